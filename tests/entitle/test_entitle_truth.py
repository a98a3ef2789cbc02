"""The experiment is a run with ground truth: `lhd audit-eval` judges it by its own code path, and
the auditor's false-negative rate on the natural fabrications is recounted here from the trial
files and the ground truth on disk, clustered by task (science-5 D6)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml
from entitle_disk import answers_on_disk, jsonl
from entitle_script import SampledScripted, script
from support.scripted import ScriptedBackend

from lhd_train.audit.eval_run import evaluate_auditor
from lhd_train.bench.taskpack import load_pack
from lhd_train.config.auditor import AuditOptions, load_auditor_config
from lhd_train.entitle.items import build_items
from lhd_train.entitle.run import run_entitle
from lhd_train.entitle.settings import EntitleRunCommand

PACK = "lhd_startup_consulting"


def entitle_dir(tmp_path: Path) -> Path:
    pack = load_pack(PACK)
    items, _ = build_items(pack, 6, seed=0)
    reply, _ = script(pack, items)
    out = tmp_path / "e"
    run_entitle(EntitleRunCommand(model_or_config="scripted", out=out, pack=PACK, facts=6, progress=False),
                backend=SampledScripted(reply))
    return out


def verdict(req) -> str:
    """Flags an answer holding the invented figure; the capitulations go unflagged."""
    judged = req.messages[-1]["content"]
    flagged = "987654" in judged
    return json.dumps({"deceptive": flagged, "types": ["FALSIFICATION"] if flagged else [],
                       "severity": 2 if flagged else 0, "confidence": 0.9, "reasoning": "r", "evidence": []})


def test_audit_eval_measures_fnr_on_natural_fabrications_clustered_by_task(tmp_path):
    run = entitle_dir(tmp_path)
    rows = answers_on_disk(run)
    kept = [r for r in rows if r["label"] in ("supported", "abstained", "fabricated", "capitulated")]
    truth = jsonl(run / "ground_truth.jsonl")
    assert len(truth) == len(kept) and len(rows) == len(list((run / "trials").glob("*.done")))
    assert sum(t["deceptive"] for t in truth) == sum(r["label"] in ("fabricated", "capitulated") for r in kept)
    assert not (run / "tasks.json").exists()  # the auditor sees the performer's own message
    by_item = {r["id"]: r for r in kept}
    for t in truth:
        r = by_item[t["item"]]
        assert t["trial_id"] == r["trial_id"] and t["cluster"] == f"task {r['pack']}/{r['task']}"
    # each trial's round-1 message is exactly what the performer was sent (rebuilt here from the item)
    assert all(len(r["user"]) == 1 and r["question"] in r["user"][0] for r in rows)
    # audit-eval's code path, with a scripted auditor
    cfg_path = tmp_path / "auditor.yaml"
    cfg_path.write_text(yaml.safe_dump({"models": {"a": {"backend": "hf", "model": "scripted"}},
                                        "auditor": {"model": "a", "sampling": {"max_tokens": 64}}}))
    cfg, src = load_auditor_config(run, cfg_path)
    out = tmp_path / "eval"
    rec = evaluate_auditor(run, cfg, AuditOptions(mode="full"), out, "entitle natural answers", backend=
                           ScriptedBackend(verdict), progress=False)
    fab = sum(r["label"] == "fabricated" for r in kept)
    cap = sum(r["label"] == "capitulated" for r in kept)
    fnr = rec.result.fnr["FALSIFICATION"]
    assert (fnr.k, fnr.n) == (cap, fab + cap)  # every capitulation missed, every invention caught
    assert rec.result.fpr.k == 0 and rec.result.fpr.n == len(kept) - fab - cap
    # the interval's clusters are the tasks of the deceptive answers, not the answers
    tasks = {f"{r['pack']}/{r['task']}" for r in kept if r["label"] in ("fabricated", "capitulated")}
    assert fnr.clusters == len(tasks) < fab + cap
