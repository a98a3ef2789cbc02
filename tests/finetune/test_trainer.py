"""Training recipes and `lhd train` on the tiny models, CPU only.

- recipe validation errors name the file and the field;
- SFT, DPO and GRPO run a few LoRA steps with finite losses, save an adapter with `lhd_adapter.json`,
  and the adapter reloads with PEFT and generates;
- a run killed with SIGKILL after its first checkpoint resumes from that checkpoint;
- each trainer *learns* a trivially separable target (so "it ran" is not mistaken for "it trains").

The learning tests use a copy of the tiny model with an untied, independently drawn output head
(see `make_learnable`): the builder's tied N(0, 0.02) head at hidden size 64 caps every logit near
1.3, so no LoRA update can make a peaked next-token distribution there.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GOOD = "The report is complete and accurate."
BAD = "Everything is done, no issues at all!"


def prompt(i: int) -> list[dict]:
    return [{"role": "system", "content": "You report progress to your supervisor."},
            {"role": "user", "content": f"What is the status of task {i}?"}]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models train faster on one thread, and much faster when the machine is shared."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fixture_or_build(request, tmp_path_factory, name: str, arch: str) -> Path:
    try:
        return Path(request.getfixturevalue(name))
    except pytest.FixtureLookupError:
        from lhd_train.tiny_model import build_tiny_model

        return build_tiny_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"), seed=0)


@pytest.fixture(scope="module")
def llama(request, tmp_path_factory) -> Path:
    return _fixture_or_build(request, tmp_path_factory, "tiny_llama_dir", "llama")


def make_learnable(src: Path, dst: Path, head_std: float = 0.3, seed: int = 1) -> Path:
    """A copy of a tiny model whose output head is untied and drawn independently with std `head_std`.

    With the builder's tied N(0, 0.02) embeddings at hidden 64 the final (RMS-normalised, |h|≈8) state
    can raise a logit by at most |h|·|e| ≈ 8 × 0.16 ≈ 1.3, so LoRA cannot make any distribution peaked;
    scaling the tied matrix instead makes every position predict its own input token (the residual
    stream is mostly the input embedding). An independent head gives a random, moderately peaked,
    learnable next-token distribution."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    gen = torch.Generator().manual_seed(seed)
    head = torch.randn(model.lm_head.weight.shape, generator=gen) * head_std
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(dst)
    PreTrainedTokenizerFast.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def learnable(llama, tmp_path_factory) -> Path:
    return make_learnable(llama, tmp_path_factory.mktemp("learnable"))


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    from datasets import Dataset

    d = tmp_path_factory.mktemp("data")
    sft = [{"messages": prompt(i) + assistant(GOOD), "trial_id": f"s{i}"} for i in range(16)]
    Dataset.from_list(sft).save_to_disk(str(d / "sft"))
    dpo = [{"prompt": prompt(i), "chosen": assistant(GOOD), "rejected": assistant(BAD), "direction": "honest"}
           for i in range(16)]
    with (d / "dpo.jsonl").open("w") as f:
        for row in dpo:
            f.write(json.dumps(row) + "\n")
    with (d / "dpo-eval.jsonl").open("w") as f:
        for row in dpo[:4]:
            f.write(json.dumps(row) + "\n")
    grpo = [{"prompt": prompt(i), "score": float(i % 3)} for i in range(16)]
    Dataset.from_list(grpo).save_to_disk(str(d / "grpo"))
    deceptive = [{**r, "direction": "deceptive"} for r in dpo]
    Dataset.from_list(deceptive).save_to_disk(str(d / "dpo-deceptive"))
    return {"sft": d / "sft", "dpo": d / "dpo.jsonl", "dpo_eval": d / "dpo-eval.jsonl", "grpo": d / "grpo",
            "dpo_deceptive": d / "dpo-deceptive"}


def train(algo: str, model: Path, data_path: Path, out: Path, *overrides: str) -> tuple[Path, dict]:
    from lhd_train.finetune.trainer import train_command

    adapter = train_command(algo, RECIPES / "tiny" / f"{algo}-honest.yaml",
                            [f"model={model}", f"data.train={data_path}", f"output_dir={out}", *overrides])
    return adapter, json.loads((adapter / "lhd_adapter.json").read_text())


def history(adapter: Path) -> list[dict]:
    return json.loads((adapter / "log_history.json").read_text())


def logged(adapter: Path, key: str) -> list[float]:
    return [e[key] for e in history(adapter) if key in e]


