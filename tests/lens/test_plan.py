"""The lens on an 8B model (issue 20, M5): defaults for a CUDA device, the memory plan against
autograd's own saved tensors, `lhd lens fit --plan`, the running sums in host memory, and the
checkpoint cadence."""
from __future__ import annotations

import json
import math

import pytest
import torch
from support.lens_toy import ByteTokenizer
from typer.testing import CliRunner

import lens.fit as fit_mod
from lens.corpus import encode_prompt
from lens.errors import LensError
from lens.fit import FitOptions, FitSettings, fit_lens, prompt_jacobian
from lens.model import HFLensModel, capture, load_hf, run
from lens.plan import GiB, ModelShape, activation_bytes_per_token, plan_fit, resolve_attn, resolve_dtype
from lhd_train.cli.lens import app

runner = CliRunner()

# Llama-3.1-8B's config.json (the fields the plan reads; values from the model card's config)
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def test_default_dtype_is_bf16_on_cuda_and_fp32_elsewhere():
    assert resolve_dtype("auto", torch.device("cuda")) == "bfloat16"
    assert resolve_dtype("auto", "cuda:3") == "bfloat16"
    assert resolve_dtype("auto", torch.device("cpu")) == "float32"  # CPU results are unchanged
    assert resolve_dtype("fp32", "cuda") == "float32" and resolve_dtype("bf16", "cpu") == "bfloat16"
    with pytest.raises(LensError, match="unknown dtype"):
        resolve_dtype("float8", "cuda")


