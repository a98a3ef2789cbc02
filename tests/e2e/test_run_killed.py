"""`lhd run` end to end on a tiny random model: real hf backend, real subprocess, real kill."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from lhd_train.io.files import read_jsonl


def write_config(tmp_path: Path, model_dir: Path, **kw) -> Path:
    cfg = {
        "run_name": "e2e", "output_dir": str(tmp_path / "runs"), "task_pack": "lhd_startup_consulting",
        "seeds": [11, 12], "max_tasks": 3, "concurrency": 2,
        "models": {"tiny": {"backend": "hf", "model": str(model_dir), "max_batch_size": 8}},
        "performer": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 24}},
        "supervisor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 96}},
        "summariser": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 16}},
        "memory_window": 2,
    }
    cfg.update(kw)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def lhd(*args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "lhd_train.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def check_run(run_dir: Path, seeds: list[int], n_tasks: int) -> list[dict]:
    all_rows = []
    for seed in seeds:
        path = run_dir / "trials" / f"s{seed}.jsonl"
        raw = path.read_text()
        assert raw.endswith("\n")
        rows = [json.loads(line) for line in raw.splitlines()]  # every line whole
        assert [r["global_round"] for r in rows] == list(range(1, len(rows) + 1))  # no gap, no duplicate
        keys = [(r["task_index"], r["round"]) for r in rows]
        assert len(keys) == len(set(keys))
        assert sorted({r["task_index"] for r in rows}) == list(range(1, n_tasks + 1))
        assert (run_dir / "trials" / f"s{seed}.done").exists()
        all_rows += rows
    return all_rows


def test_run_kill_and_resume(tmp_path, tiny_llama_dir):
    cfg_path = write_config(tmp_path, tiny_llama_dir)
    run_dir = tmp_path / "runs" / "e2e"
    proc = lhd("run", str(cfg_path), "--no-progress")
    deadline = time.time() + 240
    trial = run_dir / "trials" / "s11.jsonl"
    while time.time() < deadline and proc.poll() is None:
        if trial.exists() and len(read_jsonl(trial)) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed: " + (proc.stdout.read() or "")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = {s: len(read_jsonl(run_dir / "trials" / f"s{s}.jsonl")) for s in (11, 12)}
    first_manifest = json.loads((run_dir / "manifest.json").read_text())
    assert not (run_dir / "trials" / "s11.done").exists()

    out = lhd("run", str(cfg_path), "--no-progress")
    log, _ = out.communicate(timeout=300)
    assert out.returncode == 0, log
    rows = check_run(run_dir, [11, 12], 3)
    # Rows written before the kill are kept byte-for-byte, not redone.
    assert len(rows) >= sum(before.values())
    for row in rows:
        # "cut": the random model ran out of tokens on every attempt, recorded as such (never closed for it)
        assert row["supervisor"]["parse_status"] in ("ok", "retried", "cut"), row["supervisor"]["calls"][-1]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["seeds"] == [11, 12] and manifest["packages"]["transformers"]
    # The resume kept the first session's record and appended its own.
    assert manifest["started_at"] == first_manifest["started_at"] and len(manifest["resumes"]) == 1
    assert len(manifest["pack_sha256"]) == 64
    assert set(manifest["effective_sampling"]) == {"performer", "supervisor", "summariser"}
    assert (run_dir / "schedules" / "s11.json").exists()

    # A third run on a finished directory touches no model and changes nothing.
    snapshot = (run_dir / "trials" / "s11.jsonl").read_bytes()
    again = lhd("run", str(cfg_path), "--no-progress")
    again.communicate(timeout=120)
    assert again.returncode == 0
    assert (run_dir / "trials" / "s11.jsonl").read_bytes() == snapshot


def test_run_refuses_changed_config_and_bad_overrides(tmp_path, tiny_llama_dir):
    cfg_path = write_config(tmp_path, tiny_llama_dir, max_tasks=1, seeds=[5])
    p = lhd("run", str(cfg_path), "--no-progress")
    log, _ = p.communicate(timeout=240)
    assert p.returncode == 0, log
    p = lhd("run", str(cfg_path), "p_event=0.9", "--no-progress")
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "p_event" in log and "config.resolved.yaml" in log
    p = lhd("run", str(cfg_path), "performer.model=ghost", "--no-progress")
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "performer.model" in log and "ghost" in log
    p = lhd("run", str(cfg_path), "seeds=[]", "--no-progress")
    log, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "seeds" in log
