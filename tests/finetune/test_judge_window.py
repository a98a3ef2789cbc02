"""GRPO's judge (issue 30, B1): a grade that fails is a missing reward for that completion, counted;
the judge's window is known (set, or read from the endpoint's /v1/models as vLLM lists it), so an
over-window trajectory is refused before it is sent; training stops with one error line only when the
failed share passes `grpo.max_failed_grade_share`.

The endpoint is a real HTTP server on 127.0.0.1 that does what vLLM does with a chat request: it
refuses (HTTP 400) a prompt whose tokens plus max_tokens exceed its window, and lists its window at
/v1/models when told to. Its "tokenizer" is lhd's own estimate (3 characters per token), which is
what lhd counts with when the judge has no `tokenizer:`."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.http_json import send_json
from test_datasets import small_run  # noqa: F401  (module fixture: a two-task run on the tiny model)

from lhd_train.finetune.contexts import load_contexts
from lhd_train.finetune.rewards import build_rewards
from rollouts.model_files import estimate_tokens

AUDIT = json.dumps({"deceptive": True, "types": ["FALSIFICATION"], "severity": 2, "confidence": 0.9,
                    "reasoning": "made up", "evidence": ["round 1"]})


class Endpoint:
    """What the test's server does: its window, whether /v1/models lists it, and what it saw."""

    def __init__(self, window: int, lists_window: bool, refuse_all: bool = False):
        self.window, self.lists_window, self.refuse_all = window, lists_window, refuse_all
        self.sent: list[int] = []  # estimated prompt + max tokens of every chat request received
        self.refused = 0


@pytest.fixture
def endpoint():
    state = Endpoint(10**9, False)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _send(self, code: int, payload: dict) -> None:
            send_json(self, code, payload)

        def do_GET(self):
            card = {"id": "judge", "object": "model"}
            if state.lists_window:
                card["max_model_len"] = state.window
            self._send(200, {"object": "list", "data": [card]})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            need = estimate_tokens(req["messages"]) + int(req["max_tokens"])
            state.sent.append(need)
            if state.refuse_all or need > state.window:
                state.refused += 1
                msg = (f"This model's maximum context length is {state.window} tokens. However, you requested "
                       f"{need} tokens.")
                return self._send(400, {"object": "error", "message": msg, "type": "BadRequestError", "code": 400})
            self._send(200, {"id": "c", "object": "chat.completion", "created": 0, "model": "judge",
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": AUDIT}}],
                             "usage": {"prompt_tokens": need, "completion_tokens": 40, "total_tokens": need + 40}})

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state.url = f"http://127.0.0.1:{server.server_port}/v1"
    yield state
    server.shutdown()


class _Spec:
    def __init__(self, name, params):
        self.name, self.params, self.weight = name, params, 1.0


def _honesty(endpoint, cache, share=0.2, **judge):
    """The honesty reward as `lhd train` builds it (an endpoint judge; the run's hf supervisor is not
    started in a training rank)."""
    [fn], _ = build_rewards([_Spec("honesty", {"cache": str(cache)})], "honest",
                            shared={"judge": {"base_url": endpoint.url, "model": "judge", **judge},
                                    "max_failed_share": share}, section="grpo")
    fn.setup.training = True
    return fn


def _call(fn, run, ctxs):
    completions = [[{"role": "assistant", "content": f"Answer {i}: the files do not say."}] for i in range(len(ctxs))]
    logged = {}
    values = asyncio.run(fn(prompts=[c.messages for c in ctxs], completions=completions,
                            trial_id=[c.trial_id for c in ctxs], global_round=[c.global_round for c in ctxs],
                            run_dir=[str(run)] * len(ctxs), log_metric=lambda k, v: logged.__setitem__(k, v)))
    return values, logged


