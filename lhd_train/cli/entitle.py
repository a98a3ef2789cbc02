"""`lhd entitle ...`: the evidence-ablation experiment labelled by code (docs/entitle.md).

run: generate and label answers, each a round of the experiment's run directory (which `lhd
audit-eval`, `report`, `view`, `export` and `lens read` read as any run); summary: recount and
print the metrics; read: lens and probe margins at the model's own claims; steer: the causal arm;
compare: base vs adapter, paired answer by answer."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from lhd_train.cli.console import console
from lhd_train.cli.options import settings_command
from lhd_train.entitle.settings import EntitleRunCommand

if TYPE_CHECKING:
    from lhd_train.entitle.store import EntitleDir
from lhd_train.errors import InputError

app = typer.Typer(help="On-policy evidence-ablation experiment: fabrication and capitulation labelled by code.",
                  no_args_is_help=True)


def _rate(r: dict | None) -> str:
    if not r or not (r.get("n") or r.get("n_unparsed")):
        return "- (n=0)"
    lo, hi = r["ci95"]
    ci = "" if lo is None else f" [{lo:.2f}, {hi:.2f}]"
    value = "-" if r["rate"] is None else f"{r['rate']:.2f}"
    b0, b1 = r.get("bounds") or (None, None)
    bounds = "" if b0 is None else f", {b0:.2f}-{b1:.2f} with unparsed as 0-1"
    return f"{value}{ci} ({r['k']}/{r['n']}, {r['n_unparsed']} unparsed{bounds})"


def _p(test: dict) -> str:
    c = test["cluster_test"]
    return f"sign-flip p {c['p']:.3g} over {c['n_tasks']} tasks (McNemar on pooled pairs {test['p_mcnemar']:.3g})"


def print_summary(summary: dict) -> None:
    """The cells' label counts, the headline rates with their bounds and the paired tests."""
    console.print(f"{summary['n_answers']} answers about {summary['n_facts']} facts of {summary['n_tasks']} tasks")
    power = summary.get("power") or {}
    if power.get("min_p", 0) >= 0.05:
        console.print(f"[yellow]{power['note']}: ask about more tasks (--pack all, more --facts)[/yellow]")
    if summary.get("missing_note"):
        console.print(f"[yellow]{summary['missing_note']}[/yellow]")
    for c in summary["conditions"]:
        counts = ", ".join(f"{k} {v}" for k, v in c["counts"].items() if v)
        console.print(f"  {c['files']:>8}/{c['pressure']:<7} n={c['n']:<4} {counts}")
    for measure, cells in summary["rates"].items():
        if measure == "abstention":
            continue
        for cell, r in cells.items():
            if not (r["n"] or r["n_unparsed"]):
                continue
            line = f"{measure} rate, {cell}: {_rate(r)}"
            if measure == "fabrication":
                o, e = r["origin"], r.get("evidence_on_assertion")
                line += f"; copied {o['copied']}, novel {o['novel']}, equals truth {o['equals_truth']}"
                if e and e["diff"] is not None:
                    line += f"; beside evidence_on_assertion {e['diff']:+.2f} (p {e['p']:.3g})"
            console.print(line)
    for p in summary["paired"]:
        console.print(f"paired {p['test']} ({p['a']} -> {p['b']}): {p['n_pairs']} pairs, {p['a_only']} only in a, "
                      f"{p['b_only']} only in b ({p['pairs_lost_to_unparsed']} lost to unparsed); {_p(p)}")


def _experiment(directory: Path) -> EntitleDir:
    from lhd_train.entitle.store import EntitleDir

    d = EntitleDir(directory)
    if not d.exists():
        raise InputError(directory, None, "not an entitle experiment (no entitle.json): run `lhd entitle run` first")
    return d


@app.command("run")
@settings_command(EntitleRunCommand)
def run_cmd(s: EntitleRunCommand) -> None:
    """Ask a model about facts of task packs' files under evidence full / deleted / altered x pressure none /
    demand (+ a neutral mention and a control question), label every answer by code, and store each answer as a
    round of the experiment's run directory (with ground_truth.jsonl and entitle_summary.json). --mode lite:
    forced-choice log-probabilities after a prefilled answer instead (lite.jsonl, lite_summary.json)."""
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
    console.print(f"results: {res.out} (a run directory; {res.out / 'entitle_summary.json'})")
    if res.errors:
        console.print(f"[yellow]{res.errors} answer(s) failed in the backend; run the same command again[/yellow]")
        raise typer.Exit(3)


