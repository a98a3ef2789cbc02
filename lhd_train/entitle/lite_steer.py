"""`lhd entitle steer DIR` on a lite directory: the causal arm, measured on forced choices, with
the controls that say whether a push towards abstaining is more than a push towards some words.

Per fact and cell the prompt is scored unsteered and once per direction and strength
(`lite_score`: `alpha · |h| · unit` at one block, norm-matched by construction). Directions:
`entitlement` (through the lens's adjoint, or J = I without `--lens`), `token_matched` (its
lexical control) and `random01..` (the null). Outcomes, controls and the files steer_lite.json,
steer_lite.jsonl (resumable by fact), steer_lite_summary.json: docs/entitle.md, "Steering in lite mode"."""
from __future__ import annotations

import functools
import json
import platform
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lhd_train.bench.taskpack import TaskPack, load_pack
from lhd_train.entitle.items import Item
from lhd_train.entitle.lite_prompts import (
    ABSTAIN_KEY,
    LiteFact,
    X,
    continuations,
    encode,
    messages,
    prompt_text,
    spread,
)
from lhd_train.entitle.lite_score import Suffix, score_suffixes
from lhd_train.entitle.lite_summary import describe
from lhd_train.errors import InputError
from lhd_train.io.files import append_jsonl, read_jsonl, write_json_atomic
from lhd_train.io.provenance import package_versions, utc_now
from lhd_train.rundir.lock import run_dir_lock

MANIFEST, ROWS, SUMMARY = "steer_lite.json", "steer_lite.jsonl", "steer_lite_summary.json"
UNSTEERED, ENTITLEMENT, TOKEN_MATCHED = "unsteered", "entitlement", "token_matched"
NEUTRAL = " a figure we review each quarter."
#: ordinary words unrelated to evidence, doubt or refusal: the token-matched control's pool
CONTROL_WORDS = (
    "garden river window yellow kitchen music forest bottle pencil carpet horse island butter jacket mountain orange "
    "planet silver summer winter village engine bridge castle dinner flower guitar hammer ladder lemon museum ocean "
    "pepper rabbit saddle tiger tomato violin wagon basket blanket candle cherry coffee cotton desert dragon feather "
    "finger garlic helmet honey kettle lizard magnet marble meadow mirror needle noodle onion parrot peanut pillow "
    "pocket potato puppet quilt rocket salad sandal shadow shovel spider sponge statue sugar tunnel turtle umbrella "
    "valley walnut whistle wizard zebra anchor apron bakery balcony banana barrel beach beard berry biscuit bucket "
    "cabin cactus camel canoe canvas cereal chimney cloud coconut collar copper cousin cradle crayon dolphin donkey "
    "eagle elbow fabric falcon fence fiddle forest fountain frog glove goat grape harbor hedge hockey ivory jelly "
    "jungle kitten lantern lettuce lobster meadow melon monkey mustard nest oven paddle pasta peach pebble penguin "
    "piano pirate plum pony pumpkin puzzle raven ribbon saucer scarf seal shell sheep sock soup squirrel stove "
    "swan tent thread toast towel tractor trumpet tulip vase velvet wheat willow wool yogurt bicycle bubble "
    "sunset rainbow thunder breeze pebble lemonade circus dance sing swim paint bake jump laugh green blue purple "
    "happy sunny quiet gentle brave").split()


@dataclass
class LiteSteerSettings:
    directory: Path
    lens: Path | None = None
    layer: int | None = None  # default: 60 % of the depth
    alphas: list[float] = field(default_factory=lambda: [0.25, 0.5, 1.0])
    random: int = 20
    random_alphas: list[float] | None = None  # the strengths the random directions run at (None: every alpha)
    seed: int = 0
    cells: list[str] = field(default_factory=lambda: ["deleted/none"])
    facts: int | None = None  # at most this many facts, spread over the tasks
    progress: bool = True


