"""Local model and adapter folders: checked before transformers loads them, and fingerprinted.

transformers reports a broken folder with multi-line messages, or with exceptions it does not
wrap at all (a truncated safetensors file raises `SafetensorError`). The few things that go wrong
in practice (a wrong path, an empty folder, a torn `config.json`, no tokenizer, a cut weights
file) are checked here first, so the error is one line naming the file and what is wrong.

`weights_fingerprint` says which weights, tokenizer, chat template and config a folder holds
now, so a caller can notice when what is behind a path changed (a model rebuilt in place, a
tokenizer or template swapped) although the run's config did not (`changed_parts`).

`counting_tokenizer` is the one rule by which served models (openai, vllm, transformers-serve)
get the tokenizer that counts their prompts against the context window; `estimate_tokens` is the
conservative count used when there is none."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from rollouts.backend import BackendError
from rollouts.spec import BackendSpec

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
TOKENIZER_HINT = "tokenizer.json, tokenizer.model, vocab.json"
_FULL_HASH_MAX = 64 << 20  # files up to this size are hashed whole
_BLOCK, _BLOCKS = 1 << 20, 32  # larger files: this many spaced blocks of this size


def is_local(name: str) -> bool:
    """A path rather than a hub id: it exists, or it is written like a path (`/x`, `./x`, `~/x`, `a/b/c`)."""
    return Path(name).expanduser().exists() or name.startswith(("/", ".", "~")) or name.count("/") > 1


def one_line(text: object, limit: int = 300) -> str:
    """An error message on one line, cut to `limit` characters (loaders' messages run to many)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _check_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BackendError(f"{what} {path.parent}: {path.name} is not valid JSON ({one_line(e, 120)})") from None


def check_safetensors(path: Path, what: str = "model folder") -> None:
    """The header parses and the file is as long as the header says (a cut copy is not)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise BackendError(f"{what} {path.parent}: {path.name} is truncated or not safetensors "
                               f"({size} bytes; its header does not fit)")
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            raise BackendError(f"{what} {path.parent}: {path.name} has a corrupt header (not safetensors?)") from None
    if 8 + n + end > size:
        raise BackendError(f"{what} {path.parent}: {path.name} is truncated ({size} bytes, its header describes "
                           f"{8 + n + end})")


def _is_tokenizer_file(p: Path) -> bool:
    """A file a tokenizer is built from (tokenizer_config.json alone only configures one)."""
    if p.name == "tokenizer_config.json":
        return False
    return (p.name.startswith("tokenizer") or p.name in ("vocab.json", "vocab.txt")
            or p.suffix in (".model", ".tiktoken"))


def _weight_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def _check_index(folder: Path, what: str) -> None:
    """A sharded checkpoint's index names shards that must all be there."""
    for index in sorted(folder.glob("*.index.json")):
        data = _check_json(index, what)
        shards = set((data.get("weight_map") or {}).values()) if isinstance(data, dict) else set()
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise BackendError(f"{what} {folder}: {index.name} names {len(missing)} missing shard(s): "
                               f"{', '.join(missing[:3])}")


def check_model_dir(name: str, need_tokenizer: bool = True) -> None:
    """Raise a one-line `BackendError` when `name` is a local path that cannot hold a loadable
    model: missing, empty, no or torn config.json, no tokenizer, no or cut weights. Hub ids are
    left to the loader."""
    if not is_local(name):
        return
    folder = Path(name).expanduser()
    if not folder.exists():
        raise BackendError(f"model folder {name}: not found")
    if not folder.is_dir():
        raise BackendError(f"model folder {name}: not a folder")
    if not (folder / "config.json").is_file():
        empty = not any(folder.iterdir())
        raise BackendError(f"model folder {name}: no config.json" + (" (the folder is empty)" if empty else ""))
    _check_json(folder / "config.json", "model folder")
    if need_tokenizer and not any(_is_tokenizer_file(p) for p in folder.iterdir()):
        raise BackendError(f"model folder {name}: no tokenizer files ({TOKENIZER_HINT})")
    _check_index(folder, "model folder")
    weights = _weight_files(folder)
    if not weights:
        raise BackendError(f"model folder {name}: no weights (*.safetensors or *.bin)")
    for w in weights:
        if w.suffix == ".safetensors":
            check_safetensors(w)


def check_adapter_dir(adapter: str, path: str) -> None:
    """Like `check_model_dir`, for a LoRA adapter folder (adapter_config.json + adapter weights)."""
    if not is_local(path):
        return
    folder = Path(path).expanduser()
    what = f"adapter {adapter!r} at"
    if not folder.is_dir():
        raise BackendError(f"{what} {path}: not found" if not folder.exists() else f"{what} {path}: not a folder")
    if not (folder / "adapter_config.json").is_file():
        raise BackendError(f"{what} {path}: no adapter_config.json")
    _check_json(folder / "adapter_config.json", what)
    weights = _weight_files(folder)
    if not weights:
        raise BackendError(f"{what} {path}: no adapter weights (adapter_model.safetensors)")
    for w in weights:
        if w.suffix == ".safetensors":
            check_safetensors(w, what)


def _file_digest(path: Path) -> str:
    """sha256 of the file, or, above 64 MiB, of its size and 32 evenly spaced 1 MiB blocks (first
    and last included): reading a 140 GB checkpoint whole on every resume would take minutes,
    and retrained or rebuilt weights differ in every block."""
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= _FULL_HASH_MAX:
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
        else:
            h.update(str(size).encode())
            for k in range(_BLOCKS):
                f.seek((size - _BLOCK) * k // (_BLOCKS - 1))
                h.update(f.read(_BLOCK))
    return h.hexdigest()


TOKENIZER_EXTRA = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "merges.txt")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
CONFIG_FILES = ("config.json", "generation_config.json")
PART_NAMES = {"weights": "weights", "tokenizer": "tokenizer files", "chat_template": "chat template",
              "config": "config.json / generation_config.json"}


def _digest(items: list[tuple[str, bytes]]) -> str | None:
    if not items:
        return None
    h = hashlib.sha256()
    for name, data in items:
        h.update(f"{name}\0{len(data)}\0".encode() + hashlib.sha256(data).digest())
    return h.hexdigest()


def _tokenizer_parts(folder: Path) -> tuple[str | None, str | None]:
    """(tokenizer digest, chat template digest). The template may live in its own file or inside
    tokenizer_config.json; it is digested apart, so a changed template is named as such."""
    tok: list[tuple[str, bytes]] = []
    templates: list[tuple[str, bytes]] = []
    for f in sorted(folder.iterdir()):
        if not f.is_file():
            continue
        if f.name in TEMPLATE_FILES:
            templates.append((f.name, f.read_bytes()))
        elif f.name == "tokenizer_config.json":
            try:
                cfg = json.loads(f.read_bytes())
            except (ValueError, UnicodeDecodeError):
                tok.append((f.name, f.read_bytes()))  # unreadable: digested as bytes
                continue
            if isinstance(cfg, dict) and "chat_template" in cfg:
                templates.append(("tokenizer_config.json#chat_template",
                                  json.dumps(cfg.pop("chat_template"), sort_keys=True).encode()))
            tok.append((f.name, json.dumps(cfg, sort_keys=True).encode()))
        elif _is_tokenizer_file(f) or f.name in TOKENIZER_EXTRA:
            tok.append((f.name, f.read_bytes()))
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        templates += [(f"{extra.name}/{f.name}", f.read_bytes()) for f in sorted(extra.iterdir()) if f.is_file()]
    return _digest(tok), _digest(templates)


def weights_fingerprint(name: str | None) -> dict[str, Any] | None:
    """`{path, digest, files: {name: bytes}, parts}` for a local folder (or file) of weights; None
    for a hub id or a served model name, whose files are not ours to read. `digest` covers the
    weights; `parts` holds one digest each for weights, tokenizer files, chat template and config
    (None where the folder has none), compared by `changed_parts`."""
    if not name or not is_local(name) or not Path(name).expanduser().exists():
        return None
    p = Path(name).expanduser()
    files = ([p] if p.is_file() else _weight_files(p) + sorted(p.glob("*.index.json")))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}\0{f.stat().st_size}\0{_file_digest(f)}\n".encode())
    parts: dict[str, str | None] = {"weights": h.hexdigest()}
    if p.is_dir():
        parts["tokenizer"], parts["chat_template"] = _tokenizer_parts(p)
        parts["config"] = _digest([(c, (p / c).read_bytes()) for c in CONFIG_FILES if (p / c).is_file()])
    return {"path": str(p.resolve()), "digest": h.hexdigest(), "files": {f.name: f.stat().st_size for f in files},
            "parts": parts}