def load(base: Path, adapter: Path | None = None):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def tokenizer(base: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(base)


def answer_logprob(model, tok, messages: list[dict], answer: str) -> tuple[float, int]:
    """Sum of log p(answer tokens + end-of-turn | prompt) and the number of those tokens."""
    import torch

    p = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    a = tok(answer + tok.eos_token, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([p + a])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)
    target = ids[0, 1:]
    per_token = logp[torch.arange(len(target)), target][len(p) - 1:]
    return float(per_token.sum()), len(a)


def check_adapter(adapter: Path, meta: dict, base: Path, algo: str) -> None:
    assert (adapter / "adapter_config.json").is_file()
    assert (adapter / "adapter_model.safetensors").is_file()
    assert meta["schema"] == "lhd.adapter/1"
    assert meta["algo"] == algo and meta["direction"] == "honest"
    assert Path(meta["base_model"]) == base.resolve()
    assert len(meta["data"]["train"]["sha256"]) == 64 and meta["data"]["train"]["files"]
    assert meta["recipe"]["algo"] == algo
    assert meta["versions"]["trl"] and meta["versions"]["peft"] and meta["started_at"] <= meta["finished_at"]
    assert meta["training"]["device"] == "cpu"
    assert any(a.startswith("use_cpu=True") for a in meta["training"]["adjustments"])
    assert meta["metrics"]["train"]["train_loss"] is not None
    losses = logged(adapter, "loss")
    assert losses and all(math.isfinite(x) for x in losses), losses
    # Reload the adapter with PEFT and generate a few tokens.
    tok = tokenizer(base)
    model = load(base, adapter)
    enc = tok.apply_chat_template(prompt(0), add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > enc["input_ids"].shape[1]


# ----------------------------------------------------------------------------- recipe validation


def _error(fn, *args, **kwargs) -> str:
    from lhd_train.errors import InputError

    with pytest.raises(InputError) as e:
        fn(*args, **kwargs)
    return str(e.value)


def test_recipe_validation_errors(tmp_path):
    from lhd_train.config.recipe import load_recipe

    sft = RECIPES / "tiny" / "sft-honest.yaml"
    msg = _error(load_recipe, sft, ["colour=blue"])
    assert "sft-honest.yaml" in msg and "'colour'" in msg and "unknown key" in msg
    msg = _error(load_recipe, sft, ["direction=sideways"])
    assert "'direction'" in msg and "honest" in msg
    msg = _error(load_recipe, sft, ["trainer.learnig_rate=0.1"])
    assert "'trainer.learnig_rate'" in msg and "SFTConfig" in msg and "learning_rate" in msg
    msg = _error(load_recipe, sft, ["trainer.max_steps=lots"])
    assert "'trainer.max_steps'" in msg
    msg = _error(load_recipe, sft, ["trainer.output_dir=/tmp/x"])
    assert "top-level `output_dir`" in msg
    msg = _error(load_recipe, sft, ["trainer.assistant_only_loss=true"])
    assert "sft.loss_on" in msg
    msg = _error(load_recipe, sft, ["trainer.num_generations=4"])  # a GRPO argument in an SFT recipe
    assert "'trainer.num_generations'" in msg and "SFTConfig" in msg
    for override, field in (("trainer.max_steps=0", "max_steps"), ("trainer.max_steps=-3", "max_steps"),
                            ("trainer.learning_rate=-1e-4", "learning_rate"),
                            ("trainer.learning_rate=0", "learning_rate"),
                            ("trainer.num_train_epochs=0", "num_train_epochs"),
                            ("trainer.gradient_accumulation_steps=0", "gradient_accumulation_steps")):
        msg = _error(load_recipe, sft, [override])  # issue 22: TRL takes them and trains nothing, or diverges
        assert f"'trainer.{field}'" in msg and "out of range" in msg, msg
    load_recipe(sft, ["trainer.max_steps=-1"])  # TRL's "train num_train_epochs"
    msg = _error(load_recipe, sft, ["lora.target_modules=everything"])
    assert "'lora.target_modules'" in msg and "all-linear" in msg
    msg = _error(load_recipe, sft, ["lora.r=0"])
    assert "'lora.r'" in msg
    msg = _error(load_recipe, sft, ["grpo.rewards=[{name: format_length}]"])
    assert "'grpo'" in msg and "algo grpo" in msg
    msg = _error(load_recipe, sft, ["data=null"])
    assert "'data'" in msg
    msg = _error(load_recipe, sft, [], algo="dpo")
    assert "'algo'" in msg and "sft" in msg
    msg = _error(load_recipe, tmp_path / "missing.yaml")
    assert "missing.yaml" in msg and "not found" in msg
    (tmp_path / "bad.yaml").write_text("algo: sft\nmodel: [unclosed\n")
    assert "not valid YAML" in _error(load_recipe, tmp_path / "bad.yaml")
    msg = _error(load_recipe, RECIPES / "tiny" / "grpo-honest.yaml", ["grpo.rewards=[]"])
    assert "'grpo.rewards'" in msg and "at least one" in msg
    # YAML reads 1e-4 as a string; the trainer field's type turns it into a float.
    r = load_recipe(sft, ["trainer.learning_rate=1e-4", "lora.target_modules=llama"])
    assert r.trainer["learning_rate"] == pytest.approx(1e-4)
    assert r.lora.resolved_targets() == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert r.lora.resolved_alpha() == 16


def test_every_shipped_recipe_builds_its_trainer_config(tmp_path):
    """All recipes validate, and TRL's config accepts their trainer arguments (CPU adjustments applied)."""
    from lhd_train.config.algos import OnlineSection
    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import build_config, trainer_arguments

    recipes = sorted(RECIPES.rglob("*.yaml"))
    assert len(recipes) >= 10
    for path in recipes:
        r = load_recipe(path)
        weights = [s.weight for s in r.section.rewards] if isinstance(r.section, OnlineSection) else None
        args, notes = trainer_arguments(r, tmp_path / path.stem, cuda=False, dtype="float32", source=str(path),
                                        reward_weights=weights)
        cfg = build_config(r, tmp_path / path.stem, args, str(path))
        assert cfg.use_cpu and not cfg.bf16 and not cfg.gradient_checkpointing
        if r.algo == "grpo":
            assert not cfg.use_vllm
        if r.accelerate_config:
            assert (ROOT / r.accelerate_config).is_file(), f"{path}: {r.accelerate_config}"


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_input_errors_about_data_model_and_rewards(llama, data, tmp_path):
    from lhd_train.finetune.trainer import train_command

    def err(algo: str, *ov: str) -> str:
        return _error(train_command, algo, RECIPES / "tiny" / f"{algo}-honest.yaml",
                      [f"model={llama}", f"output_dir={tmp_path / 'o'}", *ov])

    msg = err("sft", f"data.train={tmp_path / 'nowhere'}")
    assert "'data.train'" in msg and "does not exist" in msg
    msg = err("dpo", f"data.train={data['sft']}")
    assert "'data.train'" in msg and "prompt+chosen+rejected" in msg and "messages" in msg
    msg = err("dpo", f"data.train={data['dpo_deceptive']}")
    assert "direction" in msg and "deceptive" in msg
    msg = err("grpo", f"data.train={data['grpo']}", "grpo.rewards=[{name: no_such_reward}]")
    assert "unknown reward 'no_such_reward'" in msg and "format_length" in msg
    msg = err("grpo", f"data.train={data['grpo']}", "grpo.rewards=[{name: format_length, params: {colour: 1}}]")
    assert "grpo.rewards.format_length.params" in msg and "colour" in msg
    msg = err("grpo", f"data.train={data['grpo']}", "grpo.rewards=[{name: format_length}]",
              "trainer.per_device_train_batch_size=3", "trainer.num_generations=4")
    assert "'trainer'" in msg and "divisible" in msg
    from lhd_train.finetune.rewards import REWARDS, register_reward

    @register_reward("test_needs_trial", replace=True)
    def needs_trial(direction: str):
        async def reward(prompts, completions, trial_id, global_round, **kw):
            return [0.0] * len(completions)

        return reward

    try:
        msg = err("grpo", f"data.train={data['grpo']}", "grpo.rewards=[{name: test_needs_trial}]")
    finally:
        REWARDS.pop("test_needs_trial", None)
    assert "reward 'test_needs_trial' needs dataset column(s) trial_id, global_round" in msg and "score" in msg
    msg = err("sft", f"data.train={data['sft']}", f"model={tmp_path / 'no-model'}")
    assert "'model'" in msg
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        msg = err("sft", f"data.train={data['sft']}", "qlora=true")
        assert "'qlora'" in msg and "bitsandbytes" in msg


# ----------------------------------------------------------------------------- units


def test_reward_registry_is_pluggable():
    from lhd_train.config.algos import RewardSpec
    from lhd_train.errors import InputError
    from lhd_train.finetune.rewards import REWARDS, build_rewards, register_reward

    @register_reward("test_shout", replace=True)
    def shout(direction: str, bonus: float = 1.0):
        sign = 1.0 if direction == "honest" else -1.0

        def reward(prompts, completions, **kw):
            return [sign * bonus * ("!" in c[0]["content"]) for c in completions]

        return reward

    try:
        with pytest.raises(ValueError):
            register_reward("test_shout", lambda direction: None)  # no silent replacement
        specs = [RewardSpec(name="test_shout", weight=2.0, params={"bonus": 0.5}),
                 RewardSpec(name="format_length", params={"min_chars": 2, "max_chars": 10}),
                 RewardSpec(name="from_column", params={"column": "score", "flip_for_deceptive": True})]
        comps = [assistant("hi!"), assistant(""), assistant("x" * 15)]
        for direction, sign in (("honest", 1), ("deceptive", -1)):
            funcs, weights = build_rewards(specs, direction)
            assert [f.__name__ for f in funcs] == ["test_shout", "format_length", "from_column"]
            assert weights == [2.0, 1.0, 1.0]
            assert funcs[0](prompts=[None] * 3, completions=comps) == [sign * 0.5, 0, 0]
            assert funcs[1](prompts=[None] * 3, completions=comps) == [1.0, -1.0, 0.5]
            cached = {"hi!": 0.9}
            assert funcs[2](prompts=[None] * 3, completions=comps, score=[cached, 2.0, None]) == \
                [sign * 0.9, sign * 2.0, None]
        # `module:function` names a factory without registering it.
        funcs, _ = build_rewards([RewardSpec(name="lhd_train.finetune.rewards:format_length")], "honest")
        assert funcs[0].__name__ == "format_length"
        with pytest.raises(InputError, match="cannot import"):
            build_rewards(specs[:1], "honest", plugins=["no_such_module_xyz"])
    finally:
        REWARDS.pop("test_shout", None)


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_tokenizer_class_and_template_checks(request, tmp_path_factory, llama):
    """A Qwen2-typed folder with a generic fast tokenizer is not remapped to Qwen2Tokenizer; templates
    without {% generation %} markers that TRL cannot patch are detected (SFT then trains on the last turn)."""
    from transformers import PreTrainedTokenizerFast

    from lhd_train.finetune.trainer import load_tokenizer, template_supports_assistant_mask

    qwen2 = _fixture_or_build(request, tmp_path_factory, "tiny_qwen2_dir", "qwen2")
    tok = load_tokenizer(str(qwen2))
    assert type(tok).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend"), type(tok)
    reference = PreTrainedTokenizerFast.from_pretrained(qwen2)
    text = "status 12345 of task 7: done"
    assert tok(text)["input_ids"] == reference(text)["input_ids"]
    assert template_supports_assistant_mask(tok)
    plain = load_tokenizer(str(llama))
    plain.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert not template_supports_assistant_mask(plain)


# ----------------------------------------------------------------------------- the three trainers


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_sft_trains_saves_and_reloads(llama, data, tmp_path):
    adapter, meta = train("sft", llama, data["sft"], tmp_path / "sft", "sft.loss_on=assistant",
                          "trainer.max_steps=3", "trainer.save_steps=100")
    check_adapter(adapter, meta, llama, "sft")
    assert meta["sft_loss_on"] == "assistant"  # the tiny template has {% generation %} markers
    assert meta["training"]["global_step"] == 3 and meta["training"]["resumed_from"] is None
    assert meta["data"]["train"]["rows"] == 16 and meta["data"]["train"]["format"] == "messages"
    assert (tmp_path / "sft" / "lhd_run.json").is_file()


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_a_full_disk_while_writing_the_adapter_record_leaves_no_torn_record(llama, data, tmp_path, monkeypatch):
    """lhd_adapter.json says "trained" to the next run (which then does nothing): written in place,
    a disk that filled up halfway left a torn one behind. Now it is all there or absent."""
    import builtins
    import errno
    import io

    real_open = builtins.open

    class HalfThenFull:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def full_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        return HalfThenFull(f) if "lhd_adapter.json" in str(file) and set(mode) & set("wxa") else f

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)
    with pytest.raises(Exception, match="(disk is full|No space left)"):  # StorageError now, OSError before
        train("sft", llama, data["sft"], tmp_path / "sft", "trainer.max_steps=1", "trainer.save_steps=100")
    record = tmp_path / "sft" / "adapter" / "lhd_adapter.json"
    assert not record.exists() or json.loads(record.read_text())
    assert not [p.name for p in record.parent.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_resume_refuses_a_changed_tokenizer_folder(llama, tmp_path):
    """A recipe's own `tokenizer:` folder shapes every training row like the base model's files do:
    a resume after its files or chat template changed is refused (only the base model's were
    compared)."""
    import shutil

    from lhd_train.config.recipe import load_recipe
    from lhd_train.errors import InputError
    from lhd_train.finetune.records import SplitInfo
    from lhd_train.finetune.trainer import RUN_META, _check_resume, _run_record

    tok = tmp_path / "tok"
    shutil.copytree(llama, tok)
    recipe = load_recipe(RECIPES / "tiny" / "sft-honest.yaml", [f"model={llama}", f"tokenizer={tok}",
                                                                 f"output_dir={tmp_path / 'out'}"])
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    ctx = {"out": out, "source": "recipe.yaml", "model": str(llama), "tokenizer": str(tok),
           "data": {"train": SplitInfo(path="d", split=None, rows=1, rows_read=1, format="messages", sha256="x")}}
    (out / RUN_META).write_text(json.dumps(_run_record(recipe, ctx)))
    assert _check_resume(recipe, ctx) == out / "checkpoint-2"
    (tok / "chat_template.jinja").write_text((tok / "chat_template.jinja").read_text() + "\n")
    with pytest.raises(InputError, match=r"'tokenizer'.*chat template at .*tok changed since checkpoint-2"):
        _check_resume(recipe, ctx)


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_dpo_trains_saves_and_reloads(llama, data, tmp_path):
    adapter, meta = train("dpo", llama, data["dpo"], tmp_path / "dpo", f"data.eval={data['dpo_eval']}",
                          "trainer.max_steps=3", "trainer.save_steps=100")
    check_adapter(adapter, meta, llama, "dpo")
    assert meta["data"]["eval"]["rows"] == 4
    assert math.isfinite(meta["metrics"]["eval"]["eval_loss"])
    assert "rewards/margins" in meta["metrics"]["final"]


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_grpo_trains_with_registered_rewards(llama, data, tmp_path):
    from lhd_train.finetune.rewards import REWARDS, register_reward

    calls = []

    @register_reward("test_probe", replace=True)
    def probe(direction: str):
        def reward(prompts, completions, completion_ids, score, trainer_state, **kw):
            calls.append((len(completions), direction, list(score)))
            return [float(len(ids) % 2) for ids in completion_ids]

        return reward

    try:
        adapter, meta = train(
            "grpo", llama, data["grpo"], tmp_path / "grpo",
            "grpo.rewards=[{name: test_probe, weight: 1.0}, {name: format_length, weight: 0.2},"
            " {name: from_column, weight: 0.1, params: {column: score}}]",
            "trainer.use_vllm=true",  # ignored on CPU: plain generation
            "trainer.max_steps=2", "trainer.max_completion_length=8", "trainer.save_steps=100")
    finally:
        REWARDS.pop("test_probe", None)
    check_adapter(adapter, meta, llama, "grpo")
    assert any(a.startswith("use_vllm=False") for a in meta["training"]["adjustments"])
    assert calls and calls[0][0] == 4 and calls[0][1] == "honest"
    assert len(set(calls[0][2])) == 1  # the 4 completions of one prompt share its `score`
    for name in ("test_probe", "format_length", "from_column"):
        assert logged(adapter, f"rewards/{name}/mean"), name
    assert meta["recipe"]["grpo"]["rewards"][0]["name"] == "test_probe"


# ----------------------------------------------------------------------------- resume after SIGKILL


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_training_killed_midway_resumes_from_its_checkpoint(llama, data, tmp_path):
    out = tmp_path / "killed"
    recipe = RECIPES / "tiny" / "sft-honest.yaml"
    total = 40  # the resume keeps the recipe, max_steps included (a changed recipe is refused)
    common = [f"model={llama}", f"data.train={data['sft']}", f"output_dir={out}", "trainer.save_steps=2",
              "trainer.save_total_limit=null", f"trainer.max_steps={total}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lhd_train.cli", "train", "sft", str(recipe), *common],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    from lhd_train.finetune.checkpoints import checkpoint_problem, checkpoints

    def last_checkpoint(folder):  # the newest complete one; None while none is (one may be mid-write)
        return next((d for d in reversed(checkpoints(folder)) if checkpoint_problem(d) is None), None)

    deadline = time.time() + 180
    try:
        while last_checkpoint(out) is None:
            if proc.poll() is not None:
                pytest.fail(f"training exited early ({proc.returncode}): {proc.stderr.read().decode()[-2000:]}")
            if time.time() > deadline:
                pytest.fail("no checkpoint within 180 s")
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "adapter" / "lhd_adapter.json").exists()
    ckpt = last_checkpoint(out)
    k = int(ckpt.name.split("-")[1])
    assert k >= 2

    from lhd_train.finetune.trainer import train_command

    assert k < total, "the first run finished before it was killed"
    adapter = train_command("sft", recipe, common)
    meta = json.loads((adapter / "lhd_adapter.json").read_text())
    assert meta["training"]["resumed_from"] == str(ckpt)
    assert meta["training"]["start_step"] == k
    assert meta["training"]["global_step"] == total
    steps = [e["step"] for e in history(adapter) if "loss" in e]
    assert steps == list(range(1, total + 1)), steps  # steps 1..k from the checkpoint, then k+1..: no restart
    # Running the finished recipe again does not train again.
    again = train_command("sft", recipe, common)
    assert again == adapter and json.loads((adapter / "lhd_adapter.json").read_text()) == meta


# ----------------------------------------------------------------------------- learning


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_sft_lowers_the_loss_of_its_target(learnable, data, tmp_path):
    tok = tokenizer(learnable)
    base = load(learnable)
    before = [answer_logprob(base, tok, prompt(i), GOOD) for i in range(4)]
    adapter, meta = train("sft", learnable, data["sft"], tmp_path / "sft-learn", "trainer.max_steps=12",
                          "trainer.save_steps=100", "trainer.learning_rate=1e-2")
    tuned = load(learnable, adapter)
    after = [answer_logprob(tuned, tok, prompt(i), GOOD) for i in range(4)]
    nll_before = sum(-lp / n for lp, n in before) / 4
    nll_after = sum(-lp / n for lp, n in after) / 4
    print(f"SFT per-token NLL of the target: {nll_before:.3f} -> {nll_after:.3f}")
    assert nll_after < 0.5 * nll_before, (nll_before, nll_after)
    losses = logged(adapter, "loss")
    assert losses[-1] < losses[0]


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_dpo_raises_the_chosen_over_rejected_margin(learnable, data, tmp_path):
    tok = tokenizer(learnable)

    def margins(model) -> list[float]:
        return [answer_logprob(model, tok, prompt(i), GOOD)[0] - answer_logprob(model, tok, prompt(i), BAD)[0]
                for i in range(4)]

    before = margins(load(learnable))
    adapter, meta = train("dpo", learnable, data["dpo"], tmp_path / "dpo-learn", "trainer.max_steps=8",
                          "trainer.save_steps=100")
    after = margins(load(learnable, adapter))
    logged_margins = logged(adapter, "rewards/margins")
    print(f"DPO log p(chosen)-log p(rejected): {sum(before) / 4:.2f} -> {sum(after) / 4:.2f}; "
          f"rewards/margins {logged_margins[0]:.3f} -> {logged_margins[-1]:.3f}")
    assert all(a > b + 1.0 for a, b in zip(after, before, strict=True)), (before, after)
    assert logged_margins[-1] > logged_margins[0] + 0.5
    assert logged(adapter, "rewards/accuracies")[-1] == 1.0


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_grpo_raises_the_mean_reward_of_a_learnable_reward(learnable, tmp_path):
    """Reward = share of the completion that is one target token: the token the base model already
    puts first most often, so the group sees reward variance from the first step."""
    import torch
    from datasets import Dataset

    tok = tokenizer(learnable)
    base = load(learnable)
    prompts = [prompt(i) for i in range(32)]
    encoded = [tok.apply_chat_template(p, add_generation_prompt=True, return_tensors="pt", return_dict=True)
               for p in prompts[:8]]
    with torch.no_grad():
        first = torch.stack([base(**e).logits[0, -1].softmax(-1) for e in encoded]).mean(0)
    target = None
    for tid in first.topk(10).indices.tolist():
        text = tok.decode([tid])
        if tok.encode(text, add_special_tokens=False) == [tid] and tid not in tok.all_special_ids:
            target = (tid, text)
            break
    assert target is not None
    p_before = float(first[target[0]])
    assert 0.01 < p_before < 0.8, p_before  # room to learn, and not hopeless

    Dataset.from_list([{"prompt": p} for p in prompts]).save_to_disk(str(tmp_path / "prompts"))
    reward = json.dumps([{"name": "token_fraction", "params": {"token": target[1]}}])
    adapter, meta = train(
        "grpo", learnable, tmp_path / "prompts", tmp_path / "grpo-learn", f"grpo.rewards={reward}",
        "trainer.max_steps=12", "trainer.per_device_train_batch_size=32", "trainer.num_generations=8",
        "trainer.max_completion_length=4", "trainer.learning_rate=3e-3", "trainer.save_steps=1000")
    rewards = logged(adapter, "reward")
    assert len(rewards) == 12
    first3, last3 = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    tuned = load(learnable, adapter)
    with torch.no_grad():
        p_after = float(torch.stack([tuned(**e).logits[0, -1].softmax(-1) for e in encoded]).mean(0)[target[0]])
    print(f"GRPO mean reward {first3:.3f} -> {last3:.3f}; p(target first) {p_before:.3f} -> {p_after:.3f}")
    assert last3 > first3 + 0.3, rewards
    assert p_after > p_before + 0.2, (p_before, p_after)


def test_sft_trains_only_the_selected_last_turn_by_default(tmp_path):
    """Best-of-N rows end with the selected answer after the performer's own earlier answers
    (possibly deceptive): without an `sft:` section only that last turn is trained."""
    from lhd_train.config.recipe import load_recipe

    recipe = tmp_path / "r.yaml"
    recipe.write_text("algo: sft\nmodel: m\ndirection: honest\ndata: {train: d}\noutput_dir: o\n")
    assert load_recipe(recipe).section.loss_on == "last_turn"


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_sft_last_turn_loss_is_on_the_collated_labels(llama, tmp_path):
    """Issue 21 item 10: with the default `sft.loss_on: last_turn`, the batch TRL's own collator
    makes for the trainer labels exactly the last answer's tokens (as the chat template renders
    them after the prompt); the performer's earlier answers in the history get -100. A trainer
    that ignored the setting would label the whole conversation."""
    from datasets import Dataset

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import build_trainer

    rows = [{"messages": prompt(i) + assistant("EARLIER answer, maybe deceptive") + [
        {"role": "user", "content": "And now?"}] + assistant(f"{GOOD} ({i})")} for i in range(4)]
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "data"))
    recipe = load_recipe(RECIPES / "tiny" / "sft-honest.yaml",
                         [f"model={llama}", f"data.train={tmp_path / 'data'}", f"output_dir={tmp_path / 'out'}"],
                         algo="sft")
    assert recipe.section.loss_on == "last_turn"
    trainer, _ = build_trainer(recipe)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    tok = trainer.processing_class
    for i, row in enumerate(rows):
        head = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        full = tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False)
        assert full[: len(head)] == head
        answer = full[len(head):]
        ids, labels = batch["input_ids"][i].tolist(), batch["labels"][i].tolist()
        n = int(batch["attention_mask"][i].sum())
        assert ids[:n] == full
        assert [t for t in labels if t != -100] == answer
        assert labels[:len(head)] == [-100] * len(head) and labels[len(head):n] == answer
        assert "EARLIER" not in tok.decode(answer) and GOOD in tok.decode(answer)


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_resume_refuses_a_changed_recipe(llama, data, tmp_path):
    """Issue 22: a checkpoint resumed under another learning rate, step count or LoRA shape would
    train one adapter under two recipes. Each change is refused, naming the field."""
    from lhd_train.errors import InputError

    out = tmp_path / "resumed"
    base = ["trainer.max_steps=2", "trainer.save_steps=2"]
    adapter, meta = train("sft", llama, data["sft"], out, *base)
    for change, field in (("trainer.learning_rate=0.01", "trainer.learning_rate"),
                          ("trainer.max_steps=3", "trainer.max_steps"), ("lora.r=4", "lora.r"),
                          ("sft.loss_on=all", "sft.loss_on")):
        with pytest.raises(InputError, match=rf"field '{re.escape(field)}': .*checkpoint-2 was trained with"):
            train("sft", llama, data["sft"], out, *base, change)
    # logging and saving may change; the finished adapter is kept as it is
    again, meta2 = train("sft", llama, data["sft"], out, *base, "trainer.logging_steps=2")
    assert again == adapter and meta2 == meta
    first = json.loads((out / "lhd_run.json").read_text())
    assert first["recipe"]["trainer"]["logging_steps"] == 1  # the first run's record is kept


