"""The layout rules, checked on the source: no import cycles, layers that import only downwards
(issue 23), only the command layer prints, no module past ~500 lines without a stated reason, and
each run-directory file name spelled in one module only (issue 13).

The import graph is read with `ast` (nothing is imported), counting imports inside functions
too: a cycle hidden in a function is still two modules that cannot be understood one at a time.
Imports under `if TYPE_CHECKING:` are left out: they never run."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("lhd_train", "lens", "rollouts")
MAX_LINES = 500
# Modules allowed past MAX_LINES, with the reason. Remove an entry when its module is split.
LONG_MODULES = {
    "lhd_train/bench/taskpack.py": "two on-disk formats (ours and the authors') validated into one model; "
                                   "splitting them would separate each format from its checks",
}
# Run-directory names (docs/formats.md) and the one module that may spell each.
RUN_DIR_NAMES = {
    '"config.resolved.yaml"': "lhd_train/rundir/layout.py",
    '"manifest.json"': "lhd_train/rundir/layout.py",
    '"auditor.json"': "lhd_train/rundir/layout.py",
    '".done"': "lhd_train/rundir/layout.py",
    '".messages.jsonl"': "lhd_train/rundir/layout.py",
    '".lock"': "lhd_train/rundir/layout.py",
}


# Layer contracts, in the style of import-linter, checked on `import_graph()`. The layers, bottom up:
# rollouts < rundir < config < the stages (bench, audit, metrics, finetune, report, ops, interop)
# < cli; `lens` stands beside lhd_train. Each package below may import, besides itself, only the
# packages listed for it (third-party packages are not checked).
MAY_IMPORT = {
    "rollouts": (),
    "lhd_train.io": ("lhd_train.errors",),
    "lhd_train.rundir": ("lhd_train.errors", "lhd_train.io", "rollouts"),
    "lhd_train.config": ("lhd_train.errors", "lhd_train.io", "lhd_train.rundir", "rollouts"),
}
# The command layer: only it imports `lhd_train.cli`, and only it prints (`print`, rich's
# `console.print`, `typer.echo`, writes to sys.stdout/stderr). Library code logs instead
# (`logging.getLogger(__name__)`); the command decides what the user sees.
COMMAND_LAYER = {
    "lhd_train/cli/": "the `lhd` command line",
    "lhd_train/boundary.py": "the one error boundary (outside cli/ so that lens's commands can use it)",
    "lens/cli.py": "the `lhd lens` / `python -m lens` commands",
    "lens/__main__.py": "`python -m lens`",
    "lhd_train/ops/vllm_probe.py": "a script run by vLLM's own python; its stdout line is its answer",
}
# Library modules that still print, each with what should replace it. Remove an entry when its
# module stops printing (the test refuses stale entries); never add one.
KNOWN_PRINTS: dict[str, str] = {}
# What lens may import from lhd_train (a parent package of an entry is allowed too: importing
# `a.b.c` runs `a/b/__init__.py`). The goal is the run directory's public API and the labels:
# SHRINK this list as lens stops reaching into internals (the test refuses entries lens no longer
# imports); never grow it without moving the thing into that public API.
LENS_API = {
    "lhd_train.api": "the public API: a run directory and its records, labels, task texts, lock, --out, --shard",
    "lhd_train.errors": "LhdError (LensError's base) and DataFileError (a bad line of a probe or corpus file)",
    "lhd_train.io.files": "the neutral file toolkit: atomic writes, JSONL, hashes (below every stage)",
    "lhd_train.io.csv_cells": "the neutral file toolkit: CSV cells that never start a formula",
    "lhd_train.io.provenance": "the neutral file toolkit: UTC timestamps of lens files",
    "lhd_train.boundary": "the one error boundary (lens/cli.py, the command layer)",
    "lhd_train.options": "typer options from a settings model, shared with lhd's CLI (lens/cli.py)",
}


def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


def _targets(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative import
        pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - node.level + 1]
        base = ".".join(pkg + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, in functions too, except those under `if TYPE_CHECKING:` (they
    never run: annotations only)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the project modules it imports, anywhere in the file. Importing `a.b.c` also
    imports the packages `a` and `a.b` (their `__init__` runs), except the importer's own."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"))):
            for target in _targets(module, path, node, modules):
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in modules and not (module == dep or module.startswith(dep + ".")):
                        deps.add(dep)
        graph[module] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None when the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        color[v] = GREY
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if color.get(w, BLACK) == GREY:
                return stack[stack.index(w):] + [w]
            if color.get(w) == WHITE and (cycle := visit(w)):
                return cycle
        stack.pop()
        color[v] = BLACK
        return None

    for v in sorted(graph):
        if color[v] == WHITE and (cycle := visit(v)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles():
    """The check below must be able to fail."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_imports_inside_functions(tmp_path):
    src, errors, init = tmp_path / "m.py", tmp_path / "errors.py", tmp_path / "__init__.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lhd_train.cli\n"
                   "def f():\n    from lhd_train.errors import InputError\n")
    errors.write_text("")
    init.write_text("")
    graph = import_graph({"pkg.m": src, "lhd_train.errors": errors, "lhd_train": init, "lhd_train.cli": errors})
    assert graph["pkg.m"] == {"lhd_train", "lhd_train.errors"}  # not lhd_train.cli: TYPE_CHECKING only


