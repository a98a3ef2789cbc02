"""Issue 31, item 6 (threat model, docs/formats.md): text from a model or a remote server reaches
the terminal only as text.

A server's error body, a model's answer quoted in an error, a trial error from a backend: lhd
prints them in its error line and in the per-round lines of `lhd run` and `lhd audit`. Before,
an escape sequence in such text went to the terminal as is (ESC ] 0; sets the window title, ESC [2J
clears the screen, OSC 8 and OSC 52 make links or write the clipboard), and rich markup in it
(`[link=...]`, `[/red]`) was obeyed."""
from __future__ import annotations

from lhd_train.errors import LhdError

HOSTILE = "bad \x1b]0;PWNED\x07 \x1b[2J \x9b31m [link=http://evil.example]click[/link] [/red] done"


def test_the_error_line_shows_control_characters_escaped(capsys):
    from lhd_train.cli.boundary import report_error

    assert report_error(LhdError(f"server said: {HOSTILE}")) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\x9b" not in err, repr(err)
    assert err.count("\n") == 1 and "\\x1b]0;PWNED\\x07" in err and "\\x9b31m" in err, repr(err)
    assert "[link=http://evil.example]click[/link]" in err  # plain print: shown as written


def test_per_round_errors_of_the_audit_are_shown_as_text(capsys, tmp_path):
    from lhd_train.audit.runner import AuditSummary, TrialAudit
    from lhd_train.cli.audit import print_audit_summary

    trial = TrialAudit("s1", rounds=1, missing=1, errors=[f"round 1: BackendError: {HOSTILE}"])
    print_audit_summary(AuditSummary("m-full", tmp_path, [trial]))
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x9b" not in err, repr(err)
    assert "[link=http://evil.example]click[/link]" in err and "[/red]" in err, err  # markup not obeyed


def test_per_trial_errors_of_a_run_are_shown_as_text(capsys):
    from lhd_train.bench.trial import TrialResult
    from lhd_train.cli.run import print_summary

    print_summary([TrialResult("s1", 1, status="failed", error=HOSTILE)])
    err = capsys.readouterr().err
    assert "\x1b" not in err and "[link=http://evil.example]click[/link]" in err, repr(err)
