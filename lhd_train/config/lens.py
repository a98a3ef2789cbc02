"""The options of the `lhd lens` commands, declared once: type, default, bounds, help.

The command line (`lhd_train.cli.lens`, through `lhd_train.cli.options`), the Slurm lens stage
(`ops.slurm_vars.LensVars` takes every `FitArgs` field as a variable) and the job's rendered
`lhd lens fit` flags all come from these models, so a default cannot differ between them. The
`lens` package itself takes plain dataclasses (`CorpusSpec`, `FitSettings`, ...),
filled from these by field name. Field conventions (`flag`, `argument`) are those of `config.flags`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from lhd_train.config.base import StrictModel

ModelDtype = Literal["float32", "bfloat16", "float16"]
Attn = Literal["auto", "sdpa", "eager"]
SEED_MAX = 2**32 - 1


def _threads() -> int | None:
    return Field(None, ge=1, le=4096, description="torch CPU threads (1 is fastest for tiny models on a busy CPU).")


def parse_layers(spec: str | None) -> list[int] | None:
    """`all` / empty → None (every block below the target); else `0,3,5-8,-2`. ValueError if malformed."""
    if spec is None or spec.strip().lower() in ("", "all"):
        return None
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                a, b = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                first, last = int(a), int(b)
            else:
                first = last = int(part)
        except ValueError:
            raise ValueError(f"bad layer list {spec!r} (examples: all, 0,1,2, 4-20, -2)") from None
        if last < first:  # an empty range would leave no layer, reported later as if none were below the target
            raise ValueError(f"the range {part} in {spec!r} runs backwards: write {last}-{first}")
        out += list(range(first, last + 1))
    if not out:
        raise ValueError(f"bad layer list {spec!r}: it names no layer (examples: all, 0,1,2, 4-20, -2)")
    return out


class CorpusArgs(StrictModel):
    """Which texts of a corpus file a fit or an eval reads (`lens.corpus.CorpusSpec` without the path)."""

    format: Literal["auto", "text", "jsonl", "dataset", "messages"] = Field(
        "auto", description="Corpus format; messages (lhd lens eval only): JSONL of chat transcripts, each rendered "
                            "with the model's chat template.")
    text_field: str = Field("text", description="JSONL / dataset column with the text (--format messages: with "
                                                "the list of {role, content} messages; 'text' means 'messages').")
    split: str | None = Field(None, description="Split of a DatasetDict (default train).")
    min_chars: int = Field(0, ge=0, description="Drop texts shorter than this (the reference uses 600).")
    chunk_chars: int = Field(0, ge=0, description="Join and re-cut the corpus into pieces of this many characters "
                                                  "(0 = off).")


class PromptArgs(CorpusArgs):
    """The prompts a fit or a tuned lens trains on: how many, how rendered and cut, which positions count."""

    n_prompts: int = Field(100, ge=1, description="Use the first N prompts (before sharding).")
    chat: bool = Field(False, description="Wrap each text in the model's chat template.")
    max_length: int = Field(128, ge=1, le=1 << 20, description="Truncate prompts to this many tokens.")
    skip_first: int = Field(16, ge=0, description="Positions excluded at the start (attention sinks); below "
                                                  "max_length.")

    @model_validator(mode="after")
    def _positions_left(self) -> PromptArgs:
        if self.format == "messages":
            raise ValueError("format: messages (chat transcripts) is a format of lhd lens eval's --corpus; fit or "
                             "tune on text (auto, text, jsonl, dataset), with --chat for the chat template")
        if self.skip_first >= self.max_length:
            raise ValueError(f"skip_first: {self.skip_first} leaves no position of a {self.max_length}-token "
                             "prompt (it must be below max_length)")
        return self


class FitArgs(PromptArgs):
    """What a fit reads and estimates, and how: everything a batch job may set (`LensVars`)."""

    target_layer: int = Field(-1, description="Target block: -1 = last, -2 = penultimate.")
    source_layers: str = Field("all", description="Blocks to fit: all (below the target) or e.g. 0,4,8-12.")
    dim_batch: int | None = Field(None, ge=1, le=1 << 20,
                                  description="Output dims per backward pass (memory/speed only); default: the "
                                              "largest of 128, 64, ... that fits the free GPU memory (64 on CPU).")
    method: Literal["replicate", "vmap"] = Field(
        "replicate", description="replicate (reference: prompt repeated along the batch) | vmap (batched grads).")
    estimator: Literal["all", "self", "future"] = Field(
        "all", description="all: every later target position (the reference) | self: the self-only term t'=t, by "
                           "random signs at the same cost | future: all - self (2x the cost).")
    sign_seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the random signs (--estimator self/future).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype: auto is bfloat16 on CUDA, float32 elsewhere.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa (eager with --method vmap).")
    save_dtype: ModelDtype = Field("float16", description="dtype of the saved matrices.")
    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N prompts (0 = by time only).")
    checkpoint_minutes: float = Field(30.0, ge=0, description="Checkpoint when this many minutes passed since the "
                                                              "last one (0 = only at the end).")
    resume: bool = Field(True, description="Continue from OUT/checkpoint.pt if present.")
    stop_at_delta: float = Field(0.0, ge=0, description="Early stop when the mean Δmean of the last 10 prompts "
                                                        "is below this.")
    min_prompts: int = Field(100, ge=0, description="... but not before this many prompts.")

    @field_validator("source_layers")
    @classmethod
    def _layers(cls, v: str) -> str:
        parse_layers(v)
        return v

    def layers(self) -> list[int] | None:
        return parse_layers(self.source_layers)


class FitCommand(FitArgs):
    """`lhd lens fit MODEL`: the fit's settings plus what one invocation names (files, device, plan)."""

    model: str = Field(description="HF model id or local model dir.", json_schema_extra={"argument": True})
    corpus: Path | None = Field(None, description="Text file (paragraphs), JSONL (a text field) or a datasets dir "
                                                  "(save_to_disk). Required unless --plan.")
    out: Path | None = Field(None, description="Output dir: lens.safetensors, lens.json, fit_report.json, "
                                               "convergence.csv, checkpoint.pt. Required unless --plan.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    revision: str | None = Field(None, description="Model revision (recorded in the sidecar).")
    plan: bool = Field(False, description="Print the memory and time plan and stop (reads config.json only, no "
                                          "weights).")
    memory_gib: float | None = Field(None, gt=0, description="Device memory budget for the plan, GiB (default: the "
                                                             "free memory of the CUDA device; none on CPU).")
    tflops: float | None = Field(None, gt=0, description="Sustained TFLOP/s for the plan's time estimate.")
    shard: str | None = Field(None, description="INDEX/COUNT: fit a contiguous, disjoint slice of the prompts.")
    progress: bool = Field(True, description="Progress bar.")
    threads: int | None = _threads()


class TuneCommand(PromptArgs):
    """`lhd lens tune MODEL`: a tuned lens (an affine translator per layer trained on next-token KL), the
    J-lens release's third baseline, read beside a lens with `lhd lens eval --tuned-lens`."""

    model: str = Field(description="HF model id or local model dir.", json_schema_extra={"argument": True})
    corpus: Path = Field(description="Text file (paragraphs), JSONL (a text field) or a datasets dir (save_to_disk).")
    out: Path = Field(description="Output dir: tuned.safetensors, tuned.json (and tune_checkpoint.pt while it "
                                  "trains).")
    layers: str = Field("all", description="Blocks to translate: all (below the last) or e.g. 6,10,14 (those of "
                                           "the lens it is read beside).")
    steps: int = Field(300, ge=1, description="Adam steps (learning rate decays linearly to 0).")
    batch_tokens: int = Field(256, ge=1, description="Positions drawn per step.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    val_prompts: int = Field(4, ge=1, description="The last prompts of --n-prompts, held back and scored before and "
                                                  "after training.")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the position draws.")
    checkpoint_minutes: float = Field(10.0, ge=0, description="Save OUT/tune_checkpoint.pt when this many minutes "
                                                              "passed since the last save (0 = never).")
    resume: bool = Field(True, description="Continue from OUT/tune_checkpoint.pt if present (same settings only).")
    dtype: ModelDtype = Field("float32", description="Model dtype.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    revision: str | None = Field(None, description="Model revision (recorded in the sidecar).")
    progress: bool = Field(True, description="Progress bar.")
    threads: int | None = _threads()

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: str) -> str:
        parse_layers(v)
        return v

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


class EvalCommand(CorpusArgs):
    """`lhd lens eval MODEL`: a lens's quality on the release's prompt sets (pass@k, causal check) and on held-out
    text (KL beside baselines, top-k, temperature-fitted KL) (docs/lens.md, "Lens quality")."""

    model: str = Field(description="HF model id or local model dir.", json_schema_extra={"argument": True})
    readout: list[str] = _readout_field()
    out: Path = Field(description="Output dir: passk.json, passk_ranks.jsonl, causal.json (prompt sets); eval.json, "
                                  "eval.md, fidelity.png (corpus); quality.md.")
    prompt_set: list[str] = Field(default_factory=list, description="Prompt set in the J-lens release's format "
                                  "(a file, or a shipped set: multihop, order-ops, typo); repeat for several.")
    corpus: Path | None = Field(None, description="Held-out text: text file, JSONL, datasets dir, or (--format "
                                                  "messages) JSONL of chat transcripts. Texts the lens (or a half) "
                                                  "was fitted on are left out when its sidecar names this corpus.")
    control_seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the random-transport control lens.")
    causal: bool = Field(True, description="Causal check on the prompt sets (project lens directions out).")
    causal_layers: str = Field("middle", description="Layers of the causal check: middle (the lens's middle fitted "
                                                     "layer) or a list such as 10,14.")
    causal_random: int = Field(3, ge=1, le=100, description="Norm-matched random directions per lens direction.")
    held_out: int = Field(50, ge=0, description="Evaluate the first N held-out texts (0 = all).")
    half_a: Path | None = Field(None, description="Split half A: a lens fitted like the J-lens on half the prompts "
                                                  "(e.g. lhd lens fit --shard 0/2).")
    half_b: Path | None = Field(None, description="Split half B (the other half, e.g. --shard 1/2).")
    max_length: int | None = Field(None, ge=1, le=1 << 20, description="Tokens per text (default: the lens's "
                                                                       "max_length).")
    skip_first: int | None = Field(None, ge=0, description="Positions left out at the start (default: the lens's).")
    eval_layers: Literal["lens", "all"] = Field("lens", description="--corpus: read the lens's layers and the last "
                                                                    "block (lens), or every block (all).")
    temperature_positions: int = Field(512, ge=16, description="Positions of the calibration half used to fit "
                                                               "each layer's temperature.")
    target_layer: int | None = Field(None, description="Target layer of a .pt lens (default: last block).")
    bootstrap: int = Field(1000, ge=0, le=1_000_000, description="Bootstrap resamples (over texts / items) for the "
                                                                 "CIs.")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the bootstrap and the causal check's random "
                                                        "directions.")
    dtype: ModelDtype = Field("float32", description="Model dtype.")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    revision: str | None = Field(None, description="Model revision.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa.")
    progress: bool = Field(True, description="Progress bar.")
    threads: int | None = _threads()

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


