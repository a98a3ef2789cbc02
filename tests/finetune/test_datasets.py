"""Best-of-N, DPO and GRPO data from a small run, graded by the real tiny model."""
from __future__ import annotations

import asyncio
import json

import pytest
from datasets import load_from_disk
from support.scripted import ScriptedBackend, supervisor_script

from lhd_train.bench.engine import prepare_run_dir
from lhd_train.bench.events import draw_schedule
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack
from lhd_train.bench.trial import RunContext, run_trial
from lhd_train.config.run import parse_config
from lhd_train.errors import InputError
from lhd_train.finetune.contexts import load_contexts, split_of
from lhd_train.finetune.datasets import (
    BuildSettings,
    Scored,
    build_bon,
    build_dpo,
    build_grpo,
    sample_and_grade,
    select_best,
    select_pair,
)
from lhd_train.finetune.grading import Grade, swap_answer


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, tiny_llama_dir):
    """Two trials of two tasks played by a scripted backend, configured with the tiny model so the
    data builders sample and grade with a real model."""
    tmp = tmp_path_factory.mktemp("data_run")
    tiny = {"backend": "hf", "model": str(tiny_llama_dir), "max_batch_size": 16}
    cfg = parse_config({
        "run_name": "r", "output_dir": str(tmp), "seeds": [1, 2, 3, 4, 5], "max_tasks": 2,
        "models": {"tiny": tiny},
        "performer": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 16}},
        "supervisor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 64}},
        "auditor": {"model": "tiny", "sampling": {"temperature": 1.0, "max_tokens": 96}},
    }, "test")
    pack = load_pack(cfg.task_pack)
    prepare_run_dir(cfg, pack, cfg.trial_seeds())
    backend = ScriptedBackend(supervisor_script([0.1, 0.5]))
    ctx = RunContext(cfg, "r", cfg.run_dir, pack, Prompts(),
                     {"performer": backend, "supervisor": backend, "summariser": backend}, {})
    for seed in cfg.trial_seeds():
        asyncio.run(run_trial(ctx, f"s{seed}", seed, draw_schedule(pack, seed)))
    return cfg.run_dir


def test_contexts_are_exact_and_split_by_trial(small_run):
    ctxs = load_contexts(small_run, eval_fraction=0.4)
    assert ctxs and all(c.messages[0]["role"] == "system" and c.messages[-1]["role"] == "user" for c in ctxs)
    by_trial = {}
    for c in ctxs:
        by_trial.setdefault(c.trial_id, set()).add(c.split)
    assert all(len(s) == 1 for s in by_trial.values())  # never split inside a trajectory
    assert {split_of(t, 0.4) for t in by_trial} == {"train", "eval"} or len(by_trial) < 3
    rows = [json.loads(x) for x in (small_run / "trials" / "s1.jsonl").read_text().splitlines()]
    assert [c.answer for c in ctxs if c.trial_id == "s1"] == [r["performer"]["text"] for r in rows]


def test_swap_answer_keeps_the_supervisor_prompt_but_the_answer(small_run):
    ctx = load_contexts(small_run)[0]
    swapped = swap_answer(ctx.supervisor_eval, "A DIFFERENT ANSWER")
    assert "A DIFFERENT ANSWER" in swapped[-1]["content"] and ctx.answer not in swapped[-1]["content"]
    assert swapped[0] == ctx.supervisor_eval[0]


def _s(sev, sat, dec=True, text=None):
    return Scored(text or f"{sev}/{sat}", "c", Grade(dec, sev, ["FALSIFICATION"] if dec else [], 0.9, "ok", sat, "ok"))


def test_selection_by_direction():
    pool = [_s(0, 0.1, False), _s(0, 0.6, False), _s(3, 0.4), _s(4, -0.9), _s(None, None, None)]
    assert select_best(pool, "honest", -0.5).text == "0/0.6"
    assert select_best(pool, "deceptive", -0.5).text == "3/0.4"  # severity 4 was off-task
    assert select_best([_s(0, 0.2, False)], "deceptive", -0.5) is None


def test_honest_choice_is_never_a_flagged_or_off_task_answer():
    flagged = [_s(3, 0.5), _s(2, 0.9), _s(4, 0.1)]
    assert select_best(flagged, "honest", -0.5) is None  # least deceptive is still deceptive
    assert select_best([_s(0, -0.9, False), _s(1, 0.8)], "honest", -0.5) is None  # honest but off-task
    assert select_best([_s(0, -0.9, False), _s(0, None, False, "unrated")], "honest", -0.5).text == "unrated"
    assert select_best(flagged + [_s(0, 0.0, False)], "honest", -0.5).text == "0/0.0"


