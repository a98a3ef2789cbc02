"""Base against adapter, judge-free: two entitle experiments made with the same items and the same
sampling (only the model or its adapter differs), compared answer by answer.

Answers pair by id (fact, cell, sample). Per measure (fabrication, capitulation, support) on the
pairs where both are parsed: the change with its task-bootstrap interval and the sign-flip test
over tasks, which gives the verdict; `unparsed` is a measure of its own over every pair. No LLM
judge, so it is not circular for an adapter trained against an auditor's labels (science-4 D8).
docs/entitle.md, "Base vs adapter"."""
from __future__ import annotations

from typing import Any

from lhd_train.entitle.labels import UNPARSED
from lhd_train.entitle.metrics import ALPHA, MEASURES, paired_outcomes, task_of
from lhd_train.entitle.store import EntitleDir
from lhd_train.errors import InputError

#: measure -> (labels that count, the cells it is measured in)
COMPARED: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    m.name: (m.counts, tuple(f"{f}/{p}" for f, p in m.cells)) for m in MEASURES if m.name != "abstention"}
ALL_CELLS = tuple(sorted({c for _, cells in COMPARED.values() for c in cells}))
#: settings that must agree for answers to pair
SAME = ("pack", "facts", "per_task", "samples", "seed", "temperature", "top_p", "max_tokens", "control")
LOWER_IS_BETTER = {"fabrication": True, "capitulation": True, "support": False, "unparsed": True}


def verdict(res: dict[str, Any], lower_is_better: bool) -> str:
    """In words: whether the change is told apart from none by the sign-flip test over tasks."""
    if not res["n_pairs"]:
        return "no pairs"
    test = res["cluster_test"]
    if test["p"] >= ALPHA or not res["diff"]:
        if test["min_p"] >= ALPHA:
            return f"cannot tell ({test['n_tasks']} tasks: no result could reach p < {ALPHA})"
        return "cannot tell"
    down = res["diff"] < 0
    better = down == lower_is_better
    return f"{'lower' if down else 'higher'} than the base ({'better' if better else 'worse'})"


def compare(base: EntitleDir, other: EntitleDir) -> dict[str, Any]:
    """The paired comparison (module doc); an `InputError` when the two cannot be paired."""
    for d in (base, other):
        if not d.exists():
            raise InputError(d.path, None, "not an entitle experiment (no entitle.json)")
    if base.path.resolve() == other.path.resolve():
        raise InputError("command line", "OTHER", f"{other.path} is the base experiment itself; a comparison "
                         "needs two experiments", "the adapter's experiment directory")
    sb, so = (d.record().settings for d in (base, other))
    for key in SAME:
        if sb.get(key) != so.get(key):
            raise InputError(other.manifest, f"settings.{key}", f"{so.get(key)!r} here, {sb.get(key)!r} in the base "
                             f"{base.path}; paired answers need the same items and sampling")
    if base.item_records() != other.item_records():
        raise InputError(other.items_path, None, f"the items differ from the base's ({base.items_path})")
    rb, ro = base.latest(), other.latest()
    out: dict[str, Any] = {"base": str(base.path), "other": str(other.path),
                           "base_model": _model(base), "other_model": _model(other), "measures": {}}
    if _weights(base) and _weights(base) == _weights(other):
        out["note"] = "both experiments were made with the same model and adapter weights: a difference is noise"
    common = [(a, ro[k]) for k, a in rb.items() if k in ro]
    for name, (labels, cells) in COMPARED.items():
        pairs = [(a.fact, task_of(a), a.label in labels, b.label in labels) for a, b in common
                 if a.condition in cells and UNPARSED not in (a.label, b.label)]
        out["measures"][name] = _measure(pairs, name, list(cells))
    pairs = [(a.fact, task_of(a), a.label == UNPARSED, b.label == UNPARSED) for a, b in common
             if a.condition in ALL_CELLS]
    out["measures"]["unparsed"] = _measure(pairs, "unparsed", list(ALL_CELLS))
    out["unpaired"] = len(set(rb) ^ set(ro))
    return out


def _measure(pairs: list[tuple[str, str, bool, bool]], name: str, cells: list[str]) -> dict[str, Any]:
    res = paired_outcomes(pairs)
    res["verdict"] = verdict(res, LOWER_IS_BETTER[name])
    res["cells"] = cells
    return res


def _model(d: EntitleDir) -> str:
    m = d.record().model
    return f"{m.spec.get('model', '?')}" + (f" + {m.adapter}" if m.adapter else "")


def _weights(d: EntitleDir) -> Any:
    return (d.record().model_extra or {}).get("weights")
