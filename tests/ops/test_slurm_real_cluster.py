"""The slurm templates on a real Slurm controller: a one-node cluster on this machine
(`scripts/local_slurm.sh`: slurm-wlm + munge, no GPUs), jobs rendered by `lhd slurm render ...
--var device=cpu` and submitted with `sbatch`, the tiny model on CPU.

What is shown: the 2-task rollout array and the merge job task 0 submits with `--dependency=afterok`
(the merge starts after both shards ended, by Slurm's times and by the timestamps in the job logs),
the merged run equals the unsharded run row for row (the comparison of tests/ops/test_shard_merge_slurm.py),
the logs land in logs/slurm/ under the submit directory (docs/cluster.md), a shard cancelled with
`scancel` mid-run and resubmitted with `sbatch --array=1` loses and duplicates nothing, the audit
and lens stages run once each, and `lhd slurm status` reports pending, running, finished and failed.

Determinism across processes: `max_batch_size: 1`, no prefix cache and one thread per job
(`OMP_NUM_THREADS` = the job's CPUs in device=cpu scripts), so the sampled tokens of a trial do not
depend on which trials share its process. The module skips, saying why, where the cluster cannot
start (not root and Slurm not installed, no apt, a real slurm.conf on this machine)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml
from support.synthetic import ROUND_IDS
from test_shard_merge_slurm import strip  # the merged-vs-unsharded row comparison of the existing cluster tests

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "local_slurm.sh"
LHD = [sys.executable, "-m", "lhd_train.cli"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# What a CPU job of this test asks for: one CPU each, so both shards run at once on a 2-core node.
CPU_VARS = ["device=cpu", "cpus=1", "mem=2G", "time=00:15:00", "merge_cpus=1", "merge_mem=1G",
            "merge_time=00:10:00", f"setup=[source {ROOT / '.venv/bin/activate'}]"]
WAIT_S = 240
STAMP = re.compile(r"(started|finished) (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


# ----------------------------------------------------------------------------- the cluster


@pytest.fixture(scope="session")
def slurm_cluster():
    """Starts (or finds running) the local one-node cluster; stops it at the end only if it started it."""
    was_up = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True, text=True).returncode == 0
    r = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        pytest.skip("the local Slurm cluster could not start (scripts/local_slurm.sh start): "
                    + (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1])
    yield
    if not was_up:
        subprocess.run(["bash", str(SCRIPT), "stop"], capture_output=True, text=True, timeout=120)


def sh(*cmd: str, cwd: Path | None = None, check: bool = True) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, env=ENV, timeout=120)
    if check:
        assert r.returncode == 0, (cmd, r.stdout, r.stderr)
    return r.stdout


def render(stage: str, config: Path, out: Path, *vars: str, cwd: Path) -> Path:
    args = [a for v in (*CPU_VARS, *vars) for a in ("--var", v)]
    sh(*LHD, "slurm", "render", stage, str(config), *args, "--out", str(out), cwd=cwd)
    return out


def sbatch(script: Path, *opts: str, cwd: Path) -> int:
    return int(sh("sbatch", "--parsable", *opts, str(script), cwd=cwd).strip().split(";")[0])


def job_info(job: str | int) -> list[dict[str, str]]:
    """`scontrol show job` as key=value dicts (an array: one per task); [] once Slurm forgot it."""
    out = sh("scontrol", "-o", "show", "job", str(job), check=False)
    return [dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line]


def jobs_named(name: str, after: int = 0) -> list[dict[str, str]]:
    """Jobs Slurm still knows with this name, submitted after job id `after`."""
    out = sh("scontrol", "-o", "show", "job", check=False)
    jobs = [dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)) for line in out.splitlines()]
    return [j for j in jobs if j.get("JobName") == name and int(j["JobId"]) > after]


def wait_until(cond, what: str, timeout: float = WAIT_S, every: float = 0.5, on_tick=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        if on_tick:
            on_tick()
        time.sleep(every)
    logs = sh("bash", "-c", "tail -n 20 /var/lib/lhd-slurm/log/slurmctld.log; squeue", check=False)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


def ended(job: int) -> bool:
    info = job_info(job)
    return bool(info) and all(j.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
                              for j in info)


def status(config: Path, *extra: str) -> dict:
    """`lhd slurm status CONFIG --json`, through the CLI."""
    return json.loads(sh(*LHD, "slurm", "status", str(config), "--json", *extra))


def status_here(config: Path) -> dict:
    """The same rows in this process (no interpreter start per poll, which would slow the jobs)."""
    from lhd_train.ops.status import run_status, status_json

    return status_json(run_status(config))


def rows_of(st: dict, stage: str, part: str = "") -> dict:
    return next(r for r in st["rows"] if r["stage"] == stage and r["part"] == part)


def stamps(log: Path) -> dict[str, datetime]:
    found = {k: datetime.fromisoformat(v) for k, v in STAMP.findall(log.read_text())}
    assert set(found) == {"started", "finished"}, (log, log.read_text()[-2000:])
    return found


def trial_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- the run


SEEDS = [11, 12, 13, 14]


def write_config(path: Path, model_dir: Path, run_name: str, output_dir: Path, concurrency: int = 2) -> Path:
    """One task of at most 2 rounds per trial: a round prefills ~15k tokens (no prefix cache, for
    determinism), about 10 s per round on a busy 2-core machine."""
    cfg = {
        "run_name": run_name, "output_dir": str(output_dir), "task_pack": "lhd_startup_consulting", "seeds": SEEDS,
        "max_tasks": 1, "max_rounds_per_task": 2, "concurrency": concurrency, "memory_window": 2,
        "models": {"tiny": {"backend": "hf", "model": str(model_dir), "device": "cpu", "max_batch_size": 1,
                            "enable_prefix_caching": False}},
        "performer": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 24}},
        "supervisor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 96}},
        "summariser": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 16}},
        "auditor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 64}},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def flow(slurm_cluster, tiny_llama_dir, tmp_path_factory):
    """Renders and submits the 2-shard rollout array (task 0 submits the dependent merge job) while
    the unsharded run of the same config runs here; waits for both; records `lhd slurm status`
    along the way."""
    work = tmp_path_factory.mktemp("slurm")
    name = f"st{os.getpid()}"  # unique per session: the controller remembers jobs for an hour
    cfg = write_config(work / "run.yaml", tiny_llama_dir, name, work / "runs")
    full_cfg = write_config(work / "full.yaml", tiny_llama_dir, f"{name}-full", work / "runs")
    t0 = time.time()
    script = render("rollout", cfg, work / "jobs" / "rollout.sbatch", "shards=2", cwd=work)
    text = script.read_text()
    assert "--gpus-per-node" not in text and "--gres" not in text and "export OMP_NUM_THREADS=1" in text
    array = sbatch(script, cwd=work)
    full = subprocess.Popen([*LHD, "run", str(full_cfg), "--no-progress"], cwd=work, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[dict] = []
    merge_name = f"lhd-rollout-{name}-merge"

    def snap():
        seen.append(status_here(cfg))

    snap()
    merge = wait_until(lambda: jobs_named(merge_name, after=array), "task 0 to submit the merge job", on_tick=snap)
    merge_id = int(merge[0]["JobId"])
    wait_until(lambda: ended(array) and ended(merge_id), "the rollout array and the merge job", every=1.0,
               on_tick=snap)
    snap()
    log, _ = full.communicate(timeout=WAIT_S)
    assert full.returncode == 0, log
    return {"work": work, "cfg": cfg, "name": name, "array": array, "merge": merge_id, "seen": seen,
            "full": work / "runs" / f"{name}-full", "merged": work / "runs" / name, "wall": time.time() - t0}


@pytest.mark.slurm
def test_sharded_rollout_and_dependent_merge(flow):
    work, name = flow["work"], flow["name"]
    tasks = job_info(flow["array"])
    assert sorted(int(t["ArrayTaskId"]) for t in tasks) == [0, 1]  # the array covers both shards, no more
    assert all(t["JobState"] == "COMPLETED" for t in tasks), tasks
    [merge] = job_info(flow["merge"])
    assert merge["JobState"] == "COMPLETED", merge
    # Dependency ordering, by Slurm's clock (seconds) and by the jobs' own log stamps (nanoseconds).
    assert max(t["EndTime"] for t in tasks) <= merge["StartTime"]
    logs = work / "logs" / "slurm"  # docs/cluster.md: logs/slurm/ under the submit directory
    shard_logs = [logs / f"lhd-rollout-{name}-{flow['array']}_{i}.out" for i in range(2)]
    merge_log = logs / f"lhd-rollout-{name}-merge-{flow['merge']}.out"
    assert (logs / f"lhd-rollout-{name}-merge.sbatch").is_file()  # the merge script task 0 wrote
    merge_started = stamps(merge_log)["started"]
    for log in shard_logs:
        assert stamps(log)["finished"] < merge_started, (log, merge_log)
    assert "array task 1 of 2" in shard_logs[1].read_text()
    assert "4 trials from 2 source(s)" in merge_log.read_text(), merge_log.read_text()
    # Each shard holds its block of the seeds; the merged run equals the unsharded run.
    for i, seeds in enumerate((SEEDS[:2], SEEDS[2:])):
        shard = work / "runs" / f"{name}-shard{i}of2"
        assert sorted(p.name for p in (shard / "trials").glob("*.done")) == [f"s{s}.done" for s in seeds]
    merged, full = flow["merged"], flow["full"]
    assert json.loads((merged / "manifest.json").read_text())["source"]["kind"] == "lhd merge"
    for s in SEEDS:
        a = [strip(r) for r in trial_rows(merged / "trials" / f"s{s}.jsonl")]
        b = [strip(r) for r in trial_rows(full / "trials" / f"s{s}.jsonl")]
        assert a == b and a, s
        assert [r["global_round"] for r in a] == list(range(1, len(a) + 1))
        for f in (f"trials/s{s}.messages.jsonl", f"schedules/s{s}.json"):
            assert (merged / f).read_bytes() == (full / f).read_bytes(), f
    print(f"sharded rollout + merge on Slurm: {flow['wall']:.0f} s")


@pytest.mark.slurm
def test_status_follows_the_jobs(flow):
    """`lhd slurm status` saw the shards running and the merge pending on its dependency, and at the
    end reports every part finished, from Slurm and from the run directories alone."""
    seen = flow["seen"]
    shard_states = {rows_of(s, "rollout", "shard 0/2")["status"] for s in seen if any(
        r["part"] == "shard 0/2" for r in s["rows"])}
    assert "running" in shard_states, seen
    merge_rows = [r for s in seen for r in s["rows"] if r["stage"] == "merge"]
    assert any(r["status"] == "pending" and r["slurm_state"] == "PENDING" for r in merge_rows), merge_rows
    final = status(flow["cfg"])
    for part in ("shard 0/2", "shard 1/2"):
        r = rows_of(final, "rollout", part)
        assert r["status"] == "finished" and r["slurm_state"] == "COMPLETED" and r["detail"].startswith("2/2 trials")
        assert r["job"] == f"{flow['array']}_{part[6]}"
    m = rows_of(final, "merge")
    assert m["status"] == "finished" and m["job"] == str(flow["merge"]) and "4/4 trials done" in m["detail"]
    offline = status(flow["cfg"], "--no-slurm")
    assert [(r["stage"], r["part"], r["status"], r["job"]) for r in offline["rows"]] == [
        ("rollout", "shard 0/2", "finished", ""), ("rollout", "shard 1/2", "finished", ""),
        ("merge", "", "finished", "")]
    table = sh(*LHD, "slurm", "status", str(flow["cfg"]))
    assert "shard 1/2" in table and "finished" in table and "COMPLETED" in table


@pytest.mark.slurm
def test_scancel_mid_run_then_resume(flow, tiny_llama_dir):
    """Shard 1 alone (`sbatch --array=1`, the rerun command of docs/cluster.md), cancelled once rows
    are on disk, then resubmitted: every row written before the cancel is kept byte for byte, and
    the finished trials equal the unsharded run's."""
    work, name = flow["work"], flow["name"]
    name = f"{name}r"  # its own job names: status finds a run's jobs by name
    # one trial at a time, so the second trial is still to come when the first one's row appears
    cfg = write_config(work / "resume.yaml", tiny_llama_dir, name, work / "runs", concurrency=1)
    script = render("rollout", cfg, work / "jobs" / "resume.sbatch", "shards=2", cwd=work)
    job = sbatch(script, "--array=1", cwd=work)
    shard = work / "runs" / f"{name}-shard1of2"
    trials = [shard / "trials" / f"s{s}.jsonl" for s in SEEDS[2:]]

    def some_rows():
        return any(p.exists() and p.read_bytes().count(b"\n") >= 1 for p in trials)

    wait_until(some_rows, "the shard's first trial row", every=0.05)
    sh("scancel", str(job))
    wait_until(lambda: ended(job), "the cancelled job to end")
    [info] = job_info(job)
    assert info["JobState"] == "CANCELLED", info
    done = [p.with_suffix(".done").exists() for p in trials]
    assert not all(done), "the shard finished before it could be cancelled; give it more work"
    before = {p: p.read_bytes() for p in trials if p.exists()}
    kept = {p: b[: b.rfind(b"\n") + 1] for p, b in before.items()}  # a line cut by the kill is not a row
    st = status(cfg)
    assert rows_of(st, "rollout", "shard 1/2")["status"] == "failed"
    assert rows_of(st, "rollout", "shard 1/2")["slurm_state"] == "CANCELLED"
    assert rows_of(st, "rollout", "shard 0/2")["status"] == "not started"

    again = sbatch(script, "--array=1", cwd=work)
    wait_until(lambda: ended(again), "the resubmitted shard")
    assert all(j["JobState"] == "COMPLETED" for j in job_info(again))
    for p in trials:
        assert p.with_suffix(".done").exists()
        data = p.read_bytes()
        if p in kept:
            assert data.startswith(kept[p]), p  # nothing lost, nothing rewritten
        rows = trial_rows(p)
        assert [r["global_round"] for r in rows] == list(range(1, len(rows) + 1))  # no duplicate, no gap
        ref = trial_rows(flow["full"] / "trials" / p.name)
        assert [strip(r) for r in rows] == [strip(r) for r in ref], p
    st = status(cfg)
    r = rows_of(st, "rollout", "shard 1/2")
    assert r["status"] == "finished" and r["job"].startswith(f"{again}_"), r  # the newest submission wins


