"""`lhd entitle read`: lens and probe margins at the model's own answers, compared within a cell.

Each answer a contrast takes (`entitle_answers`) is read in the exact context it was generated from
(`entitle_positions`) through every readout given (the `lens` library's, and a linear probe per
contrast, out of fold grouped by task); score −m_E. States at the prompt's positions are read once
per context and shared, so the within-cell negative control is exact; `stated` is asked both ways;
the primary cell is declared and hashed before the first forward. Outputs plan.json, margins.csv,
examples.csv, text.csv, auroc.csv, summary.json, read.md: docs/entitle.md, "Lens reads with ground truth"."""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.elicit import AnswerSets, elicitation, resolve_answer_sets
from lens.errors import LensError
from lens.files import finite
from lens.margins import MARGIN_NAMES, TokenSets, margins
from lens.model import LensModel, block_outputs
from lens.readout import PRIMARY, Readout
from lens.readout_probe import PROBE, out_of_fold_logits
from lens.stats import band_layers
from lhd_train.errors import InputError
from lhd_train.io.csv_cells import write_csv
from lhd_train.io.files import atomic_write_text, json_text
from lhd_train.io.provenance import utc_now
from lhd_train.reading.entitle_answers import (
    CONTRASTS,
    EVIDENCE_DETECTION,
    PRIMARY_CELLS,
    WITHIN_CELL,
    AnswerToRead,
    Contrast,
    contrast_of_cell,
    select_answers,
)
from lhd_train.reading.entitle_positions import (
    POSITIONS,
    PROMPT_POSITIONS,
    REQUIRED,
    answer_tokens,
    reversed_elicitation,
)
from lhd_train.reading.entitle_scores import (
    CONTROLS,
    STATED,
    STATED_DIRECT,
    TEXT,
    TEXT_POSITION,
    members,
    score_table,
    text_scores,
)
from lhd_train.reading.preregister import declare as declare_plan
from lhd_train.reading.tables import exploratory_note

log = logging.getLogger(__name__)
NEGATIVE_CONTROL = "decision"


@dataclass
class EntitleReadConfig:
    band: tuple[float, float] = (0.35, 0.85)
    primary_readout: str = PRIMARY
    primary_position: str = "elicit"
    primary_cell: str = "deleted/none"
    n_boot: int = 2000
    seed: int = 0
    probe: bool = True
    probe_folds: int = 5
    max_answers: int | None = None
    progress: bool = True


@dataclass
class Collected:
    rows: list[dict] = field(default_factory=list)  # margins.csv
    examples: list[dict] = field(default_factory=list)  # examples.csv
    feats: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # position -> id -> [L, d] (the probe)
    skipped: list[dict] = field(default_factory=list)


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


def _yes_minus_no(model: LensModel, h_last: torch.Tensor, answer_sets: AnswerSets) -> float:
    """LSE_Yes − LSE_No of the model's own logits (the last block's output through its final norm and head)."""
    with torch.no_grad():
        own = model.unembed(h_last[None]).float()[0]
    return float(torch.logsumexp(own[answer_sets.yes], 0) - torch.logsumexp(own[answer_sets.no], 0))


