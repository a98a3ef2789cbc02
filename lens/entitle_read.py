"""`lhd entitle read`: lens and probe margins at the model's own claims, with labels made by code.

Each `fabricated` and `supported` answer of a fact that has both is read in the exact context it
was generated from (`lens.entitle_positions`), at the asserted figure's last token (`claim`), the
last prompt token (`decision`), the question's last token (`question`, the negative control) and
the end of an elicitation turn after the answer (`elicit`: "does the figure you gave ... appear in
the files?"), where the model's own Yes − No is its `stated` margin.
Readouts: the logit lens, the Jacobian lens (`--lens`), a self-only Jacobian lens (`--lens-self`,
any lens directory), a random-transport control of the Jacobian lens (`lens.controls`), and a
linear probe (out of fold, folds grouped by task). Score: `-m_E` (low entitlement = suspicious).

Primary contrast: `fabricated` vs `supported` within the same fact (`lens.paired_auroc`), so the
task, the fact and the question cancel; what is left differs by the evidence and by the answer.
Two more controls: `length` (tokens up to the position: a deleted line makes the context
shorter) and `echo` (S and N tokens in the context up to the position: the lexical echo of
entitlement words). `stated` is scored like a readout (saying No = suspicious), and the
answer-controlled cell reads the primary readout at `elicit` among the answers the model says are
in the files (stated > 0): what the internal side knows that the stated side denies. The band
(fractions of depth), the primary readout and position are written to `plan.json` before the first
forward and a later read into the same folder must declare the same plan (no choosing the cell after
seeing the table)."""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.elicit import AnswerSets, elicitation, resolve_answer_sets
from lens.entitle_positions import POSITIONS, answer_tokens
from lens.errors import LensError
from lens.files import write_json
from lens.margins import MARGIN_NAMES, TokenSets, margins
from lens.model import LensModel, block_outputs
from lens.paired_auroc import paired_auroc
from lens.readout import PRIMARY, Readout
from lens.readout_probe import PROBE, out_of_fold_logits
from lens.stats import band_layers
from lhd_train.io.csv_cells import write_csv
from lhd_train.io.files import atomic_write_text, read_json_mapping
from lhd_train.io.provenance import utc_now

log = logging.getLogger(__name__)
POSITIVE, NEGATIVE = "fabricated", "supported"
CONTROLS = ("length", "echo")
STATED = "stated"  # the model's own Yes − No at `elicit` (final layer), a readout of its self-report


@dataclass
class EntitleReadConfig:
    band: tuple[float, float] = (0.35, 0.85)
    primary_readout: str = PRIMARY
    primary_position: str = "claim"
    n_boot: int = 2000
    seed: int = 0
    probe: bool = True
    probe_folds: int = 5
    max_answers: int | None = None
    progress: bool = True


def select_answers(rows: Sequence[dict[str, Any]], max_answers: int | None = None) -> list[dict[str, Any]]:
    """The rows that count (last per id) labelled fabricated or supported with an asserted span,
    of facts holding both labels, in file order; at most `max_answers` (whole facts)."""
    latest = {a["id"]: a for a in rows}
    kept = [a for a in latest.values() if a.get("label") in (POSITIVE, NEGATIVE) and a.get("asserted_span")
            and a.get("files") != "control"]  # the control question is about another task's fact
    facts: dict[str, set[str]] = {}
    for a in kept:
        facts.setdefault(a["fact"], set()).add(a["label"])
    both = [a for a in kept if facts[a["fact"]] == {POSITIVE, NEGATIVE}]
    if max_answers is not None:
        out: list[dict[str, Any]] = []
        for fact in dict.fromkeys(a["fact"] for a in both):
            group = [a for a in both if a["fact"] == fact]
            if len(out) + len(group) > max_answers:
                break
            out += group
        return out
    return both


def write_plan(out: Path, plan: dict[str, Any]) -> dict[str, Any]:
    """plan.json, written before any forward; an existing one must hold the same plan."""
    path = out / "plan.json"
    key = {k: v for k, v in plan.items() if k != "declared_at"}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    old = read_json_mapping(path)
    if old and old.get("sha256") != digest:
        raise LensError(f"{path}: declares another plan ({old.get('primary')}, band {old.get('band')}); a read into "
                        "this folder must keep it (choose a new --out to read with another plan)")
    plan = {**plan, "sha256": digest, "declared_at": old.get("declared_at") or plan["declared_at"]}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(plan, indent=2) + "\n")
    return plan


def _echo(ids: list[int], upto: int, sets: TokenSets) -> int:
    """N-set tokens minus S-set tokens in the context up to and including `upto` (suspicion-signed)."""
    window = ids[: upto + 1]
    s, n = set(sets.S), set(sets.N)
    return sum(t in n for t in window) - sum(t in s for t in window)


