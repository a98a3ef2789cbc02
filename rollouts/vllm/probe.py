"""Run by the vLLM environment's own python (never imported by lhd): validate `vllm serve` argv
with vLLM's parser, `AsyncEngineArgs`, `ModelConfig` (on a folder holding only config.json, so no
weights and no GPU), its tensor-parallel rule, and each LoRA adapter with vLLM's PEFT rules.

    python vllm_probe.py JOBS.json   # [{"key": ..., "argv": ["serve", MODEL_DIR, ...]}, ...]

Prints one line `LHD-VLLM-PROBE <json>`: per job {key, ok, stage, message}. Standard library and
vllm only: lhd is not installed in that environment."""
from __future__ import annotations

import json
import sys
from typing import Any

MARK = "LHD-VLLM-PROBE "


class ArgvError(Exception):
    pass


def _parser() -> tuple[Any, Any]:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]
        def error(self, message: str) -> Any:  # argparse would print usage and exit
            raise ArgvError(message)

    parser = Parser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser", parser_class=Parser)
    serve = ServeSubcommand()
    serve.subparser_init(sub)
    return parser, serve


def _message(e: BaseException) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):  # pydantic: the validator's own text, without the input dump
        try:
            return "; ".join(str(err.get("msg", "")) for err in errors())
        except Exception:  # noqa: BLE001
            pass
    return f"{type(e).__name__}: {e}"


def check(parser: Any, serve: Any, argv: list[str]) -> tuple[str, str]:
    """('', '') when vLLM accepts argv, else (stage, vLLM's message)."""
    from vllm.config import ParallelConfig
    from vllm.config.lora import LoRAConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.lora.peft_helper import PEFTHelper

    stage = "argv"
    try:
        args = parser.parse_args(argv)
        serve.validate(args)
        args.model = args.model_tag or args.model
        stage = "engine args"
        engine_args = AsyncEngineArgs.from_cli_args(args)
        stage = "model config"
        model_config = engine_args.create_model_config()
        stage = "parallel config"
        # The executor backend is named so that ParallelConfig does not count this machine's GPUs:
        # lhd checks the GPU count against the job's allocation itself (rollouts/gpus.py).
        model_config.verify_with_parallel_config(ParallelConfig(
            tensor_parallel_size=engine_args.tensor_parallel_size,
            pipeline_parallel_size=engine_args.pipeline_parallel_size, distributed_executor_backend="mp"))
        if engine_args.enable_lora:
            stage = "lora"
            lora = LoRAConfig(max_lora_rank=engine_args.max_lora_rank, max_loras=engine_args.max_loras)
            for module in getattr(args, "lora_modules", None) or []:
                path = module.path
                try:
                    helper = PEFTHelper.from_local_dir(path, model_config.max_model_len)
                except FileNotFoundError:
                    continue  # not trained yet: vLLM reports it when the server loads it
                stage = f"lora {module.name}"
                helper.validate_legal(lora)
    except ArgvError as e:
        return stage, str(e)
    except SystemExit as e:
        return stage, f"exited with {e.code}"
    except Exception as e:  # noqa: BLE001 - every refusal is a result, not a crash
        return stage, _message(e)
    return "", ""


def main() -> None:
    jobs = json.loads(open(sys.argv[1], encoding="utf-8").read())
    parser, serve = _parser()
    out = []
    for job in jobs:
        stage, message = check(parser, serve, job["argv"])
        out.append({"key": job["key"], "ok": not message, "stage": stage, "message": message})
    sys.stdout.flush()
    print(MARK + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
