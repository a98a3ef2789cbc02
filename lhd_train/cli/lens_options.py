"""The options of the `lhd lens` commands: the library's settings models (`lens.settings`: a fit's and a
tuned lens's type, default, bounds and help, declared once) plus what one invocation names (model,
files, device, threads), and `lhd lens read`'s (`config.lens.ReadSettings`). `lhd_train.cli.options`
makes the flags. Field conventions (`flag`, `argument`, `cli`) are those of `config.flags`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from lens.settings import (
    SEED_MAX,
    Attn,
    CorpusTexts,
    FitArgs,
    ModelDtype,
    PromptCorpus,
    QualitySettings,
    TuneOptions,
    TuneSettings,
    parse_layers,
)
from lhd_train.config.base import StrictModel
from lhd_train.config.lens import ReadSettings


class ModelArgs(StrictModel):
    """The model a lens command loads, and where it runs."""

    model: str = Field(description="HF model id or local model dir.", json_schema_extra={"argument": True})
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    revision: str | None = Field(None, description="Model revision (recorded in the files written).")
    threads: int | None = Field(None, ge=1, le=4096, description="torch CPU threads (1 is fastest for tiny models on "
                                                                 "a busy CPU).")


class FitCommand(FitArgs, ModelArgs):
    """`lhd lens fit MODEL`: the fit's settings plus what one invocation names (files, device, plan)."""

    corpus: Path | None = Field(None, description="Text file (paragraphs), JSONL (a text field) or a datasets dir "
                                                  "(save_to_disk). Required unless --plan.")
    out: Path | None = Field(None, description="Output dir: lens.safetensors, lens.json, fit_report.json, "
                                               "convergence.csv, checkpoint.pt. Required unless --plan.")
    plan: bool = Field(False, description="Print the memory and time plan and stop (reads config.json only, no "
                                          "weights).")
    memory_gib: float | None = Field(None, gt=0, description="Device memory budget for the plan, GiB (default: the "
                                                             "free memory of the CUDA device; none on CPU).")
    tflops: float | None = Field(None, gt=0, description="Sustained TFLOP/s for the plan's time estimate.")
    shard: str | None = Field(None, description="INDEX/COUNT: fit a contiguous, disjoint slice of the prompts.")


class TuneCommand(TuneOptions, TuneSettings, PromptCorpus, ModelArgs):
    """`lhd lens tune MODEL`: a tuned lens (an affine translator per layer trained on next-token KL), the
    J-lens release's third baseline, read beside a lens with `lhd lens eval --tuned-lens`."""

    corpus: Path = Field(description="Text file (paragraphs), JSONL (a text field) or a datasets dir (save_to_disk).")
    out: Path = Field(description="Output dir: tuned.safetensors, tuned.json (and tune_checkpoint.pt while it "
                                  "trains).")
    dtype: ModelDtype = Field("float32", description="Model dtype.")

    @model_validator(mode="after")
    def _prompts_left(self) -> TuneCommand:
        if self.val_prompts >= self.n_prompts:
            raise ValueError(f"val_prompts: {self.val_prompts} leaves no prompt of {self.n_prompts} to train on")
        return self


def _readout_field() -> Any:  # a pydantic FieldInfo
    return Field(default_factory=list, description="A readout's fitted artifact, NAME=PATH; repeat for several: "
                 "jacobian=LENS (lhd lens fit's folder or a published jlens .pt), jacobian_self= / jacobian_future= "
                 "(lenses fitted with --estimator self / future), tuned= (lhd lens tune's folder).")


def readout_paths(values: list[str]) -> dict[str, Path]:
    """`NAME=PATH` values of `--readout` by name; ValueError naming a malformed or repeated one."""
    out: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"readout: {value!r} is not NAME=PATH (e.g. jacobian=runs/lens)")
        if name.strip() in out:
            raise ValueError(f"readout: {name.strip()} is given twice")
        out[name.strip()] = Path(path.strip())
    return out


