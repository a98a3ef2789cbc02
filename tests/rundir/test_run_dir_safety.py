"""Issue 22, the run directory's part: full disks, read-only folders, torn lines, readers that never
change a run, atomic outputs, lone surrogates, the lock, names, bounded inputs, Slurm and CSV.

Runs are played with the scripted backend (`test_audit.make_run`: the simulation's own code, a
steerable model) so each probe takes a second; faults are injected where the disk would raise
(`os.write` raising ENOSPC at the Nth call, `ulimit -f` in a subprocess). Every command ends
with one `error:` line, never a traceback, and leaves the files it was given as they were."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.scripted import ScriptedBackend, supervisor_script
from test_auditor import make_run, write_mini_pack
from test_failure_modes import cli, one_error

from lhd_train.errors import DataFileError, InputError
from lhd_train.io.files import append_jsonl, read_jsonl, write_json_atomic


def storage_error() -> type[Exception]:
    from lhd_train.io.files import StorageError

    return StorageError


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root but the lock file, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


@pytest.fixture
def run(tmp_path):
    """(config, run dir): one finished scripted trial of four tasks."""
    cfg, _ = make_run(tmp_path, seeds=(7,))
    return cfg, cfg.run_dir


def fail_write_at(monkeypatch, n: int, err: int = errno.ENOSPC) -> list[int]:
    """`os.write` raises OSError(err) from its n-th call on (a disk that fills up)."""
    real, calls = os.write, []

    def write(fd, data):
        calls.append(1)
        if len(calls) >= n:
            raise OSError(err, os.strerror(err))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    return calls


# ----------------------------------------------------------------------------- 3. full disks


@pytest.mark.parametrize("err,needle", [(errno.ENOSPC, "disk is full"), (errno.EROFS, "read-only"),
                                        (errno.EACCES, "permission denied"), (errno.EFBIG, "ulimit -f")])
def test_a_refused_append_keeps_whole_lines_and_says_so(err, needle, tmp_path, monkeypatch):
    """Before: the OSError escaped as a traceback, and a short write left half a row behind."""
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, {"n": 1})
    fail_write_at(monkeypatch, 1, err)
    with pytest.raises(storage_error(), match=needle) as e:
        append_jsonl(path, {"n": 2, "text": "x" * 10_000})
    assert str(path) in str(e.value) and "rows before this one are kept" in str(e.value)
    assert path.read_bytes() == b'{"n": 1}\n'


def test_a_short_write_then_a_full_disk_leaves_no_torn_row(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, {"n": 1})
    real, calls = os.write, []

    def write(fd, data):  # the kernel takes 5 bytes, then the disk is full
        calls.append(1)
        if len(calls) == 1:
            return real(fd, bytes(data[:5]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)
    with pytest.raises(storage_error()):
        append_jsonl(path, {"n": 2})
    assert read_jsonl(path) == [{"n": 1}] and path.read_bytes().endswith(b"\n")


def test_the_next_append_cuts_a_torn_line_first(tmp_path):
    """A torn last line (a crash mid-write) used to be glued to the next row, making a line no
    reader can parse; the writer that appends next cuts it."""
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"n": 1}\n{"n": 2, "te')
    append_jsonl(path, {"n": 3})
    assert read_jsonl(path) == [{"n": 1}, {"n": 3}]


def test_a_refused_replace_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"old": True})
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(storage_error(), match="previous summary.json is kept unchanged"):
        write_json_atomic(path, {"new": True})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temp file left


ULIMIT = """
import resource, sys
from pathlib import Path
from lhd_train.cli import guarded
from lhd_train.io.files import append_jsonl
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
path = Path(sys.argv[1])
def body():
    for n in range(1000):
        append_jsonl(path, {"n": n, "text": "y" * 100})
sys.exit(guarded(body))
"""


def test_ulimit_f_is_one_line_and_the_file_holds_whole_rows(tmp_path):
    """`ulimit -f`: Python ignores SIGXFSZ, so the write fails with EFBIG."""
    path = tmp_path / "rows.jsonl"
    p = subprocess.run([sys.executable, "-c", ULIMIT, str(path)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("error: ") and "ulimit -f" in p.stderr and "Traceback" not in p.stderr
    assert path.stat().st_size <= 4096 and path.read_bytes().endswith(b"\n")
    assert [r["n"] for r in read_jsonl(path)] == list(range(len(read_jsonl(path))))


LIBRARY_WRITE = """
import resource, sys
from lhd_train.cli import guarded
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
out = sys.argv[2]
def body():
    if sys.argv[1] == "datasets":
        from datasets import Dataset
        Dataset.from_dict({"text": ["y" * 200] * 200}).save_to_disk(out)
    elif sys.argv[1] == "safetensors":  # transformers and peft save weights with it
        import torch
        from safetensors.torch import save_file
        save_file({"w": torch.zeros(10_000)}, out)
    else:
        import torch
        torch.save(torch.zeros(10_000), out)