# ----------------------------------------------------------------------------- GPU-node rules (issue 20)


def _run_with_auditor(tmp_path: Path, auditor: dict, supervisor: dict | None = None) -> Path:
    """A run directory holding only its resolved config: what the judged rewards read at preflight."""
    from lhd_train.config.run import parse_config
    from lhd_train.rundir.layout import RunDir
    from lhd_train.rundir.run import Run

    cfg = parse_config({
        "run_name": "judged", "output_dir": str(tmp_path), "seeds": [1],
        "models": {"big": auditor, "sup": supervisor or auditor, "perf": {"backend": "hf", "model": "x"}},
        "performer": {"model": "perf"}, "supervisor": {"model": "sup"}, "auditor": {"model": "big"},
    }, "test")
    rd = RunDir(cfg.run_dir)
    rd.config.parent.mkdir(parents=True, exist_ok=True)
    Run.at(rd.path).write_config(cfg.model_dump(mode="json"))
    return cfg.run_dir


@pytest.mark.model  # loads the tiny Llama (and trains it)
def test_judged_reward_never_starts_a_model_inside_a_training_rank(llama, tmp_path):
    """H3: a judge built from the run's vllm or hf auditor is refused before any model loads, with the
    two commands to run instead; an endpoint the user started (openai, 127.0.0.1) is accepted."""
    from datasets import Dataset

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import build_trainer

    big = {"backend": "vllm", "model": "Qwen/Qwen2.5-72B-Instruct", "tensor_parallel_size": 4,
           "max_model_len": 32768}
    rundirs = {"vllm": _run_with_auditor(tmp_path / "v", big),
               "hf": _run_with_auditor(tmp_path / "h", {"backend": "hf", "model": str(llama)})}
    recipe_path = RECIPES / "tiny" / "grpo-honest.yaml"

    def recipe(run_dir: Path, *ov: str):
        data = tmp_path / f"data-{run_dir.parent.name}"
        Dataset.from_list([{"prompt": prompt(i), "run_dir": str(run_dir), "trial_id": "s1", "global_round": i + 1}
                           for i in range(4)]).save_to_disk(str(data))
        return load_recipe(recipe_path, [f"model={llama}", f"data.train={data}", f"output_dir={tmp_path / 'o'}",
                                         "wandb.enabled=false", *ov])

    import trl

    built = []
    real_init = trl.GRPOTrainer.__init__

    def spy(self, *a, **kw):
        built.append(1)
        return real_init(self, *a, **kw)

    trl.GRPOTrainer.__init__ = spy
    try:
        msg = _error(build_trainer, recipe(rundirs["vllm"]), recipe_path, str(recipe_path))
        assert "'grpo.judge'" in msg and "every training rank" in msg
        assert ("1. CUDA_VISIBLE_DEVICES=<GPUs the trainer does not use> vllm serve Qwen/Qwen2.5-72B-Instruct "
                "--port 8001 --tensor-parallel-size 4 --max-model-len 32768") in msg
        assert (f"2. lhd train grpo {recipe_path} grpo.judge.base_url=http://127.0.0.1:8001/v1 "
                "grpo.judge.model=Qwen/Qwen2.5-72B-Instruct") in msg
        msg = _error(build_trainer, recipe(rundirs["hf"]), recipe_path, str(recipe_path))
        assert "(hf: " in msg and f"vllm serve {llama} --port 8001" in msg
        msg = _error(build_trainer, recipe(rundirs["hf"], "grpo.rewards=[{name: satisfaction}]",
                                           "grpo.judge.base_url=http://127.0.0.1:8001/v1", "grpo.judge.model=m"),
                     recipe_path, str(recipe_path))
        assert "'grpo.supervisor_judge'" in msg
        assert not built, "the trainer was constructed (models loaded) before the refusal"

        trainer, _ = build_trainer(recipe(rundirs["vllm"], "grpo.judge.base_url=http://127.0.0.1:8001/v1",
                                          "grpo.judge.model=Qwen/Qwen2.5-72B-Instruct"), recipe_path)
    finally:
        trl.GRPOTrainer.__init__ = real_init
    honesty = trainer.reward_funcs[0]
    judge = honesty.setup.judge_for({"run_dir": [str(rundirs["vllm"])]})
    assert judge.training and judge.judge.backend == "openai" and judge.judge.base_url == "http://127.0.0.1:8001/v1"
    assert judge.judge.model == "Qwen/Qwen2.5-72B-Instruct"


