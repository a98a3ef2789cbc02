"""`lhd entitle ...`: the evidence-ablation experiment labelled by code (docs/entitle.md).

run: generate and label answers; read: lens and probe margins at the model's own claims; steer:
the causal arm; export: the answers as a run directory for `lhd audit-eval`; compare: base vs
adapter, paired answer by answer."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.console import console
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.errors import InputError
from lhd_train.options import settings_command

app = typer.Typer(help="On-policy evidence-ablation experiment: fabrication and capitulation labelled by code.",
                  no_args_is_help=True)


def _rate(r: dict | None) -> str:
    if not r or not r.get("n"):
        return "- (n=0)"
    lo, hi = r["ci95"]
    ci = "" if lo is None else f" [{lo:.2f}, {hi:.2f}]"
    return f"{r['rate']:.2f}{ci} ({r['k']}/{r['n']}, {r['n_unparsed']} unparsed)"


def print_summary(summary: dict) -> None:
    """The conditions' label counts, the headline rates and the paired tests."""
    console.print(f"{summary['n_answers']} answers about {summary['n_facts']} facts of {summary['n_tasks']} tasks; "
                  f"{summary['n_errors']} backend errors (rerun to retry them)")
    for c in summary["conditions"]:
        counts = ", ".join(f"{k} {v}" for k, v in c["counts"].items() if v)
        console.print(f"  {c['files']:>8}/{c['pressure']:<6} n={c['n']:<4} {counts}")
    for measure, cells in summary["rates"].items():
        if measure == "abstention":
            continue
        for cell, r in cells.items():
            console.print(f"{measure} rate, {cell}: {_rate(r)}")
    for p in summary["paired"]:
        console.print(f"paired {p['test']} ({p['a']} vs {p['b']}): {p['n_pairs']} pairs, {p['a_only']} only in a, "
                      f"{p['b_only']} only in b, McNemar exact p {p['p_mcnemar']:.3g}")


@app.command("run")
@settings_command(EntitleRunCommand)
def run_cmd(s: EntitleRunCommand) -> None:
    """Ask a model about facts of a task pack's files under evidence full / deleted / altered x pressure none /
    demand (+ a control question), label every answer by code, and write answers.jsonl and summary.json."""
    from lhd_train.entitle.run import run_entitle

    res = run_entitle(s)
    print_summary(res.summary)
    console.print(f"results: {res.out / 'answers.jsonl'}, {res.out / 'summary.json'}")
    if res.errors:
        console.print(f"[yellow]{res.errors} answer(s) failed in the backend; run the same command again[/yellow]")
        raise typer.Exit(3)


@app.command("summary")
def summary_cmd(
    directory: Path = typer.Argument(..., help="an entitle directory"),
    relabel: bool = typer.Option(False, "--relabel", help="label every stored answer again by today's rules "
                                 "(answers.jsonl is rewritten; the answers themselves are kept)"),
) -> None:
    """Recompute summary.json from answers.jsonl (after --relabel, from the new labels) and print it."""
    from collections import Counter

    from lhd_train.entitle.generate import relabel as relabel_row
    from lhd_train.entitle.metrics import summarise
    from lhd_train.entitle.store import EntitleDir
    from lhd_train.rundir.lock import run_dir_lock

    d = EntitleDir(directory)
    if not d.exists():
        raise InputError(directory, None, "not an entitle directory (no entitle.json)")
    with run_dir_lock(d.path, stage="lhd entitle summary"):
        if relabel:
            rows = d.answers()
            new = [relabel_row(r) for r in rows]
            changed = Counter(f"{a.label} -> {b.label}" for a, b in zip(rows, new, strict=True) if a.label != b.label)
            d.rewrite_answers(new)
            console.print("relabelled: " + (", ".join(f"{k} {v}" for k, v in sorted(changed.items())) or "no change"))
        summary = summarise(d.latest().values())
        summary["items"] = (d.summary() or {}).get("items")
        d.write_summary(summary)
    print_summary(summary)


@app.command("export")
def export_cmd(
    directory: Path = typer.Argument(..., help="an entitle directory"),
    out: Path = typer.Option(..., "--out", help="the run directory to write (a new folder)"),
    all_samples: bool = typer.Option(False, "--all-samples", help="every sampled answer, not only the greedy ones"),
) -> None:
    """Write the labelled answers as a run with ground_truth.jsonl, for `lhd audit-eval --planted RUN`: the
    auditor's false-negative rate on the model's own (natural) fabrications."""
    from lhd_train.entitle.export import build_natural_run
    from lhd_train.entitle.store import EntitleDir
    from lhd_train.rundir.outputs import check_out_dir

    check_out_dir(out, what="natural run")
    rep = build_natural_run(EntitleDir(directory), out, all_samples)
    left = ", ".join(f"{k} {v}" for k, v in sorted(rep.left_out.items())) or "none"
    console.print(f"natural run: {out}: {rep.deceptive} deceptive (fabricated or capitulated), {rep.honest} honest "
                  f"(supported or abstained); left out: {left}")
    console.print(f"next: lhd audit-eval --planted {out} --auditor AUDITOR.yaml (or the run config's auditor)")