@pytest.mark.slurm
def test_audit_and_lens_jobs(flow):
    work, name, cfg = flow["work"], flow["name"], flow["cfg"]
    audit = render("audit", cfg, work / "jobs" / "audit.sbatch", "mode=window", "window=1", "concurrency=4",
                   cwd=work)
    corpus = work / "corpus.txt"
    corpus.write_text("\n\n".join(
        f"Paragraph {i}: the consultant reports to the supervisor about the quarterly numbers, the client "
        f"meeting, the open risks and the plan for the next sprint of work on the startup's product."
        for i in range(4)))
    lens = render("lens", cfg, work / "jobs" / "lens.sbatch", "shards=2", "n_prompts=2", "dtype=float32",
                  "max_length=32", f"corpus={corpus}", f"out={work / 'lens'}", "fit_args=[--skip-first, 2]",
                  cwd=work)
    assert "--device cpu" in lens.read_text()
    a = sbatch(audit, cwd=work)
    lens_array = sbatch(lens, cwd=work)
    lens_merge = f"lhd-lens-{Path(yaml.safe_load(cfg.read_text())['models']['tiny']['model']).name}-merge"
    merge = wait_until(lambda: jobs_named(lens_merge, after=lens_array), "the lens merge job")
    merge_id = int(merge[0]["JobId"])
    wait_until(lambda: ended(a) and ended(lens_array) and ended(merge_id), "the audit and lens jobs", every=1.0)
    for j in (a, lens_array, merge_id):
        assert all(x["JobState"] == "COMPLETED" for x in job_info(j)), job_info(j)
    # Audit: one row per round of every trial of the merged run.
    adirs = [p for p in (flow["merged"] / "audit").iterdir() if p.is_dir()]
    assert len(adirs) == 1
    for s in SEEDS:
        rounds = [r["global_round"] for r in trial_rows(flow["merged"] / "trials" / f"s{s}.jsonl")]
        assert sorted(r["global_round"] for r in trial_rows(adirs[0] / f"s{s}.jsonl")) == rounds
    assert (work / "logs" / "slurm" / f"lhd-audit-{name}-{a}.out").is_file()
    # Lens: two slices of one prompt each, merged into one lens of two prompts.
    meta = json.loads((work / "lens" / "lens.json").read_text())
    assert meta["n_prompts"] == 2, meta
    for i in range(2):
        assert (work / f"lens-shards/shard{i}of2" / "lens.safetensors").is_file()
    st = status(cfg)
    assert rows_of(st, "audit", adirs[0].name)["status"] == "finished"
    assert rows_of(st, "lens")["status"] == "finished" and rows_of(st, "lens", "merge")["status"] == "finished"


