"""JSON-schema helpers shared by every backend: a schema from a pydantic model that constrained
decoders (xgrammar, vLLM, OpenAI `response_format`) accept, and a tolerant parser that turns a
model's text back into that pydantic model.

    schema = schema_for(Verdict)                   # dict, refs inlined, Field bounds kept
    value, error = parse_json_output(text, Verdict)  # (Verdict, None) or (None, "why")
"""
from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[a-zA-Z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)
_DECODER = json.JSONDecoder(strict=False)

# Keys pydantic emits that carry no constraint; dropped to keep grammars and prompts small.
_NOISE_KEYS = ("title",)


def schema_for(model_cls: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of `model_cls` with every `$ref` inlined (no `$defs`), titles removed and
    the Field constraints (minimum/maximum, minLength/maxLength, min/maxItems, enum, const,
    pattern) kept as pydantic wrote them. Objects get `additionalProperties: false` unless the
    model allows extra fields. Recursive models raise ValueError (they cannot be inlined)."""
    raw = model_cls.model_json_schema()
    defs = raw.get("$defs", {})

    def inline(node: Any, stack: tuple[str, ...]) -> Any:
        if isinstance(node, list):
            return [inline(v, stack) for v in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            ref = node["$ref"]
            name = ref.rsplit("/", 1)[-1]
            if not ref.startswith("#/$defs/") or name not in defs:
                raise ValueError(f"{model_cls.__name__}: unsupported $ref {ref!r}")
            if name in stack:
                raise ValueError(f"{model_cls.__name__}: recursive model {name!r} cannot be inlined")
            target = inline(copy.deepcopy(defs[name]), stack + (name,))
            extra = {k: inline(v, stack) for k, v in node.items() if k != "$ref" and k not in _NOISE_KEYS}
            return {**target, **extra}
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$defs" or key in _NOISE_KEYS and not isinstance(value, dict):
                continue
            if key == "properties" and isinstance(value, dict):
                out[key] = {pname: inline(pschema, stack) for pname, pschema in value.items()}
            else:
                out[key] = inline(value, stack)
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    schema: dict[str, Any] = inline(raw, ())
    if model_cls.model_config.get("extra") == "allow":
        schema.pop("additionalProperties", None)
    return schema


def _candidates(text: str) -> list[str]:
    """Texts to search, most specific first: fenced blocks, then the whole text."""
    cleaned = _THINK_BLOCK.sub("", text)
    if "</think>" in cleaned:  # the opening tag was in the prompt (Qwen3-style templates)
        cleaned = cleaned.rsplit("</think>", 1)[1]
    elif "<think>" in cleaned:  # unterminated reasoning: the answer cannot be inside it
        before = cleaned.split("<think>", 1)[0]
        cleaned = before if "{" in before else cleaned
    fenced = [m.group(1) for m in _FENCE.finditer(cleaned)]
    return fenced + [cleaned]


def _objects(text: str) -> Iterator[tuple[dict[str, Any], None] | tuple[None, str]]:
    """Every JSON object that decodes at some `{` of `text`, in order of position; a decoding
    error as `(None, why)`."""
    i = text.find("{")
    while i != -1:
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError as e:
            yield None, f"invalid JSON at char {i}: {e.msg} (char {e.pos})"
            i = text.find("{", i + 1)
            continue
        except ValueError as e:
            yield None, str(e)
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict):
            yield obj, None
            i = text.find("{", end)
        else:
            i = text.find("{", i + 1)


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ())) or "<root>"
        parts.append(f"field '{loc}': {e.get('msg')}")
    more = err.error_count() - len(parts)
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def parse_json_output(text: str | None, model_cls: type[M]) -> tuple[M | None, str | None]:
    """Find the first JSON object in `text` that validates as `model_cls`.

    Tolerant of `<think>…</think>` blocks, code fences, prose around the object and raw control
    characters inside strings (`strict=False`). Returns `(instance, None)` or `(None, reason)`;
    never raises on bad model output."""
    if not text or not text.strip():
        return None, "empty output"
    first_error: str | None = None
    seen_object = False
    for chunk in _candidates(text):
        for obj, err in _objects(chunk):
            if obj is None:
                first_error = first_error or err
                continue
            seen_object = True
            try:
                return model_cls.model_validate(obj), None
            except ValidationError as e:
                if first_error is None or not first_error.startswith("schema:"):
                    first_error = "schema: " + _validation_message(e)
    if not seen_object and first_error is None:
        return None, "no JSON object found"
    return None, first_error or "no JSON object found"