def test_no_import_cycles():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_modules_stay_short_or_say_why():
    long = {}
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES and rel not in LONG_MODULES:
            long[rel] = n
    assert not long, f"modules over {MAX_LINES} lines (split them, or list them in LONG_MODULES with a reason): {long}"
    stale = [rel for rel in LONG_MODULES if not (ROOT / rel).exists()]
    assert not stale, f"LONG_MODULES lists modules that are gone: {stale}"
    short = [rel for rel in LONG_MODULES
             if len((ROOT / rel).read_text(encoding="utf-8").splitlines()) <= MAX_LINES]
    assert not short, f"LONG_MODULES lists modules that are no longer long (drop the entry): {short}"


@pytest.mark.parametrize("literal", sorted(RUN_DIR_NAMES))
def test_each_run_dir_name_is_spelled_in_one_module(literal):
    """Stages ask `lhd_train.rundir.layout.RunDir` for a path; a second spelling of a file name is
    a second place that must change when the format does."""
    pattern = re.compile(re.escape(literal[1:]))  # `.done"`: also finds `"*.done"` and f"{x}.done"
    found = sorted({path.relative_to(ROOT).as_posix() for path in module_files().values()
                    if pattern.search(path.read_text(encoding="utf-8").replace("'", '"'))})
    assert found == [RUN_DIR_NAMES[literal]], f"{literal} is spelled in {found}"


@pytest.mark.parametrize("call", ["BpeTrainer(", "PreTrainedTokenizerFast(", "ForCausalLM(", "from_config("])
def test_one_tiny_model_builder(call):
    """Random models are built in `lhd_train/tiny_model.py` only (tests, demo, benchmarks, the GPU
    check call it): two builders drift apart, each with its own tokenizer."""
    folders = ("lhd_train", "lens", "rollouts", "tests", "benchmarks", "scripts")
    files = [p for d in folders for p in (ROOT / d).rglob("*.py")]
    found = sorted(p.relative_to(ROOT).as_posix() for p in files
                   if call in p.read_text(encoding="utf-8") and p.name != "test_layout.py")
    allowed = {"lhd_train/tiny_model.py", "lhd_train/packaged_models.py"}  # packaged: SmolLM2 from its GGUF
    assert set(found) <= allowed, f"{call} outside the one builder: {sorted(set(found) - allowed)}"


# ----------------------------------------------------------------------------- layers (issue 23)


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaches_outside(graph: dict[str, set[str]], package: str, allowed: tuple[str, ...]) -> list[str]:
    """`importer -> imported` for each import from a module of `package` to a project module that
    is neither in `package` nor in one of the `allowed` packages (nor a parent package of one: importing
    `lens.settings` runs `lens/__init__.py`)."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if in_package(m, package) for d in deps
                  if not in_package(d, package) and not any(in_package(d, a) or a.startswith(d + ".")
                                                            for a in allowed))


def importers_of(graph: dict[str, set[str]], package: str, exempt: tuple[str, ...]) -> list[str]:
    """`importer -> imported` for each import of a module of `package` by a module outside it and
    outside the `exempt` packages."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if in_package(d, package)
                  and not in_package(m, package) and not any(in_package(m, e) for e in exempt))


def lens_reaches(graph: dict[str, set[str]], api: set[str]) -> tuple[list[str], set[str]]:
    """(imports from lens into lhd_train outside `api`, the `api` entries that lens uses). A parent
    package of an `api` module counts as allowed: importing the module runs the parent's __init__."""
    bad, used = [], set()
    for m, deps in graph.items():
        if not in_package(m, "lens"):
            continue
        for d in deps:
            if not in_package(d, "lhd_train"):
                continue
            if d in api:
                used.add(d)
            elif not any(a.startswith(d + ".") for a in api):
                bad.append(f"{m} -> {d}")
    return sorted(bad), used


