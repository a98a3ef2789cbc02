"""Reading entitlement margins per layer × position for every example (`lhd lens read`).

One forward per example captures every block output at the tagged positions; each readout (logit
lens, Jacobian lens, its random-transport control `jacobian_random`, ...) turns them into logits
over S ∪ N ∪ R, from which the margins follow; the linear probe is trained per (layer, position
class) with grouped folds. Everything lands in `margins.parquet`, summarised by `reading.tables` and
`reading.report`. Probe sets and benchmark runs (with an elicitation turn) are the two sources; the
primary cell is declared in plan.json first (`reading.preregister`). docs/lens.md gives the design."""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from lens.elicit import AnswerSets, resolve_answer_sets
from lens.errors import LensError
from lens.margins import MARGIN_NAMES, TokenSets, margins
from lens.model import LensModel, block_outputs
from lens.positions import ANCHORS, POSITION_CLASSES, ReadExample, render_chat, tag_chat_prompt
from lens.readout import BASELINE, PRIMARY, Lenses, Readout, build_readouts
from lens.readout_probe import PROBE, out_of_fold_logits
from lens.stats import band_layers
from lhd_train.bench.taskpack import TaskPack
from lhd_train.config.lens import ReadSettings
from lhd_train.reading import preregister
from lhd_train.reading.runs import load_run_examples
from lhd_train.reading.tables import Primary

log = logging.getLogger(__name__)

ECHO_SETS = ("S", "N", "R", "yes", "no")


def primary_cell(cfg: ReadSettings, mode: str) -> Primary:
    """The declared primary cell of a read in `mode` (run: a score; probes: a claim-kind contrast)."""
    metric = cfg.primary_metric if mode == "run" else cfg.primary_contrast
    return Primary(metric, cfg.primary_readout, cfg.primary_anchor, cfg.band)


@dataclass
class Collected:
    rows: list[dict] = field(default_factory=list)  # long margins table
    examples: list[dict] = field(default_factory=list)  # one per read example
    features: dict[str, list[np.ndarray]] = field(default_factory=dict)  # class -> [L, d] per example
    feature_ids: list[str] = field(default_factory=list)
    anchor_info: dict[str, dict[str, dict]] = field(default_factory=dict)  # example -> class -> control, echo
    skipped: list[dict] = field(default_factory=list)


def _answer_sets(tokenizer: Any, token_sets: TokenSets) -> AnswerSets:
    """Yes / No with the same single-token rule as the S / N / R sets (`--token-fallback`)."""
    return resolve_answer_sets(tokenizer, fallback="first-token" if token_sets.mode == "first-token" else "strict")


