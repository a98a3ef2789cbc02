"""`lhd lens ...`: fit, merge, tune, eval, corpus, probe build, read (the `lens` library's commands, mounted
as `lhd lens`).

Each command's options are one settings model (`lhd_train.cli.lens_options`; `settings_command` makes
the flags) built on the library's own (`lens.settings`), so the library takes the parsed settings as
they are; the group runs every command inside lhd's one error boundary (`lhd_train.cli.boundary`),
also when invoked on its own."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import typer

from lens.errors import LensError
from lens.settings import ModelDtype, QualitySettings, parse_layers
from lhd_train.cli.boundary import GuardedGroup
from lhd_train.cli.lens_options import (
    EvalCommand,
    FitCommand,
    ProbeBuildCommand,
    ReadCommand,
    TuneCommand,
    readout_paths,
)
from lhd_train.cli.options import settings_command
from lhd_train.rundir.lock import run_dir_lock
from lhd_train.rundir.outputs import check_out_dir

app = typer.Typer(help="Jacobian lens: fit or load a lens, build entitlement probes, read margins.",
                  no_args_is_help=True, cls=GuardedGroup, pretty_exceptions_enable=False)
probe_app = typer.Typer(help="Entitlement probe sets.", no_args_is_help=True)
app.add_typer(probe_app, name="probe")

log = logging.getLogger(__name__)


def _set_threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """`--out` may not be a file, a run directory or inside a run's own files (lhd's rule,
    lhd_train.rundir.outputs), checked before any model loads."""
    if out is not None:
        check_out_dir(out, flag=flag, what="lens output")


@app.command()
@settings_command(FitCommand)
def fit(args: FitCommand) -> None:
    """Fit J_l = E[∂h_final/∂h_l] on a corpus and save it (safetensors + JSON sidecar)."""
    from lens.corpus import CorpusSpec, load_corpus
    from lens.fit import fit_lens, write_fit_outputs
    from lens.model import load_hf, pick_device
    from lens.plan import resolve_attn, resolve_dtype
    from lens.store import save_lens
    from lhd_train.rundir.shard import parse_shard, shard_bounds
    from rollouts.model_files import weights_fingerprint

    _check_out(args.out)
    dev = pick_device(args.device)
    dtype = resolve_dtype(args.dtype, dev)
    attn = resolve_attn(args.attn, args.method)
    the_plan = _fit_plan(args, dev, dtype=dtype, attn=attn, required=args.plan)
    if args.plan:
        return
    corpus, out = args.corpus, args.out
    if corpus is None or out is None:
        raise LensError("lhd lens fit needs --corpus FILE and --out DIR (or --plan to print the plan only)")
    dim_batch = the_plan.dim_batch if the_plan is not None else args.dim_batch
    with run_dir_lock(out, stage="lhd lens fit"):  # one fit per --out: two would clobber one checkpoint
        _set_threads(args.threads)
        prompts, recipe = load_corpus(CorpusSpec.of(args, str(corpus)))
        index, count = parse_shard(args.shard) if args.shard else (0, 1)
        a, b = shard_bounds(len(prompts), index, count)
        prompts = prompts[a:b]
        recipe["slice"] = [a, b]
        if not prompts:
            raise LensError(f"shard {index}/{count} of {recipe['n_available']} prompts is empty")
        m, tok = load_hf(args.model, dtype=dtype, device=str(dev), revision=args.revision, attn_implementation=attn)
        settings = args.model_copy(update={"dim_batch": dim_batch})
        meta = {"model_id": args.model, "revision": m.revision, "corpus": recipe, "model_dtype": dtype, "attn": attn,
                "shard": {"index": index, "count": count, "slice": [a, b]},
                "model_files": weights_fingerprint(args.model)}  # a resume refuses other files at this path
        out.mkdir(parents=True, exist_ok=True)
        result = fit_lens(m, tok, prompts, settings, out_dir=out, options=args, meta=meta)
        save_lens(result.lens, out, dtype=args.save_dtype)
        write_fit_outputs(result, out)
        r = result.report
        sh = r["split_half_rel_diff"]
        typer.echo(
            f"lens: {out}  layers {r['source_layers'][0]}..{r['source_layers'][-1]} "
            f"-> target {result.lens.target_layer}, estimator {settings.estimator}, "
            f"{r['n_prompts']} prompts ({r['n_skipped']} skipped), {r['seconds_per_prompt'] or 0:.3f} s/prompt, "
            f"last Δmean {r['delta_mean_last']}, split-half max {max(sh.values()) if sh else 'n/a'}"
        )


def _fit_plan(args: FitCommand, dev, *, dtype: str, attn: str, required: bool):
    """Print the plan of a fit (lens.plan) and return it; None when the config cannot be read and no plan was asked."""
    from lens.fit import resolve_layers
    from lens.model import free_memory
    from lens.plan import GiB, ModelShape, plan_fit

    try:
        shape = ModelShape.read(args.model, args.revision)
    except LensError as exc:
        if required:
            raise
        log.warning("no memory plan: %s", exc)
        return None
    sources, target = resolve_layers(shape.n_layers, parse_layers(args.source_layers), args.target_layer)
    budget = int(args.memory_gib * GiB) if args.memory_gib is not None else free_memory(dev)
    p = plan_fit(shape, dtype=dtype, attn=attn, method=args.method, sources=sources, target=target,
                 tokens=args.max_length, dim_batch=args.dim_batch, budget=budget, device_type=dev.type,
                 tflops=args.tflops)
    typer.echo("\n".join(p.lines()), err=not required)
    if p.fits is False and not required:
        log.warning("the plan does not fit the device memory; the fit may run out of memory (%s)", p.advice())
    return p


@app.command()
def merge(
    out: Path = typer.Argument(..., help="Output lens dir."),
    shards: list[Path] = typer.Argument(..., help="Lens dirs fitted on disjoint prompt slices."),
    save_dtype: ModelDtype = typer.Option("float16", help="dtype of the saved matrices."),
) -> None:
    """n_prompts-weighted mean of lenses fitted on disjoint prompt slices."""
    from lens.store import load_lens, merge_lenses, save_lens

    _check_out(out, flag="OUT")
    resolved = [p.resolve() for p in shards]
    twice = sorted({str(p) for p in shards if resolved.count(p.resolve()) > 1})
    if twice:
        raise LensError(f"{', '.join(twice)} given twice: its prompts would count twice in the merge")
    merged = merge_lenses([load_lens(p) for p in shards])
    save_lens(merged, out, dtype=save_dtype)
    typer.echo(f"merged {len(shards)} lenses ({merged.n_prompts} prompts) -> {out}")


@app.command()
@settings_command(TuneCommand)
def tune(args: TuneCommand) -> None:
    """Train a tuned lens (an affine translator per layer, next-token KL) and save it beside nothing else: read it
    with `lhd lens eval --tuned-lens` (docs/lens.md, "A tuned lens on the same prompts")."""
    from lens.corpus import CorpusSpec, load_corpus
    from lens.model import load_hf
    from lens.tuned import finish_checkpoint, fit_tuned_lens, save_tuned_lens
    from rollouts.model_files import weights_fingerprint

    _check_out(args.out)
    with run_dir_lock(args.out, stage="lhd lens tune"):  # one training per --out: two would share a checkpoint
        _set_threads(args.threads)
        prompts, recipe = load_corpus(CorpusSpec.of(args, str(args.corpus)))
        m, tok = load_hf(args.model, dtype=args.dtype, device=args.device, revision=args.revision)
        args.out.mkdir(parents=True, exist_ok=True)
        lens = fit_tuned_lens(m, tok, prompts, args, out_dir=args.out, options=args,
                              meta={"model_id": args.model, "revision": m.revision, "corpus": recipe,
                                    "model_dtype": args.dtype, "model_files": weights_fingerprint(args.model)})
        save_tuned_lens(lens, args.out)
        finish_checkpoint(args.out)
    before, after = lens.meta.kl_val_before, lens.meta.kl_val_after
    resumed = lens.meta.training.get("resumed_at")
    typer.echo(f"tuned lens: {args.out}  layers {lens.layers}, {lens.meta.n_prompts} prompts ({lens.meta.n_tokens} "
               f"positions), {args.steps} steps in {lens.meta.training['seconds']} s"
               + (f" (resumed at step {resumed})" if resumed is not None else ""))
    typer.echo("  held-back KL, logit lens -> tuned: " + ", ".join(
        f"{layer}: {before[layer]:.2f} -> {after[layer]:.2f}" for layer in after))


@app.command("eval")
@settings_command(EvalCommand)
def eval_(args: EvalCommand) -> None:
    """Lens quality: pass@k on prompt sets in the J-lens release's format (logit lens, J-lens, random-transport
    control, self/future lenses) with a causal check, and/or next-token KL on held-out text beside the uniform and
    marginal baselines, top-k and a fitted temperature, and split-half agreement (docs/lens.md, "Lens quality")."""
    from lens.model import load_hf
    from lens.plan import resolve_attn
    from lens.promptsets import load_prompt_set
    from lens.readout import PRIMARY, Lenses, build_readouts, load_fitted

    _check_out(args.out)
    _set_threads(args.threads)
    paths = readout_paths(args.readout)
    if PRIMARY not in paths:
        raise LensError(f"lhd lens eval needs the lens it evaluates: --readout {PRIMARY}=LENS")
    sets = [load_prompt_set(p) for p in args.prompt_set]  # checked before the model loads
    with run_dir_lock(args.out, stage="lhd lens eval"):
        m, tok = load_hf(args.model, dtype=args.dtype, device=args.device, revision=args.revision,
                         attn_implementation=resolve_attn(args.attn, "replicate"))
        fitted = load_fitted(paths, model=m, target_layer=args.target_layer)
        lz = fitted[PRIMARY]
        readouts = build_readouts(m, Lenses(fitted, control_seed=args.control_seed))
        if sets:
            _eval_prompt_sets(args, m, tok, lz, readouts, sets)
        if args.corpus is not None:
            _eval_corpus(args, m, tok, lz, readouts)


def _eval_prompt_sets(args: EvalCommand, m, tok, lz, readouts, sets) -> None:
    from lens.eval_report import write_prompt_set_outputs
    from lens.quality import QualityConfig, evaluate_prompt_sets, middle_layer

    layers = [middle_layer(lz)] if args.causal_layers == "middle" else parse_layers(args.causal_layers)
    cfg = QualityConfig(**_quality(args), force_bos=lz.meta.force_bos, causal_layers=layers if args.causal else None)
    res = evaluate_prompt_sets(m, tok, readouts, lz.source_layers, sets, cfg)
    meta = {"model": args.model, "lens": _lens_path(args), "lens_sha256": lz.meta.sha256,
            "lens_n_prompts": lz.n_prompts, "lens_estimator": lz.meta.estimator,
            "layers": lz.source_layers, "readouts": res.readouts, "control_seed": args.control_seed,
            "causal_layers": cfg.causal_layers, "prompt_sets": {s.name: {"path": s.path, "sha256": s.sha256}
                                                                for s in sets},
            **_other_lenses(readouts, lz)}
    files = write_prompt_set_outputs(args.out, res.passk, res.ranks, res.causal, res.causal_rows, meta,
                                     title=f"{args.model}: lens quality ({lz.n_prompts}-prompt lens)")
    typer.echo(f"pass@k on {len(sets)} prompt sets -> {files['passk']}")
    for name, entry in res.passk.items():
        cells = ", ".join(f"{r} {entry[r]['1']:.3f}/{entry[r]['10']:.3f}" for r in res.readouts)
        typer.echo(f"  {name} ({entry['n']} items) pass@1/@10: {cells}")


def _quality(args: EvalCommand) -> dict[str, Any]:
    return args.model_dump(include=set(QualitySettings.model_fields))


def _lens_path(args: EvalCommand) -> str:
    """The J-lens's path as given (`--readout jacobian=PATH`)."""
    from lens.readout import PRIMARY

    return str(readout_paths(args.readout)[PRIMARY])