def stated_sets(tokenizer: Any, sets: TokenSets) -> tuple[AnswerSets | None, str | None]:
    """The Yes / No token ids by the S / N sets' rule, or None and why (the read goes on without `stated`)."""
    try:
        return resolve_answer_sets(tokenizer, fallback="first-token" if sets.mode == "first-token" else "strict"), None
    except LensError as exc:
        log.warning("no stated margin: %s", exc)
        return None, str(exc)


def collect(model: LensModel, tokenizer: Any, answers: Sequence[dict[str, Any]], readouts: Sequence[Readout],
            sets: TokenSets, cfg: EntitleReadConfig, answer_sets: AnswerSets | None = None,
            ) -> tuple[list[dict], list[dict], dict[str, list], list[dict]]:
    """(margin rows, example rows, hidden states per position [n][L, d], skipped); each example's `stated`
    margin when `answer_sets` are given."""
    union = torch.tensor(sets.union(), dtype=torch.long, device=model.device)
    idx_sets = sets.index_sets()
    rows: list[dict] = []
    examples: list[dict] = []
    feats: dict[str, list] = {p: [] for p in POSITIONS}
    skipped: list[dict] = []
    for ans in tqdm(answers, desc="read", unit="answer", disable=not cfg.progress, dynamic_ncols=True):
        tok = answer_tokens(tokenizer, ans)
        missing = [p for p in POSITIONS if p not in tok.positions]
        if missing:
            skipped.append({"id": ans["id"], "reason": f"position(s) not found: {', '.join(missing)}"})
            continue
        pos = [tok.positions[p] for p in POSITIONS]
        ids = torch.tensor(tok.ids[: max(pos) + 1], device=model.device)[None]
        acts = block_outputs(model, ids)
        H = torch.stack([acts[layer][0, pos] for layer in range(model.n_layers)])  # [L, P, d]
        base = {"id": ans["id"], "fact": ans["fact"], "task": ans["task"], "label": ans["label"]}
        for ro in readouts:
            layers = [layer for layer in range(model.n_layers) if ro.has_layer(layer)]
            with torch.no_grad():
                z = torch.stack([ro.logits(layer, H[layer], token_ids=union) for layer in layers])
            m = {k: v.float().cpu().numpy() for k, v in margins(z, idx_sets).items()}
            for j, layer in enumerate(layers):
                for p, name in enumerate(POSITIONS):
                    rows.append({**base, "readout": ro.name, "layer": layer, "position": name,
                                 **{k: float(m[k][j, p]) for k in MARGIN_NAMES}})
        stated = None
        if answer_sets is not None:
            with torch.no_grad():
                own = model.unembed(H[-1, POSITIONS.index("elicit")][None]).float()[0]  # the model's own logits
            stated = float(torch.logsumexp(own[answer_sets.yes], 0) - torch.logsumexp(own[answer_sets.no], 0))
        examples.append({**base, "files": ans["files"], "pressure": ans["pressure"], "sample": ans["sample"],
                         "retokenized": tok.retokenized, "n_prompt": tok.n_prompt, STATED: stated,
                         **{f"length_{p}": tok.positions[p] + 1 for p in POSITIONS},
                         **{f"echo_{p}": _echo(tok.ids, tok.positions[p], sets) for p in POSITIONS}})
        for p, name in enumerate(POSITIONS):
            feats[name].append(H[:, p].float().cpu().numpy())
    return rows, examples, feats, skipped


def probe_rows(examples: list[dict], feats: dict[str, list], cfg: EntitleReadConfig) -> list[dict]:
    """Out-of-fold probe margins (logit supported − logit fabricated), folds grouped by task."""
    y = np.array([e["label"] == NEGATIVE for e in examples], dtype=int)
    groups = np.array([str(e["task"]) for e in examples])
    if len(set(groups)) < 2 or len(set(y)) < 2:
        log.warning("probe skipped: it needs two tasks and both labels")
        return []
    out = []
    for name in POSITIONS:
        X = np.stack(feats[name])  # [n, L, d]
        for layer in range(X.shape[1]):
            try:
                Z = out_of_fold_logits(X[:, layer, :], y, list(groups), n_splits=cfg.probe_folds, seed=cfg.seed)
            except LensError as exc:
                log.warning("probe at layer %d, %s: %s", layer, name, exc)
                continue
            for e, zrow in zip(examples, Z, strict=True):
                m_e = float(zrow[1] - zrow[0]) if np.isfinite(zrow).all() else float("nan")
                out.append({"id": e["id"], "fact": e["fact"], "task": e["task"], "label": e["label"],
                            "readout": PROBE, "layer": layer, "position": name, "m_E": m_e})
    return out


