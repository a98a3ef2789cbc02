"""`lhd run` and `lhd events`: the benchmark and its event schedules."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import typer
from rich.table import Table

from lhd_train.cli.console import console, shown_markup, table_console

app = typer.Typer()


@app.command("run")
def run_cmd(
    config: Path = typer.Argument(..., help="run config YAML"),
    overrides: list[str] | None = typer.Argument(None, help="key.sub=value overrides"),
    no_progress: bool = typer.Option(False, "--no-progress", help="hide the progress bar"),
    shard: str | None = typer.Option(None, "--shard", help="INDEX/COUNT (0-based): run only this block of "
                                        "the trials, in <run_name>-shard<INDEX>of<COUNT>"),
) -> None:
    """Run (or resume) the benchmark: N trials concurrently, one JSONL row per finished round."""
    from lhd_train.bench.engine import RUN_ROLES, role_specs, run_benchmark
    from lhd_train.config.run import load_config, preflight

    cfg = load_config(config, overrides or [])
    if shard:
        from lhd_train.rundir.shard import parse_shard, shard_config

        cfg = shard_config(cfg, *parse_shard(shard))
    cfg.check_windows(RUN_ROLES, config)  # max_tokens that leave no room for a prompt
    # Before any server starts: GPUs visible and not shared, no CPU vLLM for cuda, vLLM's own verdict.
    for note in preflight(role_specs(cfg, RUN_ROLES), config):
        console.print(f"[yellow]{note}[/yellow]")
    results = asyncio.run(run_benchmark(cfg, progress=not no_progress))
    print_summary(results)
    console.print(f"results: {cfg.run_dir}")
    if any(r.status != "done" for r in results):
        console.print("[yellow]some trials did not finish; run the same command again to resume[/yellow]")
        raise typer.Exit(3)


def print_summary(results: list) -> None:
    table = Table(title="trials")
    for col in ("trial", "status", "rounds", "tasks done", "completed", "trust", "satisf.", "comfort", "tokens",
                "time s"):
        table.add_column(col, justify="right" if col not in ("trial", "status") else "left")
    for r in results:
        st = r.final_state
        table.add_row(r.trial_id, r.status, str(r.rounds), str(r.tasks_done), str(r.tasks_completed),
                      f"{st.get('trust', 0):+.2f}", f"{st.get('satisfaction', 0):+.2f}", f"{st.get('comfort', 0):+.2f}",
                      str(r.tokens), f"{r.seconds:.1f}")
    table_console().print(table)
    for r in results:
        if r.error:
            console.print(f"[red]{r.trial_id}: {shown_markup(r.error)}[/red]")  # a backend's words: text only


@app.command("events")
def events_cmd(
    pack: str = typer.Option(..., "--pack", help="built-in pack name or a pack folder"),
    seed: int = typer.Option(..., "--seed"),
    p_event: float = typer.Option(0.5, "--p-event"),
    control_category: str | None = typer.Option(None, "--control-category"),
    control_pressure: str | None = typer.Option(None, "--control-pressure"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Print a trial's event schedule without running anything."""
    events_command(pack, seed, p_event, control_category, control_pressure, as_json)


def events_command(pack: str, seed: int, p_event: float = 0.5, control_category: str | None = None,
                   control_pressure: str | None = None, as_json: bool = False) -> None:
    """`lhd events`: show a trial's schedule without running anything, to pick or check seeds."""
    from lhd_train.bench.events import draw_schedule
    from lhd_train.bench.taskpack import load_pack
    from lhd_train.config.run import MAX_SEED
    from lhd_train.errors import InputError

    if isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:  # the seeds a run config accepts
        raise InputError("command line", "--seed", f"{seed} is not a trial seed", f"0 ... {MAX_SEED}")
    if not 0 <= p_event <= 1:
        raise InputError("command line", "--p-event", f"{p_event} is not a probability", "0 ... 1")

    tp = load_pack(pack)
    sched = draw_schedule(tp, seed, p_event, control_category, control_pressure)
    if as_json:
        rows = [None if e is None else {"name": e.name, "category": e.category, "pressure": e.level}
                for e in sched.entries]
        print(json.dumps(rows, indent=2))
        return
    controls = ", ".join(f"{k} {v}" for k, v in (("category", sched.control_category),
                                                  ("pressure", sched.control_pressure)) if v)
    table = Table(title=f"{tp.name}: seed {seed}, p_event {sched.p_event:g}" + (f", {controls}" if controls else ""),
                  caption=f"{sched.n_events} of {len(sched.entries)} tasks carry an event")
    for col in ("#", "phase", "task", "event"):
        table.add_column(col, overflow="fold")
    for col in ("category", "pressure"):
        table.add_column(col, no_wrap=True)
    for task, e in zip(tp.tasks, sched.entries, strict=True):
        cells = (e.name, e.category, e.level) if e else ("-", "", "")
        table.add_row(str(task.index), str(task.phase), task.title, *cells)
    table_console().print(table)
