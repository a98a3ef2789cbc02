"""The layout rules, checked on the source: the import contracts of pyproject.toml's
[tool.importlinter] (no import cycles, layers that import only downwards, lens through its API:
issue 23), only the command layer prints, no module past ~500 lines without a stated reason, each
run-directory file name spelled in one module only (issue 13), and no raw row-key lookups.

The import graph is grimp's (import-linter's; nothing is imported), counting imports inside
functions too: a cycle hidden in a function is still two modules that cannot be understood one at
a time. Imports under `if TYPE_CHECKING:` are left out: they never run."""
from __future__ import annotations

import ast
import copy
import functools
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
def module_files() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


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


# ----------------------------------------------------------------------------- import contracts


@functools.cache
def import_contracts() -> dict:
    """id -> each contract of pyproject.toml's [tool.importlinter], as import-linter's contract object."""
    from importlinter.api import read_configuration
    from importlinter.contracts.acyclic_siblings import AcyclicSiblingsContract
    from importlinter.contracts.forbidden import ForbiddenContract
    from importlinter.contracts.layers import LayersContract

    types = {"layers": LayersContract, "forbidden": ForbiddenContract, "acyclic_siblings": AcyclicSiblingsContract}
    config = read_configuration(str(ROOT / "pyproject.toml"))
    return {o["id"]: types[o["type"]](name=o["name"], session_options=config["session_options"], contract_options=o)
            for o in config["contracts_options"]}


@functools.cache
def project_graph():
    """The import graph of lhd_train, lens and rollouts, as `lint-imports` builds it."""
    import grimp

    return grimp.build_graph(*PACKAGES, exclude_type_checking_imports=True, cache_dir=None)


def broken_contracts(add: tuple[tuple[str, str], ...] = (), remove: tuple[tuple[str, str], ...] = ()) -> list[str]:
    """The ids of the contracts the project breaks, with the imports `add` added and `remove` removed."""
    graph = copy.deepcopy(project_graph())
    for importer, imported in add:
        graph.add_import(importer=importer, imported=imported)
    for importer, imported in remove:
        graph.remove_import(importer=importer, imported=imported)
    return [i for i, c in import_contracts().items() if not c.check(copy.deepcopy(graph), verbose=False).kept]


def test_the_import_contracts_hold():
    assert broken_contracts() == [], "`lint-imports --contract ID` shows the imports that break them"


LAYERS, ROLLOUTS, BASE_NO_LENS, BASE_NO_BACKEND = "layers", "rollouts-alone", "base-no-lens", "base-no-backend"
LENS_API, API_NO_LENS, CYCLES = "lens-api", "api-no-lens", "no-cycles"


@pytest.mark.parametrize(("importer", "imported", "broken"), [
    ("lhd_train.rundir.store", "lhd_train.config.run", [LAYERS, CYCLES]),  # upwards, and config imports rundir
    ("lhd_train.bench.engine", "lhd_train.cli.run", [LAYERS, CYCLES]),  # only the command line imports it
    ("lhd_train.errors", "lhd_train.io.files", [LAYERS, CYCLES]),  # io imports errors
    ("rollouts.spec", "lhd_train.errors", [ROLLOUTS]),
    ("lhd_train.config.run", "lens.fit", [BASE_NO_LENS, API_NO_LENS]),  # lhd_train.api reaches config.run
    ("lhd_train.io.files", "rollouts.spec", [BASE_NO_BACKEND]),
    ("lens.fit", "lhd_train.metrics.load", [LENS_API]),
    ("lhd_train.metrics.labels", "lens.fit", [API_NO_LENS]),  # lhd_train.api imports metrics.labels
    ("lhd_train.metrics.labels", "lens.runs", [API_NO_LENS]),  # a cycle through both: lens.runs imports the API
    ("lhd_train.metrics.core", "lhd_train.report.tables", [CYCLES]),  # report imports metrics
    ("rollouts.spec", "rollouts.factory", [CYCLES]),  # factory imports spec
])
def test_each_import_contract_can_fail(importer, imported, broken):
    """One bad import each, added to the project's graph, breaks the contracts named."""
    graph = project_graph()
    assert not graph.direct_import_exists(importer=importer, imported=imported), "not a bad import today"
    assert importer in graph.modules and imported in graph.modules
    assert sorted(broken_contracts(add=((importer, imported),))) == sorted(broken)


def test_a_stale_lens_api_entry_is_refused():
    """An entry of the lens API that lens no longer imports fails the check (shrink the list)."""
    graph = project_graph()
    users = [(m, "lhd_train.api") for m in graph.find_modules_that_directly_import("lhd_train.api")
             if m.startswith("lens")]
    assert users
    from importlinter.domain.helpers import MissingImport

    with pytest.raises(MissingImport, match="No matches for ignored import lens.\\*\\* -> lhd_train.api"):
        broken_contracts(remove=tuple(users))


def test_the_graph_counts_imports_in_functions_not_under_type_checking(tmp_path, monkeypatch):
    import grimp

    pkg = tmp_path / "layoutpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "b.py").write_text("")
    (pkg / "c.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import layoutpkg.c\n"
                              "def f():\n    from layoutpkg import b\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("layoutpkg", exclude_type_checking_imports=True, cache_dir=None)
    assert graph.find_modules_directly_imported_by("layoutpkg.a") == {"layoutpkg.b"}


# ----------------------------------------------------------------------------- prints

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


def test_the_print_finder_finds_prints():
    source = ("import sys, rich, typer\nfrom rich.console import Console\nlog = None\n"
              "def f():\n    print('a')\n    Console().print('b')\n    rich.print('c')\n    typer.echo('d')\n"
              "    sys.stderr.write('e')\n    log.info('f')\n    open('x').write('g')\n")
    assert print_calls(source) == ["5: print", "6: Console().print", "7: rich.print", "8: typer.echo",
                                   "9: sys.stderr.write"]


def test_only_the_command_layer_prints():
    """Library code logs; `lhd_train/cli/` (and COMMAND_LAYER) decides what the user sees. The
    console of `lhd_train/console.py` is the command layer's: a library module may not import it."""
    printing, console_users = {}, []
    graph = project_graph()
    for module, path in module_files().items():
        rel = path.relative_to(ROOT).as_posix()
        if _command_layer(rel):
            continue
        if calls := print_calls(path.read_text(encoding="utf-8")):
            printing[rel] = calls
        if "lhd_train.console" in graph.find_modules_directly_imported_by(module):
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
        if module.startswith("lhd_train.rundir"):
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