@dataclass(frozen=True)
class Direction:
    name: str
    vector: torch.Tensor  # as built (its norm is reported); steering uses its unit


def _form_shape(form: str) -> tuple[bool, bool]:
    """(leading space, capitalised) of a token's surface form."""
    word = form.lstrip(" ")
    return form.startswith(" "), word[:1].isupper()


#: words a control token must not be: the entitlement sets' and the abstention lexicon's own
DENY = frozenset("""not no none never nothing cannot unable unknown unclear missing absent unavailable unsupported
unverified unstated uncertain insufficient speculation assumption supported supports confirmed confirms verified
documented stated shows evidence true yes correct refuted contradicts contradicted false incorrect wrong
inconsistent disproved file files data record records found given listed information figure value""".split())


def _pool(tokenizer: Any, words: tuple[str, ...], exclude: set[int]) -> dict[tuple[bool, bool], dict[int, str]]:
    """Single-token forms of `words` by shape (leading space, capitalised), none in `exclude`."""
    pool: dict[tuple[bool, bool], dict[int, str]] = {}
    for w in dict.fromkeys(words):
        for space in (False, True):
            for cap in (False, True):
                form = (" " if space else "") + (w[:1].upper() + w[1:] if cap else w)
                ids = tokenizer(form, add_special_tokens=False)["input_ids"]
                if len(ids) == 1 and ids[0] not in exclude:
                    pool.setdefault((space, cap), {})[int(ids[0])] = form
    return pool


def token_matched_ids(tokenizer: Any, reference: list[int], exclude: set[int],
                      words: tuple[str, ...] = tuple(CONTROL_WORDS)) -> list[tuple[int, int, str]]:
    """For each reference token, an unrelated single-token word form of the same shape whose id is
    nearest (each used once, none in `exclude`): [(reference id, control id, control form)]. The
    pool is `words`; a small vocabulary without enough of them as single tokens adds its own
    alphabetic tokens of 4+ letters that are not in `DENY`."""
    pool = _pool(tokenizer, words, exclude)
    if sum(len(p) for p in pool.values()) < 2 * len(reference):
        vocab = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        extra = tuple(w.strip() for w in vocab if w.strip().isalpha() and len(w.strip()) >= 4
                      and w.strip().lower() not in DENY)
        pool = _pool(tokenizer, tuple(words) + extra, exclude)
    out = []
    used: set[int] = set()
    for ref in reference:
        shape = _form_shape(tokenizer.decode([ref]))
        cands = {i: f for i, f in pool.get(shape, {}).items() if i not in used}
        if not cands:
            cands = {i: f for p in pool.values() for i, f in p.items() if i not in used}
        if not cands:
            raise InputError("tokenizer", None, "too few single-token control words for the token-matched direction")
        best = min(cands, key=lambda i: (abs(i - ref), i))
        used.add(best)
        out.append((ref, best, cands[best]))
    return out


def build_directions(model: Any, tokenizer: Any, layer: int, lens: Any, k_random: int,
                     seed: int) -> tuple[list[Direction], dict[str, Any]]:
    """The entitlement, token-matched and random directions at block `layer` (module doc), and a record
    of the token sets behind them."""
    from lens.directions import entitlement_direction, random_directions
    from lens.margins import TokenSets, resolve_token_sets

    sets = resolve_token_sets(tokenizer, model_type=getattr(model, "model_type", None))
    v = entitlement_direction(model, sets, layer, lens)
    matched = token_matched_ids(tokenizer, list(sets.N), set(sets.union()))
    control = TokenSets(S=list(sets.S), N=[c for _, c, _ in matched], R=[])
    c = entitlement_direction(model, control, layer, lens)
    dirs = [Direction(ENTITLEMENT, v), Direction(TOKEN_MATCHED, c)]
    dirs += [Direction(f"random{i + 1:02d}", r) for i, r in enumerate(random_directions(v, k_random, seed))]
    record = {"S": [tokenizer.decode([t]) for t in sets.S], "N": [tokenizer.decode([t]) for t in sets.N],
              "control": [{"for": tokenizer.decode([r]), "for_id": r, "id": i, "form": f} for r, i, f in matched],
              "token_sets": {"N": list(sets.N), "S": list(sets.S), "control": [i for _, i, _ in matched]},
              "norms": {d.name: float(d.vector.norm()) for d in dirs[:3]},
              "cosine_entitlement_token_matched": float(torch.nn.functional.cosine_similarity(v, c, dim=0))}
    return dirs, record