def test_an_over_window_trajectory_is_refused_before_it_is_sent(small_run, endpoint, tmp_path):  # noqa: F811
    ctxs = load_contexts(small_run)
    assert len(ctxs) >= 4
    # 1. No window known (the endpoint lists none): every grade is sent; measure what each one needs.
    endpoint.window = 10**9
    values, _ = _call(_honesty(endpoint, tmp_path / "all.jsonl"), small_run, ctxs)
    assert all(v == -0.5 for v in values)  # severity 2, honest direction: -2/4
    need = sorted(endpoint.sent)
    endpoint.window = need[len(need) // 2]  # half of the trajectories are now longer than the window
    over = sum(n > endpoint.window for n in need)
    assert 0 < over < len(need)

    # 2. Still no window known: the over-window prompts are sent and refused (HTTP 400, as vLLM does).
    #    Each such grade is a missing reward, not an exception out of the reward (before: the
    #    BackendUnavailable of the third refused attempt ended GRPO with a traceback).
    endpoint.sent, endpoint.refused = [], 0
    values, _ = _call(_honesty(endpoint, tmp_path / "unknown.jsonl", share=1.0), small_run, ctxs)
    assert sum(v is None for v in values) == over and endpoint.refused == 3 * over  # max_attempts each

    # 3. The endpoint lists its window at /v1/models: lhd refuses those prompts itself, none is sent.
    endpoint.lists_window, endpoint.sent, endpoint.refused = True, [], 0
    fn = _honesty(endpoint, tmp_path / "listed.jsonl", share=1.0)
    values, logged = _call(fn, small_run, ctxs)
    assert endpoint.refused == 0 and all(n <= endpoint.window for n in endpoint.sent)
    assert sum(v is None for v in values) == over and fn.setup.over_window == over
    # over the window is not the judge failing (`lhd data grpo` drops such rows): never toward the stop share
    assert fn.setup.failures == {} and fn.setup.graded == len(ctxs) - over
    assert logged["honesty/failed_grade_share"] == 0.0 and logged["honesty/over_window"] == over

    # 4. The same with the window set in the recipe (grpo.judge.max_model_len), the endpoint silent.
    endpoint.lists_window, endpoint.sent = False, []
    values, _ = _call(_honesty(endpoint, tmp_path / "set.jsonl", max_model_len=endpoint.window, share=1.0),
                      small_run, ctxs)
    assert endpoint.refused == 0 and sum(v is None for v in values) == over


def test_training_stops_only_past_the_failed_share(small_run, endpoint, tmp_path):  # noqa: F811
    from lhd_train.cli.boundary import guarded
    from lhd_train.finetune.judged_rewards import MIN_GRADES_TO_STOP, JudgeFailing, check_failed_shares

    ctxs = load_contexts(small_run)
    batch = (ctxs * 8)[:8]
    endpoint.refuse_all = True  # every request answered 400: a judge that cannot grade
    fn = _honesty(endpoint, tmp_path / "down.jsonl", share=0.5)
    values, logged = _call(fn, small_run, batch)  # 8 grades: too few to judge the share yet
    assert values == [None] * 8 and logged["honesty/failed_grade_share"] == 1.0
    check_failed_shares([fn.setup])  # what the trainer callback runs after each step
    assert MIN_GRADES_TO_STOP == 16
    _call(fn, small_run, batch)  # the reward itself never raises (no collective inside it)
    with pytest.raises(JudgeFailing) as err:
        check_failed_shares([fn.setup])  # 16 of 16 failed > 50 %
    msg = str(err.value)
    assert "\n" not in msg and "16 of 16 honesty grades" in msg and "grpo.max_failed_grade_share 50%" in msg
    assert "unavailable 16" in msg and "maximum context length" in msg
    assert guarded(lambda: (_ for _ in ()).throw(err.value)) == 2  # the boundary: one `error:` line, status 2

    # A third of the trajectories over the judge's window, under a 20 % threshold: missing rewards,
    # counted as over_window, never a stop (before issue 38 they counted as failures and stopped the run).
    endpoint.refuse_all = False
    need = sorted(_needs(endpoint, small_run, ctxs, tmp_path))
    endpoint.lists_window, endpoint.window = True, need[len(need) * 2 // 3]
    over = sum(n > endpoint.window for n in need)
    fn = _honesty(endpoint, tmp_path / "third.jsonl", share=0.2)
    for _ in range(4):
        values, logged = _call(fn, small_run, ctxs)
        check_failed_shares([fn.setup])
    assert over > 0.2 * len(ctxs) and fn.setup.over_window == 4 * over
    assert logged["honesty/failed_grade_share"] == 0.0 and fn.setup.graded == 4 * (len(ctxs) - over)


def _needs(endpoint, run, ctxs, tmp_path):
    endpoint.window, endpoint.lists_window, endpoint.sent = 10**9, False, []
    _call(_honesty(endpoint, tmp_path / "measure.jsonl"), run, ctxs)
    return list(endpoint.sent)


def test_counts_are_summed_over_ranks(monkeypatch):
    """Every rank calls each reward once per generation batch, so the failure counts are summed with
    an all-reduce (here a real one-process gloo group: the call path, not the arithmetic of others)."""
    import socket

    import torch.distributed as dist

    from lhd_train.finetune.judged_rewards import all_ranks_sum

    assert all_ranks_sum(3, 7) == [3, 7]  # no group: this process's own
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert all_ranks_sum(3, 7) == [3, 7]
    finally:
        dist.destroy_process_group()


def test_the_judge_command_in_the_refusal_keeps_the_window_override(tmp_path):
    """The command the refusal prints starts the judge with the run's own extra arguments (the YaRN
    --hf-overrides a 131072-token window needs on Qwen2.5) and hands the window to lhd train."""
    from lhd_train.finetune.judged_rewards import _refusal
    from rollouts.vllm.spec import VLLMSpec

    yarn = '{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 131072}'
    spec = VLLMSpec(model="Qwen/Qwen2.5-72B-Instruct", tensor_parallel_size=4,
                     max_model_len=131072, extra_args=["--hf-overrides", yarn])
    msg = _refusal("honesty", "auditor", "qwen72b", spec, "r.yaml", "grpo.judge")
    assert "--max-model-len 131072 --hf-overrides '" + yarn + "'" in msg
    assert "grpo.judge.max_model_len=131072" in msg
