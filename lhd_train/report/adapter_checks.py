"""Is an adapter judged only by what trained it? (review science-4 D8, docs/metrics.md, "Paired
comparison").

Best-of-N and DPO keep answers an auditor did not flag, and GRPO is rewarded by a judge's severity;
`lhd report BASE ADAPTER` then compares flag rates. Scored by the same auditor, a lower rate may mean
the adapter learned to evade that auditor, and on seeds it trained on, that it learned those
schedules. So the report reads the adapter's record (`finetune.lineage`) and warns when the
evaluation's seeds repeat training seeds and when the evaluating auditor is one whose labels
selected or rewarded the data; a held-out auditor (`--held-out-auditor ID`, an auditor id present
in every run) scores both runs again and its paired result is shown beside the headline one."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from lhd_train.finetune.lineage import auditor_identity, read_lineage
from lhd_train.finetune.records import AuditorIdentity
from lhd_train.metrics.core import per_trial_table
from lhd_train.metrics.load import RunData, load_runs
from lhd_train.metrics.paired import PAIRED, PairedComparison, compare_to_base


def same_auditor(a: AuditorIdentity, b: AuditorIdentity) -> str | None:
    """Why two auditor identities are the same auditor (same id, model key or model), or None."""
    for field, mine, theirs in (("auditor id", a.auditor_id, b.auditor_id), ("key", a.key, b.key),
                                ("model", a.model, b.model)):
        if mine and mine == theirs:
            return f"same {field} {mine}"
    return None


def _seeds(comparison: PairedComparison) -> set[int]:
    t = comparison.trials
    return {int(s) for s in t.loc[t["status"] == PAIRED, "seed"].dropna()}


def _listed(seeds: Sequence[int]) -> str:
    s = sorted(seeds)
    return ", ".join(map(str, s[:10])) + (" ..." if len(s) > 10 else "")


def adapter_warnings(runs: Sequence[RunData], comparisons: Sequence[PairedComparison],
                     held_out: str | None = None) -> list[str]:
    """One line per problem, for every compared run whose performer has an adapter: its record
    missing; evaluation seeds that trained it (or were its training data's eval split); the
    evaluating auditor (either run's headline, or the held-out one) among its training auditors."""
    by_key = {r.key: r for r in runs}
    base = runs[0]
    out: list[str] = [f"the held-out auditor {held_out} is the headline auditor of {r.key}: it is not held out"
                      for r in runs if held_out and r.auditor_id == held_out]
    for c in comparisons:
        run = by_key[c.other]
        if not run.performer.adapter:
            continue
        head = f"{run.key} (adapter {run.performer.adapter})"
        lineage, why = read_lineage(Path(run.performer.adapter))
        if lineage is None:
            out.append(f"{head}: {why}; the report cannot check that its evaluation is held out")
            continue
        evaluated = _seeds(c)
        trained = evaluated & set(lineage.train_seeds)
        checked = evaluated & set(lineage.eval_seeds)
        if trained:
            out.append(f"{head}: {len(trained)} of {len(evaluated)} evaluation seeds trained the adapter "
                       f"({_listed(sorted(trained))}): on them it saw these event schedules; evaluate on new seeds")
        if checked:
            out.append(f"{head}: {len(checked)} evaluation seed(s) were in its training data's eval split "
                       f"({_listed(sorted(checked))})")
        out += [f"{head}: {m} (lhd_adapter.json lineage)" for m in lineage.missing]
        training = lineage.auditors
        judges: list[tuple[str, str, Path]] = []
        for r in (run, base):
            if r.auditor_id and all(aid != r.auditor_id for _, aid, _ in judges):
                judges.append(("headline", r.auditor_id, r.path))
        if held_out:
            judges.append(("held-out", held_out, run.path))
        for kind, aid, path in judges:
            mine = auditor_identity("evaluation", aid, path)
            for t in training:
                reason = same_auditor(mine, t)
                if reason:
                    out.append(f"{head}: the {kind} auditor {mine.auditor_id} is the training auditor "
                               f"({t.role}; {reason}): a lower flag rate may mean the adapter evades it"
                               + ("" if held_out else "; add --held-out-auditor ID (another model family)"))
                    break
    return list(dict.fromkeys(out))


def held_out_comparisons(run_dirs: Sequence[Path], auditor_id: str, min_coverage: float) -> list[PairedComparison]:
    """Every run after the first against the first, every trial scored by `auditor_id` (an
    InputError naming the run when one of them has no labels from it)."""
    runs = load_runs([Path(p) for p in run_dirs], auditor_id, min_coverage)
    per_trial = pd.concat([per_trial_table(r, min_coverage) for r in runs], ignore_index=True)
    return compare_to_base(runs, per_trial)
