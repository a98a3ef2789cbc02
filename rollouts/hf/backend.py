"""`HFBackend`: the public class of the `hf` backend, and its request queue and worker.

A request is tokenised, checked against the context length and the memory budget, expanded into
`n` rows and queued; one worker per event loop decodes batches of rows that fit the budget in a
thread (`batching.py`, `memory_plan.py`, `decode.py`). `Completion.token_ids` exclude the final
stop token; unset decoding fields take the model's generation config. docs/benchmark.md, "Inside
the `hf` backend"."""
from __future__ import annotations

import asyncio
import collections
import hashlib
import inspect
import json
import logging
import threading
import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
import transformers
import xgrammar as xgr
from transformers import AutoModelForCausalLM, GenerationConfig

from rollouts.backend import BackendError
from rollouts.hf.batching import BatchFill
from rollouts.hf.decode import decode_rows
from rollouts.hf.device import device_context, free_memory, resolve_device
from rollouts.hf.json_guard import Grammar
from rollouts.hf.memory_plan import TokenCost, admit, batch_bytes, gib, plan_budget
from rollouts.hf.prefix_cache import PrefixCache
from rollouts.hf.rows import Pending, Row
from rollouts.hf.sampling import row_seed
from rollouts.model_config import ModelShape, context_window
from rollouts.model_files import check_adapter_dir, check_model_dir, one_line
from rollouts.tokenizer import load_tokenizer
from rollouts.types import Completion, GenerationRequest, GenerationResult, generation_defaults, sendable

if TYPE_CHECKING:
    from rollouts.hf.spec import HFSpec

log = logging.getLogger(__name__)

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}
_ENCODE_CACHE_SIZE = 128  # chat-template encodings kept (see `encode_chat`)


def peft_names(adapters: Mapping[str, str]) -> dict[str, str]:
    """The name PEFT knows each adapter by: `lora0`, `lora1`, ... in the spec's order. PEFT names
    modules after adapters and refuses a name with a dot, while a role names its adapter by its
    folder (`./ad`, `/tmp/tmp.x1`, `runs/llama-3.1-8b-sft/adapter`), so that name stays outside."""
    return {name: f"lora{i}" for i, name in enumerate(adapters)}


