"""The simulation's own logic on a scripted backend: threshold, round limit, memory, retries, resume."""
from __future__ import annotations

import asyncio
import json

import pytest
from support.scripted import ScriptedBackend, supervisor_script

from lhd_train.bench.events import draw_schedule
from lhd_train.bench.prompts import Prompts
from lhd_train.bench.taskpack import load_pack
from lhd_train.bench.trial import RunContext, run_trial
from lhd_train.config.run import parse_config
from lhd_train.rundir.run import Run


def make_cfg(tmp_path, **kw):
    data = {
        "run_name": "t", "output_dir": str(tmp_path), "seeds": [7],
        "models": {"m": {"backend": "hf", "model": "unused"}},
        "performer": {"model": "m"}, "supervisor": {"model": "m"},
    }
    data.update(kw)
    return parse_config(data, "test")


def run(cfg, backend, seed=7):
    pack = load_pack(cfg.task_pack)
    (cfg.run_dir / "trials").mkdir(parents=True, exist_ok=True)
    ctx = RunContext(cfg, cfg.run_name, cfg.run_dir, pack, Prompts(),
                     {"performer": backend, "supervisor": backend, "summariser": backend}, {})
    sched = draw_schedule(pack, seed, cfg.p_event)
    res = asyncio.run(run_trial(ctx, cfg.trial_id(seed), seed, sched))
    return res, Run.open(cfg.run_dir).trial(cfg.trial_id(seed)).rows()


def test_threshold_is_inclusive_and_ends_the_task(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=1)
    res, rows = run(cfg, ScriptedBackend(supervisor_script([0.1, 0.2])))
    assert [r.round for r in rows] == [1, 2]
    assert [r.task_complete for r in rows] == [False, True]
    assert res.tasks_completed == 1


def test_round_limit_fails_task_and_moves_on(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=2)
    res, rows = run(cfg, ScriptedBackend(supervisor_script([0.19])))
    assert [(r.task_index, r.round) for r in rows] == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)]
    assert not any(r.task_complete for r in rows)
    assert [r.global_round for r in rows] == list(range(1, 7))
    assert res.tasks_done == 2 and res.tasks_completed == 0


def test_states_carry_across_rounds_and_tasks(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=3)
    _, rows = run(cfg, ScriptedBackend(supervisor_script([0.5, -0.3, 0.9])))
    sup = [r.supervisor for r in rows]
    assert all(s is not None for s in sup)
    for prev, cur in zip(sup, sup[1:], strict=False):
        assert cur.state_before == prev.state_after
    assert sup[0].state_before.to_json() == {"trust": 0.0, "satisfaction": 0.0, "comfort": 0.0}


def test_memory_window_summarises_oldest_round(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=5, memory_window=3)
    backend = ScriptedBackend(supervisor_script([0.1]))
    _, rows = run(cfg, backend)
    added = [(r.global_round, [s.global_round for s in r.supervisor.summaries_added]) for r in rows]
    # Rounds 1-3 fill the window; from round 4 on each round summarises the oldest one.
    assert added[:3] == [(1, []), (2, []), (3, [])]
    assert added[3:6] == [(4, [1]), (5, [2]), (6, [3])]
    evals = [r for r in backend.requests if r.json_schema and "trust" in r.json_schema["properties"]]
    last_prompt = evals[-1].messages[-1]["content"]
    assert "[Round 1] summary of" in last_prompt
    recent = last_prompt.split("RECENT ROUNDS IN FULL")[1]
    assert recent.count("[Round ") == 3
    # Every file appears once in the shared-files block, however many rounds saw it.
    files_block = last_prompt.split("=== FILES SHARED SO FAR")[1].split("===")[1]
    names = [line for line in files_block.splitlines() if line.startswith("--- file: ")]
    assert len(names) == len(set(names)) > 0


def test_parse_failure_is_retried_then_recorded(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=1)
    _, rows = run(cfg, ScriptedBackend(supervisor_script([0.5], bad_first=1)))
    assert rows[0].supervisor.parse_status == "retried"
    first, second = [c for c in rows[0].supervisor.calls if c.stage == "evaluation"]
    assert first.parse_error and second.parse_error is None
    assert first.sampling.seed != second.sampling.seed


def test_parse_failure_after_all_attempts_keeps_the_trial_going(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=2)
    _, rows = run(cfg, ScriptedBackend(supervisor_script([0.5], bad_first=3)))
    first = rows[0].supervisor
    assert first.parse_status == "failed" and first.evaluation is None
    assert first.state_after == first.state_before and not rows[0].task_complete
    assert rows[1].supervisor.parse_status == "ok"


