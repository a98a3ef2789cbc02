"""`lhd report` and `lhd view` say "not a run directory" by the run directory's one rule
(`Run.open`), in its words, before writing anything."""
from __future__ import annotations

from pathlib import Path

import pytest

from lhd_train.errors import InputError
from lhd_train.report import build_report, build_viewer


@pytest.mark.parametrize("make, why", [(lambda p: p.mkdir(), "has no trials/ folder"),
                                       (lambda p: None, "does not exist")])
def test_report_and_view_refuse_what_is_not_a_run(tmp_path: Path, make, why: str) -> None:
    not_run, out = tmp_path / "not-a-run", tmp_path / "out"
    make(not_run)
    for build in (lambda: build_report([not_run], out), lambda: build_viewer(not_run, out)):
        with pytest.raises(InputError, match=rf"not a run directory \({why}\)") as exc:
            build()
        assert str(not_run) in str(exc.value)
        assert not out.exists() or not any(out.iterdir())