def _echo_counts(ids: Sequence[int], sets: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Per set, the running count of its tokens in `ids` (entry p: tokens 0..p, what position p sees)."""
    arr = np.asarray(ids)
    return {name: np.cumsum(np.isin(arr, np.asarray(toks, dtype=arr.dtype))) for name, toks in sets.items()}


def collect(
    model: LensModel,
    tokenizer: Any,
    examples: Sequence[ReadExample],
    readouts: Sequence[Readout],
    token_sets: TokenSets,
    cfg: ReadSettings,
    answer_sets: AnswerSets | None = None,
) -> Collected:
    """Margins of every readout at every layer and tagged position, the stated Yes−No margin, the
    echo covariate, and anchor hidden states for the probe."""
    union = torch.tensor(token_sets.union(), dtype=torch.long, device=model.device)
    sets = token_sets.index_sets()
    answer_sets = answer_sets or _answer_sets(tokenizer, token_sets)
    yes_no = torch.tensor(answer_sets.yes + answer_sets.no, dtype=torch.long, device=model.device)
    n_yes = len(answer_sets.yes)
    echo_sets = {"S": token_sets.S, "N": token_sets.N, "R": token_sets.R, "yes": answer_sets.yes,
                 "no": answer_sets.no}
    L = model.n_layers
    out = Collected(features={c: [] for c in POSITION_CLASSES})
    for ex in tqdm(examples, desc="read", unit="example", disable=not cfg.progress, dynamic_ncols=True):
        try:
            tag = tag_chat_prompt(tokenizer, ex.messages, ex.spans, prefill=ex.prefill,
                                  answer_tokens=cfg.answer_tokens, claims=ex.claims, judged=ex.judged)
        except LensError as exc:
            out.skipped.append({"example_id": ex.example_id, "reason": str(exc)})
            log.warning("%s skipped: %s", ex.example_id, exc)
            continue
        if tag.n_prompt > cfg.max_length:
            out.skipped.append({"example_id": ex.example_id, "reason": f"{tag.n_prompt} prompt tokens > max_length"})
            log.warning("%s skipped: %d prompt tokens > max_length %d", ex.example_id, tag.n_prompt, cfg.max_length)
            continue
        n_tok = tag.n_prompt
        acts = block_outputs(model, torch.tensor(tag.input_ids, device=model.device)[None])
        points = list(tag.positions)
        names = points + list(tag.pooled)
        idx = torch.tensor([tag.positions[n] for n in points], device=model.device)
        H = torch.stack([torch.cat([acts[layer][0, idx]] + [acts[layer][0, toks].mean(0, keepdim=True)
                                                              for toks in tag.pooled.values()])
                         for layer in range(L)])  # [L, P, d]
        token_index = {**tag.positions, **{n: toks[-1] for n, toks in tag.pooled.items()}}
        echo = _echo_counts(tag.input_ids, echo_sets)
        dec = names.index("decision")
        base = {"example_id": ex.example_id, "cluster": ex.cluster, "stratum": ex.stratum, "label": ex.label}
        final = {}
        for ro in readouts:
            layers = [layer for layer in range(L) if ro.has_layer(layer)]
            with torch.no_grad():
                z = torch.stack([ro.logits(layer, H[layer], token_ids=union) for layer in layers])  # [L', P, U]
            m = {k: v.cpu().numpy() for k, v in margins(z, sets).items()}
            for j, layer in enumerate(layers):
                for p, name in enumerate(names):
                    t = token_index[name]
                    rows = {"readout": ro.name, "layer": layer, "position": name, "position_class": tag.classes[name],
                            "is_anchor": ANCHORS[tag.classes[name]] == name, "token_index": t,
                            "control": not tag.sees_judged(name),
                            "echo_S": int(echo["S"][t]), "echo_N": int(echo["N"][t]), "echo_R": int(echo["R"][t])}
                    rows.update({k: float(m[k][j, p]) for k in MARGIN_NAMES})
                    out.rows.append({**base, **rows})
            final[ro.name] = float(m["m_E"][-1, dec])  # the last block is always readable
        # The model's own answer to the elicitation (run mode; in probe sets the verdict prompt):
        # Yes − No of its logits at the decision position (the last block's readout is its logits).
        with torch.no_grad():
            yn = model.unembed(H[L - 1, dec:dec + 1], yes_no).float()[0]
        stated_yes_no = float(torch.logsumexp(yn[:n_yes], 0) - torch.logsumexp(yn[n_yes:], 0))
        last = n_tok - 1
        out.examples.append({**base, "n_tokens": n_tok, "n_prompt_tokens": tag.n_prompt,
                             "stated_yes_no": stated_yes_no, "n_claims": len(tag.claims),
                             **{f"echo_{k}": int(echo[k][last]) for k in ECHO_SETS},
                             **{f"final_m_E_{k}": v for k, v in final.items()}, **ex.info})
        info = {}
        for c in POSITION_CLASSES:
            a = ANCHORS[c]
            out.features[c].append(H[:, names.index(a)].float().cpu().numpy())
            t = token_index[a]
            info[c] = {"control": not tag.sees_judged(a), "token_index": t, "echo_S": int(echo["S"][t]),
                       "echo_N": int(echo["N"][t]), "echo_R": int(echo["R"][t])}
        out.anchor_info[ex.example_id] = info
        out.feature_ids.append(ex.example_id)
    if not out.examples:
        raise LensError("no example could be read (see the warnings above)")
    return out


def probe_rows(col: Collected, classes: Sequence[Any], set_of_class: dict[str, Sequence[Any]],
               cfg: ReadSettings) -> list[dict]:
    """Out-of-fold linear-probe margins at the anchor of each position class, for every layer.

    `classes` are the label values in the order of the probe's logit columns; `set_of_class`
    maps S/N/R to the label values whose logits form each set.
    """
    ex = {e["example_id"]: e for e in col.examples}
    labels = np.array([ex[i]["label"] for i in col.feature_ids], dtype=object)
    groups = np.array([ex[i]["cluster"] for i in col.feature_ids], dtype=object)
    known = np.array([lab is not None and lab in classes for lab in labels])
    present = [c for c in classes if (labels[known] == c).any()]
    if known.sum() < 4 or len(present) < 2 or len(np.unique(groups[known])) < 2:
        log.warning("linear probe skipped: needs ≥ 4 labelled examples, 2 classes and 2 records")
        return []
    y = np.array([present.index(v) for v in labels[known]])
    idx_sets = {k: [present.index(c) for c in v if c in present] for k, v in set_of_class.items()}
    rows = []
    for cls in POSITION_CLASSES:
        feats = np.stack(col.features[cls])  # [n, L, d]
        for layer in range(feats.shape[1]):
            X = feats[known, layer, :]
            try:
                Z = out_of_fold_logits(X, y, groups[known], n_splits=cfg.probe_folds, C=cfg.probe_c, seed=cfg.seed)
            except LensError as exc:
                log.warning("probe at layer %d, %s: %s", layer, cls, exc)
                continue
            m = {k: v.numpy() for k, v in margins(torch.from_numpy(Z), idx_sets).items()}
            for j, i in enumerate(np.flatnonzero(known)):
                e = ex[col.feature_ids[i]]
                rows.append({"example_id": e["example_id"], "cluster": e["cluster"], "stratum": e["stratum"],
                             "label": e["label"], "readout": PROBE, "layer": layer, "position": ANCHORS[cls],
                             "position_class": cls, "is_anchor": True, **col.anchor_info[e["example_id"]][cls],
                             **{k: float(m[k][j]) for k in MARGIN_NAMES}})
    return rows


# ---------------------------------------------------------------------------------------------
# the two reading modes
# ---------------------------------------------------------------------------------------------


def _readouts(model: LensModel, fitted: Mapping[str, Any], cfg: ReadSettings) -> list[Readout]:
    """Every registered readout the fitted artifacts allow (`lens.readout`): the logit lens, the J-lens and its
    control, and each other readout whose artifact is given."""
    return list(build_readouts(model, Lenses(fitted, control=cfg.random_control, control_seed=cfg.seed)).values())


#: what a plan records of each fitted artifact (the fields its record has)
FITTED_INFO = ("format", "model_id", "revision", "target_layer", "layers", "n_prompts", "n_tokens", "skip_first",
               "max_length", "sha256", "file")


def _fitted_info(fitted: Mapping[str, Any]) -> dict[str, dict]:
    """Per readout name, the identity of the artifact it reads (its checksum names the read)."""
    return {name: {k: v for k in FITTED_INFO if (v := getattr(getattr(art, "meta", None), k, None)) is not None}
            for name, art in fitted.items()}


def declare(mode: str, model: LensModel, fitted: Mapping[str, Any], cfg: ReadSettings, token_sets: TokenSets,
            out_dir: str | Path) -> dict:
    """The pre-registration (mode, primary cell, settings), written as plan.json before any forward
    (`preregister.declare`: a folder declaring another plan is refused); returned as the head of the summary."""
    lo, hi = band_layers(model.n_layers, cfg.band)
    settings = cfg.model_dump(exclude={"progress"})  # a progress bar changes no number
    head = {"mode": mode, "model": getattr(model, "name", None), "revision": getattr(model, "revision", None),
            "n_layers": model.n_layers, "fitted": _fitted_info(fitted),
            "token_sets": token_sets.to_json(),
            "primary": {**primary_cell(cfg, mode).to_json(), "band_layers": [lo, hi]}, "config": settings}
    return preregister.declare(out_dir, head)


def _report(out_dir: str | Path, mode: str, col: Collected, edf: Any, scored: list, head: dict, baselines: list,
            cfg: ReadSettings, *, title: str, notes: list[str], n_layers: int) -> dict:
    """Tables, the primary row, layer choices; every output file (`lhd_train.reading.report.write_outputs`)."""
    import pandas as pd

    from lhd_train.reading import report, tables

    mdf = pd.DataFrame(col.rows)
    table = tables.build_table(scored, n_layers=n_layers, band=cfg.band, n_boot=cfg.bootstrap, seed=cfg.seed)
    primary = tables.mark_primary(table, primary_cell(cfg, mode))
    choice = tables.layer_choice(scored, table, headline="auroc_within", threshold=cfg.emergence_threshold)
    base = pd.DataFrame(baselines)
    summary = {**head, "n_examples": len(edf), "skipped": col.skipped, "primary_result": primary,
               "baselines": base.to_dict(orient="records"), "layer_choice": choice.to_dict(orient="records"),
               "stage": "done"}
    summary["files"] = report.write_outputs(Path(out_dir), mdf, edf, table, choice, base, summary, title=title,
                                            notes=notes)
    return summary


def _read(model: LensModel, tokenizer: Any, fitted: Mapping[str, Any], examples: Sequence[ReadExample],
          token_sets: TokenSets, head: dict, cfg: ReadSettings, probe_classes: Sequence[Any],
          probe_sets: dict[str, Sequence[Any]]) -> tuple[Collected, list[Readout]]:
    """Every example through every readout (`collect`), then the probe out of fold; the answer sets go into
    the declared `head`."""
    answer_sets = _answer_sets(tokenizer, token_sets)
    head["answer_sets"] = answer_sets.to_json()
    readouts = _readouts(model, fitted, cfg)
    col = collect(model, tokenizer, examples, readouts, token_sets, cfg, answer_sets)
    if cfg.probe:
        col.rows += probe_rows(col, probe_classes, probe_sets, cfg)
    return col, readouts


def read_probe_set(model: LensModel, tokenizer: Any, fitted: Mapping[str, Any] | None, probes: Sequence[dict],
                   token_sets: TokenSets, out_dir: str | Path, cfg: ReadSettings | None = None) -> dict:
    """Margins, AUROC tables (one per claim kind), layer choice and heatmap for an entitlement probe set;
    `fitted`: each readout's artifact by readout name (`lens.readout.load_fitted`; none: the logit lens)."""
    from lhd_train.reading import tables
    from lhd_train.reading.probes import LABELS, NOT_ENTITLED, REFUTED, SUPPORTED, render_probe

    cfg = cfg or ReadSettings()
    fitted = fitted or {}
    lens = fitted.get(PRIMARY)
    head = declare("probes", model, fitted, cfg, token_sets, out_dir)
    examples = []
    for row in probes:
        messages, spans, prefill = render_probe(row)
        examples.append(ReadExample(row["id"], row["record_id"], row["label"], messages, spans, prefill=prefill,
                                    info={"pair_id": row.get("pair_id"), "claim_kind": row.get("claim_kind"),
                                          "record_variant": row.get("record_variant")},
                                    stratum=row["record_id"], judged="claim"))
    col, readouts = _read(model, tokenizer, fitted, examples, token_sets, head, cfg, list(LABELS),
                          {"S": [SUPPORTED], "N": [NOT_ENTITLED], "R": [REFUTED]})
    import pandas as pd

    edf = pd.DataFrame(col.examples)
    edf["stated"] = edf[f"final_m_E_{BASELINE}"]  # the model's own S−N margin at the decision position (last block)
    scored = tables.probe_scores(pd.DataFrame(col.rows), edf)
    baselines = []
    for positive, what in (("stated", "stated vs evidence_deleted"),
                           ("stated_other_deleted", "stated, another line deleted vs evidence_deleted")):
        pair = edf[edf["claim_kind"].isin([positive, "evidence_deleted"])]
        y, cl = pair["claim_kind"] == positive, pair["cluster"].astype(str)
        if y.nunique() == 2:
            baselines += [tables.baseline_row("length", f"prompt tokens ({what})", pair["n_tokens"], y, cl,
                                              pair["stratum"], n_boot=cfg.bootstrap, seed=cfg.seed),
                          tables.baseline_row("echo S−N", f"S minus N tokens in the context at the decision ({what})",
                                              pair["echo_S"] - pair["echo_N"], y, cl, pair["stratum"],
                                              n_boot=cfg.bootstrap, seed=cfg.seed)]
    # every readout is the model's own logits at the last block: a nonzero gap is a bug, not a finding
    checks = {f"final_layer_{name}_minus_{BASELINE}_max_abs":
              float((edf[f"final_m_E_{name}"] - edf[f"final_m_E_{BASELINE}"]).abs().max())
              for name in (ro.name for ro in readouts) if name != BASELINE}
    head.update(labels=edf["label"].value_counts().to_dict(),
                claim_kinds=edf["claim_kind"].value_counts().to_dict(), checks=checks)
    notes = [f"model {head['model']}, {model.n_layers} blocks; lens: "
             f"{'none' if lens is None else (lens.meta.format, lens.meta.n_prompts)}; readouts: "
             f"{', '.join(ro.name for ro in readouts)}",
             f"{len(edf)} examples, claim kinds {head['claim_kinds']}; clusters = strata = records (task files)",
             "layout: claim, then files, then question; each claim kind is its own table (never pooled)",
             f"token sets: |S|={len(token_sets.S)} |N|={len(token_sets.N)} |R|={len(token_sets.R)} ({token_sets.mode})"]
    return _report(out_dir, "probes", col, edf, scored, head, baselines, cfg, title="Entitlement margins (probe set)",
                   notes=notes, n_layers=model.n_layers)


def read_run(model: LensModel, tokenizer: Any, fitted: Mapping[str, Any] | None, run_dir: str | Path,
             token_sets: TokenSets, out_dir: str | Path, cfg: ReadSettings | None = None, *, context: str = "full",
             auditor: str | None = None, pack: TaskPack | None = None) -> dict:
    """Margins of the performer's own rounds (answer, then the elicitation) and AUROCs against the audit
    flags, within tasks and pooled. The run is read by `lhd_train.reading.runs.load_run_examples` (lhd's Run API; a
    damaged run is lhd's own error)."""
    import pandas as pd

    from lens.positions import QUESTION, RECORD
    from lhd_train.reading import tables

    cfg = cfg or ReadSettings()
    if cfg.primary_anchor in (ANCHORS[RECORD], ANCHORS[QUESTION]):
        raise LensError(f"primary anchor {cfg.primary_anchor!r} comes before the answer in run mode: it is a "
                        f"negative control and cannot be the primary cell (use {ANCHORS['decision']!r})")
    fitted = fitted or {}
    head = declare("run", model, fitted, cfg, token_sets, out_dir)

    def count_tokens(messages: list[dict]) -> int:
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    examples, info = load_run_examples(run_dir, context=context, auditor=auditor, pack=pack,
                                       count_tokens=count_tokens, max_length=cfg.max_length,
                                       max_claims=cfg.max_claims)
    if not examples:
        raise LensError(f"{run_dir}: no readable round")
    # the probe is a supervised baseline here: it predicts the flag itself (classes honest/flagged), grouped by
    # trial; m_E = logit(honest) − logit(flagged), so −m_E is a suspicion score like the lenses'
    col, _ = _read(model, tokenizer, fitted, examples, token_sets, head, cfg, [False, True],
                   {"S": [False], "N": [True], "R": []})
    col.skipped = info.pop("skipped") + col.skipped
    edf = pd.DataFrame(col.examples)
    edf["stated"] = edf["stated_yes_no"]
    scored = tables.run_scores(pd.DataFrame(col.rows), edf, model.n_layers)
    baselines = _run_baselines(edf, cfg)
    head["run"] = info
    stated_yes = int((edf["stated"] > 0).sum())
    ablation = (" (an ablation: no earlier answers; record and round-1 question are the same in every trial of "
                "a task)") if context == "compact" else ""
    notes = [f"run {info['run_dir']}: {info['n_examples']} rounds read, {info['n_labelled']} audited, "
             f"{info['n_flagged']} flagged (auditors: {', '.join(info['auditors']) or 'none'}); clusters = trials, "
             "strata = tasks",
             f"context: {context}{ablation}; "
             f"task texts: {info.get('tasks_source')}",
             f"elicitation after the answer: {info['elicitation']!r}; stated = the model's own Yes−No margin at "
             f"its last token (Yes in {stated_yes} of {len(edf)} rounds); internal = the lens margins there",
             "scores: higher = more suspicious (internal: −m_E; gap: z(stated) − z(m_E), z per layer over all "
             "rounds, label-free; 'within stated-supported': only rounds whose stated Yes−No > 0)",
             "headline AUROC = within task (pairs of rounds of the same task), pooled beside it"]
    return _report(out_dir, "run", col, edf, scored, head, baselines, cfg,
                   title="Entitlement margins (benchmark run)", notes=notes, n_layers=model.n_layers)


def _run_baselines(edf: Any, cfg: ReadSettings) -> list[dict]:
    """Non-lens scores against the flag: length, the task alone (out of fold), the lexical echo."""
    from lhd_train.reading import tables

    lab = edf[edf["label"].notna()]
    if lab.empty or lab["label"].nunique() < 2:
        return []
    y = lab["label"].astype(bool).to_numpy()
    cl, st = lab["cluster"].astype(str).to_numpy(), lab["stratum"].astype(str).to_numpy()
    task_rate = tables.out_of_fold_rate(y, st, cl, n_splits=cfg.probe_folds)
    kw = {"n_boot": cfg.bootstrap, "seed": cfg.seed}
    return [tables.baseline_row("length", "prompt tokens", lab["n_tokens"], y, cl, st, **kw),
            tables.baseline_row("task only", "the task's flag rate on the other trials (out of fold)", task_rate,
                                y, cl, st, **kw),
            tables.baseline_row("echo N−S", "N minus S tokens in the context at the decision",
                                lab["echo_N"] - lab["echo_S"], y, cl, st, **kw),
            tables.baseline_row("echo all", "S, N, R, Yes and No tokens in the context at the decision",
                                lab[[f"echo_{k}" for k in ECHO_SETS]].sum(axis=1), y, cl, st, **kw)]
