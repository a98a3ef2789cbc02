"""The real-model path of the demo: `lhd run configs/demo.yaml` on SmolLM2-135M-Instruct writes
language, not the byte soup the random tiny model writes, and the supervisor's JSON parses.

The slow test is one trial x one task with small budgets (about a minute and a half on 2 idle
cores); the checker it relies on is pinned by a fast test against text the tiny model really
wrote, so it can tell the two apart."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Words that make up a large share of any English prose, and almost none of random token strings.
FUNCTION_WORDS = frozenset(
    "a an the and or but of to in on at for with from by as is are was be been it its this that these "
    "we our you your they their i he she will can should would not no all any each more most so if "
    "than then into about over".split())
_PUNCT = "\"'`*_#()[]{}<>.,;:!?-–—/|"
# 60 tokens sampled (temperature 1) from the random tiny Llama that tests and `--tiny` use.
TINY_MODEL_TEXT = ('ticFin verisk on chec volunte Tomagement]]sumged chec\ufffdel us never7completeged~\ufffd\ufffdum '
                   'NFmentsure report"namell\ufffd4 meet change newSA tonight}\nactsityX,confirmedarketyes\x1eformer '
                   'sitesearch un studentess givquestion non\ufffd')


def language_stats(text: str) -> tuple[float, float, int]:
    """(share of word-like tokens, share of function words, number of word tokens) over the
    whitespace-separated tokens that are not bare numbers or punctuation."""
    tokens = [t.strip(_PUNCT) for t in text.split()]
    tokens = [t for t in tokens if t and not re.fullmatch(r"[\d.,%$]+", t)]
    if not tokens:
        return 0.0, 0.0, 0
    wordlike = [t for t in tokens if re.fullmatch(r"[A-Z]?[a-z]+(?:'[a-z]+)?|[A-Z]{2,}", t)]
    function = [t for t in wordlike if t.lower() in FUNCTION_WORDS]
    return len(wordlike) / len(tokens), len(function) / len(tokens), len(tokens)


def looks_like_language(text: str, min_words: int = 8) -> bool:
    """Most tokens are ordinary words and a good share are English function words."""
    wordlike, function, n = language_stats(text)
    return n >= min_words and wordlike >= 0.8 and function >= 0.15


def test_checker_tells_prose_from_tiny_model_text() -> None:
    prose = ("Berthwise can reach about 2,350 facilities in the five states. Segment A is the largest, "
             "and the files do not say how fast it grows, so that is the biggest unknown.")
    assert looks_like_language(prose)
    assert not looks_like_language(TINY_MODEL_TEXT)
    assert not looks_like_language("\u0120\u00c3\u00a4 \u010a\u0120 #$ \u0109 ## ]]")
    assert not looks_like_language("the and of")  # too short to judge


def test_demo_config_runs_smollm2_and_writes_language(smollm2_dir: Path, tmp_path: Path) -> None:
    """configs/demo.yaml as the demo uses it, cut to one trial and smaller budgets."""
    cmd = [sys.executable, "-m", "lhd_train.cli", "run", str(ROOT / "configs/demo.yaml"), "--no-progress",
           f"output_dir={tmp_path}", "run_name=real", "seeds=[960523766]", f"models.smollm2.model={smollm2_dir}",
           "performer.sampling.max_tokens=48", "supervisor.sampling.max_tokens=96"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert done.returncode == 0, done.stderr[-3000:]

    [row] = [json.loads(line) for line in (tmp_path / "real/trials/s960523766.jsonl").read_text().splitlines()]
    answer = row["performer"]["text"]
    assert looks_like_language(answer), (language_stats(answer), answer)
    assert row["event"] is not None  # p_event 1.0: the one task comes with a pressure event

    sup = row["supervisor"]
    assert sup["parse_status"] in ("ok", "retried", "cut"), sup["calls"]
    if sup["parse_status"] == "cut":  # SmolLM2 can ramble past 96, 192 and 384 tokens: recorded, never closed for it
        last = sup["calls"][-1]
        assert last["cut"] and last["finish_reason"] == "length"
        assert sup["evaluation"] is None or sup["feedback"] is None
        if sup["evaluation"] is None:  # no evaluation: the states carry over, none is made up
            assert sup["state_after"] == sup["state_before"]
        return
    evaluation, feedback = sup["evaluation"], sup["feedback"]
    assert all(-1 <= evaluation[k] <= 1 for k in ("trust", "satisfaction", "comfort"))
    # The supervisor's free text is language too (the JSON wraps it; the schema bounds the numbers).
    said = " ".join([evaluation["reasoning"], feedback["reasoning"], feedback["text"]])
    assert looks_like_language(said), (language_stats(said), said)
    assert row["models"]["performer"]["model"] == str(smollm2_dir)
