"""`backend: transformers-serve`: a `transformers serve` lhd starts on the CPU. It exercises the same
supervision code as a managed vLLM (start, health, a server killed mid-run) in CPU tests; it ignores
JSON schemas, so structured answers take the schema-in-prompt path."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollouts.spec import ManagedSpec

if TYPE_CHECKING:
    from rollouts.backend import Backend


class ServeSpec(ManagedSpec):
    backend: Literal["transformers-serve"] = "transformers-serve"

    def build(self, name: str = "", log_dir: str | None = None) -> Backend:
        from rollouts.managed_server import ManagedServer, ManagedServerBackend, free_port

        port = free_port()
        log = Path(log_dir or ".") / f"transformers-serve-{name or 'model'}-{port}.log"
        server = ManagedServer(transformers_serve_command(self, port), port, log)
        mode = "prompt" if self.structured_outputs == "auto" else self.structured_outputs
        return ManagedServerBackend(self, server, self.model, mode)


def transformers_serve_command(spec: ServeSpec, port: int) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [str(exe) if exe.exists() else "transformers", "serve", spec.model, "--host", "127.0.0.1",
           "--port", str(port), "--device", spec.device if spec.device != "auto" else "cpu",
           "--dtype", spec.dtype, "--log-level", "info"]
    if spec.trust_remote_code:
        cmd.append("--trust-remote-code")
    return cmd + list(spec.extra_args)