def test_performer_never_sees_event_labels_or_think_text(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=4, p_event=1.0)

    def reply(req):
        if req.json_schema is None and "private notes" not in req.messages[0]["content"]:
            return "<think>secret plan</think>visible answer"
        return supervisor_script([0.5])(req)

    backend = ScriptedBackend(reply)
    _, rows = run(cfg, backend)
    performer_prompts = [r for r in backend.requests if r.json_schema is None
                         and "private notes" not in r.messages[0]["content"]]
    for req in performer_prompts:
        text = json.dumps(req.messages)
        for row in rows:
            assert row.event.category not in text
            assert row.event.name not in text
        assert "secret plan" not in text
    assert rows[0].performer.text == "visible answer" and rows[0].performer.think == "secret plan"
    assert rows[0].event.content in performer_prompts[0].messages[-1]["content"]


def test_no_event_block_without_event(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=1, p_event=0.0)
    backend = ScriptedBackend(supervisor_script([0.5]))
    run(cfg, backend)
    first = backend.requests[0].messages[-1]["content"]
    assert "WHAT IS HAPPENING AT WORK" not in first


def test_resume_after_failure_matches_uninterrupted(tmp_path):
    full_cfg = make_cfg(tmp_path / "a", max_tasks=3)
    _, full_rows = run(full_cfg, ScriptedBackend(supervisor_script([0.1, 0.3])))

    calls = {"n": 0}
    script = supervisor_script([0.1, 0.3])

    def dying(req):
        calls["n"] += 1
        return RuntimeError("connection refused") if calls["n"] > 9 else script(req)

    cfg = make_cfg(tmp_path / "b", max_tasks=3)
    res, part = run(cfg, ScriptedBackend(dying))
    assert res.status == "failed" and 0 < len(part) < len(full_rows)
    assert Run.open(cfg.run_dir).trial("s7").done_marker() is None

    # The rerun continues the same script where it stopped.
    res2, rows = run(cfg, ScriptedBackend(script))
    assert res2.status == "done" and res2.resumed_rounds == len(part)

    def strip(r):
        return r.model_dump(exclude={"timestamp", "performer", "supervisor"}) | {
            "answer": r.performer.text, "msgs": r.performer.message_ids, "states": r.supervisor.state_after}

    assert [strip(r) for r in rows] == [strip(r) for r in full_rows]


def test_context_policy_drops_oldest_turns_and_logs_it(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=3)
    cfg.performer.context_tokens = 900
    _, rows = run(cfg, ScriptedBackend(supervisor_script([0.1])))
    ctx = [r.performer.context for r in rows]
    assert ctx[0].dropped_messages == 0
    assert any(c.dropped_messages > 0 for c in ctx)
    assert all(c.prompt_tokens <= 900 for c in ctx if c.dropped_messages)


@pytest.mark.parametrize("bad,field", [
    ({"seeds": []}, "seeds"),
    ({"performer": {"model": "nope"}}, "performer.model"),
    ({"control": {"category": "greed"}}, "control.category"),
    ({"p_event": 1.5}, "p_event"),
    ({"surprise": 1}, "surprise"),
])
def test_bad_config_names_the_field(tmp_path, bad, field):
    from lhd_train.errors import InputError

    with pytest.raises(InputError) as e:
        make_cfg(tmp_path, **bad)
    assert field.split(".")[0] in str(e.value)


def test_supervisor_context_policy_shrinks_memory_and_records_it(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=6, memory_window=4)
    backend = ScriptedBackend(supervisor_script([0.1]))
    backend.max_model_len = 3500
    _, rows = run(cfg, backend)
    ctx = [r.supervisor.context for r in rows]
    assert ctx[0].files_omitted == 0 and ctx[0].fits
    shrunk = [c for c in ctx if c.files_omitted or c.recent_rounds_shown < 4]
    assert shrunk, ctx
    for c in ctx:
        assert not c.fits or c.prompt_tokens <= c.budget_tokens
    evals = [r for r in backend.requests if r.json_schema and "trust" in r.json_schema["properties"]]
    assert any("content omitted here to fit" in r.messages[-1]["content"] for r in evals)


def test_memory_notes_repeat_task_prompt_and_pressure(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=3, p_event=1.0, memory_window=2)
    backend = ScriptedBackend(supervisor_script([0.5]))
    _, rows = run(cfg, backend)
    pack = load_pack(cfg.task_pack)
    evals = [r for r in backend.requests if r.json_schema and "trust" in r.json_schema["properties"]]
    recent = evals[-1].messages[-1]["content"].split("RECENT ROUNDS IN FULL")[1].split("=== CURRENT TASK")[0]
    # The reference's memory record repeats each round's task prompt and its event's pressure level,
    # in the verbatim rounds and in what the summariser is given.
    second = rows[1]
    assert pack.task(second.task_index).prompt.strip() in recent
    assert second.event.pressure in recent and second.event.name in recent
    [summary_req] = [r for r in backend.requests if "private notes" in r.messages[0]["content"]]
    first = rows[0]
    assert pack.task(first.task_index).prompt.strip() in summary_req.messages[1]["content"]
    assert first.event.pressure in summary_req.messages[1]["content"]
