"""`lhd doctor`: is this machine ready for a stage? One row per check: (check, ok|warn|fail, detail).

Never imports vllm (or trl): versions and requirements come from package metadata only, so the
check is fast and works where vllm cannot even be imported (a CPU box, a broken CUDA stack)."""
from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

Row = tuple[str, str, str]
OK, WARN, FAIL = "ok", "warn", "fail"

# TRL's supported vLLM range when TRL's own source cannot be read (trl/import_utils.py states it).
TRL_VLLM_RANGES = {"1.16": ("0.22.0", "0.31.0")}
# Packages checked against vllm's own pins (the ones that break it when they drift).
VLLM_PINNED = ("torch", "transformers", "tokenizers", "xgrammar", "torchvision", "torchaudio", "triton",
               "flashinfer-python", "outlines_core", "llguidance", "numba")
REQUIRED = ("transformers", "peft", "trl", "accelerate", "datasets", "xgrammar")
OPTIONAL = ("vllm", "deepspeed", "bitsandbytes", "wandb", "flash-attn")
DISK_WARN_GB, DISK_FAIL_GB = 100.0, 10.0


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _parse(v: str):
    from packaging.version import Version

    return Version(v)


def check_python() -> Row:
    v = sys.version.split()[0]
    ok = sys.version_info >= (3, 11)
    return ("python", OK if ok else FAIL, f"{v} ({sys.executable})" + ("" if ok else "; lhd needs >= 3.11"))


def check_torch() -> list[Row]:
    rows: list[Row] = []
    if _version("torch") is None:
        return [("torch", FAIL, "not installed (pip install the torch build matching your CUDA driver)")]
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken install is exactly what doctor reports
        return [("torch", FAIL, f"installed but does not import: {type(e).__name__}: {e}")]
    cuda_build = torch.version.cuda
    avail = torch.cuda.is_available()
    detail = f"{torch.__version__}, CUDA build {cuda_build or 'none (CPU wheel)'}"
    if avail:
        rows.append(("torch", OK, detail + f", CUDA available (runtime {cuda_build}, "
                     f"cuDNN {torch.backends.cudnn.version()})"))
    elif cuda_build:
        rows.append(("torch", WARN,
                     detail + ", but no GPU is visible (driver, CUDA_VISIBLE_DEVICES, or not a GPU node)"))
    else:
        rows.append(("torch", WARN, detail + ": CPU only (fine for tests and the tiny demo, not for real models)"))
    if avail:
        n = torch.cuda.device_count()
        gpus = []
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            mem = f"{p.total_memory / 2**30:.0f} GiB"
            try:
                free, _ = torch.cuda.mem_get_info(i)
                mem += f", {free / 2**30:.0f} GiB free"
            except Exception:  # noqa: BLE001
                pass
            gpus.append(f"{i}: {p.name} ({mem}, sm_{p.major}{p.minor})")
        bf16 = torch.cuda.is_bf16_supported()
        rows.append(("gpus", OK if bf16 else WARN, f"{n}: " + "; ".join(gpus)
                     + ("" if bf16 else "; no bf16 support: recipes fall back to fp16")))
    else:
        rows.append(("gpus", WARN, "none visible" + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r})"
                                                     if "CUDA_VISIBLE_DEVICES" in os.environ else "")))
    return rows


def check_packages() -> list[Row]:
    rows: list[Row] = []
    for name in REQUIRED:
        v = _version(name)
        rows.append((name, OK if v else FAIL, v or "not installed (pip install -e .)"))
    for name in OPTIONAL:
        v = _version(name)
        why = {"vllm": "GRPO generating with vLLM in-process; the `vllm` backend only needs the `vllm` "
               "executable, see the `vllm server` row", "deepspeed": "configs/accelerate/zero3.yaml",
               "bitsandbytes": "QLoRA (qlora: true)", "wandb": "wandb logging",
               "flash-attn": "attn_implementation=flash_attention_2"}[name]
        rows.append((name, OK if v else WARN, v or f"not installed (needed for {why})"))
    return rows


def trl_vllm_range() -> tuple[str, str] | None:
    """TRL's supported vLLM range, read from TRL's own source (no import), else the known table."""
    trl = _version("trl")
    if trl is None:
        return None
    try:
        src = Path(str(md.distribution("trl").locate_file("trl/import_utils.py"))).read_text(encoding="utf-8")
        m = re.search(r'Version\("([\d.]+)"\)\s*<=\s*_vllm\w*\s*<=\s*Version\("([\d.]+)"\)', src)
        if m:
            return m.group(1), m.group(2)
    except (OSError, md.PackageNotFoundError):
        pass
    return TRL_VLLM_RANGES.get(".".join(trl.split(".")[:2]))


