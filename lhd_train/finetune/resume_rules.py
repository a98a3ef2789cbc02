"""What may differ when `lhd train` resumes from a checkpoint, and what may not.

A checkpoint holds the optimizer, scheduler and RNG state of one recipe: resuming it with another
learning rate, step count, LoRA shape or data would train one adapter under two recipes and label
it with the second (issue 22). Every recipe field must match, except those that change only
where and how progress is logged or saved, and paths whose content is compared by digest."""
from __future__ import annotations

from typing import Any

from lhd_train.config.algos import ALGOS

# Fields (dotted paths; a prefix covers its sub-fields) a resume may change.
RESUME_FREE = (
    "resume", "output_dir", "notes", "wandb", "accelerate_config",
    "data.train", "data.eval",  # paths: their content is compared by sha256 (data_sha256)
    "trainer.logging_steps", "trainer.logging_first_step", "trainer.logging_dir", "trainer.report_to",
    "trainer.run_name", "trainer.disable_tqdm", "trainer.save_steps", "trainer.save_total_limit",
    "trainer.save_strategy", "trainer.eval_steps", "trainer.eval_strategy", "trainer.per_device_eval_batch_size",
    "trainer.dataloader_num_workers", "trainer.push_to_hub",
    # and the algorithm's own section's `RESUME_FREE` (an online one: where its judges are)
)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def _free(path: str, algo: str) -> bool:
    section = ALGOS[algo].section if algo in ALGOS else None
    free = RESUME_FREE + tuple(f"{algo}.{p}" for p in getattr(section, "RESUME_FREE", ()))
    return any(path == p or path.startswith(p + ".") for p in free)


def recipe_changes(before: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, checkpoint's value, now) for every recipe field a resume must not change."""
    a, b = _flat(before), _flat(now)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)
            and not _free(k, now.get("algo", ""))]