def _read_beside(readouts: dict, lens: Any) -> dict[str, Any]:
    """Each lens a readout applies besides the main one (self-only, future-only, tuned), by readout name."""
    return {name: other for name, ro in readouts.items()
            if (other := ro.fitted) is not None and other is not lens}


def _other_lenses(readouts: dict, lens: Any) -> dict[str, Any]:
    """`<readout>_lens`: the SHA-256 of each lens read beside the main one (self-only, future-only, tuned)."""
    return {f"{name}_lens": other.meta.sha256 for name, other in _read_beside(readouts, lens).items()
            if other.meta.sha256 is not None}


def _eval_corpus(args: EvalCommand, m, tok, lz, readouts) -> None:
    from lens.corpus import CorpusSpec, load_corpus
    from lens.eval_report import write_fidelity
    from lens.fidelity import EvalConfig, evaluate, select_held_out
    from lens.store import load_lens

    texts, recipe = load_corpus(CorpusSpec.of(args, str(args.corpus)))
    halves = None if args.half_a is None or args.half_b is None else (
        load_lens(args.half_a, model=m, target_layer=args.target_layer),
        load_lens(args.half_b, model=m, target_layer=args.target_layer))
    fitted = [lz, *(halves or ()), *_read_beside(readouts, lz).values()]  # none of their fit texts is scored
    chosen, excluded = select_held_out(texts, fitted, args.held_out or None)
    fitted_skip = 16 if lz.meta.skip_first is None else lz.meta.skip_first
    cfg = EvalConfig(max_length=args.max_length or lz.meta.max_length or 128,
                     skip_first=args.skip_first if args.skip_first is not None else fitted_skip,
                     chat=lz.meta.chat, force_bos=lz.meta.force_bos,
                     progress=args.progress, messages=recipe["format"] == "messages", **_quality(args),
                     layers=None if args.eval_layers == "all" else lz.source_layers)
    result = evaluate(m, tok, readouts, chosen, cfg, halves=halves)
    result.update(model_id=args.model, lens=_lens_path(args), lens_sha256=lz.meta.sha256,
                  lens_n_prompts=lz.n_prompts, control_seed=args.control_seed,
                  halves=None if halves is None else [str(args.half_a), str(args.half_b)],
                  corpus=str(args.corpus), corpus_format=recipe["format"], fit_texts_excluded=excluded)
    files = write_fidelity(args.out, result, title=f"{args.model}: next-token KL by layer ({lz.n_prompts}-prompt "
                                                   "lens)")
    s, model_row = result["summary"], result["model"]
    typer.echo(f"evaluated {result['n_texts']} held-out texts ({excluded} fit texts left out) -> {files['markdown']}")
    typer.echo(f"  uniform KL {model_row['kl_uniform']:.2f} nats; middle band {s['band_layers']}: Jacobian lens KL "
               f"lower at {s['jacobian_lower_kl'] or 'none'}, higher at {s['jacobian_higher_kl'] or 'none'} "
               f"(of {s['layers_compared'] or 'none'})")


