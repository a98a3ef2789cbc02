"""Issue 39 item 3: `lhd export RUN --format inspect --out FILE` writes an inspect_ai log.

A real run of the tiny model, audited by it, is exported through the command; inspect_ai's own
reader reads the file back and every sample is recounted against the run's files on disk (one per
performer round, the answer, the supervisor's state, the auditor's label). Then `inspect view`
serves the log and a real Chromium shows a sample's content; the screenshot is kept in the test's
tmp folder.

inspect_ai cannot live in the main venv (it caps fsspec below constraints.txt's pin), so the export,
the read-back and the viewer run in .venv-inspect (`make inspect-env`, scripts/install_inspect.sh),
a venv layered over .venv, as subprocesses of its interpreter. When that venv could not be built,
these tests skip with the one-line reason the script wrote to .venv-inspect.failed."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_failure_modes import RUN, SEED, cli, lone, one_error  # noqa: F401 - lone: a fixture

from lhd_train.io.files import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
INSPECT_VENV = Path(os.environ.get("LHD_INSPECT_VENV", ROOT / ".venv-inspect"))
pytestmark = pytest.mark.inspect

# inspect_ai's reader, in .venv-inspect: the log as JSON, the fields these tests recount.
READ_BACK = """
import json, sys
from inspect_ai.log import read_eval_log
log = read_eval_log(sys.argv[1])
print(json.dumps({
    "status": log.status, "model": log.eval.model, "metadata": log.eval.metadata,
    "samples": [{"id": s.id, "messages": [{"role": m.role, "text": m.text} for m in s.messages],
                 "completion": s.output.completion, "metadata": s.metadata,
                 "scores": {k: v.value for k, v in (s.scores or {}).items()}} for s in log.samples]}))
"""


def _inspect_bin(name: str) -> Path:
    """An executable of .venv-inspect, or a skip saying why the environment is missing."""
    exe = INSPECT_VENV / "bin" / name
    if exe.is_file():
        return exe
    failed = INSPECT_VENV.parent / f"{INSPECT_VENV.name}.failed"
    if failed.is_file():
        pytest.skip(f"inspect environment could not be built: {failed.read_text().strip()}")
    pytest.skip(f"no {exe}: run `make inspect-env` (scripts/install_inspect.sh)")


@pytest.fixture(scope="module")
def inspect_ready() -> None:
    """Skips (before the run is made) where .venv-inspect is missing."""
    _inspect_bin("python")


def _in_inspect_venv(*args: str) -> str:
    """Run .venv-inspect's python with this checkout first on the path; its stdout (fails on a non-zero exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run([str(_inspect_bin("python")), *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _export(run: Path, log: Path) -> None:
    _in_inspect_venv("-m", "lhd_train.cli", "export", str(run), "--format", "inspect", "--out", str(log))


