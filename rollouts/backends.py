"""The backends lhd knows, by the name a `models:` entry gives in `backend:`, and what every caller
does with an entry without naming its backend: read it, build it, check the entries that start
together.

Adding a backend is a module with a `BackendSpec` subclass (its fields as a `Literal` `backend`
and pydantic fields, `build`, and whichever answers differ from `rollouts/spec.py`'s defaults) and
one line in `BACKENDS`. Nothing outside `rollouts/` compares a backend's name
(tests/test_layout.py holds that)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import PlainValidator, SerializeAsAny, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from rollouts.backend import Backend
from rollouts.gpus import GpuAssignmentError, GpuClaim, check_claims, gpu_count
from rollouts.hf.spec import HFSpec
from rollouts.openai_backend import OpenAISpec
from rollouts.serve import ServeSpec
from rollouts.spec import BackendSpec, CheckRow
from rollouts.vllm.spec import VLLMSpec

BACKENDS: dict[str, type[BackendSpec]] = {
    "hf": HFSpec,
    "openai": OpenAISpec,
    "vllm": VLLMSpec,
    "transformers-serve": ServeSpec,
}


def _problem(key: str, kind: str, message: str, value: Any) -> InitErrorDetails:
    return InitErrorDetails(type=PydanticCustomError(kind, message), loc=(key,), input=value)


def _takes_default(name: str, value: Any) -> bool:
    """Whether some backend has field `name` with default `value`: such an entry asks for nothing.
    Files written before entries were per backend hold every field at its default."""
    fields = [cls.model_fields[name] for cls in BACKENDS.values() if name in cls.model_fields]
    return any(f.get_default(call_default_factory=True) == value for f in fields)


def parse_spec(value: Any) -> BackendSpec:
    """A `models:` entry as its backend's spec. A field its backend does not take is refused,
    naming the field, the backend and which backends take it; one another backend takes, at that
    backend's default, is dropped (it asks for nothing)."""
    if isinstance(value, BackendSpec):
        return value
    if not isinstance(value, Mapping):
        raise PydanticCustomError("model_entry", "a model entry is a mapping (backend: ..., model: ...)")
    name = value.get("backend")
    cls = BACKENDS.get(name) if isinstance(name, str) else None
    if cls is None:
        kind, msg = (("missing", "Field required") if "backend" not in value else
                     ("backend", f"{name!r} is not a backend lhd knows (allowed: {', '.join(BACKENDS)})"))
        raise ValidationError.from_exception_data("ModelSpec", [_problem("backend", kind, msg, name)])
    data, problems = {}, []
    for key, v in value.items():
        if key in cls.model_fields:
            data[key] = v
            continue
        if _takes_default(key, v):
            continue
        takers = [n for n, c in BACKENDS.items() if key in c.model_fields]
        own = ", ".join(f for f in cls.model_fields if f != "backend")
        why = (f"a field of backend {' and '.join(takers)}, which backend {name!r} does not use" if takers
               else "unknown key")
        problems.append(_problem(key, "backend_field", f"{why} (backend {name!r} takes: {own})", v))
    if problems:
        raise ValidationError.from_exception_data("ModelSpec", problems)
    return cls.model_validate(data)


#: A `models:` entry in a settings model: validated as its backend's spec, written with its fields.
ModelSpec = Annotated[SerializeAsAny[BackendSpec], PlainValidator(parse_spec)]


def build_backend(spec: BackendSpec, name: str = "", log_dir: str | None = None) -> Backend:
    """The backend serving `spec`; `name` (the model's key) and `log_dir` name a server's log."""
    return spec.build(name, log_dir)


def by_backend(specs: Mapping[str, BackendSpec]) -> list[tuple[type[BackendSpec], dict[str, Any]]]:
    """The entries grouped by backend, in the order their backends first appear."""
    groups: dict[type[BackendSpec], dict[str, Any]] = {}
    for key, spec in specs.items():
        groups.setdefault(type(spec), {})[key] = spec
    return list(groups.items())


def gpu_claims(specs: Mapping[str, BackendSpec], cuda: bool) -> dict[str, GpuClaim]:
    """model key -> the GPU positions it occupies where GPUs are visible (`cuda`)."""
    claims: dict[str, GpuClaim] = {}
    for key, spec in specs.items():
        try:
            claim = spec.gpu_claim(cuda)
        except GpuAssignmentError as e:
            raise GpuAssignmentError(key, e.field, e.problem) from None
        if claim is not None:
            claims[key] = claim
    return claims


def check_gpus(specs: Mapping[str, BackendSpec], visible: int | None = None) -> dict[str, GpuClaim]:
    """The claims of the entries started together, refused (GpuAssignmentError naming the entry and
    field) when they ask for more than the `visible` GPUs (default: this process's) or share one."""
    visible = gpu_count() if visible is None else visible
    claims = gpu_claims(specs, visible > 0)
    check_claims(claims, visible)
    return claims


def preflight(specs: Mapping[str, BackendSpec]) -> list[str]:
    """The check before anything starts, on the entries `lhd run` or `lhd audit` starts together:
    GPUs visible and not shared, then each backend's own check (for vLLM: its build and its own
    verdict on the argv). Raises SpecError (naming the entry and field) or BackendError; returns
    notes (checks skipped)."""
    check_gpus(specs)
    return [note for cls, group in by_backend(specs) for note in cls.preflight(group)]


def machine_rows() -> list[CheckRow]:
    """`lhd doctor`'s rows of every backend on this machine."""
    return [row for cls in dict.fromkeys(BACKENDS.values()) for row in cls.machine_rows()]


def config_rows(specs: Mapping[str, BackendSpec], config: str, gpu_gib: float | None = None) -> list[CheckRow]:
    """`lhd doctor --config`'s rows of each backend for its entries in `config`."""
    return [row for cls, group in by_backend(specs) for row in cls.config_rows(group, config, gpu_gib)]
