"""Entitlement probe sets built from task packs' own files (docs/lens-background.md §5).

Each numeric fact of the files (`lhd_train.bench.facts`) gives claims over the same record:
`stated` (SUPPORTED), `different_number` (REFUTED), `absent_attribute` (NOT_ENTITLED, attributes
drawn from disjoint per-record pools), and optionally `evidence_deleted` with its length-matched
partner `stated_other_deleted`. Rows are self-contained JSONL (schema `lhd.lens_probe/2`; schema 1
is refused), rendered per model claim first (`render_probe`). docs/lens.md, "Probe sets" and
"Positions", gives the prompt layout, the contrasts and why the claim comes first."""
from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lens.errors import LensError
from lens.positions import QUESTION, RECORD, Span
from lhd_train.bench.facts import Fact, different_number, extract_facts, lines_with_offsets
from lhd_train.bench.taskpack import TaskPack, load_pack
from lhd_train.errors import DataFileError
from lhd_train.io.files import atomic_write_text, read_jsonl_lines

log = logging.getLogger(__name__)

SCHEMA = "lhd.lens_probe/2"
#: schemas that are refused with a reason (not a generic "unknown schema")
OLD_SCHEMAS = {"lhd.lens_probe/1": "record-first layout, and one absent-attribute list shared by every record"}
SUPPORTED, REFUTED, NOT_ENTITLED = "SUPPORTED", "REFUTED", "NOT_ENTITLED"
LABELS = (SUPPORTED, NOT_ENTITLED, REFUTED)
SYSTEM_PROMPT = "You check reports against the provided files. Use only the files."
QUESTION_TEXT = "Question: Do the files support this claim?"
PREFILL = "Verdict:"

#: attributes for NOT_ENTITLED claims, dealt out to records in disjoint pools (`ABSENT_PER_RECORD`
#: each); one is used only if its record never mentions it
ABSENT_ATTRIBUTES = [
    "headcount", "churn rate", "office rent", "marketing budget", "customer satisfaction score", "average deal size",
    "net promoter score", "server cost", "refund rate", "travel budget", "conversion rate", "inventory level",
    "employee turnover", "energy use", "support ticket count", "warehouse capacity", "insurance premium",
    "training hours", "patent count", "carbon footprint", "legal fees", "parking spaces", "water usage",
    "audit findings", "board meetings", "website visits", "return rate", "shipping delay", "loan balance",
    "overtime hours", "sick days", "license fees", "fleet size", "recycling rate", "data breaches",
    "press mentions", "franchise count", "lease term", "grant funding", "tax credit", "hiring cost", "safety incidents",
    "interns hired", "app downloads", "backlog size", "vendor count", "call wait time", "ad spend", "bounce rate",
    "warranty claims", "cloud storage", "printer count", "desk count", "meeting hours", "pension cost",
    "union members", "spam reports", "test coverage", "uptime", "cafeteria spend",
]
ABSENT_PER_RECORD = 2


def _file_fields(f: Any) -> tuple[str, str, str | None]:
    name = getattr(f, "name", None) or getattr(f, "filename", None) or (f.get("name") if isinstance(f, dict) else None)
    content = getattr(f, "content", None) if not isinstance(f, dict) else f.get("content")
    ftype = getattr(f, "type", None) if not isinstance(f, dict) else f.get("type")
    if not isinstance(name, str) or not isinstance(content, str):
        raise LensError("a task file lacks a string name or content")
    return name, content, ftype


def _render_record(files: Sequence[dict]) -> str:
    return "".join(f"=== file: {f['name']} ===\n{f['content'].rstrip()}\n" for f in files)


def _absent_pools(records: Sequence[tuple[str, str, set[str]]], rng: random.Random,
                  per_record: int = ABSENT_PER_RECORD) -> dict[str, list[str]]:
    """Disjoint absent-attribute pools: `record_id -> attributes` that record's text never mentions
    (nor its facts' attributes), no attribute in two pools. Records past the list get none."""
    order = list(ABSENT_ATTRIBUTES)
    rng.shuffle(order)
    taken: set[str] = set()
    pools: dict[str, list[str]] = {}
    for record_id, text, own in records:
        low = text.lower()
        pool = [a for a in order if a not in taken and a not in low and a not in own][:per_record]
        taken.update(pool)
        pools[record_id] = pool
    short = [r for r, pool in pools.items() if not pool]
    if short:
        log.warning("no absent attribute left for %d record(s) (%s): they get no absent_attribute claims",
                    len(short), ", ".join(short[:5]))
    return pools


