"""Issue 31, item 5 (`lhd tiny-model`): `--out` naming a file, and `--force` over a folder.

Before: `--out FILE` was refused with "already exists and is not empty ... or pass --force", and
`--out FILE --force`, the flag that refusal suggests, crashed with a FileExistsError traceback.
Now a file is refused in one line (the model is a folder; --force never removes a user's file),
and `--force` over a folder replaces it whole (built aside, then swapped in)."""
from __future__ import annotations

import json

from test_failure_modes import cli, one_error

ARGS = ("--arch", "llama", "--hidden-size", "16", "--layers", "1")


def test_out_naming_a_file_is_one_line_with_or_without_force(tmp_path, monkeypatch, capsys):
    f = tmp_path / "model.txt"
    f.write_text("my notes")
    line = one_error(*cli(monkeypatch, capsys, "tiny-model", *ARGS, "--out", str(f)), str(f), "is a file")
    assert "--force" not in line  # the refusal no longer suggests a flag that cannot help
    one_error(*cli(monkeypatch, capsys, "tiny-model", *ARGS, "--out", str(f), "--force"), str(f), "is a file")
    assert f.read_text() == "my notes"


def test_force_replaces_a_folder_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old weights")
    line = one_error(*cli(monkeypatch, capsys, "tiny-model", *ARGS, "--out", str(out)), str(out), "--force")
    assert "not empty" in line
    code, text = cli(monkeypatch, capsys, "tiny-model", *ARGS, "--seed", "5", "--out", str(out), "--force")
    assert code == 0, text
    assert not (out / "stale.safetensors").exists() and (out / "model.safetensors").is_file()
    assert json.loads((out / "lhd_tiny.json").read_text())["seed"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging folder left behind