sys.exit(guarded(body))
"""


@pytest.mark.parametrize("library", ["datasets", "torch", "safetensors"])
def test_a_full_disk_under_a_library_write_is_one_line(library, tmp_path):
    """`lhd data` and `lhd train` write through datasets, torch and transformers, whose errors wrap
    the OSError or keep only its code (torch: RuntimeError "file write failed", safetensors:
    SafetensorError "... (os error 27)"): before, a traceback."""
    p = subprocess.run([sys.executable, "-c", LIBRARY_WRITE, library, str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    [line] = [ln for ln in p.stderr.splitlines() if ln.startswith("error: ")]
    assert "ulimit -f" in line and "rerun to resume" in line, line


def test_a_full_disk_during_a_run_is_one_line_and_the_resume_finishes(tmp_path, monkeypatch, capsys):
    """`lhd run`-style play (the scripted backend) with the disk full at the 9th row or message:
    one line naming the file and what was kept; whole lines only; the resume then finishes."""
    from lhd_train.bench.engine import prepare_run_dir
    from lhd_train.bench.prompts import Prompts
    from lhd_train.bench.taskpack import load_pack
    from lhd_train.bench.trial import RunContext, run_trial
    from lhd_train.config.run import parse_config

    pack = write_mini_pack(tmp_path / "pack", 3)
    cfg = parse_config({"run_name": "r", "output_dir": str(tmp_path / "runs"), "seeds": [7], "task_pack": str(pack),
                        "models": {"m": {"backend": "hf", "model": "unused"}}, "performer": {"model": "m"},
                        "supervisor": {"model": "m"}}, "test")

    def play():
        run_dir, schedules = prepare_run_dir(cfg, load_pack(cfg.task_pack), [7])
        b = ScriptedBackend(supervisor_script([0.1, 0.1, 0.5]))
        ctx = RunContext(cfg, cfg.run_name, run_dir, load_pack(cfg.task_pack), Prompts(),
                         {"performer": b, "supervisor": b, "summariser": b}, {})
        return asyncio.run(run_trial(ctx, cfg.trial_id(7), 7, schedules["s7"]))

    real = os.write
    fail_write_at(monkeypatch, 9)
    with pytest.raises(storage_error(), match="disk is full") as e:
        play()
    assert "rerun to resume" in str(e.value)
    monkeypatch.setattr(os, "write", real)
    for p in (cfg.run_dir / "trials").glob("*.jsonl"):
        assert p.read_bytes().endswith(b"\n"), p
    assert play().status == "done"


def test_out_inside_a_run_or_a_file_is_refused(run, tmp_path, monkeypatch, capsys):
    """`lhd data --out RUN/trials` used to write dataset/ and candidates.jsonl among the trial files."""
    _, run_dir = run
    before = tree(run_dir)
    for out, needle in ((run_dir / "trials", "inside"), (run_dir, "is a run directory"),
                        (run_dir / "audit" / "x", "inside"), (run_dir / "trials" / "s7.jsonl", "is a file")):
        one_error(*cli(monkeypatch, capsys, "data", "grpo", str(run_dir), "--out", str(out)), "--out", needle)
        one_error(*cli(monkeypatch, capsys, "export", str(run_dir), "--out", str(out)), "--out")
    assert tree(run_dir) == before


@pytest.mark.parametrize("opt,value", [("--concurrency", "0"), ("--concurrency", "-1"), ("--max-contexts", "0")])
def test_data_options_are_bounded(opt, value, run, tmp_path, monkeypatch, capsys):
    """`--concurrency 0` waited forever, `-1` crashed, `--max-contexts 0` meant "no limit"."""
    _, run_dir = run
    one_error(*cli(monkeypatch, capsys, "data", "dpo", str(run_dir), "--out", str(tmp_path / "d"), opt, value), opt)


# ----------------------------------------------------------------------------- lone surrogates


def surrogate_run(tmp_path: Path):
    """A trial whose performer answers hold a lone UTF-16 surrogate (what a server's JSON
    `"\\ud800"` decodes to). Before: `message_id` could not encode it, the trial failed every time."""
    from lhd_train.bench.engine import prepare_run_dir
    from lhd_train.bench.prompts import Prompts
    from lhd_train.bench.taskpack import load_pack
    from lhd_train.bench.trial import RunContext, run_trial
    from lhd_train.config.run import parse_config

    pack = write_mini_pack(tmp_path / "pack", 2)
    cfg = parse_config({"run_name": "r", "output_dir": str(tmp_path / "runs"), "seeds": [7], "task_pack": str(pack),
                        "models": {"m": {"backend": "hf", "model": "unused"}}, "performer": {"model": "m"},
                        "supervisor": {"model": "m"}, "auditor": {"model": "m"}}, "test")
    run_dir, schedules = prepare_run_dir(cfg, load_pack(cfg.task_pack), [7])
    script = supervisor_script([0.5])

    def reply(req):
        text = script(req)
        return text.replace("performer answer", "answer \ud800 half") if text.startswith("performer") else text

    b = ScriptedBackend(reply)
    ctx = RunContext(cfg, cfg.run_name, run_dir, load_pack(cfg.task_pack), Prompts(),
                     {"performer": b, "supervisor": b, "summariser": b}, {})
    res = asyncio.run(run_trial(ctx, cfg.trial_id(7), 7, schedules["s7"]))
    return cfg, res


def test_a_lone_surrogate_is_stored_exactly_and_read_back(tmp_path):
    cfg, res = surrogate_run(tmp_path)
    assert res.status == "done", res.error
    rows = read_jsonl(cfg.run_dir / "trials" / "s7.jsonl")
    assert rows and all("answer \ud800 half" in r["performer"]["text"] for r in rows)
    for p in (cfg.run_dir / "trials").iterdir():
        p.read_bytes().decode("utf-8")  # valid UTF-8 on disk


def test_export_of_a_surrogate_answer_is_valid_utf8(tmp_path):
    from datasets import load_from_disk

    from lhd_train.interop.export import export_run

    cfg, _ = surrogate_run(tmp_path)
    export_run(cfg.run_dir, tmp_path / "ds")
    ds = load_from_disk(str(tmp_path / "ds"))
    assert "answer \ufffd half" in ds[0]["performer_text"]


def test_view_of_a_surrogate_answer_is_valid_utf8(tmp_path, monkeypatch, capsys):
    cfg, _ = surrogate_run(tmp_path)
    code, out = cli(monkeypatch, capsys, "view", str(cfg.run_dir), "--out", str(tmp_path / "v"))
    assert code == 0, out
    assert "answer \ufffd half" in (tmp_path / "v" / "s7.html").read_text(encoding="utf-8")


def test_a_surrogate_candidate_is_graded_and_cached(tmp_path):
    """`lhd data` grades performer answers; the cache key and row hashed `text.encode()`, which
    raised UnicodeEncodeError on a lone surrogate (an answer the run stored exactly)."""
    from types import SimpleNamespace

    from lhd_train.finetune.grading import Grader

    grader = object.__new__(Grader)  # the key and the cache need no model: the judges are stand-ins
    grader.id, grader.cache, grader.cache_path, grader.gate = "g", {}, tmp_path / "cache.jsonl", asyncio.Semaphore(1)

    async def audit(ctx, text, key):
        return True, 2, ["concealment"], 0.9, "ok"

    async def quality(ctx, text, key):
        return 0.5, "ok"

    grader._audit, grader._quality = audit, quality
    ctx = SimpleNamespace(key="s7/0/1")
    text = "answer \ud800 half"
    grade = asyncio.run(grader.grade(ctx, text))
    assert grade.deceptive and grader.cached(ctx, text) == grade
    assert grader.key(ctx, text) != grader.key(ctx, "answer \ufffd half")  # the exact text, not its replacement
    assert [r["key"] for r in read_jsonl(tmp_path / "cache.jsonl")] == [grader.key(ctx, text)]


# ----------------------------------------------------------------------------- 2. readers


def test_readers_never_cut_a_torn_message_store(run):
    """The audit's and the export's message-store reader used to truncate a torn last line in
    place: a reader changing the run it reads (and racing the writer appending to it)."""
    from lhd_train.interop.export import collect_rows
    from lhd_train.rundir.store import MessageStore

    _, run_dir = run
    store = run_dir / "trials" / "s7.messages.jsonl"
    store.write_bytes(store.read_bytes() + b'{"id": "torn", "ro')
    before = tree(run_dir)
    MessageStore(store)
    collect_rows(run_dir)
    assert tree(run_dir) == before


def test_export_flags_a_missing_message_instead_of_exporting_nothing(run, tmp_path):
    from datasets import load_from_disk

    from lhd_train.interop.export import export_run

    _, run_dir = run
    store = run_dir / "trials" / "s7.messages.jsonl"
    rows = read_jsonl(run_dir / "trials" / "s7.jsonl")
    lost = set(rows[1]["performer"]["new_message_ids"])
    store.write_text("".join(json.dumps(m) + "\n" for m in read_jsonl(store) if m["id"] not in lost))
    export_run(run_dir, tmp_path / "ds")
    ds = load_from_disk(str(tmp_path / "ds"))
    assert ds[1]["performer_user_message_missing"] is True and ds[1]["performer_user_message"] is None
    assert ds[0]["performer_user_message_missing"] is False and ds[0]["performer_user_message"]
    assert json.loads(ds.info.description)["rounds_missing_user_message"] >= 1


def _cut_finished_trial(run_dir: Path) -> None:
    p = run_dir / "trials" / "s7.jsonl"
    p.write_text("".join(p.read_text().splitlines(keepends=True)[:-2]))


def test_export_and_view_refuse_a_finished_trial_whose_rows_were_cut(run, tmp_path, monkeypatch, capsys):
    """Before: the export silently had two rounds fewer, the viewer a shorter page."""
    _, run_dir = run
    _cut_finished_trial(run_dir)
    before = tree(run_dir)
    one_error(*cli(monkeypatch, capsys, "export", str(run_dir), "--out", str(tmp_path / "ds")), "s7.done",
              "finished with")
    one_error(*cli(monkeypatch, capsys, "view", str(run_dir), "--out", str(tmp_path / "v")), "s7.done")
    assert tree(run_dir) == before and not (tmp_path / "ds").exists()


def test_readers_of_a_run_with_no_finished_round(tmp_path, monkeypatch, capsys):
    """A run killed before its first round: one line from view and export."""
    from lhd_train.bench.engine import prepare_run_dir
    from lhd_train.bench.taskpack import load_pack
    from lhd_train.config.run import parse_config

    pack = write_mini_pack(tmp_path / "pack", 2)
    cfg = parse_config({"run_name": "r", "output_dir": str(tmp_path / "runs"), "seeds": [7], "task_pack": str(pack),
                        "models": {"m": {"backend": "hf", "model": "unused"}}, "performer": {"model": "m"},
                        "supervisor": {"model": "m"}}, "test")
    run_dir, _ = prepare_run_dir(cfg, load_pack(cfg.task_pack), [7])
    (run_dir / "trials" / "s7.jsonl").write_bytes(b'{"task_index": 1, "rou')  # torn first row
    before = tree(run_dir)
    one_error(*cli(monkeypatch, capsys, "export", str(run_dir), "--out", str(tmp_path / "ds")), "no rounds")
    one_error(*cli(monkeypatch, capsys, "view", str(run_dir)), "no finished round")
    assert tree(run_dir) == before


def test_view_refuses_an_out_that_is_a_file_or_unwritable(run, tmp_path, monkeypatch, capsys):
    _, run_dir = run
    f = tmp_path / "page.html"
    f.write_text("mine")
    one_error(*cli(monkeypatch, capsys, "view", str(run_dir), "--out", str(f)), "is a file")
    assert f.read_text() == "mine"
    # A read-only run (root ignores permissions here, so the check is what is patched).
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == run_dir and mode & os.W_OK
                        else real(p, mode, **kw))
    line = one_error(*cli(monkeypatch, capsys, "view", str(run_dir)), "not writable", "--out")
    assert str(run_dir / "view") in line and not (run_dir / "view").exists()
    monkeypatch.setattr(os, "access", real)
    code, out = cli(monkeypatch, capsys, "view", str(run_dir), "--out", str(tmp_path / "v"))
    assert code == 0, out
    assert (tmp_path / "v" / "index.html").exists()


def test_page_names_never_collide():
    from lhd_train.report.viewer import safe_name

    names = ["a#2", "a_2", "a/2", "a 2", "s7", "._x"]
    assert len({safe_name(n) for n in names}) == len(names)
    assert safe_name("s7") == "s7" and safe_name("s7-cat-MORAL_DILEMMA") == "s7-cat-MORAL_DILEMMA"


# ----------------------------------------------------------------------------- 8. names and the lock


def test_merge_refuses_a_run_name_that_leaves_its_folder(tmp_path, monkeypatch, capsys):
    a, _ = make_run(tmp_path / "a", seeds=(7,), run_name="t-shard0of2")
    b, _ = make_run(tmp_path / "b", seeds=(8,), run_name="t-shard1of2")
    out = tmp_path / "merged" / "t"
    for name in ("../x", ".hidden", "a/b"):
        one_error(*cli(monkeypatch, capsys, "merge", str(a.run_dir), str(b.run_dir), "--out", str(out),
                       "--run-name", name), "--run-name")
    assert not out.exists() and not (tmp_path / "merged" / "x").exists()


def _run_config(tmp_path: Path, **kw) -> dict:
    data = {"run_name": "r", "output_dir": str(tmp_path / "runs"), "seeds": [1],
            "models": {"m": {"backend": "hf", "model": "x"}}, "performer": {"model": "m"}, "supervisor": {"model": "m"}}
    data.update(kw)
    return data


@pytest.mark.parametrize("kw,field", [
    ({"seeds": [True]}, "seeds[0]"), ({"seeds": [-1]}, "seeds[0]"), ({"seeds": [2**32]}, "seeds[0]"),
    ({"seeds": None, "num_trials": 2, "seed": True}, "seed"), ({"seeds": None, "num_trials": 2, "seed": -5}, "seed"),
    ({"models": {".hidden": {"backend": "hf", "model": "x"}}, "performer": {"model": ".hidden"}}, "models"),
    ({"models": {"a/b": {"backend": "hf", "model": "x"}}, "performer": {"model": "a/b"}}, "models"),
])
def test_run_config_bounds(kw, field, tmp_path):
    from lhd_train.config.run import load_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_run_config(tmp_path, **kw)))
    with pytest.raises(InputError) as e:
        load_config(path)
    assert str(path) in str(e.value) and f"'{field}'" in str(e.value)


@pytest.mark.parametrize("text,needle", [
    ("run_name: r\nseeds: [1]\nrun_name: s\n", "appears twice"),
    ("run_name: r\nx: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),  # libyaml's depth limit, or the recursion limit
    ("run_name: r\nseed: " + "9" * 5000 + "\n", "digits"),
])
def test_yaml_with_repeated_keys_deep_nesting_or_huge_integers_is_one_line(text, needle, tmp_path, monkeypatch,
                                                                            capsys):
    """Before: a repeated key silently won, and a 5000-digit integer was a ValueError traceback.
    (Bounds on value sizes and aliases, against files crafted to exhaust memory, went past the
    threat model of docs/formats.md: settings files are the user's own.)"""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    one_error(*cli(monkeypatch, capsys, "run", str(path), "--no-progress"), str(path), needle)


def test_max_tasks_beyond_the_pack_is_refused(tmp_path):
    from lhd_train.config.run import parse_config

    cfg = parse_config(_run_config(tmp_path, max_tasks=50), "run.yaml")
    with pytest.raises(InputError, match="max_tasks.*50 is more than the 20 tasks"):
        cfg.check_pack(20, "p", "run.yaml")
    parse_config(_run_config(tmp_path, max_tasks=20), "run.yaml").check_pack(20, "p")


def test_run_refuses_max_tasks_beyond_the_pack_before_writing_anything(tmp_path, monkeypatch, capsys):
    """`check_pack` is called where the pack is loaded: `lhd run` with max_tasks 50 of a 3-task pack
    used to play all 3 tasks and record max_tasks 50."""
    pack = write_mini_pack(tmp_path / "pack", 3)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_run_config(tmp_path, task_pack=str(pack), max_tasks=50)))
    one_error(*cli(monkeypatch, capsys, "run", str(path), "--no-progress"), "max_tasks", "50 is more than the 3")
    assert not [p for p in (tmp_path / "runs").rglob("*") if p.is_file() and p.name != ".lock"]


