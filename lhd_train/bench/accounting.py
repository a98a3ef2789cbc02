"""Token, request and GPU-hour accounting per role, computed from the rows on disk so it is
exact after a resume too (each model call is recorded once, in the round it belongs to)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from lhd_train.rundir.rows import AuditRow, CallRecord, RoundRow
from rollouts import gpus
from rollouts.spec import BackendSpec

STAGE_ROLE = {"evaluation": "supervisor", "feedback": "supervisor", "summary": "summariser"}
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_s", "cut_calls", "cut_answers")
_SUMMED = ("prompt_tokens", "completion_tokens", "cached_tokens", "latency_s")


def _role(call: CallRecord) -> str:
    return STAGE_ROLE.get(str(call.stage), str(call.stage))


def _add(acc: dict[str, float], call: CallRecord) -> None:
    acc["requests"] += 1
    for k in _SUMMED:
        acc[k] += getattr(call, k) or 0
    acc["cut_calls"] += _cut(call)


def _cut(call: CallRecord) -> bool:
    """A call that ended at its token limit (rows written before the `cut` field: finish_reason)."""
    return call.cut if call.cut is not None else call.finish_reason == "length"


def _cut_answers(calls: list[CallRecord]) -> dict[str, int]:
    """Per role, the answers that stayed cut: a stage (evaluation, feedback, summary, audit) of one
    round whose last call ended at its token limit, so no value came of it."""
    last: dict[str, CallRecord] = {}
    for c in calls:
        last[str(c.stage)] = c
    out: dict[str, int] = defaultdict(int)
    for c in last.values():
        out[_role(c)] += _cut(c)
    return out


def usage_by_role(rows: Iterable[RoundRow], audit_rows: Iterable[AuditRow] = ()) -> dict[str, dict[str, float]]:
    """Totals per role: requests, tokens, model time, and cut answers (docs/benchmark.md, "Answers..."):
    `cut_calls` counts every call that ended at its token limit (a performer segment that was
    then continued, a structured attempt that was then retried with a larger budget), and
    `cut_answers` the answers that stayed cut (a performer answer still truncated after its
    continuations; a supervisor evaluation or feedback, summary or audit whose last attempt was
    cut). Any field may be null (an imported reference run saved no call records,
    docs/auditing.md), so a missing record counts as nothing rather than failing."""
    acc: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for row in rows:
        p, performer = row.performer, acc["performer"]
        performer["requests"] += p.attempts or 1  # failed attempts were requests too
        for k in _SUMMED:
            performer[k] += getattr(p, k) or 0
        truncated = bool(p.truncated)
        # every segment but the last was cut (that is why it was continued); the last one if truncated
        performer["cut_calls"] += max((p.segments or 1) - 1, 0) + truncated
        performer["cut_answers"] += truncated
        calls = row.supervisor.calls if row.supervisor else []
        for call in calls:
            _add(acc[_role(call)], call)
        for role, n in _cut_answers(calls).items():
            acc[role]["cut_answers"] += n
    for a in audit_rows:
        for call in a.calls:
            _add(acc["auditor"], call)
        acc["auditor"]["cut_answers"] += sum(_cut_answers(a.calls).values())
    return {role: {k: round(v, 3) for k, v in d.items()} for role, d in acc.items()}


def gpu_hours(specs: Iterable[BackendSpec], wall_s: float) -> float:
    """GPU hours of models that ran for `wall_s` seconds: each on the GPUs it claims here."""
    cuda = gpus.cuda_visible()
    claims = [s.gpu_claim(cuda) for s in specs]
    return round(sum(len(c.positions) for c in claims if c) * wall_s / 3600.0, 4)