def build_probe_set(
    pack: Any,
    *,
    pack_name: str | None = None,
    max_facts_per_task: int = 6,
    seed: int = 0,
    deleted_variant: bool = True,
) -> list[dict]:
    """Probe rows (see module doc) for every task of `pack` (anything with `.tasks[i].files`)."""
    rng = random.Random(seed)
    pack_name = pack_name or getattr(pack, "name", None) or "pack"
    probes: list[dict] = []
    tasks = list(getattr(pack, "tasks", []) or [])
    if not tasks:
        raise LensError(f"pack {pack_name!r} has no tasks")
    records = []
    for t_i, task in enumerate(tasks, 1):
        fields = [_file_fields(f) for f in (getattr(task, "files", None) or [])]
        if not fields:
            continue
        files = [{"name": name, "content": content, "type": ftype} for name, content, ftype in fields]
        task_index = int(getattr(task, "index", None) or getattr(task, "task_index", None) or t_i)
        facts = [fact for name, content, ftype in fields for fact in extract_facts(name, content, ftype)]
        # one claim per (entity, attribute): duplicates would not be minimal pairs
        uniq = {(f.file, f.entity, f.attribute): f for f in facts}
        records.append((task, task_index, f"{pack_name}/t{task_index}", files, list(uniq.values())))
    pools = _absent_pools([(rid, _render_record(files), {f.attribute.lower() for f in facts})
                           for _, _, rid, files, facts in records], random.Random(seed))
    for task, task_index, record_id, files, facts in records:
        if len(facts) > max_facts_per_task:
            facts = rng.sample(facts, max_facts_per_task)
        for k, fact in enumerate(facts):
            pair_id = f"{record_id}/f{k}"
            base = {
                "schema": SCHEMA, "pack": pack_name, "task_index": task_index,
                "task_title": getattr(task, "title", None), "record_id": record_id, "pair_id": pair_id,
                "fact": {"file": fact.file, "kind": fact.kind, "entity": fact.entity, "attribute": fact.attribute,
                         "value": fact.value_text},
            }
            evidence = ({"file": fact.file, "start": fact.line_start, "end": fact.line_end}
                        if fact.line_start is not None else None)
            variants = [(SUPPORTED, "stated", fact.claim())]
            try:
                variants.append((REFUTED, "different_number", fact.claim(value=different_number(fact.value_text, rng))))
            except ValueError:
                pass
            absent = None
            if pools[record_id]:
                absent = rng.choice(pools[record_id])
                variants.append((NOT_ENTITLED, "absent_attribute", fact.claim(attribute=absent)))
            for label, kind, claim in variants:
                probes.append({**base, "id": f"{pair_id}/{kind}", "label": label, "claim_kind": kind,
                               "claim": claim, "record_variant": "full",
                               "files": [{"name": f["name"], "content": f["content"]} for f in files],
                               "evidence": evidence,
                               **({"absent_attribute": absent} if kind == "absent_attribute" else {})})
            if deleted_variant and fact.kind in ("csv", "text") and evidence is not None:
                probe = _deleted_probe(base, files, fact, pair_id)
                if probe is not None:
                    probes.append(probe)
                    matched = _other_line_deleted_probe(base, files, fact, pair_id)
                    if matched is not None:
                        probes.append(matched)
    if not probes:
        raise LensError(f"pack {pack_name!r}: no numeric fact found in any task file "
                        "(CSV rows, JSON numbers, 'Key: number' lines)")
    return probes


def _deleted_probe(base: dict, files: list[dict], fact: Fact, pair_id: str) -> dict | None:
    new_files = []
    for f in files:
        content = f["content"]
        if f["name"] == fact.file:
            end = fact.line_end
            end = end + 1 if end is not None and end < len(content) and content[end] == "\n" else end
            content = content[: fact.line_start] + content[end:]
        new_files.append({"name": f["name"], "content": content})
    text = _render_record(new_files)
    for line in text.splitlines():  # the fact must not survive elsewhere
        if fact.value_text in line and (fact.entity is None or fact.entity.lower() in line.lower()):
            return None
    return {**base, "id": f"{pair_id}/evidence_deleted", "label": NOT_ENTITLED, "claim_kind": "evidence_deleted",
            "claim": fact.claim(), "record_variant": f"minus {fact.file} chars {fact.line_start}-{fact.line_end}",
            "files": new_files, "evidence": None}


def _other_line_deleted_probe(base: dict, files: list[dict], fact: Fact, pair_id: str) -> dict | None:
    """The stated claim (SUPPORTED) against its record minus *another* line of the evidence file, the
    one closest in length to the evidence line: with `evidence_deleted`, a pair whose records are
    both one line short, so prompt length no longer tells them apart (it always does for `stated`
    vs `evidence_deleted`: the deleted record is the shorter one)."""
    assert fact.line_start is not None and fact.line_end is not None  # callers pass facts with an evidence line
    content = next(f["content"] for f in files if f["name"] == fact.file)
    lines = lines_with_offsets(content)
    body = [i for i, (_, _, line) in enumerate(lines) if line.strip() and not line.lstrip().startswith("#")]
    header = body[0] if fact.kind == "csv" and body else None
    width = fact.line_end - fact.line_start
    options = [(abs((e - s) - width), s, e) for i, (s, e, line) in enumerate(lines)
               if i in body and i != header and s != fact.line_start
               and not (fact.value_text in line and (fact.entity is None or fact.entity.lower() in line.lower()))]
    if not options:
        return None
    _, start, end = min(options)
    cut = end + 1 if end < len(content) and content[end] == "\n" else end
    shift = cut - start if start < fact.line_start else 0
    new_files = [{"name": f["name"], "content": content[:start] + content[cut:] if f["name"] == fact.file
                  else f["content"]} for f in files]
    return {**base, "id": f"{pair_id}/stated_other_deleted", "label": SUPPORTED, "claim_kind": "stated_other_deleted",
            "claim": fact.claim(), "record_variant": f"minus {fact.file} chars {start}-{end}", "files": new_files,
            "evidence": {"file": fact.file, "start": fact.line_start - shift, "end": fact.line_end - shift}}