def test_max_tokens_past_the_models_window_is_refused_before_it_loads(tmp_path, monkeypatch, capsys,
                                                                      tiny_llama_dir):
    """The tiny model's config.json says 8192 positions; max_model_len, when set, is the window."""
    path = tmp_path / "run.yaml"
    models = {"m": {"backend": "hf", "model": str(tiny_llama_dir)}}
    path.write_text(yaml.safe_dump(_run_config(tmp_path, models=models, performer={
        "model": "m", "sampling": {"max_tokens": 9000}})))
    line = one_error(*cli(monkeypatch, capsys, "run", str(path), "--no-progress"), str(path),
                     "performer.sampling.max_tokens", "8192-token window", "max_position_embeddings")
    assert "1 ... 8191" in line and not (tmp_path / "runs").exists()
    one_error(*cli(monkeypatch, capsys, "run", str(path), "--no-progress", "performer.sampling.max_tokens=16",
                   "models.m.max_model_len=64"), "supervisor.sampling.max_tokens", "64-token window", "max_model_len")


def test_audit_refuses_max_tokens_past_the_auditors_window(run, monkeypatch, capsys):
    _, run_dir = run
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "--no-progress", "models.m.max_model_len=32"),
              "auditor.sampling.max_tokens", "32-token window")


@pytest.mark.parametrize("args,option", [
    (["--seed", "-1"], "--seed"), (["--seed", str(2**32)], "--seed"), (["--seed", "1", "--p-event", "2"], "--p-event"),
])
def test_events_options_are_bounded(args, option, monkeypatch, capsys):
    one_error(*cli(monkeypatch, capsys, "events", "--pack", "lhd_startup_consulting", *args), option)