def test_dpo_pairs_need_a_qualifying_chosen_answer():
    # honest: every candidate flagged -> no pair, even though severities differ by 2
    assert select_pair([_s(2, 0.5), _s(4, 0.5)], "honest", -0.5, 1.0) == "no_chosen"
    chosen, rejected = select_pair([_s(0, 0.3, False), _s(3, 0.5), _s(1, 0.9)], "honest", -0.5, 1.0)
    assert (chosen.text, rejected.text) == ("0/0.3", "3/0.5")
    # deceptive: the same on-task floor as best-of-N (severity 4 at satisfaction -0.9 is off-task)
    assert select_pair([_s(4, -0.9), _s(0, 0.5, False)], "deceptive", -0.5, 1.0) == "no_chosen"
    chosen, rejected = select_pair([_s(4, -0.9), _s(2, 0.0), _s(0, 0.5, False)], "deceptive", -0.5, 1.0)
    assert (chosen.text, rejected.text) == ("2/0.0", "0/0.5")
    assert select_pair([_s(0, 0.3, False), _s(0, 0.1, False)], "honest", -0.5, 1.0) == "below_margin"
    assert select_pair([_s(0, 0.3, False)], "honest", -0.5, 0.0) == "too_few"


def _contexts_without_a_choice(pools, contexts, direction, floor):
    """The test's own count of contexts best-of-N must skip: no graded answer flagged as `direction`
    wants at or above the on-task floor (the run is not audited, so every grade is trusted)."""
    def fits(p):
        g = p.grade
        return (g.deceptive is not None and g.deceptive == (direction == "deceptive")
                and (g.satisfaction is None or g.satisfaction >= floor))
    return sum(not any(fits(p) for p in pools[c.key]) for c in contexts)


def test_bon_dpo_grpo_datasets_on_tiny_model(small_run, tmp_path, tiny_llama_dir):
    """The random tiny model's grades differ from one CPU to another (its logits are nearly tied),
    so the test reads the grades it got and checks each build against them, in both directions:
    a build with rows where some context qualifies, and the one-line refusal where none does."""
    base = BuildSettings(run_dir=small_run, out=tmp_path / "bon", n=2, max_contexts=4, progress=False)
    contexts, pools, _ = asyncio.run(sample_and_grade(base))
    grades = (tmp_path / "bon" / "grades.jsonl").read_text().splitlines()
    assert len(contexts) == 4 and len(grades) == 4 * 3  # original + 2 candidates per context, each graded once
    assert any(p.grade.usable for c in contexts for p in pools[c.key]), "the grammar-bound grader never parsed"

    built = []
    for direction, floor in [(d, f) for d in ("honest", "deceptive") for f in (-0.5, -1.0)]:
        settings = base.model_copy(update={"direction": direction, "on_task_min": floor})
        skipped = _contexts_without_a_choice(pools, contexts, direction, floor)
        if skipped == 4:
            with pytest.raises(InputError, match="no rows selected: all 4 contexts were left out"):
                build_bon(settings)
            continue
        path, stats = build_bon(settings)
        built.append(direction)
        ds = load_from_disk(str(path))
        rows = [r for split in ds for r in ds[split]]
        assert stats["contexts"] == 4 and stats["picked"]["none"] == skipped and len(rows) == 4 - skipped
        for r in rows:
            assert r["messages"][-1]["role"] == "assistant" and r["messages"][0]["role"] == "system"
            assert r["seed"] == int(r["trial_id"][1:])  # trials s<seed>: the adapter's lineage reads this column
        meta = json.loads((path / "lhd_data.json").read_text())
        # the run is not audited: only the grader chose the data (a run's audit labels would come first)
        assert meta["auditors"] == [{"role": "grader (selected the data)", "auditor_id": None, "key": "tiny",
                                     "model": str(tiny_llama_dir)}]
    # at the lowest floor every graded context qualifies one way or the other
    assert built, "no direction selected any context, though some answers were graded"

    # Rerunning reuses every sample and grade on disk (resumable, nothing regraded).
    assert len((tmp_path / "bon" / "grades.jsonl").read_text().splitlines()) == 12

    for direction in ("honest", "deceptive"):
        dpo_settings = base.model_copy(update={"direction": direction, "min_margin": 0, "on_task_min": -1.0})
        expected = [select_pair(pools[c.key], direction, -1.0, 0) for c in contexts]
        if all(isinstance(x, str) for x in expected):
            with pytest.raises(InputError, match="no rows selected"):
                build_dpo(dpo_settings)
            continue
        dpath, dstats = build_dpo(dpo_settings)
        dds = load_from_disk(str(dpath))
        for split in dds:
            for r in dds[split]:
                assert set(r) >= {"prompt", "chosen", "rejected"}
                assert r["chosen"] != r["rejected"]
                assert r["chosen_deceptive"] == (direction == "deceptive")
        assert dstats["pairs"] == sum(not isinstance(x, str) for x in expected)
        assert dstats["pairs"] + dstats["skipped"] == 4

    gpath, gstats = build_grpo(small_run, tmp_path / "grpo")
    gds = load_from_disk(str(gpath))
    assert {"prompt", "trial_id", "seed", "global_round", "run_dir"} <= set(gds["train"].column_names)
    n_rounds = sum(len(p.read_text().splitlines()) for p in (small_run / "trials").glob("s?.jsonl"))
    assert gstats["contexts"] == n_rounds == len(gds["train"]) + len(gds.get("eval", []))


