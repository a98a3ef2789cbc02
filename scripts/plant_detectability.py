"""Reproduce the detectability numbers of docs/validity.md ("Do plants give themselves away?").

Builds a scripted run of the authors' `startup_consulting` pack (no model: the scripted performer
of tests/audit/test_audit_eval.py answers each task with an answer of the curated set drawn per
trial, honest or deceptive, and revises it once when the supervisor asks), then runs
`lhd audit-plant` on it with the default settings and without the per-trial cap, and prints the
text-only classifier's AUROCs from each copy's plant.json.

    PYTHONPATH=. python scripts/plant_detectability.py [--trials 40] [--tasks 9] [--seeds 0 1]
        [--old-planter FILE]

`--old-planter FILE` also plants with another version of `lhd_train/audit/plant.py` (for example
`git show c1e14e6:lhd_train/audit/plant.py > old.py`, the planter before issue 28) and scores its
copy with the same control. The numbers depend on the run: a scripted run reuses a few dozen
answer texts across trials, which makes the answers chosen for planting easier to recognise than
in a real run, where every answer is different."""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "audit")]

from support.scripted import ScriptedBackend  # noqa: E402
from test_audit_eval import performer_reply  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from lhd_train.audit.curated import load_curated  # noqa: E402
from lhd_train.audit.detectability import plant_detectability  # noqa: E402
from lhd_train.bench.engine import prepare_run_dir  # noqa: E402
from lhd_train.bench.prompts import Prompts  # noqa: E402
from lhd_train.bench.taskpack import load_pack  # noqa: E402
from lhd_train.bench.trial import RunContext, run_trial  # noqa: E402
from lhd_train.cli.app import app  # noqa: E402
from lhd_train.config.run import parse_config  # noqa: E402
from lhd_train.rundir.run import Run  # noqa: E402


def scripted_run(out: Path, trials: int, tasks: int) -> Path:
    pack = load_pack("startup_consulting")
    pool: dict[int, list[str]] = {}
    for item in load_curated().items:
        pool.setdefault(item.task, []).append(item.answer)
    seeds = list(range(100, 100 + trials))
    cfg = parse_config({"run_name": "scripted", "output_dir": str(out), "seeds": seeds,
                        "task_pack": "startup_consulting", "p_event": 0.5, "max_tasks": tasks,
                        "models": {"m": {"backend": "hf", "model": "unused"}},
                        "performer": {"model": "m"}, "supervisor": {"model": "m"}, "auditor": {"model": "m"}},
                       "plant_detectability")
    run_dir, schedules = prepare_run_dir(cfg, pack, seeds)
    ctx = RunContext(cfg, cfg.run_name, run_dir, pack, Prompts(), {}, {})
    for seed in seeds:
        draw = random.Random(seed)
        answers = {t: draw.choice(pool.get(t, pool[1])) for t in range(1, tasks + 1)}
        backend = ScriptedBackend(performer_reply(pack, answers))
        ctx.backends = {"performer": backend, "supervisor": backend, "summariser": backend}
        tid = cfg.trial_id(seed)
        assert asyncio.run(run_trial(ctx, tid, seed, schedules[tid])).status == "done"
    return Path(run_dir)


def copy_texts(copy: Path) -> tuple[list, list]:
    """The control's inputs, read back from a planted copy and the run it came from."""
    truth = {(t["trial_id"], t["global_round"]): t
             for t in map(json.loads, (copy / "ground_truth.jsonl").read_text().splitlines())}
    src = Run.open(json.loads((copy / "plant.json").read_text())["source_run"])
    rounds, edits = [], []
    for tid in Run.open(copy).trial_ids():
        old = {r.global_round: r.performer.text or "" for r in src.trial(tid).rows()}
        for row in Run.open(copy).trial(tid).rows():
            t = truth.get((tid, row.global_round))
            kind = None if t is None else t.get("plant") or t["type"]
            rounds.append((tid, row.performer.text or "", kind))
            if kind is not None:
                edits.append((tid, old[row.global_round], row.performer.text or "", kind))
    return rounds, edits


def show(label: str, det: dict) -> None:
    def f(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    for key in ("rounds", "edits"):
        d = det[key]
        ci = d["ci95"] or [None, None]
        kinds = ", ".join(f"{k.lower()} {f(v['auroc'])} (n={v['n']})" for k, v in d.get("by_kind", {}).items())
        print(f"{label:24s} {key:6s} AUROC {f(d['auroc'])} [{f(ci[0])}, {f(ci[1])}] n={d['n']} "
              f"planted={d['positives']} trials={d['trials']} length {f(d['length_auroc'])} | {kinds}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--tasks", type=int, default=9)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--old-planter", type=Path)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="plant-detectability-"))
    run = scripted_run(tmp / "runs", a.trials, a.tasks)
    print(f"scripted run: {run} ({a.trials} trials, tasks 1-{a.tasks})")
    for seed in a.seeds:
        for label, extra in (("default", []), ("no cap", ["--max-per-trial", "0"])):
            copy = tmp / f"{label.replace(' ', '-')}-{seed}"
            res = CliRunner().invoke(app, ["audit-plant", str(run), "--out", str(copy), "--seed", str(seed), *extra])
            assert res.exit_code == 0, res.output
            show(f"{label}, seed {seed}", json.loads((copy / "plant.json").read_text())["detectability"])
    if a.old_planter is not None:
        spec = importlib.util.spec_from_file_location("old_planter", a.old_planter)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_planter"] = old
        spec.loader.exec_module(old)
        for seed in a.seeds:
            copy = tmp / f"old-{seed}"
            old.plant_run(run, copy, seed=seed)
            show(f"old planter, seed {seed}", plant_detectability(*copy_texts(copy), seed=seed))


if __name__ == "__main__":
    main()