def test_default_attention_is_sdpa_except_for_vmap():
    assert resolve_attn("auto", "replicate") == "sdpa"
    assert resolve_attn("auto", "vmap") == "eager"  # no vmap batching rule for the sdpa backward kernels
    assert resolve_attn("eager", "replicate") == "eager"
    for op in ("aten::_scaled_dot_product_efficient_attention_backward",
               "aten::_scaled_dot_product_flash_attention_backward"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "FuncTorchBatched")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sdpa_gives_the_eager_lens(arch, tiny_dirs, fit_prompts):
    """First-order gradients through sdpa equal eager's: sdpa is a valid default for the fit."""
    eager, tok = load_hf(str(tiny_dirs[arch]), dtype="float32", device="cpu", attn_implementation="eager")
    sdpa, _ = load_hf(str(tiny_dirs[arch]), dtype="float32", device="cpu", attn_implementation="sdpa")
    ids = encode_prompt(tok, fit_prompts[0], max_length=32)
    kw = dict(source_layers=[0, 1], target_layer=2, skip_first=4, dim_batch=16)
    a, b = prompt_jacobian(eager, ids, **kw), prompt_jacobian(sdpa, ids, **kw)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def _saved_bytes(model: HFLensModel, B: int, T: int, root: int, target: int) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in the lens's forward."""
    params = {p.untyped_storage().data_ptr() for p in model.hf.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(5, 200, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.enable_grad(), capture(model, [root, target], root=root, stop_after=target), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model, ids)
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(("dtype", "attn"), [("float32", "eager"), ("bfloat16", "sdpa"), ("bfloat16", "eager")])
def test_planned_activations_match_autograd(arch, dtype, attn, tiny_dirs):
    """The plan's saved activations are what autograd keeps, within 1 % (the rest is the shared rotary
    cos/sin), on tiny Llama and Qwen3 with 4 heads / 2 kv heads (Llama-3's 8B has 32 / 8)."""
    model, _ = load_hf(str(tiny_dirs[arch]), dtype=dtype, device="cpu", attn_implementation=attn)
    shape = ModelShape.parse(json.loads((tiny_dirs[arch] / "config.json").read_text()))
    assert (shape.d_model, shape.n_layers, shape.qk_norm) == (model.d_model, model.n_layers, arch == "qwen3")
    assert shape.n_params == sum(p.numel() for p in model.hf.parameters())
    B, T = 4, 40
    measured = _saved_bytes(model, B, T, root=0, target=2)
    plan = plan_fit(shape, dtype=dtype, attn=attn, sources=[0, 1], target=2, tokens=T, dim_batch=B, device_type="cpu")
    assert plan.memory["saved activations"] == pytest.approx(measured, rel=0.01)
    assert plan.memory["saved activations"] <= measured  # nothing counted that autograd does not keep
    assert plan.memory["weights"] == shape.n_params * (4 if dtype == "float32" else 2)


def test_plan_for_llama_8b_on_an_80gb_gpu():
    shape = ModelShape.parse(LLAMA_8B)
    assert shape.n_params == pytest.approx(8.03e9, rel=0.002)
    sources, budget = list(range(31)), 80 * GiB
    bf16 = plan_fit(shape, dtype=resolve_dtype("auto", "cuda"), attn=resolve_attn("auto", "replicate"),
                    sources=sources, target=31, budget=budget)
    assert bf16.fits and bf16.dim_batch == 64 and bf16.dim_batch_auto  # 128 would not fit
    assert 45 * GiB < bf16.peak < 65 * GiB
    fp32 = plan_fit(shape, dtype="float32", attn="eager", sources=sources, target=31, dim_batch=64, budget=budget)
    assert fp32.fits is False and fp32.peak > 90 * GiB and "--dtype bfloat16" in fp32.advice()
    # 1 forward of 64 x 128 tokens + 64 passes of input gradients through 31 blocks: about 7.2 PFLOP
    assert bf16.flops == pytest.approx(7.2e15, rel=0.05)
    assert bf16.memory["per-prompt J (out, fp32)"] == 31 * 4096 * 4096 * 4
    assert bf16.host["running sums (2 x fp32)"] == 2 * 31 * 4096 * 4096 * 4  # host memory, not the GPU


def test_fit_plan_cli_reads_config_json_only(tmp_path):
    model = tmp_path / "llama-3.1-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_8B))  # no weights, no tokenizer
    from lhd_train.cli.app import app as lhd_app

    args = ["fit", str(model), "--plan", "--device", "cuda", "--memory-gib", "80"]
    for res in (runner.invoke(app, args), runner.invoke(lhd_app, ["lens", *args])):  # the group alone, lhd
        assert res.exit_code == 0, res.output
        assert "bfloat16" in res.output and "dim_batch 64" in res.output and ": fits" in res.output
        assert "per prompt:" in res.output and "PFLOP" in res.output
    res = runner.invoke(app, ["fit", str(model), "--plan", "--device", "cuda", "--memory-gib", "80",
                              "--dtype", "float32", "--dim-batch", "64"])
    assert res.exit_code == 0 and "DOES NOT FIT" in res.output, res.output
    res = runner.invoke(app, ["fit", str(model), "--plan", "--device", "cpu"])
    assert res.exit_code == 0 and "float32" in res.output and "no budget given" in res.output
    res = runner.invoke(app, ["fit", str(tmp_path / "nowhere"), "--plan"])
    assert res.exit_code == 2 and "config.json" in res.output
    res = runner.invoke(app, ["fit", str(model), "--device", "cpu"])
    assert res.exit_code == 2 and "--corpus" in res.output


class _ReportsMeta:
    """The tiny model, reporting the `meta` device: stands for a model on an accelerator."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    @property
    def device(self):
        return torch.device("meta")


def test_running_sums_live_in_host_memory(llama, tmp_path):
    """The sums are allocated in host memory whatever the model's device (lens-background.md §2)."""
    model, tok = llama
    out = tmp_path / "fit"
    with pytest.raises(LensError, match="no usable prompt"):  # no prompt: only the state is built and saved
        fit_lens(_ReportsMeta(model), tok, [], FitSettings(skip_first=4, max_length=32), out_dir=out,
                 options=FitOptions(progress=False))
    saved = torch.load(out / "checkpoint.pt", weights_only=True)
    assert saved["sum_a"].device.type == "cpu" and saved["sum_a"].shape == (2, model.d_model, model.d_model)
    assert fit_mod.SUMS_DEVICE == torch.device("cpu")


def _count_checkpoints(monkeypatch) -> list[int]:
    saves: list[int] = []
    real = fit_mod._save_checkpoint

    def counting(path, state, settings):
        saves.append(state.n)
        real(path, state, settings)

    monkeypatch.setattr(fit_mod, "_save_checkpoint", counting)
    return saves


def test_checkpoints_by_wall_time_not_every_ten_prompts(toy, tmp_path, monkeypatch):
    prompts = [f"prompt number {i} for the toy" for i in range(12)]
    settings = FitSettings(skip_first=4, max_length=40, force_bos=False)
    saves = _count_checkpoints(monkeypatch)
    fit_lens(toy, ByteTokenizer(), prompts, settings, out_dir=tmp_path / "a", options=FitOptions(progress=False))
    assert saves == [12]  # a fast fit: only the final checkpoint (was: every 10 prompts)

    clock = [0.0]  # every prompt takes 10 minutes
    real_pj = fit_mod.prompt_jacobian

    def slow(*args, **kwargs):
        clock[0] += 600
        return real_pj(*args, **kwargs)

    monkeypatch.setattr(fit_mod, "prompt_jacobian", slow)
    monkeypatch.setattr(fit_mod, "_now", lambda: clock[0])
    saves.clear()
    fit_lens(toy, ByteTokenizer(), prompts[:7], settings, out_dir=tmp_path / "b", options=FitOptions(progress=False))
    assert saves == [3, 6, 7]  # every 30 minutes, and at the end
    saves.clear()
    fit_lens(toy, ByteTokenizer(), prompts[:7], settings, out_dir=tmp_path / "c",
             options=FitOptions(progress=False, checkpoint_every=2, checkpoint_minutes=0))
    assert saves == [2, 4, 6, 7]


def test_checkpoint_size_of_an_8b_fit_is_in_the_plan():
    plan = plan_fit(ModelShape.parse(LLAMA_8B), dtype="bfloat16", attn="sdpa", sources=list(range(31)),
                    target=31, budget=80 * GiB)
    gb = plan.host["checkpoint file"] / 1e9
    assert math.isclose(gb, 4.16, rel_tol=0.01)
    assert activation_bytes_per_token(plan.shape, "bfloat16", "sdpa", 128) / 4096 == pytest.approx(34.1, abs=0.1)
