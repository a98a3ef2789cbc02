"""GRPO generating on a vLLM server in its own environment, the LoRA adapter synced each step by
file (`grpo.vllm_server` in a recipe; issue 38, item 3), through the stable `GRPOTrainer`'s
`rollout_func`: TRL 1.16's own vLLM paths import vLLM into the trainer, and no vLLM TRL supports
installs next to lhd's transformers. The first call saves the adapter and starts `vllm serve
--enable-lora` (`rollouts.vllm.server`); each later step saves it and reloads it in place
(`/v1/load_lora_adapter`); prompts go as token ids to `/v1/completions`. One training process: a
multi-process launch is refused. Why and how: docs/training.md, "GRPO generation (vLLM)"."""
from __future__ import annotations

import json
import logging
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lhd_train.errors import LhdError

log = logging.getLogger(__name__)
ADAPTER = "policy"  # the served name of the trained adapter
KEEP = 2  # adapter copies kept on disk (the one loaded and the one before it)


class RolloutServerError(LhdError):
    """The generation server refused a request or did not answer: training stops with one line."""


def _post(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read().decode() or "{}"
    except urllib.error.HTTPError as e:
        raise RolloutServerError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise RolloutServerError(f"{url}: {e}") from None
    try:
        out: dict[str, Any] = json.loads(body)
    except ValueError:
        out = {"text": body}
    return out


class ServerRollout:
    """TRL's `rollout_func(prompts, trainer)`, generating on a managed vLLM server (module doc)."""

    def __init__(self, spec: Any, out_dir: Path, log_dir: Path, timeout_s: float = 600.0):
        self.spec = spec  # a rollouts.vllm.spec.VLLMSpec of the base model, without adapters
        self.out_dir = Path(out_dir)
        self.log_dir = Path(log_dir)
        self.timeout_s = timeout_s
        self.server: Any = None
        self.synced_step: int | None = None
        self.saved: list[Path] = []
        self.loads = 0  # adapter reloads through /v1/load_lora_adapter

    # ------------------------------------------------------------------ server and adapter

    def _save_adapter(self, trainer: Any, step: int) -> Path:
        model = trainer.accelerator.unwrap_model(trainer.model)
        dest = self.out_dir / f"step-{step}"
        shutil.rmtree(dest, ignore_errors=True)
        model.save_pretrained(str(dest))
        self.saved.append(dest)
        while len(self.saved) > KEEP:
            shutil.rmtree(self.saved.pop(0), ignore_errors=True)
        return dest

    def _start(self, adapter: Path) -> None:
        from rollouts.managed_server import ManagedServer, free_port
        from rollouts.vllm.server import checked_vllm, vllm_command, vllm_device, vllm_env

        spec = self.spec.model_copy(update={"adapters": {ADAPTER: str(adapter)}})
        device = vllm_device(spec)
        exe = checked_vllm(spec, device)
        port = free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**vllm_env(spec, device), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
        self.server = ManagedServer(vllm_command(spec, port, "base", device, exe), port,
                                    self.log_dir / f"vllm-rollout-{port}.log", env, expect_model="base")
        log.info("GRPO generation: starting %s (log %s)", " ".join(self.server.cmd[:3]), self.server.log_path)
        self.server.start(spec.startup_timeout_s)

    def sync(self, trainer: Any) -> None:
        """The adapter as trained so far, on the server (started on the first call)."""
        step = int(trainer.state.global_step)
        if step == self.synced_step:
            return
        adapter = self._save_adapter(trainer, step)
        if self.server is None:
            self._start(adapter)
        else:
            t0 = time.perf_counter()
            _post(f"{self.server.base_url}/load_lora_adapter",
                  {"lora_name": ADAPTER, "lora_path": str(adapter), "load_inplace": True}, self.timeout_s)
            self.loads += 1
            log.info("GRPO generation: adapter of step %d reloaded in %.2f s", step, time.perf_counter() - t0)
        self.synced_step = step

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    # ------------------------------------------------------------------ generation

    def _complete(self, prompt_ids: list[int], params: dict[str, Any]) -> tuple[list[int], list[float]]:
        out = _post(f"{self.server.base_url}/completions",
                    {"model": ADAPTER, "prompt": prompt_ids, "logprobs": 0, "return_token_ids": True, **params},
                    self.timeout_s)
        choice = out["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) if x is not None else 0.0 for x in (choice.get("logprobs") or {}).get(
            "token_logprobs", [0.0] * len(ids))]
        if len(logprobs) != len(ids):
            raise RolloutServerError(f"{len(ids)} tokens but {len(logprobs)} log-probabilities from the server")
        return ids, logprobs

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """One completion per prompt entry (TRL's sampler already repeats each prompt
        `num_generations` times): prompt and completion token ids and the sampled tokens' log-probs."""
        self.sync(trainer)
        tok = trainer.processing_class
        args = trainer.args
        prompt_ids = [list(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                   **(args.chat_template_kwargs or {}))["input_ids"])
                      if isinstance(p, list) else list(tok(p, add_special_tokens=False)["input_ids"])
                      for p in prompts]
        params: dict[str, Any] = {"max_tokens": int(args.max_completion_length), "temperature": float(args.temperature),
                                  "top_p": float(args.top_p)}
        if args.top_k:
            params["top_k"] = int(args.top_k)
        if args.min_p:
            params["min_p"] = float(args.min_p)
        if args.repetition_penalty and args.repetition_penalty != 1.0:
            params["repetition_penalty"] = float(args.repetition_penalty)
        with ThreadPoolExecutor(max_workers=min(32, max(1, len(prompt_ids)))) as pool:
            done = list(pool.map(lambda ids: self._complete(ids, params), prompt_ids))
        return {"prompt_ids": prompt_ids, "completion_ids": [d[0] for d in done], "logprobs": [d[1] for d in done]}


def server_rollout(recipe: Any, out: Path, source: str) -> tuple[ServerRollout, Any]:
    """(the rollout function, a trainer callback that stops its server when training ends) for a
    recipe whose online section sets `vllm_server`; refuses a multi-process launch."""
    from accelerate import PartialState
    from transformers import TrainerCallback

    from lhd_train.errors import InputError
    from rollouts.vllm.spec import VLLMSpec

    field = f"{recipe.algo}.vllm_server"
    if PartialState().num_processes > 1:
        raise InputError(source, field, "generation on a managed vLLM server runs with one training "
                         "process (each rank would start its own server)", f"one process (lhd train), or leave "
                         f"{field} out")
    fields = dict(recipe.section.vllm_server)
    try:
        spec = VLLMSpec(model=str(recipe.model), **fields)
    except ValueError as e:
        raise InputError(source, field, str(e).splitlines()[-1]) from None
    rollout = ServerRollout(spec, out / "rollout-adapter", out / "logs")

    class StopServer(TrainerCallback):
        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            log.info("GRPO generation: %d adapter reloads; stopping the server", rollout.loads)
            rollout.close()

    return rollout, StopServer()
