"""What every `models:` entry is: the fields all backends take, and the questions the rest of lhd
asks a backend instead of comparing its name (build it, is it managed, which GPUs, what a Slurm
job needs, which checks). Each backend subclasses `BackendSpec` with its own fields and answers in
its own module; `rollouts/backends.py` registers it under its name. A field a backend does not
take is refused when the config loads, naming the field and the backend."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from rollouts.gpus import GpuClaim

if TYPE_CHECKING:
    from rollouts.backend import Backend

CheckRow = tuple[str, str, str]  # `lhd doctor`'s rows: (check, ok | warn | fail, detail)
DEFAULT_IN_FLIGHT = 32  # requests an OpenAI-compatible server gets at once when nothing says more

HIDDEN = "***"  # what a credential is replaced with wherever a URL or an error text is written
MIN_SECRET = 4  # shorter values (`?v=2`) are not hidden inside texts: they would erase ordinary words


def url_secrets(url: str | None) -> list[str]:
    """The credentials a URL carries, as written and percent-decoded: the user and password of
    `user:pass@host` and every query value (`?key=...`: an API may take its key there)."""
    if not url:
        return []
    parts = urlsplit(url)
    found = [parts.username, parts.password]
    found += [v for _, v in parse_qsl(parts.query, keep_blank_values=True)]
    found += [v for _, v in (pair.partition("=")[::2] for pair in parts.query.split("&"))]
    out: set[str] = set()
    for value in found:
        if value:
            out |= {value, unquote(value), quote(unquote(value), safe="")}
    return sorted(out, key=len, reverse=True)


def public_url(url: str | None) -> str | None:
    """The URL without its credentials (user:pass@ dropped, query values hidden): the form that
    configs, manifests and logs record."""
    if not url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    query = urlencode([(k, HIDDEN) for k, _ in parse_qsl(parts.query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact(text: str, secrets: list[str]) -> str:
    """`text` with every secret (of MIN_SECRET characters or more) replaced by ***, longest first
    (an error a server returns may echo the request's Authorization header or URL)."""
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET}, key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text


@dataclass
class JobNeeds:
    """What a Slurm job's node must provide to start one model (`lhd slurm render` checks it)."""

    env: list[str] = field(default_factory=list)  # environment variables that must be set (API keys)
    executables: list[str] = field(default_factory=list)  # commands that must be on the node's PATH
    vllm_from_path: bool = False  # needs `vllm` from $LHD_VLLM or PATH (the job's guard resolves it)
    server: str | None = None  # the server command line the job runs, for the plan's notes


