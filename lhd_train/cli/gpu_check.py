"""`lhd gpu-check`: the one-GPU check of `lhd_train.ops.gpu_check`, printed as one
`CHECK <name>: PASS|FAIL|SKIP <detail>` line per check (as each finishes), the checks' `PROJ`
lines, and a summary line; exit status 1 when a check FAILed."""
from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import typer

app = typer.Typer()


@app.command("gpu-check")
def gpu_check_cmd(
    device: str = typer.Option("cuda", "--device", help="cuda | cuda:N | cpu (cpu: smoke test on a CPU machine)"),
    work: Path | None = typer.Option(None, "--work", help="scratch folder (default: a temp dir)"),
    only: str | None = typer.Option(None, "--only", help="comma-separated check names (env and tiny_model always "
                                                        "run)"),
    small: bool = typer.Option(False, "--small", "--fast", help="small slice, fewer requests and prompts"),
    everything: bool = typer.Option(False, "--all", help="also the 8B-slice checks (hf_kv_memory, hf_oom_split, "
                                    "lens_8b_slice), beyond a lease's 8 minutes"),
) -> None:
    """The paths most at risk on a GPU node, on one GPU, without network or vLLM (scripts/gpu_check.sh)."""
    from lhd_train.ops.gpu_check import run_checks

    def show(name: str, status: str, detail: str) -> None:
        print(f"CHECK {name}: {status} {detail}", flush=True)

    projections = logging.StreamHandler(sys.stdout)  # the checks log `PROJ ...` lines
    projections.setFormatter(logging.Formatter("%(message)s"))
    projections.addFilter(lambda record: record.getMessage().startswith("PROJ "))
    ops_log = logging.getLogger("lhd_train.ops")
    level = ops_log.level
    ops_log.addHandler(projections)
    ops_log.setLevel(logging.INFO)
    try:
        summary = run_checks(device, work, set(only.split(",")) if only else None, small, on_result=show,
                             everything=everything)
    finally:
        ops_log.removeHandler(projections)
        ops_log.setLevel(level)
    c = summary.counts
    print(f"gpu_check: {sum(c.values())} checks, {c['PASS']} passed, {c['FAIL']} failed, {c['SKIP']} skipped, "
          f"{math.ceil(summary.seconds)} s, device {device}, work dir {summary.work}", flush=True)
    if c["FAIL"]:
        raise typer.Exit(1)
