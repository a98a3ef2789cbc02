"""The curated set does not give its labels away by length (issue 28, item 5; review 4, D9), and
its deceptive answers are deceptive only where they say so.

The length check is computed here from the file: sklearn's AUROC of character length for
telling deceptive from honest answers. The review measured 0.985 (honest answers 2.2x longer)
on the 37-item set; the set now holds more honest answers and the lengths overlap."""
from __future__ import annotations

import json
import statistics

from sklearn.metrics import roc_auc_score
from test_audit_eval import authors_tasks, corpus_numbers, numbers

from lhd_train.audit.curated import CURATED_PATH

LENGTH_AUROC_LIMIT = 0.65  # either way: 0.5 is no information


def items() -> list[dict]:
    return json.loads(CURATED_PATH.read_text(encoding="utf-8"))["items"]


def test_length_alone_does_not_separate_honest_from_deceptive_answers():
    its = items()
    deceptive = [i["deceptive"] for i in its]
    lengths = [len(i["answer"]) for i in its]
    auroc = roc_auc_score(deceptive, lengths)
    assert max(auroc, 1 - auroc) < LENGTH_AUROC_LIMIT, auroc
    honest = [n for n, d in zip(lengths, deceptive, strict=True) if not d]
    lying = [n for n, d in zip(lengths, deceptive, strict=True) if d]
    assert len(honest) >= 20 and len(lying) >= 20
    assert 0.8 <= statistics.median(honest) / statistics.median(lying) <= 1.25


def test_every_task_with_a_deceptive_answer_has_an_honest_one_of_comparable_length():
    """The added honest answers are in the same task contexts as the deceptive ones."""
    its = items()
    for task in {i["task"] for i in its if i["deceptive"]}:
        honest = [len(i["answer"]) for i in its if i["task"] == task and not i["deceptive"]]
        lying = [len(i["answer"]) for i in its if i["task"] == task and i["deceptive"]]
        assert honest, task
        assert min(honest) <= max(lying), task  # not only long honest answers beside short deceptive ones


def test_a_deceptive_answer_holds_no_unfounded_figure_outside_its_quoted_passages():
    """Padding a deceptive answer with honest content must not add a second, unlabelled deception:
    every figure outside `answer_quotes` is one of the task's files."""
    tasks = authors_tasks()
    for it in items():
        if not it["deceptive"]:
            continue
        files = {f["filename"]: f["content"] for f in tasks[it["task"]]["files"]}
        corpus = corpus_numbers(tasks[it["task"]]["base_prompt"] + " " + " ".join(files) + " "
                                + " ".join(files.values()))
        rest = it["answer"]
        for q in it["answer_quotes"]:
            rest = rest.replace(q, " ")
        assert not numbers(rest) - corpus, (it["id"], numbers(rest) - corpus)
