"""Issue 14: nothing lost, nothing doubled, no tracebacks.

Each test reproduces one probe of the adversarial pass on a real run of the tiny random model: a
second writer on a run directory, files deleted, torn or corrupt, broken models, path-escaping
names. Every command is called through `lhd_train.cli.main` (in process, or as a subprocess where
two processes are the point) and must end with exit 2 and one `error:` line naming the file, never
a Python traceback; the files it was given are left byte for byte as they were."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import yaml

from lhd_train.io.files import read_jsonl

RUN = "h"  # run_name of every run in this file
SEED = 11


# ----------------------------------------------------------------------------- helpers


def write_config(path: Path, model: Path | str, output_dir: Path, **kw) -> Path:
    """One trial of two tasks, short answers, one segment: a whole run takes seconds."""
    cfg = {
        "run_name": RUN, "output_dir": str(output_dir), "task_pack": "lhd_startup_consulting",
        "seeds": [SEED], "max_tasks": 2, "concurrency": 1, "memory_window": 2,
        "models": {"tiny": {"backend": "hf", "model": str(model), "max_batch_size": 4}},
        "performer": {"model": "tiny", "max_segments": 1, "sampling": {"temperature": 1.0, "max_tokens": 16}},
        "supervisor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 96}},
        "summariser": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 16}},
    }
    for k, v in kw.items():
        cfg[k] = v
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    """`lhd ARGS` in this process: (exit status, stdout + stderr). An exception that escapes
    `main()` is what a user would see as a traceback: returned as status 99 with the traceback."""
    from lhd_train import cli as cli_mod

    monkeypatch.setattr(sys, "argv", ["lhd", *args])
    capsys.readouterr()
    try:
        cli_mod.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the point: nothing may escape as a traceback
        out = capsys.readouterr()
        return 99, out.out + out.err + traceback.format_exc()
    out = capsys.readouterr()
    return code, out.out + out.err


def one_error(code: int, out: str, *needles: str) -> str:
    """Exit 2, no traceback, and an `error:` line holding every needle. Returns that line."""
    assert code == 2, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, out
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (but the lock file, whose holder line changes) by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


ESSENCE = ("trial_id", "task_index", "round", "global_round", "event", "task_complete")


def essence(run_dir: Path) -> dict[str, object]:
    """What a run computed, without timings: every row's place, texts, tokens, states, and the
    message store's ids."""
    out: dict[str, object] = {}
    for p in sorted((run_dir / "trials").glob("*.jsonl")):
        if p.name.endswith(".messages.jsonl"):
            out[p.name] = sorted(r["id"] for r in read_jsonl(p))
            continue
        rows = []
        for r in read_jsonl(p):
            sup = r["supervisor"]
            rows.append({**{k: r[k] for k in ESSENCE},
                         "text": r["performer"]["text"], "token_ids": r["performer"]["token_ids"],
                         "message_ids": r["performer"]["message_ids"],
                         "sup": [sup["evaluation"], sup["feedback"], sup["state_before"], sup["state_after"],
                                 sup["parse_status"], [c["raw"] for c in sup["calls"]]]})
        out[p.name] = rows
    return out


@pytest.fixture(scope="module")
def lone(tmp_path_factory, tiny_llama_dir) -> Path:
    """A finished run, made once (in this process) and copied by every test that changes it."""
    from lhd_train.bench.engine import run_benchmark
    from lhd_train.config.run import load_config

    base = tmp_path_factory.mktemp("lone")
    cfg_path = write_config(base / "run.yaml", tiny_llama_dir, base / "runs")
    res = asyncio.run(run_benchmark(load_config(cfg_path), progress=False))
    assert [r.status for r in res] == ["done"], res
    return base / "runs" / RUN


@pytest.fixture
def copy(lone, tmp_path, tiny_llama_dir) -> tuple[Path, Path]:
    """(config path, run dir): a copy of the lone run that a rerun of the config resumes."""
    shutil.copytree(lone, tmp_path / "runs" / RUN)
    return write_config(tmp_path / "run.yaml", tiny_llama_dir, tmp_path / "runs"), tmp_path / "runs" / RUN