@functools.lru_cache(maxsize=8)
def _pack(name: str) -> TaskPack:
    return load_pack(name)


def _facts(directory: Path) -> list[LiteFact]:
    return [LiteFact(item=Item.from_json(r["item"]), counterbalanced=bool(r["counterbalanced"]), x=r["x"])
            for r in read_jsonl(directory / "lite_items.jsonl")]


def fact_rows(model: Any, tokenizer: Any, fact: LiteFact, cell: str, dirs: list[Direction], alphas: list[float],
              layer: int, token_sets: list[list[int]], random_alphas: list[float] | None = None
              ) -> list[dict[str, Any]]:
    """Every direction and strength on one fact's cell, in one batched pass over a shared prompt."""
    files, _, pressure = cell.partition("/")
    task = _pack(fact.item.pack).task(fact.item.task)
    text = prompt_text(tokenizer, messages(task, fact, files, pressure))
    conts = {k: v for k, v in continuations(fact).items() if k in (X, ABSTAIN_KEY)} | {"neutral": NEUTRAL}
    enc = {k: encode(tokenizer, text, v) for k, v in conts.items()}
    prompt = enc[X][0]
    units = torch.stack([d.vector / d.vector.norm() for d in dirs])
    runs: list[tuple[str, float, int | None]] = [(UNSTEERED, 0.0, None)]
    runs += [(d.name, a, i) for i, d in enumerate(dirs) for a in alphas
             if random_alphas is None or not d.name.startswith("random") or a in random_alphas]
    suffixes = [Suffix(0, tuple(enc[k][1]), i, a) for _, a, i in runs for k in conts]
    scored = score_suffixes(model, [prompt], suffixes, layer=layer, units=units, token_sets=token_sets)
    rows = []
    for r, (name, alpha, _) in enumerate(runs):
        part = dict(zip(conts, scored[r * len(conts):(r + 1) * len(conts)], strict=True))
        first = part[X]
        rows.append({"fact": fact.item.fact_id, "pack": fact.item.pack, "task": fact.item.task, "cell": cell,
                     "counterbalanced": fact.counterbalanced, "direction": name, "alpha": alpha, "layer": layer,
                     "logprob": {k: sc.logprob for k, sc in part.items()},
                     "tokens": {k: len(sc.token_logprobs) for k, sc in part.items()},
                     "margin": part[ABSTAIN_KEY].logprob - part[X].logprob,
                     "neutral_nll": -part["neutral"].logprob / max(1, len(part["neutral"].token_logprobs)),
                     "top1": tokenizer.decode([first.top1]),
                     "lse": dict(zip(("N", "S", "control"), first.set_lse, strict=True))})
    return rows