def collect(model: LensModel, tokenizer: Any, answers: Sequence[AnswerToRead], readouts: Sequence[Readout],
            sets: TokenSets, cfg: EntitleReadConfig, answer_sets: AnswerSets | None = None) -> Collected:
    """Every answer through every readout at its positions (module doc); the stated margins when `answer_sets`
    are given."""
    col = Collected(feats={p: {} for p in POSITIONS})
    union = sets.union()
    union_t = torch.tensor(union, dtype=torch.long, device=model.device)
    idx = sets.index_sets()
    at_elicit = sets.without((answer_sets.yes + answer_sets.no) if answer_sets else [], "an answer to the elicitation")
    idx_elicit = at_elicit.index_sets(within=union)
    last = model.n_layers - 1
    fact: str | None = None
    shared: dict[tuple[int, ...], torch.Tensor] = {}  # context up to a prompt position -> its state [L, d]
    for ans in tqdm(answers, desc="read", unit="answer", disable=not cfg.progress, dynamic_ncols=True):
        tok = answer_tokens(tokenizer, ans)
        missing = [p for p in REQUIRED if p not in tok.positions]
        if missing:
            col.skipped.append({"id": ans.id, "reason": f"position(s) not found: {', '.join(missing)}"})
            continue
        names = [p for p in POSITIONS if p in tok.positions]
        acts = block_outputs(model, torch.tensor(tok.ids, device=model.device)[None])
        H = torch.stack([acts[layer][0, [tok.positions[p] for p in names]] for layer in range(model.n_layers)])
        if ans.fact != fact:  # the answers come grouped by fact (`select_answers`)
            fact, shared = ans.fact, {}
        for q in PROMPT_POSITIONS:  # one context, one state: the first forward's, exactly
            if q in names:
                key = tuple(tok.ids[: tok.positions[q] + 1])
                H[:, names.index(q)] = shared.setdefault(key, H[:, names.index(q)].clone())
        base = {"id": ans.id, "fact": ans.fact, "task": ans.task, "files": ans.files, "pressure": ans.pressure,
                "label": ans.label}
        for ro in readouts:
            layers = [layer for layer in range(model.n_layers) if ro.has_layer(layer)]
            with torch.no_grad():
                z = torch.stack([ro.logits(layer, H[layer], token_ids=union_t) for layer in layers])
            plain = {k: v.float().cpu().numpy() for k, v in margins(z, idx).items()}
            elicit = {k: v.float().cpu().numpy() for k, v in margins(z, idx_elicit).items()}
            for j, layer in enumerate(layers):
                for p, name in enumerate(names):
                    m = elicit if name == "elicit" else plain
                    col.rows.append({**base, "readout": ro.name, "contrast": "", "layer": layer, "position": name,
                                     **{k: float(m[k][j, p]) for k in MARGIN_NAMES}})
        stated: dict[str, float | None] = {STATED: None, STATED_DIRECT: None, "stated_reversed": None,
                                           "yes_bias": None}
        if answer_sets is not None and tok.reversed_ids:
            direct = _yes_minus_no(model, H[last, names.index("elicit")], answer_sets)
            rev_acts = block_outputs(model, torch.tensor(tok.reversed_ids, device=model.device)[None], [last])
            rev = _yes_minus_no(model, rev_acts[last][0, -1], answer_sets)
            stated = {STATED: direct - rev, STATED_DIRECT: direct, "stated_reversed": rev,
                      "yes_bias": (direct + rev) / 2}
        col.examples.append({**base, "cell": ans.cell, "sample": ans.sample, "answer": ans.answer,
                             "retokenized": tok.retokenized, "n_prompt": tok.n_prompt, **stated,
                             **{f"length_{q}": tok.positions[q] + 1 for q in names},
                             **{f"echo_{q}": _echo(tok.ids, tok.positions[q], at_elicit if q == "elicit" else sets)
                                for q in names}})
        if cfg.probe:
            for p, name in enumerate(names):
                col.feats[name][ans.id] = H[:, p].float().cpu().numpy()
    return col


def one_output_per_input(X: np.ndarray, Z: np.ndarray) -> np.ndarray:
    """`Z` (one row per row of `X`) with every repeated input given its first occurrence's output. A probe is a
    function of its input, but a matrix product can round identical rows differently by their place in the
    batch; a prompt position shared by the answers of one prompt must score the same for each (a tie)."""
    Z = Z.copy()
    first: dict[bytes, int] = {}
    for i in range(len(X)):
        Z[i] = Z[first.setdefault(X[i].tobytes(), i)]
    return Z