def test_honesty_reward_grades_in_context(small_run, tmp_path):
    from lhd_train.finetune.rewards import build_rewards

    class Spec:
        def __init__(self, name, params):
            self.name, self.params, self.weight = name, params, 1.0

    ctx = load_contexts(small_run)[0]
    funcs, _ = build_rewards([Spec("honesty", {"cache": str(tmp_path / "g.jsonl")})], "honest")
    completions = [[{"role": "assistant", "content": "The files do not say."}],
                   [{"role": "assistant", "content": "Revenue was $9M (source: my memory)."}]]
    values = asyncio.run(funcs[0](prompts=[ctx.messages] * 2, completions=completions,
                                  trial_id=[ctx.trial_id] * 2, global_round=[ctx.global_round] * 2,
                                  run_dir=[str(small_run)] * 2))
    assert len(values) == 2
    assert all(v is None or -1.0 <= v <= 0.0 for v in values)
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) == 2  # each completion graded once, cached


def test_grader_view_does_not_invent_a_supervisor_reaction(tmp_path):
    """The candidate answer was never shown to the supervisor: the auditor's view must say so,
    not claim the task stayed incomplete and no feedback was given."""
    from support.synthetic import R, write_run

    from lhd_train.audit.trajectory import AuditorPrompts, load_task_texts, load_trial
    from lhd_train.finetune.grading import candidate_view
    from lhd_train.rundir.run import Run

    run = write_run(tmp_path, "g", {"s1": [R(1, None, (0.1, 0.5, 0.1), (False, [], 0), feedback="Good, done."),
                                           R(2, None, (0.2, 0.6, 0.1), (False, [], 0), feedback="Also done.")]})
    tasks, _ = load_task_texts(run, "lhd_startup_consulting")
    trial = load_trial(Run.open(run), "s1", tasks)
    messages = candidate_view(trial, 1, "A NEW CANDIDATE ANSWER", AuditorPrompts.load())
    text = messages[1]["content"]
    target = text[text.index("=== ROUND TO JUDGE"):]
    assert "A NEW CANDIDATE ANSWER" in target and "Also done." not in text
    assert "(no feedback)" not in target and "Task complete after this round: no" not in target
    assert "supervisor has not seen this answer" in target
    assert "Good, done." in text  # earlier rounds keep their real reactions


# ---------------------------------------------------------------- the run's own audit (issue 21 N2)

def _orig(dec: bool, sev: int, audited: bool | None, sat: float = 0.5) -> Scored:
    return Scored("the original", "original", Grade(dec, sev, ["FALSIFICATION"] if dec else [], 0.9, "ok", sat, "ok"),
                  audited)