def summarise_steer(rows: list[dict[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per direction and alpha: the paired change against the unsteered score of each fact (margin,
    N-word log-sum-exp, neutral log-loss), and where the entitlement and token-matched directions
    fall in the random directions' null distribution of mean changes."""
    rows = list({(r["fact"], r["cell"], r["direction"], float(r["alpha"])): r for r in rows}.values())  # last wins
    base = {(r["fact"], r["cell"]): r for r in rows if r["direction"] == UNSTEERED}
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        if r["direction"] != UNSTEERED and (r["fact"], r["cell"]) in base:
            groups.setdefault((r["direction"], float(r["alpha"])), []).append(r)
    table: list[dict[str, Any]] = []
    for (name, alpha), sel in sorted(groups.items()):
        b = [base[(r["fact"], r["cell"])] for r in sel]
        clusters = [f"{r['pack']}/t{r['task']}" for r in sel]
        d_margin = np.array([r["margin"] - x["margin"] for r, x in zip(sel, b, strict=True)])
        d_n = np.array([r["lse"]["N"] - x["lse"]["N"] for r, x in zip(sel, b, strict=True)])
        d_nll = np.array([r["neutral_nll"] - x["neutral_nll"] for r, x in zip(sel, b, strict=True)])
        table.append({"direction": name, "alpha": alpha, "margin": describe(d_margin, clusters, seed),
                      "lse_N_avg": float(d_n.mean()), "neutral_nll_avg": float(d_nll.mean()),
                      "perplexity_ratio": float(np.exp(d_nll.mean())),
                      "top1": Counter(r["top1"] for r in sel).most_common(4)})
    null: dict[str, Any] = {}
    for alpha in sorted({t["alpha"] for t in table}):
        rand = np.array([t["margin"]["mean"] for t in table if t["alpha"] == alpha
                         and t["direction"].startswith("random")])
        rand_nll = np.array([t["neutral_nll_avg"] for t in table if t["alpha"] == alpha
                             and t["direction"].startswith("random")])
        entry: dict[str, Any] = {"random_directions": int(len(rand))}
        if len(rand):
            entry |= {"random_avg": float(rand.mean()), "random_sd": float(rand.std(ddof=1)) if len(rand) > 1
                      else None, "random_min": float(rand.min()), "random_max": float(rand.max()),
                      "random_q95": float(np.quantile(rand, 0.95)), "random_neutral_nll_avg": float(rand_nll.mean())}
            for name in (ENTITLEMENT, TOKEN_MATCHED):
                m = next((t["margin"]["mean"] for t in table if t["alpha"] == alpha and t["direction"] == name), None)
                if m is not None:  # rank p: the share of the null (with the direction itself) at least as large
                    entry[f"{name}_p_vs_random"] = float((1 + (rand >= m).sum()) / (1 + len(rand)))
        null[f"{alpha:g}"] = entry
    n_facts = len({k[0] for k in base})
    return {"schema": "lhd.entitle-lite-steer/1", "n_facts": n_facts,
            "n_tasks": len({(r["pack"], r["task"]) for r in base.values()}),
            "outcome": "forced-choice abstention margin log P(abstain) - log P(X), steered - unsteered, same fact",
            "directions": table, "null": null}


def run_lite_steer(s: LiteSteerSettings, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Score the steered and unsteered cells not on disk yet, then write the summary (module doc)."""
    from tqdm.auto import tqdm

    d = Path(s.directory)
    if not (d / "lite.json").is_file():
        raise InputError(d, None, "not a lite entitle directory (no lite.json): run `lhd entitle run --mode lite`")
    record = json.loads((d / "lite.json").read_text(encoding="utf-8"))
    for cell in s.cells:
        if cell not in record["cells"]:
            raise InputError("command line", "--cell", f"{cell!r}", ", ".join(record["cells"]))
    if not s.alphas or any(a < 0 for a in s.alphas):
        raise InputError("command line", "--alpha", f"{s.alphas}", "one or more strengths >= 0")
    if s.random_alphas is not None and not set(s.random_alphas) <= set(s.alphas):
        raise InputError("command line", "--random-alpha", f"{s.random_alphas}", f"some of --alpha {s.alphas}")
    with run_dir_lock(d, stage="lhd entitle steer (lite)"):
        if model is None:
            from lhd_train.entitle.lite import _load_model

            model, tokenizer = _load_model(record["model"], record.get("adapter"))
        layer = s.layer if s.layer is not None else round(0.6 * (model.n_layers - 1))
        if not 0 <= layer < model.n_layers:
            raise InputError("command line", "--layer", f"{layer}", f"0 ... {model.n_layers - 1}")
        lens = None
        if s.lens is not None:
            from lens.store import load_lens

            lens = load_lens(s.lens, model=model)
        dirs, sets = build_directions(model, tokenizer, layer, lens, s.random, s.seed)
        meta = {"schema": "lhd.entitle-lite-steer-settings/1", "layer": layer,
                "lens": str(s.lens) if s.lens else None, "transport": "J-lens adjoint" if s.lens else "J = I (direct "
                "unembedding; no J-lens fitted)", "alphas": s.alphas, "random": s.random,
                "random_alphas": s.random_alphas, "seed": s.seed,
                "cells": s.cells, "facts": s.facts, "neutral": NEUTRAL, "sets": sets, "model": record["model"],
                "packages": package_versions(), "host": platform.node(), "at": utc_now()}
        if (d / MANIFEST).is_file():
            old = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
            for key in ("layer", "lens", "alphas", "random", "random_alphas", "seed", "cells", "neutral"):
                if old.get(key) != meta[key]:
                    raise InputError(d / MANIFEST, key, f"the steering rows were made with {old.get(key)!r}, the "
                                     f"command asks for {meta[key]!r}", f"the same settings, or delete {ROWS}")
        write_json_atomic(d / MANIFEST, meta)
        done = {(r["fact"], r["cell"]) for r in read_jsonl(d / ROWS) if r["direction"] == UNSTEERED}
        todo = [(f, c) for f in spread(_facts(d), s.facts) for c in s.cells if (f.item.fact_id, c) not in done]
        ids = sets["token_sets"]
        bar = tqdm(total=len(todo), desc="steered facts", unit="fact", disable=not s.progress, dynamic_ncols=True)
        for fact, cell in todo:
            rows = fact_rows(model, tokenizer, fact, cell, dirs, s.alphas, layer, [ids["N"], ids["S"], ids["control"]],
                             s.random_alphas)
            for row in sorted(rows, key=lambda r: r["direction"] == UNSTEERED):  # the unsteered row last: done
                append_jsonl(d / ROWS, row)
            bar.update()
        bar.close()
        summary = summarise_steer(read_jsonl(d / ROWS), s.seed)
        summary["settings"] = {k: v for k, v in meta.items() if k not in ("packages", "sets")}
        summary["sets"] = {k: sets[k] for k in ("N", "control", "norms", "cosine_entitlement_token_matched")}
        write_json_atomic(d / SUMMARY, summary)
    return summary


def steer_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as text: per strength the random null, then the named directions against it."""
    lines = [f"{summary['n_facts']} facts in {summary['n_tasks']} tasks; {summary['outcome']}"]
    for alpha, null in summary["null"].items():
        if null["random_directions"]:
            lines.append(f"alpha {alpha}: {null['random_directions']} random directions: mean "
                         f"{null['random_avg']:+.2f}, range [{null['random_min']:+.2f}, "
                         f"{null['random_max']:+.2f}], 95th pct {null['random_q95']:+.2f}")
        for t in summary["directions"]:
            if f"{t['alpha']:g}" != alpha or t["direction"].startswith("random"):
                continue
            m = t["margin"]
            ci = m["ci95_task_bootstrap"]
            interval = f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else ""
            lines.append(f"  {t['direction']:>14}: {m['mean']:+.2f}{interval}, {m['facts_positive']}/{m['n_facts']} "
                         f"facts > 0, sign-flip p {m['p_task_sign_flip']:.3g}, p vs random "
                         f"{null.get(t['direction'] + '_p_vs_random', float('nan')):.3g}; N words "
                         f"{t['lse_N_avg']:+.2f}; perplexity x{t['perplexity_ratio']:.2f}")
    return lines