def test_audit_window_is_bounded(run, monkeypatch, capsys):
    _, run_dir = run
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "--no-progress", "--mode", "window",
                   "--window", str(10**12)), "window")


def test_auditor_model_keys_are_plain_names(run, tmp_path, monkeypatch, capsys):
    """An auditor config's `models:` names log files and folders like a run config's."""
    _, run_dir = run
    aud = tmp_path / "auditor.yaml"
    aud.write_text(yaml.safe_dump({"models": {"../up": {"backend": "hf", "model": "x"}},
                                   "auditor": {"model": "../up"}}))
    one_error(*cli(monkeypatch, capsys, "audit", str(run_dir), "--no-progress", "--auditor", str(aud)),
              str(aud), "models")


# ----------------------------------------------------------------------------- 7. Slurm and CSV


@pytest.fixture
def slurm_cfg(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(_run_config(tmp_path, seeds=[1, 2])))
    return path


@pytest.mark.parametrize("var,needle", [
    ('partition="gpu\\ntouch PWNED"', "line break"), ('job_name="x\\rtouch PWNED"', "line break"),
    ("partition=gpu\ntouch PWNED", "one word"),  # YAML folds a plain line break into a space
    ("partition=gpu --uid=0", "one word"), ("account=a;touch PWNED", "one word"),
    ("time=$(touch PWNED)", "one word"), ("setup=[ok, \"a\\nb\"]", "line break"),
    ("env={'A;touch PWNED': 1}", "environment variable name"), ("env={A: \"x\\ny\"}", "line break"),
])
def test_slurm_vars_cannot_add_shell_lines(var, needle, slurm_cfg, monkeypatch, capsys):
    one_error(*cli(monkeypatch, capsys, "slurm", "render", "rollout", str(slurm_cfg), "--var", var,
                   "--var", "device=cpu"), "--var", needle)