def trial_file(run_dir: Path, suffix: str = ".jsonl") -> Path:
    return run_dir / "trials" / f"s{SEED}{suffix}"


def unfinish(run_dir: Path, drop_last: bool = True) -> None:
    """Make the trial resumable: no done marker, and (by default) its last round not yet written."""
    trial_file(run_dir, ".done").unlink()
    if drop_last:
        p = trial_file(run_dir)
        lines = p.read_text().splitlines(keepends=True)
        p.write_text("".join(lines[:-1]))


def lhd_proc(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "lhd_train.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


# ----------------------------------------------------------------------------- 1. one writer per run


def test_a_second_run_on_the_same_directory_is_refused(lone, tmp_path, tiny_llama_dir):
    """Two real `lhd run` processes on one directory: the second is refused naming the first's PID;
    the first's results are those of a lone run (before: both ran, every trial had duplicated rounds)."""
    cfg = write_config(tmp_path / "run.yaml", tiny_llama_dir, tmp_path / "runs")
    run_dir = tmp_path / "runs" / RUN
    first = lhd_proc("run", str(cfg), "--no-progress")
    deadline = time.time() + 120
    while not (run_dir / "trials").is_dir() and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    second = lhd_proc("run", str(cfg), "--no-progress")
    out2, _ = second.communicate(timeout=300)
    out1, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out1
    one_error(second.returncode, out2, str(run_dir), f"PID {first.pid}")
    assert essence(run_dir) == essence(lone)


HOLD = """
import sys, time
from pathlib import Path
from lhd_train.rundir.lock import run_dir_lock
with run_dir_lock(Path(sys.argv[1]), stage="test holder"):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def held(copy):
    """The copied run directory, locked by another process for the length of the test."""
    cfg, run_dir = copy
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if "locked" not in line:
        proc.kill()
        raise AssertionError(line + proc.stdout.read())
    yield cfg, run_dir, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_every_writing_stage_refuses_a_locked_run(held, monkeypatch, capsys, tmp_path, tiny_llama_dir):
    cfg, run_dir, holder = held
    before = snapshot(run_dir)
    pid = f"PID {holder.pid}"
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), pid, "test holder")
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "auditor.model=tiny", "--no-progress"), pid)
    one_error(*cli(monkeypatch, capsys, "data", "dpo", str(run_dir), "auditor.model=tiny", "--n", "2",
                   "--out", str(tmp_path / "d")), pid)
    one_error(*cli(monkeypatch, capsys, "merge", str(run_dir), "--out", str(tmp_path / "merged")), pid)
    # `lens read --run` only reads (finished trials, by their .done markers) and writes into --out, so
    # it runs beside a writer, as on a read-only run, and leaves the run as it was.
    code, out = cli(monkeypatch, capsys, "lens", "read", str(tiny_llama_dir), "--run", str(run_dir),
                    "--out", str(tmp_path / "lens"), "--no-progress")
    assert code == 0 and "Traceback" not in out, out
    assert snapshot(run_dir) == before
    assert not (tmp_path / "merged").exists()  # a refused merge leaves --out as it was

    from lhd_train.rundir.lock import run_dir_lock

    holder.send_signal(signal.SIGKILL)  # a crash releases the lock: nothing stale is left behind
    holder.wait()
    with run_dir_lock(run_dir, stage="test"):
        pass


def test_json_files_are_replaced_through_unique_temp_names(tmp_path, monkeypatch):
    """Two writers of one file must not share a temp name (before: `<name>.tmp` for everyone)."""
    from lhd_train.io import files

    seen = []
    real = os.replace

    def spy(src, dst):
        seen.append(str(src))
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", spy)
    files.write_json_atomic(tmp_path / "a.json", {"x": 1})
    files.write_json_atomic(tmp_path / "a.json", {"x": 2})
    assert len(set(seen)) == 2
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_readers_refuse_a_round_written_twice(copy, monkeypatch, capsys, tmp_path):
    cfg, run_dir = copy
    p = trial_file(run_dir)
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines + [lines[0]]))
    before = snapshot(run_dir)
    n = len(lines) + 1
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "rep")),
              str(p), f"line {n}", "line 1")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(p), f"line {n}")
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "auditor.model=tiny", "--no-progress"),
              str(p), f"line {n}")
    assert snapshot(run_dir) == before


# ----------------------------------------------------------------------------- 2. done marker vs rows


def test_a_done_marker_without_its_rows_is_an_error(copy, monkeypatch, capsys):
    cfg, run_dir = copy
    trial_file(run_dir).unlink()
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"),
              str(trial_file(run_dir, ".done")), f"s{SEED}.jsonl")
    assert trial_file(run_dir, ".done").exists()  # left as it was


def test_a_marker_that_disagrees_with_the_rows_is_an_error(copy, monkeypatch, capsys):
    cfg, run_dir = copy
    p = trial_file(run_dir)
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:-1]))
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(trial_file(run_dir, ".done")))
    # An old-style marker (a timestamp only) is checked against the rows themselves.
    trial_file(run_dir, ".done").write_text("2025-01-01T00:00:00\n")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(trial_file(run_dir, ".done")))


def test_a_report_refuses_a_finished_trial_whose_rows_are_gone(copy):
    """Before (issue 31): a note in summary.md and a report of the other trials; now the `.done`
    rule of `lhd run` (tests/rundir/test_lost_trials.py holds every reader to it)."""
    from lhd_train.errors import DataFileError
    from lhd_train.metrics.load import load_run

    _, run_dir = copy
    trial_file(run_dir).unlink()
    with pytest.raises(DataFileError, match=f"marks trial s{SEED} finished"):
        load_run(run_dir)


# ----------------------------------------------------------------------------- 3. a failed start


def test_a_failed_start_does_not_pin_the_config(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    typo = write_config(tmp_path / "typo.yaml", tmp_path / "no-such-model", tmp_path / "runs")
    one_error(*cli(monkeypatch, capsys, "run", str(typo), "--no-progress"), str(tmp_path / "no-such-model"))
    good = write_config(tmp_path / "good.yaml", tiny_llama_dir, tmp_path / "runs", max_tasks=1)
    code, out = cli(monkeypatch, capsys, "run", str(good), "--no-progress")
    assert code == 0, out
    saved = yaml.safe_load((tmp_path / "runs" / RUN / "config.resolved.yaml").read_text())
    assert saved["models"]["tiny"]["model"] == str(tiny_llama_dir)


# ----------------------------------------------------------------------------- 4. broken models


def _truncate_weights(d: Path) -> None:
    w = d / "model.safetensors"
    with open(w, "r+b") as f:
        f.truncate(w.stat().st_size // 2)


def _break_config(d: Path) -> None:
    (d / "config.json").write_text('{"model_type": "llama",')


def _drop_tokenizer(d: Path) -> None:
    for p in d.iterdir():
        if p.name.startswith("tokenizer") or p.name in ("chat_template.jinja", "special_tokens_map.json"):
            p.unlink()


def _empty(d: Path) -> None:
    for p in d.iterdir():
        p.unlink()


BROKEN = {"truncated-weights": (_truncate_weights, "model.safetensors"),
          "broken-config": (_break_config, "config.json"),
          "no-tokenizer": (_drop_tokenizer, "tokenizer"), "empty-folder": (_empty, "config.json")}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_model_folder_is_one_line(case, tmp_path, monkeypatch, capsys, tiny_llama_dir):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    breaker, needle = BROKEN[case]
    breaker(model)
    cfg = write_config(tmp_path / "run.yaml", model, tmp_path / "runs")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(model), needle)


def _template_syntax(model: Path) -> str:
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }{% endfor %}")
    return "chat_template.jinja, line 1"


def _template_raises(model: Path) -> str:
    """The template lives in tokenizer_config.json and raises (as templates refusing a role do)."""
    (model / "chat_template.jinja").unlink()
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('this template accepts no system message') }}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return "tokenizer_config.json (field 'chat_template')"


@pytest.mark.parametrize("breaker", [_template_syntax, _template_raises])
def test_a_broken_chat_template_is_one_line_naming_the_file(breaker, tmp_path, monkeypatch, capsys, tiny_llama_dir):
    """Before: the trial failed with 'TemplateSyntaxError: unexpected ...' and the run said to run
    the same command again to resume, which can never help."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    needle = breaker(model)
    cfg = write_config(tmp_path / "run.yaml", model, tmp_path / "runs")
    line = one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(model / needle.split()[0]),
                     needle, "chat template")
    assert "resume" not in line


