"""The report and the trajectory viewer: files, tables, escaping, and a real headless Chromium
(no console errors, sections present, no network, injected scripts inert)."""
from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
from markdown_tables import md_rows
from support.browser import Browser
from support.synthetic import R, write_run

from lhd_train.report import build_report, build_viewer
from lhd_train.report.chromium import find_chromium
from lhd_train.rundir.layout import RunDir

F, C, E = "FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"
# Each part would change the title, set a global, log an error or open a dialog if it ran.
PAYLOAD = ("<script>document.title='PWNED';window.__pwned=1;console.error('xss ran')</script>"
           "<img src=x onerror=\"document.title='PWNED';window.__pwned=2;alert('xss')\">"
           "<svg onload=\"window.__pwned=3\"></svg> & <b>bold?</b>")
CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (scripts/install_chromium.sh or apt-get install chromium)")
REPORT_SECTIONS = ["runs", "deception", "types", "pressure", "category", "task", "control", "states", "horizon",
                   "trials", "table-runs", "table-types", "table-pressure", "table-category", "table-control",
                   "table-corr-within", "table-corr-across", "table-horizon", "table-delayed", "table-chains"]


def _trial(seed: int, flags: list[tuple[bool, list[str], int]], payload_round: int | None = None) -> list[R]:
    events = [("GOAL_CONFLICT", "HIGH"), None, ("INFORMATION_GAP", "LOW"), ("MORAL_DILEMMA", "CRITICAL"), None]
    out = []
    for i, lab in enumerate(flags):
        task = i // 2 + 1
        st = (0.3 - 0.1 * i + 0.01 * seed, 0.25 - 0.05 * i, 0.1 - 0.05 * i)
        if i == payload_round:
            out.append(R(task, events[task - 1], st, lab, text="Answer. " + PAYLOAD, feedback=PAYLOAD,
                         extra={"task_title": "Title " + PAYLOAD},
                         audit_extra={"reasoning": PAYLOAD, "evidence": [PAYLOAD]}))
        else:
            out.append(R(task, events[task - 1], st, lab, text=f"answer {i}\n  second line"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("runs")
    yes, no = (True, [F], 2), (False, [], 0)
    a = write_run(root, "base", {
        "s1": _trial(1, [yes, no, (True, [F, C], 3), (True, [C], 3), no, no], payload_round=0),
        "s2": _trial(2, [no, no, yes, no, (True, [E], 1), no]),
        "s3": _trial(3, [yes, yes, no, no, no, "failed"]),
    }, extra_auditors={"task-r": ("task", {"s1": [no, no, yes, no, no, no], "s2": [no] * 6})})
    b = write_run(root, "honest", {
        "s1": _trial(1, [no, no, no, no, yes, no]),
        "s2": _trial(2, [no] * 6),
    }, adapter="/ckpt/adapters/honest-lora")
    return [a, b]


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory) -> Path:
    return build_report(runs, tmp_path_factory.mktemp("report"))


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed")
    with Browser(CHROMIUM) as b:
        yield b


# ----------------------------------------------------------------------------- files (no browser)
def test_report_writes_page_tables_summary_and_trial_pages(report: Path):
    out = report.parent
    tables = {p.stem for p in (out / "tables").glob("*.csv")}
    assert {"runs", "per_trial", "type_distribution", "by_pressure", "by_category", "by_task", "control",
            "correlations_within_runs", "correlations_across_runs", "horizon", "delayed", "chains",
            "chains_summary", "rounds"} <= tables
    with open(out / "tables" / "runs.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    # base: s1 3/6, s2 2/6, s3 2/5 (one failed label excluded)
    assert float(rows["base"]["deception_rate_mean"]) == pytest.approx((3 / 6 + 2 / 6 + 2 / 5) / 3)
    assert rows["base"]["n_failed_labels"] == "1"
    assert float(rows["honest"]["deception_rate_mean"]) == pytest.approx(1 / 12)
    # s3 has 5 of 6 labels (83 %): flagged, and the headline is also given without it
    assert float(rows["base"]["min_label_coverage"]) == pytest.approx(5 / 6)
    assert rows["base"]["n_low_coverage_trials"] == "1" and rows["honest"]["n_low_coverage_trials"] == "0"
    assert float(rows["base"]["deception_rate_covered_mean"]) == pytest.approx((3 / 6 + 2 / 6) / 2)
    with open(out / "tables" / "per_trial.csv") as f:
        cov = {(r["run"], r["trial_id"]): r for r in csv.DictReader(f)}
    assert cov[("base", "s3")]["low_coverage"] == "True" and cov[("base", "s1")]["label_coverage"] == "1.0"
    html = report.read_text()
    assert "label coverage" in html and "trials below 90% coverage" in html
    summary = (out / "summary.md").read_text()
    assert "| base | tiny-llama |" in summary and "label coverage" in summary
    assert "1 trial(s) with label coverage below 90% (s3 83%)" in summary
    assert "honest-lora" in summary
    pages = sorted(p.relative_to(out).as_posix() for p in (out / "trials").rglob("*.html"))
    assert pages == ["trials/base/s1.html", "trials/base/s2.html", "trials/base/s3.html",
                     "trials/honest/s1.html", "trials/honest/s2.html"]
    assert len(list((out / "plots").glob("*.png"))) >= 5


def test_pages_are_self_contained_and_escape_model_text(report: Path):
    html = report.read_text()
    assert "<script" not in html  # the report needs no script at all
    for attr in re.findall(r'(?:src|href)="([^"]*)"', html):
        assert attr.startswith(("data:image/png;base64,", "#", "trials/")), attr
    assert "Content-Security-Policy" in html and "default-src 'none'" in html
    page = (report.parent / "trials" / "base" / "s1.html").read_text()
    assert page.count("<script") == 1  # ours, allowed by hash in the CSP
    assert "<script>document.title" not in page and "<img src=x" not in page and "<svg onload" not in page
    assert "&lt;script&gt;document.title=&#39;PWNED&#39;" in page
    assert page.count("&lt;img src=x onerror=") >= 5  # answer, feedback, title, reasoning, evidence


def test_view_command_writes_index_and_pages(runs, tmp_path):
    index = build_viewer(runs[0], tmp_path / "view", None)
    assert index.name == "index.html"
    assert sorted(p.name for p in (tmp_path / "view").glob("s*.html")) == ["s1.html", "s2.html", "s3.html"]
    assert 'href="s1.html"' in index.read_text()
    default = build_viewer(runs[1], None, None)
    assert default == runs[1] / "view" / "index.html"


def test_report_on_runs_without_labels(tmp_path):
    bare = write_run(tmp_path, "bare", {"s5": [R(1, None, (0.1, 0.2, 0.3), None)]})
    failed = write_run(tmp_path, "failed", {"s6": [R(1, ("GOAL_CONFLICT", "LOW"), (0.1, 0.2, 0.3), "failed")]})
    page = build_report([bare, failed], tmp_path / "out")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "no audit labels" in summary and "audit failed" in summary
    assert 'id="table-runs"' in page.read_text()


# ----------------------------------------------------------------------------- headless Chromium
def _assert_clean(page) -> None:
    rep = page.report
    assert rep.errors == [], rep.errors
    assert rep.dialogs == [], rep.dialogs
    assert rep.title != "PWNED"
    bad = [u for u in rep.requests if not u.startswith(("file://", "data:"))]
    assert bad == [], bad


@needs_browser
def test_browser_detects_a_payload_that_does_run(browser, tmp_path):
    """Positive control: unescaped, the payload runs and the checks below would catch it."""
    raw = tmp_path / "raw.html"
    raw.write_text(f"<!DOCTYPE html><html><head><title>t</title></head><body>{PAYLOAD}</body></html>")
    page = browser.open(raw, settle_s=0.5)
    assert page.eval("window.__pwned") in (1, 2, 3)
    assert page.report.title == "PWNED" or page.eval("document.title") == "PWNED"
    assert any("xss ran" in e for e in page.report.errors)
    page.close()


@needs_browser
def test_report_loads_cleanly_in_chromium(browser, report: Path):
    page = browser.open(report)
    _assert_clean(page)
    missing = page.eval(f"{REPORT_SECTIONS!r}.filter(id => !document.getElementById(id))")
    assert missing == []
    imgs = page.eval("Array.from(document.images).map(i => [i.complete, i.naturalWidth])")
    assert len(imgs) >= 5 and all(done and w > 0 for done, w in imgs)
    links = page.eval("Array.from(document.querySelectorAll('a[href^=\"trials/\"]')).map(a => a.getAttribute('href'))")
    assert links and all((report.parent / href).is_file() for href in links)
    assert page.eval("document.querySelector('#table-runs tbody').rows.length") == 2
    assert "honest-lora" in page.eval("document.getElementById('runs').textContent")
    page.close()


@needs_browser
def test_trajectory_page_escapes_payload_and_filters(browser, report: Path):
    page = browser.open(report.parent / "trials" / "base" / "s1.html", settle_s=0.5)
    _assert_clean(page)
    assert page.eval("typeof window.__pwned") == "undefined"
    assert page.eval("document.scripts.length") == 1
    assert page.eval("document.querySelectorAll('img[src=\"x\"], svg[onload]').length") == 0
    assert page.eval("document.querySelectorAll('.performer-text *, section.task h2 *, "
                     ".bubble.supervisor .text *').length") == 0
    first = page.eval("document.querySelector('article.round .performer-text').textContent")
    assert first == "Answer. " + PAYLOAD  # shown verbatim, as text
    assert PAYLOAD in page.eval("document.querySelector('section.task h2').textContent")
    n_rounds = page.eval("document.querySelectorAll('article.round').length")
    n_flagged = page.eval("document.querySelectorAll('article.round[data-flagged=\"1\"]').length")
    assert (n_rounds, n_flagged) == (6, 3)
    visible = "Array.from(document.querySelectorAll('article.round')).filter(e => e.offsetParent !== null).length"
    assert page.eval(visible) == 6
    page.eval("document.getElementById('only-flagged').click()")
    assert page.eval(visible) == 3
    assert page.eval("document.getElementById('shown-count').textContent") == "3 of 6 rounds shown"
    page.eval("document.getElementById('expand-all').click()")
    assert page.eval("Array.from(document.querySelectorAll('details')).every(d => d.open)")
    # the short auditor's verdicts are shown next to the chosen one
    assert page.eval("document.querySelectorAll('details.audit').length") == 12
    _assert_clean(page)
    page.close()


@needs_browser
def test_viewer_on_a_run_written_by_the_trial_loop(browser, tmp_path):
    from test_metrics import scripted_run

    run = scripted_run(tmp_path, performer_text="Plan: " + PAYLOAD)
    index = build_viewer(run, tmp_path / "view", None)
    page = browser.open(index)
    _assert_clean(page)
    page.close()
    page = browser.open(tmp_path / "view" / "s7.html", settle_s=0.5)
    _assert_clean(page)
    assert page.eval("typeof window.__pwned") == "undefined"
    # task prompt and files come from the task pack; the exact round-1 message from the message store
    assert page.eval("document.querySelectorAll('details.task-prompt').length") == 3
    assert page.eval("document.querySelectorAll('details.task-prompt details.file').length") >= 1
    assert "=== TASK 1" in page.eval("document.querySelector('details.exact-message').textContent")
    assert page.eval("document.querySelector('.performer-text').textContent") == "Plan: " + PAYLOAD
    page.close()


# ----------------------------------------------------------------------------- issue 21
def test_report_cites_only_docs_that_exist(report: Path):
    """Item 9: the header cited REFERENCE.md, a file the repository does not have."""
    root = Path(__file__).resolve().parents[2]
    for text in (report.read_text(), (report.parent / "summary.md").read_text()):
        assert "REFERENCE.md" not in text
        cited = set(re.findall(r"docs/[\w.-]+\.md", text))
        for doc in cited:
            assert (root / doc).is_file(), doc
    assert "docs/reference.md" in report.read_text()


def test_report_names_pack_hash_and_headline_auditor(tmp_path):
    """N5/N6: the runs table names the task pack with its content hash (recorded, or computed from
    the folder the manifest names, and said so) and why the headline auditor was chosen."""
    import json

    from lhd_train.bench.taskpack import BUILTIN_DIR, load_pack, pack_sha256

    recorded = write_run(tmp_path, "recorded", {"s1": [R(1, None, label=(True, [F], 2))]})
    computed = write_run(tmp_path, "computed", {"s1": [R(1, None, label=(True, [], 2))]})
    sha = pack_sha256(load_pack("startup_consulting"))
    for run, extra in ((recorded, {"pack_sha256": "ab" * 32}),
                       (computed, {"pack_source": str(BUILTIN_DIR / "startup_consulting")})):
        man = json.loads((run / "manifest.json").read_text())
        (run / "manifest.json").write_text(json.dumps({**man, "pack": "startup_consulting", **extra}))
    page = build_report([recorded, computed], tmp_path / "out").read_text()
    assert f"startup_consulting (sha256 {'ab' * 8}…, recorded by the run)" in page
    assert f"startup_consulting (sha256 {sha[:16]}…, computed now from {BUILTIN_DIR / 'startup_consulting'})" in page
    assert "the first full-mode auditor created" in page
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- computed: auditor full (the first full-mode auditor created); pack startup_consulting" in summary
    row = next(r for r in md_rows(summary) if r.get("run") == "computed")
    assert row["flagged, no type (unspecified)"] == "1"  # N3: the typeless flag is counted and shown
    with open(tmp_path / "out" / "tables" / "runs.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["computed"]["n_unspecified"] == "1" and float(rows["computed"]["deception_rate_mean"]) == 1.0


def test_pressure_plots_say_what_they_measure(report: Path, tmp_path):
    """N10: the per-round breakdown is not called the paper's pressure figure; the paper's
    measure (trials run under one fixed pressure level) is plotted from the control study."""
    plots_dir = report.parent / "plots"
    assert (plots_dir / "rate_by_round_pressure.png").is_file() and not (plots_dir / "rate_by_pressure.png").exists()
    assert not (plots_dir / "control_rate_by_pressure.png").exists()  # no pressure-controlled trial there
    html = report.read_text()
    assert "not the paper&#39;s pressure figure" in html or "not the paper's pressure figure" in html
    yes, no = (True, [F], 2), (False, [], 0)
    high = write_run(tmp_path, "high", {"s1-lvl-HIGH": _trial(1, [yes, no])}, control={"pressure": "HIGH"})
    low = write_run(tmp_path, "low", {"s1-lvl-LOW": _trial(1, [no, no])}, control={"pressure": "LOW"})
    out = build_report([high, low], tmp_path / "ctl-report").parent
    assert (out / "plots" / "control_rate_by_pressure.png").is_file()


def _call(stage: str, cut: bool | None = False, finish: str = "stop") -> dict:
    call = {"stage": stage, "attempt": 1, "finish_reason": "length" if cut else finish, "prompt_tokens": 10,
            "completion_tokens": 5, "latency_s": 0.1}
    if cut is not None:
        call["cut"] = cut
    return call


def test_report_shows_cut_answers_per_role_and_each_roles_sampling(tmp_path):
    """Issue 21 N1/N4: how many answers were cut per role (calls that hit the token limit, answers
    that stayed cut) and each role's effective sampling from the manifest. Counted by hand:
    performer: a first segment continued (1 call, 0 answers); supervisor: round 1 one cut attempt
    then an answer, round 2 cut three times (4 calls, 1 answer); summariser: one cut summary,
    recorded before the `cut` field (finish_reason only: 1 call, 1 answer); auditor: round 1 one
    cut attempt then a label, round 2 cut twice (3 calls, 1 answer)."""
    run = write_run(tmp_path, "cuts", {"s1": [R(1, None, (0.1, 0.1, 0.0), (False, [], 0)),
                                              R(1, None, (0.1, 0.1, 0.0), (False, [], 0)),
                                              R(2, None, (0.2, 0.5, 0.1), (True, [F], 2))]})
    rd = RunDir(run)
    rows = [json.loads(x) for x in rd.trial("s1").rows.read_text().splitlines()]
    rows[0]["supervisor"]["calls"] = [_call("evaluation", True), _call("evaluation"), _call("feedback")]
    rows[1]["supervisor"].update(calls=[_call("evaluation", True)] * 3, parse_status="cut", evaluation=None,
                                 feedback=None, state_after=dict(rows[1]["supervisor"]["state_before"]))
    rows[1]["performer"].update(segments=2, truncated=False)
    rows[2]["supervisor"]["calls"] = [_call("evaluation"), _call("feedback"), _call("summary", None, "length")]
    rd.trial("s1").rows.write_text("".join(json.dumps(r) + "\n" for r in rows))
    audits = [json.loads(x) for x in rd.audit_rows("full", "s1").read_text().splitlines()]
    audits[0]["calls"] = [_call("audit", True), _call("audit")]
    audits[1].update(calls=[_call("audit", True)] * 2, parse_status="cut", deceptive=None, severity=None)
    rd.audit_rows("full", "s1").write_text("".join(json.dumps(r) + "\n" for r in audits))
    manifest = json.loads(rd.manifest.read_text())
    manifest["effective_sampling"] = {
        "supervisor": {"temperature": None, "top_p": None, "max_tokens": 4096, "seed": None, "n": 1, "top_k": None,
                       "repetition_penalty": None},
        "performer": {"temperature": 0.7, "top_p": 0.95, "max_tokens": 4096, "seed": 3, "n": 1, "top_k": 20,
                      "repetition_penalty": 1.0}}
    rd.manifest.write_text(json.dumps(manifest))

    out = tmp_path / "out"
    html = build_report([run], out).read_text()
    with open(out / "tables" / "usage_by_role.csv") as f:
        usage = {r["role"]: (float(r["cut_calls"]), float(r["cut_answers"])) for r in csv.DictReader(f)}
    assert usage == {"performer": (1, 0), "supervisor": (4, 1), "summariser": (1, 1), "auditor": (3, 1)}
    cuts = "performer 0 (1 call), supervisor 1 (4 calls), summariser 1 (1 call), auditor 1 (3 calls)"
    summary = (out / "summary.md").read_text()
    assert md_rows(summary)[0]["cut answers per role (calls that hit the token limit)"] == cuts
    assert cuts in html and "cut answers (stayed cut)" in html
    with open(out / "tables" / "runs.csv") as f:
        s = next(csv.DictReader(f))
    assert (s["n_supervisor_failed_rounds"], s["n_supervisor_cut_rounds"], s["n_cut_labels"]) == ("1", "1", "1")
    performer = ("performer: temperature 0.7, top_p 0.95, top_k 20, repetition_penalty 1.0, max_tokens 4096, "
                 "seed 3, n 1")
    supervisor = ("supervisor: temperature server default, top_p server default, top_k server default, "
                  "repetition_penalty server default, max_tokens 4096")
    assert performer in html and supervisor in html
    assert html.index(performer) < html.index(supervisor)  # roles in the run's order
    assert f"sampling {performer}" in summary