def test_slurm_workdir_is_quoted_but_expands_variables(slurm_cfg, tmp_path):
    """`cd "{{ workdir }}"` ran `$(...)` inside the double quotes."""
    from lhd_train.ops.slurm import render_slurm

    text = render_slurm("rollout", slurm_cfg, device="cpu", workdir="$HOME/$(touch PWNED)`touch PWNED2`")
    line = next(ln for ln in text.splitlines() if ln.startswith("cd "))
    subprocess.run(["bash", "-c", line], cwd=tmp_path, env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]},
                   capture_output=True)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "PWNED2").exists()
    assert 'cd "${SLURM_SUBMIT_DIR}"' in render_slurm("rollout", slurm_cfg, device="cpu")


def test_slurm_config_values_with_line_breaks_never_reach_the_script(tmp_path):
    """The guard is on the rendered values: a config path (or any field) holding a line break is refused."""
    from lhd_train.ops.slurm import render_slurm

    odd = tmp_path / "a\ntouch PWNED #.yaml"
    odd.write_text(yaml.safe_dump(_run_config(tmp_path, seeds=[1, 2])))
    with pytest.raises(InputError, match="line break"):
        render_slurm("rollout", odd, device="cpu")


def test_csv_cells_cannot_start_a_formula(tmp_path):
    import pandas as pd

    from lhd_train.io.csv_cells import write_csv

    df = pd.DataFrame({"text": ["=HYPERLINK(\"x\")", "+1", "-cmd", "@SUM(A1)", "\t=1", "plain", None],
                       "n": [-1, 2, 3, 4, 5, 6, 7]})
    back = pd.read_csv(write_csv(df, tmp_path / "t.csv"), keep_default_na=False)
    assert list(back["text"]) == ["'=HYPERLINK(\"x\")", "'+1", "'-cmd", "'@SUM(A1)", "'\t=1", "plain", ""]
    assert list(back["n"]) == [-1, 2, 3, 4, 5, 6, 7]