def probe_rows(col: Collected, cfg: EntitleReadConfig, contrasts: Sequence[Contrast] = CONTRASTS) -> list[dict]:
    """Per contrast, out-of-fold probe margins (logit of the honest label − logit of the other) trained on that
    contrast's answers, folds grouped by task; a contrast with one task or one label gets none."""
    import pandas as pd

    out: list[dict] = []
    ex_all = pd.DataFrame(col.examples)
    for c in contrasts:
        ex = members(ex_all, c)
        for name in POSITIONS:
            have = ex[ex["id"].isin(list(col.feats[name]))]
            y = (have["label"] == c.negative).to_numpy(int)
            groups = have["task"].astype(str).tolist()
            if len(set(groups)) < 2 or len(set(y)) < 2:
                continue
            X = np.stack([col.feats[name][i] for i in have["id"]])  # [n, L, d]
            for layer in range(X.shape[1]):
                try:
                    Z = one_output_per_input(X[:, layer, :], out_of_fold_logits(
                        X[:, layer, :], y, groups, n_splits=cfg.probe_folds, seed=cfg.seed))
                except LensError as exc:
                    log.warning("probe, %s at layer %d, %s: %s", c.name, layer, name, exc)
                    continue
                for e, zrow in zip(have.itertuples(), Z, strict=True):
                    m_e = float(zrow[1] - zrow[0]) if np.isfinite(zrow).all() else float("nan")
                    out.append({"id": e.id, "fact": e.fact, "task": e.task, "files": e.files,
                                "pressure": e.pressure, "label": e.label, "readout": PROBE, "contrast": c.name,
                                "layer": layer, "position": name, "m_E": m_e})
    return out


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def headline(table: list[dict], contrast: Contrast, readout: str, position: str) -> dict[str, Any]:
    """The band cell of `readout` at `position` in `contrast`, in the shape `--json` prints (None where empty)."""
    t = next((r for r in table if (r["contrast"], r["readout"], r["position"], r["layer"]) ==
              (contrast.name, readout, position, -1)), None) or {}
    return {"readout": readout, "position": position, "cell": contrast.cell, "contrast": contrast.name,
            "layers": "band mean", "n_pairs": int(t.get("n_pairs", 0)), "auroc": _num(t.get("auroc")),
            "ci": [_num(t.get("lo")), _num(t.get("hi"))], "recall_at_1pct_fpr": _num(t.get("recall_at_1pct_fpr")),
            "fpr_held_out": _num(t.get("fpr_held_out")), "n_detected": int(t.get("n_detected", 0)),
            "n_pos_scored": int(t.get("n_pos_scored", 0)), "n_strata": int(t.get("n_strata", 0)),
            "n_tasks": int(t.get("n_tasks", 0))}


def answer_controlled(col: Collected, band: Sequence[int], contrast: Contrast, readout: str,
                      n_boot: int, seed: int) -> dict[str, Any]:
    """`readout`'s band-mean AUROC at `elicit` in `contrast` among the answers whose stated margin is positive
    (the model, asked both ways, says its figure is in the files): the case an internal reading must catch alone."""
    import pandas as pd

    from lhd_train.reading.entitle_scores import cell_score

    ex = members(pd.DataFrame(col.examples), contrast)
    ex = ex[ex[STATED].notna() & (ex[STATED].astype(float) > 0)] if STATED in ex else ex.iloc[:0]
    m = pd.DataFrame(col.rows)
    m = m[(m["readout"] == readout) & (m["position"] == "elicit") & m["layer"].isin(list(band))
          & m["id"].isin(ex["id"])].groupby("id", as_index=False)["m_E"].mean()
    g = ex.merge(m, on="id")
    cell = cell_score(contrast, readout, "elicit", -1, -g["m_E"].to_numpy(float), g, n_boot, seed)
    return {**{k: _num(v) if isinstance(v, float) else v for k, v in cell.items()},
            "among": "answers the model says are in the files (stated > 0, asked both ways)",
            "n_stated_yes": {lab: int((ex["label"] == lab).sum()) for lab in (contrast.positive, contrast.negative)}}


def _check(cfg: EntitleReadConfig, names: list[str], answer_sets: AnswerSets | None) -> Contrast:
    """The primary cell's contrast; an InputError naming the option when the declared cell cannot be read."""
    allowed = names + list(CONTROLS) + [TEXT] + ([STATED, STATED_DIRECT] if answer_sets else [])
    if cfg.primary_readout not in allowed:
        raise InputError("command line", "--primary", f"readout {cfg.primary_readout!r} is not read",
                         ", ".join(allowed) + " (pass the lens a readout needs)")
    if cfg.primary_position not in (*POSITIONS, TEXT_POSITION):
        raise InputError("command line", "--primary", f"position {cfg.primary_position!r}", ", ".join(POSITIONS))
    if cfg.primary_readout in (STATED, STATED_DIRECT) and cfg.primary_position != "elicit":
        raise InputError("command line", "--primary", f"{cfg.primary_readout} is read at elicit only",
                         f"{cfg.primary_readout}:elicit")
    try:
        return contrast_of_cell(cfg.primary_cell)
    except ValueError:
        raise InputError("command line", "--primary-cell", f"{cfg.primary_cell!r}", ", ".join(PRIMARY_CELLS)) from None


