"""The training algorithms `lhd train` runs, in one table: each one's TRL config and trainer classes,
the data formats it takes and its recipe section. Everything else asks the table (`ALGOS[name]`)
or the recipe's section, never the algorithm's name, so a TRL trainer with the common constructor
(`model, args, train_dataset, eval_dataset, processing_class, peft_config, quantization_config`)
is one entry here plus recipes (docs/training.md, "Adding an algorithm").

The table lives in `config/` because the recipe (`config.recipe`) checks `trainer:` against the
algorithm's TRL config and refuses a section of another algorithm; `finetune/` builds the trainer."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, field_serializer, field_validator

from lhd_train.config.base import StrictModel
from rollouts.spec import public_url


@dataclass(frozen=True)
class Format:
    """One shape of an algorithm's rows. Every column in `columns` holds a list of chat messages.
    `prompt` is the column that may be shortened from the left to fit the length (`fit_rows`);
    `answers` are the loss turns, never cut. A prompt column that is also an answer holds the
    answer as its last message (`messages`); no answers: prompt-only rows (the trainer generates)."""

    name: str  # recorded per split in lhd_adapter.json (`format`)
    columns: tuple[str, ...]
    answers: tuple[str, ...] = ()
    prompt: str = "prompt"

    @property
    def answer_in_prompt(self) -> bool:
        return self.prompt in self.answers


@dataclass(frozen=True)
class Algo:
    """A TRL algorithm as `lhd train` runs it."""

    name: str
    config: str  # the TRL config class (`trl.<config>`), which `trainer:` is checked against
    trainer: str  # the TRL trainer class
    formats: tuple[Format, ...]  # the first that a dataset's columns match is used
    section: type[StrictModel] | None = None  # the recipe section named after the algorithm (`sft:`, `grpo:`)
    unit: str = "rows"  # what one batch element is (the Slurm plan's batch line)
    unpaired: bool = False  # learns from single answers labelled good or bad: lhd unpairs the pairs and shuffles
    # a check of the built TRL config that TRL itself makes only once the model is loaded:
    # returns (trainer field, problem) or None
    check_config: Callable[[Any], tuple[str, str] | None] | None = None

    @property
    def online(self) -> bool:
        """Generates completions and learns from its section's `rewards` (TRL `reward_funcs`)."""
        return self.section is not None and issubclass(self.section, OnlineSection)

    def config_class(self) -> Any:
        import trl

        return getattr(trl, self.config)

    def trainer_class(self) -> Any:
        import trl

        return getattr(trl, self.trainer)

    def format_named(self, name: str) -> Format:
        return next(f for f in self.formats if f.name == name)


# ----------------------------------------------------------------------------- the recipe sections


class JudgeEndpoint(StrictModel):
    """An OpenAI-compatible endpoint started by the user (e.g. `vllm serve`), never by the trainer."""

    base_url: str = Field(description="e.g. http://127.0.0.1:8001/v1")
    model: str = Field(description="the model name the endpoint serves (vllm serve: the path or id it was given)")
    api_key_env: str | None = Field(None, description="name of the env variable holding the key, if any")
    tokenizer: str | None = Field(None, description="local tokenizer for exact token counts")
    max_model_len: int | None = Field(
        None, ge=1, description="the judge's context window in tokens; default: the max_model_len the endpoint "
        "lists at /v1/models (vLLM does). A prompt over it is not sent: that grade fails and its reward is missing")
    max_in_flight: int | None = Field(None, ge=1, description="default: the openai backend's (32)")
    timeout_s: float | None = Field(None, gt=0, description="default: the openai backend's (3600 s for a "
                                    "127.0.0.1/localhost endpoint, 600 s for a remote one)")

    @field_validator("base_url")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"'{v}' is not an http(s) URL")
        return v

    @field_serializer("base_url", when_used="json")
    def _public_base_url(self, v: str) -> str | None:
        """The recipe written next to an adapter never holds the URL's credentials."""
        return public_url(v)


class RewardSpec(StrictModel):
    name: str = Field(description="a registered reward (see lhd_train.finetune.rewards) or 'module:function'")
    weight: float = 1.0
    params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward's factory")


