"""The lens commands' settings models (lhd_train/config/lens.py): they fill the library's dataclasses by
field name, so a field renamed on one side must fail here rather than silently fall back to a
library default; and the lens commands log through the one boundary's handler, one logger per
module."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from lens.corpus import CorpusSpec
from lens.fidelity import EvalConfig
from lens.fit import FitOptions, FitSettings
from lens.tuned import TuneOptions, TuneSettings
from lhd_train.config.lens import EvalCommand, FitCommand, ReadCommand, ReadSettings, TuneCommand, parse_layers

ROOT = Path(__file__).resolve().parents[2]

# Library fields no command sets (kept at the library's default), and those the command fills itself.
LIBRARY_ONLY = {
    CorpusSpec: {"skip_headers"},  # path: from --corpus
    FitSettings: {"force_bos"},
    FitOptions: {"stop_after", "overlap_sums"},  # a test's stop switch; overlap is decided by the device (on for CUDA)
    TuneSettings: {"force_bos"},
    TuneOptions: {"stop_after", "checkpoint_every"},  # a test's stop switch; a step cadence (time is the option)
}
FILLED_BY_COMMAND = {CorpusSpec: {"path"}, FitSettings: set(), FitOptions: set(),
                     TuneSettings: {"layers"}, TuneOptions: set()}  # layers: parsed from --layers
COMMAND = {CorpusSpec: FitCommand, FitSettings: FitCommand, FitOptions: FitCommand,
           TuneSettings: TuneCommand, TuneOptions: TuneCommand}


@pytest.mark.parametrize("library", [CorpusSpec, FitSettings, FitOptions, TuneSettings, TuneOptions])
def test_every_library_setting_is_a_command_option(library):
    names = {f.name for f in fields(library)}
    missing = names - set(COMMAND[library].model_fields) - LIBRARY_ONLY[library] - FILLED_BY_COMMAND[library]
    assert not missing, f"{library.__name__} fields no option fills: {sorted(missing)}"


def test_eval_options_cover_the_corpus_and_the_eval():
    corpus = {f.name for f in fields(CorpusSpec)} - {"path", "skip_headers", "n_prompts", "chat"}
    assert corpus <= set(EvalCommand.model_fields)
    # chat and force_bos come from the lens's sidecar, n_boot from --bootstrap, messages from --format,
    # layers from --eval-layers
    assert {f.name for f in fields(EvalConfig)} - set(EvalCommand.model_fields) == {"chat", "force_bos", "n_boot",
                                                                                     "messages", "layers"}


def test_defaults_match_the_library_where_both_have_one():
    """The command's default is the library's, except where the command decides (dim_batch: the
    plan picks it; n_prompts: the command reads the first 100, the library every text)."""
    cmd = FitCommand(model="m")
    lib = {**vars(FitSettings()), **vars(FitOptions()), **vars(CorpusSpec(path="x"))}
    differ = {k for k, v in lib.items() if k in FitCommand.model_fields and getattr(cmd, k) != v}
    assert differ == {"dim_batch", "n_prompts", "source_layers"}  # source_layers: "all" is None
    assert parse_layers(cmd.source_layers) is None
    tune = TuneCommand(model="m", corpus=Path("c"), out=Path("o"))
    assert {k for k, v in vars(TuneSettings()).items() if k in TuneCommand.model_fields and getattr(tune, k) != v} \
        == {"layers"}  # "all" is None
    assert all(getattr(tune, k) == v for k, v in vars(TuneOptions()).items() if k in TuneCommand.model_fields)


def test_the_read_settings_are_declared_once():
    """The reading pipeline takes `lhd lens read`'s own settings model: every setting is an option with the
    same default, help and bound (no second copy with a default of its own)."""
    assert issubclass(ReadCommand, ReadSettings)
    assert {n: repr(ReadCommand.model_fields[n]) for n in ReadSettings.model_fields} == \
        {n: repr(f) for n, f in ReadSettings.model_fields.items()}
    read = ReadCommand(model="m", out=Path("o"), run=Path("r"))
    assert read.model_dump(include=set(ReadSettings.model_fields)) == ReadSettings().model_dump()
    with pytest.raises(ValidationError, match="band_start"):
        ReadSettings(band_start=0.9, band_end=0.1)


@pytest.mark.parametrize(("given", "field"), [
    ({"method": "batched"}, "method"), ({"dtype": "fp64"}, "dtype"), ({"format": "csv"}, "format"),
    ({"source_layers": "1-x"}, "source_layers"), ({"skip_first": 128}, "skip_first"), ({"n_prompts": 0}, "n_prompts"),
])
def test_fit_settings_refuse_what_the_fit_cannot_use(given, field):
    with pytest.raises(ValidationError) as e:
        FitCommand(model="m", **given)
    assert field in str(e.value)


@pytest.mark.model  # `python -m lhd_train.cli` in a subprocess
def test_lens_logs_through_the_boundary_one_logger_per_module(tmp_path):
    """`python -m lhd_train.cli lens`: the warning comes from the command module's logger, formatted by the
    handler the boundary configures (the module used to set up its own, on the logger `lens`)."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("a paragraph of text\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "lhd_train.cli", "lens", "fit", str(tmp_path / "no-model"), "--corpus",
                          str(corpus), "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "WARNING lhd_train.cli.lens: no memory plan" in res.stderr and "Traceback" not in res.stderr, res.stderr