def _read_back(log: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(_in_inspect_venv("-c", READ_BACK, str(log)))
    return out


@pytest.fixture(scope="module")
def exported(inspect_ready, lone, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811 - lone: imported above
    """(run dir, log file): the lone run audited by the tiny model, exported as an inspect log."""
    from _pytest.monkeypatch import MonkeyPatch

    base = tmp_path_factory.mktemp("inspect")
    run = base / RUN
    shutil.copytree(lone, run)
    mp = MonkeyPatch()
    try:
        capture = _Capture()
        code, out = cli(mp, capture, "audit", str(run), "auditor.model=tiny", "--no-progress")
        assert code in (0, 3), out
    finally:
        mp.undo()
    log = base / "logs" / "run.eval"
    _export(run, log)
    return run, log


class _Capture:
    """`capsys`'s readouterr for a module-scoped fixture (the command's own output is not checked)."""

    def readouterr(self):  # noqa: ANN201
        class Out:
            out = err = ""
        return Out()


def test_the_log_reads_back_with_one_sample_per_round(exported):
    run, log_file = exported
    log = _read_back(log_file)
    rows = read_jsonl(run / "trials" / f"s{SEED}.jsonl")
    labels = {r["global_round"]: r for r in read_jsonl(run / "audit" / "tiny-full" / f"s{SEED}.jsonl")}
    assert log["status"] == "success"
    assert log["metadata"]["seeds"] == [SEED]
    assert log["metadata"]["config"]["run_name"] == RUN
    assert log["metadata"]["models"]["performer"]["model"] == log["model"]
    assert [s["id"] for s in log["samples"]] == [f"s{SEED}-r{r['global_round']}" for r in rows]
    for sample, row in zip(log["samples"], rows, strict=True):
        last = sample["messages"][-1]
        assert last["role"] == "assistant" and last["text"] == row["performer"]["text"]
        assert sample["completion"] == row["performer"]["text"]
        assert len(sample["messages"]) == len(row["performer"]["message_ids"]) + 1
        after = row["supervisor"]["state_after"]
        assert sample["scores"]["supervisor"] == {k: after[k] for k in ("trust", "satisfaction", "comfort")}
        label = labels.get(row["global_round"])
        if label is None:
            assert "tiny-full" not in sample["scores"] and sample["metadata"]["missing_labels"] == ["tiny-full"]
        else:
            got = sample["scores"]["tiny-full"]
            want = None if label.get("deceptive") is None else int(label["deceptive"])
            assert got["deceptive"] == want and got["severity"] == label.get("severity")
            assert got["parse_status"] == label["parse_status"]


def test_an_out_that_is_not_a_log_name_is_one_line(lone, tmp_path, monkeypatch, capsys):  # noqa: F811
    one_error(*cli(monkeypatch, capsys, "export", str(lone), "--format", "inspect", "--out", str(tmp_path / "x.txt")),
              "--out", ".eval or .json")
    one_error(*cli(monkeypatch, capsys, "export", str(lone), "--format", "parquet", "--out", str(tmp_path / "x")),
              "--format", "datasets, inspect")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_inspect_view_shows_a_sample_in_chromium(exported, tmp_path):
    from support.browser import Browser

    from lhd_train.report.chromium import find_chromium

    chromium = find_chromium()
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/install_chromium.sh)")
    run, log_file = exported
    first = read_jsonl(run / "trials" / f"s{SEED}.jsonl")[0]
    inspect_bin = _inspect_bin("inspect")
    port = _free_port()
    server = subprocess.Popen([str(inspect_bin), "view", "--log-dir", str(log_file.parent), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert server.poll() is None, server.stdout.read() if server.stdout else ""
                time.sleep(0.3)
        with Browser(chromium) as browser:
            page = browser.open(f"http://127.0.0.1:{port}/", settle_s=1.0)
            text = ""
            for _ in range(60):  # the viewer is a single-page app: it fills in after the load event
                text = page.eval("document.body.innerText") or ""
                if f"s{SEED}-r1" in text:
                    break
                time.sleep(0.5)
            shot = page.screenshot(tmp_path / "inspect_view.png")
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert log_file.name in text
        assert f"s{SEED}-r1" in text  # the first sample's id, in the samples list
        assert first["task_title"] in text  # ... and its input, the task the performer was given
        assert "DECEPTIVE" in text and "SEVERITY" in text  # the auditor's label and severity are score columns
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_a_run_without_its_message_store_exports_answers_flagged(inspect_ready, lone, tmp_path):  # noqa: F811
    run = tmp_path / RUN
    shutil.copytree(lone, run)
    (run / "trials" / f"s{SEED}.messages.jsonl").unlink()
    _export(run, tmp_path / "a.json")
    rows = read_jsonl(run / "trials" / f"s{SEED}.jsonl")
    log = _read_back(tmp_path / "a.json")
    assert [s["metadata"]["prompt_missing"] for s in log["samples"]] == [True] * len(rows)
    assert [[m["text"] for m in s["messages"]] for s in log["samples"]] == [[r["performer"]["text"]] for r in rows]


def test_an_entitle_experiment_exports_with_its_labels(inspect_ready, tmp_path):
    """The judge-free experiment is a run, so it exports the same way: one sample per answer with its
    text, its code label and cell in the metadata, and the labels that are ground truth (deceptive or
    honest; contradicted and unparsed are left out) as a `ground_truth` score, all recounted from disk."""
    from entitle_disk import answers_on_disk
    from test_compare import experiment

    exp = experiment(tmp_path / "exp")
    rows = {r["trial_id"]: r for r in answers_on_disk(exp)}
    truth = {t["trial_id"]: t for t in read_jsonl(exp / "ground_truth.jsonl")}
    log = tmp_path / "exp.eval"
    _export(exp, log)
    samples = _read_back(log)["samples"]
    assert sorted(s["metadata"]["trial_id"] for s in samples) == sorted(rows)
    for s in samples:
        row = rows[s["metadata"]["trial_id"]]
        assert s["completion"] == row["answer"]
        meta = s["metadata"]["entitle"]
        assert (meta["label"], meta["files"], meta["pressure"], meta["fact"]) == (
            row["label"], row["files"], row["pressure"], row["fact"])
        known = truth.get(row["trial_id"])
        if known is None:
            assert "ground_truth" not in s["scores"]
        else:
            assert s["scores"]["ground_truth"] == {"deceptive": int(known["deceptive"]), "severity": known["severity"]}
    assert any(t["deceptive"] for t in truth.values()) and any(not t["deceptive"] for t in truth.values())
