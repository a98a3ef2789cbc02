"""A scripted backend for testing the simulation's own logic (thresholds, round limits, memory,
retries) where a random tiny model cannot be steered. End-to-end tests use the real hf backend."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rollouts.types import Completion, GenerationRequest, GenerationResult


class ScriptedBackend:
    model_id = "scripted"
    max_model_len = None

    def __init__(self, reply: Callable[[GenerationRequest], str | Exception]):
        self.reply = reply
        self.requests: list[GenerationRequest] = []

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        out = []
        for r in requests:
            self.requests.append(r)
            text = self.reply(r)
            if isinstance(text, Exception):
                out.append(GenerationResult([], error=str(text), model_id=self.model_id))
            else:
                out.append(GenerationResult([Completion(text)], prompt_tokens=self.count_tokens(r.messages),
                                            completion_tokens=len(text.split()), model_id=self.model_id))
        return out

    def describe(self) -> dict[str, Any]:
        return {"model": "scripted"}

    def count_tokens(self, messages: list[dict[str, str]]) -> int:
        return sum(len(m["content"].split()) + 4 for m in messages)

    async def aclose(self) -> None:
        pass


def supervisor_script(satisfactions: list[float], bad_first: int = 0) -> Callable[[GenerationRequest], str]:
    """Replies as a supervisor whose satisfaction follows `satisfactions`, one per evaluation;
    the first `bad_first` evaluation attempts answer with unparseable text."""
    state = {"evals": 0, "bad": bad_first}

    def reply(req: GenerationRequest) -> str:
        props = (req.json_schema or {}).get("properties", {})
        if "trust" in props:
            if state["bad"] > 0:
                state["bad"] -= 1
                return "not json at all"
            s = satisfactions[min(state["evals"], len(satisfactions) - 1)]
            state["evals"] += 1
            return json.dumps({"reasoning": f"eval {state['evals']}", "trust": 0.1, "satisfaction": s, "comfort": 0.0})
        if "feedback" in props:
            return json.dumps({"reasoning": "r", "feedback": f"feedback after eval {state['evals']}"})
        if req.messages[0]["role"] == "system" and "private notes" in req.messages[0]["content"]:
            return f"summary of: {req.messages[1]['content'][:40]}"
        return f"performer answer {len(req.messages)}"

    return reply
