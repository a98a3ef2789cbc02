"""The lens commands' settings models (lhd_train/cli/lens_options.py) are built on the library's own
(lens/settings.py): an option has one default, one help text and one bound, and the library takes
the parsed settings as they are; and the lens commands log through the one boundary's handler, one
logger per module."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from lens.corpus import CorpusSpec
from lens.fidelity import EvalConfig
from lens.fit import FitOptions, FitSettings
from lens.settings import CorpusTexts, FitArgs, QualitySettings, parse_layers
from lens.tuned import TuneOptions, TuneSettings
from lhd_train.cli.lens_options import EvalCommand, FitCommand, ReadCommand, TuneCommand
from lhd_train.config.flags import cli_fields, flag_of
from lhd_train.config.lens import ReadSettings

ROOT = Path(__file__).resolve().parents[2]

LIBRARY = {FitCommand: (FitSettings, FitOptions, CorpusTexts), TuneCommand: (TuneSettings, TuneOptions, CorpusTexts),
           EvalCommand: (CorpusTexts, QualitySettings)}
# knobs no command line sets: the BOS switch, a test's stop switches, the CUDA overlap, a step cadence
LIBRARY_ONLY = {FitSettings: {"force_bos"}, FitOptions: {"stop_after", "overlap_sums"}, TuneSettings: {"force_bos"},
                TuneOptions: {"stop_after", "checkpoint_every"}, CorpusTexts: set(), QualitySettings: set()}


@pytest.mark.parametrize("command", list(LIBRARY))
def test_every_library_setting_is_declared_once_and_is_an_option(command):
    """Each library field is the command's own field (the same FieldInfo: default, help, bounds), and every one
    but the library-only knobs is a flag."""
    for library in LIBRARY[command]:
        assert issubclass(command, library)
        for name, info in library.model_fields.items():
            assert repr(command.model_fields[name]) == repr(info), (command.__name__, name)
            assert (name in cli_fields(command)) == (name not in LIBRARY_ONLY[library]), (command.__name__, name)


def test_the_library_takes_the_parsed_command_line():
    """No copy between the two: the command's settings are the library's, layer lists as their spec."""
    cmd = FitCommand(model="m", source_layers="0,2-3", n_prompts=7, chat=True, min_chars=5)
    assert isinstance(cmd, FitSettings) and isinstance(cmd, FitOptions) and parse_layers(cmd.source_layers) == [0, 2, 3]
    spec = CorpusSpec.of(cmd, "c.txt")
    assert spec == CorpusSpec(path="c.txt", n_prompts=7, chat=True, min_chars=5)
    assert FitSettings(source_layers=[1, 4]).source_layers == "1,4" and FitSettings().source_layers == "all"
    assert TuneSettings(layers=None).layers == "all"
    assert FitSettings().dim_batch is None  # the fit picks 64, the command the plan's
    with pytest.raises(ValidationError, match="skip_first"):
        FitSettings(skip_first=16, max_length=16)  # the library's own bound, not only the command line's
    assert set(FitArgs.model_fields) < set(FitCommand.model_fields)
    assert EvalConfig(**EvalCommand(model="m", out=Path("o"), corpus=Path("c"), n_boot=7).model_dump(
        include=set(QualitySettings.model_fields))).n_boot == 7
    assert flag_of("n_boot", EvalCommand.model_fields["n_boot"]) == "--bootstrap"  # the flag keeps its name


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
