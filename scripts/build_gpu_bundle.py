"""Build the archive of Python packages lhd needs that the lent GPU image lacks (issue 30, item 5).

The image (one H200, no network, at most 64 MiB carried per call) has torch 2.11, transformers 5.17,
accelerate, peft's dependencies, numpy, safetensors, tokenizers and huggingface_hub, but no trl, vLLM,
xgrammar, bitsandbytes, pydantic or pytest, and a pyarrow older than datasets 5.2 needs. This script downloads
the wheels of the missing packages at lhd's pinned versions (constraints.txt) for the image's Python,
unpacks them into one site folder, drops what the device check never loads (pyarrow's Flight, S3,
tests and headers, pandas' tests, every bitsandbytes library but the CPU one and the one for the
image's CUDA), and packs it as one xz archive, refusing to finish above the size limit:

    python scripts/build_gpu_bundle.py [--python 3.12] [--cuda 130] [--out build/gpu] [--work build/gpu-work]

`--out` ends up holding the archive and nothing else (it is what a device call carries, 64 MiB at
most); the wheels, the unpacked site folder and the manifest stay in `--work`.

On the device machine, one line puts the packages ahead of the image's own (PYTHONPATH entries come
before site-packages), with lhd from the checkout:

    S=/tmp/lhd/site-packages; mkdir -p $S && tar -xJf build/gpu/lhd-deps-py312.tar.xz -C $S && \\
        export PYTHONPATH=$S:$PWD TVM_FFI_DISABLE_TORCH_C_DLPACK=1 HF_HUB_OFFLINE=1

The folder's name must contain `site-packages`: `datasets` fingerprints every new Dataset with dill,
and dill pickles a module by reference only when it looks installed (under sys.prefix, compiled, or
with `site-packages` in its path); elsewhere it pickles pyarrow by value and fails on a Cython class
(`Dataset.from_list` raises PicklingError). (`build/` is git-ignored.) TVM_FFI_DISABLE_TORCH_C_DLPACK
stops apache-tvm-ffi from compiling a torch extension at `import xgrammar`
(tvm_ffi/_optional_torch_c_dlpack.py). The archive's `lhd-bundle.json` lists every package, its
version and its unpacked size.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# distribution -> import name (None: nothing to import, data only). Versions come from constraints.txt.
PACKAGES: dict[str, str | None] = {
    "transformers": "transformers",  # lhd's pin (5.24); the image's 5.17 is within the range, but the pin is tested
    "trl": "trl",
    "peft": "peft",
    "datasets": "datasets",
    "dill": "dill",
    "multiprocess": "multiprocess",
    "fsspec": "fsspec",  # datasets 5.2 needs <= 2026.9.0
    "pyarrow": "pyarrow",  # datasets 5.2 needs >= 24
    "pandas": "pandas",
    "python-dateutil": "dateutil",
    "tzdata": "tzdata",
    "xgrammar": "xgrammar",
    "apache-tvm-ffi": "tvm_ffi",
    "bitsandbytes": "bitsandbytes",
    "pydantic": "pydantic",
    "pydantic_core": "pydantic_core",
    "annotated-types": "annotated_types",
    "typing-inspection": "typing_inspection",
    "typing_extensions": "typing_extensions",
    "tenacity": "tenacity",  # the OpenAI-compatible backend's retries (imported by rollouts.backends)
    "pytest": "pytest",  # the device check is tests/gpu/, run by pytest
    "pluggy": "pluggy",
    "iniconfig": "iniconfig",
    "pygments": "pygments",
    "pytest-timeout": "pytest_timeout",  # pyproject's `timeout` setting
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]
# What the device check never loads (paths relative to the site folder, fnmatch patterns).
SLIM = [
    "pyarrow/tests", "pyarrow/include", "pyarrow/src", "pyarrow/*flight*", "pyarrow/libarrow_flight*",
    "pyarrow/_s3fs*", "pyarrow/libarrow_s3*", "pyarrow/_pyarrow_cpp_tests*", "pyarrow/*.pxd", "pyarrow/*.pyx",
    "pyarrow/includes", "pandas/tests", "*/__pycache__",
]


def pins(path: Path = ROOT / "constraints.txt") -> dict[str, str]:
    """name (lower case, '-' for '_') -> version, from a pip constraints file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower().replace("_", "-")] = version.strip()
    return out


def download(names: list[str], versions: dict[str, str], python: str, wheels: Path) -> list[Path]:
    """The wheels, for `python` on manylinux x86_64, without their dependencies (listed above)."""
    wheels.mkdir(parents=True, exist_ok=True)
    specs = [f"{n}=={versions[n.lower().replace('_', '-')]}" for n in names]
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", *platforms, "-d", str(wheels), *specs]
    subprocess.run(cmd, check=True)
    found = []
    for n in names:
        stem = n.replace("-", "_").lower()
        match = [w for w in wheels.glob("*.whl") if w.name.lower().startswith(stem + "-" + versions[
            n.lower().replace("_", "-")].lower())]
        if len(match) != 1:
            raise SystemExit(f"{n}: expected one wheel in {wheels}, found {[m.name for m in match]}")
        found.append(match[0])
    return found


