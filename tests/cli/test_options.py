"""Settings declared once (issue 23, item 5): a command's flags come from its pydantic model
(`lhd_train.cli.options.settings_command`), a refused value names its flag, and the Slurm stages take
the same model's fields as variables and render them as the same flags (`config.flags.to_argv`):
the job's command line parses back to what the variables say, and an unset variable is the
command's own default."""
from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Literal

import pytest
import typer
from pydantic import BaseModel, Field, model_validator
from typer.main import get_command
from typer.testing import CliRunner

from lens.settings import FitArgs
from lhd_train.cli.boundary import GuardedGroup
from lhd_train.cli.data import data_app
from lhd_train.cli.lens import app as lens_app
from lhd_train.cli.lens_options import FitCommand
from lhd_train.cli.options import parse_settings, settings_command
from lhd_train.config.data import BuildSettings, DataOptions
from lhd_train.config.flags import cli_fields, to_argv
from lhd_train.errors import InputError
from lhd_train.ops.slurm import dry_run_commands, render_slurm
from lhd_train.ops.slurm_vars import DataVars, LensVars, stage_vars

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


class Toy(BaseModel):
    """One field of each kind the bridge handles."""

    source: Path = Field(description="an input", json_schema_extra={"argument": True})
    extra: list[str] = Field([], description="more words", json_schema_extra={"argument": True})
    n_items: int = Field(3, ge=1, le=10, description="how many")
    mode: Literal["fast", "exact"] = Field("exact", description="how")
    verbose: bool = Field(True, description="talk")
    config_file: Path | None = Field(None, json_schema_extra={"flag": "--config"})
    hidden: int = Field(7, json_schema_extra={"cli": False})
    low: int = 0
    high: int = 5

    @model_validator(mode="after")
    def _ordered(self) -> Toy:
        if self.low > self.high:
            raise ValueError("low: must not be above high")
        return self


def toy_app(seen: list[Toy]) -> typer.Typer:
    app = typer.Typer(cls=GuardedGroup)

    @app.command()
    @settings_command(Toy)
    def go(settings: Toy) -> None:
        """Record the settings."""
        seen.append(settings)

    @app.command()
    def other() -> None:  # a second command, so `go` is a subcommand as in lhd
        pass

    return app


def test_flags_come_from_the_model_and_parse_back_into_it():
    seen: list[Toy] = []
    app = toy_app(seen)
    res = runner.invoke(app, ["go", "in.txt"])
    assert res.exit_code == 0, res.output
    assert seen.pop() == Toy(source=Path("in.txt"))  # every default is the model's
    res = runner.invoke(app, ["go", "in.txt", "a", "b", "--n-items", "10", "--mode", "fast", "--no-verbose",
                              "--config", "c.yaml", "--low", "2"])
    assert res.exit_code == 0, res.output
    assert seen.pop() == Toy(source=Path("in.txt"), extra=["a", "b"], n_items=10, mode="fast", verbose=False,
                             config_file=Path("c.yaml"), low=2)
    assert runner.invoke(app, ["go", "in.txt", "--hidden", "1"]).exit_code == 2  # not on the command line
    help_text = runner.invoke(app, ["go", "--help"]).output
    assert "how many" in help_text and "fast" in help_text and "--config" in help_text


@pytest.mark.parametrize(("args", "flag", "says"), [
    (["--n-items", "0"], "--n-items", "must be >= 1, got 0"),
    (["--n-items", "11"], "--n-items", "must be <= 10, got 11"),
    (["--low", "6"], "--low", "must not be above high"),  # a model-level check names its field
])
def test_a_refused_value_is_one_line_naming_its_flag(args, flag, says):
    seen: list[Toy] = []
    res = runner.invoke(toy_app(seen), ["go", "in.txt", *args])
    assert res.exit_code == 2 and not seen, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert lines == [f"error: command line: field '{flag}': {says}"], res.output


def test_a_literal_names_its_choices():
    res = runner.invoke(toy_app([]), ["go", "in.txt", "--mode", "slow"])
    text = re.sub(r"[│╭╮╰╯─\s]+", " ", res.output)  # typer's error panel, unwrapped
    assert res.exit_code == 2 and "'--mode'" in text and "'slow' is not one of 'fast', 'exact'" in text, text
    with pytest.raises(InputError) as e:  # the same value from a file or a variable
        parse_settings(Toy, {"source": "x", "mode": "slow"}, source="jobs.yaml")
    assert str(e.value) == "jobs.yaml: field '--mode': 'slow' is not allowed (allowed: fast, exact)"


