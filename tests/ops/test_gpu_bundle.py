"""scripts/build_gpu_bundle.py (issue 30, item 5): the packages lhd needs that the lent GPU image lacks,
as one archive under the carry limit, which put first on PYTHONPATH shadows the installed copies.

Built here for this machine's Python (the image's is 3.12; the wheels differ only in their compiled
parts): the archive is under 60 MiB, every bundled package imports from the unpacked folder (not from
the environment's own copy), at the pinned version, in a fresh interpreter, and the slimming left no
library a bundled package loads at import. Needs PyPI (pip download); skipped without it."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("build_gpu_bundle", ROOT / "scripts" / "build_gpu_bundle.py")
bundle = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bundle)


def test_the_bundle_list_is_pinned_and_slimming_keeps_the_images_cuda_library(tmp_path):
    versions = bundle.pins()
    missing = [n for n in bundle.PACKAGES if n.lower().replace("_", "-") not in versions]
    assert not missing, f"not pinned in constraints.txt: {missing}"
    site = tmp_path / "site"
    for rel in ("bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cuda128.so",
                "bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_rocm72.so",
                "pyarrow/tests/t.py", "pyarrow/libarrow_flight.so.2600", "pyarrow/lib.so", "pandas/tests/x.py",
                "pandas/core/frame.py"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("x")
    removed = bundle.slim(site, "130")
    left = sorted(p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file())
    assert left == ["bitsandbytes/libbitsandbytes_cpu.so", "bitsandbytes/libbitsandbytes_cuda130.so",
                    "pandas/core/frame.py", "pyarrow/lib.so"], (left, removed)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_bundle_fits_the_carry_limit_and_imports_cleanly(tmp_path):
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    try:
        manifest = bundle.build(tmp_path / "gpu", python=python, cuda="130", limit_mib=60.0)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"pip download failed (no PyPI here?): {e}")
    archive = Path(manifest["archive"])
    assert archive.stat().st_size < 60 * 2**20, manifest["archive_mib"]
    site = tmp_path / "unpacked"
    site.mkdir()
    with tarfile.open(archive) as tar:  # what the device's install line does
        tar.extractall(site, filter="tar")
    assert json.loads((site / "lhd-bundle.json").read_text())["packages"].keys() == bundle.PACKAGES.keys()
    code = ("import importlib, importlib.metadata as md, json, sys\n"
            "site, wanted = sys.argv[1], json.loads(sys.argv[2])\n"
            "out = {}\n"
            "for dist, (mod, version) in wanted.items():\n"
            "    m = importlib.import_module(mod)\n"
            "    out[dist] = [str(m.__file__).startswith(site), md.version(dist) == version]\n"
            "print(json.dumps(out))\n")
    wanted = {d: [p["import"], p["version"]] for d, p in manifest["packages"].items() if p["import"]}
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code, str(site), json.dumps(wanted)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert {d: v for d, v in seen.items() if v != [True, True]} == {}, seen
    # lhd's own modules that need the bundle import with it in front (datasets/pyarrow, trl, xgrammar)
    lhd = "import lhd_train.finetune.trainer, rollouts.hf, lens.fit, trl, xgrammar"
    r = subprocess.run([sys.executable, "-c", lhd], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the device check's own install line, through scripts/gpu_check.sh, then its version test
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site-by-script"),
           "GPU_CHECK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(archive), "--", "-k", "test_versions"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and "first on PYTHONPATH" in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    line = next(x for x in r.stdout.splitlines() if x.startswith("CHECK versions:"))
    assert ": PASS " in line and f"trl {manifest['packages']['trl']['version']}" in line, line


CHECK = re.compile(r"^CHECK ([a-z0-9_]+): (PASS|FAIL|SKIP) .*\[\d+\.\d s\]$")


def test_the_check_script_runs_the_device_tests_and_prints_one_line_each(tmp_path):
    """scripts/gpu_check.sh runs tests/gpu with pytest: on CPU (GPU_CHECK_DEVICE=cpu) the CPU forms, one
    CHECK line per test as it finishes; a version outside lhd's ranges would FAIL the first line."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": ""}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--", "-k", "test_versions or test_env"],
                       capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    lines = [x for x in r.stdout.splitlines() if x.startswith("CHECK ")]
    assert [CHECK.match(x).groups() for x in lines] == [("versions", "PASS"), ("env", "PASS")], r.stdout
    assert "CHECK versions: PASS Python " in lines[0] and " torch " in lines[0] and "device cpu; torch " in lines[1]
    assert re.search(r"^2 passed, \d+ deselected", r.stdout.splitlines()[-1]), r.stdout[-500:]


# The lent image's packages (docs/gpu.md) and those their own requirements bring (torch: jinja2, sympy,
# networkx, filelock, fsspec; transformers and huggingface_hub: pyyaml, tqdm, regex, requests, packaging).
IMAGE = {"torch", "transformers", "accelerate", "numpy", "safetensors", "tokenizers", "huggingface_hub", "jinja2",
         "sympy", "networkx", "filelock", "fsspec", "yaml", "tqdm", "regex", "requests", "packaging", "psutil"}


def device_test_imports() -> set[str]:
    """The lhd, lens and rollouts modules tests/gpu imports (at module level or inside a test)."""
    import ast

    found = set()
    for path in (ROOT / "tests" / "gpu").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found |= {n for n in names if n.split(".")[0] in ("lhd_train", "lens", "rollouts")}
    return found


def test_the_device_tests_need_only_the_image_and_the_bundle():
    """Every third-party package the device tests' lhd modules reach (imports in functions included)
    is on the image or in the bundle: a new dependency of that code must join `PACKAGES`, or the
    check fails on the lent machine with an ImportError after its start-up."""
    import grimp

    graph = grimp.build_graph("lhd_train", "lens", "rollouts", include_external_packages=True,
                              exclude_type_checking_imports=True, cache_dir=None)
    starts = device_test_imports()
    assert {"lhd_train.finetune.trainer", "lens.fit", "rollouts.hf"} <= starts
    reached = {m.split(".")[0] for s in starts for m in graph.find_upstream_modules(s) | {s}}
    external = reached - {"lhd_train", "lens", "rollouts"} - set(sys.stdlib_module_names)
    assert {"trl", "xgrammar", "torch"} <= external  # the walk sees past lhd's own modules
    bundled = {imp.split(".")[0] for imp in bundle.PACKAGES.values() if imp}
    assert sorted(external - IMAGE - bundled) == []