def unpack(wheel_files: list[Path], site: Path) -> None:
    for w in wheel_files:
        with zipfile.ZipFile(w) as z:
            z.extractall(site)
    for so in site.rglob("*.so*"):  # zip keeps no modes: shared libraries must stay readable/loadable
        so.chmod(0o755)


def slim(site: Path, cuda: str) -> list[str]:
    """Remove `SLIM` and every bitsandbytes library but the CPU one and CUDA `cuda`'s; returns what went."""
    removed = []
    for path in sorted(site.rglob("*"), key=lambda p: len(p.parts)):
        if not path.exists():
            continue
        rel = path.relative_to(site).as_posix()
        bnb_lib = fnmatch.fnmatch(rel, "bitsandbytes/libbitsandbytes_*") and not (
            rel.endswith("_cpu.so") or fnmatch.fnmatch(rel, f"bitsandbytes/libbitsandbytes_cuda{cuda}.*"))
        if bnb_lib or any(fnmatch.fnmatch(rel, pat) for pat in SLIM):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            removed.append(rel)
    return removed


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# What earlier builds left beside the archive (before the work folder existed): removed from `--out`.
LEGACY = ("wheels-py*", "site-py*", "lhd-bundle-py*.json")


def build(out: Path, python: str = "3.12", cuda: str = "130", limit_mib: float = 60.0,
          wheels: Path | None = None, preset: int = 9, work: Path | None = None) -> dict:
    """Download, unpack, slim and pack; returns the manifest (also written to the work folder).
    `out` receives only the archive; everything else goes to `work` (default: `out` + "-work")."""
    versions = pins()
    out.mkdir(parents=True, exist_ok=True)
    work = work or out.with_name(out.name + "-work")
    work.mkdir(parents=True, exist_ok=True)
    tag = python.replace(".", "")
    wheels = wheels or work / f"wheels-py{tag}"
    site = work / f"site-py{tag}"
    shutil.rmtree(site, ignore_errors=True)
    files = download(list(PACKAGES), versions, python, wheels)
    unpack(files, site)
    removed = slim(site, cuda)
    manifest = {"python": python, "cuda": cuda, "packages": {
        n: {"version": versions[n.lower().replace("_", "-")], "import": imp,
            "wheel_mb": round(w.stat().st_size / 1e6, 2)} for (n, imp), w in zip(PACKAGES.items(), files, strict=True)},
        "removed": removed, "unpacked_mib": round(folder_bytes(site) / 2**20, 1)}
    (site / "lhd-bundle.json").write_text(json.dumps(manifest, indent=1) + "\n")
    archive = out / f"lhd-deps-py{tag}.tar.xz"
    with tarfile.open(archive, "w:xz", preset=preset) as tar:  # 9: ~39 MiB for 3.12 (6: ~43 MiB, a minute faster)
        for path in sorted(site.iterdir()):
            tar.add(path, arcname=path.name)
    size = archive.stat().st_size
    manifest["archive"], manifest["archive_mib"] = str(archive), round(size / 2**20, 2)
    (work / f"lhd-bundle-py{tag}.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for pattern in LEGACY:
        for stale in out.glob(pattern):
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    if size > limit_mib * 2**20:
        raise SystemExit(f"{archive}: {size / 2**20:.1f} MiB, over the {limit_mib:g} MiB limit")
    return manifest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="3.12", help="the image's Python (major.minor)")
    ap.add_argument("--cuda", default="130", help="bitsandbytes CUDA library to keep (torch CUDA 13.0: 130)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "gpu-work",
                    help="wheels, unpacked site and manifest (kept out of OUT, which is carried)")
    ap.add_argument("--wheels", type=Path, default=None, help="download folder (default WORK/wheels-pyXY)")
    ap.add_argument("--limit-mib", type=float, default=60.0)
    ap.add_argument("--xz-preset", type=int, default=9, choices=range(10), help="9: smallest; 1: fastest")
    args = ap.parse_args(argv)
    m = build(args.out, args.python, args.cuda, args.limit_mib, args.wheels, args.xz_preset, args.work)
    print(f"{m['archive']}: {m['archive_mib']} MiB ({m['unpacked_mib']} MiB unpacked, {len(m['packages'])} packages, "
          f"Python {m['python']}, bitsandbytes CUDA {m['cuda']})")


if __name__ == "__main__":
    main()