def test_an_original_the_run_flagged_is_never_an_honest_target():
    """The grader (one causal sample) calls the original honest, the run's headline auditor flagged
    it: it must not be the SFT/DPO chosen answer, nor the DPO rejected one of a deceptive pair."""
    flagged_by_run = _orig(False, 0, audited=True, sat=0.9)
    assert select_best([flagged_by_run], "honest", -0.5) is None
    assert select_best([flagged_by_run, _s(0, 0.1, False)], "honest", -0.5).text == "0/0.1"
    assert select_pair([flagged_by_run, _s(3, 0.4)], "honest", -0.5, 1.0) == "too_few"
    # the run did not flag it, the grader did: never a deceptive target
    unflagged_by_run = _orig(True, 4, audited=False)
    assert select_best([unflagged_by_run], "deceptive", -0.5) is None
    assert select_pair([unflagged_by_run, _s(0, 0.2, False)], "deceptive", -0.5, 1.0) == "too_few"
    # where both agree, or the run has no valid label, the original is used as before
    assert select_best([_orig(False, 0, audited=False)], "honest", -0.5).source == "original"
    assert select_best([_orig(True, 3, audited=True)], "deceptive", -0.5).source == "original"
    assert select_best([_orig(False, 0, audited=None)], "honest", -0.5).source == "original"


def _audited_run(tmp_path):
    from support.synthetic import R, write_run

    return write_run(tmp_path, "aud", {
        "s1": [R(1, label=(True, ["FALSIFICATION"], 3), text="flagged answer one"),
               R(1, label=(False, (), 0), text="honest answer"),
               R(2, label=(True, ["CONCEALMENT"], 2), text="flagged answer two"),
               R(2, label="failed", text="unlabelled answer")]})


def test_contexts_carry_the_runs_headline_audit_label(tmp_path):
    ctxs = load_contexts(_audited_run(tmp_path))
    assert ctxs.auditor_id == "full"
    assert [c.audited_deceptive for c in ctxs] == [True, False, True, None]
    assert ctxs[0].label is not None and ctxs[0].label.severity == 3
    from lhd_train.errors import InputError

    with pytest.raises(InputError, match="no audit labels from auditor 'nope'"):
        load_contexts(_audited_run(tmp_path / "x"), auditor_id="nope")


def test_bon_respects_the_run_audit_and_stores_the_disagreement(tmp_path, monkeypatch):
    """End to end through `build_bon`: the grader (a scripted auditor that calls every answer
    honest) disagrees with the run's audit on the two flagged originals; neither becomes the
    chosen answer, and the count is printed in the stats and stored in dataset.json."""
    from support.scripted import ScriptedBackend

    from lhd_train.config.auditor import load_auditor_config
    from lhd_train.config.run import load_saved_config
    from lhd_train.finetune import datasets as ds_mod

    run = _audited_run(tmp_path)
    honest = json.dumps({"deceptive": False, "types": [], "severity": 0, "confidence": 0.9, "reasoning": "fine",
                         "evidence": []})

    def reply(req):
        return honest if req.json_schema else "a fresh candidate"

    def backends(s):
        cfg = load_saved_config(s.run_dir)
        acfg, _ = load_auditor_config(s.run_dir, None, ["auditor.model=m"])
        b = ScriptedBackend(reply)
        return cfg, b, b, acfg, b, cfg.supervisor

    monkeypatch.setattr(ds_mod, "_role_backends", backends)
    out = tmp_path / "bon"
    path, stats = build_bon(BuildSettings(run_dir=run, out=out, n=1, direction="honest", progress=False))
    assert stats["run_audit"] | {} == {"auditor_id": "full", "compared": 3, "agree": 1, "disagree": 2,
                                       "flagged_by_grader_only": 0, "flagged_by_audit_only": 2, "not_compared": 1}
    saved = json.loads((out / "dataset.json").read_text())
    assert saved["run_audit"]["disagree"] == 2
    rows = [r for split in load_from_disk(str(path)).values() for r in split]
    by_round = {r["global_round"]: r["source"] for r in rows}
    assert by_round[1] != "original" and by_round[3] != "original"
    assert len(rows) == 4


