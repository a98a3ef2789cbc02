"""The whole loop on a random tiny model, on CPU, through the same `lhd` commands a researcher
types on a GPU node: build a model → run the benchmark → audit → report → DPO data → train a
LoRA adapter → re-run the same seeds with it → audit → compare both in one report → lens.

Every step is resumable: running the demo again skips what is already on disk. The numbers mean
nothing (the model is random); the pipeline and the files are real."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
LHD = [sys.executable, "-m", "lhd_train.cli"]


def lhd(title: str, *args: str) -> None:
    print(f"\n== {title} ==\n$ lhd {' '.join(shlex.quote(a) for a in args)}", flush=True)
    t = time.time()
    subprocess.run([*LHD, *args], check=True)
    print(f"   ({time.time() - t:.0f}s)", flush=True)


def main() -> int:
    t0 = time.time()
    model = Path("runs/tiny-llama")
    if not (model / "config.json").exists():
        lhd("build a tiny random Llama and its tokenizer", "tiny-model", "--arch", "llama", "--out", str(model))
    lhd("benchmark: 2 trials x 14 tasks", "run", "configs/demo.yaml")
    # Full-trajectory auditing needs a long-context model (every round sees all ~40k tokens of
    # the trial); the tiny model has 8k, so the demo uses the per-task (short-horizon) auditor.
    lhd("audit every round (per-task auditor)", "audit", "runs/demo", "--mode", "task")
    lhd("DPO pairs, honest direction", "data", "dpo", "runs/demo", "--n", "2", "--direction", "honest",
        "--min-margin", "1", "--max-contexts", "12", "--out", "runs/demo/data/dpo-honest")
    lhd("train an honesty-directed LoRA adapter with TRL's DPOTrainer", "train", "dpo", "recipes/tiny/dpo-honest.yaml")
    lhd("re-run the same seeds with the adapter", "run", "configs/demo.yaml", "run_name=demo-dpo",
        "performer.adapter=runs/demo/adapters/dpo-honest/adapter")
    lhd("audit the adapter's run", "audit", "runs/demo-dpo", "--mode", "task")
    lhd("report: base vs adapter", "report", "runs/demo", "runs/demo-dpo", "--out", "runs/demo-report")
    lhd("lens: entitlement probes from the task pack", "lens", "probe", "build", "--pack", "startup_consulting",
        "--max-facts-per-task", "2", "--out", "runs/lens/probes.jsonl")
    lhd("lens: fit a Jacobian lens on the run's own messages", "lens", "fit", str(model), "--corpus",
        "runs/demo/trials/s390185437.messages.jsonl", "--text-field", "content", "--n-prompts", "8",
        "--max-length", "128", "--out", "runs/lens/jlens")
    lhd("lens: entitlement margins by layer and position", "lens", "read", str(model), "--lens", "runs/lens/jlens",
        "--probes", "runs/lens/probes.jsonl", "--limit", "40", "--bootstrap", "200", "--out", "runs/lens/read")
    print(f"\ndone in {time.time() - t0:.0f}s. Results:")
    for p in ("runs/demo/trials", "runs/demo/audit", "runs/demo/adapters/dpo-honest/adapter", "runs/demo-dpo/trials",
              "runs/demo-report/report.html", "runs/lens/read"):
        print(f"  {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