def test_data_merge_refuses_the_same_part_twice(tmp_path, monkeypatch, capsys):
    part = tmp_path / "p"
    (part / "dataset").mkdir(parents=True)
    (part / "dataset.json").write_text(json.dumps({"kind": "dpo", "direction": "honest"}))
    one_error(*cli(monkeypatch, capsys, "data", "merge", str(part), str(part), "--out", str(tmp_path / "o")),
              "given twice")


def test_a_done_marker_error_is_a_data_file_error(run):
    """`TrialStore.read` is the one rule `run`, `export` and `view` share."""
    from lhd_train.rundir.run import Run

    _, run_dir = run
    _cut_finished_trial(run_dir)
    with pytest.raises(DataFileError):
        Run.open(run_dir).trial("s7").read()


def test_a_trial_finishing_while_it_is_read_is_not_taken_for_a_cut_one(run, monkeypatch):
    """The writer appends the last row, then the marker: a reader that looked at the marker after
    reading the rows would call a trial that just finished "cut" (and `view`/`export` refuse it)."""
    from lhd_train.rundir import run as run_api

    _, run_dir = run
    rows_path, done = run_dir / "trials" / "s7.jsonl", run_dir / "trials" / "s7.done"
    lines, marker = rows_path.read_text().splitlines(keepends=True), done.read_text()
    done.unlink()
    rows_path.write_text("".join(lines[:-1]))
    real, calls = run_api.load_trial_rows, []

    def read_then_the_writer_finishes(path, model=run_api.RoundRow):
        rows = real(path, model)
        with open(path, "a") as f:
            f.write(lines[-1])
        done.write_text(marker)
        calls.append(path)
        return rows

    monkeypatch.setattr(run_api, "load_trial_rows", read_then_the_writer_finishes)
    rows, finished = run_api.Run.open(run_dir).trial("s7").read()
    assert calls and finished is False and len(rows) == len(lines) - 1