PRINT_ATTRIBUTES = {"print", "print_json", "print_exception", "print_exc", "print_stack", "echo", "secho"}


def print_calls(source: str) -> list[str]:
    """`line: call` for each call that writes to the terminal: `print(...)`, rich's and typer's
    (`console.print`, `rich.print`, `typer.echo`, `traceback.print_exc`, ...) and `sys.stdout/stderr.write`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        to_stream = isinstance(f, ast.Attribute) and f.attr == "write" and ast.unparse(f.value) in ("sys.stdout",
                                                                                                  "sys.stderr")
        if (isinstance(f, ast.Name) and f.id == "print") or (isinstance(f, ast.Attribute) and
                                                             f.attr in PRINT_ATTRIBUTES) or to_stream:
            found.append(f"{node.lineno}: {ast.unparse(f)}")
    return sorted(found, key=lambda s: int(s.split(":")[0]))


def _command_layer(rel: str) -> bool:
    return any(rel.startswith(p) if p.endswith("/") else rel == p for p in COMMAND_LAYER)


def test_the_layer_checks_find_a_bad_import():
    """Each check below must be able to fail: here on a small graph with one bad edge each."""
    graph = {"lhd_train.rundir.store": {"lhd_train.errors", "lhd_train.config.run", "lhd_train.config"},
             "lhd_train.config.run": {"lhd_train.rundir.store", "rollouts.spec", "lhd_train.bench.engine"},
             "lhd_train.bench.engine": {"lhd_train.cli.run"}, "lhd_train.cli.run": {"lhd_train.bench.engine"},
             "rollouts.spec": {"lens.fit"}, "lens.fit": {"lhd_train.io.files", "lhd_train.io"},
             "lens.runs": {"lhd_train.metrics.load", "lhd_train.metrics"}}
    allowed = MAY_IMPORT["lhd_train.rundir"]
    assert reaches_outside(graph, "lhd_train.rundir", allowed) == ["lhd_train.rundir.store -> lhd_train.config",
                                                                   "lhd_train.rundir.store -> lhd_train.config.run"]
    assert reaches_outside(graph, "lhd_train.config", MAY_IMPORT["lhd_train.config"]) == [
        "lhd_train.config.run -> lhd_train.bench.engine"]
    assert reaches_outside(graph, "rollouts", ()) == ["rollouts.spec -> lens.fit"]
    assert importers_of(graph, "lhd_train.cli", ("lens",)) == ["lhd_train.bench.engine -> lhd_train.cli.run"]
    assert lens_reaches(graph, {"lhd_train.io.files", "lhd_train.errors"}) == (
        ["lens.runs -> lhd_train.metrics", "lens.runs -> lhd_train.metrics.load"], {"lhd_train.io.files"})


def test_the_print_finder_finds_prints():
    source = ("import sys, rich, typer\nfrom rich.console import Console\nlog = None\n"
              "def f():\n    print('a')\n    Console().print('b')\n    rich.print('c')\n    typer.echo('d')\n"
              "    sys.stderr.write('e')\n    log.info('f')\n    open('x').write('g')\n")
    assert print_calls(source) == ["5: print", "6: Console().print", "7: rich.print", "8: typer.echo",
                                   "9: sys.stderr.write"]


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_lower_layers_import_nothing_above_them(package):
    """rundir/ (the run directory) and config/ are what every stage builds on; rollouts/ is a
    separate library. None of them may depend on a stage, the CLI or lens."""
    bad = reaches_outside(import_graph(module_files()), package, MAY_IMPORT[package])
    assert not bad, f"{package} may import only {MAY_IMPORT[package] or 'nothing of the project'}: {bad}"


def test_only_the_command_line_imports_it():
    """No stage (bench, audit, metrics, finetune, report, ops, interop, rundir, config) and no
    other library module imports `lhd_train.cli`; lens is held by LENS_API below."""
    bad = importers_of(import_graph(module_files()), "lhd_train.cli", ("lens",))
    assert not bad, f"library modules importing the CLI (move what they need below it): {bad}"


def test_lens_reaches_lhd_train_only_through_its_api():
    bad, used = lens_reaches(import_graph(module_files()), set(LENS_API))
    assert not bad, f"lens imports lhd_train modules outside LENS_API (use the public API): {bad}"
    stale = sorted(set(LENS_API) - used)
    assert not stale, f"LENS_API lists modules lens no longer imports (drop the entries): {stale}"


def test_only_the_command_layer_prints():
    """Library code logs; `lhd_train/cli/` (and COMMAND_LAYER) decides what the user sees. The
    console of `lhd_train/console.py` is the command layer's: a library module may not import it."""
    printing, console_users = {}, []
    graph = import_graph(module_files())
    for module, path in module_files().items():
        rel = path.relative_to(ROOT).as_posix()
        if _command_layer(rel):
            continue
        if calls := print_calls(path.read_text(encoding="utf-8")):
            printing[rel] = calls
        if "lhd_train.console" in graph[module]:
            console_users.append(rel)
    unknown = {rel: calls for rel, calls in printing.items() if rel not in KNOWN_PRINTS}
    assert not unknown, f"library modules that print (log instead, and print in lhd_train/cli): {unknown}"
    stale = sorted(set(KNOWN_PRINTS) - set(printing))
    assert not stale, f"KNOWN_PRINTS lists modules that no longer print (drop the entries): {stale}"
    assert set(console_users) <= set(KNOWN_PRINTS), \
        f"library modules importing lhd_train.console: {sorted(set(console_users) - set(KNOWN_PRINTS))}"