class HFBackend:
    """transformers in-process backend. Build with `HFBackend.from_spec(spec)`."""

    def __init__(self, spec: HFSpec, model: Any, tokenizer: Any, device: str, dtype: Any):
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.model_id = spec.model
        cfg = self.base_model().config
        self.vocab_size = int(getattr(cfg.get_text_config(), "vocab_size", None) or len(tokenizer))  # lm_head rows
        self.n_tokenizer = min(len(tokenizer), self.vocab_size)
        text_cfg = cfg.get_text_config()
        window = context_window(cfg)  # the one reader's answer, as the run config's window check gets
        self.max_model_len = int(spec.max_model_len or (window[0] if window else 10**9))
        # Our decode loop keeps every layer's full key/value history and calls the model with the
        # transformers 5 forward arguments: the cache is `cache=` from 5.24 on, `past_key_values=`
        # before (5.17 on the lent GPU image); other models (sliding-window or linear-attention
        # layers, remote code with another signature) decode with `model.generate` instead.
        # `decode_path` says which, in describe() and so in every run's manifest.
        params = inspect.signature(self.base_model().forward).parameters
        self.cache_arg = next((a for a in ("cache", "past_key_values") if a in params), None)
        self._own_loop = (all(t == "full_attention" for t in getattr(text_cfg, "layer_types", None) or [])
                          and not getattr(text_cfg, "sliding_window", None) and self.cache_arg is not None
                          and all(p in params for p in ("position_ids", "logits_to_keep")))
        self.decode_path = f"loop ({self.cache_arg}=)" if self._own_loop else "model.generate"
        gen_cfg = self.base_model().generation_config
        stops: list[int] = []
        eos = getattr(gen_cfg, "eos_token_id", None)
        for t in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id]:
            if t is not None and int(t) not in stops and int(t) < self.vocab_size:
                stops.append(int(t))
        if not stops:
            raise BackendError(f"{spec.model}: tokenizer and generation config define no eos token")
        self.stop_ids = stops
        self.stop_set = set(stops)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else stops[0])
        special = {int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        special |= {int(i) for i in tokenizer.all_special_ids if i is not None}
        self.special_ids = {i for i in special if i < self.vocab_size}
        banned = sorted(self.special_ids - self.stop_set)
        self.banned_ids_tensor = torch.tensor(banned, dtype=torch.long, device=device) if banned else None
        self._orig_generation_config = gen_cfg
        # The model's decoding defaults, applied by our sampler to requests that leave them unset.
        self.generation_defaults = generation_defaults(gen_cfg)
        # A clean generation config so no processor of `model.generate` (repetition penalty,
        # top_k, suppress tokens, ...) alters the logits our sampler sees: it applies them itself.
        self.base_model().generation_config = GenerationConfig(
            eos_token_id=stops, pad_token_id=self.pad_id, bos_token_id=getattr(gen_cfg, "bos_token_id", None))
        self._tok_lock = threading.Lock()
        self._encoded: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._run_lock = threading.Lock()
        self._grammar_lock = threading.Lock()
        self._grammars: dict[str, Grammar] = {}
        self._xgrammar: tuple[xgr.TokenizerInfo, xgr.GrammarCompiler] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[Row] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None
        self._inflight: list[Row] = []
        self._closed = False
        # Memory (rollouts/hf/memory_plan.py): measured once, now that the weights are loaded and
        # before any batch has filled the allocator's cache.
        self.cost = TokenCost.of(ModelShape.parse(cfg, f"{spec.model} config"), torch.finfo(dtype).bits // 8)
        free, total = free_memory(device)
        self.budget = plan_budget(device.split(":")[0], free, total, spec.kv_budget_gib, spec.prefix_cache_gib,
                                  spec.enable_prefix_caching)
        if self.budget.batch <= 0:
            raise BackendError(f"{spec.model} on {device}: no memory left for keys/values after loading "
                               f"({self.budget.source}); set kv_budget_gib, use a larger GPU, or serve it with vllm")
        self.prefix_cache = PrefixCache(self.budget.prefix)
        # xgrammar's kernel; see sampling.py
        self.bitmask_kernel: Literal["cpu", "triton", "torch_native"] = "triton" if device.startswith("cuda") else "cpu"
        self.batches_run = 0
        self.busy_s = 0.0  # time spent inside batched decodes: the backend's own cost
        # where busy_s goes (our decode loop; on CUDA without synchronising, so only indicative)
        self.timings: dict[str, float] = {"prefill_s": 0.0, "forward_s": 0.0, "sample_s": 0.0}
        self.stats: dict[str, int] = collections.Counter(
            batches=0, loop_batches=0, generate_batches=0, rows=0, max_batch_rows=0, decode_steps=0, json_rows=0,
            json_cut_rows=0, prefill_tokens=0, prefix_reused_tokens=0,
            prefix_matches_ignored=0, oom_splits=0, oom_rows_failed=0)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_spec(cls, spec: HFSpec) -> HFBackend:
        device = resolve_device(spec.device, torch.cuda.device_count() if torch.cuda.is_available() else 0, spec.model)
        if spec.dtype == "auto":
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        elif spec.dtype in _DTYPES:
            dtype = getattr(torch, _DTYPES[spec.dtype])
        else:
            raise BackendError(
                f"{spec.model}: unknown dtype {spec.dtype!r} (allowed: auto, float32, bfloat16, float16)")
        # A broken local folder gets a one-line error naming the file before transformers tries it.
        check_model_dir(spec.model)
        for name, path in spec.adapters.items():
            check_adapter_dir(name, path)
        kw: dict[str, Any] = {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code}
        try:
            tokenizer = load_tokenizer(spec.model, spec.revision, trust_remote_code=spec.trust_remote_code)
            if device.startswith("cuda"):  # load straight onto the GPU
                kw["device_map"] = device
            model: Any = AutoModelForCausalLM.from_pretrained(spec.model, dtype=dtype, **kw)
        except Exception as e:  # noqa: BLE001 - loaders raise many types (SafetensorError is not an OSError)
            raise BackendError(f"cannot load model {spec.model}: {type(e).__name__}: {one_line(e)}") from e
        model.to(device)
        model.eval()
        if spec.adapters:
            from peft import PeftModel

            items = list(spec.adapters.items())
            inner = peft_names(spec.adapters)
            try:
                name, path = items[0]
                model = PeftModel.from_pretrained(model, path, adapter_name=inner[name], is_trainable=False)
                for name, path in items[1:]:
                    model.load_adapter(path, adapter_name=inner[name], is_trainable=False)
            except Exception as e:  # noqa: BLE001 - as above
                raise BackendError(f"cannot load LoRA adapter {name!r} from {path}: {type(e).__name__}: "
                                   f"{one_line(e)}") from e
            model.to(device)
            model.eval()
        return cls(spec, model, tokenizer, device, dtype)

    def base_model(self) -> Any:
        """The model without its LoRA wrapper (the model itself when no adapter is loaded)."""
        m = self.model
        if hasattr(m, "get_base_model") and self.spec.adapters:
            return m.get_base_model()
        return m

    # ------------------------------------------------------------------ tokens
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids: the chat template with the assistant generation prompt. The last
        `_ENCODE_CACHE_SIZE` results are kept: callers count a prompt's tokens (`count_tokens`)
        and then submit the same messages, and tokenising an 8k-token prompt takes ~10 ms on the
        event loop."""
        try:
            key: Any = tuple(tuple(sorted(m.items())) for m in messages)
            hash(key)
        except (AttributeError, TypeError):  # unusual message values: no caching
            key = None
        with self._tok_lock:
            hit = self._encoded.get(key) if key is not None else None
            if hit is not None:
                self._encoded.move_to_end(key)
                cached: list[int] = hit.tolist()
                return cached
            clean = [{**m, "content": sendable(m["content"])} if isinstance(m.get("content"), str) else m
                     for m in messages]  # a lone surrogate (in an answer from elsewhere) is not UTF-8
            ids = self.tokenizer.apply_chat_template(
                clean, add_generation_prompt=True, tokenize=True, return_dict=False)
            if ids and isinstance(ids[0], list):
                ids = ids[0]
            ids = [int(i) for i in ids]
            if key is not None:
                self._encoded[key] = np.array(ids, dtype=np.int64)
                while len(self._encoded) > _ENCODE_CACHE_SIZE:
                    self._encoded.popitem(last=False)
        return ids

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.encode_chat(messages))

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            text: str = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return text

    # ------------------------------------------------------------------ grammars
    def _ensure_xgrammar(self) -> tuple[xgr.TokenizerInfo, xgr.GrammarCompiler]:
        """xgrammar's view of the tokenizer and its grammar compiler, built on first use."""
        with self._grammar_lock:
            if self._xgrammar is None:
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_ids)
                self._xgrammar = (info, xgr.GrammarCompiler(info))
            return self._xgrammar

    def grammar_for(self, schema: dict[str, Any]) -> Grammar:
        """Compiled grammar for a JSON schema, cached by the
        schema's canonical JSON. Raises ValueError for schemas xgrammar rejects."""
        key = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output order
        with self._grammar_lock:
            hit = self._grammars.get(key)
        if hit is not None:
            return hit
        _, compiler = self._ensure_xgrammar()
        try:
            compiled = compiler.compile_json_schema(key, any_whitespace=False)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
            raise ValueError(f"JSON schema not supported by xgrammar: {e}") from e
        grammar = Grammar(compiled)
        with self._grammar_lock:
            self._grammars.setdefault(key, grammar)
            return self._grammars[key]

    # ------------------------------------------------------------------ public API
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        if not requests:
            return []
        futures = [await self._submit(r) for r in requests]
        return list(await asyncio.gather(*futures))

    def describe(self) -> dict[str, Any]:
        try:
            xgr_version = version("xgrammar")
        except PackageNotFoundError:  # pragma: no cover
            xgr_version = None
        cfg = self.base_model().config
        cfg_file = Path(self.spec.model) / "config.json"
        cfg_text = cfg_file.read_bytes() if cfg_file.is_file() else cfg.to_json_string().encode()
        return {
            "backend": "hf",
            "model": self.spec.model,
            "model_path": str(Path(self.spec.model).resolve()) if Path(self.spec.model).exists() else self.spec.model,
            "revision": self.spec.revision or getattr(cfg, "_commit_hash", None),
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": self.device,
            "architectures": getattr(cfg, "architectures", None),
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
            "generation_defaults": dict(self.generation_defaults),
            "adapters": dict(self.spec.adapters),
            "max_batch_size": self.spec.max_batch_size,
            "batch_wait_ms": self.spec.batch_wait_ms,
            "prefix_cache_gib": round(self.budget.prefix / 2**30, 3),
            "kv_budget_gib": round(self.budget.batch / 2**30, 3),
            "kv_bytes_per_token": self.cost.kv,
            "decode_path": self.decode_path,
            "config_sha256": hashlib.sha256(cfg_text).hexdigest(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "xgrammar": xgr_version,
        }

    async def aclose(self) -> None:
        self._closed = True
        worker = self._worker
        if self._wakeup is not None:
            self._wakeup.set()
        if worker is not None and not worker.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # pragma: no cover
                loop = None
            if loop is self._loop:
                try:
                    await asyncio.wait_for(asyncio.shield(worker), timeout=1.0)
                except (TimeoutError, asyncio.CancelledError):
                    worker.cancel()
            else:
                worker.cancel()
        self._fail_queued("backend closed")
        self._fail_rows(self._inflight, "backend closed during generation")
        self._worker = None
        if self._run_lock.acquire(blocking=False):  # free the cached keys/values unless a batch
            try:                                     # still runs (then they go with the backend)
                self.prefix_cache.clear()
            finally:
                self._run_lock.release()

    # ------------------------------------------------------------------ queue and worker
    def _error_result(self, pending_t0: float, error: str, prompt_ids: list[int] | None = None) -> GenerationResult:
        return GenerationResult(
            completions=[], prompt_tokens=len(prompt_ids or []), latency_s=time.perf_counter() - pending_t0,
            model_id=self.model_id, error=error, prompt_token_ids=prompt_ids)

    def _adapter_name(self, adapter: str | None) -> str | None:
        """The PEFT name of the adapter a request asks for by its name or its folder."""
        if adapter is None:
            return None
        inner = peft_names(self.spec.adapters)
        if adapter in self.spec.adapters:
            return inner[adapter]
        for name, path in self.spec.adapters.items():
            if adapter == path or Path(adapter).resolve() == Path(path).resolve():
                return inner[name]
        raise KeyError(adapter)

    async def _submit(self, req: GenerationRequest) -> asyncio.Future[GenerationResult]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        t0 = time.perf_counter()

        def fail(msg: str, prompt_ids: list[int] | None = None) -> asyncio.Future[GenerationResult]:
            fut.set_result(self._error_result(t0, msg, prompt_ids))
            return fut

        if self._closed:
            return fail("backend closed")
        s = req.sampling.resolved(self.generation_defaults)
        if s.n < 1 or s.max_tokens < 1:
            return fail(f"invalid sampling params: n={s.n}, max_tokens={s.max_tokens} (both must be >= 1)")
        if s.temperature < 0 or not (0 < s.top_p <= 1) or s.top_k < 0 or s.repetition_penalty <= 0:
            return fail(f"invalid sampling params: temperature={s.temperature} (>= 0), top_p={s.top_p} "
                        f"(0 < p <= 1), top_k={s.top_k} (>= 0), repetition_penalty={s.repetition_penalty} (> 0)")
        try:
            adapter = self._adapter_name(req.adapter)
        except KeyError:
            known = ", ".join(sorted(self.spec.adapters)) or "none configured"
            return fail(f"unknown adapter {req.adapter!r} (known: {known})")
        try:
            prompt_ids = self.encode_chat(req.messages)
        except Exception as e:  # template errors: bad roles, missing content, ...
            return fail(f"chat template failed: {type(e).__name__}: {e}")
        if len(prompt_ids) >= self.max_model_len:
            return fail(f"prompt too long: {len(prompt_ids)} tokens, but the model's max length is "
                        f"{self.max_model_len} tokens (max_model_len / max_position_embeddings)", prompt_ids)
        grammar = None
        if req.json_schema is not None:
            try:
                grammar = self._grammars.get(json.dumps(req.json_schema, separators=(",", ":")))
                if grammar is None:  # compile off the event loop
                    grammar = await asyncio.to_thread(self.grammar_for, req.json_schema)
            except (TypeError, ValueError) as e:
                return fail(str(e), prompt_ids)
        max_tokens = min(s.max_tokens, self.max_model_len - len(prompt_ids))
        need = batch_bytes(self.cost, [len(prompt_ids)], [max_tokens])
        if need > self.budget.batch:  # never truncated: refused, with where to go instead
            return fail(f"prompt too long for the hf backend's memory: {len(prompt_ids)} prompt tokens plus "
                        f"{max_tokens} new need {gib(need)} of keys/values and prefill activations, more than "
                        f"its batch budget of {gib(self.budget.batch)} on {self.device} ({self.budget.source}); "
                        "serve long contexts with the vllm backend (paged keys/values), or lower max_tokens, "
                        "raise kv_budget_gib or lower prefix_cache_gib", prompt_ids)
        pending = Pending(req, fut, t0, prompt_ids, [None] * s.n, s.n,
                          sampling=s.to_dict() | {"max_tokens": max_tokens})
        self._ensure_worker(loop)
        for j in range(s.n):
            self._queue.append(Row(
                pending=pending, j=j, prompt_ids=prompt_ids, max_tokens=max_tokens,
                temperature=float(s.temperature), top_p=float(s.top_p), seed=row_seed(s.seed, j),
                grammar=grammar, adapter=adapter, top_k=int(s.top_k), repetition_penalty=float(s.repetition_penalty)))
        assert self._wakeup is not None
        self._wakeup.set()
        return fut

    def _ensure_worker(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not loop or self._worker is None or self._worker.done():
            if self._loop is not loop:  # rows of a finished loop can never be delivered
                self._queue = collections.deque()
                self._inflight = []
            self._loop = loop
            self._wakeup = asyncio.Event()
            self._worker = loop.create_task(self._work(), name="hf-backend-worker")

    def _take_batch(self) -> list[Row]:
        """The oldest row, then rows of its adapter in order of prompt length while the batch fits
        the memory budget and `max_batch_size` (`memory_plan.admit`); queue order within it."""
        first = self._queue[0]
        same = [r for r in self._queue if r.adapter == first.adapter]
        picked = admit(self.cost, self.budget.batch, [(len(r.prompt_ids), r.max_tokens) for r in same],
                       self.spec.max_batch_size)
        taken = {id(same[i]) for i in picked}
        self._queue = collections.deque(r for r in self._queue if id(r) not in taken)
        return [same[i] for i in sorted(picked)]

    async def _work(self) -> None:
        assert self._wakeup is not None
        wakeup = self._wakeup
        fill = BatchFill(self.spec.batch_wait_ms / 1000.0, self.spec.max_batch_size)  # rollouts/hf/batching.py
        while not self._closed:
            if not self._queue:
                wakeup.clear()
                await wakeup.wait()
                continue
            await fill.wait(lambda: len(self._queue), wakeup, lambda: self._closed)
            if self._closed or not self._queue:
                continue
            batch = self._take_batch()
            self._inflight = batch
            t0 = time.perf_counter()
            try:
                error = await asyncio.to_thread(self._run_batch, batch)
            except Exception as e:  # never let one bad batch kill the worker
                log.exception("hf backend batch failed")
                error = f"generation failed: {type(e).__name__}: {e}"
            self._deliver(batch, error)
            fill.delivered(len(batch), len(self._queue), time.perf_counter() - t0)
            self._inflight = []
        self._fail_queued("backend closed")

    def _deliver(self, batch: list[Row], error: str | None) -> None:
        for r in batch:
            p = r.pending
            if p.future.done():
                continue
            failure = error if error is not None else r.error
            if failure is not None:
                p.future.set_result(self._error_result(p.t0, failure, p.prompt_ids))
                continue
            p.completions[r.j] = Completion(text=self.decode(r.tokens), token_ids=list(r.tokens),
                                            finish_reason=r.finish or "length")
            p.remaining -= 1
            if p.remaining == 0:
                comps = [c for c in p.completions if c is not None]
                p.future.set_result(GenerationResult(
                    completions=comps, prompt_tokens=len(p.prompt_ids),
                    completion_tokens=sum(len(c.token_ids or []) for c in comps),
                    cached_tokens=p.cached_tokens, latency_s=time.perf_counter() - p.t0, model_id=self.model_id,
                    prompt_token_ids=list(p.prompt_ids), sampling=None if p.sampling is None else dict(p.sampling)))

    def _fail_queued(self, msg: str) -> None:
        rows, self._queue = list(self._queue), collections.deque()
        self._fail_rows(rows, msg)

    def _fail_rows(self, rows: list[Row], msg: str) -> None:
        for r in rows:
            if not r.pending.future.done() and not r.pending.future.get_loop().is_closed():
                r.pending.future.set_result(self._error_result(r.pending.t0, msg, r.pending.prompt_ids))

    # ------------------------------------------------------------------ one batched decode (decode.py)
    def _run_batch(self, rows: list[Row]) -> str | None:
        """Decode `rows` together (in a worker thread, on the model's CUDA device: a new thread's
        current device is 0). Fills each row's tokens and finish, or its error."""
        t_start = time.perf_counter()
        try:
            with device_context(self.device):
                return decode_rows(self, rows)
        finally:
            self.busy_s += time.perf_counter() - t_start
