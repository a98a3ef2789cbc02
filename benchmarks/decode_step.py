"""Cost of one batched decode step against a single-row step, at a long context.

Why: the rollout engine's gain over one-request-at-a-time decoding is bounded by how much a
step's cost grows with its rows. If a step with B rows costs c(B), batching decodes B rows
B * c(1) / c(B) times faster. On CPU with a tiny model the fixed per-step cost amortises but each
row's attention over its own history does not.

    python benchmarks/decode_step.py [--context 5000] [--rows 1 8 16] [--model DIR]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lhd_train.tiny_model import build_tiny_model  # noqa: E402


def step_ms(model, rows: int, context: int, repeats: int = 30) -> float:
    """Median wall time of one decode forward for `rows` rows with `context` cached tokens each
    (a padding mask, as the backend's decode loop passes)."""
    import inspect

    import torch
    from transformers import DynamicCache

    # the cache argument's spelling: `cache` from transformers 5.24, `past_key_values` before
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(5, 1000, (rows, context))
    with torch.inference_mode():
        filled = DynamicCache()
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **{arg: filled})
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in filled.layers]
        mask = torch.ones(rows, context + 1, dtype=torch.bool)
        feed = torch.ones(rows, 1, dtype=torch.long)
        position = torch.full((rows, 1), context)
        times = []
        for _ in range(repeats):
            cache = DynamicCache()
            for i, (k, v) in enumerate(kv):
                cache.update(k, v, i)
            t0 = time.perf_counter()
            model(input_ids=feed, attention_mask=mask, position_ids=position, use_cache=True, **{arg: cache})
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_tiny_model("llama", Path(tmp) / "model", seed=0)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        step_ms(model, 1, 64, repeats=5)  # warm-up
        cost = {b: step_ms(model, b, args.context) for b in args.rows}
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; context {args.context} tokens")
    base = cost[min(cost)]
    print(f"{'rows':>5}{'step ms':>10}{'step / 1-row step':>20}{'batched speed-up':>18}")
    for b, ms in cost.items():
        print(f"{b:>5}{ms:>10.2f}{ms / base:>20.2f}{b * base / ms:>18.2f}")


if __name__ == "__main__":
    main()
