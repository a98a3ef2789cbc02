"""The layout rules, checked on the source: the import contracts of pyproject.toml's
[tool.importlinter] (no import cycles, layers that import only downwards, a lens library that
imports nothing of lhd_train: issues 23, 37), only the command layer prints, no module past ~500
lines without a stated reason, each run-directory file name spelled in one module only (issue 13),
and no raw row-key lookups.

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
PACKAGES = ("lhd_train", "lens", "rollouts", "filekit")
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
    "lhd_train/cli/boundary.py": "the one error boundary (`report_error` prints the one `error:` line)",
    "rollouts/vllm/probe.py": "a script run by vLLM's own python; its stdout line is its answer",
}
# Library modules that still print, each with what should replace it. Remove an entry when its
# module stops printing (the test refuses stale entries); never add one.
KNOWN_PRINTS: dict[str, str] = {}
# Third-party packages lens may not import: it is a torch and transformers library, and its command
# line is lhd's (`lhd_train/cli/lens.py`, options in `lhd_train/cli/lens_options.py`).
LENS_NEVER_IMPORTS = ("typer", "click", "rich")


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
LENS_ALONE, CYCLES, FILEKIT_ALONE = "lens-alone", "no-cycles", "filekit-alone"


@pytest.mark.parametrize(("importer", "imported", "broken"), [
    ("lhd_train.rundir.store", "lhd_train.config.run", [LAYERS, CYCLES]),  # upwards, and config imports rundir
    ("lhd_train.bench.engine", "lhd_train.cli.run", [LAYERS, CYCLES]),  # only the command line imports it
    ("lhd_train.errors", "lhd_train.io.files", [LAYERS, CYCLES]),  # io imports errors
    ("lhd_train.metrics.core", "lhd_train.ops.status", [LAYERS, CYCLES]),  # passed the layers before (a bag)
    ("lhd_train.bench.engine", "lhd_train.metrics.core", [LAYERS]),  # siblings on one floor stay apart
    ("rollouts.spec", "lhd_train.errors", [ROLLOUTS, LENS_ALONE]),  # lens imports rollouts: it would load lhd_train
    ("lhd_train.config.run", "lens.fit", [BASE_NO_LENS]),
    ("lhd_train.io.files", "rollouts.spec", [BASE_NO_BACKEND]),
    ("lens.fit", "lhd_train.io.files", [LENS_ALONE]),
    ("filekit", "lens.errors", [FILEKIT_ALONE, BASE_NO_LENS]),  # lhd_train.io imports filekit: it would load lens
    ("lens.readout", "lhd_train.reading.runs", [LENS_ALONE, LAYERS]),  # and entitle would reach reading
    ("lhd_train.metrics.core", "lhd_train.report.tables", [LAYERS, CYCLES]),  # report imports metrics
    ("rollouts.spec", "rollouts.backends", [CYCLES]),  # the registry imports spec
])
def test_each_import_contract_can_fail(importer, imported, broken):
    """One bad import each, added to the project's graph, breaks the contracts named."""
    graph = project_graph()
    assert not graph.direct_import_exists(importer=importer, imported=imported), "not a bad import today"
    assert importer in graph.modules and imported in graph.modules
    assert sorted(broken_contracts(add=((importer, imported),))) == sorted(broken)


def layer_groups() -> list[list[str]]:
    """The floors of the `layers` contract, top first, each a list of sibling packages."""
    layers = next(o for o in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["tool"]
                  ["importlinter"]["contracts"] if o["id"] == LAYERS)["layers"]
    return [[s.strip() for s in re.split(r"[|:]", floor)] for floor in layers]


def test_the_layers_are_spelled_out():
    """No floor holds more than 4 siblings, and siblings on a floor are independent (`|`, not `:`)."""
    raw = next(o for o in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["tool"]
               ["importlinter"]["contracts"] if o["id"] == LAYERS)["layers"]
    assert all(":" not in floor for floor in raw), raw
    assert max(len(g) for g in layer_groups()) <= 4, layer_groups()