# ----------------------------------------------------------------------------- without Slurm


@pytest.mark.parametrize("bad", [["gpus_per_node=2"], ["device=tpu"]])
def test_cpu_render_errors(tmp_path, bad):
    from lhd_train.errors import InputError
    from lhd_train.ops import render_slurm
    from lhd_train.ops.slurm import parse_vars

    cfg = write_config(tmp_path / "c.yaml", tmp_path, "c", tmp_path / "runs")
    with pytest.raises(InputError) as e:
        render_slurm("rollout", cfg, **parse_vars(["device=cpu", *bad]))
    assert "--var" in str(e.value) and ("cpu" in str(e.value) or "cuda" in str(e.value))


def test_cpu_render(tmp_path):
    """device=cpu: no GPU lines (whatever gpu_directive says), threads = the job's CPUs, lens on CPU;
    training refuses."""
    from lhd_train.errors import InputError
    from lhd_train.ops import dry_run_commands, render_slurm

    cfg = write_config(tmp_path / "c.yaml", tmp_path, "c", tmp_path / "runs")
    for stage, extra in (("rollout", {"shards": 2}), ("audit", {}), ("merge", {"shards": 2}),
                         ("lens", {"corpus": "c.txt"}), ("data", {"shards": 2})):
        text = render_slurm(stage, cfg, device="cpu", cpus=3, gpu_directive="gres", **extra)
        header = text.split("set -eo")[0]
        assert "--gpus-per-node" not in header and "--gres" not in header and "nvidia-smi" not in text, stage
        assert "export OMP_NUM_THREADS=3" in text and "export MKL_NUM_THREADS=3" in text
        assert "device=cpu: no GPUs requested" in text
    assert "#SBATCH --gpus-per-node=1" in render_slurm("lens", cfg, corpus="c.txt")  # the default asks for a GPU
    lens = [c for c in dry_run_commands("lens", cfg, corpus="c.txt", device="cpu") if c.startswith("lhd lens fit")]
    assert lens and all("--device cpu" in c for c in lens)
    with pytest.raises(InputError, match="train stage needs GPUs"):
        render_slurm("train", ROOT / "recipes/tiny/sft-honest.yaml", device="cpu")


