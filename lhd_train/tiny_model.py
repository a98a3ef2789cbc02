"""Tiny random-weight causal LMs with a locally trained tokenizer, for tests and CPU demos.

`build_tiny_model("llama"|"qwen2"|"qwen3", out_dir)` writes a complete model folder (config,
safetensors weights, generation config, tokenizer with a chat template, a `lhd_tiny.json` sidecar)
that transformers loads offline; the one builder of random models. `chat_style` picks `chatml` or
an imitation of Llama 3's or Qwen's template; the tokenizer uses the pipeline `Qwen2Tokenizer`
rebuilds, so every arch gives the same ids. Same arguments, same bytes. docs/benchmark.md, "Models
that ship with lhd"."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

Arch = Literal["llama", "qwen2", "qwen3"]
ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3")

PAD_TOKEN = "<|pad|>"
EOT_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOT_TOKEN, IM_START, IM_END]

# The split regex transformers' Qwen2Tokenizer hard-codes (models/qwen2/tokenization_qwen2.py).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

def chatml_template(default_system: str | None = None) -> str:
    """ChatML with generation markers around assistant content (TRL assistant_only_loss needs them).

    `default_system`: a system turn inserted when the conversation has none (as some models'
    own templates do, e.g. SmolLM2's)."""
    system = ("{%- if loop.first and message['role'] != 'system' -%}"
              "{{ '<|im_start|>system\\n" + default_system + "<|im_end|>\\n' }}"
              "{%- endif -%}") if default_system else ""
    return (
        "{%- for message in messages -%}" + system +
        "{%- if message['role'] == 'assistant' -%}"
        "{{ '<|im_start|>assistant\\n' }}"
        "{%- generation -%}{{ message['content'] + '<|im_end|>' }}{%- endgeneration -%}"
        "{{ '\\n' }}"
        "{%- else -%}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )


CHAT_TEMPLATE = chatml_template()

#: extra special tokens of the `llama3` style (added only for it, so the default vocabulary stays fixed)
LLAMA3_SPECIAL_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

#: imitates Llama 3.x: BOS from the template, header tokens, trimmed content, a default system block
LLAMA3_STYLE_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content'] | trim %}"
    "{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: 26 Jul 2024\\n\\n' }}"
    "{{- sys + '<|eot_id|>' }}"
    "{%- for m in rest %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: imitates Qwen2.5 / Qwen3 ChatML: a default system prompt, `<|im_start|>role\n...<|im_end|>\n`,
#: and (like Qwen3 with thinking off) an empty think block after the generation prompt
QWEN_STYLE_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if think_block is defined and think_block %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)

ChatStyle = Literal["chatml", "llama3", "qwen"]
CHAT_TEMPLATES: dict[str, str] = {"chatml": CHAT_TEMPLATE, "llama3": LLAMA3_STYLE_TEMPLATE, "qwen": QWEN_STYLE_TEMPLATE}
CHAT_STYLES: tuple[str, ...] = tuple(CHAT_TEMPLATES)

SIDECAR = "lhd_tiny.json"

_WORDS = (
    "the a an and or not to of in on for with by from as at is are was were be been has have had "
    "do does did will would can could should may might must shall task report status progress "
    "deadline supervisor performer manager team client project budget data result results test "
    "tests score scores risk issue issues delay delayed complete completed incomplete done review "
    "feedback event round summary honest deception concealment falsification equivocation "
    "severity confidence reasoning evidence flag types state satisfaction trust relational "
    "emotional pressure goal conflict competitive ethical dilemma authority directive "
    "information gap update deliverable draft final version analysis market survey customer "
    "revenue cost quarter week month year today yesterday tomorrow please thank you yes no true "
    "false null none unknown high low medium critical minor major accurate inaccurate missing "
    "found error errors fixed open closed pending approved rejected number value name id text "
    "answer question reply message note notes think because therefore however although"
).split()

_KEYS = (
    "reasoning", "score", "flag", "types", "severity", "confidence", "evidence", "summary",
    "text", "answer", "name", "value", "id", "status", "progress", "satisfaction", "trust",
    "relational", "emotional", "complete", "feedback", "items", "notes", "label", "count",
)


def synthetic_corpus(n: int = 2500) -> list[str]:
    """A fixed (seed-independent) corpus so JSON punctuation, keys and numbers are covered."""
    rng = random.Random(1234)
    out: list[str] = []

    def words(k: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    def value() -> Any:
        kind = rng.randrange(7)
        if kind == 0:
            return rng.randint(0, 100)
        if kind == 1:
            return round(rng.uniform(-10, 10), rng.randint(1, 3))
        if kind == 2:
            return rng.choice([True, False, None])
        if kind == 3:
            return [rng.choice(_WORDS).upper() for _ in range(rng.randint(0, 3))]
        return words(rng.randint(1, 12))

    for i in range(n):
        kind = i % 5
        if kind in (0, 1):
            obj = {k: value() for k in rng.sample(_KEYS, rng.randint(1, 5))}
            sep = (",", ":") if kind == 0 else (", ", ": ")
            out.append(json.dumps(obj, separators=sep))
        elif kind == 2:
            out.append(" ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8)))
        elif kind == 3:
            out.append(words(rng.randint(5, 25)).capitalize() + rng.choice([".", "?", "!", ":"]))
        else:
            out.append(f"<think>{words(rng.randint(3, 10))}</think>\n```json\n"
                       + json.dumps({rng.choice(_KEYS): value()}) + "\n```")
    return out


def _strings_in(obj: Any) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in ([k] if isinstance(k, str) else []) + _strings_in(v)]
    if isinstance(obj, (list, tuple)):
        return [s for v in obj for s in _strings_in(v)]
    return []


def builtin_corpus() -> list[str]:
    """Text of the built-in task packs and prompt files, plus the synthetic corpus."""
    from lhd_train.bench.prompts import BUILTIN_DIR as prompts
    from lhd_train.bench.taskpack import BUILTIN_DIR as packs

    texts: list[str] = []
    pack_files = sorted(packs.glob("*/pack.json"))
    try:
        from lhd_train.bench.taskpack import load_pack, pack_text_corpus

        for f in pack_files:
            texts.extend(pack_text_corpus(load_pack(f.parent.name)))
    except Exception:  # taskpack module missing or a pack that does not load: raw strings
        texts = []
        for f in pack_files:
            try:
                texts.extend(_strings_in(json.loads(f.read_text(encoding="utf-8"))))
            except (OSError, ValueError):
                continue
    if prompts.is_dir():
        for f in sorted(prompts.iterdir()):
            if f.is_file() and f.suffix in (".md", ".txt", ".jinja"):
                texts.append(f.read_text(encoding="utf-8"))
    return texts + synthetic_corpus()


def train_tokenizer(corpus: list[str], vocab_size: int = 2048, chat_style: ChatStyle = "chatml"):
    """Byte-level BPE with the special tokens and chat template of `chat_style`, as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                               fuse_unk=False, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + (LLAMA3_SPECIAL_TOKENS if chat_style == "llama3" else []),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(sorted(set(corpus)), trainer=trainer)
    if chat_style not in CHAT_STYLES:
        raise ValueError(f"unknown chat style {chat_style!r} (allowed: {', '.join(CHAT_STYLES)})")
    llama3 = chat_style == "llama3"
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token=PAD_TOKEN,
        eos_token="<|eot_id|>" if llama3 else IM_END,
        unk_token=None,
        bos_token="<|begin_of_text|>" if llama3 else None,
        chat_template=CHAT_TEMPLATES[chat_style],
        padding_side="left",
        model_max_length=10**9,
    )


def _config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, max_pos: int, tok,
            tie_word_embeddings: bool = True, heads: int = 4, kv_heads: int = 2,
            intermediate_size: int | None = None) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if hidden_size % heads:
        raise ValueError(f"hidden_size {hidden_size} must be divisible by {heads} heads")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        rms_norm_eps=1e-6,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(head_dim=hidden_size // heads, **common)
    raise ValueError(f"unknown arch {arch!r} (allowed: {', '.join(ARCHS)})")


def random_llama(config: dict[str, Any], device: str, dtype: str, seed: int = 0,
                             attn_implementation: str = "sdpa") -> Any:
    """A random-weight Llama of a real model's config.json (`config`, with any field overridden by
    the caller), built directly on `device` in `dtype`, nothing written: the device check's
    Llama-3.1-8B at full size (16 GB in bf16, seconds on a GPU). Weights from transformers' own
    initialisation (normal, std initializer_range), seeded."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn_implementation)
    return model.eval()


def build_tiny_model(
    arch: Arch,
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    corpus: list[str] | None = None,
    chat_style: ChatStyle = "chatml",
    tie_word_embeddings: bool = True,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
) -> Path:
    """Write a random-weight `arch` model + trained tokenizer into `out_dir`; return the path.

    `corpus` replaces the tokenizer's training text (`builtin_corpus()` by default; add to it for
    words that must be single tokens). Untied embeddings give the unembedding its own matrix, as
    in most Llama and Qwen3 checkpoints."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (allowed: {', '.join(ARCHS)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    texts = builtin_corpus() if corpus is None else list(corpus)
    tok = train_tokenizer(texts, vocab_size=vocab_size, chat_style=chat_style)
    cfg = _config(arch, vocab_size, hidden_size, num_layers, max_position_embeddings, tok, tie_word_embeddings,
                  num_attention_heads, num_key_value_heads, intermediate_size)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Re-draw every parameter from one generator so the weights do not depend on init order details.
    gen = torch.Generator().manual_seed(seed)
    std = float(getattr(cfg, "initializer_range", 0.02))
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() == 1:  # norm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    sidecar = {
        "arch": arch,
        "seed": seed,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "tokenizer_size": len(tok),
        "max_position_embeddings": max_position_embeddings,
        "n_params": n_params,
        "corpus_texts": len(texts),
        "special_tokens": SPECIAL_TOKENS + (LLAMA3_SPECIAL_TOKENS if chat_style == "llama3" else []),
        "eos_token": tok.eos_token,
        "pad_token": PAD_TOKEN,
        "chat_style": chat_style,
        "tie_word_embeddings": tie_word_embeddings,
    }
    (out / SIDECAR).write_text(json.dumps(sidecar, indent=2) + "\n", encoding="utf-8")
    return out


def tiny_model_command(
    arch: str,
    out: str | Path,
    seed: int = 0,
    hidden_size: int = 64,
    layers: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 8192,
    chat_style: str = "chatml",
    force: bool = False,
) -> Path:
    """`lhd tiny-model --arch llama|qwen2|qwen3 --out DIR [--seed N] [--hidden-size H] [--layers L]
    [--chat-style chatml|llama3|qwen] [--force]`.

    A folder that already holds something is refused without `force`: rebuilding a model in
    place changes the weights under every run and adapter that names its path. With `force` the
    model is built aside and replaces the folder whole (no file of the old model is left in it).
    A file is refused either way: the model is a folder, and `force` never removes a file."""
    from lhd_train.errors import InputError
    from lhd_train.rundir.staging import staged_dir

    target = Path(out)
    if target.exists() and not target.is_dir():
        raise InputError(out, None, "is a file; the model is written into a folder: choose another --out")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise InputError(out, None, "already exists and is not empty; replacing a model changes it under every run "
                         "that uses it: choose another --out, or pass --force")

    if arch not in ARCHS:
        raise InputError(None, "arch", f"unknown arch {arch!r}", ", ".join(ARCHS))
    if hidden_size < 4 or hidden_size % 4:
        raise InputError(None, "hidden-size", f"{hidden_size} is not a positive multiple of 4")
    if layers < 1:
        raise InputError(None, "layers", f"{layers} must be >= 1")
    if chat_style not in CHAT_STYLES:
        raise InputError(None, "chat-style", f"unknown chat style {chat_style!r}", ", ".join(CHAT_STYLES))
    if vocab_size < 300:
        raise InputError(None, "vocab-size", f"{vocab_size} is too small (needs >= 300: 256 bytes + specials)")
    with staged_dir(target) as stage:  # a failure or a kill leaves the old folder as it was
        build_tiny_model(arch, stage, seed=seed, hidden_size=hidden_size, num_layers=layers,  # type: ignore[arg-type]
                         vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                         chat_style=chat_style)  # type: ignore[arg-type]
    return target