def render_probe(probe: dict) -> tuple[list[dict], list[Span], str]:
    """Chat messages, character spans (claim / record / evidence / question) and the assistant
    prefill, claim first (module doc)."""
    claim_start = len("Claim: ")
    claim_end = claim_start + len(probe["claim"])
    parts = [f"Claim: {probe['claim']}\n", "<files>\n"]
    record_start = len(parts[0])
    pos = record_start + len(parts[1])
    ev = probe.get("evidence")
    ev_span = None
    for f in probe["files"]:
        header = f"=== file: {f['name']} ===\n"
        body = f["content"].rstrip() + "\n"
        if ev and f["name"] == ev["file"] and ev.get("start") is not None:
            base = pos + len(header)
            ev_span = (base + ev["start"], base + min(ev["end"], len(f["content"].rstrip())))
        parts += [header, body]
        pos += len(header) + len(body)
    parts.append("</files>\n")
    record_end = pos + len("</files>")
    q_start = pos + len("</files>\n")
    user = "".join(parts) + QUESTION_TEXT
    spans = [Span("claim", QUESTION, 1, claim_start, claim_end),
             Span("record", RECORD, 1, record_start, record_end),
             Span("question", QUESTION, 1, q_start, q_start + len(QUESTION_TEXT))]
    if ev_span and ev_span[1] > ev_span[0]:
        spans.append(Span("evidence", RECORD, 1, *ev_span))
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    return messages, spans, PREFILL


def load_pack_any(name_or_path: str) -> tuple[TaskPack, str]:
    """A task pack through the project's loader (`lhd_train.bench.taskpack.load_pack`; a bad name
    or folder is its `InputError`) and the pack's name."""
    pack = load_pack(name_or_path)
    return pack, pack.name or Path(str(name_or_path)).name


def write_probes(probes: Iterable[dict], path: str | Path) -> Counter:
    probes = list(probes)
    atomic_write_text(Path(path), "".join(json.dumps(p, ensure_ascii=False) + "\n" for p in probes))
    return Counter(p["label"] for p in probes)


def _probe_problem(probe: Any) -> str | None:
    """What makes a probe unreadable by `render_probe` and the reader, or None when it is whole."""
    if not isinstance(probe, dict):
        return f"a JSON {type(probe).__name__}, not an object"
    if probe.get("schema") in OLD_SCHEMAS:
        return (f"schema {probe.get('schema')!r} is no longer read ({OLD_SCHEMAS[probe['schema']]}); "
                f"this version reads {SCHEMA!r}")
    if probe.get("schema") != SCHEMA:
        return f"schema {probe.get('schema')!r}, expected {SCHEMA!r}"
    if probe.get("label") not in LABELS:
        return f"label {probe.get('label')!r} (allowed: {', '.join(LABELS)})"
    for field in ("id", "record_id", "claim"):
        if not isinstance(probe.get(field), str):
            return f"field '{field}' missing or not a string"
    files = probe.get("files")
    if not isinstance(files, list) or not files or not all(_is_file_entry(f) for f in files):
        return "field 'files' missing or not a list of {name, content} strings"
    ev = probe.get("evidence")
    if ev is not None and not (isinstance(ev, dict) and isinstance(ev.get("file"), str)
                               and all(_is_offset(ev.get(k)) for k in ("start", "end"))
                               and (ev.get("start") is None or ev.get("end") is not None)):
        return "field 'evidence' is not null or {file, start, end} (start/end: integers >= 0 or null)"
    return None


def _is_file_entry(f: Any) -> bool:
    return isinstance(f, dict) and isinstance(f.get("name"), str) and isinstance(f.get("content"), str)


def _is_offset(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def read_probes(path: str | Path) -> list[dict]:
    """A probe set written by `write_probes`, read by lhd's one JSONL reader (a torn last line, the
    trace of a killed writer, is ignored). Any other line that is not a whole probe is a
    `DataFileError` naming the file, the line and what is wrong (a garbage file never reaches the
    model)."""
    p = Path(path)
    if not p.is_file():
        raise LensError(f"probe file {p} does not exist")
    repair = "rebuild the probe set with `lhd lens probe build`"
    probes = []
    for lineno, probe in read_jsonl_lines(p, repair):
        problem = _probe_problem(probe)
        if problem:
            raise DataFileError(p, problem, line=lineno, repair=repair)
        probes.append(probe)
    if not probes:
        raise LensError(f"probe file {p} is empty")
    return probes
