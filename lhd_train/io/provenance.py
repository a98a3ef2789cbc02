"""What every run, audit, dataset and adapter records about where it was made: UTC timestamps
and the versions of Python and of the packages that shape the numbers."""
from __future__ import annotations

import sys
from datetime import UTC, datetime
from importlib import metadata

# Packages whose versions are recorded with every run, audit, dataset and adapter.
PACKAGES: tuple[str, ...] = ("lhd", "torch", "transformers", "tokenizers", "trl", "peft", "accelerate", "datasets",
                             "xgrammar", "openai", "vllm", "bitsandbytes", "wandb", "deepspeed")

def utc_now(timespec: str = "seconds") -> str:
    """ISO-8601 UTC timestamp, the one format of every `*_at` field."""
    return datetime.now(UTC).isoformat(timespec=timespec)


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    """Installed versions of `names` (None when not installed), for provenance records."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def python_version() -> str:
    return sys.version.split()[0]