def _fake_run(d: Path, seeds: list[int], rows: int, done: list[int]) -> None:
    (d / "trials").mkdir(parents=True)
    (d / "config.resolved.yaml").write_text(yaml.safe_dump({"run_name": d.name, "seeds": seeds}))
    for s in seeds:
        row = {**ROUND_IDS, "trial_id": f"s{s}", "task_index": 1, "performer": {"text": ""}}  # what a row needs
        (d / "trials" / f"s{s}.jsonl").write_text("".join(json.dumps({**row, "round": i + 1, "global_round": i + 1})
                                                          + "\n" for i in range(rows)))
        if s in done:
            marker = {"finished_at": "2026-01-01T00:00:00Z", "rounds": rows}
            (d / "trials" / f"s{s}.done").write_text(json.dumps(marker))


def test_status_from_run_directories(tmp_path):
    """Without Slurm: finished, incomplete and not started, from `.done` markers and rows."""
    from lhd_train.ops.status import run_status

    cfg = write_config(tmp_path / "c.yaml", tmp_path, "c", tmp_path / "runs")
    runs = tmp_path / "runs"
    _fake_run(runs / "c-shard0of3", [11], 2, [11])  # 4 seeds in 3 shards: [11], [12], [13, 14]
    _fake_run(runs / "c-shard1of3", [12], 1, [])
    st = run_status(cfg, use_slurm=False)
    got = [(r.stage, r.part, r.status, r.detail) for r in st.rows]
    assert got == [("rollout", "shard 0/3", "finished", "1/1 trials done, 2 rows"),
                   ("rollout", "shard 1/3", "incomplete", "0/1 trials done, 1 rows"),
                   ("rollout", "shard 2/3", "not started", "no run directory")]
    # The merged run directory works as RUN too (it finds its shards next to it).
    _fake_run(runs / "c", SEEDS, 2, SEEDS)
    (runs / "c" / "manifest.json").write_text(json.dumps({"source": {"kind": "lhd merge", "sources": [{}, {}, {}]}}))
    st = run_status(runs / "c", use_slurm=False)
    assert st.get("merge").status == "finished" and "merged from 3 shard(s)" in st.get("merge").detail
    assert st.get("rollout", "shard 1/3").status == "incomplete"
    r = subprocess.run([*LHD, "slurm", "status", str(cfg), "--no-slurm"], capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and "incomplete" in r.stdout and "not started" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([*LHD, "slurm", "status", str(tmp_path / "nope")], capture_output=True, text=True, env=ENV)
    assert r.returncode != 0 and "neither a run config nor a run directory" in r.stdout + r.stderr
