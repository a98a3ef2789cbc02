"""Issue 31, item 5 (demo): the README says what `scripts/demo.py` builds.

Before: the README said the demo "builds best-of-2 SFT data" while the demo ran `lhd data bon
--n 1`, which samples one answer per context and prints "best-of-1". The number of samples in the
demo's data step, the README's sentence and the demo's own account of what it cut must agree."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _demo():
    spec = importlib.util.spec_from_file_location("demo_script", ROOT / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_readme_names_the_demos_best_of_n():
    demo = _demo()
    args = demo.SMOLLM2.data_args
    assert args[0] == "bon"
    n = int(args[args.index("--n") + 1])
    assert n >= 2, "best-of-1 is not a choice among samples"
    readme = (ROOT / "README.md").read_text()
    said = re.findall(r"best-of-(\d+) SFT data", readme)
    assert said == [str(n)], said
    assert f"original + {n} samples" in demo.SMOLLM2.cut, demo.SMOLLM2.cut
