"""Training data: load a `datasets` folder or a JSONL file, check its columns for the trainer, hash it.

Each algorithm's formats are in its table entry (`config.algos`), conversational as TRL 1.16
expects them: sft `messages` (ending with the answer to learn) or `prompt` + `completion`; dpo and kto
`prompt` + `chosen` + `rejected`; grpo `prompt`, where every other column reaches the reward functions.
An optional `direction` column (or the dataset record's `direction`, `finetune.records`) must match
the recipe's direction, so an honest adapter is never trained on deceptive data by mistake.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from lhd_train.config.algos import Algo, Format
from lhd_train.errors import DataFileError, InputError
from lhd_train.finetune.records import find_data_record
from lhd_train.io.files import read_jsonl_lines, sha256_file

PASSTHROUGH = ("tools", "chat_template_kwargs")
EVAL_SPLITS = ("eval", "validation", "test")


def resolve_path(raw: str, recipe_path: Path | None, field: str, source: str, must_exist: bool = True) -> Path:
    """Absolute paths as given; relative ones against the working directory, then the recipe's folder."""
    p = Path(raw).expanduser()
    if p.is_absolute():
        if must_exist and not p.exists():
            raise InputError(source, field, f"'{raw}' does not exist")
        return p
    if p.exists():
        return p.resolve()
    if recipe_path is not None and (recipe_path.parent / p).exists():
        return (recipe_path.parent / p).resolve()
    if must_exist:
        where = "the working directory" + (f" or {recipe_path.parent}" if recipe_path is not None else "")
        raise InputError(source, field, f"'{raw}' does not exist (looked in {where})")
    return p.resolve()


def data_files(path: Path) -> list[Path]:
    """The files that hold the data: cache-*.arrow files that `datasets` writes next to a saved
    dataset when it is mapped are not part of it."""
    if path.is_file():
        return [path]
    return sorted(f for f in path.rglob("*") if f.is_file() and not f.name.startswith("cache-"))


def sha256_files(path: Path) -> dict[str, Any]:
    """sha256 of each data file and one digest over (relative name, file digest) pairs."""
    files = []
    total = hashlib.sha256()
    for f in data_files(path):
        digest = sha256_file(f)
        rel = f.name if path.is_file() else str(f.relative_to(path))
        files.append({"name": rel, "bytes": f.stat().st_size, "sha256": digest})
        total.update(rel.encode() + b"\0" + digest.encode() + b"\n")
    return {"sha256": total.hexdigest(), "files": files}


def _read_jsonl(path: Path, source: str, field: str):
    """A data file written by hand often ends without a newline: its last row counts here."""
    from datasets import Dataset

    try:
        rows = [row for _, row in read_jsonl_lines(path, hand_written=True)]
    except DataFileError as e:
        raise InputError(source, field, str(e)) from None
    if not rows:
        raise InputError(source, field, f"{path} has no rows")
    try:
        return Dataset.from_list(rows)
    except Exception as e:  # arrow cannot unify the rows' types
        raise InputError(source, field, f"{path}: rows do not share one schema: {e}") from None


def load_dataset_at(path: Path, split: str | None, source: str, field: str, default_splits: tuple[str, ...] = ()):
    """A Dataset from a save_to_disk folder (Dataset or DatasetDict) or a .jsonl file."""
    from datasets import DatasetDict, load_from_disk

    if path.is_file():
        if path.suffix not in (".jsonl", ".json"):
            raise InputError(source, field, f"{path}: expected a .jsonl file or a `datasets` folder")
        return _read_jsonl(path, source, field)
    try:
        ds = load_from_disk(str(path), keep_in_memory=True)  # mapping writes no cache files into the data folder
    except FileNotFoundError as e:
        raise InputError(source, field, f"{path} is not a `datasets` folder saved with save_to_disk: {e}") from None
    if isinstance(ds, DatasetDict):
        candidates = [split] if split else list(default_splits)
        for name in candidates:
            if name in ds:
                return ds[name]
        raise InputError(source, field, f"{path} has splits {', '.join(ds)}; none of {', '.join(candidates)}")
    return ds


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_columns(ds, algo: Algo, source: str, field: str, path: Path) -> Format:
    """The first of the algorithm's formats whose columns the data has; else raise naming them."""
    cols = set(ds.column_names)
    fmt = next((f for f in algo.formats if set(f.columns) <= cols), None)
    if fmt is None:
        want = " or ".join("+".join(f.columns) for f in algo.formats)
        raise InputError(source, field, f"{path}: {algo.name} data needs columns {want}; "
                         f"it has {', '.join(sorted(cols))}")
    if len(ds) == 0:
        raise InputError(source, field, f"{path} has no rows")
    row = ds[0]
    for col in fmt.columns:
        if not _is_messages(row[col]):
            raise InputError(source, field, f"{path}: column '{col}' must hold conversational message lists "
                             "([{\"role\": ..., \"content\": ...}, ...])")
    return fmt


def check_direction(ds, path: Path, direction: str, source: str, field: str) -> None:
    record = find_data_record(path)
    if record is not None and record[0].direction != direction:
        raise InputError(source, field, f"{path} was built for direction '{record[0].direction}' "
                         f"({record[1]}), the recipe says '{direction}'")
    if "direction" in ds.column_names:
        found = sorted({d for d in ds["direction"] if d is not None})
        wrong = [d for d in found if d != direction]
        if wrong:
            raise InputError(source, field,
                             f"{path} has rows with direction {', '.join(wrong)}; the recipe says '{direction}'")


def sft_to_last_turn(ds, source: str, field: str):
    """messages → prompt (all but the last message) + completion (the last, an assistant message)."""

    def split(row: dict[str, Any]) -> dict[str, Any]:
        msgs = row["messages"]
        if not msgs or msgs[-1].get("role") != "assistant":
            raise InputError(source, field,
                             "sft.loss_on=last_turn needs every `messages` to end with an assistant message")
        return {"prompt": msgs[:-1], "completion": [msgs[-1]]}

    keep = [c for c in PASSTHROUGH if c in ds.column_names]
    return ds.map(split, remove_columns=[c for c in ds.column_names if c not in keep])


def select_columns(ds, algo: Algo, fmt: Format):
    """Keep what the trainer reads; an online algorithm keeps everything (extra columns feed the rewards)."""
    if algo.online:
        return ds
    keep = set(fmt.columns) | {c for c in PASSTHROUGH if c in ds.column_names}
    drop = [c for c in ds.column_names if c not in keep]
    return ds.remove_columns(drop) if drop else ds


def unpair_shuffled(ds, seed: int):
    """Pairs → one row per answer (`prompt`, `completion`, `label`: chosen True, rejected False), in
    an order shuffled with the trainer's seed. TRL's own unpairing puts every chosen row before every
    rejected one, and KTO reads its rows in order (its KL term pairs each row with its batch
    neighbour's answer), so without this the first half of an epoch would see only desirable answers."""
    from trl.data_utils import unpair_preference_dataset

    return unpair_preference_dataset(ds).shuffle(seed=seed).flatten_indices()