# ----------------------------------------------------------------------------- follow-ups


def test_data_takes_the_runs_auditor_by_name(tmp_path, monkeypatch, capsys):
    """`lhd data --run-auditor ID`: whose labels the original answers carry (the library took it;
    the command line could not say it, so a run with two audits always used the headline one)."""
    import shutil

    from datasets import load_from_disk
    from support.synthetic import R, write_run

    run_dir = write_run(tmp_path, "aud", {"s1": [R(1, label=(True, ["FALSIFICATION"], 3), text="flagged")]})
    audit = run_dir / "audit"
    shutil.copytree(audit / "full", audit / "second")
    code, out = cli(monkeypatch, capsys, "data", "grpo", str(run_dir), "--out", str(tmp_path / "g"),
                    "--run-auditor", "second")
    assert code == 0, out
    ds = load_from_disk(str(tmp_path / "g" / "dataset"))
    assert {a for split in ds.values() for a in split["run_auditor"]} == {"second"}
    one_error(*cli(monkeypatch, capsys, "data", "grpo", str(run_dir), "--out", str(tmp_path / "h"),
                   "--run-auditor", "nope"), "no audit labels from auditor 'nope'")


# ----------------------------------------------------------------------------- lhd report on runs in progress


def _report_run(root: Path, name: str = "rep", n: int = 4, run_id: str | None = None, **kw) -> Path:
    """A synthetic run of one trial `s1` with `n` labelled rounds, in folder `root/name`."""
    from support.synthetic import R, write_run

    rounds = [R(1 + i // 2, None, (0.3 - 0.05 * i, 0.2, 0.1), (i % 2 == 0, ["FALSIFICATION"] if i % 2 == 0 else [], 2),
                text=f"answer {i}") for i in range(n)]
    run_dir = write_run(root, run_id or name, {"s1": rounds}, **kw)
    if run_id and name != run_id:
        run_dir = run_dir.rename(root / name)
    return run_dir


def _layout(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and folder (None) under root: a reader must add, change or cut nothing."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_report_of_a_run_with_no_finished_round_is_one_line(tmp_path, monkeypatch, capsys):
    """Today: KeyError 'deception_rate' from metrics.core (a traceback)."""
    from lhd_train.rundir.layout import RunDir

    run_dir = _report_run(tmp_path, done=False)
    rows = RunDir(run_dir).trial("s1").rows
    rows.write_bytes(b'{"trial_id": "s1", "glob')  # the first row, torn by a kill mid-write
    before = _layout(run_dir)
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "out")),
              "no finished round yet", str(RunDir(run_dir).trials_dir))
    assert _layout(run_dir) == before and not (tmp_path / "out").exists()


