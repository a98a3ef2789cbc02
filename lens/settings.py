"""The settings of a fit, a tuned lens and a quality evaluation, declared once: type, default, bounds, help.

The library functions take these models (`lens.fit.fit_lens`, `lens.tuned.fit_tuned_lens`,
`lens.corpus.load_corpus`, `lens.quality`, `lens.fidelity`); lhd's commands and its Slurm lens stage are built from them
(`lhd_train/cli/lens_options.py`, `ops.slurm_vars.LensVars` from `FitArgs`), so a default cannot
differ between the library and the command line. A field marked `json_schema_extra={"cli": False}`
is a library knob no command line sets (a test's stop switch). No torch here: the planners import it."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

ModelDtype = Literal["float32", "bfloat16", "float16"]
Attn = Literal["auto", "sdpa", "eager"]
SEED_MAX = 2**32 - 1
LIBRARY_ONLY: Any = {"cli": False}


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


def _layer_spec(v: Any) -> Any:
    """A layer list as its spec (`[0, 4]` → `"0,4"`, None → `"all"`), checked by `parse_layers`."""
    v = "all" if v is None else ",".join(str(int(x)) for x in v) if isinstance(v, list | tuple) else v
    if isinstance(v, str):
        parse_layers(v)
    return v


#: blocks as text (`all`, `0,4,8-12`, `-2`); a list of ints is taken too
LayerSpec = Annotated[str, BeforeValidator(_layer_spec)]


class LensSettings(BaseModel):
    """Base of the settings models: an unknown key is an error (a typo never passes silently)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class CorpusTexts(LensSettings):
    """Which texts of a corpus file are read (`CorpusSpec` without the path and count)."""

    format: Literal["auto", "text", "jsonl", "dataset", "messages"] = Field(
        "auto", description="Corpus format; messages (lhd lens eval only): JSONL of chat transcripts, each rendered "
                            "with the model's chat template.")
    text_field: str = Field("text", description="JSONL / dataset column with the text (--format messages: with "
                                                "the list of {role, content} messages; 'text' means 'messages').")
    split: str | None = Field(None, description="Split of a DatasetDict (default train).")
    min_chars: int = Field(0, ge=0, description="Drop texts shorter than this (the reference uses 600).")
    chunk_chars: int = Field(0, ge=0, description="Join and re-cut the corpus into pieces of this many characters "
                                                  "(0 = off).")


class CorpusSpec(CorpusTexts):
    """Which texts of which corpus file; its fields are a lens sidecar's `corpus` recipe."""

    path: str
    n_prompts: int | None = None  # the first N texts (None: all)
    skip_headers: bool = True  # drop WikiText-style "= Title =" lines
    chat: bool = False  # wrap each text in the model's chat template (user half / assistant half)

    @classmethod
    def of(cls, settings: BaseModel, path: str) -> CorpusSpec:
        """The corpus of a command's settings: `path` and the settings' fields of the same names (the
        `CorpusTexts` fields, and `n_prompts` and `chat` where it has them)."""
        return cls(path=path, **settings.model_dump(include=set(cls.model_fields) - {"path"}))


class PromptCorpus(CorpusTexts):
    """The prompts a fit or a tuned lens trains on: the first `n_prompts` texts, never chat transcripts."""

    n_prompts: int = Field(100, ge=1, description="Use the first N prompts (before sharding).")

    @model_validator(mode="after")
    def _not_messages(self) -> Any:
        if self.format == "messages":
            raise ValueError("format: messages (chat transcripts) is a format of lhd lens eval's --corpus; fit or "
                             "tune on text (auto, text, jsonl, dataset), with --chat for the chat template")
        return self


class PromptSettings(LensSettings):
    """How each prompt is rendered and cut, and which of its positions count."""

    chat: bool = Field(False, description="Wrap each text in the model's chat template.")
    max_length: int = Field(128, ge=1, le=1 << 20, description="Truncate prompts to this many tokens.")
    skip_first: int = Field(16, ge=0, description="Positions excluded at the start (attention sinks); below "
                                                  "max_length.")
    force_bos: bool = Field(True, description="Start every prompt with the BOS token.", json_schema_extra=LIBRARY_ONLY)

    @model_validator(mode="after")
    def _positions_left(self) -> Any:
        if self.skip_first >= self.max_length:
            raise ValueError(f"skip_first: {self.skip_first} leaves no position of a {self.max_length}-token "
                             "prompt (it must be below max_length)")
        return self