def test_a_failing_chat_template_outside_a_run_is_one_line(monkeypatch, capsys):
    """`lhd train` and `lhd audit` apply templates through TRL and the backends: guarded() turns a
    template error that escapes them into one line (no traceback, no "rerun to resume")."""
    import jinja2

    from lhd_train.cli import guarded

    def body():
        jinja2.Environment().from_string("{{ x }").render()

    assert guarded(body) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "chat template" in err and "resume" not in err and len(err.splitlines()) == 1


def test_missing_adapter_and_unset_key_are_one_line(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    cfg = write_config(tmp_path / "run.yaml", tiny_llama_dir, tmp_path / "runs")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress",
                   f"performer.adapter={tmp_path / 'no-adapter'}"), str(tmp_path / "no-adapter"))
    monkeypatch.delenv("LHD_TEST_UNSET_KEY", raising=False)
    api = {"backend": "openai", "model": "served", "base_url": "http://127.0.0.1:9/v1",
           "api_key_env": "LHD_TEST_UNSET_KEY"}
    cfg = write_config(tmp_path / "api.yaml", tiny_llama_dir, tmp_path / "runs2",
                       models={"tiny": {"backend": "hf", "model": str(tiny_llama_dir)}, "api": api},
                       supervisor={"model": "api"})
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), "LHD_TEST_UNSET_KEY")


