"""The layout rules of issue 13, checked on the source: no import cycles, no module past ~500 lines
without a stated reason, and each run-directory file name spelled in one module only.

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