class OnlineSection(StrictModel):
    """The settings every online algorithm (one that generates and learns from `rewards`) shares; an
    online algorithm's section subclasses it, so `finetune/` finds the online path by type."""

    #: the section's fields (dotted, below the section) a resume may change: where the judges are and
    #: when to stop on a failing one, not what is trained (`finetune.resume_rules`)
    RESUME_FREE: ClassVar[tuple[str, ...]] = tuple(
        f"{judge}.{f}" for judge in ("judge", "supervisor_judge")
        for f in ("base_url", "api_key_env", "timeout_s", "max_in_flight", "max_model_len")
    ) + ("max_failed_grade_share",)

    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="format_length")])
    plugins: list[str] = Field(
        default_factory=list, description="modules imported before rewards are looked up (they register rewards)"
    )
    max_length: int | None = Field(
        None, ge=2, description="prompt + completion tokens: prompts are cut from the left to max_length - "
        "trainer.max_completion_length (TRL 1.16 does not cut the prompts of its online trainers); default "
        "trainer.vllm_max_model_length")
    judge: JudgeEndpoint | None = Field(
        None, description="the auditor-judge of the honesty/satisfaction rewards: an endpoint you started")
    supervisor_judge: JudgeEndpoint | None = Field(
        None, description="the supervisor's endpoint for the satisfaction reward (default: none)")
    vllm_server: dict[str, Any] | None = Field(
        None, description="generate on a vLLM server lhd starts from its own vLLM environment, the LoRA adapter "
        "reloaded each step through /v1/load_lora_adapter (lhd_train/finetune/vllm_rollout.py): the fields of a "
        "`vllm` model entry (device, gpus, max_model_len, gpu_memory_utilization, cpu_kv_cache_gib, "
        "vllm_executable, extra_args, ...), the model being the recipe's; one training process; needs a trainer "
        "that takes TRL's rollout_func (GRPO)")
    max_failed_grade_share: float = Field(
        0.2, ge=0, le=1, description="a judged reward whose grade failed (endpoint unreachable, prompt over the "
        "judge's window, answer unparseable) is missing for that completion, which TRL leaves out; training stops "
        "once more than this share of the grades so far (all ranks, at least 16) failed")

    @field_validator("rewards")
    @classmethod
    def _nonempty(cls, v: list[RewardSpec]) -> list[RewardSpec]:
        if not v:
            raise ValueError("give at least one reward")
        names = [r.name for r in v]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward listed twice: {', '.join(dup)} (combine the weights)")
        return v


class GrpoSpec(OnlineSection):
    """GRPO's section: the online settings; GRPO's own knobs are GRPOConfig's, under `trainer:`."""


class SftSpec(StrictModel):
    loss_on: Literal["assistant", "last_turn", "all"] = Field(
        "last_turn",
        description=(
            "last_turn (default): only the final assistant message, the selected answer (prompt/completion split, "
            "any template; earlier assistant turns of a best-of-N row are the performer's own, possibly deceptive, "
            "answers); assistant: every assistant turn (TRL assistant_only_loss; needs {% generation %} markers or "
            "a template TRL can patch, else falls back to last_turn); all: every token"
        ),
    )


# ----------------------------------------------------------------------------- the table


def _kto_batch(config: Any) -> tuple[str, str] | None:
    """KTOTrainer refuses a batch of one after loading the model; a 7B model takes minutes to load."""
    if config.loss_type != "apo_zero_unpaired" and config.per_device_train_batch_size < 2:
        return ("per_device_train_batch_size",
                f"{config.per_device_train_batch_size} is too small for KTO (loss_type {config.loss_type}): its KL "
                "term pairs each row with a batch neighbour's answer, so give 2 or more")
    return None


MESSAGES = Format("messages", ("messages",), answers=("messages",), prompt="messages")
PROMPT_COMPLETION = Format("prompt_completion", ("prompt", "completion"), answers=("completion",))
PAIRS = Format("conversational", ("prompt", "chosen", "rejected"), answers=("chosen", "rejected"))
PROMPTS = Format("conversational", ("prompt",))

ALGOS: dict[str, Algo] = {
    "sft": Algo("sft", "SFTConfig", "SFTTrainer", (MESSAGES, PROMPT_COMPLETION), section=SftSpec),
    "dpo": Algo("dpo", "DPOConfig", "DPOTrainer", (PAIRS,), unit="pairs"),
    # KTO takes the DPO pairs, unpaired into a desirable (chosen) and an undesirable (rejected)
    # completion each (`train_data.unpair_shuffled`), so one batch element is one of those halves
    "kto": Algo("kto", "KTOConfig", "KTOTrainer", (PAIRS,), unit="completions", unpaired=True,
                check_config=_kto_batch),
    "grpo": Algo("grpo", "GRPOConfig", "GRPOTrainer", (PROMPTS,), section=GrpoSpec, unit="completions"),
}