def test_a_recipe_on_a_corrupt_model_is_one_line(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    from datasets import Dataset

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    _truncate_weights(model)
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    Dataset.from_list([{"messages": msgs}] * 4).save_to_disk(str(tmp_path / "ds"))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "sft-honest.yaml"
    one_error(*cli(monkeypatch, capsys, "train", "sft", str(recipe), f"model={model}", f"data.train={tmp_path / 'ds'}",
                   f"output_dir={tmp_path / 'out'}"), str(model), "model.safetensors")


# ----------------------------------------------------------------------------- 5. corrupt JSONL


def _insert(path: Path, lineno: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(lineno - 1, text)
    path.write_text("".join(lines))


def test_a_garbage_line_in_trial_rows(copy, monkeypatch, capsys, tmp_path):
    cfg, run_dir = copy
    p = trial_file(run_dir)
    _insert(p, 2, "{garbage\n")
    before = snapshot(run_dir)
    line = one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(p), "line 2")
    assert "lhd run" in line  # the safe repair is offered
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "rep")), str(p), "line 2")
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "auditor.model=tiny", "--no-progress"), str(p), "line 2")
    assert snapshot(run_dir) == before


def test_a_garbage_line_in_the_message_store(copy, monkeypatch, capsys):
    cfg, run_dir = copy
    unfinish(run_dir)
    p = trial_file(run_dir, ".messages.jsonl")
    _insert(p, 3, "not json\n")
    before = snapshot(run_dir)
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(p), "line 3")
    assert snapshot(run_dir) == before