@app.command("corpus")
def corpus_(
    out: Path = typer.Argument(..., help="Output JSONL file."),
    source: str = typer.Option("python-docs", help="python-docs: the prose of the Python reference shipped with "
                                                   "Python ({\"text\"} lines, a general-text fit corpus); run: "
                                                   "the chat transcripts of --run ({\"messages\"} lines, for "
                                                   "lhd lens eval --format messages)."),
    run: Path | None = typer.Option(None, help="Benchmark run dir (with --source run)."),
) -> None:
    """Write a corpus file that needs no download: general prose, or a run's chat transcripts."""
    from lhd_train.reading.general_corpus import (
        python_docs_texts,
        run_transcripts,
        write_messages_jsonl,
        write_texts_jsonl,
    )

    if out.is_dir():
        raise LensError(f"{out} is a folder; the corpus is one JSONL file")
    _check_out(out.parent, flag="OUT")
    if source == "python-docs":
        texts = python_docs_texts()
        write_texts_jsonl(texts, out)
        typer.echo(f"{len(texts)} texts ({sum(map(len, texts))} characters) -> {out}")
    elif source == "run":
        if run is None:
            raise LensError("--source run needs --run RUN")
        chats = run_transcripts(run)
        write_messages_jsonl(chats, out)
        typer.echo(f"{len(chats)} chat transcripts -> {out}")
    else:
        raise LensError(f"unknown --source {source!r} (allowed: python-docs, run)")


