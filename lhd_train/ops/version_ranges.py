"""The installed versions of lhd's dependencies against the ranges lhd declares (pyproject.toml).

Why: on a node image lhd runs from its checkout (PYTHONPATH) next to whatever torch, transformers
and friends the image has, so pip never compared them with lhd's ranges. The device check starts
with this comparison and fails on a version outside them, naming the range (issue 30, item 5).
The ranges are read from the checkout's pyproject.toml, else from the installed lhd's metadata.
"""
from __future__ import annotations

import importlib.metadata as md
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the distributions the device check imports (the CLI's own, typer and rich, come with it)
CHECKED = ("torch", "transformers", "tokenizers", "peft", "trl", "accelerate", "datasets", "safetensors",
           "xgrammar", "pydantic", "pyarrow", "pandas", "numpy", "bitsandbytes", "typer", "rich", "pyyaml")


def declared(extras: tuple[str, ...] = ("qlora",)) -> dict[str, str]:
    """distribution (normalised) -> its specifier, from the dependencies and the given extras."""
    reqs: list[str] = []
    pyproject = ROOT / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        reqs = list(project["dependencies"])
        for extra in extras:
            reqs += project.get("optional-dependencies", {}).get(extra, [])
    else:
        for r in md.requires("lhd") or []:
            marker = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", r)
            if marker is None or marker.group(1) in extras:
                reqs.append(r.split(";")[0])
    from packaging.requirements import Requirement

    return {_norm(Requirement(r).name): str(Requirement(r).specifier) for r in reqs}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def range_report(names: tuple[str, ...] = CHECKED) -> list[tuple[str, str | None, str, bool]]:
    """(distribution, installed version or None, lhd's range, within it) for each of `names` that lhd
    declares. A local label (2.11.0+cu130) is compared without it, as pip does for `>=` and `<`."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    ranges = declared()
    out = []
    for name in names:
        spec = ranges.get(_norm(name))
        if spec is None:
            continue
        version = _installed(name)
        ok = version is not None and SpecifierSet(spec).contains(Version(version).public, prereleases=True)
        out.append((name, version, spec, ok))
    return out
