"""`lhd entitle ...`: the evidence-ablation experiment labelled by code (docs/entitle.md).

run: generate and label answers; read: lens and probe margins at the model's own claims; steer:
the causal arm; export: the answers as a run directory for `lhd audit-eval`; compare: base vs
adapter, paired answer by answer."""
from __future__ import annotations

from pathlib import Path

import typer

from lhd_train.cli.console import console
from lhd_train.cli.options import settings_command
from lhd_train.entitle.settings import EntitleRunCommand
from lhd_train.errors import InputError

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
            if r["n"] or r["n_unparsed"]:
                console.print(f"{measure} rate, {cell}: {_rate(r)}")
    for p in summary["paired"]:
        console.print(f"paired {p['test']} ({p['a']} vs {p['b']}): {p['n_pairs']} pairs, {p['a_only']} only in a, "
                      f"{p['b_only']} only in b, McNemar exact p {p['p_mcnemar']:.3g}")


@app.command("run")
@settings_command(EntitleRunCommand)
def run_cmd(s: EntitleRunCommand) -> None:
    """Ask a model about facts of a task pack's files under evidence full / deleted / altered x pressure none /
    demand (+ a control question), label every answer by code, and write answers.jsonl and summary.json.
    --mode lite: forced-choice log-probabilities after a prefilled answer instead (lite.jsonl, lite_summary.json)."""
    if s.mode == "lite":
        from lhd_train.entitle.lite import lite_lines, run_lite

        lite = run_lite(s)
        for line in lite_lines(lite.summary):
            console.print(line, highlight=False, markup=False)
        console.print(f"results: {lite.out / 'lite.jsonl'}, {lite.out / 'lite_summary.json'}")
        return
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
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON"),
) -> None:
    """Recompute summary.json from answers.jsonl (after --relabel, from the new labels) and print it; for a lite
    directory, lite_summary.json from lite.jsonl."""
    from lhd_train.entitle.lite import is_lite_dir, lite_lines, lite_summary

    if is_lite_dir(directory):
        lite = lite_summary(directory)
        if as_json:
            from lhd_train.io.files import json_text

            print(json_text(lite, indent=1))
        else:
            for line in lite_lines(lite):
                console.print(line, highlight=False, markup=False)
        return
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
    if as_json:
        from lhd_train.io.files import json_text

        print(json_text(summary, indent=1))
        return
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


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise InputError("command line", "--band", f"{text!r}", "two fractions of depth, e.g. 0.35,0.85") from None
    if not 0 <= lo <= hi <= 1:
        raise InputError("command line", "--band", f"{text!r}", "0 <= low <= high <= 1")
    return lo, hi