@pytest.mark.parametrize("floor", range(1, 13))
def test_each_floor_may_not_import_the_one_above(floor):
    """A package importing any package of the floor just above it breaks the `layers` contract: the
    stages are ordered, not a bag of siblings (aesthetics-5 §2.3: `metrics -> ops` passed before)."""
    groups = layer_groups()
    assert len(groups) == 13
    lower, upper = groups[floor][-1], groups[floor - 1][0]
    assert LAYERS in broken_contracts(add=((f"lhd_train.{lower}", f"lhd_train.{upper}"),))


def test_importing_lens_loads_nothing_of_lhd_train():
    """`import lens` and every module of the library load no module of lhd_train, whatever the import graph
    says."""
    import subprocess
    import sys

    code = ("import pkgutil, importlib, sys, lens\n"
            "for m in pkgutil.iter_modules(lens.__path__, 'lens.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(len([m for m in sys.modules if m.startswith('lens.')]),"
            " sorted(m for m in sys.modules if m.split('.')[0] == 'lhd_train'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    n, loaded = out.split(" ", 1)
    assert int(n) >= 25 and loaded.strip() == "[]", out


def test_the_lens_alone_contract_has_no_exceptions():
    """Every application module left lens/ (probes and the experiment reader live in lhd_train/reading/), so the
    `lens-alone` contract ignores no import: one added back would have to be argued for here."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    [lens_alone] = [c for c in contracts if c["id"] == LENS_ALONE]
    assert "ignore_imports" not in lens_alone


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


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


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


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the absolute imports of `source` (TYPE_CHECKING imports left out)."""
    tops = set()
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_lens_is_a_torch_and_transformers_library():
    """No command-line framework in lens/: its commands and their options live in lhd_train."""
    assert third_party_imports("import typer\nfrom rich import print\nimport torch.nn\nfrom . import x\n") == {
        "typer", "rich", "torch"}
    found = {f"{path.relative_to(ROOT)}: {name}" for module, path in module_files().items()
             if in_package(module, "lens") for name in third_party_imports(path.read_text(encoding="utf-8"))
             if name in LENS_NEVER_IMPORTS}
    assert not found, f"lens imports a command-line framework: {sorted(found)}"


# ------------------------------------------------------------------ readouts (issue 32)

def readout_names() -> set[str]:
    from lens.readout import READOUTS
    from lens.readout_probe import PROBE

    return set(READOUTS) | {PROBE}


def readout_name_lookups(source: str, names: set[str]) -> list[str]:
    """`line: code` for each place that chooses behaviour by a readout's name spelled as a string literal:
    a comparison (`name == "logit"`, `name in ("jacobian", ...)`), `x.startswith/endswith/isin("...")`, or
    a lookup `readouts["logit"]` / `.get("logit")`."""
    def named(node: ast.AST) -> bool:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(e, ast.Constant) and e.value in names for e in elts)

    found = []
    for node in ast.walk(ast.parse(source)):
        hit = False
        if isinstance(node, ast.Compare):
            hit = any(named(x) for x in (node.left, *node.comparators))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = node.func.attr in ("startswith", "endswith", "isin", "get") and bool(node.args) and \
                named(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            hit = isinstance(node.slice, ast.Constant) and node.slice.value in names
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_readout_name_finder_finds_names():
    src = ('if name != "logit":\n    pass\nx = ro.name in ("jacobian", "other")\ny = readouts["jacobian_random"]\n'
           'z = n.startswith("probe")\nw = d.get("logit")\nok = name == PRIMARY\nkeep = {"logit": 1}["x"]\n'
           'row = r["kl_logit"]\nLiteral["jacobian", "logit"]\n')
    assert readout_name_lookups(src, {"logit", "jacobian", "jacobian_random", "probe"}) == [
        "1: name != 'logit'", "3: ro.name in ('jacobian', 'other')", "4: readouts['jacobian_random']",
        "5: n.startswith('probe')", "6: d.get('logit')"]


def test_only_the_readout_modules_name_readouts():
    """Evaluation, reading, tables and plots iterate the readouts of `lens.readout.READOUTS`; a readout's
    name is spelled (to choose what it does) only in lens/readout*.py, so a new readout is one class and one
    registry entry there."""
    names = readout_names()
    found = []
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        if re.fullmatch(r"lens/readout\w*\.py", rel):
            continue
        found += [f"{rel}:{hit}" for hit in readout_name_lookups(path.read_text(encoding="utf-8"), names)]
    assert found == [], "readouts chosen by name outside lens/readout*.py:\n" + "\n".join(found)


def test_the_command_line_offers_the_registered_readouts():
    """`--primary-readout` lists readouts the registry knows (the choice is declared with the other options)."""
    import typing

    from lhd_train.cli.lens_options import ReadCommand

    choices = set(typing.get_args(ReadCommand.model_fields["primary_readout"].annotation))
    assert choices and choices <= readout_names(), choices - readout_names()


def test_only_the_command_layer_prints():
    """Library code logs; `lhd_train/cli/` (and COMMAND_LAYER) decides what the user sees. The
    console of `lhd_train/cli/console.py` is the command layer's: a library module may not import it."""
    printing, console_users = {}, []
    graph = project_graph()
    for module, path in module_files().items():
        rel = path.relative_to(ROOT).as_posix()
        if _command_layer(rel):
            continue
        if calls := print_calls(path.read_text(encoding="utf-8")):
            printing[rel] = calls
        if "lhd_train.cli.console" in graph.find_modules_directly_imported_by(module):
            console_users.append(rel)
    unknown = {rel: calls for rel, calls in printing.items() if rel not in KNOWN_PRINTS}
    assert not unknown, f"library modules that print (log instead, and print in lhd_train/cli): {unknown}"
    stale = sorted(set(KNOWN_PRINTS) - set(printing))
    assert not stale, f"KNOWN_PRINTS lists modules that no longer print (drop the entries): {stale}"
    assert set(console_users) <= set(KNOWN_PRINTS), \
        f"library modules importing lhd_train.cli.console: {sorted(set(console_users) - set(KNOWN_PRINTS))}"


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


# ------------------------------------------------------------------ the algorithm seam (issue 32)

#: the one module that names training algorithms; everything else asks its table or the recipe's section
ALGO_TABLE = "lhd_train/config/algos.py"


def _names_an_algo(node: ast.AST) -> bool:
    """`algo`, `recipe.algo`, `v["algo"]`, `self.algorithm`: an expression that holds an algorithm's name."""
    if isinstance(node, ast.Name):
        return "algo" in node.id.lower()
    if isinstance(node, ast.Attribute):
        return "algo" in node.attr.lower()
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return "algo" in str(node.slice.value).lower()
    return False


def _string_literals(node: ast.AST) -> list[str]:
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return [e.value for e in items if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def algo_name_comparisons(source: str) -> list[str]:
    """`line: code` for each comparison of an algorithm's name with string literals (`algo == "grpo"`,
    `recipe.algo != "sft"`, `v["algo"] in ("sft", "dpo")`): behaviour chosen by spelling a name,
    which the algorithm's table entry (`config.algos.ALGOS`) or its recipe section should own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if any(_names_an_algo(o) for o in operands) and any(_string_literals(o) for o in operands):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_algo_comparison_finder_finds_them():
    source = ('if recipe.algo == "grpo":\n    pass\nok = algo in ("sft", "dpo")\nbad = v["algo"] != "kto"\n'
              'kind = v["kind"] == "dpo"\nsame = algo == other\nonline = ALGOS[algo].online\n'
              'name = recipe.algo\nx = "sft" == algorithm\n')
    assert algo_name_comparisons(source) == ["1: recipe.algo == 'grpo'", "3: algo in ('sft', 'dpo')",
                                             "4: v['algo'] != 'kto'", "9: 'sft' == algorithm"]


def test_no_module_compares_an_algorithm_name_outside_the_table():
    """Adding a TRL algorithm is one entry in `config/algos.py` plus recipes (issue 32): no other
    module may choose behaviour by an algorithm's name."""
    found = []
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        if rel != ALGO_TABLE:
            found += [f"{rel}:{hit}" for hit in algo_name_comparisons(path.read_text(encoding="utf-8"))]
    assert found == [], f"{len(found)} algorithm-name comparisons outside {ALGO_TABLE}:\n" + "\n".join(found)


def section_by_name(source: str, names: set[str]) -> list[str]:
    """`line: code` for each algorithm section read by its name (`recipe.grpo`, `getattr(r, "sft")`):
    the online path found by attribute, which `recipe.section` and its type own (issue 37, item 5)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_no_module_reads_an_algorithm_section_by_its_name():
    from lhd_train.config.algos import ALGOS

    names = {name for name, algo in ALGOS.items() if algo.section is not None}
    assert section_by_name('a = recipe.grpo.rewards\nb = getattr(r, "sft", None)\nc = recipe.section\n', names) \
        == ["1: recipe.grpo", "2: getattr(r, 'sft', None)"]
    found = []
    for path in module_files().values():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{hit}" for hit in section_by_name(path.read_text(encoding="utf-8"), names)]
    assert found == [], "sections read by name (use recipe.section and its type):\n" + "\n".join(found)


# ------------------------------------------------------------------ the backend seam (issue 32)

def backend_name_choices(source: str, names: set[str]) -> list[str]:
    """`line: code` for each place that chooses behaviour by a backend's name: a comparison (`==`,
    `!=`, `in`, `not in`) with a backend name or with a tuple/list/set holding one, a `.backend`
    (or a variable `backend`) compared with a string, and a `match` case on a backend name."""
    def is_name(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    def holds_name(node: ast.AST) -> bool:
        return is_name(node) or (isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(is_name, node.elts)))

    def is_backend(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "backend") or (
            isinstance(node, ast.Name) and node.id == "backend")

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            strings = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            if any(map(holds_name, sides)) or (any(map(is_backend, sides)) and strings):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.match_case):
            if any(isinstance(p, ast.MatchValue) and is_name(p.value) for p in ast.walk(node.pattern)):
                found.append(f"{node.pattern.lineno}: case {ast.unparse(node.pattern)}")
    return found


def test_the_backend_name_finder_finds_choices():
    names = {"hf", "vllm", "openai"}
    source = ('if spec.backend == "vllm":\n    pass\n'
              'managed = spec.backend in ("vllm", "transformers-serve")\n'
              'x = "hf" != kind\n'
              'y = backend != "anything"\n'
              'match spec.backend:\n    case "openai":\n        pass\n    case _:\n        pass\n'
              'ok = spec.managed and name == "deepspeed" and version("vllm")\n')
    assert backend_name_choices(source, names) == [
        "1: spec.backend == 'vllm'", "3: spec.backend in ('vllm', 'transformers-serve')", "4: 'hf' != kind",
        "5: backend != 'anything'", "7: case 'openai'"]


def test_no_module_outside_rollouts_chooses_by_backend_name():
    """Behaviour that differs by backend lives in its spec class (rollouts/spec.py and one module per
    backend); everything else asks the spec (`spec.managed`, `spec.gpu_claim(...)`, `spec.build()`),
    so adding a backend is a module and one line in `rollouts.backends.BACKENDS`."""
    from rollouts.backends import BACKENDS

    found = []
    for module, path in module_files().items():
        if in_package(module, "rollouts"):
            continue
        found += [f"{path.relative_to(ROOT)}:{hit}"
                  for hit in backend_name_choices(path.read_text(encoding="utf-8"), set(BACKENDS))]
    assert found == [], f"{len(found)} choices by backend name outside rollouts/:\n" + "\n".join(found)
