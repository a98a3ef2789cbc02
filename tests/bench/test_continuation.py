"""A performer answer cut at max_tokens is continued (the reference's auto-continuation: the
partial answer as an assistant turn, then a request to go on), up to `max_segments` segments."""
from __future__ import annotations

from support.scripted import ScriptedBackend, supervisor_script
from test_trial_loop import make_cfg, run

from lhd_train.bench.prompts import Prompts
from lhd_train.config.run import parse_config
from rollouts.types import Completion, GenerationResult

CONTINUE = Prompts().render("performer_continue")


class TruncatingBackend(ScriptedBackend):
    """Supervisor replies as in `supervisor_script`; the performer's first `cut` segments of every
    answer end on the token limit."""

    def __init__(self, cut: int):
        super().__init__(supervisor_script([0.5]))
        self.cut = cut
        self.segment = 0

    async def generate(self, requests):
        out = []
        for r in requests:
            performer = r.json_schema is None and "private notes" not in r.messages[0]["content"]
            if not performer:
                out += await super().generate([r])
                continue
            self.requests.append(r)
            self.segment = self.segment + 1 if r.messages[-1]["content"] == CONTINUE else 1
            text = f"part{self.segment} "
            finish = "length" if self.segment <= self.cut else "stop"
            out.append(GenerationResult([Completion(text, [self.segment], finish)], prompt_tokens=10,
                                        completion_tokens=1, model_id=self.model_id))
        return out


def _performer_requests(backend):
    return [r for r in backend.requests if r.json_schema is None and "private notes" not in r.messages[0]["content"]]


def test_truncated_answer_is_continued_and_recorded(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=2)
    backend = TruncatingBackend(cut=2)
    _, rows = run(cfg, backend)
    first = rows[0].performer
    assert first.text == "part1 part2 part3"
    assert first.segments == 3 and first.truncated is False and first.finish_reason == "stop"
    assert first.completion_tokens == 3 and first.token_ids == [1, 2, 3]
    reqs = _performer_requests(backend)
    opening, second, third = reqs[:3]
    # A continuation re-sends the same conversation plus the answer so far and the request to go on.
    assert second.messages[:-2] == opening.messages
    assert second.messages[-2:] == [{"role": "assistant", "content": "part1 "},
                                    {"role": "user", "content": CONTINUE}]
    assert third.messages[-2]["content"] == "part1 part2 "
    # The next round's history holds the joined answer once, without the continuation turns.
    nxt = reqs[3].messages
    assert {"role": "assistant", "content": "part1 part2 part3"} in nxt
    assert all(m["content"] != CONTINUE for m in nxt)


def test_continuation_is_bounded(tmp_path):
    cfg = make_cfg(tmp_path, max_tasks=1)
    _, rows = run(cfg, TruncatingBackend(cut=99))
    p = rows[0].performer
    assert p.segments == 5 and p.truncated is True and p.finish_reason == "length"
    assert p.text == "part1 part2 part3 part4 part5"

    cfg = make_cfg(tmp_path / "one", max_tasks=1, performer={"model": "m", "max_segments": 1})
    _, rows = run(cfg, TruncatingBackend(cut=99))
    assert rows[0].performer.segments == 1 and rows[0].performer.truncated is True


def test_performer_max_tokens_default_fits_a_report(tmp_path):
    data = {"run_name": "t", "seeds": [1], "models": {"m": {"backend": "hf", "model": "x"}},
            "performer": {"model": "m", "sampling": {"temperature": 0.5}}, "supervisor": {"model": "m"}}
    cfg = parse_config(data, "test")
    # A startup report runs to about 6-12k characters, i.e. up to ~3k tokens.
    assert cfg.performer.sampling.max_tokens >= 4096
    assert cfg.performer.max_segments == 5
    data["performer"] = {"model": "m"}
    assert parse_config(data, "test").performer.sampling.max_tokens >= 4096