def test_to_argv_parses_back_to_the_same_settings():
    cmd = get_command(toy_app([])).commands["go"]
    toy = Toy(source=Path("s"), extra=["x"], n_items=2, mode="fast", verbose=False, config_file=Path("c"), high=9)
    argv = to_argv(toy)
    assert argv == ["s", "x", "--n-items", "2", "--mode", "fast", "--no-verbose", "--config", "c", "--high", "9"]
    assert parse_settings(Toy, cmd.make_context("go", argv).params) == toy
    assert to_argv(Toy(source=Path("s"))) == ["s"]  # defaults are left to the command


# ----------------------------------------------------------------------------- the real commands


def _params(app: typer.Typer, *path: str) -> dict[str, object]:
    """Each option's default as the command's --help shows it."""
    cmd = get_command(app)
    for name in path:
        cmd = cmd.commands[name]
    return {p.name: p.default for p in cmd.params}


def test_lens_fit_defaults_are_the_slurm_stages():
    shown = _params(lens_app, "fit")
    assert shown["n_prompts"] == 100 and shown["dtype"] == "auto" and shown["max_length"] == 128
    stage = LensVars()
    for name in cli_fields(FitArgs):  # every option of the fit is a variable with the same default
        assert getattr(stage, name) == shown[name], name
    assert "[default: 100]" in runner.invoke(lens_app, ["fit", "--help"], terminal_width=200).output
    with pytest.raises(InputError, match="not a variable"):  # the library's stop switch has no flag to render
        stage_vars("lens", {"stop_after": 3})


def test_data_defaults_are_the_slurm_stages():
    shown = _params(data_app, "dpo")
    stage = DataVars()
    for name in DataOptions.model_fields:
        assert getattr(stage, name) == shown[name], name
    assert {"n", "min_margin", "concurrency", "overrides", "auditor_config"}.isdisjoint(_params(data_app, "grpo"))


def _job_command(lines: list[str], prefix: str) -> list[str]:
    return shlex.split(next(c for c in lines if c.startswith(prefix)))[len(prefix.split()):]


def test_slurm_lens_job_runs_the_fit_the_variables_say(tmp_path):
    model_cfg = ROOT / "configs/models/qwen3-8b.yaml"
    fit = get_command(lens_app).commands["fit"]
    job = _job_command(dry_run_commands("lens", model_cfg, corpus="c.txt", shards=2), "lhd lens fit")
    got = parse_settings(FitCommand, fit.make_context("fit", job).params)
    # nothing set: the job's fit is `lhd lens fit`'s defaults (the stage used to pass 1000 prompts, bfloat16)
    assert got == FitCommand(model="Qwen/Qwen3-8B", corpus=Path("c.txt"), out=Path("lenses/Qwen3-8B-shards/shard0of2"),
                             shard="0/2", device="cuda", progress=False)
    given = {"n_prompts": 300, "skip_first": 4, "chat": True, "source_layers": "0,2-5", "method": "vmap",
             "checkpoint_minutes": 5.5, "resume": False, "format": "jsonl", "dim_batch": 32}
    job = _job_command(dry_run_commands("lens", model_cfg, corpus="c.jsonl", shards=1, device="cpu", **given),
                       "lhd lens fit")
    got = parse_settings(FitCommand, fit.make_context("fit", job).params)
    assert got == FitCommand(model="Qwen/Qwen3-8B", corpus=Path("c.jsonl"), shard="0/1", device="cpu", progress=False,
                             out=Path("lenses/Qwen3-8B-shards/shard0of1"), **given)
    # the sbatch script runs the same words, the array index left to slurm
    script = render_slurm("lens", model_cfg, corpus="c.jsonl", shards=1, device="cpu", **given)
    assert shlex.join(job).replace("0/1", "${SLURM_ARRAY_TASK_ID}/1").split("--out")[0] in script.replace("'", "")


