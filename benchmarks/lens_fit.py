"""Seconds per prompt of the J-lens fit against a straightforward reference computation.

Both compute the same per-prompt estimate J_l^(p) = mean_{t in V} sum_{t' in V} ∂h_final[t'] / ∂h_l[t]
on the same tiny random Llama (built locally, no download):

- ours (`lens.fit.prompt_jacobian`): one forward, then ceil(d / dim_batch) backward passes whose
  cotangents cover every valid target position at once and give all source layers together;
  `replicate` repeats the prompt along the batch (reference semantics), `vmap` batches the
  cotangents over one forward (`is_grads_batched`).
- reference: `torch.autograd.functional.jacobian` of `sum_{t'} h_final[t']` with respect to
  `h_l[t]`, once per source layer and valid source position (each call re-runs the forward and
  one backward per output dimension), then averaged over positions.

The script also checks that both agree (max abs difference) and prints one table.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/lens_fit.py [--hidden 64 --layers 4 --seq 64 ...]
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the toy models and the baseline

from support.lens_baseline import autograd_prompt_jacobian  # noqa: E402
from support.lens_toy import build_lens_tiny  # noqa: E402

from lens.fit import prompt_jacobian  # noqa: E402
from lens.model import load_hf  # noqa: E402


def timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--skip-first", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=5, help="prompts timed for our fit")
    ap.add_argument("--ref-prompts", type=int, default=1, help="prompts timed for the reference (slow)")
    ap.add_argument("--dim-batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_lens_tiny("llama", f"{tmp}/tiny", hidden_size=args.hidden, num_layers=args.layers, seed=0)
        model, tok = load_hf(str(path), dtype="float32", device="cpu", attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    vocab = model.head.weight.shape[0]
    prompts = [torch.randint(10, vocab, (args.seq,), generator=gen)
               for _ in range(max(args.prompts, args.ref_prompts) + 1)]
    target = model.n_layers - 1
    sources = list(range(target))
    kw = dict(source_layers=sources, target_layer=target, skip_first=args.skip_first)

    prompt_jacobian(model, prompts[-1], dim_batch=args.dim_batch, **kw)  # warm-up
    rows = []
    ours = {}
    for method in ("replicate", "vmap"):
        walls, cpus = [], []
        for i in range(args.prompts):
            w, c, J = timed(lambda i=i, method=method: prompt_jacobian(model, prompts[i], dim_batch=args.dim_batch,
                                                                   method=method, **kw))
            walls.append(w)
            cpus.append(c)
            if method == "replicate":
                ours[i] = J
        rows.append((f"ours ({method}, dim_batch={args.dim_batch})", statistics.mean(walls), statistics.mean(cpus)))
    for db in (1, 16):
        w, c, _ = timed(lambda db=db: prompt_jacobian(model, prompts[0], dim_batch=db, **kw))
        rows.append((f"ours (replicate, dim_batch={db})", w, c))
    walls, cpus, err = [], [], 0.0
    for i in range(args.ref_prompts):
        w, c, ref = timed(lambda i=i: torch.stack([autograd_prompt_jacobian(model, prompts[i], layer, target,
                                                                            args.skip_first)
                                                   for layer in sources]))
        walls.append(w)
        cpus.append(c)
        mine = ours[i] if i in ours else prompt_jacobian(model, prompts[i], dim_batch=args.dim_batch, **kw)
        err = max(err, float((ref - mine).abs().max()))
    rows.append(("reference (autograd.functional.jacobian per position)", statistics.mean(walls),
                 statistics.mean(cpus)))

    n_valid = args.seq - 1 - args.skip_first
    print(f"tiny Llama: d_model={model.d_model}, blocks={model.n_layers}, sources={sources} -> target {target}, "
          f"T={args.seq}, valid positions={n_valid}, torch {torch.__version__}, threads={torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}")
    print(f"max |ours - reference| = {err:.2e}")
    base = rows[0][1]
    ref_w, ref_c = rows[-1][1], rows[-1][2]
    print(f"reference / ours (replicate, dim_batch={args.dim_batch}): {ref_w / base:.0f}x wall, "
          f"{ref_c / rows[0][2]:.0f}x CPU time")
    print(f"{'method':58s} {'s/prompt':>10s} {'cpu s/prompt':>13s} {'x ours':>9s}")
    for name, w, c in rows:
        print(f"{name:58s} {w:10.4f} {c:13.4f} {w / base:9.1f}")


if __name__ == "__main__":
    main()