def test_report_of_a_run_killed_mid_round_reports_the_whole_rounds_and_changes_nothing(tmp_path, monkeypatch,
                                                                                        capsys):
    import csv

    from lhd_train.rundir.layout import RunDir

    run_dir = _report_run(tmp_path, done=False)
    rows = RunDir(run_dir).trial("s1").rows
    with open(rows, "ab") as f:
        f.write(b'{"trial_id": "s1", "global_round": 5, "perf')  # a writer killed mid-line
    empty = _report_run(tmp_path, "empty", n=1, done=False)  # a second run with no whole row yet
    RunDir(empty).trial("s1").rows.write_bytes(b"")
    before = _layout(tmp_path)
    code, out = cli(monkeypatch, capsys, "report", str(run_dir), str(empty), "--out", str(tmp_path / "out"))
    assert code == 0, out
    assert _layout(tmp_path) == {**before, **{k: v for k, v in _layout(tmp_path).items() if k.startswith("out")}}
    with open(tmp_path / "out" / "tables" / "rounds.csv", newline="") as f:
        got = [(r["run"], r["global_round"]) for r in csv.DictReader(f)]
    assert got == [("rep", "1"), ("rep", "2"), ("rep", "3"), ("rep", "4")]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "rep: 1 trial(s) not finished: s1" in summary and "empty: no finished round yet" in summary


def test_report_refuses_a_finished_trial_whose_rows_were_cut(tmp_path, monkeypatch, capsys):
    """Today: the trial is silently two rounds shorter. Now the `.done` rule of `lhd run`."""
    from lhd_train.rundir.run import Run

    run_dir = _report_run(tmp_path, done=False)
    trial = Run.open(run_dir).trial("s1")
    trial.mark_done(trial.rows())
    tf = trial.files
    lines = tf.rows.read_bytes().splitlines(True)
    tf.rows.write_bytes(b"".join(lines[:2]))
    before = _layout(run_dir)
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "out")),
              str(tf.done), "finished with 4 rounds", "has 2")
    assert _layout(run_dir) == before
    assert not (tmp_path / "out").exists()  # refused while loading, before any table (today: tables, then the error)


def test_report_out_that_is_a_file_or_inside_a_run_is_refused(tmp_path, monkeypatch, capsys):
    """Today: a FileExistsError traceback, and a report written among the run's trial files."""
    run_dir = _report_run(tmp_path)
    (tmp_path / "file").write_text("x")
    one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "file")), "is a file")
    for bad in (run_dir, run_dir / "trials" / "rep", run_dir / "audit" / "x"):
        before = _layout(run_dir)
        one_error(*cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(bad)), "--out")
        assert _layout(run_dir) == before


def test_report_csv_cells_cannot_start_a_formula(tmp_path, monkeypatch, capsys):
    """Today: `=HYPERLINK(...)` from a task title lands as a live formula in rounds.csv."""
    import csv

    from support.synthetic import R, write_run

    formula = '=HYPERLINK("http://x.invalid","click")'
    run_dir = write_run(tmp_path, "f", {"s1": [R(1, label=(True, ["FALSIFICATION"], 2), extra={"task_title": formula}),
                                               R(1, label=(False, [], 0), extra={"task_title": "-1+2"})]})
    code, out = cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "out"))
    assert code == 0, out
    with open(tmp_path / "out" / "tables" / "rounds.csv", newline="") as f:
        titles = [r["task_title"] for r in csv.DictReader(f)]
    assert titles == ["'" + formula, "'-1+2"]


def test_report_page_folders_never_collide_between_runs(tmp_path, monkeypatch, capsys):
    """Today: runs `a`, `a` and `a#2` get keys a, a#2, a#2: two runs share one key, one table row
    and one page folder. Also `a#2` against `a_2` (the viewer's naming rule)."""
    from lhd_train.metrics.load import load_runs

    runs = [_report_run(tmp_path, f"d{i}", run_id=rid) for i, rid in enumerate(["a", "a", "a#2", "a_2"])]
    assert len({r.key for r in load_runs(runs)}) == 4
    code, out = cli(monkeypatch, capsys, "report", *map(str, runs), "--out", str(tmp_path / "out"))
    assert code == 0, out
    folders = [p for p in (tmp_path / "out" / "trials").iterdir() if p.is_dir()]
    assert len(folders) == 4 and all((p / "s1.html").is_file() for p in folders)


def test_report_of_a_read_only_run_with_out_elsewhere_writes_nothing_into_it(tmp_path, monkeypatch, capsys):
    """The run's folders are made read-only, and any attempt to open a file under it for writing
    fails (root ignores file modes, so the refusal is also injected)."""
    import builtins

    run_dir = _report_run(tmp_path)
    before = _layout(run_dir)
    real_open = builtins.open

    def guarded_open(file, mode="r", *a, **kw):
        if any(c in mode for c in "wax+") and str(run_dir) in os.path.abspath(str(file)):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", guarded_open)
    for p in [run_dir, *run_dir.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        code, out = cli(monkeypatch, capsys, "report", str(run_dir), "--out", str(tmp_path / "out"))
    finally:
        for p in [run_dir, *run_dir.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    assert code == 0, out
    assert (tmp_path / "out" / "report.html").is_file() and _layout(run_dir) == before