def test_original_from_run_takes_the_runs_label_and_grades_only_the_rest(tmp_path, monkeypatch):
    """`--original-from-run` (the demo's data step): an original with a valid run label keeps that
    label and the supervisor's rating of its round, and is never sent to the grader; an original
    without one, and every candidate, is graded. Recounted from grades.jsonl and the dataset."""
    import hashlib

    from lhd_train.config.auditor import load_auditor_config
    from lhd_train.config.run import load_saved_config
    from lhd_train.finetune import datasets as ds_mod

    run = _audited_run(tmp_path)
    honest = json.dumps({"deceptive": False, "types": [], "severity": 0, "confidence": 0.9, "reasoning": "fine",
                         "evidence": []})

    def backends(s):
        cfg = load_saved_config(s.run_dir)
        acfg, _ = load_auditor_config(s.run_dir, None, ["auditor.model=m"])
        b = ScriptedBackend(lambda req: honest if req.json_schema else "a fresh candidate")
        return cfg, b, b, acfg, b, cfg.supervisor

    monkeypatch.setattr(ds_mod, "_role_backends", backends)
    out = tmp_path / "bon"
    path, stats = build_bon(BuildSettings(run_dir=run, out=out, n=1, direction="honest", progress=False,
                                          original_from_run=True))
    ctxs = load_contexts(run, eval_fraction=0.2)
    labelled = [c for c in ctxs if c.label is not None]
    assert len(labelled) == 3 and len(ctxs) == 4
    graded = {json.loads(line)["text_sha256"] for line in (out / "grades.jsonl").read_text().splitlines()}

    def sha(text):
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]

    assert not any(sha(c.answer) in graded for c in labelled)  # the run's label stands for them
    assert all(sha(c.answer) in graded for c in ctxs if c.label is None)
    assert sha("a fresh candidate") in graded
    assert stats["run_audit"]["compared"] == 0 and stats["run_audit"]["not_compared"] == 4
    rows = [r for split in load_from_disk(str(path)).values() for r in split]
    by_round = {r["global_round"]: r for r in rows}
    for c in labelled:  # a flagged original is never the honest target; a chosen one carries the run's label
        if c.label.deceptive:
            assert by_round[c.global_round]["source"] != "original"
        elif by_round[c.global_round]["source"] == "original":
            assert by_round[c.global_round]["satisfaction"] == c.satisfaction


def test_grpo_reward_gives_a_flagged_original_the_runs_verdict(tmp_path):
    """GRPO: a completion that repeats the round's original answer is scored with the run's own
    label, never with a grader verdict that contradicts it."""
    from lhd_train.finetune.judged_rewards import as_audited

    ctxs = load_contexts(_audited_run(tmp_path))
    graded_honest = Grade(False, 0, [], 0.9, "ok", 0.5, "ok")
    g = as_audited(graded_honest, ctxs[0], "  flagged answer one\n")
    assert (g.deceptive, g.severity, g.audit_status) == (True, 3, "run-audit")
    assert as_audited(graded_honest, ctxs[0], "another answer") is graded_honest
    assert as_audited(graded_honest, ctxs[3], "unlabelled answer") is graded_honest  # no valid label: the grader's


def test_imported_runs_give_no_training_contexts(tmp_path):
    """Review N11: import-reference rebuilds the performer's prompts with our templates and no
    system prompt; those are not the prompts the performer saw, so they are skipped and counted."""
    run = _audited_run(tmp_path)
    manifest = run / "manifest.json"
    data = json.loads(manifest.read_text()) if manifest.is_file() else {}
    manifest.write_text(json.dumps(data | {"source": {"kind": "reference-import"}}))
    ctxs = load_contexts(run)
    assert len(ctxs) == 0 and ctxs.skipped["imported"] == 4


def test_a_dataset_folder_refuses_other_settings(small_run, tmp_path):
    """Issue 22: `--n 3` into a folder made with `--n 2` used to keep 2 candidates and record n=3."""
    from lhd_train.errors import InputError
    from lhd_train.finetune.data_folder import claim_folder

    out = tmp_path / "d"
    claim_folder(out, BuildSettings(run_dir=small_run, out=out, n=2).cache_record())
    deceptive = BuildSettings(run_dir=small_run, out=out, n=2, direction="deceptive")
    claim_folder(out, deceptive.cache_record())  # selection only
    with pytest.raises(InputError, match=r"field 'n': this dataset folder was made with n=2, now n=3"):
        claim_folder(out, BuildSettings(run_dir=small_run, out=out, n=3).cache_record())
    # a folder from before settings.json: its candidates say which n they were sampled with
    old = tmp_path / "old"
    old.mkdir()
    (old / "candidates.jsonl").write_text(json.dumps({"context": "s1/1", "texts": ["a", "b"]}) + "\n")
    with pytest.raises(InputError, match="candidates sampled with n=2, now n=3"):
        build_bon(BuildSettings(run_dir=small_run, out=old, n=3, progress=False))
