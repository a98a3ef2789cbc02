"""Will each vLLM server's KV cache hold one sequence of its `max_model_len`? Asked by `lhd doctor
--config` (rows), and by the preflight of `lhd run`/`audit`/`data` when a GPU is visible, which
refuses a failing server before anything starts (`refuse_short_kv`, issue 38).

vLLM checks this only after loading the weights; this makes the same estimate from config.json
alone (issue 30, B8): KV per GPU = utilisation x memory - weights / TP - `RUNTIME_RESERVE`, divided
by the KV per token per GPU (KV heads split over TP). The reserve is an approximation, so a margin
below 10 % is a warning, not a verdict. The arithmetic and the table it reproduces: docs/gpu.md."""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from rollouts.backend import BackendError
from rollouts.model_config import ModelShape, read_config
from rollouts.spec import CheckRow
from rollouts.vllm.preflight import config_folder

if TYPE_CHECKING:
    from rollouts.vllm.spec import VLLMSpec

GIB = 2**30
RUNTIME_RESERVE = 3 * GIB
# When no GPU is visible here (a login node), the estimate is for this GPU unless --gpu-gib says.
ASSUMED_GPU = ("H100 80GB", 79.1 * GIB)  # what torch reports as total_memory for an H100 SXM 80GB
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2}


def visible_gpu() -> tuple[str, float] | None:
    """(name, bytes) of the first GPU torch sees here, None without one."""
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return p.name, float(p.total_memory)
    except Exception:  # noqa: BLE001 - a broken CUDA stack is reported by the torch row
        pass
    return None


def gpu_memory(gpu_gib: float | None) -> tuple[str, float, bool]:
    """(name, bytes, assumed): `--gpu-gib` when given, else the first visible GPU, else `ASSUMED_GPU`."""
    if gpu_gib:
        return "a GPU (--gpu-gib)", gpu_gib * GIB, False
    seen = visible_gpu()
    if seen is not None:
        return seen[0], seen[1], False
    return ASSUMED_GPU[0], ASSUMED_GPU[1], True


def refuse_short_kv(specs: Mapping[str, VLLMSpec]) -> list[str]:
    """On a machine with a GPU: the `kv_rows` estimate on it for every cuda server, a `SpecError`
    (field gpu_memory_utilization) for the first that cannot hold one `max_model_len` sequence, so
    the config is refused before minutes of weight loading end in vLLM's own refusal. Without a GPU
    (a login node, a CPU run) nothing is judged here: `lhd doctor --config` estimates for an assumed
    or given GPU. Returns notes to show (none so far)."""
    from rollouts.backend import SpecError

    cuda = {k: s for k, s in specs.items() if s.device.lower() != "cpu"}
    if not cuda:
        return []
    seen = visible_gpu()
    if seen is None:
        return []
    for key, status, detail in kv_rows(cuda, "", seen[1] / GIB, where=seen[0]):
        if status == "fail":
            raise SpecError(key.removeprefix("kv "), "gpu_memory_utilization", detail.split("': ", 1)[-1])
    return []


def kv_estimate(spec: VLLMSpec, shape: ModelShape, config_dtype: str | None, gpu_bytes: float) -> dict[str, float]:
    """The arithmetic of the module doc for one server; every quantity in bytes or tokens."""
    dtype = spec.dtype if spec.dtype != "auto" else (config_dtype or "bfloat16")
    nbytes = _DTYPE_BYTES.get(dtype, 2)
    tp = spec.tensor_parallel_size
    per_token = shape.kv_bytes_per_token(nbytes, tp)
    weights = shape.n_params * nbytes
    kv = spec.gpu_memory_utilization * gpu_bytes - weights / tp - RUNTIME_RESERVE
    max_len = spec.max_model_len or shape.context or 0
    return {"weights_per_gpu": weights / tp, "kv_per_gpu": kv, "per_token": per_token,
            "tokens": max(0.0, kv) / per_token, "max_len": max_len, "tp": tp}


def kv_rows(specs: Mapping[str, VLLMSpec], config: str, gpu_gib: float | None = None,
            where: str | None = None) -> list[CheckRow]:
    """One `kv <key>` row per vllm model on a GPU: ok when its KV cache holds at least one
    `max_model_len` sequence with 10 % to spare, warn within 10 %, fail below (vLLM would refuse to
    start, after loading the weights). `where`: the GPU's name, when `gpu_gib` is a GPU seen here."""
    name, total, assumed = gpu_memory(gpu_gib)
    name = where or name
    where = f"{name} of {total / GIB:.1f} GiB" + (" (assumed: no GPU visible here; set --gpu-gib)" if assumed else "")
    rows: list[CheckRow] = []
    for key, spec in specs.items():
        if spec.device.lower() == "cpu":
            continue
        found = config_folder(spec)
        if found is None:
            rows.append((f"kv {key}", "warn", f"no config.json for {spec.model} (local folder, HF_HOME or "
                         "configs/models/): KV memory not estimated"))
            continue
        try:
            model_config = read_config(found[0])
            dtype = str(getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None) or "")
            e = kv_estimate(spec, ModelShape.parse(model_config), dtype.removeprefix("torch.") or None, total)
        except BackendError as err:
            rows.append((f"kv {key}", "warn", f"{found[0]}/config.json: cannot size {spec.model}: {err}"))
            continue
        detail = (f"on {where}, TP {e['tp']:g}, gpu_memory_utilization {spec.gpu_memory_utilization}: weights "
                  f"{e['weights_per_gpu'] / GIB:.1f} GiB/GPU, ~{RUNTIME_RESERVE / GIB:.0f} GiB runtime, KV cache "
                  f"{e['kv_per_gpu'] / GIB:.1f} GiB/GPU = {e['tokens'] / 1000:.0f}k tokens "
                  f"({e['per_token'] / 1024:.0f} KiB/token/GPU)")
        if not e["max_len"]:
            rows.append((f"kv {key}", "warn", detail + "; max_model_len unknown"))
            continue
        seqs = e["tokens"] / e["max_len"]
        detail += f" = {seqs:.1f} sequence(s) of max_model_len {e['max_len']}"
        if seqs < 1:
            rows.append((f"kv {key}", "fail", f"{config}: field 'models.{key}.gpu_memory_utilization': {detail}: "
                         "vLLM would refuse to start after loading the weights; raise gpu_memory_utilization or "
                         "tensor_parallel_size, or lower max_model_len"))
        else:
            rows.append((f"kv {key}", "warn" if seqs < 1.1 else "ok", detail))
    return rows
