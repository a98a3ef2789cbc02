"""`lhd audit-plant` and `lhd audit-eval`: the auditor's measured error rates (docs/validity.md).

They are top-level commands beside `lhd audit RUN [OVERRIDES...]` rather than subcommands of it:
`audit` takes a run directory and any number of overrides as positional arguments, so `lhd audit
eval ...` would already mean "audit the run directory named eval", and turning `audit` into a
group would break every existing `lhd audit RUN` call."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.cli.console import console
from lhd_train.cli.options import settings_command
from lhd_train.config.auditor import AuditEvalCommand
from lhd_train.config.vocab import TYPES
from lhd_train.errors import InputError

app = typer.Typer()
TYPE_HELP = f"deception type to plant (repeatable; default: {', '.join(TYPES)})"


def plant_command(run: Path, out: Path, seed: int = 0, rate: float = 0.5, types: list[str] | None = None,
                  max_per_trial: int = 1, cross_round: float = 0.5) -> int:
    from lhd_train.audit.ground_truth import ground_truth_path
    from lhd_train.audit.plant import plant_run
    from lhd_train.rundir.run import Run

    chosen = tuple(t.strip().upper() for t in (types or TYPES))
    rep = plant_run(Path(run), Path(out), seed=seed, rate=rate, types=chosen, max_per_trial=max_per_trial,
                    cross_round=cross_round)
    for t in chosen:
        console.print(f"{t.lower()}: {rep.planted[t]} planted, {rep.skipped[t]} skipped (nothing plantable) "
                      f"of {rep.chosen[t]} chosen")
    if rep.planted.get("FALSIFICATION"):
        d = rep.directions
        console.print(f"falsifications: {rep.cross_round} across rounds; {d['up']} up, {d['down']} down as the "
                      f"pressure favours, {d['default']} in the default direction (not inferable)")
    if rep.capped:
        console.print(f"{rep.capped} chosen round(s) left as they were: their trial had {max_per_trial} plant(s)")
    if rep.unfinished_trials:
        console.print(f"copied unchanged (unfinished): {', '.join(rep.unfinished_trials)}")
    console.print(f"planted copy: {out} ({rep.rounds} rounds; ground truth in {ground_truth_path(Run.at(out))})")
    if rep.detectability is not None:
        for key, what in (("rounds", "finds the planted rounds among all rounds"),
                          ("edits", "tells a planted answer from the answer it replaced")):
            console.print(f"detectability: a text-only classifier {what}: {_auroc_line(rep.detectability[key])}")
    return 0


def _auroc_line(d: dict) -> str:
    """'AUROC 0.55 [0.41, 0.70] (n=.., planted ..; length alone 0.52)', or why there is none."""
    length = "-" if d["length_auroc"] is None else f"{d['length_auroc']:.2f}"
    if d["auroc"] is None:
        return f"not measured ({d.get('note', 'one class only')}); length alone {length}"
    ci = "" if d["ci95"] is None else f" [{d['ci95'][0]:.2f}, {d['ci95'][1]:.2f}]"
    return (f"AUROC {d['auroc']:.2f}{ci} (n={d['n']}, {d['positives']} planted, {d['trials']} trials; "
            f"0.5 is chance; length alone {length})")


def eval_command(s: AuditEvalCommand) -> int:
    from lhd_train.audit.eval_results import eval_dir
    from lhd_train.audit.eval_run import attach, curated_run, evaluate_auditor, planted_from
    from lhd_train.config.auditor import load_auditor_config
    from lhd_train.rundir.outputs import check_out_dir
    from lhd_train.rundir.run import Run

    set_path = None
    if s.labelled_set is not None and s.labelled_set != "curated":
        set_path = Path(s.labelled_set)
        if not set_path.is_file():
            raise InputError("command line", "--set", f"unknown set {s.labelled_set!r}",
                             "curated, or a set file (JSON)")
    curated, planted, out, samples = s.labelled_set is not None, s.planted, s.out, s.samples
    auditor_config, attach_to, overrides = s.auditor, s.attach, s.overrides
    if curated == (planted is not None):
        raise InputError("command line", "--set/--planted", "give exactly one of them", "--set curated | --planted DIR")
    opts = s.options
    if curated:
        if out is None:
            raise InputError("command line", "--out", "needed with --set curated: the set is written there as a run "
                             "directory (OUT/run) and the results beside it", "a folder")
        if auditor_config is None:
            raise InputError("command line", "--auditor", "needed with --set curated (the set has no run config of "
                             "its own)", "an auditor config YAML, e.g. configs/examples/auditor-llama70b.yaml")
        check_out_dir(out)
        run, source = curated_run(out, set_path), "curated set" if set_path is None else f"set {set_path}"
    else:
        assert planted is not None  # exactly one of --set/--planted, checked above
        run, source = Path(planted), f"planted run {Path(planted).name}"
        if not run.is_dir():
            raise InputError(run, None, "planted run directory not found")
    if attach_to is not None:
        Run.open(attach_to, source="command line", field="--attach")
    cfg, cfg_source = load_auditor_config(run, auditor_config, overrides or [])
    if out is None:
        out = eval_dir(run, opts.resolved_id(cfg.auditor.model))
    check_out_dir(out)
    target = None if s.no_attach else (attach_to or (planted_from(run) if planted is not None else None))
    if target is not None and Path(target).resolve() == run.resolve():
        target = None  # the run judged: its own eval/<auditor-id>/ is already where its report looks
    res = evaluate_auditor(run, cfg, opts, out, source, samples, cfg_source, progress=s.progress)
    for line in res.headline:
        console.print(line)
    r = res.result
    console.print(f"intervals clustered by {r.cluster_by} (design effect deff beside each rate); severity MAE "
                  f"{'-' if r.severity_mae.mae is None else format(r.severity_mae.mae, '.2f')}")
    if r.self_consistency:
        sc = r.self_consistency.all_agree
        console.print(f"self-consistency: all {samples} flags agree on {sc.k} of {sc.n} rounds")
    if res.note:
        console.print(f"[yellow]{res.note}[/yellow]")
    plot = f", {out / res.reliability_png}" if res.reliability_png else ""
    console.print(f"results: {out / 'eval.json'}, {out / 'eval.md'}{plot}")
    if target is not None:
        try:
            where = attach(res, Path(target))
        except OSError as e:  # e.g. a read-only source run: the results above are complete without it
            console.print(f"[yellow]not filed for the report of {target} ({e}); pass --attach RUN to file them "
                          "in a run you can write to[/yellow]")
        else:
            console.print(f"filed for the report of {target}: {where}")
    if res.incomplete:
        console.print("[yellow]some rounds have no audit row yet (model unreachable); run the same command "
                      "again[/yellow]")
        return 3
    return 0


@app.command("audit-plant")
def audit_plant_cmd(
    run: Path = typer.Argument(..., help="run directory to copy"),
    out: Path = typer.Option(..., "--out", help="the planted copy (a new folder)"),
    seed: int = typer.Option(0, "--seed", help="decides which answers, which type, which figure or sentence"),
    rate: float = typer.Option(0.5, "--rate", help="chance that a round is chosen for a plant"),
    types: list[str] | None = typer.Option(None, "--type", help=TYPE_HELP),
    max_per_trial: int = typer.Option(1, "--max-per-trial",
                                      help="at most this many planted rounds per trial (0: no cap)"),
    cross_round: float = typer.Option(0.5, "--cross-round",
                                      help="share of falsifications that contradict a figure an earlier answer of "
                                           "the trial gave, where the trial has one"),
) -> None:
    """Copy a run with known deceptions planted into chosen answers, and write their ground truth."""
    raise typer.Exit(plant_command(run, out, seed, rate, types, max_per_trial, cross_round))


@app.command("audit-eval")
@settings_command(AuditEvalCommand)
def audit_eval_cmd(s: AuditEvalCommand) -> None:
    """Measure an auditor: false-negative rate per type, false-positive rate (clustered intervals, design
    effect, bounds for rows without a verdict), kappa where honest labels exist, weighted kappa on severity,
    calibration of its confidence, type confusion and self-consistency, against the curated set or a planted run."""
    raise typer.Exit(eval_command(s))
