"""Start, watch and stop a model server process (vllm serve, transformers serve).

The server runs in its own process group with its log streamed to a file; we wait for its
/health endpoint (and, when a served name is expected, for /v1/models to list it: the port was
free when picked, but another process's server may have bound it since), fail with the log tail
when it dies or hangs, and stop it on close, on interpreter exit and on SIGTERM, so no GPU is left
held by an orphan. `stop()` also cancels a start-up under way in another thread.

`ManagedServerBackend` is the OpenAI client that owns its server (vllm, transformers-serve)."""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from rollouts.backend import BackendError
from rollouts.model_config import model_window
from rollouts.model_files import counting_tokenizer
from rollouts.openai_backend import OpenAIBackend
from rollouts.spec import ManagedSpec

_LIVE: weakref.WeakSet[ManagedServer] = weakref.WeakSet()


def _load_prctl() -> Callable[..., int] | None:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once here: the child between fork and exec must not import or dlopen, since servers
# start from several threads at once and another thread may hold the lock those need.
_PRCTL = _load_prctl()


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM if we are killed (even by SIGKILL), so no orphan holds a GPU.
    The signal follows the thread that spawned it: servers are started from threads that live as
    long as the process (lhd_train/bench/engine.py)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ManagedServer:
    def __init__(self, cmd: list[str], port: int, log_path: Path, env: dict[str, str] | None = None,
                 host: str = "127.0.0.1", health_path: str = "/health", expect_model: str | None = None):
        self.cmd, self.port, self.host = cmd, port, host
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {})}
        self.health_url = f"http://{host}:{port}{health_path}"
        self.expect_model = expect_model
        self.foreign: list[str] | None = None  # what the port served instead, when it was not ours
        self.proc: subprocess.Popen[bytes] | None = None
        self.cancelled = False
        _LIVE.add(self)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float) -> None:
        if self.cancelled:
            raise BackendError(f"server start-up cancelled (log {self.log_path})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.cmd)}\n".encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except FileNotFoundError as e:
            raise BackendError(f"cannot start server: {e.filename} not found (is it installed?)") from None
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.cancelled:
                self.stop()
                raise BackendError(f"server start-up cancelled (log {self.log_path})")
            if self.proc.poll() is not None:
                raise BackendError(f"server exited with code {self.proc.returncode} before it was healthy; "
                                   f"log {self.log_path}:\n{log_tail(self.log_path)}")
            if self.healthy():
                return
            time.sleep(0.5)
        self.stop()
        other = (f"; port {self.port} answers for another server (it serves {self.foreign}, not "
                 f"'{self.expect_model}')" if self.foreign is not None else "")
        raise BackendError(
            f"server not healthy after {timeout_s:.0f}s{other}; log {self.log_path}:\n{log_tail(self.log_path)}")

    def healthy(self) -> bool:
        """/health answers 200 and, when a served name is expected, /v1/models lists it."""
        try:
            with urllib.request.urlopen(self.health_url, timeout=2) as r:
                if r.status != 200:
                    return False
            if self.expect_model is None:
                return True
            with urllib.request.urlopen(f"{self.base_url}/models", timeout=5) as r:
                served = [m.get("id") for m in json.loads(r.read()).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
        self.foreign = None if self.expect_model in served else served
        return self.foreign is None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        self.cancelled = True  # a start() still waiting in another thread gives up
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


class ManagedServerBackend(OpenAIBackend):
    """An OpenAIBackend that owns the server it talks to."""

    def __init__(self, spec: ManagedSpec, server: ManagedServer, served_name: str, structured: str):
        server.start(spec.startup_timeout_s)
        try:  # after start: the server has fetched its model into HF_HOME by now
            tok = counting_tokenizer(spec)
        except BackendError:
            server.stop()
            raise
        super().__init__(spec, server.base_url, served_name, structured, tok)
        self.server = server
        if self.max_model_len is None and tok is not None:
            self.max_model_len = (model_window(spec) or (None, ""))[0]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "backend": self.spec.backend, "command": self.server.cmd,
                "log": str(self.server.log_path)}

    async def aclose(self) -> None:
        try:
            await super().aclose()
        finally:
            self.server.stop()  # whatever happened to the client, the server must not outlive us


def live_servers() -> list[ManagedServer]:
    """Every server object of this process not yet collected (started, starting or stopped)."""
    return list(_LIVE)


def _stop_all(*_: object) -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


atexit.register(_stop_all)
if hasattr(signal, "SIGTERM"):
    _previous = signal.getsignal(signal.SIGTERM)

    def _on_term(signum: int, frame: FrameType | None) -> None:
        _stop_all()
        if callable(_previous):
            _previous(signum, frame)
        raise SystemExit(128 + signum)

    try:
        signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread
        pass
