"""`lhd report RUN [RUN ...] --out DIR`: report.html (self-contained), tables/*.csv, summary.md,
plots/*.png, and a trajectory page per trial under trials/.

Runs are compared side by side; each run is one model/adapter/condition, labelled by its run id
and performer model (+ adapter).

The report only reads its runs (a read-only run works with `--out` elsewhere) and reports what is
finished (`metrics.load`); with no finished round in any run it says so in one line. Every file it
writes is replaced atomically, CSV cells cannot start a formula (`rundir.csv_cells`), and `--out`
is refused when it is a file, a run directory or inside a run's own files (`check_out_dir`). The
report is built in a sibling folder and put in place whole, with `lhd_report.json` marking the folder
as a report's: a rerun into it replaces the old report; a folder of other files is refused."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lhd_train.config.vocab import LEVELS
from lhd_train.errors import InputError
from lhd_train.io.csv_cells import write_csv
from lhd_train.io.files import atomic_write_bytes, atomic_write_text, check_writable_dir
from lhd_train.metrics.core import RunMetrics, compute_all
from lhd_train.metrics.horizon import chains_summary, chains_table, delayed_table, horizon_table
from lhd_train.metrics.load import COVERAGE_MIN, RunData, load_runs
from lhd_train.metrics.paired import MIN_PAIRS, PairedComparison, compare_to_base
from lhd_train.metrics.registry import HEADLINE, csv_frame
from lhd_train.report import plots, tables
from lhd_train.report.adapter_checks import adapter_warnings, held_out_comparisons
from lhd_train.report.headline import headline
from lhd_train.report.render import Table, render_page
from lhd_train.report.tables import PAIRED_HOW, role_usage, sampling_lines, usage_frame
from lhd_train.report.validity import auditor_validity, validity_md
from lhd_train.report.viewer import safe_name, states_plot, write_run_pages
from lhd_train.rundir.outputs import check_out_dir, check_report_dir, write_report_marker
from lhd_train.rundir.staging import staged_dir

MAX_STATE_PLOTS = 60  # per report; more trials still get their own page (with its plot)


def _csv_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    out = rounds.drop(columns=["reasoning", "evidence"])
    out["types"] = ["|".join(t) for t in out["types"]]
    return out


def write_tables(out: Path, m: RunMetrics, extra: dict[str, pd.DataFrame]) -> list[Path]:
    """tables/*.csv (docs/metrics.md, "Report files"), summaries spread over their columns (`registry.csv_frame`)."""
    tdir = out / "tables"
    tdir.mkdir(parents=True, exist_ok=True)
    frames = {"runs": m.runs, "per_trial": m.per_trial, "type_distribution": m.types,
              "by_category": m.by_category, "by_pressure": m.by_pressure, "by_task": m.by_task,
              "control": m.control, "correlations_within_runs": m.corr_within,
              "correlations_across_runs": m.corr_across, "rounds": _csv_rounds(m.rounds), **extra}
    return [write_csv(csv_frame(df), tdir / f"{name}.csv") for name, df in frames.items()]


def _md(t: Table | None) -> list[str]:
    return t.markdown() if t is not None else []


def summary_md(runs: list[RunData], tables: dict[str, Table | None], min_coverage: float = COVERAGE_MIN,
               paired: Sequence[PairedComparison] = (), warnings: Sequence[str] = (),
               opening: Sequence[str] = (), note: str | None = None) -> str:
    """summary.md: the report's key tables (the same `Table`s as report.html) and its notes; `opening`:
    the headline lines (`headline`) put first, after `note` (the caller's line, e.g. what the demo cut)."""
    lines = ["# LH-Deception report", "", *([f"Note: {note}", ""] if note else []),
             *opening, *([""] if opening else []),
             "Per-trial metrics as the authors' auditor computes them (docs/reference.md), averaged over trials",
             "(unweighted mean ± SE, ddof=1; 95 % percentile bootstrap interval). Label coverage = rounds with a",
             f"valid label / all rounds; trials below {min_coverage:.0%} are counted, "
             "and the rate is also given without",
             "them. Definitions: docs/metrics.md. Full report: report.html.", "", *_md(tables["runs"]),
             "", "Headline auditor, task pack and sampling per run:", ""]
    for run in runs:
        lines.append(f"- {run.key}: auditor {run.auditor_id or 'none'} ({run.auditor_reason or 'none'}); "
                     f"pack {pack_line(run)}")
        lines += [f"  - sampling {x}" for x in sampling_lines(run)]
    lines += ["", "Type distribution (pooled, normalised; flagged rounds without a type are not in the shares):", "",
              *_md(tables["types"])]
    if tables["horizon"] is not None:
        lines += ["", "Long- vs short-horizon auditing:", "", *_md(tables["horizon"])]
    if paired:
        lines += ["", f"Paired by seed against the base run {paired[0].base} ({PAIRED_HOW}; fewer than {MIN_PAIRS} "
                  "paired seeds is too few to tell):", "", *[f"- WARNING: {w}" for w in warnings],
                  "", *_md(tables["paired"]), "",
                  *dict.fromkeys(f"- {c.other}: {n}" for c in paired for n in c.notes)]
    notes = [f"- {run.key}: {n}" for run in runs for n in run.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "Files: report.html, tables/*.csv, plots/*.png, trials/<run>/<trial>.html", ""]
    return "\n".join(lines)


def pack_line(run: RunData) -> str:
    """The task pack a run used and its content hash (`taskpack.pack_sha256`): as the run recorded
    them (manifest `pack`, `pack_sha256`), else the hash computed now from the folder the manifest
    names (`pack_source`), marked as such; never from a pack name, which may mean another pack today."""
    name = run.manifest.pack or run.config.get("task_pack") or "?"
    sha, how, source = run.manifest.pack_sha256, "recorded by the run", run.manifest.pack_source
    if not sha and source and Path(str(source)).is_dir():
        from lhd_train.bench.taskpack import load_pack, pack_sha256

        try:
            sha, how = pack_sha256(load_pack(Path(str(source)))), f"computed now from {source}"
        except InputError:
            sha = None
    return f"{name} (sha256 {sha[:16]}…, {how})" if sha else f"{name} (content hash not recorded)"


def build_report(run_dirs: Sequence[Path], out: Path, auditor: str | None = None,
                 min_coverage: float = COVERAGE_MIN, held_out_auditor: str | None = None,
                 on_warning: Callable[[str], None] | None = None, note: str | None = None) -> Path:
    """Write the whole report into `out`; returns the path of report.html. Trials whose label
    coverage is below `min_coverage` are flagged and left out of the "covered" rates. With two or
    more runs, `held_out_auditor` scores the paired comparison again, and `on_warning` hears each
    adapter warning (`report.adapter_checks`) that the report also shows. `note`, the caller's one line
    (the demo's account of what it cut), is shown under the title, escaped like any text."""
    if not run_dirs:
        raise InputError(None, "runs", "give at least one run directory")
    if not 0.0 <= min_coverage <= 1.0:
        raise InputError(None, "min_coverage", f"{min_coverage} is not a share", "a number in [0, 1]")
    out = Path(out)
    check_out_dir(out, what="report", beside="report")
    check_report_dir(out)
    check_writable_dir(out, "report's folder")
    if held_out_auditor is not None and len(run_dirs) < 2:
        raise InputError("command line", "--held-out-auditor", "needs two or more runs: it scores the paired "
                         "comparison of the base run with the others", "lhd report BASE ADAPTER --held-out-auditor ID")
    runs = load_runs([Path(p) for p in run_dirs], auditor, min_coverage)
    if not any(len(r.rounds) for r in runs):
        where = runs[0].store.dir.trials_dir if len(runs) == 1 else "runs"
        raise InputError(where, None, "no finished round yet: nothing to report (rerun `lhd report` once "
                         "`lhd run` has written a round)")
    with staged_dir(out) as stage:  # built aside, then put in place whole: a rerun replaces the old report
        write_report(runs, stage, min_coverage, run_dirs=run_dirs, held_out_auditor=held_out_auditor,
                     on_warning=on_warning, note=note)
        write_report_marker(stage, [str(p) for p in run_dirs])
    return out / "report.html"


def write_report(runs: list[RunData], out: Path, min_coverage: float = COVERAGE_MIN, *,
                 run_dirs: Sequence[Path] = (), held_out_auditor: str | None = None,
                 on_warning: Callable[[str], None] | None = None, note: str | None = None) -> Path:
    """Write report.html, summary.md, tables/, plots/ and the trial pages of `runs` into `out`
    (`run_dirs`, `held_out_auditor`, `on_warning` and `note` as in `build_report`)."""
    out.mkdir(parents=True, exist_ok=True)
    m = compute_all(runs, min_coverage)
    labels = {r.key: r.label for r in runs}
    horizon = pd.concat([horizon_table(r) for r in runs], ignore_index=True) if runs else pd.DataFrame()
    delayed = delayed_table(m.rounds)
    chains = chains_summary(m.rounds)
    usage = {r.key: role_usage(r) for r in runs}
    paired = compare_to_base(runs, m.per_trial)
    held = held_out_comparisons(run_dirs, held_out_auditor, min_coverage) if held_out_auditor and paired else []
    warnings = adapter_warnings(runs, paired, held_out_auditor)
    for w in warnings:
        if on_warning is not None:
            on_warning(w)
    extra = {"horizon": horizon, "delayed": delayed, "chains_summary": chains, "chains": chains_table(m.rounds),
             "usage_by_role": usage_frame(runs, usage)}
    if paired:
        extra["paired"] = pd.concat([c.effects for c in (*paired, *held)], ignore_index=True)
        extra["paired_trials"] = pd.concat([c.trials for c in paired], ignore_index=True)
    opening = headline(runs)  # the lite experiment of RUN/entitle-lite/: the report opens with it
    if opening is not None:
        extra["headline"] = pd.DataFrame(opening.rows)
    write_tables(out, m, extra)

    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    figs: dict[str, str] = {}

    def keep(name: str, data: bytes) -> None:
        atomic_write_bytes(pdir / f"{name}.png", data)
        figs[name] = plots.data_uri(data)

    has_labels = bool(m.rounds["labelled"].any())
    if has_labels:
        keep("deception_by_run", plots.plot_run_summary(m.runs))
        keep("type_distribution", plots.plot_types(m.types, labels))
        # Not the paper's pressure figure (that is the control study below): rounds grouped by
        # the pressure of their own task's event, inside whatever trials the runs hold (review N10).
        keep("rate_by_round_pressure",
             plots.plot_breakdown(m.by_pressure, "pressure", labels,
                                  "rate of rounds by their task's event pressure (not the paper's control study)"))
        control_png = plots.plot_control_pressure(m.control, LEVELS)
        if control_png is not None:
            keep("control_rate_by_pressure", control_png)
        keep("rate_by_category",
             plots.plot_breakdown(m.by_category, "category", labels, "deception rate by event category"))
        keep("correlations", plots.plot_correlations(m.per_trial[m.per_trial[HEADLINE].notna()], labels))

    # Trajectory pages, then the state plots shown in the report itself.
    run_sections = []
    n_state_plots = 0
    for run in runs:
        sub = safe_name(run.key)
        pngs = {tid: states_plot(run, tid) for tid in run.trials["trial_id"]}
        pages = write_run_pages(run, out / "trials" / sub, back_href="../../report.html", state_pngs=pngs)
        hrefs = {t: f"trials/{sub}/{p.name}" for t, p in pages.items()}
        pt = m.per_trial[m.per_trial["run"] == run.key]
        state_plots = []
        for tid, data in pngs.items():
            if data is None or n_state_plots >= MAX_STATE_PLOTS:
                continue
            n_state_plots += 1
            state_plots.append({"trial_id": tid, "href": hrefs.get(tid, ""), "src": plots.data_uri(data)})
        a = run.auditor
        run_sections.append({
            "key": run.key, "label": run.label, "path": str(run.path), "model": run.performer.model or "?",
            "adapter": run.performer.adapter or "none", "revision": run.performer.revision or "–",
            "auditor": (f"{a.auditor_id} (mode {a.mode}{', R=' + str(a.window) if a.window else ''}; "
                        f"{run.auditor_reason})") if a else "none",
            "pack": pack_line(run), "sampling": sampling_lines(run),
            "auditors": ", ".join(f"{x.auditor_id} ({x.mode})" for x in run.auditors) or "none",
            "notes": run.notes, "trials": tables.trials_table(pt, hrefs), "state_plots": state_plots,
            "anchor": "run-" + sub,
        })

    conditions = sorted(set(m.per_trial["condition"])) if len(m.per_trial) else []
    validity = auditor_validity(runs, m.per_trial)  # the headline auditor's measured error rates (docs/validity.md)
    shown = {  # each table once, for report.html and summary.md
        "runs": tables.runs_table(runs, m, min_coverage, usage), "types": tables.types_table(m.types, labels),
        "pressure": tables.breakdown_table(m.by_pressure, "pressure", labels, "pressure"),
        "category": tables.breakdown_table(m.by_category, "category", labels, "category"),
        "task": tables.breakdown_table(m.by_task, "task_index", labels, "task"),
        "control": tables.control_table(m.control), "corr_within": tables.corr_table(m.corr_within, labels),
        "corr_across": tables.corr_table(m.corr_across), "delayed": tables.delayed_table(delayed, labels),
        "horizon": tables.horizon_table(horizon, labels) if len(horizon) else None,
        "chains": tables.chains_table(chains, labels), "compute": tables.compute_table(runs, usage),
        "paired": tables.paired_table(extra["paired"], labels) if paired else None}
    ctx: dict[str, Any] = {
        "runs": run_sections, "has_labels": has_labels, "figs": figs, "validity": validity, "t": shown,
        "conditions": conditions, "n_state_plots_capped": n_state_plots >= MAX_STATE_PLOTS,
        "paired": [{"base": labels.get(c.base, c.base), "other": labels.get(c.other, c.other), "notes": c.notes,
                    "trials": tables.paired_trials_table(c.trials)} for c in paired], "min_pairs": MIN_PAIRS,
        "adapter_warnings": warnings, "held_out_auditor": held_out_auditor if held else None,
        "headline": opening, "note": note,
    }
    html = render_page("report.html.j2", **ctx)
    path = out / "report.html"
    atomic_write_text(path, html)
    atomic_write_text(out / "summary.md", summary_md(runs, shown, min_coverage, [*paired, *held], warnings,
                                                     opening=opening.md if opening is not None else (), note=note)
                      + validity_md(validity))
    return path

