"""Fit training rows to the trainer's length before TRL sees them (issue 20, H5): TRL 1.16 cuts SFT and
DPO rows from the right and drops those left without answer tokens, and does not cut GRPO prompts.
Each prompt is shortened from the LEFT with the performer's own policy (older turns first, then the
start of the last user message, then the system message); the loss turn is never cut, and a row
that cannot fit is dropped and counted (`FitReport`). Lengths are counted as TRL tokenises. The fit
runs once per data, tokenizer and length (`fit_once`), before the process group starts (issue 38),
and is saved where every rank and resume loads it. Why and how: docs/training.md, "Long rows"."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lhd_train.bench.performer import Performer
from lhd_train.config.algos import Format

NOTE_RE = re.compile(r"^\[Note: (\d+) earlier messages of this conversation were omitted to fit the context "
                     r"window\.\]\n\n")
CUT_NOTE = "[Note: the start of this message was omitted to fit the context window.]\n\n"
MAX_LISTED = 50  # dropped row indices listed in the report
FITTED_DIR = "fitted"  # under the trainer's output_dir: one folder per (split, data, tokenizer, lengths)
log = logging.getLogger(__name__)


@dataclass
class FitReport:
    """What fitting did to one split; goes into `lhd_adapter.json` under data.<split>.length_fit."""

    split: str
    max_length: int | None
    limit: int | None  # tokens allowed for what is measured (GRPO: the prompt)
    measured: str  # what the lengths count
    rows_in: int = 0
    kept: int = 0
    truncated: int = 0
    dropped: int = 0
    dropped_rows: list[int] = field(default_factory=list)
    before: dict[str, int] = field(default_factory=dict)
    after: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def lines(self) -> list[str]:
        limit = "no limit" if self.limit is None else f"limit {self.limit}"
        out = [f"data.{self.split}: {self.rows_in} rows, {self.measured} tokens {_fmt(self.before)} "
               f"(max_length {self.max_length}, {limit})"]
        if self.limit is not None:
            out.append(f"data.{self.split}: {self.truncated} truncated from the left (older turns first), "
                       f"{self.dropped} dropped (answer alone longer than the limit), {self.kept} kept; "
                       f"after: {_fmt(self.after)}")
        return out


def _fmt(p: dict[str, int]) -> str:
    return " ".join(f"{k} {v}" for k, v in p.items()) if p else "(no rows)"


def percentiles(values: list[int]) -> dict[str, int]:
    """The nearest-rank p50, p90, p99 and max of the token counts."""
    if not values:
        return {}
    found = np.percentile(values, [50, 90, 99, 100], method="nearest")
    return {k: int(v) for k, v in zip(("p50", "p90", "p99", "max"), found, strict=True)}


# ----------------------------------------------------------------------------- one prompt


def _with_note(msg: dict[str, Any], n_omitted: int, cut: bool = False) -> dict[str, Any]:
    m = dict(msg)
    text = m["content"] if isinstance(m.get("content"), str) else ""
    note = Performer.OMITTED_NOTE.format(n=n_omitted) if n_omitted else ""
    m["content"] = note + (CUT_NOTE if cut else "") + text
    return m


def fit_prompt(prompt: list[dict[str, Any]], measure: Callable[[list[dict[str, Any]]], int],
               limit: int) -> list[dict[str, Any]] | None:
    """The longest left-shortened version of `prompt` whose `measure` is within `limit`; None when
    nothing fits (the loss turn alone is too long)."""
    if measure(prompt) <= limit:
        return prompt
    system = [prompt[0]] if prompt and prompt[0].get("role") == "system" else []
    hist = list(prompt[len(system):])
    if not hist:
        return None
    prior = 0
    first = hist[0].get("content")
    if isinstance(first, str) and (m := NOTE_RE.match(first)):  # the performer had dropped turns already
        prior = int(m.group(1))
        hist[0] = {**hist[0], "content": first[m.end():]}
    users = [i for i, m in enumerate(hist) if m.get("role") == "user"]
    last_user = users[-1] if users else len(hist) - 1

    def dropped(k: int) -> list[dict[str, Any]]:
        kept = hist[k:]
        n = prior + k
        return system + ([_with_note(kept[0], n)] if n else kept[:1]) + kept[1:]

    candidates = [k for k in users if 0 < k <= last_user]
    if candidates:
        best = _smallest(candidates, lambda k: measure(dropped(k)) <= limit)
        if best is not None:
            return dropped(best)
    # Only the system message and the last user turn are left: cut that turn's text from its start.
    tail = hist[last_user:]
    n_omitted = prior + last_user
    text = tail[0].get("content")
    if not isinstance(text, str):
        return None

    def cut(c: int, head: list[dict[str, Any]]) -> list[dict[str, Any]]:
        msg = _with_note({**tail[0], "content": text[c:]}, n_omitted, cut=c > 0)
        return head + [msg] + tail[1:]

    def shortest_cut(head: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        best = _smallest(list(range(len(text) + 1)), lambda c: measure(cut(c, head)) <= limit)
        return None if best is None else cut(best, head)

    for head in (system, []):  # the system message goes last of all
        if (fitted := shortest_cut(head)) is not None:
            return fitted
    return None


def _smallest(options: list[int], fits: Callable[[int], bool]) -> int | None:
    """The first option that fits, by bisection (fitting is monotone in how much is left out)."""
    lo, hi, best = 0, len(options) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(options[mid]):
            best, hi = options[mid], mid - 1
        else:
            lo = mid + 1
    return best


# ----------------------------------------------------------------------------- a dataset


def _template_kwargs(row: dict[str, Any]) -> dict[str, Any]:
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    return {"tools": tools, **(row.get("chat_template_kwargs") or {})}


def _counter(tok, row: dict[str, Any]) -> Callable[..., int]:
    kw = _template_kwargs(row)

    def count(messages: list[dict[str, Any]], generation_prompt: bool = False) -> int:
        out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                      add_generation_prompt=generation_prompt, **kw)
        return len(out["input_ids"])

    return count


def _split_row(fmt: Format, row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    """(prompt, loss turns): the messages that may be shortened and the answers that may not."""
    prompt = list(row[fmt.prompt])
    if fmt.answer_in_prompt:
        return prompt[:-1], [prompt[-1:]]
    return prompt, [list(row[c]) for c in fmt.answers]


def fit_dataset(ds, fmt: Format, tok, max_length: int | None, reserve: int = 0, split: str = "train"):
    """(dataset with every row fitted, FitReport). `reserve`: tokens kept free after the prompt
    (GRPO's max_completion_length); the limit is `max_length − reserve`. Prompt-only rows (no
    answers: the trainer generates) are measured with the generation prompt."""
    limit = None if max_length is None else max_length - reserve
    measured = "prompt+answer" if fmt.answers else "prompt"
    report = FitReport(split, max_length, limit, measured, rows_in=len(ds))
    before, after, keep, changed = [], [], [], {}
    for i, row in enumerate(ds):
        count = _counter(tok, row)
        prompt, answers = _split_row(fmt, row)

        def measure(p: list[dict[str, Any]], count: Callable[..., int] = count,
                    answers: list[list[dict[str, Any]]] = answers) -> int:
            """The prompt with its longest answer; with no answers (GRPO) the prompt and the generation prompt."""
            if answers:
                return max(count(p + a) for a in answers)
            return count(p, generation_prompt=True)

        n = measure(prompt)
        before.append(n)
        if limit is None or n <= limit:
            keep.append(i)
            after.append(n)
            continue
        fitted = fit_prompt(prompt, measure, limit)
        if fitted is None:
            report.dropped += 1
            if len(report.dropped_rows) < MAX_LISTED:
                report.dropped_rows.append(i)
            continue
        report.truncated += 1
        keep.append(i)
        after.append(measure(fitted))
        changed[i] = fitted
    report.kept = len(keep)
    report.before, report.after = percentiles(before), percentiles(after)
    if not changed and len(keep) == len(ds):
        return ds, report
    ds = ds.select(keep)
    index = {new: old for new, old in enumerate(keep)}
    column = fmt.prompt

    def apply(row: dict[str, Any], j: int) -> dict[str, Any]:
        p = changed.get(index[j])
        if p is None:
            return {column: row[column]}
        return {column: p + row[column][-1:]} if fmt.answer_in_prompt else {column: p}

    return ds.map(apply, with_indices=True), report


# ----------------------------------------------------------------------------- once per data


def tokenizer_digest(tok: Any) -> str:
    """What a row's token counts depend on: the vocabulary and merges (the fast tokenizer's own
    serialisation), the special tokens and the chat template."""
    backend = getattr(tok, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
    parts = [vocab, str(getattr(tok, "chat_template", None)), json.dumps(tok.special_tokens_map, sort_keys=True,
                                                                          default=str)]
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def fit_key(data_sha256: str, fmt: Format, tok: Any, max_length: int | None, reserve: int, split: str) -> str:
    """The cache key of a fitted split: the data's digest, what is measured and against what limit,
    the tokenizer, and this module's own text (a change to the fitting rules refits)."""
    code = hashlib.sha256(Path(__file__).read_bytes() + Performer.OMITTED_NOTE.encode()).hexdigest()
    parts = [data_sha256, fmt.name, fmt.prompt, fmt.answers, max_length, reserve, split, tokenizer_digest(tok), code]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def fit_once(ds: Any, fmt: Format, tok: Any, max_length: int | None, reserve: int, split: str,
             out_dir: Path, data_sha256: str) -> tuple[Any, FitReport, bool]:
    """`fit_dataset`, done once: (dataset, report, whether it was loaded). Loaded from
    `out_dir/fitted/<split>-<key>/` when an earlier process saved it (`lhd train --fit-only`, a
    previous run); else fitted here and saved by the main process. No collective: in a distributed
    launch without the cache every rank fits the same rows itself, so none waits in a barrier."""
    from accelerate import PartialState

    folder = Path(out_dir) / FITTED_DIR / f"{split}-{fit_key(data_sha256, fmt, tok, max_length, reserve, split)}"
    loaded = _load_fitted(folder, ds)
    if loaded is not None:
        log.info("data.%s: fitted rows loaded from %s", split, folder)
        return loaded[0], loaded[1], True
    state = PartialState()
    if state.num_processes > 1:
        log.warning("data.%s: no fitted rows in %s; every rank fits them itself (run `lhd train ... --fit-only` "
                    "before the launch to fit once)", split, folder)
    fitted, report = fit_dataset(ds, fmt, tok, max_length, reserve, split)
    if state.is_main_process:
        _save_fitted(folder, fitted if fitted is not ds else None, report)
    return fitted, report, False


def _load_fitted(folder: Path, ds: Any) -> tuple[Any, FitReport] | None:
    try:
        saved = json.loads((folder / "report.json").read_text(encoding="utf-8"))
        report = FitReport(**saved["report"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not saved.get("rows_changed"):
        return ds, report
    from datasets import load_from_disk

    try:
        return load_from_disk(str(folder / "rows")), report
    except (OSError, ValueError):
        return None


def _save_fitted(folder: Path, fitted: Any | None, report: FitReport) -> None:
    """Rows first, then the report (the marker a reader trusts), written into a temporary folder
    that is renamed into place: a killed writer leaves no half folder that looks complete."""
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if fitted is not None:
        fitted.save_to_disk(str(tmp / "rows"))
    (tmp / "report.json").write_text(json.dumps({"rows_changed": fitted is not None, "report": report.to_json()}),
                                     encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