def changed_parts(before: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """What differs between two `weights_fingerprint`s, as names ("weights", "chat template", ...).
    A part an older record did not fingerprint is not compared."""
    if not before or not now:
        return []
    old = dict(before.get("parts") or {"weights": before.get("digest")})
    new = dict(now.get("parts") or {"weights": now.get("digest")})
    return [PART_NAMES.get(k, k) for k in PART_NAMES if k in old and k in new and old[k] != new[k]]


def chat_template_source(name: str) -> tuple[str, str] | None:
    """(where, template text) of the chat template a local folder's tokenizer uses: its own
    chat_template.jinja (which transformers prefers), else chat_template.json, else the
    `chat_template` field of tokenizer_config.json; None when none is found."""
    if not name or not is_local(name) or not Path(name).expanduser().is_dir():
        return None
    folder = Path(name).expanduser()
    if (folder / "chat_template.jinja").is_file():
        return str(folder / "chat_template.jinja"), (folder / "chat_template.jinja").read_text(errors="replace")
    for file in ("chat_template.json", "tokenizer_config.json"):
        try:
            value = json.loads((folder / file).read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, list):  # named templates: the default one is the one applied
            value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
        if isinstance(value, str):
            return f"{folder / file} (field 'chat_template')", value
    return None


def chat_template_error(exc: BaseException, names: list[str]) -> BackendError | None:
    """A one-line error naming the file whose chat template raised `exc` (a jinja2 TemplateError
    from applying a model's template), or None when `exc` is not one. Among several models, the
    template that does not even parse is named; a template that parses but raises is named when
    it is the only candidate, else every candidate is."""
    try:
        import jinja2
    except ImportError:
        return None
    if not isinstance(exc, jinja2.TemplateError):
        return None
    found = {src[0]: src[1] for src in map(chat_template_source, dict.fromkeys(names)) if src}
    blamed = list(found)
    if isinstance(exc, jinja2.TemplateSyntaxError):
        # compiled as transformers compiles it (its {% generation %} tag and loop controls)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        broken = []
        for where, text in found.items():
            try:
                _compile_jinja_template(text)
            except jinja2.TemplateSyntaxError as e:
                broken.append(f"{where}, line {e.lineno}")
        blamed = broken or blamed
    where = " or ".join(blamed) or "the model's chat template (chat_template.jinja or tokenizer_config.json)"
    return BackendError(f"{where}: the chat template fails ({type(exc).__name__}: {one_line(exc, 200)}); fix the "
                        "template, or point `tokenizer:` at a folder whose template works")


# Fallback token count: 3 characters per token. English prose runs ~4 chars/token, but tokenisers
# that split numbers into single digits (Qwen, SmolLM2) need ~3.3 on task-pack text, so 4 undercounts
# and sends prompts over the window. Digit-dense text can still beat 3: only a tokenizer is exact.
CHARS_PER_TOKEN_ESTIMATE = 3
_MESSAGE_OVERHEAD = 4  # role and chat-template tokens per message
_warned: set[str] = set()


def estimate_tokens(messages: list[dict[str, str]]) -> int:
    """A prompt's length in tokens without a tokenizer, erring on the long side."""
    return sum(len(m["content"]) // CHARS_PER_TOKEN_ESTIMATE + _MESSAGE_OVERHEAD for m in messages)


def counting_tokenizer(spec: BackendSpec) -> Any | None:
    """The tokenizer that counts a served model's prompts: `tokenizer:` when given, else the model
    itself, either a local folder or a hub id already in HF_HOME (never downloaded: nodes are often
    offline, and a managed vLLM has fetched its model before this runs). None when the model's own
    cannot be found: counts are then estimated, and a warning says so once per model. A `tokenizer:`
    that does not load is a configuration error."""
    from rollouts.tokenizer import load_tokenizer

    own = spec.extra_folders().get("tokenizer")
    try:
        return load_tokenizer(own or spec.model, spec.revision, local_files_only=True,
                              trust_remote_code=spec.trust_remote_code)
    except Exception as e:  # noqa: BLE001 - loaders raise OSError, ValueError, HFValidationError, ...
        if own:
            raise BackendError(f"model '{spec.model}': tokenizer: '{own}' does not load offline "
                               f"(a local folder, or a hub id in HF_HOME): {one_line(e, 200)}") from None
        if spec.model not in _warned:
            _warned.add(spec.model)
            log.warning("model '%s': no tokenizer found (not a local folder, not in HF_HOME), so prompt lengths are "
                        "estimated at %d characters per token and digit-heavy prompts may still overflow the "
                        "context; set `tokenizer:` on this model to a local folder with its tokenizer files for "
                        "exact counts", spec.model, CHARS_PER_TOKEN_ESTIMATE)
        return None