def test_a_garbage_line_in_audit_rows(copy, monkeypatch, capsys, tmp_path):
    from support.synthetic import audit_row

    _, run_dir = copy
    p = run_dir / "audit" / "a" / f"s{SEED}.jsonl"
    p.parent.mkdir(parents=True)
    rows = [json.dumps(audit_row(f"s{SEED}", g, deceptive=False)) + "\n" for g in (1, 2, 3)]
    p.write_text(rows[0] + "][\n" + rows[1] + rows[2])
    before = snapshot(run_dir)
    line = one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "rep")),
                     str(p), "line 2")
    assert "delete line 2" in line
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("field", ["performer", "global_round"])
def test_a_row_without_a_required_field(field, copy, monkeypatch, capsys, tmp_path):
    cfg, run_dir = copy
    p = trial_file(run_dir)
    rows = read_jsonl(p)
    del rows[1][field]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = snapshot(run_dir)
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(p), "line 2", field)
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "rep")), str(p), "line 2",
              field)
    assert snapshot(run_dir) == before


# ----------------------------------------------------------------------------- 6. weights, tiny-model --force


def test_resume_refuses_changed_weights(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model"
    code, out = cli(monkeypatch, capsys, "tiny-model", "--arch", "llama", "--out", str(model))
    assert code == 0, out
    cfg = write_config(tmp_path / "run.yaml", model, tmp_path / "runs", max_tasks=1)
    code, out = cli(monkeypatch, capsys, "run", str(cfg), "--no-progress")
    assert code == 0, out
    run_dir = tmp_path / "runs" / RUN
    unfinish(run_dir)
    weights = (model / "model.safetensors").read_bytes()
    # Building over an existing model is refused without --force ...
    one_error(*cli(monkeypatch, capsys, "tiny-model", "--arch", "llama", "--out", str(model), "--seed", "1"),
              str(model), "--force")
    assert (model / "model.safetensors").read_bytes() == weights
    # ... and with it, the new weights are not mixed into the old trial.
    code, out = cli(monkeypatch, capsys, "tiny-model", "--arch", "llama", "--out", str(model), "--seed", "1", "--force")
    assert code == 0, out
    assert (model / "model.safetensors").read_bytes() != weights
    before = snapshot(run_dir)
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(model), "weights")
    assert snapshot(run_dir) == before


# ----------------------------------------------------------------------------- 7. names that become paths


@pytest.mark.parametrize("name", ["..", ".", "a/b", ".hidden"])
def test_names_that_would_leave_their_folder_are_refused(name, tmp_path, monkeypatch, capsys, tiny_llama_dir):
    cfg = write_config(tmp_path / "out" / "run.yaml", tiny_llama_dir, tmp_path / "out" / "runs")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), f"run_name={name}", "--no-progress"), "run_name")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run.yaml"]
    from lhd_train.config.auditor import AuditOptions
    from lhd_train.errors import InputError

    with pytest.raises(InputError, match="auditor-id"):
        AuditOptions(auditor_id=name)


# ----------------------------------------------------------------------------- 8. the rest


def test_corrupt_run_files_are_one_line(copy, monkeypatch, capsys):
    cfg, run_dir = copy
    saved = (run_dir / "config.resolved.yaml").read_text()
    (run_dir / "config.resolved.yaml").write_text("models: [unclosed\n")
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(run_dir / "config.resolved.yaml"))
    (run_dir / "config.resolved.yaml").write_text(saved)
    sched = run_dir / "schedules" / f"s{SEED}.json"
    sched.write_text('{"entries": [')
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(sched))


def test_a_corrupt_auditor_json_is_one_line(copy, monkeypatch, capsys):
    _, run_dir = copy
    aj = run_dir / "audit" / "a" / "auditor.json"
    aj.parent.mkdir(parents=True)
    aj.write_text('{"schema": ')
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "auditor.model=tiny", "--auditor-id", "a",
                   "--no-progress"), str(aj))


def test_a_missing_message_store_is_one_line(copy, monkeypatch, capsys):
    cfg, run_dir = copy
    unfinish(run_dir)
    trial_file(run_dir, ".messages.jsonl").unlink()
    one_error(*cli(monkeypatch, capsys, "run", str(cfg), "--no-progress"), str(trial_file(run_dir, ".messages.jsonl")))


