"""One long-lived python of the vLLM environment (.venv-vllm) for the tests that ask vLLM's own
classes one question each.

Each such question used to start `.venv-vllm/bin/python` and import vLLM again (8 s idle, minutes
on a loaded machine). `VLLMPython` keeps one interpreter open for the test session and runs each
question in it as a fresh `__main__` (its own globals, argv, stdin, environment and stdout), so the
import is paid once. `run` answers like `subprocess.run(..., capture_output=True, text=True)`, and
`subprocess_module` stands in for the `subprocess` module of product code that starts the vLLM
python itself (rollouts/vllm/preflight.py): the product's own argv, parsing and error handling run
unchanged, only the process is shared.
"""
from __future__ import annotations

import json
import subprocess
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPLY = "LHD-TEST-VLLM-REPLY "

# Runs in the vLLM venv (standard library only): one JSON job a line on stdin, one reply line on the
# real stdout. The job's own prints are captured; vLLM's logging goes to stderr, which is drained.
_LOOP = r'''
import contextlib, io, json, os, sys, traceback
REPLY = sys.argv[1]
real_out, real_in = sys.stdout, sys.stdin
for line in real_in:
    job = json.loads(line)
    out, code, err = io.StringIO(), 0, ""
    saved_env = dict(os.environ)
    os.environ.update(job["env"])
    sys.argv = [job["argv0"], *job["args"]]
    sys.stdin = io.StringIO(job["stdin"])
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(job["code"], job["argv0"], "exec"), {"__name__": "__main__", "__file__": job["argv0"]})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        err = "" if isinstance(e.code, int) or e.code is None else str(e.code)
    except BaseException:
        code, err = 1, traceback.format_exc()
    sys.stdin = real_in
    os.environ.clear()
    os.environ.update(saved_env)
    real_out.write(REPLY + json.dumps({"code": code, "stdout": out.getvalue(), "stderr": err}) + "\n")
    real_out.flush()
'''


class VLLMPython:
    """The vLLM venv's python, started once; `run` sends it one job at a time."""

    def __init__(self, python: Path, env: Mapping[str, str] | None = None):
        self.python = Path(python)
        base = {"PATH": "/usr/bin:/bin", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "ERROR", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([str(self.python), "-u", "-c", _LOOP, REPLY], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**base, **(env or {})})
        self._stderr: list[str] = []
        # vLLM logs to stderr; drain it so a chatty import cannot fill the pipe and stall the loop.
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        self.jobs = 0

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)
            del self._stderr[:-200]

    def run(self, argv: Sequence[str], input: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float | None = None, **_: Any) -> subprocess.CompletedProcess[str]:
        """Run `[python, "-c", CODE, *args]` or `[python, SCRIPT, *args]` in the shared interpreter.
        `env` is laid over the interpreter's environment for this job only (as a whole environment
        it would also drop the loop's own settings). `timeout` is not enforced: pytest-timeout is."""
        argv = [str(a) for a in argv]
        if argv[0] != str(self.python):
            raise ValueError(f"{argv[0]} is not the shared vLLM python {self.python}")
        if argv[1] == "-c":
            code, argv0, args = argv[2], "-c", argv[3:]
        else:
            code, argv0, args = Path(argv[1]).read_text(encoding="utf-8"), argv[1], argv[2:]
        job = {"code": code, "argv0": argv0, "args": args, "stdin": input or "",
               "env": {k: v for k, v in (env or {}).items() if k.startswith(("VLLM_", "HF_", "TRANSFORMERS_"))}}
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the shared vLLM python exited {self.proc.returncode}:\n{''.join(self._stderr[-20:])}")
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                reply = json.loads(line[len(REPLY):])
                self.jobs += 1
                return subprocess.CompletedProcess(argv, reply["code"], reply["stdout"], reply["stderr"])
        raise RuntimeError(f"the shared vLLM python exited {self.proc.wait()}:\n{''.join(self._stderr[-20:])}")

    def subprocess_module(self) -> types.SimpleNamespace:
        """A stand-in for `subprocess` whose `run` sends this interpreter's jobs here and starts
        every other command as usual."""
        def run(argv: Sequence[str], *a: Any, **kw: Any) -> subprocess.CompletedProcess[Any]:
            if str(argv[0]) == str(self.python):
                return self.run(argv, input=kw.get("input"), env=kw.get("env"))
            return subprocess.run(argv, *a, **kw)

        return types.SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired, PIPE=subprocess.PIPE,
                                     CompletedProcess=subprocess.CompletedProcess)

    def close(self) -> None:
        """Ends the interpreter (it holds nothing to save; vLLM's exit handlers take seconds)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