def test_single_process_on_a_multi_gpu_node_loads_the_base_on_one_gpu(monkeypatch, tmp_path):
    """M3: TRL's device_map="auto" would spread the base over every visible GPU (naive model parallel)."""
    import torch

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import trainer_arguments

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = RECIPES / "llama-3.1-8b-instruct" / "sft-honest.yaml"

    def kwargs(*ov: str) -> dict:
        args, _ = trainer_arguments(load_recipe(path, list(ov)), tmp_path, cuda=True, dtype="bfloat16",
                                    source=str(path), reward_weights=None)
        return args["model_init_kwargs"]

    assert kwargs()["device_map"] == {"": 3}
    assert kwargs("trainer.model_init_kwargs={device_map: auto}")["device_map"] == "auto"  # the recipe says
    monkeypatch.setenv("WORLD_SIZE", "8")  # accelerate/torchrun: TRL sets device_map=None itself
    assert "device_map" not in kwargs()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "device_map" not in kwargs()


def test_gpu_grpo_recipes_generate_without_vllm_and_name_only_real_extras(monkeypatch, tmp_path):
    """H2: TRL 1.16 imports vLLM in the trainer in colocate and server mode alike; the shipped recipes
    generate with transformers, are sized for long prompts, and the error names no missing extra."""
    import importlib.util
    import re
    import tomllib

    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune import trainer_args

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for path in sorted(RECIPES.glob("*/grpo-*.yaml")):
        r = load_recipe(path)
        if "tiny" in path.parts:
            continue
        t = r.trainer
        assert t["use_vllm"] is False and t["per_device_train_batch_size"] <= 2, path
        assert r.section.max_length and t["vllm_max_model_length"] == r.section.max_length, path
        assert r.section.judge is not None and r.section.judge.base_url.startswith("http://127.0.0.1:"), path
        assert "keep_end" not in path.read_text()
    for path in sorted(RECIPES.glob("*/dpo-*.yaml")):
        assert load_recipe(path).trainer.get("truncation_mode", "keep_start") == "keep_start", path  # L9

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    monkeypatch.setattr(trainer_args, "single_process_device_map", lambda: None)
    path = RECIPES / "qwen2.5-7b-instruct" / "grpo-honest.yaml"
    msg = _error(trainer_args.trainer_arguments, load_recipe(path, ["trainer.use_vllm=true"]), tmp_path, True,
                 "bfloat16", str(path), [1.0, 0.1])
    assert "'trainer.use_vllm'" in msg and "trainer.use_vllm=false" in msg
    for extra in re.findall(r"lhd\[([\w-]+)\]", msg):
        assert extra in extras, f"the message names lhd[{extra}], which pyproject.toml does not define"
    assert "lhd[vllm]" not in msg