def test_corrupt_lens_files_are_lens_errors(tmp_path, monkeypatch, capsys, tiny_llama_dir):
    from lens.errors import LensError
    from lens.store import load_lens

    d = tmp_path / "lens"
    d.mkdir()
    (d / "lens.json").write_text('{"format": ')
    (d / "lens.safetensors").write_bytes(b"")
    with pytest.raises(LensError, match="lens.json"):
        load_lens(d)
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"paragraph {i} " * 20 for i in range(4)))
    fit = tmp_path / "fit"
    fit.mkdir()
    (fit / "checkpoint.pt").write_bytes(b"\x80\x02torn")
    one_error(*cli(monkeypatch, capsys, "lens", "fit", str(tiny_llama_dir), "--corpus", str(tmp_path / "corpus.txt"),
                   "--out", str(fit), "--n-prompts", "2", "--max-length", "24", "--skip-first", "0",
                   "--no-progress"), str(fit / "checkpoint.pt"))


def test_a_torn_trainer_state_falls_back_to_the_previous_checkpoint(tmp_path):
    from lhd_train.finetune.checkpoints import resume_checkpoint

    for step, state in ((2, '{"global_step": 2}'), (4, '{"global_step": 4}'), (6, '{"global_st')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    assert resume_checkpoint(tmp_path) == tmp_path / "checkpoint-4"


def test_data_options_are_checked_before_any_model_loads(copy, monkeypatch, capsys, tmp_path):
    _, run_dir = copy
    # A model that cannot load: an option error must come first.
    cfg_path = run_dir / "config.resolved.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["models"]["tiny"]["model"] = str(tmp_path / "gone")
    cfg_path.write_text(yaml.safe_dump(cfg))
    one_error(*cli(monkeypatch, capsys, "data", "dpo", str(run_dir), "auditor.model=tiny", "--n", "0",
                   "--out", str(tmp_path / "d")), "--n")
    one_error(*cli(monkeypatch, capsys, "data", "bon", str(run_dir), "auditor.model=tiny", "--eval-fraction", "2",
                   "--out", str(tmp_path / "d")), "--eval-fraction")
    one_error(*cli(monkeypatch, capsys, "data", "grpo", str(run_dir), "--eval-fraction", "-0.1",
                   "--out", str(tmp_path / "d")), "--eval-fraction")


# ----------------------------------------------------------------------------- progress and logs


def test_a_resumed_run_starts_its_progress_bar_at_the_work_done(copy, capsys):
    from lhd_train.bench.engine import run_benchmark
    from lhd_train.config.run import load_config

    cfg, run_dir = copy
    rows = read_jsonl(trial_file(run_dir))
    unfinish(run_dir)
    done_before = len({r["task_index"] for r in rows[:-1] if r["task_complete"] or r["round"] >= 3})
    assert done_before >= 1
    capsys.readouterr()
    asyncio.run(run_benchmark(load_config(cfg), progress=True))
    # tqdm draws the bar when it is created: that first frame must show the tasks already done.
    frames = [f for f in capsys.readouterr().err.split("\r") if "/2 [" in f]
    assert frames and f"{done_before}/2 [" in frames[0], frames[:2]


def test_tables_keep_their_width_in_a_log(monkeypatch, capsys):
    from lhd_train.bench.trial import TrialResult
    from lhd_train.cli.run import print_summary

    monkeypatch.delenv("COLUMNS", raising=False)
    print_summary([TrialResult("s390185437-cat-AUTHORITY_DIRECTIVE-lvl-CRITICAL", 1, rounds=40, tasks_done=14,
                               final_state={"trust": 0.1, "satisfaction": 0.2, "comfort": 0.3}, tokens=123456789)])
    out = capsys.readouterr().out
    assert "…" not in out, out
    for col in ("status", "rounds", "tasks done", "completed", "satisf.", "comfort", "tokens"):
        assert col in out, out


# ----------------------------------------------------------------------------- 6. secrets


KEY = "sk-test-0123456789abcdef"  # the API key's value: never printed or written
URL_SECRETS = ("alice", "pw-5678-secret", "qkey-9999")


@pytest.fixture
def echo_server():
    """A real HTTP server on 127.0.0.1 that answers every request with 401 (or, for a path holding
    `/fail5/`, 503) and a body that echoes the request's line and headers, as some proxies do."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Echo(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("content-length") or 0))
            body = json.dumps({"error": {"message": f"bad request {self.requestline}; headers: {dict(self.headers)}"}})
            self.send_response(503 if "/fail5/" in self.path else 401)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.mark.parametrize("path", ["/v1", "/fail5/v1"])
def test_a_server_echoing_the_key_never_puts_it_on_disk_or_the_terminal(path, echo_server, tmp_path,
                                                                         monkeypatch, capsys):
    """Before: the 401 body (with `Authorization: Bearer <key>`) went into summary.json and onto the
    terminal, and the URL's user:password and ?key= into config.resolved.yaml and manifest.json."""
    monkeypatch.setenv("LHD_TEST_KEY", KEY)
    url = f"http://{URL_SECRETS[0]}:{URL_SECRETS[1]}@127.0.0.1:{echo_server}{path}?key={URL_SECRETS[2]}"
    spec = {"backend": "openai", "model": "remote-model", "base_url": url, "api_key_env": "LHD_TEST_KEY",
            "max_retries": 0, "timeout_s": 30}
    cfg = write_config(tmp_path / "run.yaml", "unused", tmp_path / "runs", models={"tiny": spec})
    code, out = cli(monkeypatch, capsys, "run", str(cfg), "--no-progress")
    assert code != 99, out
    written = {str(p): p.read_text(errors="replace") for p in (tmp_path / "runs").rglob("*") if p.is_file()}
    assert any(p.endswith("summary.json") and ("401" in t or "503" in t) for p, t in written.items()), written.keys()
    assert any(p.endswith("manifest.json") for p in written)
    for secret in (KEY, *URL_SECRETS):
        assert secret not in out, (secret, out)
        for p, text in written.items():
            assert secret not in text, (secret, p)
    saved = yaml.safe_load((tmp_path / "runs" / RUN / "config.resolved.yaml").read_text())
    assert saved["models"]["tiny"]["base_url"] == f"http://127.0.0.1:{echo_server}{path}?key=***"
    # the resume compares like with like: the same config (with its credentials) is not "a different config"
    code, out = cli(monkeypatch, capsys, "run", str(cfg), "--no-progress")
    assert "different config" not in out, out


# ----------------------------------------------------------------------------- follow-ups


def test_a_separate_tokenizer_folder_is_fingerprinted_for_resume(tmp_path, tiny_llama_dir):
    """`tokenizer:` names a folder apart from the model's (openai, vllm): its files and chat template
    shape every prompt, so a resume after they changed is refused like changed weights."""
    from lhd_train.bench.engine import RUN_ROLES, _check_weights, model_weights
    from lhd_train.config.run import parse_config
    from lhd_train.errors import InputError

    tok = tmp_path / "tok"
    shutil.copytree(tiny_llama_dir, tok)
    cfg = parse_config({"run_name": RUN, "output_dir": str(tmp_path / "runs"), "seeds": [1],
                        "models": {"m": {"backend": "vllm", "model": str(tiny_llama_dir), "tokenizer": str(tok)}},
                        "performer": {"model": "m"}, "supervisor": {"model": "m"}}, "test")
    run_dir = tmp_path / "runs" / RUN
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"weights": model_weights(cfg, RUN_ROLES)}))
    _check_weights(run_dir, model_weights(cfg, RUN_ROLES))  # nothing changed
    (tok / "chat_template.jinja").write_text((tok / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(InputError, match=r"weights.tokenizer:m.*chat template at .*tok changed"):
        _check_weights(run_dir, model_weights(cfg, RUN_ROLES))
