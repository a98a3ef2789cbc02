"""The one interface every generation backend implements, and the factory that builds them."""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from rollouts.types import GenerationRequest, GenerationResult


class BackendError(RuntimeError):
    """A backend could not be built or could not serve (model missing, server dead, ...)."""


class SpecError(ValueError):
    """A model entry that cannot be honoured, found before anything starts: `key` (the entry's key in
    `models:`, when known) and its `field`, for the caller to name with the file."""

    def __init__(self, key: str | None, field: str | None, problem: str):
        self.key, self.field, self.problem = key, field, problem
        super().__init__(problem)


@runtime_checkable
class Backend(Protocol):
    """Async batch generation. Many callers may await `generate` concurrently; the backend
    batches (in-process) or keeps requests in flight together (servers)."""

    model_id: str

    @property
    def max_model_len(self) -> int | None:
        """The context budget in tokens, when known (a plain attribute in every backend)."""
        ...

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """One result per request, in order. Failures come back as results with `error` set."""
        ...

    def describe(self) -> dict[str, Any]:
        """Model id, revision, dtype, device, engine versions: saved in the run directory."""
        ...

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        """Prompt length in tokens after the chat template (used for context budgets)."""
        ...

    async def aclose(self) -> None:
        ...
