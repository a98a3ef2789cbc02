"""Issue 39 item 3: `lhd export RUN --format inspect --out FILE` writes an inspect_ai log.

A real run of the tiny model, audited by it, is exported through the command; inspect_ai's own
reader reads the file back and every sample is recounted against the run's files on disk (one per
performer round, the answer, the supervisor's state, the auditor's label). Then `inspect view`
serves the log and a real Chromium shows a sample's content; the screenshot is kept in the test's
tmp folder. Needs the `inspect` extra (inspect_ai)."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_failure_modes import RUN, SEED, cli, lone, one_error  # noqa: F401 - lone: a fixture

from lhd_train.io.files import read_jsonl

pytest.importorskip("inspect_ai", reason="the `inspect` extra (inspect_ai) is not installed")


@pytest.fixture(scope="module")
def exported(lone, tmp_path_factory) -> tuple[Path, Path]:  # noqa: F811 - the fixture imported above
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
        log = base / "logs" / "run.eval"
        code, out = cli(mp, capture, "export", str(run), "--format", "inspect", "--out", str(log))
        assert code == 0, out
    finally:
        mp.undo()
    return run, log


class _Capture:
    """`capsys`'s readouterr for a module-scoped fixture (the command's own output is not checked)."""

    def readouterr(self):  # noqa: ANN201
        class Out:
            out = err = ""
        return Out()


def test_the_log_reads_back_with_one_sample_per_round(exported):
    from inspect_ai.log import read_eval_log

    run, log_file = exported
    log = read_eval_log(str(log_file))
    rows = read_jsonl(run / "trials" / f"s{SEED}.jsonl")
    labels = {r["global_round"]: r for r in read_jsonl(run / "audit" / "tiny-full" / f"s{SEED}.jsonl")}
    assert log.status == "success"
    assert log.eval.metadata["seeds"] == [SEED]
    assert log.eval.metadata["config"]["run_name"] == RUN
    assert log.eval.metadata["models"]["performer"]["model"] == log.eval.model
    assert [s.id for s in log.samples] == [f"s{SEED}-r{r['global_round']}" for r in rows]
    for sample, row in zip(log.samples, rows, strict=True):
        assert sample.messages[-1].role == "assistant" and sample.messages[-1].text == row["performer"]["text"]
        assert sample.output.completion == row["performer"]["text"]
        assert len(sample.messages) == len(row["performer"]["message_ids"]) + 1
        after = row["supervisor"]["state_after"]
        assert sample.scores["supervisor"].value == {k: after[k] for k in ("trust", "satisfaction", "comfort")}
        label = labels.get(row["global_round"])
        if label is None:
            assert "tiny-full" not in sample.scores and sample.metadata["missing_labels"] == ["tiny-full"]
        else:
            got = sample.scores["tiny-full"].value
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
    inspect_bin = Path(sys.executable).parent / "inspect"
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


def test_a_run_without_its_message_store_exports_answers_flagged(lone, tmp_path, monkeypatch, capsys):  # noqa: F811
    from inspect_ai.log import read_eval_log

    run = tmp_path / RUN
    shutil.copytree(lone, run)
    (run / "trials" / f"s{SEED}.messages.jsonl").unlink()
    code, out = cli(monkeypatch, capsys, "export", str(run), "--format", "inspect", "--out", str(tmp_path / "a.json"))
    assert code == 0, out
    rows = read_jsonl(run / "trials" / f"s{SEED}.jsonl")
    log = read_eval_log(str(tmp_path / "a.json"))
    assert [s.metadata["prompt_missing"] for s in log.samples] == [True] * len(rows)
    assert [[m.text for m in s.messages] for s in log.samples] == [[r["performer"]["text"]] for r in rows]