def auroc_table(rows: list[dict], examples: list[dict], n_layers: int, cfg: EntitleReadConfig) -> list[dict]:
    """Paired AUROC of −m_E (fabricated positive) per readout × position × layer, over the band
    (mean m_E over its layers; layer −1), and for the length and echo controls."""
    import pandas as pd

    df = pd.DataFrame(rows)
    lo, hi = band_layers(n_layers, cfg.band)
    band = list(range(lo, hi + 1))
    out = []

    def cell(readout: str, position: str, layer: int, g: Any, score: Any) -> dict:
        r = paired_auroc(score, g["label"] == POSITIVE, g["fact"], g["task"], n_boot=cfg.n_boot, seed=cfg.seed)
        return {"readout": readout, "position": position, "layer": layer, **r.to_json()}

    for (ro, pos, layer), g in df.groupby(["readout", "position", "layer"], sort=True):
        out.append(cell(ro, pos, int(layer), g, -g["m_E"].to_numpy(float)))
    b = df[df["layer"].isin(band)]
    for (ro, pos), g in b.groupby(["readout", "position"], sort=True):
        m = g.groupby(["id", "fact", "task", "label"], as_index=False)["m_E"].mean()
        out.append(cell(ro, pos, -1, m, -m["m_E"].to_numpy(float)))
    ex = pd.DataFrame(examples)
    if ex[STATED].notna().any():
        out.append(cell(STATED, "elicit", -1, ex, -ex[STATED].to_numpy(float)))  # saying No = suspicious
    for control in CONTROLS:
        for pos in POSITIONS:
            sign = -1.0 if control == "length" else 1.0  # shorter context (a deleted line) = suspicious
            out.append(cell(control, pos, -1, ex, sign * ex[f"{control}_{pos}"].to_numpy(float)))
    return out


def answer_controlled(rows: list[dict], examples: list[dict], n_layers: int, cfg: EntitleReadConfig,
                      readout: str) -> dict[str, Any]:
    """`readout`'s band-mean paired AUROC at `elicit` among the answers whose stated margin is positive (the
    model says the figure is in the files): a fabricated answer it calls supported is the case the internal
    side must catch on its own."""
    lo, hi = band_layers(n_layers, cfg.band)
    yes = {e["id"] for e in examples if e.get(STATED) is not None and e[STATED] > 0}
    sums: dict[str, list[float]] = {}
    for r in rows:
        if (r["readout"], r["position"]) == (readout, "elicit") and lo <= r["layer"] <= hi and r["id"] in yes:
            sums.setdefault(r["id"], []).append(r["m_E"])
    ex = [e for e in examples if e["id"] in sums]
    res = paired_auroc([-float(np.mean(sums[e["id"]])) for e in ex], [e["label"] == POSITIVE for e in ex],
                     [e["fact"] for e in ex], [e["task"] for e in ex], n_boot=cfg.n_boot, seed=cfg.seed)
    return {"readout": readout, "position": "elicit", "among": "answers the model says are in the files "
            "(stated > 0)", "n_stated_yes": {lab: sum(e["id"] in yes and e["label"] == lab for e in examples)
                                             for lab in (POSITIVE, NEGATIVE)}, **res.to_json()}


