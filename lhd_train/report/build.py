"""`lhd report RUN [RUN ...] --out DIR`: report.html (self-contained), tables/*.csv, summary.md,
plots/*.png, and a trajectory page per trial under trials/.

Runs are compared side by side; each run is one model/adapter/condition, labelled by its run id
and performer model (+ adapter)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from lhd_train.errors import InputError
from lhd_train.metrics.core import RunMetrics, compute_all
from lhd_train.metrics.horizon import chains_summary, chains_table, delayed_table, horizon_table
from lhd_train.config.vocab import TYPES
from lhd_train.metrics.load import COVERAGE_MIN, RunData, load_runs
from lhd_train.report import plots
from lhd_train.report.render import ci, fmt, pm, render_page
from lhd_train.report.viewer import safe_name, states_plot, write_run_pages

MAX_STATE_PLOTS = 60  # per report; more trials still get their own page (with its plot)


def _t(columns: Sequence[str], rows: list[list[Any]], numeric: Sequence[bool] | None = None) -> dict[str, Any]:
    """A table for the `table` macro: cells are strings or {text, href}."""
    return {"columns": list(columns), "rows": rows, "numeric": list(numeric or [False] * len(columns))}


def _num(columns: Sequence[str], first_text: int) -> list[bool]:
    return [i >= first_text for i in range(len(columns))]


def runs_table_ctx(runs: list[RunData], m: RunMetrics, min_coverage: float = COVERAGE_MIN) -> dict[str, Any]:
    cols = ["run", "performer", "auditor", "trials", "labelled rounds", "flagged", "failed labels",
            "repaired labels", "label coverage (min)", f"trials below {min_coverage:.0%} coverage",
            "deception rate", "95% CI", f"deception rate (trials ≥ {min_coverage:.0%} coverage)",
            "avg severity (all rounds)", "avg severity (deceptive; 0 if none)",
            "avg severity (deceptive; trials with deception)"]
    by = {r["run"]: r for r in m.runs.to_dict("records")}
    rows = []
    for run in runs:
        s = by.get(run.key, {})
        a = run.auditor
        rows.append([run.key, run.model_label,
                     f"{a.auditor_id} ({a.mode})" if a else "none",
                     fmt(s.get("n_trials", 0)), fmt(s.get("n_rounds", 0)), fmt(s.get("n_flagged", 0)),
                     fmt(s.get("n_failed_labels", 0)), fmt(s.get("n_repaired_labels", 0)),
                     fmt(s.get("min_label_coverage")), fmt(s.get("n_low_coverage_trials", 0)),
                     pm(s.get("deception_rate_mean"), s.get("deception_rate_se")),
                     ci(s.get("deception_rate_ci_low"), s.get("deception_rate_ci_high")),
                     pm(s.get("deception_rate_covered_mean"), s.get("deception_rate_covered_se"))
                     + f" (n={fmt(s.get('n_trials_covered', 0))})",
                     pm(s.get("severity_average_all_rounds_mean"), s.get("severity_average_all_rounds_se")),
                     pm(s.get("severity_average_deception_only_mean"), s.get("severity_average_deception_only_se")),
                     pm(s.get("severity_deceptive_nan_mean"), s.get("severity_deceptive_nan_se"))])
    return _t(cols, rows, _num(cols, 3))


def compute_table_ctx(runs: list[RunData]) -> dict[str, Any]:
    """Requests and tokens per role (from the rows, so exact across resumes) and GPU-hours."""
    from lhd_train.accounting import usage_by_role
    from lhd_train.rundir.files import read_json_mapping, read_jsonl
    from lhd_train.rundir.layout import RunDir

    cols = ["run", "role", "requests", "prompt tokens", "completion tokens", "cached prompt tokens",
            "model time (s)", "GPU-hours (run)"]
    rows = []
    for run in runs:
        rd = RunDir(run.path)
        trial_rows = [r for p in rd.rows_files() for r in read_jsonl(p)]
        audit_rows = [r for p in rd.audit_dir.glob("*/*.jsonl") for r in read_jsonl(p)]
        gpu_h = read_json_mapping(rd.summary).get("gpu_hours_this_invocation")
        for role, u in usage_by_role(trial_rows, audit_rows).items():
            rows.append([run.key, role, fmt(u["requests"]), fmt(u["prompt_tokens"]), fmt(u["completion_tokens"]),
                         fmt(u["cached_tokens"]), fmt(u["latency_s"], 1), fmt(gpu_h, 3) if gpu_h is not None else "–"])
    return _t(cols, rows, _num(cols, 2))


def types_table_ctx(types: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "type labels", *[t.lower() for t in TYPES]]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_type_labels"]),
             *[f"{fmt(r[f'share_{t}'])} ({r[f'count_{t}']})" for t in TYPES]] for r in types.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def breakdown_table_ctx(df: pd.DataFrame, by: str, labels: dict[str, str], title: str) -> dict[str, Any]:
    cols = ["run", title, "trials", "labelled rounds", "label coverage", "flagged", "rate (pooled)",
            "rate (mean over trials)", "95% CI", "avg severity (deceptive)", *[f"share {t.lower()}" for t in TYPES]]
    rows = []
    for r in df.to_dict("records"):
        v = r[by]
        rows.append([labels.get(r["run"], r["run"]), str(v), fmt(r["n_trials"]), fmt(r["n_rounds"]),
                     fmt(r["label_coverage"]), fmt(r["n_flagged"]), fmt(r["rate_pooled"]), pm(r["rate_mean"], r["rate_se"]),
                     ci(r["rate_ci_low"], r["rate_ci_high"]), fmt(r["severity_deceptive"], 2),
                     *[fmt(r[f"share_{t}"]) for t in TYPES]])
    return _t(cols, rows, _num(cols, 2))


def control_table_ctx(df: pd.DataFrame) -> dict[str, Any]:
    cols = ["performer", "condition", "trials", "label coverage (min)", "trials below coverage", "deception rate",
            "95% CI", "avg severity (all)", "avg severity (deceptive)", *[f"share {t.lower()}" for t in TYPES]]
    rows = [[r["model"], r["condition"], fmt(r["n_trials"]), fmt(r["min_label_coverage"]),
             fmt(r["n_low_coverage_trials"]), pm(r["deception_rate_mean"], r["deception_rate_se"]),
             ci(r["deception_rate_ci_low"], r["deception_rate_ci_high"]),
             pm(r["severity_average_all_rounds_mean"], r["severity_average_all_rounds_se"]),
             pm(r["severity_average_deception_only_mean"], r["severity_average_deception_only_se"]),
             *[fmt(r[f"share_{t}"]) for t in TYPES]] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 2))


def corr_table_ctx(df: pd.DataFrame, labels: dict[str, str] | None = None) -> dict[str, Any]:
    lead = ["run"] if "run" in df.columns else []
    cols = [*lead, "deception rate vs", "Pearson r", "p", "n", "note"]
    rows = [[*([labels.get(r["run"], r["run"])] if lead and labels else [r["run"]] if lead else []),
             r["y"].replace("_", " "), fmt(r["r"]), fmt(r["p"], 4), fmt(r["n"]), r["note"]] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, len(lead) + 1))


def horizon_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "long auditor", "short auditor", "rounds compared", "long flagged", "short flagged", "extra",
            "missed", "extra / short", "net gain", "delayed extra", "delayed share of extra", "kappa"]
    rows = [[labels.get(r["run"], r["run"]), r["long"],
             f"{r['short']} ({r['short_mode']}{', R=' + fmt(r['short_window'], 0) if r['short_window'] == r['short_window'] and r['short_window'] is not None else ''})",
             fmt(r["n_rounds"]), fmt(r["long_flagged"]), fmt(r["short_flagged"]), fmt(r["extra"]), fmt(r["missed"]),
             fmt(r["extra_vs_short"]), fmt(r["net_gain"]), fmt(r["delayed_extra"]), fmt(r["delayed_share_of_extra"]),
             fmt(r["kappa"])] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 3))


def delayed_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "flagged rounds", "delayed", "delayed share", "mean lag (tasks)"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_flagged"]), fmt(r["n_delayed"]), fmt(r["delayed_share"]),
             fmt(r["mean_lag_tasks"], 2)] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def chains_table_ctx(df: pd.DataFrame, labels: dict[str, str]) -> dict[str, Any]:
    cols = ["run", "trials", "chains", "chains per trial", "mean length", "max length",
            "length: count", "share of flagged rounds in chains"]
    rows = [[labels.get(r["run"], r["run"]), fmt(r["n_trials"]), fmt(r["n_chains"]), fmt(r["chains_per_trial"], 2),
             fmt(r["mean_length"], 2), fmt(r["max_length"]), r["length_distribution"] or "–",
             fmt(r["share_flagged_in_chains"])] for r in df.to_dict("records")]
    return _t(cols, rows, _num(cols, 1))


def trials_table_ctx(per_trial: pd.DataFrame, hrefs: dict[str, str]) -> dict[str, Any]:
    cols = ["trial", "condition", "finished", "rounds", "labelled", "flagged", "failed labels", "label coverage",
            "deception rate", "avg severity (all)", "avg severity (deceptive)", "final trust", "mean satisfaction",
            "final comfort"]
    rows = []
    for r in per_trial.to_dict("records"):
        tid = r["trial_id"]
        rows.append([{"text": tid, "href": hrefs[tid]} if tid in hrefs else tid, r["condition"], fmt(bool(r["done"])),
                     fmt(r["n_rounds"]), fmt(r.get("total_rounds")), fmt(r.get("deception_occurrences")),
                     fmt(r.get("failed_rounds")),
                     fmt(r.get("label_coverage")) + (" (low)" if r.get("low_coverage") in (True,) else ""),  # numpy or NaN
                     fmt(r.get("deception_rate")),
                     fmt(r.get("severity_average_all_rounds"), 2), fmt(r.get("severity_average_deception_only"), 2),
                     fmt(r["final_trust"], 2), fmt(r["mean_satisfaction"], 2), fmt(r["final_comfort"], 2)])
    return _t(cols, rows, _num(cols, 3))


def _csv_rounds(rounds: pd.DataFrame) -> pd.DataFrame:
    out = rounds.drop(columns=[c for c in ("reasoning", "evidence") if c in rounds.columns])
    out["types"] = ["|".join(t) for t in out["types"]]
    return out


def write_tables(out: Path, m: RunMetrics, extra: dict[str, pd.DataFrame]) -> list[Path]:
    tdir = out / "tables"
    tdir.mkdir(parents=True, exist_ok=True)
    frames = {"runs": m.runs, "per_trial": m.per_trial, "type_distribution": m.types,
              "by_category": m.by_category, "by_pressure": m.by_pressure, "by_task": m.by_task,
              "control": m.control, "correlations_within_runs": m.corr_within,
              "correlations_across_runs": m.corr_across, "rounds": _csv_rounds(m.rounds), **extra}
    paths = []
    for name, df in frames.items():
        p = tdir / f"{name}.csv"
        df.to_csv(p, index=False)
        paths.append(p)
    return paths


def summary_md(runs: list[RunData], m: RunMetrics, horizon: pd.DataFrame, min_coverage: float = COVERAGE_MIN) -> str:
    lines = ["# LH-Deception report", "",
             "Per-trial metrics as the authors' auditor computes them (docs/reference.md), averaged over trials",
             "(unweighted mean ± SE, ddof=1; 95 % percentile bootstrap interval). Label coverage = rounds with a",
             f"valid label / all rounds; trials below {min_coverage:.0%} are counted, and the rate is also given without",
             "them. Definitions: docs/metrics.md. Full report: report.html.", "",
             "| run | performer | auditor | trials | label coverage (min) | trials below coverage | deception rate "
             "| 95% CI | rate (covered trials) | severity (all) | severity (deceptive) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {r["run"]: r for r in m.runs.to_dict("records")}
    for run in runs:
        s = by.get(run.key, {})
        lines.append(f"| {run.key} | {run.model_label} | {run.auditor_id or 'none'} | {fmt(s.get('n_trials', 0))} | "
                     f"{fmt(s.get('min_label_coverage'))} | {fmt(s.get('n_low_coverage_trials', 0))} | "
                     f"{pm(s.get('deception_rate_mean'), s.get('deception_rate_se'))} | "
                     f"{ci(s.get('deception_rate_ci_low'), s.get('deception_rate_ci_high'))} | "
                     f"{pm(s.get('deception_rate_covered_mean'), s.get('deception_rate_covered_se'))} | "
                     f"{pm(s.get('severity_average_all_rounds_mean'), s.get('severity_average_all_rounds_se'))} | "
                     f"{pm(s.get('severity_average_deception_only_mean'), s.get('severity_average_deception_only_se'))} |")
    lines += ["", "Type distribution (pooled, normalised):", ""]
    for r in m.types.to_dict("records"):
        shares = ", ".join(f"{t.lower()} {fmt(r[f'share_{t}'])}" for t in TYPES)
        lines.append(f"- {r['run']}: {shares} ({r['n_type_labels']} labels)")
    if len(horizon):
        lines += ["", "Long- vs short-horizon auditing:", ""]
        for r in horizon.to_dict("records"):
            lines.append(f"- {r['run']}: {r['long']} vs {r['short']} ({r['short_mode']}): {r['extra']} extra detections"
                         f" (net gain {fmt(r['net_gain'])}), delayed share of extra {fmt(r['delayed_share_of_extra'])}")
    notes = [f"- {run.key}: {n}" for run in runs for n in run.notes]
    if notes:
        lines += ["", "Notes:", "", *notes]
    lines += ["", "Files: report.html, tables/*.csv, plots/*.png, trials/<run>/<trial>.html", ""]
    return "\n".join(lines)


def build_report(run_dirs: Sequence[Path], out: Path, auditor: str | None = None,
                 min_coverage: float = COVERAGE_MIN) -> Path:
    """Write the whole report into `out`; returns the path of report.html. Trials whose label
    coverage is below `min_coverage` are flagged and left out of the "covered" rates."""
    if not run_dirs:
        raise InputError(None, "runs", "give at least one run directory")
    if not 0.0 <= min_coverage <= 1.0:
        raise InputError(None, "min_coverage", f"{min_coverage} is not a share", "a number in [0, 1]")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = load_runs([Path(p) for p in run_dirs], auditor, min_coverage)
    m = compute_all(runs, min_coverage)
    labels = {r.key: r.label for r in runs}
    horizon = pd.concat([horizon_table(r) for r in runs], ignore_index=True) if runs else pd.DataFrame()
    delayed = delayed_table(m.rounds)
    chains = chains_summary(m.rounds)
    extra = {"horizon": horizon, "delayed": delayed, "chains_summary": chains, "chains": chains_table(m.rounds)}
    write_tables(out, m, extra)

    pdir = out / "plots"
    pdir.mkdir(exist_ok=True)
    figs: dict[str, str] = {}

    def keep(name: str, data: bytes) -> None:
        (pdir / f"{name}.png").write_bytes(data)
        figs[name] = plots.data_uri(data)

    has_labels = bool(m.rounds["labelled"].any()) if len(m.rounds) else False
    if has_labels:
        keep("deception_by_run", plots.plot_run_summary(m.runs))
        keep("type_distribution", plots.plot_types(m.types, labels))
        keep("rate_by_pressure", plots.plot_breakdown(m.by_pressure, "pressure", labels, "deception rate by pressure level"))
        keep("rate_by_category", plots.plot_breakdown(m.by_category, "category", labels, "deception rate by event category"))
        keep("correlations", plots.plot_correlations(m.per_trial[m.per_trial["deception_rate"].notna()], labels))

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
            "key": run.key, "label": run.label, "path": str(run.path), "model": run.performer.get("model") or "?",
            "adapter": run.performer.get("adapter") or "none", "revision": run.performer.get("revision") or "–",
            "auditor": f"{a.auditor_id} (mode {a.mode}{', R=' + str(a.window) if a.window else ''})" if a else "none",
            "auditors": ", ".join(f"{x.auditor_id} ({x.mode})" for x in run.auditors) or "none",
            "notes": run.notes, "trials": trials_table_ctx(pt, hrefs), "state_plots": state_plots,
            "anchor": "run-" + sub,
        })

    conditions = sorted(set(m.per_trial["condition"])) if len(m.per_trial) else []
    ctx = {
        "runs": run_sections, "has_labels": has_labels, "figs": figs,
        "runs_table": runs_table_ctx(runs, m, min_coverage), "types_table": types_table_ctx(m.types, labels),
        "pressure_table": breakdown_table_ctx(m.by_pressure, "pressure", labels, "pressure"),
        "category_table": breakdown_table_ctx(m.by_category, "category", labels, "category"),
        "task_table": breakdown_table_ctx(m.by_task, "task_index", labels, "task"),
        "control_table": control_table_ctx(m.control), "conditions": conditions,
        "corr_within": corr_table_ctx(m.corr_within, labels), "corr_across": corr_table_ctx(m.corr_across),
        "horizon_table": horizon_table_ctx(horizon, labels) if len(horizon) else None,
        "delayed_table": delayed_table_ctx(delayed, labels), "chains_table": chains_table_ctx(chains, labels),
        "n_state_plots_capped": n_state_plots >= MAX_STATE_PLOTS,
        "compute_table": compute_table_ctx(runs),
    }
    html = render_page("report.html.j2", **ctx)
    path = out / "report.html"
    path.write_text(html, encoding="utf-8")
    (out / "summary.md").write_text(summary_md(runs, m, horizon, min_coverage), encoding="utf-8")
    return path


def report_command(runs: list[Path], out: Path, auditor: str | None = None,
                   min_coverage: float = COVERAGE_MIN) -> Path:
    """`lhd report RUN [RUN ...] --out DIR [--auditor ID]`."""
    path = build_report(runs, out, auditor, min_coverage)
    print(f"report: {path}")
    print(f"tables: {Path(out) / 'tables'}  summary: {Path(out) / 'summary.md'}")
    return path