def check_trl_vllm() -> Row:
    trl, vllm = _version("trl"), _version("vllm")
    if vllm is None:
        return ("trl/vllm", OK, "vLLM is not importable in lhd's environment: GRPO generates with transformers, as "
                "the shipped recipes do; a recipe with `use_vllm: true` fails here (TRL 1.16 needs vLLM in the "
                "trainer's environment, and no vLLM it supports accepts lhd's pins: docs/training.md)")
    if trl is None:
        return ("trl/vllm", OK, f"vllm {vllm}, trl not installed")
    rng = trl_vllm_range()
    if rng is None:
        return ("trl/vllm", WARN, f"trl {trl} with vllm {vllm}: supported range unknown for this TRL")
    lo, hi = rng
    base = _parse(_parse(vllm).base_version)
    if _parse(lo) <= base <= _parse(hi):
        return ("trl/vllm", OK, f"trl {trl} supports vllm {lo}-{hi}; installed {vllm}")
    return ("trl/vllm", WARN, f"trl {trl} supports vllm {lo}-{hi} but {vllm} is installed: GRPO's vLLM "
            "generation may break (rollouts through `vllm serve` are not affected)")


def check_vllm_requirements() -> list[Row]:
    """Installed versions against the installed vllm's own pins (Requires-Dist), metadata only."""
    vllm = _version("vllm")
    if vllm is None:
        return []
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    bad, good, other_bad = [], [], []
    pinned = {canonicalize_name(n) for n in VLLM_PINNED}
    for raw in md.requires("vllm") or []:
        try:
            req = Requirement(raw)
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = _version(req.name)
        name = canonicalize_name(req.name)
        if have is None:
            if name in pinned:
                bad.append(f"{req.name} missing (vllm wants {req.specifier or 'any'})")
            else:
                other_bad.append(f"{req.name} missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            msg = f"{req.name} {have} (vllm {vllm} wants {req.specifier})"
            (bad if name in pinned else other_bad).append(msg)
        elif name in pinned:
            good.append(f"{req.name} {have}")
    rows: list[Row] = []
    if bad:
        rows.append(("vllm pins", FAIL, "; ".join(bad) + ". vLLM pins exact versions: keep it in its own venv "
                     "(the `vllm` backend only needs the `vllm` executable) or install the versions it wants"))
    else:
        rows.append(("vllm pins", OK, f"vllm {vllm}: " + (", ".join(good) or "no pinned package checked")))
    if other_bad:
        rows.append(("vllm deps", WARN, f"{len(other_bad)} other requirement(s) of vllm not met: "
                     + "; ".join(other_bad[:8]) + (" ..." if len(other_bad) > 8 else "")))
    return rows


def check_gpu_toolchain() -> list[Row]:
    """On a GPU node: a C compiler (Triton builds its launcher at run time: xgrammar's CUDA mask
    kernel, bitsandbytes) and bitsandbytes' import (QLoRA)."""
    from rollouts import gpus

    if not gpus.cuda_visible():
        return []
    cc = next((p for p in (os.environ.get("CC"), shutil.which("cc"), shutil.which("gcc"), shutil.which("clang"))
               if p), None)
    rows: list[Row] = [("c compiler", OK if cc else FAIL, cc or "none (cc, gcc, clang, $CC): Triton cannot build "
                        "its kernels, so JSON-schema decoding on CUDA (xgrammar) fails; load a gcc module")]
    if _version("bitsandbytes") is None:
        rows.append(("bitsandbytes", WARN, "not installed: QLoRA recipes (qlora: true) cannot run"))
    else:
        try:
            import bitsandbytes  # noqa: F401

            rows.append(("bitsandbytes", OK, f"{_version('bitsandbytes')} imports"))
        except Exception as e:  # noqa: BLE001
            rows.append(("bitsandbytes", FAIL, f"installed but does not import: {type(e).__name__}: {e}"))
    return rows


def check_disk(path: str | Path = ".") -> Row:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    usage = shutil.disk_usage(p)
    free = usage.free / 1e9
    detail = f"{free:.0f} GB free of {usage.total / 1e9:.0f} GB at {p.resolve()}"
    if free < DISK_FAIL_GB:
        return ("disk", FAIL, detail + f" (< {DISK_FAIL_GB:.0f} GB: checkpoints and run dirs will not fit)")
    if free < DISK_WARN_GB:
        return ("disk", WARN, detail + f" (< {DISK_WARN_GB:.0f} GB: a 70B model alone is ~140 GB, a full 8B "
                "checkpoint with optimizer state ~100 GB; LoRA checkpoints are small)")
    return ("disk", OK, detail)


def hub_cache_dir() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except Exception:  # noqa: BLE001
        home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
        return Path(home) / "hub"


def _config_models(config: Path) -> list[tuple[str, str, str | None, str]]:
    """(label, model, revision, what) for every model a run config, auditor config, model config or
    training recipe names: `what` is weights (loaded on this machine), endpoint (served by someone
    else) or tokenizer (the tokenizers of served models included)."""
    import yaml

    from rollouts.backends import BACKENDS

    data = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    out: list[tuple[str, str, str | None, str]] = []
    models = data.get("models") if isinstance(data, dict) else None
    if isinstance(models, dict):
        for key, spec in models.items():
            if not isinstance(spec, dict) or "model" not in spec:
                continue
            backend = BACKENDS.get(str(spec.get("backend")))
            what = "endpoint" if backend is not None and not (backend.managed or backend.in_process) else "weights"
            out.append((key, str(spec["model"]), spec.get("revision"), what))
            if spec.get("tokenizer"):
                out.append((f"{key} tokenizer", str(spec["tokenizer"]), spec.get("revision"), "tokenizer"))
    elif isinstance(data, dict) and "model" in data:
        out.append(("recipe model", str(data["model"]), data.get("revision"), "weights"))
        if data.get("tokenizer"):
            out.append(("recipe tokenizer", str(data["tokenizer"]), data.get("revision"), "tokenizer"))
    return out


def check_models(config: Path) -> list[Row]:
    """Every model of `config`: a local folder needs config.json (or tokenizer files for a tokenizer);
    a hub id must be in the hub cache (HF_HOME) with config.json and weights, as jobs run offline."""
    from lhd_train.errors import InputError

    config = Path(config)
    if not config.is_file():
        raise InputError(config, None, "config file not found")
    rows: list[Row] = []
    cache = hub_cache_dir()
    base = config.parent
    for label, model, revision, what in _config_models(config):
        name = f"model {label}"
        if what == "endpoint":
            rows.append((name, OK, f"{model}: served by a remote endpoint, not checked here"))
            continue
        local = Path(model).expanduser()
        if not local.is_absolute() and (base / local).exists():
            local = base / local
        if local.exists() or model.startswith((".", "/", "~")):
            if what == "tokenizer":
                found = any((local / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
            else:
                found = (local / "config.json").is_file()
            rows.append((name, OK if found else FAIL,
                         f"{local}: " + ("found" if found else "no config.json / tokenizer files there")))
            continue
        repo = cache / ("models--" + model.replace("/", "--"))
        snaps = sorted((repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
        if revision and re.fullmatch(r"[0-9a-f]{40}", revision):
            snaps = [s for s in snaps if s.name == revision]
        elif revision and (repo / "refs" / revision).is_file():
            ref = (repo / "refs" / revision).read_text().strip()
            snaps = [s for s in snaps if s.name == ref] or snaps
        ok_snaps = [s for s in snaps if (s / "config.json").exists() or
                    (what == "tokenizer" and (s / "tokenizer_config.json").exists())]
        if not ok_snaps:
            rows.append((name, FAIL, f"{model}{'@' + revision if revision else ''} is not in {cache} "
                         "(download it on a node with network: `hf download " + model + "`; jobs run offline)"))
            continue
        snap = ok_snaps[-1]
        if what != "tokenizer":
            weights = list(snap.glob("*.safetensors")) + list(snap.glob("*.bin"))
            index = list(snap.glob("*.safetensors.index.json"))
            if not weights:
                rows.append((name, FAIL, f"{model}: config in {snap} but no weight files (incomplete download)"))
                continue
            if index:
                import json

                try:
                    want = set(json.loads(index[0].read_text())["weight_map"].values())
                except (OSError, ValueError, KeyError):
                    want = set()
                missing = sorted(w for w in want if not (snap / w).exists())
                if missing:
                    rows.append((name, FAIL, f"{model}: {len(missing)} of {len(want)} weight shards missing in {snap}"))
                    continue
            size = sum(w.stat().st_size for w in weights if w.exists()) / 1e9
            rows.append((name, OK, f"{model}: in the hub cache ({snap.name[:12]}, {size:.1f} GB of weights)"))
        else:
            rows.append((name, OK, f"{model}: tokenizer in the hub cache"))
    if not rows:
        rows.append(("models", WARN, f"{config}: no `models:` entries or recipe `model:` found"))
    return rows


def check_hf_env() -> Row:
    home = os.environ.get("HF_HOME")
    offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True", "YES", "yes")
    detail = f"hub cache {hub_cache_dir()}" + (f" (HF_HOME={home})" if home else " (HF_HOME unset: default)")
    detail += "; HF_HUB_OFFLINE=1" if offline else "; HF_HUB_OFFLINE unset: jobs would try the Hub"
    return ("hf cache", OK if offline else WARN, detail)


def check_chromium() -> Row:
    try:
        from lhd_train.report.chromium import find_chromium

        path = find_chromium()
    except Exception:  # noqa: BLE001
        path = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)),
                    None)
    return ("chromium", OK if path else WARN,
            path or "not found: report screenshot tests skip (apt-get install chromium, or LHD_CHROMIUM=PATH)")


def check_slurm() -> Row:
    exe = shutil.which("sbatch")
    job = os.environ.get("SLURM_JOB_ID")
    if job:
        return ("slurm", OK, f"inside job {job} on {os.environ.get('SLURM_JOB_NODELIST', '?')}")
    return ("slurm", OK if exe else WARN,
            f"sbatch at {exe}" if exe else "no sbatch on PATH (render scripts here, submit on the cluster)")


def _groups(data: dict, specs: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The sets of models one process starts together: `lhd run`'s roles, `lhd audit`'s auditor,
    `lhd data`'s both; a file of bare `models:` entries is one set. Role adapters are added as `lhd run` adds them."""
    run_keys: dict[str, Any] = {}
    for role in ("performer", "supervisor", "summariser"):
        rc = data.get(role) if isinstance(data.get(role), dict) else None
        if rc and rc.get("model") in specs:
            spec = run_keys.get(rc["model"], specs[rc["model"]])
            run_keys[rc["model"]] = spec.with_adapter(rc["adapter"]) if rc.get("adapter") else spec
    out = [("lhd run", run_keys)] if run_keys else []
    auditor = data.get("auditor") if isinstance(data.get("auditor"), dict) else None
    if auditor and auditor.get("model") in specs:
        key = auditor["model"]
        out.append(("lhd audit", {key: specs[key]}))
        if run_keys and key not in run_keys:  # `lhd data` samples and grades at once
            out.append(("lhd data", {**run_keys, key: specs[key]}))
    return out or [("models", specs)]


def check_config(config: str | Path, gpu_gib: float | None = None) -> list[Row]:
    """`lhd doctor --config`: each entry read as `lhd run` reads it, the GPU assignment of each set of
    models started together, and each backend's rows for its entries (for vLLM: vLLM's verdict,
    judged for cuda unless the entry says device: cpu, and whether its KV cache holds a sequence)."""
    import yaml

    from lhd_train.errors import field_path
    from rollouts.backends import check_gpus, config_rows, parse_spec
    from rollouts.gpus import GpuAssignmentError, gpu_count

    data = yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}
    specs: dict[str, Any] = {}
    rows: list[Row] = []
    for key, entry in ((data.get("models") or {}) if isinstance(data, dict) else {}).items():
        try:
            specs[key] = parse_spec(entry)
        except ValueError as e:  # pydantic's ValidationError, naming the field
            errors = e.errors(include_url=False) if hasattr(e, "errors") else [{"loc": (), "msg": str(e)}]
            rows += [(f"config {key}", FAIL, f"{config}: field '{field_path(('models', key, *err['loc']))}': "
                      f"{err['msg']}") for err in errors]
    if not specs:
        return rows
    visible = gpu_count()
    for stage, group in _groups(data, specs):
        try:
            claims = check_gpus(group, visible or 1 << 16)  # no GPU here: what the config says of itself
            where = "; ".join(f"{k}: position(s) {','.join(map(str, c.positions))}" for k, c in claims.items())
            rows.append((f"gpus ({stage})", OK, f"{visible} GPU(s) visible; {where or 'no model on a GPU'}")
                        if visible else (f"gpus ({stage})", WARN, "no GPU visible here: GPU counts not checked (run "
                                         "doctor on the GPU node); no GPU is given to two models"))
        except GpuAssignmentError as e:
            rows.append((f"gpus ({stage})", FAIL, f"{config}: field 'models.{e.key}.{e.field}': {e.problem}"))
    return rows + config_rows(specs, str(config), gpu_gib)


def doctor(config: str | Path | None = None, path: str | Path = ".", gpu_gib: float | None = None) -> list[Row]:
    """All checks; `config` (optional) adds one row per model it names, the GPU assignment, and each
    backend's rows for its models (for vLLM: each server's KV cache on a GPU of `gpu_gib`, default
    the visible one, and vLLM's own verdict); `path` is where checkpoints and run dirs go (free disk)."""
    from rollouts.backends import machine_rows

    rows: list[Row] = [check_python()]
    for fn in (check_torch, check_packages, check_vllm_requirements, machine_rows, check_gpu_toolchain):
        try:
            rows += fn()
        except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
            rows.append((fn.__name__.removeprefix("check_"), FAIL, f"{type(e).__name__}: {e}"))
    for fn1 in (check_trl_vllm, lambda: check_disk(path), check_hf_env, check_slurm, check_chromium):
        try:
            rows.append(fn1())
        except Exception as e:  # noqa: BLE001
            rows.append(("check", FAIL, f"{type(e).__name__}: {e}"))
    if config is not None:
        rows += check_models(Path(config))
        rows += check_config(Path(config), gpu_gib)
    return rows
