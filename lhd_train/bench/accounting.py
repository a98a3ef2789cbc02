"""Token, request and GPU-hour accounting per role, computed from the rows on disk so it is
exact after a resume too (each model call is recorded once, in the round it belongs to)."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from rollouts.spec import ModelSpec

STAGE_ROLE = {"evaluation": "supervisor", "feedback": "supervisor", "summary": "summariser"}
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "latency_s")


def _add(acc: dict[str, float], call: dict[str, Any]) -> None:
    acc["requests"] += 1
    for k in FIELDS[1:]:
        acc[k] += call.get(k) or 0


def usage_by_role(rows: Iterable[dict[str, Any]],
                  audit_rows: Iterable[dict[str, Any]] = ()) -> dict[str, dict[str, float]]:
    """Totals per role. Any field may be null (an imported reference run saved no call records,
    docs/auditing.md), so a missing record counts as nothing rather than failing."""
    acc: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(FIELDS, 0))
    for row in rows:
        p = row.get("performer") or {}
        _add(acc["performer"], p)
        acc["performer"]["requests"] += (p.get("attempts") or 1) - 1  # failed attempts were requests too
        for call in (row.get("supervisor") or {}).get("calls") or []:
            _add(acc[STAGE_ROLE.get(call["stage"], call["stage"])], call)
    for a in audit_rows:
        for call in a.get("calls") or []:
            _add(acc["auditor"], call)
    return {role: {k: round(v, 3) for k, v in d.items()} for role, d in acc.items()}


def gpus_of(spec: ModelSpec) -> int:
    """GPUs a model occupies: servers by their parallel sizes; in-process models one if on CUDA."""
    if spec.backend == "vllm":
        from rollouts.vllm_server import vllm_device

        return 0 if vllm_device(spec) == "cpu" else spec.tensor_parallel_size * spec.data_parallel_size
    if spec.backend == "hf" and spec.device.startswith("cuda"):
        return 1
    if spec.backend == "hf" and spec.device == "auto":
        try:
            import torch

            return 1 if torch.cuda.is_available() else 0
        except ImportError:
            return 0
    return 0


def gpu_hours(specs: Iterable[ModelSpec], wall_s: float) -> float:
    return round(sum(gpus_of(s) for s in specs) * wall_s / 3600.0, 4)
