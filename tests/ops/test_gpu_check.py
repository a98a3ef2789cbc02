"""The device check (scripts/gpu_check.sh → lhd gpu-check) runs on a CPU machine too:
every check that has a CPU form runs, the GPU-only ones SKIP with their reason, none FAILs, and the
output is one `CHECK <name>: PASS|FAIL|SKIP <detail>` line per check plus a summary line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
LINE = re.compile(r"^CHECK ([a-z0-9_]+): (PASS|FAIL|SKIP) \S.*\[\d+\.\d s\]$")
NAMES = ["versions", "env", "tiny_model", "hf_constrained_json", "xgrammar_worker_thread", "hf_decode_8b",
         "hf_long_row_8b", "train_8b", "lens_8b", "lens_bf16_vs_fp32", "trl_lora_sft", "trl_sft_long_rows",
         "trl_dpo_lora", "trl_qlora", "train_single_device", "lens_fit_device_vs_cpu"]
SLICE = ["hf_kv_memory", "hf_oom_split", "lens_8b_slice"]  # with --all (beyond a lease's 8 minutes)
GPU_ONLY = {"xgrammar_worker_thread": "needs CUDA", "trl_qlora": "needs CUDA",
            "train_single_device": "needs >= 2 visible GPUs"}


def run_check(tmp_path: Path, *args: str, timeout: int) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    r = subprocess.run([PY, "-m", "lhd_train.cli", "gpu-check", "--device", "cpu", "--work", str(tmp_path), *args],
                       capture_output=True, text=True, env=ENV, timeout=timeout, cwd=ROOT)
    checks = [ln for ln in r.stdout.splitlines() if ln.startswith("CHECK ")]
    bad = [ln for ln in checks if not LINE.match(ln)]
    assert not bad, f"lines not in the format: {bad}"
    assert re.search(r"^gpu_check: \d+ checks, \d+ passed, \d+ failed, \d+ skipped, \d+ s, device cpu",
                     r.stdout, re.M), r.stdout
    return r, {LINE.match(ln).group(1): ln for ln in checks}


def test_output_format_and_unknown_check(tmp_path):
    r, lines = run_check(tmp_path, "--only", "trl_qlora", timeout=120)
    assert list(lines) == ["versions", "env", "tiny_model", "trl_qlora"], r.stdout
    assert lines["versions"].startswith("CHECK versions: PASS Python ") and "torch " in lines["versions"]
    assert lines["trl_qlora"].startswith("CHECK trl_qlora: SKIP needs CUDA")
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([PY, "-m", "lhd_train.cli", "gpu-check", "--device", "cpu", "--only", "nope"],
                       capture_output=True, text=True, env=ENV, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "unknown check(s) ['nope']" in r.stderr and "hf_kv_memory" in r.stderr
    r = subprocess.run(["bash", "-n", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_every_check_without_failure(tmp_path):
    r, lines = run_check(tmp_path, "--small", timeout=600)
    assert list(lines) == NAMES, r.stdout
    failed = [ln for ln in lines.values() if ": FAIL " in ln]
    assert not failed and r.returncode == 0, (failed, r.stderr[-3000:])
    for name, reason in GPU_ONLY.items():
        assert lines[name].startswith(f"CHECK {name}: SKIP {reason}"), lines[name]
    assert "bf16 skipped on cpu" in lines["trl_lora_sft"]
    assert "decode path loop (" in lines["hf_constrained_json"] and "decode path loop (" in lines["hf_decode_8b"]
    for name in ("hf_decode_8b", "hf_long_row_8b", "train_8b", "lens_8b", "lens_bf16_vs_fp32"):
        assert ": PASS " in lines[name], lines[name]
    assert re.search(r"0 dropped, TRL trains on 8\b", lines["trl_sft_long_rows"]), lines["trl_sft_long_rows"]
    assert not set(SLICE) & set(lines)


def test_a_version_outside_lhds_ranges_fails_the_check(monkeypatch):
    """The check's first line compares the installed versions with pyproject.toml's ranges."""
    from lhd_train.ops import gpu_check, version_ranges
    from lhd_train.ops.gpu_check_base import Ctx

    ranges = version_ranges.declared()
    assert ranges["torch"] == "<2.14,>=2.11" and ranges["transformers"] == "<5.25,>=5.17"
    status, detail = gpu_check.check_versions(Ctx("cpu", ROOT, True))
    assert status == "PASS", detail
    monkeypatch.setattr(version_ranges, "declared", lambda extras=("qlora",): {**ranges, "torch": ">=2.14,<2.15"})
    status, detail = gpu_check.check_versions(Ctx("cpu", ROOT, True))
    import importlib.metadata as md

    torch = md.version("torch")
    assert status == "FAIL" and "OUTSIDE lhd's ranges" in detail and f"torch {torch} not in >=2.14,<2.15" in detail