# ------------------------------------------------------------------ raw row-key lookups

def _record_keys() -> set[str]:
    """Every key a run record holds (the rows and run-level records of `lhd_train.rundir`, nested
    records included), except the two of a chat message, which many dicts share."""
    import typing

    from pydantic import BaseModel

    from lhd_train.rundir import manifest, rows

    keys: set[str] = set()
    seen: set[type] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            keys.add(field.alias or name)
            for arg in typing.get_args(field.annotation) or (field.annotation,):
                for inner in typing.get_args(arg) or (arg,):
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        walk(inner)

    for record in (rows.RoundRow, rows.AuditRow, manifest.Manifest, manifest.Summary, manifest.DoneMarker,
                   manifest.AuditorRecord):
        walk(record)
    return keys - {"role", "content"}


#: names a run record goes by in this code base (a DataFrame column or a chat message is not one)
RECORD_NAMES = re.compile(r"^(row|rows|rr|manifest|marker|performer|perf|supervisor|sup)$")


def row_key_lookups(source: str, keys: set[str]) -> list[str]:
    """`line: name["key"]` / `name.get("key")` for each lookup (a read, not a write into a dict
    being built) of a record key on a variable named like a run record: the dict access the typed
    records replace (attributes instead). Names, not types, say what a variable holds here; the
    type checker covers the rest (a record is not subscriptable)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        base = key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.ctx, ast.Load):
            base, key = node.value, node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args
              and node.func.attr in ("get", "pop", "setdefault") and isinstance(node.args[0], ast.Constant)):
            base, key = node.func.value, node.args[0].value
        while isinstance(base, ast.Subscript):  # rows[0]["x"], row["a"]["b"]
            base = base.value
        name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if isinstance(key, str) and key in keys and name and RECORD_NAMES.match(name):
            found.append(f"{node.lineno}: {name}[{key!r}]")
    return found


def test_the_row_key_counter_counts():
    keys = _record_keys()
    src = 'a = row["performer"]["text"]\nb = rows[0].get("global_round")\nc = df["global_round"]\nd = m["content"]\n'
    assert sorted(row_key_lookups(src, keys)) == ["1: row['performer']", "1: row['text']", "2: rows['global_round']"]


def test_no_raw_row_key_lookups_outside_rundir():
    """Stages read run records as models (`row.performer.text`), not dicts (issue 23)."""
    keys = _record_keys()
    found = []
    for module, path in module_files().items():
        if in_package(module, "lhd_train.rundir"):
            continue
        found += [f"{path.relative_to(ROOT)}:{hit}" for hit in row_key_lookups(path.read_text(encoding="utf-8"), keys)]
    assert found == [], f"{len(found)} raw row-key lookups outside rundir/:\n" + "\n".join(found)


def test_test_module_names_are_unique():
    """tests/conftest.py puts every test folder on the path, so two test files with one basename
    shadow each other (pytest stops at collection: 'import file mismatch')."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name not in ("__init__.py", "conftest.py") and "data" not in path.relative_to(ROOT / "tests").parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one): {clashes}"