@probe_app.command("build")
@settings_command(ProbeBuildCommand)
def probe_build(args: ProbeBuildCommand) -> None:
    """Build SUPPORTED / REFUTED / NOT_ENTITLED claims from a pack's own files."""
    from lhd_train.reading.probes import build_probe_set, load_pack_any, write_probes

    out, model = args.out, args.model
    if out.is_dir():
        raise LensError(f"--out {out} is a folder; the probe set is one JSONL file")
    _check_out(out.parent)  # never among a run's own files
    p, name = load_pack_any(args.pack)
    rows = build_probe_set(p, pack_name=name, max_facts_per_task=args.max_facts_per_task, seed=args.seed,
                           deleted_variant=args.deleted)
    counts = write_probes(rows, out)
    typer.echo(f"{len(rows)} probes -> {out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if model:
        from lens.margins import load_token_sets_file, resolve_token_sets
        from lens.model import load_tokenizer

        tok = load_tokenizer(model)
        words = load_token_sets_file(args.token_sets) if args.token_sets else None
        ts = resolve_token_sets(tok, words, model_type=_model_type(model), fallback=args.token_fallback)
        for name in ("S", "N", "R"):
            forms = ts.forms[name]
            typer.echo(f"token set {name}: {len(getattr(ts, name))} tokens from {len(forms)} forms "
                       f"({', '.join(repr(f) for f in forms[:6])}{', ...' if len(forms) > 6 else ''})")
        if ts.dropped:
            typer.echo(f"dropped {len(ts.dropped)} forms that are not single tokens (or shared between sets)")


def _model_type(model: str) -> str | None:
    cfg = Path(model) / "config.json"
    if cfg.is_file():
        try:
            return json.loads(cfg.read_text()).get("model_type")
        except (OSError, json.JSONDecodeError):
            return None
    return "qwen" if "qwen" in model.lower() else None


@app.command()
@settings_command(ReadCommand)
def read(args: ReadCommand) -> None:
    """Entitlement margins per layer × position class, AUROC table with CIs, emergence, heatmap."""
    from lens.margins import load_token_sets_file, resolve_token_sets
    from lens.model import load_hf
    from lens.plan import resolve_attn
    from lens.readout import PRIMARY, load_fitted
    from lhd_train.reading.read import read_probe_set, read_run

    out, model = args.out, args.model
    _check_out(out)
    _set_threads(args.threads)
    attn = resolve_attn(args.attn, "replicate")
    # Only --out is locked: the run is read, never written (a read-only run, or one in progress,
    # is read up to its last whole line like `lhd report` does).
    rows = None
    if args.probes is not None:  # read and checked before the model loads
        from lhd_train.reading.probes import read_probes

        rows = read_probes(args.probes)[:args.limit]
    with run_dir_lock(out, stage="lhd lens read"):
        m, tok = load_hf(model, dtype=args.dtype, device=args.device, revision=args.revision, attn_implementation=attn)
        fitted = load_fitted(readout_paths(args.readout), model=m, target_layer=args.target_layer)
        lz = fitted.get(PRIMARY)
        if lz is not None and lz.meta.model_id not in (None, model):
            log.warning("the lens was fitted on %s; reading %s (d_model and layer count match)",
                        lz.meta.model_id, model)
        words = load_token_sets_file(args.token_sets) if args.token_sets else None
        ts = resolve_token_sets(tok, words, model_type=getattr(m, "model_type", None), fallback=args.token_fallback)
        if rows is not None:
            summary = read_probe_set(m, tok, fitted, rows, ts, out, args)
        else:
            run = args.run
            assert run is not None  # ReadCommand: exactly one of --probes and --run
            p = None
            if args.pack:
                from lhd_train.reading.probes import load_pack_any

                p, _ = load_pack_any(args.pack)
            summary = read_run(m, tok, fitted, run, ts, out, args, context=args.context, auditor=args.auditor, pack=p)
        typer.echo(f"read {summary['n_examples']} examples -> {out}")
        res = summary.get("primary_result") or {}
        d = res.get("declared") or {}
        cell = f"{d.get('metric')} · {d.get('readout')} · {d.get('anchor')} · band {d.get('band')}"
        if res.get("found"):
            def r(x: float | None) -> str:
                return "n/a" if x is None else f"{x:.3f}"

            typer.echo(f"  primary ({cell}): within-stratum AUROC {r(res['auroc_within'])} "
                       f"[{r(res['within_lo'])}, {r(res['within_hi'])}], pooled {r(res['auroc'])}; "
                       f"n_pos {res['n_pos']}, n_neg {res['n_neg']}")
        else:
            typer.echo(f"  primary ({cell}): not available: {res.get('why')}")
        typer.echo(f"  everything else is exploratory or a negative control: {summary['files']['auroc_md']}")