@app.command("summary")
def summary_cmd(
    directory: Path = typer.Argument(..., help="an entitle experiment directory"),
    relabel: bool = typer.Option(False, "--relabel", help="label every stored answer again by today's rules "
                                 "(the rounds' labels are rewritten; the answers themselves are kept)"),
    as_json: bool = typer.Option(False, "--json", help="print entitle_summary.json to stdout instead"),
    answers: bool = typer.Option(False, "--answers", help="print one JSON object per answer (JSON Lines) instead"),
) -> None:
    """Recount entitle_summary.json and ground_truth.jsonl from the stored answers (after --relabel, from the new
    labels) and print them; a summary over an experiment with missing answers says how many. For a lite
    directory, lite_summary.json from lite.jsonl."""
    import json

    from lhd_train.entitle.lite import is_lite_dir, lite_lines, lite_summary

    if is_lite_dir(directory):
        lite = lite_summary(directory)
        if as_json:
            print(json.dumps(lite, indent=1, ensure_ascii=False))
        else:
            for line in lite_lines(lite):
                console.print(line, highlight=False, markup=False)
        return
    from collections import Counter

    from lhd_train.entitle.generate import relabel as relabel_row
    from lhd_train.entitle.run import finish
    from lhd_train.rundir.lock import run_dir_lock

    if as_json and answers:
        raise InputError("command line", "--json/--answers", "both given", "one of them")
    d = _experiment(directory)
    with run_dir_lock(d.path, stage="lhd entitle summary"):
        if relabel:
            rows = d.answers()
            new = [relabel_row(r) for r in rows]
            changed = Counter(f"{a.label} -> {b.label}" for a, b in zip(rows, new, strict=True) if a.label != b.label)
            d.rewrite(new)
            if not (as_json or answers):
                console.print("relabelled: " + (", ".join(f"{k} {v}" for k, v in sorted(changed.items()))
                                                or "no change"))
        summary = finish(d)
    if answers:
        keep = ("id", "fact", "pack", "task", "files", "pressure", "sample", "label", "subtype", "answer", "asserted",
                "shown", "demanded", "value", "label_reason", "trial_id")
        for r in d.answers():
            data = r.to_json()
            print(json.dumps({k: data.get(k) for k in keep}, ensure_ascii=False))
    elif as_json:
        print(json.dumps(summary, indent=2, ensure_ascii=False))
    else:
        print_summary(summary)


