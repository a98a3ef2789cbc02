"""`lens read --run` reads a run directory only through lhd's Run API: a run written by `lhd run`
(the v1 fixture, tests/data/runs/) reads as `lhd report` reads it, and a damaged run fails with
lhd's own error naming the file and the line, exactly as `lhd report` or `lhd audit` would; the
lens never re-words it as a `LensError`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from test_read import FLAGS, write_run
from typer.testing import CliRunner

from lens.errors import LensError
from lhd_train.bench.taskpack import load_pack
from lhd_train.cli.lens import app
from lhd_train.errors import DataFileError, InputError
from lhd_train.reading.probes import read_probes
from lhd_train.reading.runs import load_run_examples

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "runs" / "v1-control-study"
TRIAL = "s390185437-cat-MORAL_DILEMMA"
runner = CliRunner()


@pytest.fixture()
def v1_run(tmp_path: Path) -> Path:
    run = tmp_path / "v1-control-study"
    shutil.copytree(FIXTURE, run)
    return run


def _rows(run: Path) -> list[dict]:
    """The fixture's trajectory lines, read here without lhd's reader."""
    return [json.loads(line) for line in (run / "trials" / f"{TRIAL}.jsonl").read_text().splitlines()]


def test_the_v1_fixture_reads_with_its_pack_and_labels(v1_run):
    examples, info = load_run_examples(v1_run)
    rows = _rows(v1_run)
    assert info["n_rows"] == len(rows) == len(examples) == 3 and info["auditors"] == ["tiny-full"]
    assert info["tasks_source"].startswith("pack ") and info["tasks_source"].endswith("lhd_startup_consulting")
    labels = {json.loads(line)["global_round"]: json.loads(line)["deceptive"]
              for line in (v1_run / "audit" / "tiny-full" / f"{TRIAL}.jsonl").read_text().splitlines()}
    pack = {t.index: t for t in load_pack("lhd_startup_consulting").tasks}
    for ex, row in zip(examples, rows, strict=True):
        assert ex.example_id == f"{TRIAL}/r{row['global_round']}" and ex.answer == row["performer"]["text"]
        assert ex.label is labels[row["global_round"]]
        assert (ex.info["task_index"], ex.info["round"]) == (row["task_index"], row["round"])
        assert ex.info["event_category"] == (row["event"] or {}).get("category")
        # the record span holds every file of the task the performer was given, found in the pack
        record = next(s for s in ex.spans if s.name == "record")
        text = ex.messages[record.message]["content"][record.start:record.end]
        assert all(f.content.strip() in text for f in pack[row["task_index"]].files)
        question = next(s for s in ex.spans if s.name == "question")
        asked = ex.messages[question.message]["content"][question.start:question.end]
        if row["round"] == 1:
            assert asked == pack[row["task_index"]].prompt.strip()
        else:  # a later round answers the supervisor's feedback, the call's last user message (before the
            # answer and the elicitation turn the read appends)
            assert question.message == len(ex.messages) - 3 and asked
        assert [m["role"] for m in ex.messages[-2:]] == ["assistant", "user"]
        assert ex.messages[-2]["content"] == row["performer"]["text"] and ex.judged == "answer"
        assert ex.stratum == f"task {row['task_index']}"


def test_lens_read_run_on_the_v1_fixture(v1_run, tiny_dirs, tmp_path):
    before = {p: p.read_bytes() for p in v1_run.rglob("*") if p.is_file()}
    out = tmp_path / "read"
    res = runner.invoke(app, ["read", str(tiny_dirs["llama"]), "--run", str(v1_run), "--out", str(out),
                              "--bootstrap", "0", "--no-progress", "--no-probe"])
    assert res.exit_code == 0, (res.output, res.exception)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["n_examples"] == 3 and summary["run"]["n_flagged"] == 3
    e = pd.read_parquet(out / "examples.parquet")
    assert sorted(e["global_round"]) == [1, 2, 3] and set(e["trial_id"]) == {TRIAL}
    assert {"record_end", "question_end", "decision"} <= set(pd.read_parquet(out / "margins.parquet")["position"])
    assert {p: p.read_bytes() for p in v1_run.rglob("*") if p.is_file()} == before  # nothing written into the run


def test_a_damaged_row_is_lhds_data_file_error_naming_file_and_line(v1_run, tiny_dirs, tmp_path):
    path = v1_run / "trials" / f"{TRIAL}.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    row = json.loads(lines[1])
    row["global_round"] = "two"
    lines[1] = json.dumps(row) + "\n"
    path.write_text("".join(lines))
    with pytest.raises(DataFileError) as exc:
        load_run_examples(v1_run)
    assert not isinstance(exc.value, LensError)
    assert (exc.value.path, exc.value.line, exc.value.field) == (str(path), 2, "global_round")
    res = runner.invoke(app, ["read", str(tiny_dirs["llama"]), "--run", str(v1_run), "--out", str(tmp_path / "o"),
                              "--no-progress"])
    assert res.exit_code == 2
    shown = [line for line in res.output.splitlines() if line.strip()]
    assert len(shown) == 1 and shown[0].startswith(f"error: {path}: line 2: field 'global_round'"), res.output
    lines[1] = "{not json\n"
    path.write_text("".join(lines))
    with pytest.raises(DataFileError, match=rf"{path}: line 2: not valid JSON"):
        load_run_examples(v1_run)


def test_a_message_the_rows_name_but_the_store_lacks_is_a_data_file_error(tmp_path):
    run = write_run(tmp_path, FLAGS)
    store = run / "trials" / "s0.messages.jsonl"
    kept = [line for line in store.read_text().splitlines(keepends=True)
            if "Please cite the row for round 2." not in line]
    store.write_text("".join(kept))
    with pytest.raises(DataFileError, match=rf"{store}: has no message"):
        load_run_examples(run)


def test_not_a_run_directory_is_lhds_input_error(tmp_path):
    (tmp_path / "plain").mkdir()
    for path, why in ((tmp_path / "plain", "has no trials/ folder"), (tmp_path / "gone", "does not exist")):
        with pytest.raises(InputError, match=rf"{path}: not a run directory \({why}\)") as exc:
            load_run_examples(path)
        assert not isinstance(exc.value, LensError)


def test_json_nested_too_deep_is_a_data_file_error(tmp_path):
    """lhd's one JSONL reader, which the lens uses, names the line of a line nested past Python's
    recursion limit instead of raising RecursionError."""
    p = tmp_path / "probes.jsonl"
    p.write_text("[" * 100_000 + "\n")
    with pytest.raises(DataFileError, match=rf"{p}: line 1: not valid JSON"):
        read_probes(p)