def read_entitle(model: LensModel, tokenizer: Any, answers_rows: Sequence[dict[str, Any]],
                 readouts: Sequence[Readout], sets: TokenSets, out_dir: str | Path,
                 cfg: EntitleReadConfig | None = None, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Declare the plan, read every selected answer, write margins.csv, examples.csv, auroc.csv, read.md
    and summary.json into `out_dir`; returns the summary."""
    cfg = cfg or EntitleReadConfig()
    out = Path(out_dir)
    names = [ro.name for ro in readouts] + ([PROBE] if cfg.probe else [])
    answer_sets, no_stated = stated_sets(tokenizer, sets)
    if cfg.primary_readout not in names + list(CONTROLS) + ([STATED] if answer_sets else []):
        raise LensError(f"primary readout {cfg.primary_readout!r} is not read (readouts: {', '.join(names)}); pass "
                        "the lens it needs or declare another primary readout")
    if cfg.primary_position not in POSITIONS:
        raise LensError(f"primary position {cfg.primary_position!r}: allowed {', '.join(POSITIONS)}")
    if cfg.primary_readout == STATED and cfg.primary_position != "elicit":
        raise LensError(f"primary readout {STATED!r} is read at the elicit position only (--primary stated:elicit)")
    answers = select_answers(answers_rows, cfg.max_answers)
    lo, hi = band_layers(model.n_layers, cfg.band)
    band = list(range(lo, hi + 1))
    plan = write_plan(out, {
        "contrast": f"{POSITIVE} vs {NEGATIVE} within the same fact (paired AUROC of -m_E)",
        "primary": {"readout": cfg.primary_readout, "position": cfg.primary_position, "layers": "band mean"},
        "band": list(cfg.band), "band_layers": band, "readouts": names, "token_sets": sets.to_json(),
        "elicitation": "the last user turn after the answer: " + elicitation("<attribute>", "<entity>"),
        "stated": answer_sets.to_json() if answer_sets else f"not read: {no_stated}",
        "answers": [a["id"] for a in answers], "declared_at": utc_now(), **(info or {})})
    if not answers:
        summary = {"n_answers": 0, "plan": plan, "primary": None,
                   "note": "no fact has both a fabricated and a supported answer: nothing to compare"}
        write_json(out / "summary.json", summary)
        return summary
    rows, examples, feats, skipped = collect(model, tokenizer, answers, readouts, sets, cfg, answer_sets)
    if cfg.probe and examples:
        rows += probe_rows(examples, feats, cfg)
    table = auroc_table(rows, examples, model.n_layers, cfg) if examples else []
    primary = next((t for t in table if (t["readout"], t["position"], t["layer"]) ==
                    (cfg.primary_readout, cfg.primary_position, -1)), None)
    import pandas as pd

    write_csv(pd.DataFrame(rows), out / "margins.csv")
    write_csv(pd.DataFrame(examples), out / "examples.csv")  # per answer: stated margin, lengths, echo counts
    write_csv(pd.DataFrame(table), out / "auroc.csv")
    summary = {"n_answers": len(examples), "n_facts": len({e["fact"] for e in examples}),
               "labels": {lab: sum(e["label"] == lab for e in examples) for lab in (POSITIVE, NEGATIVE)},
               "retokenized": sum(e["retokenized"] for e in examples), "skipped": skipped, "plan": plan,
               "primary": primary, "config": asdict(cfg),
               "answer_controlled": answer_controlled(rows, examples, model.n_layers, cfg, cfg.primary_readout)
               if examples and answer_sets and cfg.primary_readout in names else None,
               "negative_control": [t for t in table if t["position"] == "question" and t["layer"] == -1]}
    write_json(out / "summary.json", summary)
    atomic_write_text(out / "read.md", markdown(summary, table))
    return summary


def with_adapter(model: Any, adapter: str | None) -> Any:
    """`model` (an `HFLensModel`) with a LoRA adapter merged in, so the read sees the weights that
    generated the answers; `model` itself when there is none."""
    if not adapter:
        return model
    from peft import PeftModel

    from lens.model import HFLensModel

    merged = PeftModel.from_pretrained(model.hf, adapter, is_trainable=False).merge_and_unload()
    return HFLensModel(merged, name=f"{model.name}+{adapter}", revision=model.revision)


def _f(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def markdown(summary: dict[str, Any], table: list[dict]) -> str:
    """read.md: the declared primary cell first, then every band cell (exploratory)."""
    p = summary["primary"]
    plan = summary["plan"]
    lines = ["# Entitlement margins at the model's own claims", "",
             f"{summary['n_answers']} answers of {summary['n_facts']} facts ({summary['labels']}); "
             f"{summary['retokenized']} re-tokenised (no stored token ids); {len(summary['skipped'])} skipped.", "",
             f"Declared before reading ({plan['declared_at']}, plan sha256 {plan['sha256'][:12]}): "
             f"{plan['contrast']}; primary cell {plan['primary']['readout']} at {plan['primary']['position']}, "
             f"band layers {plan['band_layers'][0]}-{plan['band_layers'][-1]}.", ""]
    if p:
        lines.append(f"**Primary: paired AUROC {_f(p['auroc'])} [{_f(p['lo'])}, {_f(p['hi'])}]** "
                     f"({p['n_pairs']} pairs in {p['n_groups']} facts, {p['n_clusters']} tasks)")
    ac = summary.get("answer_controlled")
    if ac:
        lines.append(f"\nAnswer-controlled ({ac['readout']} at elicit, band, among {ac['among']}; "
                     f"{ac['n_stated_yes']}): paired AUROC {_f(ac['auroc'])} [{_f(ac['lo'])}, {_f(ac['hi'])}] "
                     f"over {ac['n_pairs']} pairs")
    lines += ["", "| readout | position | paired AUROC [95% CI] | pairs | facts |", "|---|---|---|---|---|"]
    for t in table:
        if t["layer"] == -1:
            lines.append(f"| {t['readout']} | {t['position']} | {_f(t['auroc'])} [{_f(t['lo'])}, {_f(t['hi'])}] | "
                         f"{t['n_pairs']} | {t['n_groups']} |")
    lines += ["", "Band cells other than the primary one are exploratory. `question` is the negative control "
              "(identical context within a fact: 0.5 expected); `length` and `echo` are the confound controls; "
              "`stated` is the model's own Yes - No at `elicit`, after it is asked whether its figure appears in "
              "the files; "
              "`jacobian_random` is the lens with random singular bases. Per-layer cells: auroc.csv.", ""]
    return "\n".join(lines)
