"""Files of `lhd lens eval`: pass@k and the causal check on prompt sets (`passk.json`,
`passk_ranks.jsonl`, `passk_split.csv`, `causal.json`, `quality.md`), and next-token KL on held-out text beside its
baselines (`eval.json`, `eval.md`, `fidelity.png`)."""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lens.files import atomic_write, atomic_write_text, write_csv, write_json
from lens.passk import KS, PROMPT_ECHO
from lens.readout import BASELINE, PRIMARY, READOUTS


def _f(x: Any, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


# ---------------------------------------------------------------------------------------------
# prompt sets: pass@k and the causal check
# ---------------------------------------------------------------------------------------------


def _with_ci(x: Any, ci: Any, spec: str = ".3f") -> str:
    return _f(x, spec) + (f" [{_f(ci[0], spec)}, {_f(ci[1], spec)}]" if ci else "")


def _ordered_readouts(names: Any) -> list[str]:
    return [r for r in READOUTS if r in names] + [r for r in names if r not in READOUTS]


def split_rows(passk: dict[str, Any]) -> list[dict[str, Any]]:
    """passk_split.csv: one row per (set, kind, prompt subset, readout) of every set's `split`, with pass@k, AUC and
    the AUC differences paired by item against the logit lens and the J-lens, each with its interval."""
    out = []
    for name, entry in passk.items():
        for sub in entry.get("split", []):
            for r in _ordered_readouts(sub.get("passk", {})):
                row: dict[str, Any] = {"set": name, "kind": sub["kind"], "prompt": sub["prompt"], "readout": r,
                                       "n_items": sub["n"], "n_intermediates": sub["n_intermediates"]}
                for k in KS:
                    ci = sub["ci"][r][str(k)] or [None, None]
                    row.update({f"pass@{k}": sub["passk"][r][str(k)], f"pass@{k}_lo": ci[0], f"pass@{k}_hi": ci[1]})
                auc_ci = sub["auc"][r]["ci"] or [None, None]
                row.update(auc=sub["auc"][r]["value"], auc_lo=auc_ci[0], auc_hi=auc_ci[1])
                for ref in (BASELINE, PRIMARY):
                    d = sub["auc_diff"].get(f"{r} - {ref}") or {}
                    dci = d.get("ci") or [None, None]
                    row.update({f"auc_minus_{ref}": d.get("value"), f"auc_minus_{ref}_lo": dci[0],
                                f"auc_minus_{ref}_hi": dci[1]})
                out.append(row)
    return out


def _split_lines(entry: dict[str, Any]) -> list[str]:
    """The split by intermediate kind and prompt presence, leaving out the subset that is the whole set."""
    subs = [s for s in entry.get("split", []) if s["n_intermediates"] != entry.get("n_intermediates")]
    if not subs:
        return []
    ip = entry.get("in_prompt", {})
    kinds = ", ".join(f"{k} {n} of {t}" for k, (n, t) in ip.get("by_kind", {}).items())
    lines = [f"By intermediate kind; `absent`: without the intermediates that have a scored form among the prompt's "
             f"tokens (in the prompt: {kinds}). `{PROMPT_ECHO}` ranks the prompt's own tokens, most recent first.", "",
             "| kind | prompt | items | intermediates | readout | pass@1 | pass@10 | pass@50 | AUC | AUC − logit "
             "(paired) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in subs:
        if not s.get("passk"):
            lines.append(f"| {s['kind']} | {s['prompt']} | 0 | 0 | – | – | – | – | – | – |")
            continue
        for r in _ordered_readouts(s["passk"]):
            d = s["auc_diff"].get(f"{r} - {BASELINE}")
            lines.append(f"| {s['kind']} | {s['prompt']} | {s['n']} | {s['n_intermediates']} | {r} | "
                         + " | ".join(_with_ci(s["passk"][r][str(k)], s["ci"][r][str(k)]) for k in (1, 10, 50))
                         + f" | {_with_ci(s['auc'][r]['value'], s['auc'][r]['ci'])} | "
                         + (_with_ci(d["value"], d.get("ci"), "+.3f") if d else "–") + " |")
    return lines + [""]


def passk_markdown(passk: dict[str, Any]) -> list[str]:
    lines = ["## Pass@k on the prompt sets", "",
             "An intermediate's score is its best rank over the lens's layers at the read position; pass@k is the "
             "mean over items of the share of its intermediates scored <= k; [95 % CI] from a bootstrap over items. "
             "AUC: area under pass@k against log k, k in [1, 1000], normalised to 1. "
             f"`{PROMPT_ECHO}` is a baseline that reads no activation: the prompt's distinct tokens, most recent "
             "first.", ""]
    for name, entry in passk.items():
        readouts = _ordered_readouts([r for r in entry.get("ci", {})])
        tf = entry.get("token_forms", {})
        lines += [f"### {name} ({entry['n']} items, {entry.get('n_intermediates')} intermediates, layers "
                  f"{entry.get('layers')}; {tf.get('n_fallback', 0)} intermediates without a single-token form, "
                  "scored by their first token)", "",
                  "| readout | " + " | ".join(f"pass@{k}" for k in KS) + " | AUC |",
                  "|---|" + "---|" * (len(KS) + 1)]
        for r in readouts:
            cells = []
            for k in KS:
                ci = entry.get("ci", {}).get(r, {}).get(str(k))
                cells.append(f"{_f(entry[r][str(k)])}" + (f" [{_f(ci[0])}, {_f(ci[1])}]" if ci else ""))
            auc = entry.get("auc", {}).get(r, {})
            aci = auc.get("ci")
            cells.append(f"{_f(auc.get('value'))}" + (f" [{_f(aci[0])}, {_f(aci[1])}]" if aci else ""))
            lines.append(f"| {r} | " + " | ".join(cells) + " |")
        lines.append("")
        if entry.get("auc_diff"):
            lines += ["AUC differences, paired by item [95 % CI]: "
                      + "; ".join(f"{k} {_f(d['value'], '+.3f')}"
                                  + (f" [{_f(d['ci'][0], '+.3f')}, {_f(d['ci'][1], '+.3f')}]" if d.get("ci") else "")
                                  for k, d in entry["auc_diff"].items()), ""]
        lines += _split_lines(entry)
    return lines


def causal_markdown(causal: dict[str, Any]) -> list[str]:
    lines = ["## Causal check: lens directions projected out at the read position", "",
             "Output KL(p_before ‖ p_after) of the final next-token distribution and the share of prompts whose "
             "top-1 changed, for each lens direction and for norm-matched random edits (same size, random "
             "direction); ΔKL CI: bootstrap over items.", "",
             "| set | layer | direction | n | KL | KL random | ΔKL [95% CI] | top-1 changed | random | answer rank "
             "worse |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, by_layer in causal.items():
        for layer, per in by_layer.items():
            for kind, e in per.items():
                ci = e.get("kl_diff_ci")
                lines.append(f"| {name} | {layer} | {kind} | {e['n']} | {_f(e['kl'])} | {_f(e['kl_random'])} | "
                             f"{_f(e['kl'] - e['kl_random'], '+.3f')}"
                             + (f" [{_f(ci[0], '+.3f')}, {_f(ci[1], '+.3f')}]" if ci else "")
                             + f" | {_f(e['top1_changed'])} | {_f(e['top1_changed_random'])} | "
                               f"{_f(e['answer_rank_worse'])} |")
    return lines + [""]


def write_prompt_set_outputs(out_dir: Path, passk: dict[str, Any], ranks: Sequence[dict[str, Any]],
                             causal: dict[str, Any] | None, causal_rows: Sequence[dict[str, Any]],
                             meta: dict[str, Any], *, title: str) -> dict[str, str]:
    """passk.json, passk_ranks.jsonl, passk_split.csv, causal.json (when run) and quality.md in `out_dir`."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"passk": str(out / "passk.json"), "ranks": str(out / "passk_ranks.jsonl"),
             "split": str(out / "passk_split.csv"), "quality": str(out / "quality.md")}
    write_json(out / "passk.json", passk)
    write_csv(pd.DataFrame(split_rows(passk)), out / "passk_split.csv")
    atomic_write_text(out / "passk_ranks.jsonl", "".join(json.dumps(r) + "\n" for r in ranks))
    md = [f"# {title}", "", *(f"- {k}: {v}" for k, v in meta.items()), "", *passk_markdown(passk)]
    if causal is not None:
        files["causal"] = str(out / "causal.json")
        write_json(out / "causal.json", {"summary": causal, "meta": meta, "rows": list(causal_rows)})
        md += causal_markdown(causal)
    atomic_write_text(out / "quality.md", "\n".join(md))
    return files


# ---------------------------------------------------------------------------------------------
# held-out text (lens.fidelity): KL beside its baselines, top-k, temperature
# ---------------------------------------------------------------------------------------------


def _below(rows: Sequence[dict], key: str, level: float | None) -> list[int]:
    if level is None:
        return []
    return [r["layer"] for r in rows if r.get(key) is not None and r[key] < level]


def fidelity_markdown(result: dict, *, title: str) -> str:
    """Two tables by layer: KL and top-1 of the baseline (logit lens) and the primary readout (J-lens) with the
    J − logit CI, and the halves; then the calibration-free view of every readout (top-k, KL on the evaluation
    half raw and after the fitted temperature)."""
    rows = result["layers"]
    model = result.get("model") or {}
    B, P = BASELINE, PRIMARY
    has_halves = any("halves_top1_agreement" in r for r in rows)
    uni, uni_eval, marg = model.get("kl_uniform"), model.get("kl_uniform_eval"), model.get("kl_marginal_eval")
    head = ["layer", "KL logit", "KL J", "ΔKL J−logit [95% CI]", "top-1 logit", "top-1 J", "Δtop-1 [95% CI]",
            "entropy logit / J", "top-1 = input token, logit / J"]
    if has_halves:
        head += ["KL J half A / B", "halves top-1 agree", "halves ‖A−B‖/‖mean‖", "halves corr (J−I)"]
    lines = [f"# {title}", "", f"{result['n_texts']} held-out texts, {result['n_positions']} positions; "
             "KL(p_model ‖ q_lens) in nats, top-k = share of positions where the model's top token is among the "
             "readout's top k; CIs: bootstrap over texts. The model's own entropy: "
             f"{_f(model.get('entropy'))} nats; its top-1 is the input token at {_f(model.get('current_token'))} of "
             "positions.", "",
             f"**Baselines.** A uniform predictor has KL = log V − H = {_f(uni)} nats here ({_f(uni_eval)} on the "
             f"evaluation half); the model's marginal next-token distribution (a constant, from the calibration "
             f"half) {_f(marg)} on the evaluation half. A KL above these is worse than knowing nothing about the "
             f"position: it is not evidence of fidelity. Layers with a KL below uniform: logit "
             f"{_below(rows, f'kl_{B}', uni) or 'none'}, J {_below(rows, f'kl_{P}', uni) or 'none'}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["layer"]), _f(r.get(f"kl_{B}")), _f(r.get(f"kl_{P}"))]
        for d in ("kl_diff", "top1_diff"):
            if r.get(d) is not None:
                ci = f"[{_f(r[d + '_lo'], '+.3f')}, {_f(r[d + '_hi'], '+.3f')}]"
                cells.append(f"{_f(r[d], '+.3f')} {ci}")
            else:
                cells.append("–")
            if d == "kl_diff":
                cells += [_f(r.get(f"top1_{B}")), _f(r.get(f"top1_{P}"))]
        cells += [f"{_f(r.get(f'entropy_{B}'), '.2f')} / {_f(r.get(f'entropy_{P}'), '.2f')}",
                  f"{_f(r.get(f'current_token_{B}'))} / {_f(r.get(f'current_token_{P}'))}"]
        if has_halves:
            cells += [f"{_f(r.get('kl_half_a'))} / {_f(r.get('kl_half_b'))}", _f(r.get("halves_top1_agreement")),
                      _f(r.get("halves_rel_frob")), _f(r.get("halves_corr_minus_identity"))]
        lines.append("| " + " | ".join(cells) + " |")
    names = result.get("readouts", [B, P])
    head2 = ["layer"] + [f"{n}: top-1/5/10" for n in names] + [f"{n}: KL eval → at T (T)" for n in names]
    lines += ["", "## Calibration-free view", "",
              f"Temperatures fitted per layer on {result.get('n_calibration_texts')} calibration texts, KL scored on "
              f"the other {result.get('n_eval_texts')} ({result.get('n_eval_positions')} positions). Top-k does not "
              "depend on a temperature.", "", "| " + " | ".join(head2) + " |", "|" + "---|" * len(head2)]
    for r in rows:
        cells = [str(r["layer"])]
        cells += [f"{_f(r.get(f'top1_{n}'))} / {_f(r.get(f'top5_{n}'))} / {_f(r.get(f'top10_{n}'))}" for n in names]
        cells += [f"{_f(r.get(f'kl_eval_{n}'), '.2f')} → {_f(r.get(f'kl_temp_{n}'), '.2f')} "
                  f"({_f(r.get(f'temperature_{n}'), '.2f')})" for n in names]
        lines.append("| " + " | ".join(cells) + " |")
    s = result["summary"]
    lines += ["", f"Middle band (layers {s['band_layers'][0]}–{s['band_layers'][1]}), fitted layers compared: "
              f"{s['layers_compared'] or 'none'}. Jacobian lens KL lower (CI below 0): "
              f"{s['jacobian_lower_kl'] or 'none'}; higher: {s['jacobian_higher_kl'] or 'none'}. Top-1 higher: "
              f"{s['jacobian_higher_top1'] or 'none'}; "
              f"lower: {s['jacobian_lower_top1'] or 'none'}. A lower KL where both readouts are above the uniform "
              "baseline says which is less over-confident, not which reads the model better.", ""]
    return "\n".join(lines)


def fidelity_plot(result: dict, path: Path, *, title: str) -> Path:
    """Two panels by layer: KL (with the uniform and marginal baselines) and top-1 agreement, per readout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["layers"]
    model = result.get("model") or {}
    lines = [(name, marker + "-") for name, marker in zip(result.get("readouts", []), "os^vD<>ph", strict=False)]
    lines += [("half_a", "--"), ("half_b", ":")]  # the split halves, when read
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), layout="constrained")
    for ax, metric, label in ((axes[0], "kl", "KL(model ‖ lens), nats"), (axes[1], "top1", "top-1 agreement")):
        for key, style in lines:
            pts = [(r["layer"], r.get(f"{metric}_{key}")) for r in rows if r.get(f"{metric}_{key}") is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=key, markersize=3)
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for key, style, label in (("kl_uniform", "k--", "uniform"), ("kl_marginal_eval", "k:", "marginal")):
        if model.get(key) is not None:
            axes[0].axhline(model[key], linestyle=style[1:], color="k", linewidth=0.8, label=label)
    axes[0].set_yscale("symlog", linthresh=0.1)
    axes[0].set_ylim(bottom=0)
    axes[0].legend(fontsize=7)
    axes[1].set_ylim(-0.02, 1.02)
    fig.suptitle(title, fontsize=9)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=130, bbox_inches="tight"))
    plt.close(fig)
    return path


def write_fidelity(out_dir: Path, result: dict, *, title: str) -> dict[str, str]:
    """eval.json, eval.md and fidelity.png in `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(out / "eval.json"), "markdown": str(out / "eval.md"), "plot": str(out / "fidelity.png")}
    fidelity_plot(result, out / "fidelity.png", title=title)
    atomic_write_text(out / "eval.md", fidelity_markdown(result, title=title))
    write_json(out / "eval.json", {**result, "files": files})
    return files