class FitSettings(PromptSettings):
    """Everything that changes a fit's estimate (compared on resume), plus the speed knobs."""

    target_layer: int = Field(-1, description="Target block: -1 = last, -2 = penultimate.")
    source_layers: LayerSpec = Field("all", description="Blocks to fit: all (below the target) or e.g. 0,4,8-12.")
    estimator: Literal["all", "self", "future"] = Field(
        "all", description="all: every later target position (the reference) | self: the self-only term t'=t, by "
                           "random signs at the same cost | future: all - self (2x the cost).")
    sign_seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the random signs (--estimator self/future).")
    # speed only (not compared on resume)
    dim_batch: int | None = Field(None, ge=1, le=1 << 20,
                                  description="Output dims per backward pass (memory/speed only); default: the "
                                              "largest of 128, 64, ... that fits the free GPU memory (64 on CPU).")
    method: Literal["replicate", "vmap"] = Field(
        "replicate", description="replicate (reference: prompt repeated along the batch) | vmap (batched grads).")


class FitOptions(LensSettings):
    """When a fit checkpoints, resumes and stops early."""

    checkpoint_every: int = Field(0, ge=0, description="Also checkpoint every N prompts (0 = by time only).")
    checkpoint_minutes: float = Field(30.0, ge=0, description="Checkpoint when this many minutes passed since the "
                                                              "last one (0 = only at the end).")
    resume: bool = Field(True, description="Continue from OUT/checkpoint.pt if present.")
    stop_at_delta: float = Field(0.0, ge=0, description="Early stop when the mean Δmean of the last 10 prompts "
                                                        "is below this.")
    min_prompts: int = Field(100, ge=0, description="... but not before this many prompts.")
    progress: bool = Field(True, description="Progress bar.")
    stop_after: int | None = Field(None, ge=1, description="Stop, with a checkpoint, after this many new prompts.",
                                   json_schema_extra=LIBRARY_ONLY)
    overlap_sums: bool | None = Field(None, description="Add each estimate to the host sums during the next prompt "
                                                        "(None: on CUDA).", json_schema_extra=LIBRARY_ONLY)


class FitArgs(FitOptions, FitSettings, PromptCorpus):
    """What a fit reads and estimates, and how: everything a batch job may set (`LensVars`)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Model dtype: auto is bfloat16 on CUDA, float32 elsewhere.")
    attn: Attn = Field("auto", description="attn_implementation: auto is sdpa (eager with --method vmap).")
    save_dtype: ModelDtype = Field("float16", description="dtype of the saved matrices.")


class TuneSettings(PromptSettings):
    """How a tuned lens is trained (compared on resume)."""

    layers: LayerSpec = Field("all", description="Blocks to translate: all (below the last) or e.g. 6,10,14 (those of "
                                           "the lens it is read beside).")
    steps: int = Field(300, ge=1, description="Adam steps (learning rate decays linearly to 0).")
    batch_tokens: int = Field(256, ge=1, description="Positions drawn per step.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    val_prompts: int = Field(4, ge=1, description="The last prompts of --n-prompts, held back and scored before and "
                                                  "after training.")
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the position draws.")
    progress: bool = Field(True, description="Progress bar.")


class TuneOptions(LensSettings):
    """When the training saves its state to `<out_dir>/tune_checkpoint.pt` and whether it resumes from it."""

    checkpoint_minutes: float = Field(10.0, ge=0, description="Save OUT/tune_checkpoint.pt when this many minutes "
                                                              "passed since the last save (0 = never).")
    checkpoint_every: int = Field(0, ge=0, description="Also every N steps (0: by time only).",
                                  json_schema_extra=LIBRARY_ONLY)
    resume: bool = Field(True, description="Continue from OUT/tune_checkpoint.pt if present (same settings only).")
    stop_after: int | None = Field(None, ge=1, description="Stop, with a checkpoint, after this many new steps.",
                                   json_schema_extra=LIBRARY_ONLY)


class QualitySettings(LensSettings):
    """The intervals and random draws of a lens-quality evaluation (`lens.quality`, `lens.fidelity`)."""

    n_boot: int = Field(1000, ge=0, le=1_000_000, description="Bootstrap resamples (over texts / items) for the CIs.",
                        json_schema_extra={"flag": "--bootstrap"})
    seed: int = Field(0, ge=0, le=SEED_MAX, description="Seed of the bootstrap and the causal check's random "
                                                        "directions.")
    causal_random: int = Field(3, ge=1, le=100, description="Norm-matched random directions per lens direction.")
    temperature_positions: int = Field(512, ge=16, description="Positions of the calibration half used to fit "
                                                               "each layer's temperature.")
