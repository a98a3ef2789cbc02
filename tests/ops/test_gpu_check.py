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
NAMES = ["env", "tiny_model", "hf_constrained_json", "xgrammar_worker_thread", "hf_kv_memory", "hf_oom_split",
         "lens_8b_slice", "trl_lora_sft", "trl_sft_long_rows", "trl_dpo_lora", "trl_qlora", "train_single_device",
         "lens_fit_device_vs_cpu"]
GPU_ONLY = {"xgrammar_worker_thread": "needs CUDA", "hf_oom_split": "needs CUDA", "trl_qlora": "needs CUDA",
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
    assert list(lines) == ["env", "tiny_model", "trl_qlora"], r.stdout
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
    assert re.search(r"0 dropped, TRL trains on 8\b", lines["trl_sft_long_rows"]), lines["trl_sft_long_rows"]
    for name in ("hf_kv_memory", "lens_8b_slice"):  # PASS, or SKIP until the slice can be built
        assert ": PASS " in lines[name] or "needs lhd_train.tiny_model.build_tiny_model(" in lines[name], lines[name]
