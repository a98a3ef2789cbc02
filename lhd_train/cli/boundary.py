"""The one error boundary of every entry point (`lhd`, `python -m lhd_train.cli`, also under
`accelerate launch`, and a command group invoked on its own): bad input, a model that cannot
load, a disk that refuses a write (also one made by datasets, torch or transformers, whose errors
lhd's writers do not see) and a chat template that fails end as one `error:` line and exit status
2, never a traceback; Ctrl-C ends with a resume hint. Library code only logs; the boundary gives
the lens library's and the commands' loggers their stderr handler."""
from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperGroup


def configure_logging() -> None:
    """INFO and above of the `lens`, `lhd_train.cli` and `lhd_train.finetune` loggers (one per module;
    `lhd train` reports its progress there) on stderr, once, unless the host program configured logging."""
    for name in ("lens", "lhd_train.cli", "lhd_train.finetune"):
        package_log = logging.getLogger(name)
        if not logging.getLogger().handlers and not package_log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
            package_log.addHandler(handler)
            package_log.setLevel(logging.INFO)
            package_log.propagate = False


def report_error(exc: BaseException) -> int:
    """Print `exc` as the one line a user sees (no traceback); the exit status for it."""
    from lhd_train.cli.console import shown

    # plain: no wrapping, no markup in paths or fields; a server's or a model's text in it is
    # shown with its control characters escaped
    print(f"error: {shown(str(exc))}", file=sys.stderr)
    return 2


def guarded(call: Callable[[], int | None]) -> int:
    """Run `call` and turn lhd's errors into `report_error`, Ctrl-C into a resume hint."""
    from lens.errors import LensError
    from lhd_train.errors import LhdError
    from rollouts.backend import BackendError

    configure_logging()
    try:
        return call() or 0
    except typer.Exit:  # an inner boundary already reported and chose the status
        raise
    except (LhdError, BackendError, LensError) as e:  # the libraries rollouts/ and lens/ know nothing of lhd's errors
        return report_error(e)
    except Exception as e:
        known = _known_failure(e)
        if known is None:
            raise
        return report_error(known)
    except KeyboardInterrupt:
        from lhd_train.cli.console import console

        console.print("[yellow]interrupted: finished rounds are on disk; rerun to resume[/yellow]")
        return 130


_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)|\bcode: (\d+)")  # Rust's io::Error (safetensors)
_TORCH_WRITER = ("PytorchStreamWriter", "inline_container.cc")  # torch.save: the errno is not kept


def _storage_cause(exc: BaseException) -> tuple[str | None, str] | None:
    """(file, reason) of the refused write (disk full, read-only, ...) behind `exc`: `exc` itself
    or an OSError it was raised from (datasets and transformers wrap it), a Rust I/O error's code
    in the text (safetensors), or torch's writer failing, which keeps no errno."""
    from lhd_train.io.files import STORAGE_ERRNOS

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e.filename, STORAGE_ERRNOS[e.errno]
        text = str(e)
        for match in _OS_ERROR_CODE.finditer(text):
            code = int(match.group(1) or match.group(2))
            if code in STORAGE_ERRNOS:
                return None, STORAGE_ERRNOS[code]
        if isinstance(e, RuntimeError) and any(t in text for t in _TORCH_WRITER):
            return None, "torch could not write it: is the disk full, the quota used up or `ulimit -f` passed?"
        e = e.__cause__ or e.__context__
    return None


def _known_failure(exc: Exception) -> Exception | None:
    """A one-line error for a refused write or a chat template that fails; None for anything else."""
    from lhd_train.io.files import StorageError
    from rollouts.model_files import chat_template_error

    template = chat_template_error(exc, [])
    if template is not None:  # a file to fix: no "rerun to resume"
        return template
    cause = _storage_cause(exc)
    if cause is None:
        return None
    path, reason = cause
    return StorageError(path or "a file being saved", reason, "work finished before is kept on disk; make room "
                        "(or fix the folder's permissions) and rerun to resume")




class GuardedGroup(TyperGroup):
    """A typer group whose commands run inside `guarded`, also when the group is invoked on its own
    (typer's CliRunner): an error becomes exit status 2 and one line."""

    def invoke(self, ctx: Any) -> Any:
        status = guarded(lambda: super(GuardedGroup, self).invoke(ctx))
        if status:
            raise typer.Exit(status)
        return None