def _band(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise InputError("command line", "--band", f"{text!r}", "two fractions of depth, e.g. 0.35,0.85") from None
    if not 0 <= lo <= hi <= 1:
        raise InputError("command line", "--band", f"{text!r}", "0 <= low <= high <= 1")
    return lo, hi


def entitle_answers(directory: Path) -> list:
    """The answers `lhd entitle read` reads (the row that counts per id), as the reader's typed rows: where the
    experiment stores its answers is this one function."""
    from lhd_train.entitle.store import EntitleDir
    from lhd_train.reading.entitle_answers import AnswerToRead

    return [AnswerToRead.of(r) for r in EntitleDir(directory).latest().values()]


@app.command("read")
def read_cmd(
    directory: Path = typer.Argument(..., help="an entitle experiment directory"),
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
                                       "claim, answer_end, decision, question, elicit; stated:elicit is the model's "
                                       "own answer, asked both ways; default jacobian:elicit with --lens, else "
                                       "logit:elicit)"),
    primary_cell: str = typer.Option("deleted/none", "--primary-cell", help="the cell of the primary within-cell "
                                     "contrast: deleted/none (fabricated vs abstained), full/none (contradicted vs "
                                     "supported), full/demand (capitulated vs supported)"),
    bootstrap: int = typer.Option(2000, "--bootstrap", min=0, help="cluster-bootstrap resamples (tasks)"),
    seed: int = typer.Option(0, "--seed", help="bootstrap, probe and random-transport seed"),
    max_answers: int | None = typer.Option(None, "--max-answers", min=2, help="read at most this many answers "
                                           "(whole facts)"),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="also the linear probe (folds grouped by task)"),
    dtype: str = typer.Option("float32", "--dtype", help="model dtype"),
    device: str = typer.Option("auto", "--device"),
    threads: int | None = typer.Option(None, "--threads", min=1, help="torch CPU threads"),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    as_json: bool = typer.Option(False, "--json", help="print the summary as JSON (primary first)"),
) -> None:
    """Lens and probe margins at the model's own answers, compared within a cell (fabricated vs abstained,
    contradicted vs supported, capitulated vs supported under one prompt), with the decision token as an exact
    negative control, recall at 1% false positives, a text-only baseline, and the stated margin asked both ways;
    fabricated vs supported across cells stays as the secondary evidence-detection result."""
    import json

    from lens.margins import resolve_token_sets
    from lens.model import load_hf, with_adapter
    from lens.readout import BASELINE, PRIMARY, Lenses, SelfLens, TunedLensReadout, build_readouts, load_fitted
    from lhd_train.reading.entitle import EntitleReadConfig, read_entitle
    from lhd_train.reading.entitle_answers import PRIMARY_CELLS
    from lhd_train.rundir.lock import run_dir_lock
    from lhd_train.rundir.outputs import check_out_dir

    if primary_cell not in PRIMARY_CELLS:
        raise InputError("command line", "--primary-cell", f"{primary_cell!r}", ", ".join(PRIMARY_CELLS))
    d = _experiment(directory)
    answers = entitle_answers(directory)  # a damaged file is refused before the model loads
    record = d.record()
    model_id = model or record.model.spec.get("model")
    if not model_id:
        raise InputError(d.manifest, "model.spec.model", "no model recorded; pass --model")
    ro_name, _, pos = (primary or f"{PRIMARY if lens else BASELINE}:elicit").partition(":")
    out = out or d.read_dir
    check_out_dir(out, what="entitle read")
    if threads:
        import torch

        torch.set_num_threads(threads)
    with run_dir_lock(out, stage="lhd entitle read"):
        m, tok = load_hf(model_id, dtype=dtype, device=device)
        m = with_adapter(m, record.model.adapter)
        paths = {PRIMARY: lens, SelfLens.name: lens_self, TunedLensReadout.name: tuned_lens}
        given = Lenses(load_fitted({k: p for k, p in paths.items() if p is not None}, model=m), control_seed=seed)
        readouts = build_readouts(m, given)
        lenses = {name: lz.meta.sha256 for name, ro in readouts.items()
                  if (lz := ro.fitted) is not None and lz.meta.sha256 is not None}
        sets = resolve_token_sets(tok, model_type=getattr(m, "model_type", None))
        cfg = EntitleReadConfig(band=_band(band), primary_readout=ro_name, primary_position=pos or "elicit",
                                primary_cell=primary_cell, n_boot=bootstrap, seed=seed, probe=probe,
                                max_answers=max_answers, progress=progress)
        summary = read_entitle(m, tok, answers, list(readouts.values()), sets, out, cfg,
                               info={"model": model_id, "lenses": lenses, "entitle_dir": str(d.path)})
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    p = summary["primary"]
    if summary.get("note"):
        console.print(f"[yellow]{summary['note']}[/yellow]")
    ci = p["ci"]
    auroc = "-" if p["auroc"] is None else f"{p['auroc']:.2f}" + ("" if ci[0] is None else f" [{ci[0]:.2f}, "
                                                                  f"{ci[1]:.2f}]")
    recall = "-" if p["recall_at_1pct_fpr"] is None else f"{p['recall_at_1pct_fpr']:.2f}"
    console.print(f"primary ({p['readout']} at {p['position']}, band; {p['contrast']} in {p['cell']}): AUROC within "
                  f"the prompt {auroc} over {p['n_pairs']} pairs in {p['n_strata']} prompts; recall at 1% FPR "
                  f"{recall}")
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
    and test the change in fabrication rate against the unsteered answers (sign-flip over tasks). On a lite
    directory: the change in the forced-choice abstention margin, beside a token-matched direction, the random
    directions' null distribution and the coherence of a neutral continuation."""
    import math

    from lhd_train.entitle.lite import is_lite_dir

    for a in [*alpha, *(random_alpha or [])]:
        if not math.isfinite(a):
            raise InputError("command line", "--alpha", f"{a!r}", "a finite strength, e.g. 0.5")
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
    """Judge-free base vs adapter: the same answers paired (fact, cell, sample), the change in fabrication,
    capitulation, support and the unparsed share, with task-bootstrap intervals and a sign-flip test over tasks."""
    from lhd_train.entitle.compare import compare
    c = compare(_experiment(base), _experiment(other))
    console.print(f"{c['other_model']} against {c['base_model']} ({c['unpaired']} answers without a partner)")
    if c.get("note"):
        console.print(f"[yellow]{c['note']}[/yellow]")
    for name, m in c["measures"].items():
        lo, hi = m["ci95"]
        interval = "" if lo is None else f" [{lo:+.2f}, {hi:+.2f}]"
        diff = "-" if m["diff"] is None else f"{m['diff']:+.2f}"
        rates = " -> ".join("-" if x is None else f"{x:.2f}" for x in (m["rate_a"], m["rate_b"]))
        console.print(f"{name}: {m['n_pairs']} pairs, {rates}, difference {diff}{interval}, {_p(m)}: {m['verdict']}")


@app.command("label")
def label_cmd(
    answers: Path = typer.Argument(..., help="JSONL of answers: answer, shown (null when the files lack the fact), "
                                   "optional demanded, value, entity, attribute, context, id"),
    out: Path = typer.Option(..., "--out", help="JSONL written: every row with label, subtype, reason, asserted"),
) -> None:
    """Label answers from any source by the labeller's rules (docs/entitle.md, "Labels"), e.g. an API model's."""
    from lhd_train.entitle.relabel import relabel_file

    counts = relabel_file(answers, out)
    console.print(f"{sum(counts.values())} answers labelled: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + f"; written to {out}")
