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
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
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
@pytest.mark.timeout(2400)
def test_the_bundle_fits_the_carry_limit_and_trains_from_its_site(tmp_path):
    """The archive is alone in the folder a device call carries; unpacked under a `site-packages`
    path (the device's install line, through scripts/gpu_check.sh), every bundled package imports
    from it at its pin, a `Dataset` is built (dill pickles pyarrow by reference only there) and TRL
    trains one SFT step on CPU (the device check's `trl_lora_sft`, CPU form)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    tag = python.replace(".", "")
    out, work = tmp_path / "gpu", tmp_path / "gpu-work"
    try:  # the download folder is only a cache (pip download skips wheels already there)
        manifest = bundle.build(out, python=python, cuda="130", limit_mib=60.0, preset=1, work=work,
                                wheels=ROOT / "build" / "gpu-work" / f"wheels-py{tag}")
    except subprocess.CalledProcessError as e:
        pytest.skip(f"pip download failed (no PyPI here?): {e}")
    archive = Path(manifest["archive"])
    assert sorted(p.name for p in out.iterdir()) == [archive.name]  # what `carry` sends: the archive only
    assert archive.stat().st_size < 60 * 2**20, manifest["archive_mib"]
    site = tmp_path / "unpacked" / "site-packages"
    site.mkdir(parents=True)
    with tarfile.open(archive) as tar:  # what the device's install line does
        tar.extractall(site, filter="tar")
    assert json.loads((site / "lhd-bundle.json").read_text())["packages"].keys() == bundle.PACKAGES.keys()
    code = ("import importlib, importlib.metadata as md, json, sys\n"
            "site, wanted = sys.argv[1], json.loads(sys.argv[2])\n"
            "out = {}\n"
            "for dist, (mod, version) in wanted.items():\n"
            "    m = importlib.import_module(mod)\n"
            "    out[dist] = [str(m.__file__).startswith(site), md.version(dist) == version]\n"
            "import datasets\n"  # dill fingerprints the table: PicklingError outside a site-packages path
            "out['rows'] = datasets.Dataset.from_list([{'text': 'a'}, {'text': 'b'}]).num_rows\n"
            "print(json.dumps(out))\n")
    wanted = {d: [p["import"], p["version"]] for d, p in manifest["packages"].items() if p["import"]}
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "TVM_FFI_DISABLE_TORCH_C_DLPACK": "1",
           "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, "-c", code, str(site), json.dumps(wanted)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen.pop("rows") == 2
    assert {d: v for d, v in seen.items() if v != [True, True]} == {}, seen
    # lhd's own modules that need the bundle import with it in front (datasets/pyarrow, trl, xgrammar)
    lhd = "import lhd_train.finetune.trainer, rollouts.hf, lens.fit, trl, xgrammar"
    r = subprocess.run([sys.executable, "-c", lhd], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # the device check's own install line (its default site folder's name holds `site-packages`), through
    # scripts/gpu_check.sh: versions first, then one TRL SFT step on CPU from the unpacked bundle
    assert "site-packages" in re.search(r'SITE="\$\{GPU_CHECK_SITE:-([^}]+)\}"', GPU_CHECK.read_text())[1]
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "by-script" / "site-packages"),
           "GPU_CHECK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": ""}
    r = subprocess.run(["bash", str(GPU_CHECK), str(archive), "--", "-k", "test_trl_lora_sft or test_versions"],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0 and "first on PYTHONPATH" in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    checks = [x for x in r.stdout.splitlines() if x.startswith("CHECK ")]
    assert [c.split(":")[0] for c in checks] == ["CHECK versions", "CHECK trl_lora_sft"], r.stdout[-2000:]
    assert ": PASS " in checks[0] and f"trl {manifest['packages']['trl']['version']}" in checks[0], checks[0]
    assert ": PASS " in checks[1], checks[1]


CHECK = re.compile(r"^CHECK ([a-z0-9_]+): (PASS|FAIL|SKIP) .*\[\d+\.\d s\]$")


@pytest.mark.model  # runs scripts/gpu_check.sh's python in a subprocess
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
            found |= {n for n in names if n.split(".")[0] in ("lhd_train", "lens", "rollouts", "filekit")}
    return found


def test_the_device_tests_need_only_the_image_and_the_bundle():
    """Every third-party package the device tests' lhd modules reach (imports in functions included)
    is on the image or in the bundle: a new dependency of that code must join `PACKAGES`, or the
    check fails on the lent machine with an ImportError after its start-up."""
    import grimp

    graph = grimp.build_graph("lhd_train", "lens", "rollouts", "filekit", include_external_packages=True,
                              exclude_type_checking_imports=True, cache_dir=None)
    # GRPO's generation on a vLLM server (grpo.vllm_server: openai/httpx through rollouts' managed servers)
    # is imported by the trainer only for such a recipe, which no device test uses
    graph.remove_module("lhd_train.finetune.vllm_rollout")
    starts = device_test_imports()
    assert {"lhd_train.finetune.trainer", "lens.fit", "rollouts.hf"} <= starts
    reached = {m.split(".")[0] for s in starts for m in graph.find_upstream_modules(s) | {s}}
    external = reached - {"lhd_train", "lens", "rollouts", "filekit"} - set(sys.stdlib_module_names)
    assert {"trl", "xgrammar", "torch"} <= external  # the walk sees past lhd's own modules
    bundled = {imp.split(".")[0] for imp in bundle.PACKAGES.values() if imp}
    assert sorted(external - IMAGE - bundled) == []


def run_check(*args: str, env_extra: dict[str, str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": "", **env_extra}
    return subprocess.run(["bash", str(GPU_CHECK), *args], capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=cwd)


@pytest.mark.model  # runs scripts/gpu_check.sh's python in a subprocess
def test_require_gpu_refuses_a_machine_whose_torch_sees_no_gpu(tmp_path):
    """On the device the check runs with --require-gpu: a broken CUDA stack exits 3 before the tests,
    instead of passing as 19 SKIPs."""
    r = run_check("--require-gpu", "--", "-k", "test_versions", env_extra={}, cwd=tmp_path)
    assert r.returncode == 3, (r.stdout[-1000:], r.stderr[-1000:])
    assert "CHECK setup: FAIL --require-gpu: torch " in r.stderr and "sees no GPU" in r.stderr, r.stderr[-1000:]
    assert "CHECK versions" not in r.stdout


def test_an_import_failure_names_its_cause(tmp_path):
    """peft without accelerate used to read `peft does not import`: the check now imports accelerate
    before peft and prints the import's own last line. Here accelerate's import fails on a module
    that does not exist (a package of that name first on PYTHONPATH)."""
    blocker = tmp_path / "shadow" / "accelerate"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("import lhd_module_that_is_not_installed\n")
    r = run_check("--", "-k", "test_versions", env_extra={"PYTHONPATH": str(tmp_path / "shadow")}, cwd=tmp_path)
    assert r.returncode == 2, (r.stdout[-1000:], r.stderr[-1000:])
    assert ("CHECK setup: FAIL accelerate does not import: ModuleNotFoundError: No module named "
            "'lhd_module_that_is_not_installed'") in r.stderr, r.stderr[-1000:]