@app.command("read")
def read_cmd(
    directory: Path = typer.Argument(..., help="an entitle directory"),
    lens: Path | None = typer.Option(None, "--lens", help="Jacobian lens directory (J-all); also gives the "
                                     "random-transport control"),
    lens_self: Path | None = typer.Option(None, "--lens-self", help="a self-only Jacobian lens directory"),
    tuned_lens: Path | None = typer.Option(None, "--tuned-lens", help="a tuned lens directory (lhd lens tune) on "
                                           "the lens's layers"),
    model: str | None = typer.Option(None, "--model", help="default: the model the answers were made with"),
    out: Path | None = typer.Option(None, "--out", help="default: DIR/read"),
    band: str = typer.Option("0.35,0.85", "--band", help="the workspace band, fractions of depth (declared in "
                             "plan.json before reading)"),
    primary: str | None = typer.Option(None, "--primary", help="READOUT:POSITION of the primary cell (positions: "
                                       "claim, decision, question, elicit; stated:elicit is the model's own answer; "
                                       "default jacobian:claim with --lens, else logit:claim)"),
    bootstrap: int = typer.Option(2000, "--bootstrap", min=0, help="cluster-bootstrap resamples (tasks)"),
    seed: int = typer.Option(0, "--seed", help="bootstrap, probe and random-transport seed"),
    max_answers: int | None = typer.Option(None, "--max-answers", min=2, help="read at most this many answers"),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="also the linear probe (folds grouped by task)"),
    dtype: str = typer.Option("float32", "--dtype", help="model dtype"),
    device: str = typer.Option("auto", "--device"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """Lens and probe margins at the asserted figure, the decision token, the question (a negative control) and
    an elicitation after the answer (with the model's own Yes - No there, `stated`): fabricated vs supported
    within each fact, with random-transport, length and echo controls."""
    from lens.entitle_read import EntitleReadConfig, read_entitle, with_adapter
    from lens.margins import resolve_token_sets
    from lens.model import load_hf
    from lens.readout import BASELINE, PRIMARY, Lenses, build_readouts
    from lens.store import load_lens
    from lens.tuned import load_tuned_lens
    from lhd_train.entitle.store import EntitleDir
    from lhd_train.io.files import read_jsonl
    from lhd_train.rundir.lock import run_dir_lock
    from lhd_train.rundir.outputs import check_out_dir

    d = EntitleDir(directory)
    if not d.exists():
        raise InputError(directory, None, "not an entitle directory (no entitle.json)")
    record = d.record()
    model_id = model or record.model.spec.get("model")
    if not model_id:
        raise InputError(d.manifest, "model.spec.model", "no model recorded; pass --model")
    ro_name, _, pos = (primary or f"{PRIMARY if lens else BASELINE}:claim").partition(":")
    out = out or d.read_dir
    check_out_dir(out, what="entitle read")
    if threads:
        import torch

        torch.set_num_threads(threads)
    with run_dir_lock(out, stage="lhd entitle read"):
        m, tok = load_hf(model_id, dtype=dtype, device=device)
        m = with_adapter(m, record.model.adapter)
        given = Lenses(load_lens(lens, model=m) if lens is not None else None,
                       self_lens=load_lens(lens_self, model=m) if lens_self is not None else None,
                       tuned=load_tuned_lens(tuned_lens, model=m) if tuned_lens is not None else None,
                       control_seed=seed)
        readouts = build_readouts(m, given)
        lenses = {name: lz.meta.sha256 for name, ro in readouts.items()
                  if (lz := ro.fitted) is not None and lz.meta.sha256 is not None}
        sets = resolve_token_sets(tok, model_type=getattr(m, "model_type", None))
        cfg = EntitleReadConfig(band=_band(band), primary_readout=ro_name, primary_position=pos or "claim",
                                n_boot=bootstrap, seed=seed, probe=probe,
                                max_answers=max_answers, progress=progress)
        summary = read_entitle(m, tok, read_jsonl(d.answers_path), list(readouts.values()), sets, out, cfg,
                               info={"model": model_id, "lenses": lenses, "entitle_dir": str(d.path)})
    p = summary.get("primary")
    if p is None:
        console.print(f"[yellow]{summary.get('note') or 'no primary cell'}[/yellow]")
    else:
        console.print(f"primary ({ro_name} at {pos or 'claim'}, band): paired AUROC {p['auroc']:.2f} "
                      f"[{p['lo']:.2f}, {p['hi']:.2f}] over {p['n_pairs']} pairs in {p['n_groups']} facts")
    console.print(f"read {summary['n_answers']} answers -> {out}")


@app.command("steer")
def steer_cmd(
    directory: Path = typer.Argument(..., help="an entitle directory made with the hf backend, or a lite directory"),
    lens: Path | None = typer.Option(None, "--lens", help="Jacobian lens directory (default: the logit-lens "
                                     "direction, J = I)"),
    layer: int | None = typer.Option(None, "--layer", help="block to steer at (default: 60% of the depth)"),
    alpha: list[float] = typer.Option([0.25, 0.5, 1.0], "--alpha", help="strength, in units of the residual's norm "
                                      "at the decision position (repeatable: a dose-response)"),
    random: int = typer.Option(20, "--random", min=0, help="norm-matched random directions (the null distribution)"),
    random_alpha: list[float] | None = typer.Option(None, "--random-alpha", help="lite mode: the strengths the random "
                                                    "directions run at (repeatable; default: every --alpha)"),
    cell: list[str] | None = typer.Option(None, "--cell", help="files/pressure cells to ask again (repeatable; "
                                          "default deleted/none and control/none, in lite mode deleted/none)"),
    facts: int | None = typer.Option(None, "--facts", min=1, help="lite mode: at most this many facts, spread over "
                                     "the tasks"),
    seed: int = typer.Option(0, "--seed", help="seed of the random directions"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
) -> None:
    """The causal arm: ask again with the entitlement direction (and random ones) added at the decision token,
    and test the change in fabrication rate against the unsteered answers (McNemar, paired by fact). On a lite
    directory: the change in the forced-choice abstention margin, beside a token-matched direction, the random
    directions' null distribution and the coherence of a neutral continuation."""
    from lhd_train.entitle.lite import is_lite_dir

    if is_lite_dir(directory):
        from lhd_train.entitle.lite_steer import LiteSteerSettings, run_lite_steer, steer_lines

        res = run_lite_steer(LiteSteerSettings(directory=directory, lens=lens, layer=layer, alphas=list(alpha),
                                               random=random, random_alphas=list(random_alpha) if random_alpha
                                               else None, seed=seed, cells=list(cell or ["deleted/none"]),
                                               facts=facts, progress=progress))
        for line in steer_lines(res):
            console.print(line, highlight=False, markup=False)
        console.print(f"results: {Path(directory) / 'steer_lite_summary.json'}")
        return
    from lhd_train.entitle.steer import SteerSettings, run_steer

    summary = run_steer(SteerSettings(directory=directory, lens=lens, layer=layer, alphas=list(alpha),
                                      random=random, seed=seed, cells=list(cell or ["deleted/none", "control/none"]),
                                      progress=progress))
    for o in summary["directions"]:
        fab = o["fabrication"]
        line = f"{o['direction']:>12} alpha {o['alpha']:<5g} fabrication {_rate(fab)}"
        p = o.get("vs_unsteered")
        if p:
            line += (f"; vs unsteered: {p['n_pairs']} pairs, {p['a_only']} stopped / {p['b_only']} started, "
                     f"McNemar p {p['p_mcnemar']:.3g}")
        console.print(line)
    console.print(f"results: {Path(directory) / 'steer'}")


@app.command("compare")
def compare_cmd(
    base: Path = typer.Argument(..., help="the base model's entitle directory"),
    other: Path = typer.Argument(..., help="the other (adapter's) entitle directory: same items and sampling"),
) -> None:
    """Judge-free base vs adapter: the same answers paired (fact, condition, sample), the change in fabrication,
    capitulation and support with task-bootstrap intervals and McNemar's exact test."""
    from lhd_train.entitle.compare import compare
    from lhd_train.entitle.store import EntitleDir

    c = compare(EntitleDir(base), EntitleDir(other))
    console.print(f"{c['other_model']} against {c['base_model']} ({c['unpaired']} answers without a partner)")
    for name, m in c["measures"].items():
        lo, hi = m["ci95"]
        interval = "" if lo is None else f" [{lo:+.2f}, {hi:+.2f}]"
        diff = "-" if m["diff"] is None else f"{m['diff']:+.2f}"
        rates = " -> ".join("-" if x is None else f"{x:.2f}" for x in (m["rate_a"], m["rate_b"]))
        console.print(f"{name}: {m['n_pairs']} pairs, {rates}, difference {diff}{interval}, "
                      f"McNemar p {m['p_mcnemar']:.3g}: {m['verdict']}")