def test_slurm_data_job_runs_the_build_the_variables_say():
    run_cfg = ROOT / "configs/examples/vllm-llama8b.yaml"
    dpo = get_command(data_app).commands["dpo"]
    job = _job_command(dry_run_commands("data", run_cfg), "lhd data dpo")
    got = parse_settings(BuildSettings, dpo.make_context("dpo", job).params)
    assert got == BuildSettings(run_dir=Path("runs/llama8b-vs-qwen72b"),
                                out=Path("runs/llama8b-vs-qwen72b/data/dpo-honest"))
    given = {"n": 6, "direction": "deceptive", "eval_fraction": 0.25, "max_contexts": 9, "min_margin": 2.0,
             "concurrency": 8, "run_auditor": "q72"}
    job = _job_command(dry_run_commands("data", run_cfg, **given), "lhd data dpo")
    got = parse_settings(BuildSettings, dpo.make_context("dpo", job).params)
    assert got == BuildSettings(run_dir=Path("runs/llama8b-vs-qwen72b"),
                                out=Path("runs/llama8b-vs-qwen72b/data/dpo-deceptive"), **given)
    bon = _job_command(dry_run_commands("data", run_cfg, kind="bon", min_margin=2.0), "lhd data bon")
    assert "--min-margin" not in bon  # best-of-N takes no margin


def test_a_bad_variable_is_refused_like_the_flag():
    model_cfg = ROOT / "configs/models/qwen3-8b.yaml"
    with pytest.raises(InputError) as e:
        dry_run_commands("lens", model_cfg, corpus="c.txt", n_prompts=0)
    assert e.value.field == "--var n_prompts" and "must be >= 1, got 0" in str(e.value)
    with pytest.raises(InputError) as e:
        dry_run_commands("data", ROOT / "configs/examples/vllm-llama8b.yaml", direction="sideways")
    assert e.value.field == "--var direction" and "honest, deceptive" in str(e.value)


def test_ctrl_c_in_a_lens_command_ends_in_the_one_boundary(monkeypatch, tmp_path):
    """The lens group is lhd's boundary: Ctrl-C is exit 130 with the resume hint, not click's 'Aborted!'."""
    import lhd_train.cli.lens

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(lhd_train.cli.lens, "_check_out", interrupted)
    res = runner.invoke(lens_app, ["fit", "/nonexistent/model", "--corpus", str(tmp_path), "--out",
                                   str(tmp_path / "o")])
    assert res.exit_code == 130 and "rerun to resume" in res.output, res.output


def test_the_slurm_audit_stage_renders_flags_lhd_audit_parses_back(tmp_path):
    """`AuditVars` takes `lhd audit`'s own option fields; the flags it renders are parsed by the
    real `lhd audit` command line into the same options (nothing re-declared, nothing drifts)."""
    from lhd_train.config.auditor import AuditCommand, AuditOptions
    from lhd_train.ops.slurm import command_argv
    from lhd_train.ops.slurm_vars import AuditVars

    chosen = {"mode": "window", "window": 3, "hide_event_labels": True, "auditor_id": "a-w3", "concurrency": 8,
              "include_unfinished": True}
    words = shlex.split(command_argv(AuditOptions, AuditVars(**chosen).model_dump()))
    seen = {}

    @settings_command(AuditCommand)
    def capture(s: AuditCommand) -> None:
        seen["s"] = s

    app = typer.Typer()
    app.command()(capture)
    result = CliRunner().invoke(app, [str(tmp_path), *words])
    assert result.exit_code == 0, result.output
    assert seen["s"].options == AuditOptions(**chosen)
    assert set(AuditOptions.model_fields) <= set(AuditVars.model_fields)


def test_audit_eval_takes_the_audit_options_from_the_same_model(tmp_path):
    """`lhd audit-eval` declares none of `lhd audit`'s options itself: the same fields, defaults
    and bounds, and its own ones (`--samples`) checked by its model; `--no-attach` is one switch."""
    from lhd_train.cli.app import app
    from lhd_train.config.auditor import AuditEvalCommand, AuditOptions

    assert set(AuditOptions.model_fields) < set(AuditEvalCommand.model_fields)
    res = CliRunner().invoke(app, ["audit-eval", "--set", "curated", "--out", str(tmp_path / "o"), "--samples", "0"])
    assert isinstance(res.exception, InputError) and res.exception.field == "--samples", res.output
    assert "must be >= 1" in str(res.exception)
    res = CliRunner().invoke(app, ["audit-eval", "--planted", str(tmp_path), "--window", "-1"])
    assert isinstance(res.exception, InputError) and res.exception.field == "--window", res.output
    help_text = CliRunner().invoke(app, ["audit-eval", "--help"], env={"COLUMNS": "200"}).output
    assert "--no-attach" in help_text and "--no-no-attach" not in help_text
