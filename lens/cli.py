"""`lhd lens ...`: fit, merge, probe build, read (a typer app the main CLI mounts as `lens`)."""
from __future__ import annotations

import functools
import json
import logging
import os
import sys
from pathlib import Path

import typer

from lens.errors import LensError

app = typer.Typer(help="Jacobian lens: fit or load a lens, build entitlement probes, read margins.",
                  no_args_is_help=True)
probe_app = typer.Typer(help="Entitlement probe sets.", no_args_is_help=True)
app.add_typer(probe_app, name="probe")

log = logging.getLogger("lens")


def _setup_logging() -> None:
    if not logging.getLogger().handlers and not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _clean_errors(fn):
    """Bad input ends with one line on stderr and exit code 2, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from lhd_train.errors import LhdError, report_error

        _setup_logging()
        try:
            return fn(*args, **kwargs)
        except LhdError as exc:  # LensError is one
            raise typer.Exit(report_error(exc)) from None

    return wrapper


def _out_lock(*dirs: Path | None, stage: str):
    """lhd's run-directory lock (lhd_train.rundir.lock) on the folders a lens command reads or writes."""
    from lhd_train.rundir.lock import run_dir_lock

    return run_dir_lock(*dirs, stage=stage)


def parse_layers(spec: str | None) -> list[int] | None:
    """`all` / empty → None (every block below the target); else `0,3,5-8,-2`."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return None
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part[1:]:
                a, b = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
        except ValueError:
            raise LensError(f"bad layer list {spec!r} (examples: all, 0,1,2, 4-20, -2)") from None
    return out


def _set_threads(n: int | None) -> None:
    if n is not None:
        import torch

        torch.set_num_threads(n)


#: the largest sensible value of each bounded option (a typo such as --bootstrap 10000000000 would
#: otherwise run for days or allocate past memory before saying anything)
_MAX = {"--threads": 4096, "--max-length": 1 << 20, "--bootstrap": 1_000_000, "--dim-batch": 1 << 20,
        "--probe-folds": 1000, "--seed": 2**32 - 1}


def _bounded(**options: tuple[int | float | None, int | float]) -> None:
    """Refuse an option below its minimum (or past `_MAX`) in one line, before any model loads.
    `options`: python name -> (value, minimum); None values (option not given) pass."""
    for name, (value, low) in options.items():
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        high = _MAX.get(flag)
        if isinstance(value, float) and value != value:
            raise LensError(f"{flag} is not a number (got nan)")
        if value < low or (high is not None and value > high):
            allowed = f">= {low}" if high is None else f"{low} ... {high}"
            raise LensError(f"{flag} must be {allowed}, got {value}")


def _check_out(out: Path | None, flag: str = "--out") -> None:
    """`--out` may not be a file, a run directory or inside a run's own files (lhd's rule,
    lhd_train.rundir.outputs), checked before any model loads."""
    from lhd_train.rundir.outputs import check_out_dir

    if out is not None:
        check_out_dir(out, flag=flag, what="lens output")


@app.command()
@_clean_errors
def fit(
    model: str = typer.Argument(..., help="HF model id or local model dir."),
    corpus: Path | None = typer.Option(None,
                                       help="Text file (paragraphs), JSONL (a text field) or a datasets dir "
                                            "(save_to_disk). Required unless --plan."),
    out: Path | None = typer.Option(None,
                                    help="Output dir: lens.safetensors, lens.json, fit_report.json, convergence.csv, "
                                         "checkpoint.pt. Required unless --plan."),
    corpus_format: str = typer.Option("auto", "--format", help="auto | text | jsonl | dataset"),
    text_field: str = typer.Option("text", help="JSONL / dataset column with the text."),
    split: str | None = typer.Option(None, help="Split of a DatasetDict (default train)."),
    n_prompts: int | None = typer.Option(100, help="Use the first N prompts (before sharding)."),
    min_chars: int = typer.Option(0, help="Drop texts shorter than this (the reference uses 600)."),
    chunk_chars: int = typer.Option(0,
                                    help="Join and re-cut the corpus into pieces of this many characters (0 = off)."),
    chat: bool = typer.Option(False, "--chat/--no-chat", help="Wrap each text in the model's chat template."),
    max_length: int = typer.Option(128, help="Truncate prompts to this many tokens."),
    skip_first: int = typer.Option(16, help="Positions excluded at the start (attention sinks)."),
    target_layer: int = typer.Option(-1, help="Target block: -1 = last, -2 = penultimate."),
    source_layers: str = typer.Option("all", help="Blocks to fit: all (below the target) or e.g. 0,4,8-12."),
    dim_batch: int | None = typer.Option(None,
                                         help="Output dims per backward pass (memory/speed only); default: the "
                                              "largest of 128, 64, ... that fits the free GPU memory (64 on CPU)."),
    method: str = typer.Option("replicate",
                               help="replicate (reference: prompt repeated along the batch) | vmap (batched grads)."),
    dtype: str = typer.Option("auto", help="Model dtype: auto (bfloat16 on CUDA, float32 elsewhere) | float32 | "
                                           "bfloat16 | float16."),
    device: str = typer.Option("auto"),
    revision: str | None = typer.Option(None, help="Model revision (recorded in the sidecar)."),
    attn: str = typer.Option("auto", help="attn_implementation: auto (sdpa; eager with --method vmap) | sdpa | eager."),
    save_dtype: str = typer.Option("float16", help="dtype of the saved matrices."),
    checkpoint_every: int = typer.Option(0, help="Also checkpoint every N prompts (0 = by time only)."),
    checkpoint_minutes: float = typer.Option(30.0, help="Checkpoint when this many minutes passed since the last "
                                                        "one (0 = only at the end)."),
    plan: bool = typer.Option(False, "--plan",
                              help="Print the memory and time plan and stop (reads config.json only, no weights)."),
    memory_gib: float | None = typer.Option(None, help="Device memory budget for the plan, GiB (default: the free "
                                                       "memory of the CUDA device; none on CPU)."),
    tflops: float | None = typer.Option(None, help="Sustained TFLOP/s for the plan's time estimate."),
    resume: bool = typer.Option(True, "--resume/--no-resume", help="Continue from OUT/checkpoint.pt if present."),
    shard: str | None = typer.Option(None, help="INDEX/COUNT: fit a contiguous, disjoint slice of the prompts."),
    stop_at_delta: float = typer.Option(0.0,
                                        help="Early stop when the mean Δmean of the last 10 prompts is below this."),
    min_prompts: int = typer.Option(100, help="... but not before this many prompts."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    threads: int | None = typer.Option(None, help="torch CPU threads (1 is fastest for tiny models on a busy CPU)."),
):
    """Fit J_l = E[∂h_final/∂h_l] on a corpus and save it (safetensors + JSON sidecar)."""
    from lens.corpus import CorpusSpec, load_corpus
    from lens.fit import FitOptions, FitSettings, fit_lens, write_fit_outputs
    from lens.model import load_hf, pick_device
    from lens.plan import DEFAULT_DIM_BATCH, resolve_attn, resolve_dtype
    from lens.store import save_lens
    from lhd_train.ops.shard import parse_shard, shard_bounds
    from rollouts.model_files import weights_fingerprint

    _bounded(n_prompts=(n_prompts, 1), min_chars=(min_chars, 0), chunk_chars=(chunk_chars, 0),
             max_length=(max_length, 1), skip_first=(skip_first, 0), dim_batch=(dim_batch, 1),
             checkpoint_every=(checkpoint_every, 0), checkpoint_minutes=(checkpoint_minutes, 0.0),
             memory_gib=(memory_gib, 1e-3), tflops=(tflops, 1e-3), stop_at_delta=(stop_at_delta, 0.0),
             min_prompts=(min_prompts, 0), threads=(threads, 1))
    if skip_first >= max_length:
        raise LensError(f"--skip-first {skip_first} leaves no position of a {max_length}-token prompt "
                        "(it must be below --max-length)")
    _check_out(out)
    dev = pick_device(device)
    dtype = resolve_dtype(dtype, dev)
    attn = resolve_attn(attn, method)
    the_plan = _fit_plan(model, revision, dev, dtype=dtype, attn=attn, method=method, dim_batch=dim_batch,
                         max_length=max_length, source_layers=source_layers, target_layer=target_layer,
                         memory_gib=memory_gib, tflops=tflops, required=plan)
    if plan:
        return
    if corpus is None or out is None:
        raise LensError("lhd lens fit needs --corpus FILE and --out DIR (or --plan to print the plan only)")
    if the_plan is not None:
        dim_batch = the_plan.dim_batch
    with _out_lock(out, stage="lhd lens fit"):  # one fit per --out: two would clobber one checkpoint
        _set_threads(threads)
        spec = CorpusSpec(path=str(corpus), format=corpus_format, text_field=text_field, split=split,
                          n_prompts=n_prompts,
                          min_chars=min_chars, chunk_chars=chunk_chars, chat=chat)
        prompts, recipe = load_corpus(spec)
        index, count = parse_shard(shard) if shard else (0, 1)
        a, b = shard_bounds(len(prompts), index, count)
        prompts = prompts[a:b]
        recipe["slice"] = [a, b]
        if not prompts:
            raise LensError(f"shard {index}/{count} of {recipe['n_available']} prompts is empty")
        m, tok = load_hf(model, dtype=dtype, device=str(dev), revision=revision, attn_implementation=attn)
        settings = FitSettings(target_layer=target_layer, source_layers=parse_layers(source_layers),
                               skip_first=skip_first, max_length=max_length, chat=chat,
                               dim_batch=dim_batch or DEFAULT_DIM_BATCH, method=method)
        options = FitOptions(checkpoint_every=checkpoint_every, checkpoint_minutes=checkpoint_minutes, resume=resume,
                             stop_at_delta=stop_at_delta, min_prompts=min_prompts, progress=progress)
        meta = {"model_id": model, "revision": m.revision, "corpus": recipe, "model_dtype": dtype, "attn": attn,
                "shard": {"index": index, "count": count, "slice": [a, b]},
                "model_files": weights_fingerprint(model)}  # a resume refuses other files at this path
        out.mkdir(parents=True, exist_ok=True)
        result = fit_lens(m, tok, prompts, settings, out_dir=out, options=options, meta=meta)
        save_lens(result.lens, out, dtype=save_dtype)
        write_fit_outputs(result, out)
        r = result.report
        sh = r["split_half_rel_diff"]
        typer.echo(
            f"lens: {out}  layers {r['source_layers'][0]}..{r['source_layers'][-1]} "
            f"-> target {result.lens.target_layer}, "
            f"{r['n_prompts']} prompts ({r['n_skipped']} skipped), {r['seconds_per_prompt'] or 0:.3f} s/prompt, "
            f"last Δmean {r['delta_mean_last']}, split-half max {max(sh.values()) if sh else 'n/a'}"
        )


def _fit_plan(model: str, revision: str | None, dev, *, dtype: str, attn: str, method: str, dim_batch: int | None,
              max_length: int, source_layers: str, target_layer: int, memory_gib: float | None,
              tflops: float | None, required: bool):
    """Print the plan of a fit (lens.plan) and return it; None when the config cannot be read and no plan was asked."""
    from lens.fit import resolve_layers
    from lens.model import free_memory, read_model_config
    from lens.plan import GiB, ModelShape, plan_fit

    try:
        cfg, where = read_model_config(model, revision)
        shape = ModelShape.parse(cfg, source=where)
    except LensError as exc:
        if required:
            raise
        log.warning("no memory plan: %s", exc)
        return None
    sources, target = resolve_layers(shape.n_layers, parse_layers(source_layers), target_layer)
    budget = int(memory_gib * GiB) if memory_gib is not None else free_memory(dev)
    p = plan_fit(shape, dtype=dtype, attn=attn, method=method, sources=sources, target=target, tokens=max_length,
                 dim_batch=dim_batch, budget=budget, device_type=dev.type, tflops=tflops)
    typer.echo("\n".join(p.lines()), err=not required)
    if p.fits is False and not required:
        log.warning("the plan does not fit the device memory; the fit may run out of memory (%s)", p.advice())
    return p


@app.command()
@_clean_errors
def merge(
    out: Path = typer.Argument(..., help="Output lens dir."),
    shards: list[Path] = typer.Argument(..., help="Lens dirs fitted on disjoint prompt slices."),
    save_dtype: str = typer.Option("float16"),
):
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


@app.command("eval")
@_clean_errors
def eval_(
    model: str = typer.Argument(..., help="HF model id or local model dir."),
    lens: Path = typer.Option(..., help="Lens dir (lens.json + lens.safetensors) or a published jlens .pt."),
    corpus: Path = typer.Option(..., help="Held-out text: text file, JSONL or datasets dir. Texts the lens (or a "
                                          "half) was fitted on are left out when its sidecar names this corpus."),
    out: Path = typer.Option(..., help="Output dir: eval.json, eval.md, fidelity.png."),
    held_out: int | None = typer.Option(50, help="Evaluate the first N held-out texts (0 = all)."),
    half_a: Path | None = typer.Option(None, help="Split half A: a lens fitted like --lens on half the prompts "
                                                  "(e.g. lhd lens fit --shard 0/2)."),
    half_b: Path | None = typer.Option(None, help="Split half B (the other half, e.g. --shard 1/2)."),
    corpus_format: str = typer.Option("auto", "--format", help="auto | text | jsonl | dataset"),
    text_field: str = typer.Option("text"),
    split: str | None = typer.Option(None),
    min_chars: int = typer.Option(0),
    chunk_chars: int = typer.Option(0),
    max_length: int | None = typer.Option(None, help="Tokens per text (default: the lens's max_length)."),
    skip_first: int | None = typer.Option(None, help="Positions left out at the start (default: the lens's)."),
    target_layer: int | None = typer.Option(None, help="Target layer of a .pt lens (default: last block)."),
    bootstrap: int = typer.Option(1000, help="Bootstrap resamples (over texts) for the CIs."),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("float32"),
    device: str = typer.Option("auto"),
    revision: str | None = typer.Option(None),
    attn: str = typer.Option("auto", help="attn_implementation: auto (sdpa) | sdpa | eager."),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    threads: int | None = typer.Option(None, help="torch CPU threads (1 is fastest for tiny models on a busy CPU)."),
):
    """Per-layer KL to the model's own next-token distribution and top-1 agreement on held-out text, Jacobian lens
    vs logit lens, and split-half agreement (docs/lens.md, "Fidelity")."""
    from lens.corpus import CorpusSpec, load_corpus
    from lens.fidelity import EvalConfig, evaluate, select_held_out
    from lens.model import load_hf
    from lens.plan import resolve_attn
    from lens.report import write_fidelity
    from lens.store import load_lens

    _bounded(held_out=(held_out, 0), min_chars=(min_chars, 0), chunk_chars=(chunk_chars, 0),
             max_length=(max_length, 1), skip_first=(skip_first, 0), bootstrap=(bootstrap, 0), seed=(seed, 0),
             threads=(threads, 1))
    _check_out(out)
    _set_threads(threads)
    if (half_a is None) != (half_b is None):
        raise LensError("give both --half-a and --half-b (two lenses fitted on disjoint halves), or neither")
    if held_out is not None and held_out < 0:
        raise LensError(f"--held-out must be >= 0, got {held_out}")
    with _out_lock(out, stage="lhd lens eval"):
        texts, _ = load_corpus(CorpusSpec(path=str(corpus), format=corpus_format, text_field=text_field, split=split,
                                          min_chars=min_chars, chunk_chars=chunk_chars))
        m, tok = load_hf(model, dtype=dtype, device=device, revision=revision,
                         attn_implementation=resolve_attn(attn, "replicate"))
        lz = load_lens(lens, model=m, target_layer=target_layer)
        halves = None if half_a is None else (load_lens(half_a, model=m, target_layer=target_layer),
                                              load_lens(half_b, model=m, target_layer=target_layer))
        chosen, excluded = select_held_out(texts, [lz, *(halves or ())], held_out or None)
        cfg = EvalConfig(max_length=max_length or int(lz.meta.get("max_length") or 128),
                         skip_first=skip_first if skip_first is not None else int(lz.meta.get("skip_first", 16)),
                         chat=bool(lz.meta.get("chat", False)), force_bos=bool(lz.meta.get("force_bos", True)),
                         n_boot=bootstrap, seed=seed, progress=progress)
        result = evaluate(m, tok, lz, chosen, cfg, halves=halves)
        result.update(model_id=model, lens=str(lens), lens_sha256=lz.meta.get("sha256"), lens_n_prompts=lz.n_prompts,
                      halves=None if halves is None else [str(half_a), str(half_b)],
                      corpus=str(corpus), fit_texts_excluded=excluded)
        files = write_fidelity(out, result, title=f"{model}: lens fidelity ({lz.n_prompts}-prompt lens)")
        s = result["summary"]
        typer.echo(f"evaluated {result['n_texts']} held-out texts ({excluded} fit texts left out) "
                   f"-> {files['markdown']}")
        typer.echo(f"  middle band {s['band_layers']}: Jacobian lens KL lower at {s['jacobian_lower_kl'] or 'none'}, "
                   f"higher at {s['jacobian_higher_kl'] or 'none'} (of {s['layers_compared'] or 'none'})")


@probe_app.command("build")
@_clean_errors
def probe_build(
    pack: str = typer.Option(..., help="Task pack name (built in) or folder."),
    out: Path = typer.Option(..., help="Output JSONL probe set."),
    max_facts_per_task: int = typer.Option(6, help="Numeric facts sampled per task (each gives 3-4 claims)."),
    seed: int = typer.Option(0),
    deleted: bool = typer.Option(True, "--deleted/--no-deleted",
                                 help="Also add NOT_ENTITLED rows whose record has the evidence line deleted."),
    model: str | None = typer.Option(None, help="Check the token sets against this model's tokenizer."),
    token_sets: Path | None = typer.Option(None, help="JSON {S, N, R} word/id lists (with --model)."),
    token_fallback: str = typer.Option("strict", help="strict | first-token"),
):
    """Build SUPPORTED / REFUTED / NOT_ENTITLED claims from a pack's own files."""
    from lens.probes import build_probe_set, load_pack_any, write_probes

    _bounded(max_facts_per_task=(max_facts_per_task, 1), seed=(seed, 0))
    if out.is_dir():
        raise LensError(f"--out {out} is a folder; the probe set is one JSONL file")
    _check_out(out.parent)  # never among a run's own files
    p, name = load_pack_any(pack)
    rows = build_probe_set(p, pack_name=name, max_facts_per_task=max_facts_per_task, seed=seed, deleted_variant=deleted)
    counts = write_probes(rows, out)
    typer.echo(f"{len(rows)} probes -> {out}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if model:
        from lens.margins import load_token_sets_file, resolve_token_sets
        from lens.model import load_tokenizer

        tok = load_tokenizer(model)
        words = load_token_sets_file(token_sets) if token_sets else None
        ts = resolve_token_sets(tok, words, model_type=_model_type(model), fallback=token_fallback)
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
@_clean_errors
def read(
    model: str = typer.Argument(..., help="HF model id or local model dir."),
    out: Path = typer.Option(..., help="Output dir (margins.parquet, auroc.csv/.md, heatmap.png, summary.json)."),
    lens: Path | None = typer.Option(None, help="Lens dir (lens.json + lens.safetensors) or a published jlens .pt; "
                                                   "without it only the logit lens and the probe are read."),
    probes: Path | None = typer.Option(None, help="Probe set JSONL from `lhd lens probe build`."),
    run: Path | None = typer.Option(None, help="Benchmark run dir (docs/formats.md)."),
    target_layer: int | None = typer.Option(None, help="Target layer of a .pt lens (default: last block)."),
    token_sets: Path | None = typer.Option(None, help="JSON {S, N, R}: words or token ids, replacing the defaults."),
    token_fallback: str = typer.Option("strict",
                                       help="strict | first-token (use the first token of multi-token words)."),
    max_length: int = typer.Option(4096, help="Longer prompts are skipped (run mode 'full' drops middle turns first)."),
    answer_tokens: int = typer.Option(3, help="Answer tokens read after the decision position (run mode)."),
    bootstrap: int = typer.Option(2000, help="Bootstrap resamples for the CIs."),
    probe: bool = typer.Option(True, "--probe/--no-probe", help="Linear-probe baseline (record-grouped CV)."),
    probe_folds: int = typer.Option(5),
    context: str = typer.Option("compact",
                                help="Run mode: compact (system, task message, feedback) | full (exact call)."),
    auditor: str | None = typer.Option(None,
                                       help="Run mode: auditor id (default: as lhd report, the newest full-mode "
                                            "auditor)."),
    pack: str | None = typer.Option(None,
                                    help="Run mode: task pack, to locate the files exactly (default: the row's pack)."),
    limit: int | None = typer.Option(None, help="Read only the first N examples."),
    dtype: str = typer.Option("float32"),
    device: str = typer.Option("auto"),
    revision: str | None = typer.Option(None),
    attn: str = typer.Option("auto", help="attn_implementation: auto (sdpa: no gradients here, and no [heads, T, T] "
                                          "scores at long context) | sdpa | eager."),
    seed: int = typer.Option(0),
    progress: bool = typer.Option(True, "--progress/--no-progress"),
    threads: int | None = typer.Option(None, help="torch CPU threads (1 is fastest for tiny models on a busy CPU)."),
):
    """Entitlement margins per layer × position class, AUROC table with CIs, emergence, heatmap."""
    from lens.margins import load_token_sets_file, resolve_token_sets
    from lens.model import load_hf
    from lens.plan import resolve_attn
    from lens.read import ReadConfig, read_probe_set, read_run
    from lens.store import load_lens

    _bounded(max_length=(max_length, 1), answer_tokens=(answer_tokens, 1), bootstrap=(bootstrap, 0),
             probe_folds=(probe_folds, 2), limit=(limit, 1), seed=(seed, 0), threads=(threads, 1))
    if (probes is None) == (run is None):
        raise LensError("give exactly one of --probes FILE or --run RUN")
    _check_out(out)
    _set_threads(threads)
    attn = resolve_attn(attn, "replicate")
    # Only --out is locked: the run is read, never written (a read-only run, or one in progress,
    # is read up to its last whole line like `lhd report` does).
    rows = None
    if probes is not None:  # read and checked before the model loads
        from lens.probes import read_probes

        rows = read_probes(probes)[:limit]
    with _out_lock(out, stage="lhd lens read"):
        m, tok = load_hf(model, dtype=dtype, device=device, revision=revision, attn_implementation=attn)
        lz = load_lens(lens, model=m, target_layer=target_layer) if lens is not None else None
        if lz is not None and lz.meta.get("model_id") not in (None, model):
            log.warning("the lens was fitted on %s; reading %s (d_model and layer count match)",
                        lz.meta.get("model_id"), model)
        words = load_token_sets_file(token_sets) if token_sets else None
        ts = resolve_token_sets(tok, words, model_type=getattr(m, "model_type", None), fallback=token_fallback)
        cfg = ReadConfig(max_length=max_length, answer_tokens=answer_tokens, n_boot=bootstrap, seed=seed, probe=probe,
                         probe_folds=probe_folds, progress=progress)
        if probes is not None:
            summary = read_probe_set(m, tok, lz, rows, ts, out, cfg)
        else:
            p = None
            if pack:
                from lens.probes import load_pack_any

                p, _ = load_pack_any(pack)
            summary = read_run(m, tok, lz, run, ts, out, cfg, context=context, auditor=auditor, pack=p)
        typer.echo(f"read {summary['n_examples']} examples -> {out}")
        md = Path(summary["files"]["auroc_md"])
        if md.is_file():
            em = summary.get("emergence") or []
            for e in em:
                typer.echo(f"  {e['metric']} · {e['readout']} · {e['position_class']}: emergence layer "
                           f"{e['emergence_layer']}, "
                           f"best {e['best_auroc'] if e['best_auroc'] is None else round(e['best_auroc'], 3)} "
                           f"at layer {e['best_layer']}")


if __name__ == "__main__":  # pragma: no cover
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()
