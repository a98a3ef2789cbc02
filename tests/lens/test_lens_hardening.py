"""Issue 22 for the lens: garbage corpora and probe files are one line naming the file and line,
bounded options are refused before any model loads, `lens read --run` never writes into the run,
`--out` is never a file or among a run's files, and CSV tables hold no formula cell."""
from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from lens_data import make_pack
from test_read import FLAGS, write_run
from typer.testing import CliRunner

from lens.corpus import CorpusSpec, load_corpus
from lens.errors import LensError, LensFileError
from lhd_train.cli.lens import app
from lhd_train.errors import DataFileError
from lhd_train.reading import report
from lhd_train.reading.probes import build_probe_set, read_probes, write_probes

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
NO_MODEL = "/nonexistent/model-dir"  # a check that runs before the model loads never reaches it


def refused(*args) -> str:
    """The one-line error of a refused command (exit 2, no traceback)."""
    res = runner.invoke(app, [str(a) for a in args])
    assert res.exit_code == 2, (res.output, res.exception)
    assert not isinstance(res.exception, Exception) or isinstance(res.exception, SystemExit), res.exception
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


@pytest.fixture()
def binary(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(b"fine first line\n" + bytes(range(128, 256)) * 4 + b"\n")
    return p


# ------------------------------------------------------------------ 1. garbage input files

@pytest.mark.parametrize(("fmt", "error", "where"), [
    ("text", LensError, "{}:2: not UTF-8"),
    ("jsonl", LensFileError, "{}: line 1: not valid JSON"),  # the lens's JSONL reader: its first line is no JSON
])
def test_binary_corpus_names_file_and_line(binary, fmt, error, where):
    with pytest.raises(error, match=where.format(binary)):
        load_corpus(CorpusSpec(path=str(binary), format=fmt))
    assert where.format(binary) in refused("fit", NO_MODEL, "--corpus", binary, "--out", binary.parent / "o",
                                           "--format", fmt)


def test_jsonl_corpus_with_a_bad_line(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "a fine line of text"}\nnot json at all\n')
    with pytest.raises(LensFileError, match=rf"{p}: line 2: not valid JSON"):
        load_corpus(CorpusSpec(path=str(p)))
    p.write_text('{"text": "ok"}\n[1, 2]\n')
    with pytest.raises(LensFileError, match=rf"{p}: line 2: a JSON list, not an object"):
        load_corpus(CorpusSpec(path=str(p)))
    p.write_text('{"text": "ok"}\n{"body": "no text field"}\n{"text": "torn')
    with pytest.raises(LensFileError, match=rf"{p}: line 2: field 'text': missing"):
        load_corpus(CorpusSpec(path=str(p)))


def test_garbage_probe_files(tmp_path, binary):
    good = tmp_path / "good.jsonl"
    write_probes(build_probe_set(make_pack(), max_facts_per_task=1, seed=0), good)
    first = json.loads(good.read_text().splitlines()[0])
    with pytest.raises(DataFileError, match=rf"{binary}: line 1: not valid JSON"):
        read_probes(binary)
    cases = {
        "not json\n": "not valid JSON",
        "[1, 2]\n": "a JSON list, not an object",
        json.dumps({k: v for k, v in first.items() if k != "claim"}) + "\n": "field 'claim' missing",
        json.dumps({k: v for k, v in first.items() if k != "files"}) + "\n": "field 'files' missing",
        json.dumps({**first, "files": [{"name": 1}]}) + "\n": "field 'files'",
        json.dumps({**first, "evidence": "line 3"}) + "\n": "field 'evidence'",
        json.dumps({**first, "evidence": {"file": "a.csv", "start": 3, "end": None}}) + "\n": "field 'evidence'",
        json.dumps({**first, "id": 7}) + "\n": "field 'id'",
    }
    for i, (line, why) in enumerate(cases.items()):
        p = tmp_path / f"bad{i}.jsonl"
        p.write_text(json.dumps(first) + "\n" + line)
        with pytest.raises(DataFileError) as exc:
            read_probes(p)
        assert str(exc.value).startswith(f"{p}: line 2: ") and why in str(exc.value), (line, str(exc.value))
        torn = tmp_path / f"torn{i}.jsonl"  # the same line torn by a killed writer: ignored
        torn.write_text(json.dumps(first) + "\n" + line.rstrip("\n"))
        assert read_probes(torn) == [first]
    bad = tmp_path / "bad0.jsonl"
    assert f"{bad}: line 2: not valid JSON" in refused("read", NO_MODEL, "--probes", bad, "--out", tmp_path / "o")


@pytest.mark.model  # `python -m lhd_train.cli` in a subprocess
def test_the_module_entry_point_prints_one_line(binary, tmp_path):
    """`python -m lhd_train.cli lens ...` (there is no `python -m lens`: the lens is a library)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "lhd_train.cli", "lens", "fit", NO_MODEL, "--corpus", str(binary),
                          "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert res.returncode != 0
    lines = [line for line in res.stderr.splitlines() if line.strip() and not line.startswith(("WARNING", "INFO"))]
    assert lines == [lines[0]] and "Traceback" not in res.stderr and f"{binary}:2" in lines[0], res.stderr


# ------------------------------------------------------------------ 2. bounded options

@pytest.mark.parametrize(("cmd", "flag", "value"), [
    ("fit", "--n-prompts", "0"), ("fit", "--max-length", "0"), ("fit", "--dim-batch", "0"),
    ("fit", "--checkpoint-every", "-1"), ("fit", "--checkpoint-minutes", "-1"), ("fit", "--threads", "0"),
    ("fit", "--skip-first", "-1"), ("fit", "--min-chars", "-5"), ("fit", "--chunk-chars", "-1"),
    ("fit", "--memory-gib", "0"), ("fit", "--threads", "100000"), ("fit", "--max-length", "99999999999"),
    ("read", "--bootstrap", "-1"), ("read", "--probe-folds", "1"), ("read", "--limit", "0"),
    ("read", "--max-length", "-3"), ("read", "--answer-tokens", "0"), ("read", "--seed", "-1"),
    ("read", "--bootstrap", "100000000000"),
    ("eval", "--bootstrap", "-1"), ("eval", "--held-out", "-1"), ("eval", "--seed", "-2"),
])
def test_bounded_options_refused_before_the_model_loads(cmd, flag, value, tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a paragraph of text\n")
    probes = tmp_path / "p.jsonl"
    probes.write_text("")
    extra = {"fit": ["--corpus", corpus, "--out", tmp_path / "o"],
             "read": ["--probes", probes, "--out", tmp_path / "o"],
             "eval": ["--readout", f"jacobian={tmp_path / 'lens'}", "--corpus", corpus, "--out", tmp_path / "o"]}[cmd]
    line = refused(cmd, NO_MODEL, *extra, flag, value)
    assert flag in line and "must be" in line, line
    assert not (tmp_path / "o").exists()


def test_skip_first_must_leave_positions(tmp_path):
    line = refused("fit", NO_MODEL, "--corpus", tmp_path, "--out", tmp_path / "o", "--max-length", "16")
    assert "'--skip-first': 16 leaves no position" in line and "below max_length" in line


# ------------------------------------------------------------------ 3. read-only runs and --out

def test_out_refused_when_a_file_or_inside_a_run(tmp_path):
    run = write_run(tmp_path, FLAGS)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    corpus = tmp_path / "c.txt"
    corpus.write_text("a paragraph of text\n")
    for out in (a_file, run, run / "trials" / "lens", run / "audit"):
        for args in (["fit", NO_MODEL, "--corpus", corpus, "--out", out],
                     ["read", NO_MODEL, "--run", run, "--out", out],
                     ["eval", NO_MODEL, "--readout", f"jacobian={tmp_path / 'l'}", "--corpus", corpus, "--out", out],
                     ["merge", out, tmp_path / "a", tmp_path / "b"]):
            line = refused(*args)
            assert str(out) in line and ("is a file" in line or "run" in line), line
    assert sorted(p.name for p in (run / "trials").iterdir()) == ["s0.done", "s0.jsonl", "s0.messages.jsonl",
                                                                   "s1.done", "s1.jsonl", "s1.messages.jsonl"]
    line = refused("probe", "build", "--pack", "x", "--out", run / "trials" / "probes.jsonl")
    assert "trials" in line


def _refuse_writes_under(monkeypatch, root: Path) -> list[str]:
    """Make every write, create, rename or delete under `root` fail like a read-only folder would
    (root ignores file modes, so chmod cannot test this); the refused paths are recorded."""
    root = Path(root).resolve()
    tried: list[str] = []

    def under(path) -> bool:
        try:
            return Path(os.fspath(path)).resolve().is_relative_to(root)
        except (TypeError, ValueError):
            return False

    def deny(path):
        tried.append(str(path))
        raise PermissionError(13, "Read-only file system (test)", str(path))

    real_open, real_os_open = builtins.open, os.open

    def fake_open(file, mode="r", *a, **k):
        if isinstance(file, (str, bytes, os.PathLike)) and any(c in mode for c in "wax+") and under(file):
            deny(file)
        return real_open(file, mode, *a, **k)

    def fake_os_open(path, flags, *a, **k):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND) and under(path):
            deny(path)
        return real_os_open(path, flags, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    for name in ("replace", "rename", "unlink", "remove", "mkdir", "rmdir", "truncate"):
        real = getattr(os, name)

        def guarded(path, *a, _real=real, **k):
            if under(path) or (a and isinstance(a[0], (str, os.PathLike)) and under(a[0])):
                deny(path)
            return _real(path, *a, **k)

        monkeypatch.setattr(os, name, guarded)
    return tried


def test_read_run_writes_nothing_into_the_run(tmp_path, tiny_dirs, monkeypatch):
    run = write_run(tmp_path, FLAGS)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    tried = _refuse_writes_under(monkeypatch, run)
    out = tmp_path / "read_out"
    res = runner.invoke(app, ["read", str(tiny_dirs["qwen3"]), "--run", str(run), "--out", str(out), "--bootstrap",
                              "20", "--no-progress", "--no-probe", "--threads", "1"])
    monkeypatch.undo()
    assert res.exit_code == 0, (res.output, res.exception, tried)
    assert tried == []
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert json.loads((out / "summary.json").read_text())["run"]["n_flagged"] == 3


# ------------------------------------------------------------------ 4. CSV cells

def test_lens_tables_hold_no_formula_cell(tmp_path):
    choice = pd.DataFrame([{"metric": "=HYPERLINK(\"http://x\")", "readout": "+logit", "position": "@decision",
                            "emergence_layer": None, "best_layer_in_sample": 1, "best_auroc_in_sample": -0.5,
                            "nested_auroc": 0.5, "nested_layers": "1,1"}])
    baselines = pd.DataFrame([{"baseline": "-length", "score": "=1+1", "auroc": 0.5, "ci_lo": 0.4, "ci_hi": 0.6,
                               "auroc_within": 0.5, "within_lo": 0.4, "within_hi": 0.6}])
    table = pd.DataFrame(columns=["metric", "readout", "position_class", "layer", "auroc"])
    margins = pd.DataFrame([{"example_id": "-1+1", "label": True, "m_E": -1.0}])
    files = report.write_outputs(tmp_path, margins, margins, table, choice, baselines, {"n_examples": 1}, title="t")
    back = pd.read_csv(files["layers"]).iloc[0]
    assert back["metric"] == "'=HYPERLINK(\"http://x\")" and back["readout"] == "'+logit"
    assert back["position"] == "'@decision" and back["best_auroc_in_sample"] == -0.5  # numbers stay numbers
    base = pd.read_csv(files["baselines"]).iloc[0]
    assert base["baseline"] == "'-length" and base["score"] == "'=1+1" and base["auroc"] == 0.5
    assert json.loads(Path(files["summary"]).read_text())["n_examples"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_run_examples_hold_trials_against_their_done_marker(tmp_path):
    """A finished trial whose rows were cut is an error naming its marker (as in `lhd report`),
    never a shorter trial read as whole."""
    from lhd_train.reading.runs import load_run_examples

    run = write_run(tmp_path, FLAGS)
    rows = (run / "trials" / "s0.jsonl").read_text().splitlines(keepends=True)
    (run / "trials" / "s0.done").write_text(json.dumps({"finished_at": "2026-01-01T00:00:00Z", "rounds": 4}))
    (run / "trials" / "s0.jsonl").write_text("".join(rows[:2]))
    with pytest.raises(DataFileError, match=r"s0\.done.*finished with 4 rounds.*has 2"):  # lhd's, unchanged
        load_run_examples(run)
    (run / "trials" / "s0.done").unlink()  # an unfinished trial (a run in progress): what is there is read
    _, info = load_run_examples(run)
    assert info["n_rows"] == 2 + 4
