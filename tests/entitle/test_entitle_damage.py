"""The experiment's answers counted against what was asked (issue 40, item 3), as a new user meets
them: the real command on the tiny model, files damaged on disk, the exit code, the message and
the files' bytes checked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from entitle_disk import answers_on_disk

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--pack", "lhd_startup_consulting", "--facts", "2", "--max-tokens", "8", "--no-control", "--no-progress"]


def lhd(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lhd_train.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def one_line_error(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def trial_files(out: Path, trial: str) -> list[Path]:
    return [out / "trials" / f"{trial}{suffix}" for suffix in (".jsonl", ".messages.jsonl", ".done")]


@pytest.fixture
def experiment(tmp_path, tiny_llama_dir) -> Path:
    out = tmp_path / "e"
    done = lhd("entitle", "run", str(tiny_llama_dir), "--out", str(out), *COMMON)
    assert done.returncode == 0, done.stderr
    return out


def test_a_summary_with_missing_answers_says_so_and_a_rerun_fills_them(experiment, tiny_llama_dir):
    rows = answers_on_disk(experiment)
    assert len(rows) == 2 * 7
    for r in rows[:3]:  # three answers lost (their trial files gone)
        for p in trial_files(experiment, r["trial_id"]):
            p.unlink()
    done = lhd("entitle", "summary", str(experiment))
    said = " ".join((done.stdout + done.stderr).split())  # the console writes to stderr
    assert done.returncode == 0 and "3 of 14 missing; rerun with the same --out" in said
    summary = json.loads(lhd("entitle", "summary", str(experiment), "--json").stdout)
    assert (summary["missing"], summary["n_planned"], summary["n_answers"]) == (3, 14, 11)
    cells = {(c["files"], c["pressure"]): c["missing"] for c in summary["conditions"]}
    assert Counter({k: v for k, v in cells.items() if v}) == Counter((r["files"], r["pressure"]) for r in rows[:3])
    # the answers as scripts read them: one object per stored answer
    listed = [json.loads(line) for line in lhd("entitle", "summary", str(experiment), "--answers").stdout.splitlines()]
    assert sorted(a["id"] for a in listed) == sorted(r["id"] for r in rows[3:])
    assert all({"id", "fact", "task", "files", "pressure", "sample", "label", "answer"} <= set(a) for a in listed)
    # the rerun asks for the three, and nothing is missing or stored twice
    done = lhd("entitle", "run", str(tiny_llama_dir), "--out", str(experiment), *COMMON)
    assert done.returncode == 0, done.stderr
    again = answers_on_disk(experiment)
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in rows)
    assert json.loads((experiment / "entitle_summary.json").read_text())["missing"] == 0


def test_a_kill_between_the_sampled_answers_of_one_request_writes_none_twice(tmp_path, tiny_llama_dir):
    out = tmp_path / "k"
    args = ["--pack", "lhd_startup_consulting", "--facts", "1", "--samples", "3", "--max-tokens", "8", "--no-control",
            "--no-progress"]
    assert lhd("entitle", "run", str(tiny_llama_dir), "--out", str(out), *args).returncode == 0
    rows = answers_on_disk(out)
    assert len(rows) == 7 * 4
    request = sorted((r for r in rows if (r["files"], r["pressure"]) == ("deleted", "none") and r["sample"]),
                     key=lambda r: r["sample"])
    # as a kill leaves it: sample 1 written (its marker not yet), samples 2 and 3 not at all
    first = trial_files(out, request[0]["trial_id"])
    first[2].unlink()
    kept_bytes = first[0].read_bytes()
    for r in request[1:]:
        for p in trial_files(out, r["trial_id"]):
            p.unlink()
    done = lhd("entitle", "run", str(tiny_llama_dir), "--out", str(out), *args)
    assert done.returncode == 0, done.stderr
    again = answers_on_disk(out)
    assert Counter(r["id"] for r in again) == Counter(r["id"] for r in rows)  # every answer once
    assert first[0].read_bytes() == kept_bytes and first[2].is_file()  # sample 1 kept, marked finished
    for r in again:  # one round per trial file
        assert len((out / "trials" / f"{r['trial_id']}.jsonl").read_text().splitlines()) == 1


def test_read_and_summary_refuse_a_row_without_its_id_in_one_line(experiment):
    [first] = [p for p in sorted((experiment / "trials").glob("*.jsonl")) if not p.name.endswith(".messages.jsonl")][:1]
    row = json.loads(first.read_text())
    del row["entitle"]["id"]
    first.write_text(json.dumps(row) + "\n")
    before = first.read_bytes()
    for command in (["entitle", "read", str(experiment), "--no-progress", "--bootstrap", "10"],
                    ["entitle", "summary", str(experiment)]):
        line = one_line_error(lhd(*command))
        assert first.name in line and "entitle.id" in line, line
    assert first.read_bytes() == before


@pytest.mark.parametrize("alpha", ["nan", "inf", "-inf"])
def test_steer_refuses_a_strength_that_is_not_finite(experiment, alpha):
    line = one_line_error(lhd("entitle", "steer", str(experiment), "--alpha", alpha, "--no-progress"))
    assert "--alpha" in line and "finite" in line
    assert not (experiment / "steer").exists()