class EvalCommand(CorpusTexts, QualitySettings, ModelArgs):
    """`lhd lens eval MODEL`: a lens's quality on the release's prompt sets (pass@k, causal check) and on held-out
    text (KL beside baselines, top-k, temperature-fitted KL) (docs/lens.md, "Lens quality")."""

    readout: list[str] = _readout_field()
    out: Path = Field(description="Output dir: passk.json, passk_ranks.jsonl, passk_split.csv, causal.json "
                                  "(prompt sets); eval.json, eval.md, fidelity.png (corpus); quality.md.")
    prompt_set: list[str] = Field(default_factory=list, description="Prompt set in the J-lens release's format "
                                  "(a file, or a shipped set: multihop, order-ops, typo); repeat for several.")
    corpus: Path | None = Field(None, description="Held-out text: text file, JSONL, datasets dir, or (--format "
                                                  "messages) JSONL of chat transcripts. Texts the lens (or a half) "
                                                  "was fitted on are left out when its sidecar names this corpus.")
    control_seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the random-transport control lens.")
    causal: bool = Field(True, description="Causal check on the prompt sets (project lens directions out).")
    causal_layers: str = Field("middle", description="Layers of the causal check: middle (the lens's middle fitted "
                                                     "layer) or a list such as 10,14.")
    held_out: int = Field(50, ge=0, description="Evaluate the first N held-out texts (0 = all).")
    half_a: Path | None = Field(None, description="Split half A: a lens fitted like the J-lens on half the prompts "
                                                  "(e.g. lhd lens fit --shard 0/2).")
    half_b: Path | None = Field(None, description="Split half B (the other half, e.g. --shard 1/2).")
    max_length: int | None = Field(None, ge=1, le=1 << 20, description="Tokens per text (default: the lens's "
                                                                       "max_length).")
    skip_first: int | None = Field(None, ge=0, description="Positions left out at the start (default: the lens's).")
    eval_layers: Literal["lens", "all"] = Field("lens", description="--corpus: read the lens's layers and the last "
                                                                    "block (lens), or every block (all).")
    target_layer: int | None = Field(None, description="Target layer of a .pt lens (default: last block).")
    dtype: ModelDtype = Field("float32", description="Model dtype.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa.")
    progress: bool = Field(True, description="Progress bar.")

    @model_validator(mode="after")
    def _what_to_evaluate(self) -> EvalCommand:
        readout_paths(self.readout)
        if self.corpus is None and not self.prompt_set:
            raise ValueError("corpus: give --corpus FILE (held-out KL) and/or --prompt-set FILE (pass@k)")
        if (self.half_a is None) != (self.half_b is None):
            raise ValueError("half_a: give both --half-a and --half-b (two lenses fitted on disjoint halves), "
                             "or neither")
        if self.causal_layers != "middle":
            parse_layers(self.causal_layers)
        return self


class ProbeBuildCommand(StrictModel):
    """`lhd lens probe build`: SUPPORTED / REFUTED / NOT_ENTITLED claims from a pack's own files."""

    pack: str = Field(description="Task pack name (built in) or folder.")
    out: Path = Field(description="Output JSONL probe set.")
    max_facts_per_task: int = Field(6, ge=1, description="Numeric facts sampled per task (each gives 3-4 claims).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the fact sampling.")
    deleted: bool = Field(True, description="Also add NOT_ENTITLED rows whose record has the evidence line deleted.")
    model: str | None = Field(None, description="Check the token sets against this model's tokenizer.")
    token_sets: Path | None = Field(None, description="JSON {S, N, R} word/id lists (with --model).")
    token_fallback: Literal["strict", "first-token"] = Field(
        "strict", description="first-token: use the first token of multi-token words.")


class ReadCommand(ReadSettings, ModelArgs):
    """`lhd lens read MODEL`: entitlement margins of a probe set or of a run's answers."""

    out: Path = Field(description="Output dir (margins.parquet, auroc.csv/.md, heatmap.png, summary.json).")
    readout: list[str] = _readout_field()
    probes: Path | None = Field(None, description="Probe set JSONL from `lhd lens probe build` (or give --run).")
    run: Path | None = Field(None, description="Benchmark run dir (docs/formats.md) (or give --probes).")
    target_layer: int | None = Field(None, description="Target layer of a .pt lens (default: last block).")
    token_sets: Path | None = Field(None, description="JSON {S, N, R}: words or token ids, replacing the defaults.")
    token_fallback: Literal["strict", "first-token"] = Field(
        "strict", description="first-token: use the first token of multi-token words.")
    context: Literal["compact", "full"] = Field(
        "full", description="Run mode: full (the exact call; for any deception claim) | compact (system, task "
                            "message, feedback: an ablation without the earlier answers).")
    auditor: str | None = Field(None, description="Run mode: auditor id (default: as lhd report, the newest "
                                                  "full-mode auditor).")
    pack: str | None = Field(None, description="Run mode: task pack, to locate the files exactly (default: the "
                                               "row's pack).")
    limit: int | None = Field(None, ge=1, description="Read only the first N examples.")
    dtype: ModelDtype = Field("float32", description="Model dtype.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa (no gradients here, and no "
                                           "[heads, T, T] scores at long context).")

    @model_validator(mode="after")
    def _one_source(self) -> ReadCommand:
        readout_paths(self.readout)
        if (self.probes is None) == (self.run is None):
            raise ValueError("probes: give exactly one of --probes FILE or --run RUN")
        return self
