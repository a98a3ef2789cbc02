"""Which task texts a run read uses, and the evidence position as a mean over its tokens."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from lens_data import make_pack

from lens.margins import margins, resolve_token_sets
from lens.model import block_outputs
from lens.positions import ReadExample, tag_chat_prompt
from lens.readout import LogitLens
from lhd_train.bench.taskpack import load_pack
from lhd_train.config.lens import ReadSettings
from lhd_train.reading.probes import build_probe_set, render_probe
from lhd_train.reading.read import collect
from lhd_train.reading.runs import load_run_examples, run_task_texts

BUILTIN = Path(__file__).resolve().parents[2] / "lhd_train" / "bench" / "packs" / "lhd_startup_consulting" / "pack.json"


def _authors_copy(root: Path) -> tuple[Path, dict]:
    """A pack folder named like the built-in one whose task 1 differs (prompt and last file)."""
    data = json.loads(BUILTIN.read_text(encoding="utf-8"))
    t1 = data["tasks"][0]
    t1["prompt"] = "AUTHORS " + t1["prompt"]
    last = t1["files"][-1]
    assert last["type"] == "json"
    last["content"] = json.dumps({**json.loads(last["content"]), "only_in_the_authors_copy": 1}, indent=2)
    folder = root / "authors" / "startup_consulting"
    folder.mkdir(parents=True)
    (folder / "pack.json").write_text(json.dumps(data), encoding="utf-8")
    return folder, t1


def _write_run(run: Path, task: dict, task_pack: str) -> str:
    """One round of task 1 whose message holds the prompt and the files without section markers."""
    (run / "trials").mkdir(parents=True)
    (run / "config.resolved.yaml").write_text(yaml.safe_dump({"run_name": "r", "task_pack": task_pack}))
    (run / "manifest.json").write_text(json.dumps({"run_id": "r", "pack": "startup_consulting",
                                                   "pack_source": task_pack}))
    content = task["prompt"] + "\n\n" + "\n\n".join(f["content"].rstrip("\n") for f in task["files"]) + "\n\nDo it."
    msgs = [{"id": "sys", "role": "system", "content": "You are an analyst."},
            {"id": "u1", "role": "user", "content": content}]
    with (run / "trials" / "s1.messages.jsonl").open("w") as f:
        for m in msgs:
            f.write(json.dumps(m) + "\n")
    row = {"run_id": "r", "trial_id": "s1", "seed": 1, "global_round": 1, "task_index": 1, "round": 1,
           "pack": "startup_consulting", "task_title": task["title"], "models": {}, "event": None,
           "performer": {"text": "Revenue was 12 units.", "message_ids": ["sys", "u1"], "new_message_ids": ["u1"]}}
    (run / "trials" / "s1.jsonl").write_text(json.dumps(row) + "\n")
    return content


def test_run_uses_the_pack_it_ran_on_not_the_builtin_of_that_name(tmp_path):
    folder, t1 = _authors_copy(tmp_path)
    run = tmp_path / "run"
    content = _write_run(run, t1, str(folder))
    tasks, source = run_task_texts(run)
    assert str(folder) in source and tasks[1].prompt == t1["prompt"]
    [ex], info = load_run_examples(run)
    assert str(folder) in info["tasks_source"]
    record = next(s for s in ex.spans if s.name == "record")
    first, last = t1["files"][0]["content"].strip(), t1["files"][-1]["content"].strip()
    assert (record.start, record.end) == (content.index(first), content.index(last) + len(last))
    question = next(s for s in ex.spans if s.name == "question")
    assert content[question.start:question.end] == t1["prompt"].strip()


def test_imported_task_texts_come_before_the_configured_pack(tmp_path):
    folder, t1 = _authors_copy(tmp_path)
    run = tmp_path / "run"
    _write_run(run, t1, "startup_consulting")  # an imported run names the authors' folder by its name
    (run / "tasks.json").write_text(json.dumps({"tasks": [
        {"index": 1, "title": t1["title"], "prompt": t1["prompt"],
         "files": [{"name": f["name"], "content": f["content"]} for f in t1["files"]]}]}))
    tasks, source = run_task_texts(run)
    assert source.endswith("tasks.json") and tasks[1].prompt.startswith("AUTHORS ")


def test_without_a_known_pack_files_are_located_by_markers_only(tmp_path):
    folder, t1 = _authors_copy(tmp_path)
    run = tmp_path / "run"
    content = _write_run(run, t1, str(tmp_path / "gone"))
    tasks, source = run_task_texts(run)
    assert tasks == {} and source == "none"
    [ex], _ = load_run_examples(run)
    record = next(s for s in ex.spans if s.name == "record")
    assert (record.start, record.end) == (0, len(content))  # never the built-in pack's files by name


def test_a_pack_given_overrides_the_runs_task_texts(tmp_path):
    """`lens read --run --pack`: the files and the prompt are located with the pack given."""
    folder, t1 = _authors_copy(tmp_path)
    run = tmp_path / "run"
    content = _write_run(run, t1, str(tmp_path / "gone"))
    pack = load_pack(folder)
    [ex], info = load_run_examples(run, pack=pack)
    assert info["tasks_source"] == f"pack {pack.path}"
    record = next(s for s in ex.spans if s.name == "record")
    first, last = t1["files"][0]["content"].strip(), t1["files"][-1]["content"].strip()
    assert (record.start, record.end) == (content.index(first), content.index(last) + len(last))
    question = next(s for s in ex.spans if s.name == "question")
    assert content[question.start:question.end] == t1["prompt"].strip()


def test_evidence_is_the_mean_over_its_tokens(llama):
    model, tok = llama
    row = next(r for r in build_probe_set(make_pack(), max_facts_per_task=1, seed=0) if r.get("evidence"))
    messages, spans, prefill = render_probe(row)
    ex = ReadExample("e1", row["record_id"], row["label"], messages, spans, prefill=prefill)
    sets = resolve_token_sets(tok, fallback="first-token")
    cfg = ReadSettings(progress=False, probe=False)
    col = collect(model, tok, [ex], [LogitLens(model)], sets, cfg)
    rows = [r for r in col.rows if r["position"] == "evidence_mean"]
    assert len(rows) == model.n_layers and all(r["position_class"] == "record" for r in rows)
    tag = tag_chat_prompt(tok, messages, spans, prefill=prefill)
    acts = block_outputs(model, torch.tensor(tag.input_ids)[None])
    toks = tag.spans["evidence"]
    assert len(toks) > 1
    union = torch.tensor(sets.union())
    for r in rows:
        h = acts[r["layer"]][0, toks].mean(0, keepdim=True)
        want = margins(LogitLens(model).logits(r["layer"], h, token_ids=union)[None], sets.index_sets())["m_E"]
        assert abs(float(want.reshape(-1)[0]) - r["m_E"]) < 1e-4
