"""GRPO steps per second: generation on a managed vLLM server (`grpo.vllm_server`, the adapter
reloaded by file each step) against TRL's in-process transformers generation, same model, recipe,
data and seed.

Each mode trains `--steps` optimizer steps of recipes/tiny/grpo-honest-vllm.yaml (the format_length
reward only, so no judge is needed) on SmolLM2-135M-Instruct, at a learning rate of 1e-6 so the
completions keep their length over the steps (at the recipe's 5e-3 they shrink from ~26 to ~3
tokens within five steps, and each step gets cheaper); the mean completion length of each mode
is printed beside its rate, since the two samplers draw different completions. Steps are timed by a trainer callback;
the first step is left out of the rate (it starts the server, and warms up both modes), and the
server's start-up is printed apart. Prints one line per mode, the ratio server / in-process, the
machine and its load average; `--json` also writes them.

    python benchmarks/grpo_vllm.py [--steps 5] [--model runs/models/smollm2-135m] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes" / "tiny" / "grpo-honest-vllm.yaml"


def run_mode(mode: str, model: Path, data: Path, out: Path, steps: int) -> dict[str, Any]:
    """Train `steps` steps; returns the seconds of each step (end to end) and the wall time."""
    from transformers import TrainerCallback

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import build_trainer

    overrides = [f"model={model}", f"data.train={data}", f"output_dir={out}", f"trainer.max_steps={steps}",
                 "trainer.save_steps=100000", "wandb.enabled=false", "trainer.learning_rate=1.0e-6",
                 "grpo.rewards=[{name: format_length, params: {min_chars: 1, max_chars: 60}}]"]
    if mode == "in-process":
        overrides.append("grpo.vllm_server=null")
    recipe = load_recipe(RECIPE, overrides, algo="grpo")
    trainer, _ = build_trainer(recipe, RECIPE)
    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    steps_s = [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]
    timed = steps_s[1:]
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    return {"mode": mode, "steps": len(steps_s), "step_s": [round(x, 2) for x in steps_s], "wall_s": round(wall, 1),
            "steps_per_s": len(timed) / sum(timed) if timed else None, "load_avg_1m": os.getloadavg()[0],
            "mean_completion_tokens": round(sum(lengths[1:]) / max(1, len(lengths) - 1), 1)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "models" / "smollm2-135m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        from lhd_train.packaged_models import build_packaged_model

        build_packaged_model("smollm2-135m", args.model)
    import torch
    from datasets import Dataset

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        rows = [{"prompt": [{"role": "user", "content": f"Give the status of task {i} in one sentence."}]}
                for i in range(4 * args.steps)]
        Dataset.from_list(rows).save_to_disk(f"{tmp}/data")
        for mode in ("in-process", "vllm-server"):
            results.append(run_mode(mode, args.model, Path(tmp) / "data", Path(tmp) / mode, args.steps))
            print(json.dumps(results[-1]), flush=True)
    rate = {r["mode"]: r["steps_per_s"] for r in results}
    ratio = rate["vllm-server"] / rate["in-process"] if rate["in-process"] and rate["vllm-server"] else None
    head = (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}, load average {os.getloadavg()[0]:.2f}; {args.model.name}, {args.steps} steps x 4 "
            "completions of 32 tokens, first step left out")
    print(head)
    for r in results:
        print(f"{r['mode']:<12} {r['steps_per_s']:.4f} steps/s  steps {r['step_s']} s  wall {r['wall_s']} s  "
              f"mean completion {r['mean_completion_tokens']} tokens (steps 2 on)")
    print(f"vllm-server / in-process: {ratio:.2f}x" if ratio else "ratio: n/a")
    if args.json:
        args.json.write_text(json.dumps({"machine": head, "results": results, "ratio": ratio}, indent=1) + "\n")


if __name__ == "__main__":
    main()
