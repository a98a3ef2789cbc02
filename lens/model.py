"""The model interface the lens needs, an adapter for Hugging Face causal LMs, and block hooks.

The lens only touches a model through `LensModel`: its decoder blocks (whose outputs are the
residual stream `h_l`, *before* the final norm), the final norm, and the unembedding. Anything
that implements it (the HF adapter below, the toy in tests/support/lens_toy.py) can be fitted and read.

Block outputs are captured with forward hooks inside a context manager (`capture`), which can
also (a) root the autograd graph at one block output, (b) edit a block output, and (c) stop the
forward right after a block, so neither the later blocks nor the `[T, vocab]` unembedding run
when they are not needed.
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from lens.errors import LensError

log = logging.getLogger(__name__)


class StopForward(Exception):
    """Raised by a hook to end a forward pass once the last needed block has run."""


@runtime_checkable
class LensModel(Protocol):
    """What the lens needs from a decoder-only language model."""

    name: str
    n_layers: int
    d_model: int

    @property
    def blocks(self) -> Sequence[nn.Module]:
        """Decoder blocks in order; block `l`'s output is the residual `h_l`."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward_ids(self, input_ids: torch.Tensor) -> Any:
        """Run the model on `[B, T]` token ids (hooks may stop it early)."""

    def unembed(self, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits from a *pre-norm* residual: final norm, unembedding (rows `token_ids` only if given), softcap."""


def _split_output(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """A block returns a Tensor (transformers 5) or a tuple whose first item is the residual."""
    if isinstance(out, torch.Tensor):
        return out, lambda t: t
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        rest = tuple(out[1:])
        return out[0], lambda t: (t, *rest)
    raise LensError(f"cannot find the residual stream in a block output of type {type(out).__name__}")


@contextlib.contextmanager
def capture(
    model: LensModel,
    layers: Sequence[int],
    *,
    root: int | None = None,
    stop_after: int | None = None,
    edit: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> Iterator[dict[int, torch.Tensor]]:
    """Record the outputs of `layers` during forwards run inside the `with` block.

    root: this block's output is detached and made a leaf that requires grad, so a backward
        never goes below it (parameters are assumed frozen).
    stop_after: raise `StopForward` once this block has run (call `run` to swallow it).
    edit: per block, a function applied to its output before it is passed on (and recorded).
    """
    acts: dict[int, torch.Tensor] = {}
    edit = dict(edit or {})
    wanted = set(layers) | set(edit) | ({root} if root is not None else set()) | (
        {stop_after} if stop_after is not None else set()
    )
    handles = []

    def make_hook(idx: int):
        def hook(_module, _inputs, output):
            h, rebuild = _split_output(output)
            changed = False
            if idx == root:
                h = h.detach().requires_grad_(True)
                changed = True
            if idx in edit:
                h = edit[idx](h)
                changed = True
            if idx in layers or idx == root:
                acts[idx] = h
            if idx == stop_after:
                raise StopForward()
            return rebuild(h) if changed else None

        return hook

    blocks = model.blocks
    for idx in sorted(wanted):
        if not 0 <= idx < len(blocks):
            raise LensError(f"layer {idx} out of range: the model has {len(blocks)} blocks")
        handles.append(blocks[idx].register_forward_hook(make_hook(idx)))
    try:
        yield acts
    finally:
        for handle in handles:
            handle.remove()


def run(model: LensModel, input_ids: torch.Tensor) -> None:
    """Forward that treats an early stop as success."""
    try:
        model.forward_ids(input_ids)
    except StopForward:
        pass


def block_outputs(
    model: LensModel,
    input_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
    *,
    edit: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] | None = None,
) -> dict[int, torch.Tensor]:
    """Outputs of the given blocks (all by default) for `[B, T]` ids, without running past the last one."""
    layers = list(range(model.n_layers)) if layers is None else list(layers)
    with torch.no_grad(), capture(model, layers, stop_after=max(layers), edit=edit) as acts:
        run(model, input_ids)
    return dict(acts)


def normalise_layer(layer: int, n_layers: int, what: str = "layer") -> int:
    """Negative indices count from the end; out of range raises."""
    idx = layer + n_layers if layer < 0 else layer
    if not 0 <= idx < n_layers:
        raise LensError(f"{what} {layer} is out of range for a model with {n_layers} blocks")
    return idx


# ---------------------------------------------------------------------------------------------
# Hugging Face adapter
# ---------------------------------------------------------------------------------------------


def _find(root: nn.Module, paths: Sequence[str]) -> Any:
    for path in paths:
        obj: Any = root
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return obj
    return None


class HFLensModel:
    """`LensModel` over a transformers causal LM (Llama, Qwen2/3, Mistral, Gemma, GPT-2 style)."""

    _BLOCKS = ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers")
    _NORMS = ("model.norm", "model.language_model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm")
    _HEADS = ("lm_head", "embed_out")

    def __init__(self, hf_model: nn.Module, *, name: str | None = None, revision: str | None = None):
        self.hf = hf_model.eval()
        for p in self.hf.parameters():
            p.requires_grad_(False)
        blocks = _find(self.hf, self._BLOCKS)
        norm = _find(self.hf, self._NORMS)
        head = _find(self.hf, self._HEADS)
        if blocks is None or norm is None or head is None:
            raise LensError(
                f"{type(hf_model).__name__}: cannot find decoder blocks / final norm / lm_head "
                f"(looked for {self._BLOCKS}, {self._NORMS}, {self._HEADS})"
            )
        self._blocks = blocks
        self.norm = norm
        self.head = head
        cfg = getattr(self.hf, "config", None)
        self.name = name or getattr(cfg, "_name_or_path", None) or type(hf_model).__name__
        self.revision = revision
        self.n_layers = len(blocks)
        self.d_model = int(head.weight.shape[1])
        self.softcap = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        self.model_type = getattr(cfg, "model_type", None) if cfg is not None else None

    @property
    def blocks(self) -> Sequence[nn.Module]:
        return self._blocks

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def forward_ids(self, input_ids: torch.Tensor) -> Any:
        return self.hf(input_ids=input_ids.to(self.device), use_cache=False)

    def unembed(self, h: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.norm(h.to(self.dtype))
        if token_ids is None:
            z = self.head(x)
        else:
            w = self.head.weight[token_ids.to(self.device)]
            b = self.head.bias[token_ids.to(self.device)] if getattr(self.head, "bias", None) is not None else None
            z = torch.nn.functional.linear(x, w, b)
        if self.softcap:
            z = self.softcap * torch.tanh(z / self.softcap)
        return z


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise LensError(f"unknown dtype {name!r} (allowed: {', '.join(sorted(DTYPES))})") from None


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def free_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (what a fit may plan with), None elsewhere or without CUDA."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def load_tokenizer(model_id: str, revision: str | None = None) -> Any:
    """The tokenizer the model dir saved (rollouts' one loading rule, `rollouts.tokenizer`), with a
    lens error naming the model when it does not load."""
    from rollouts.model_files import one_line
    from rollouts.tokenizer import load_tokenizer as load_saved_tokenizer

    try:
        return load_saved_tokenizer(model_id, revision)
    except Exception as exc:  # noqa: BLE001 - loaders raise OSError, ValueError, HFValidationError, ...
        raise LensError(f"cannot load a tokenizer from {model_id}: {type(exc).__name__}: {one_line(exc)}") from None


def with_adapter(model: HFLensModel, adapter: str | None) -> HFLensModel:
    """`model` with a LoRA adapter merged in, so a read sees the weights that generated the answers;
    `model` itself when there is none."""
    if not adapter:
        return model
    from peft import PeftModel

    merged = PeftModel.from_pretrained(model.hf, adapter, is_trainable=False).merge_and_unload()
    return HFLensModel(merged, name=f"{model.name}+{adapter}", revision=model.revision)


def load_hf(
    model_id: str,
    *,
    dtype: str = "float32",
    device: str = "auto",
    revision: str | None = None,
    attn_implementation: str = "eager",  # the CLI passes lens.plan.resolve_attn's choice
) -> tuple[HFLensModel, Any]:
    """Load a causal LM and its tokenizer (local dir or Hub id; offline unless HF_HUB_OFFLINE is unset)."""
    from transformers import AutoModelForCausalLM

    from rollouts.backend import BackendError
    from rollouts.model_files import check_model_dir, one_line
    from rollouts.tokenizer import load_tokenizer as load_saved_tokenizer

    dev = pick_device(device)
    torch_dtype = parse_dtype(dtype)
    try:
        check_model_dir(str(model_id))  # a broken local folder: one line naming the file
        hf = AutoModelForCausalLM.from_pretrained(
            model_id, dtype=torch_dtype, revision=revision, attn_implementation=attn_implementation
        )
        tok = load_saved_tokenizer(model_id, revision=revision)
    except BackendError as exc:
        raise LensError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - loaders raise many types (SafetensorError is not an OSError)
        raise LensError(f"cannot load model {model_id}: {type(exc).__name__}: {one_line(exc)}") from exc
    hf.to(dev)  # type: ignore[arg-type]  # transformers wraps PreTrainedModel.to so that mypy loses `self`
    rev = revision or _local_revision(model_id)
    return HFLensModel(hf, name=str(model_id), revision=rev), tok


def _local_revision(model_id: str) -> str | None:
    """The commit hash of a Hub snapshot dir (`.../snapshots/<hash>`), else None."""
    parts = Path(model_id).resolve().parts if os.path.isdir(model_id) else ()
    if len(parts) >= 2 and parts[-2] == "snapshots":
        return parts[-1]
    return None