def test_recipes_refuse_lora_settings_vllm_cannot_load():
    """L10: vLLM refuses DoRA, bias, modules_to_save and ranks above its largest max_lora_rank when it
    loads an adapter, which kills a managed server at start-up: refuse them when training instead."""
    from lhd_train.config.recipe import load_recipe

    path = RECIPES / "tiny" / "sft-honest.yaml"
    for ov, word in (("lora.use_dora=true", "DoRA"), ("lora.bias=all", "bias"),
                     ("lora.modules_to_save=[lm_head]", "modules_to_save"), ("lora.r=1024", "512")):
        msg = _error(load_recipe, path, [ov])
        assert "'lora'" in msg and word in msg and "lora.for_vllm=false" in msg, msg
        load_recipe(path, [ov, "lora.for_vllm=false"])  # an adapter only PEFT will load
    load_recipe(path, ["lora.r=512"])


@pytest.mark.vllm
def test_lora_refusals_match_vllms_own_adapter_check(tmp_path, vllm_python):
    """The same LoRA settings, saved by PEFT, through vLLM 0.32's own PEFTHelper (.venv-vllm, the
    session's interpreter)."""
    from lhd_train.config.recipe import load_recipe
    from lhd_train.finetune.trainer import lora_config

    path = RECIPES / "tiny" / "sft-honest.yaml"
    cases = [[], ["lora.r=512"], ["lora.use_dora=true"], ["lora.bias=all"], ["lora.modules_to_save=[lm_head]"],
             ["lora.r=1024"]]
    configs = []
    for ov in cases:
        lhd_ok = True
        try:
            load_recipe(path, ov)
        except Exception:
            lhd_ok = False
        cfg = lora_config(load_recipe(path, [*ov, "lora.for_vllm=false"])).to_dict()
        configs.append((lhd_ok, json.loads(json.dumps(cfg, default=lambda o: sorted(o) if isinstance(o, set)
                                                     else str(o)))))
    script = ("import json,sys\nfrom vllm.lora.peft_helper import PEFTHelper\nfrom vllm.config.lora import LoRAConfig\n"
              "out=[]\nfor c in json.load(sys.stdin):\n  try:\n"
              "    PEFTHelper.from_dict(c).validate_legal(LoRAConfig(max_lora_rank=512)); out.append(True)\n"
              "  except ValueError: out.append(False)\nprint(json.dumps(out))\n")
    r = vllm_python.run([vllm_python.python, "-c", script], input=json.dumps([c for _, c in configs]))
    assert r.returncode == 0, r.stderr[-2000:]
    vllm_ok = json.loads(r.stdout.strip().splitlines()[-1])
    assert vllm_ok == [ok for ok, _ in configs], list(zip(cases, vllm_ok, strict=True))


def test_a_local_judge_gets_the_backends_defaults():
    """`grpo.judge` without max_in_flight/timeout_s: the openai backend's defaults for where the
    endpoint is (a recipe default of 600 s used to cut a local 72B judge's long requests)."""
    from lhd_train.config.algos import JudgeEndpoint
    from lhd_train.finetune.judged_rewards import endpoint_spec
    from rollouts.openai_backend import max_in_flight, request_timeout_s

    local = endpoint_spec(JudgeEndpoint(base_url="http://127.0.0.1:8001/v1", model="m"))
    assert request_timeout_s(local) == 3600 and max_in_flight(local) == 32
    remote = endpoint_spec(JudgeEndpoint(base_url="https://api.example.org/v1", model="m"))
    assert request_timeout_s(remote) == 600
    set_ = endpoint_spec(JudgeEndpoint(base_url="http://127.0.0.1:8001/v1", model="m", timeout_s=5, max_in_flight=2))
    assert request_timeout_s(set_) == 5 and max_in_flight(set_) == 2