class BackendSpec(BaseModel):
    """One model behind one backend. Several roles may point at the same entry (a shared server).

    Subclasses set `backend` to a `Literal` of their name, add their fields, and override what
    differs from the defaults here (an endpoint someone else runs: no GPU, nothing to start)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    backend: str
    model: str = Field(description="local path or model id")
    revision: str | None = None
    max_model_len: int | None = Field(None, ge=16, description="context budget in tokens")
    trust_remote_code: bool = False

    managed: ClassVar[bool] = False  # lhd starts a server process for it (servers start concurrently)
    in_process: ClassVar[bool] = False  # its weights load into this Python process

    @property
    def runs_here(self) -> bool:
        """Whether using it starts a model on this machine (not an endpoint someone else runs)."""
        return self.managed or self.in_process

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        """The backend serving this model; `name` (the model's key) and `log_dir` name a server's log."""
        raise NotImplementedError(f"backend {self.backend!r} does not build")

    def with_adapter(self, adapter: str) -> Self:
        """A copy that also loads the LoRA `adapter` at start-up (an endpoint serves its own by name)."""
        return self.model_copy(deep=True)

    def adapter_path(self, adapter: str) -> str:
        """Where `adapter` (a name a role gives) is read from."""
        return adapter

    def extra_folders(self) -> dict[str, str]:
        """Local folders it loads besides the model (a tokenizer), by what they are."""
        return {}

    def in_flight_limit(self) -> int | None:
        """Requests kept in flight at once, when the entry sets it (None: unset, or it batches itself)."""
        return None

    def with_in_flight(self, n: int) -> Self:
        """This entry with `n` requests in flight when it does not set its own."""
        return self

    def gpu_claim(self, cuda: bool) -> GpuClaim | None:
        """The GPU positions it occupies where GPUs are visible (`cuda`), or None on the CPU."""
        return None

    def placement(self, cuda: bool) -> str:
        """Where it runs, in words (the Slurm plan's notes)."""
        return f"{self.backend} {self.model}"

    def first_gpus(self) -> dict[str, Any]:
        """The field values that put it on the job's first GPUs, for a job that starts it alone
        ({} when it already sits there)."""
        return {}

    def job_needs(self, key: str, cuda: bool) -> JobNeeds:
        """What a Slurm job starting it needs on its node (`cuda`: a GPU partition)."""
        return JobNeeds()

    def serve_argv(self, port: int) -> list[str]:
        """A `vllm serve` command that puts this model behind an endpoint (for a judge during training)."""
        argv = ["vllm", "serve", self.model, "--port", str(port)]
        return argv + (["--max-model-len", str(self.max_model_len)] if self.max_model_len else [])

    @classmethod
    def preflight(cls, specs: Mapping[str, Self]) -> list[str]:
        """Checks before anything starts, for the entries of this backend started together: raises
        SpecError or BackendError; returns notes (checks skipped)."""
        return []

    @classmethod
    def machine_rows(cls) -> list[CheckRow]:
        """`lhd doctor`'s rows for this backend on this machine (its executable, its build)."""
        return []

    @classmethod
    def config_rows(cls, specs: Mapping[str, Self], config: str, gpu_gib: float | None = None) -> list[CheckRow]:
        """`lhd doctor --config`'s rows for the entries of this backend in `config` (`gpu_gib`: the
        GPU memory to plan for, default the visible GPU's)."""
        return []


class LoadsAdapters(BackendSpec):
    """A backend that loads LoRA adapters from folders when it starts (in-process or a server)."""

    adapters: dict[str, str] = Field(default_factory=dict, description="name -> LoRA adapter dir")

    def with_adapter(self, adapter: str) -> Self:
        out = self.model_copy(deep=True)
        out.adapters.setdefault(adapter, adapter)
        return out

    def adapter_path(self, adapter: str) -> str:
        return self.adapters.get(adapter, adapter)


class ServedSpec(BackendSpec):
    """The fields of every backend lhd talks to through the OpenAI client (an endpoint, or a server
    it starts)."""

    max_in_flight: int | None = Field(
        None, ge=1, description="requests in flight at once; default: vllm: the server's --max-num-seqs in "
        "extra_args, otherwise 32")
    timeout_s: float | None = Field(
        None, gt=0, description="seconds one request may take, queue time included; default 3600 for a managed "
        "or local (127.0.0.1/localhost) server, 600 for a remote API")
    max_retries: int = Field(5, ge=0, description="resends of a request that failed transiently (429, 5xx, "
                             "connection, timeout)")
    structured_outputs: Literal["auto", "response_format", "vllm", "prompt"] = Field(
        "auto", description="how JSON schemas reach the server (see rollouts/openai_backend.py)")
    tokenizer: str | None = Field(None, description="tokenizer (local folder or a hub id in HF_HOME) for exact "
                                  "token counts; default: the model's own")
    api_key_env: str | None = Field(None, description="name of the env variable holding the key the server wants")

    def extra_folders(self) -> dict[str, str]:
        return {"tokenizer": self.tokenizer} if self.tokenizer else {}

    def in_flight_limit(self) -> int | None:
        return self.max_in_flight

    def job_needs(self, key: str, cuda: bool) -> JobNeeds:
        return JobNeeds(env=[self.api_key_env] if self.api_key_env else [])

    def with_in_flight(self, n: int) -> Self:
        return self if self.max_in_flight is not None else self.model_copy(update={"max_in_flight": n})

    def default_in_flight(self) -> int:
        """Requests in flight when `max_in_flight` is unset."""
        return DEFAULT_IN_FLIGHT

    def served_defaults(self) -> dict[str, Any] | None:
        """The decoding defaults the server applies to unset fields, when known."""
        return None


class ManagedSpec(ServedSpec):
    """A server lhd starts and stops itself, and talks to through the OpenAI client."""

    dtype: str = Field("auto", description="auto | float32 | bfloat16 | float16")
    device: str = Field("auto", description="auto | cpu | cuda (auto: cuda when a GPU is visible, else cpu)")
    startup_timeout_s: float = Field(900.0, gt=0, description="wait this long for the server's /health")
    extra_args: list[str] = Field(default_factory=list, description="extra arguments of the server's command")

    managed = True