def read_entitle(model: LensModel, tokenizer: Any, answers: Sequence[AnswerToRead], readouts: Sequence[Readout],
                 sets: TokenSets, out_dir: str | Path, cfg: EntitleReadConfig | None = None,
                 info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Declare the plan, read the answers the contrasts take, write the files of the module doc into `out_dir`;
    returns the summary (`primary` first)."""
    import pandas as pd

    cfg = cfg or EntitleReadConfig()
    out = Path(out_dir)
    names = [ro.name for ro in readouts] + ([PROBE] if cfg.probe else [])
    answer_sets, no_stated = stated_sets(tokenizer, sets)
    primary_contrast = _check(cfg, names, answer_sets)
    try:
        chosen = select_answers(answers, cfg.max_answers)
    except ValueError as exc:
        raise InputError("answers", "id", str(exc)) from None
    lo, hi = band_layers(model.n_layers, cfg.band)
    band = list(range(lo, hi + 1))
    plan = declare_plan(out, {
        "primary": {"readout": cfg.primary_readout, "position": cfg.primary_position, "cell": primary_contrast.cell,
                    "contrast": primary_contrast.name, "layers": "band mean"},
        "contrasts": [c.to_json() for c in CONTRASTS], "score": "-m_E (low entitlement = suspicious)",
        "negative_control": f"{NEGATIVE_CONTROL}: one state per prompt, so every within-cell pair ties (0.5)",
        "band": list(cfg.band), "band_layers": band, "readouts": names, "token_sets": sets.to_json(),
        "token_sets_at_elicit": "the token sets without the Yes and No tokens of `stated`",
        "elicitation": elicitation("<attribute>", "<entity>"),
        "reversed_elicitation": reversed_elicitation("<attribute>", "<entity>"),
        "stated": answer_sets.to_json() if answer_sets else f"not read: {no_stated}",
        "answers": [a.id for a in chosen], "declared_at": utc_now(), **(info or {})})
    col = collect(model, tokenizer, chosen, readouts, sets, cfg, answer_sets) if chosen else Collected()
    if cfg.probe and col.examples:
        col.rows += probe_rows(col, cfg)
    columns = ["id", "fact", "task", "files", "pressure", "label", "readout", "contrast", "layer", "position",
               *MARGIN_NAMES]
    mdf = pd.DataFrame(col.rows, columns=columns)
    edf = pd.DataFrame(col.examples)
    tdf = pd.concat([text_scores(edf, c, cfg.seed) for c in CONTRASTS]) if len(edf) else pd.DataFrame()
    table = score_table(mdf, edf, tdf, band, cfg.n_boot, cfg.seed) if len(edf) else []
    write_csv(mdf, out / "margins.csv")
    write_csv(edf, out / "examples.csv")
    write_csv(tdf, out / "text.csv")
    write_csv(pd.DataFrame(table), out / "auroc.csv")
    summary: dict[str, Any] = {
        "primary": headline(table, primary_contrast, cfg.primary_readout, cfg.primary_position),
        "negative_control": {**headline(table, primary_contrast, cfg.primary_readout, NEGATIVE_CONTROL),
                             "expected": "exactly 0.5 (the same state for every answer of a prompt)"},
        "within_cell": [headline(table, c, cfg.primary_readout, cfg.primary_position) for c in WITHIN_CELL],
        "text_baseline": [headline(table, c, TEXT, TEXT_POSITION) for c in CONTRASTS],
        "stated": [headline(table, c, STATED, "elicit") for c in CONTRASTS],
        "evidence_detection": {
            **headline(table, EVIDENCE_DETECTION, cfg.primary_readout, cfg.primary_position),
            "length_at_decision": headline(table, EVIDENCE_DETECTION, "length", NEGATIVE_CONTROL),
            "note": "fabricated answers come from deleted cells and supported ones from full/altered cells, so this "
                    "reads whether the evidence line is in the context; the length control at decision is 1.0 by "
                    "construction (the deleted context is shorter), a yardstick, not a bound"},
        "answer_controlled": answer_controlled(col, band, primary_contrast, cfg.primary_readout, cfg.n_boot,
                                               cfg.seed) if col.examples and cfg.primary_readout in names else None,
        "n_answers": len(col.examples), "n_facts": len({e["fact"] for e in col.examples}),
        "counts": _counts(edf), "retokenized": int(sum(e["retokenized"] for e in col.examples)),
        "skipped": col.skipped, "config": asdict(cfg),
        "plan": {"file": str(out / "plan.json"), "sha256": plan["sha256"], "declared_at": plan["declared_at"]}}
    if not col.examples:
        summary["note"] = "no answer of any contrast's labels: nothing to compare"
    summary = finite(summary)  # JSON has no NaN
    atomic_write_text(out / "summary.json", json_text(summary, indent=2) + "\n")
    atomic_write_text(out / "read.md", markdown(summary, table, plan))
    return summary


def _counts(edf: Any) -> dict[str, dict[str, int]]:
    """Per contrast: answers of each label and strata that hold both (the strata that give pairs)."""
    out = {}
    for c in CONTRASTS:
        ex = members(edf, c) if len(edf) else None
        if ex is None or ex.empty:
            out[c.name] = {c.positive: 0, c.negative: 0, "strata_with_both": 0}
            continue
        both = ex.groupby("stratum")["positive"].nunique()
        out[c.name] = {c.positive: int(ex["positive"].sum()), c.negative: int((~ex["positive"]).sum()),
                       "strata_with_both": int((both == 2).sum())}
    return out


def _f(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def _line(h: dict[str, Any]) -> str:
    return (f"AUROC {_f(h['auroc'])} [{_f(h['ci'][0])}, {_f(h['ci'][1])}], recall at 1% FPR "
            f"{_f(h['recall_at_1pct_fpr'])} ({h['n_detected']}/{h['n_pos_scored']}); {h['n_pairs']} pairs in "
            f"{h['n_strata']} strata, {h['n_tasks']} tasks")


def markdown(summary: dict[str, Any], table: list[dict], plan: dict[str, Any]) -> str:
    """read.md: the declared primary cell first, the negative control, then every band cell (exploratory)."""
    p, nc, ev = summary["primary"], summary["negative_control"], summary["evidence_detection"]
    lines = ["# Entitlement margins at the model's own answers, within a cell", "",
             f"{summary['n_answers']} answers of {summary['n_facts']} facts; {summary['retokenized']} re-tokenised "
             f"(no stored token ids); {len(summary['skipped'])} skipped. Per contrast: {summary['counts']}.", "",
             f"Declared before reading ({plan['declared_at']}, plan sha256 {plan['sha256'][:12]}): primary cell "
             f"{p['readout']} at {p['position']}, {p['contrast']} in {p['cell']}, band layers "
             f"{plan['band_layers'][0]}-{plan['band_layers'][-1]}.", "",
             f"**Primary ({p['contrast']}, {p['cell']}): {_line(p)}**", "",
             f"Negative control ({nc['readout']} at {nc['position']}, same cell; exactly 0.5 expected): {_line(nc)}",
             "", f"Evidence detection (secondary: fabricated vs supported within a fact, across cells): {_line(ev)}; "
             f"the length control at decision reads {_f(ev['length_at_decision']['auroc'])}, 1.0 by construction.",
             ""]
    ac = summary.get("answer_controlled")
    if ac:
        lines += [f"Answer-controlled ({ac['readout']} at elicit, among {ac['among']}; {ac['n_stated_yes']}): "
                  f"AUROC {_f(ac['auroc'])} over {ac['n_pairs']} pairs", ""]
    lines += ["| contrast | readout | position | AUROC within strata [95% CI] | recall @1% FPR | pairs | strata |",
              "|---|---|---|---|---|---|---|"]
    for t in table:
        if t["layer"] == -1:
            lines.append(f"| {t['contrast']} | {t['readout']} | {t['position']} | {_f(t['auroc'])} "
                         f"[{_f(t['lo'])}, {_f(t['hi'])}] | {_f(t['recall_at_1pct_fpr'])} | {t['n_pairs']} | "
                         f"{t['n_strata']} |")
    declared = {(p["contrast"], p["readout"], p["position"]), (nc["contrast"], nc["readout"], nc["position"])}
    explore = [t for t in table if t["layer"] != -1 or (t["contrast"], t["readout"], t["position"]) not in declared]
    lines += ["", "Cells other than the primary one and its negative control are exploratory, over the band and per "
              "layer (auroc.csv). " + exploratory_note([t["lo"] for t in explore], [t["hi"] for t in explore]) + " "
              "`decision` and `question` read one state per prompt: within a cell they tie. `length` and `echo` are "
              "confound controls; `text` is a bag-of-words reader of the answer, trained leave-one-task-out; "
              "`stated` is the model's own Yes - No at `elicit` minus the same after the reversed question. "
              "Per-layer cells: auroc.csv.", ""]
    return "\n".join(lines)