class ReadSettings(StrictModel):
    """What a read computes, declared once: `lhd_train.reading.read` takes this model, and `lhd lens read`'s
    options are its fields (`ReadCommand`), so a setting has one default, one help text and one bound."""

    max_length: int = Field(4096, ge=1, le=1 << 20, description="Longer prompts are skipped (run mode 'full' drops "
                                                               "middle turns first).")
    answer_tokens: int = Field(3, ge=1, description="Run mode: first tokens of the performer's answer read "
                                                    "(answer_1..k).")
    bootstrap: int = Field(2000, ge=0, le=1_000_000, description="Bootstrap resamples for the CIs.")
    probe: bool = Field(True, description="Linear-probe baseline (record-grouped CV).")
    probe_folds: int = Field(5, ge=2, le=1000, description="Cross-validation folds of the probe.")
    max_claims: int = Field(16, ge=1, description="Run mode: asserted claims read per answer (thinned evenly beyond "
                                                  "that).")
    probe_c: float = Field(1.0, gt=0, description="Inverse regularisation strength of the probe.")
    emergence_threshold: float = Field(0.70, ge=0.5, le=1, description="AUROC from which a layer counts as "
                                                                        "emerged (three in a row, CI above 0.5).")
    band_start: float = Field(0.35, ge=0, le=1, description="Workspace band start, a fraction of depth (band means "
                                                            "and the primary cell).")
    band_end: float = Field(0.85, ge=0, le=1, description="Workspace band end, a fraction of depth.")
    primary_readout: Literal["jacobian", "jacobian_random", "logit", "probe"] = Field(
        "jacobian", description="Primary cell, declared before reading: the readout.")
    primary_anchor: Literal["record_end", "question_end", "decision"] = Field(
        "decision", description="Primary cell: the anchor position (run mode: decision, the elicitation's last "
                                "token; record_end and question_end come before the answer).")
    primary_metric: Literal["internal", "gap", "gap_stated_supported"] = Field(
        "gap_stated_supported", description="Primary cell, run mode: the score.")
    primary_contrast: Literal["length_matched", "evidence_deleted", "absent_attribute", "different_number"] = Field(
        "length_matched", description="Primary cell, probe sets: the claim-kind contrast (length_matched: the "
                                      "same claim with and without its evidence line, both records one line "
                                      "short).")
    random_control: bool = Field(True, description="Also read the random-transport control of the lens "
                                                   "(readout jacobian_random).")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the bootstrap and the probe folds.")
    progress: bool = Field(True, description="Progress bar.")

    @property
    def band(self) -> tuple[float, float]:
        return (self.band_start, self.band_end)

    @model_validator(mode="after")
    def _band(self) -> ReadSettings:
        if self.band_start > self.band_end:
            raise ValueError(f"band_start: {self.band_start} is above band_end {self.band_end}")
        return self


class ReadCommand(ReadSettings):
    """`lhd lens read MODEL`: entitlement margins of a probe set or of a run's answers."""

    model: str = Field(description="HF model id or local model dir.", json_schema_extra={"argument": True})
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
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    revision: str | None = Field(None, description="Model revision.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa (no gradients here, and no "
                                           "[heads, T, T] scores at long context).")
    threads: int | None = _threads()

    @model_validator(mode="after")
    def _one_source(self) -> ReadCommand:
        readout_paths(self.readout)
        if (self.probes is None) == (self.run is None):
            raise ValueError("probes: give exactly one of --probes FILE or --run RUN")
        return self
