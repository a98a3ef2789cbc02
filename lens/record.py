"""`lens.json`, the sidecar of a lens folder, as a typed record like the run directory's.

`LensMeta` is what a lens in memory knows about itself (the fit's settings, the corpus recipe, a
merge's or a control's provenance); `LensRecord` is the file: the same plus the fields `save_lens`
has always written, which are required. The conventions are those of lhd's run records (which the library
does not import): strict types, unknown fields kept, collections default to empty, and
`to_json` writes only the fields that were set, so a file reads and writes back as it was.
tests/data/records/lens-*.json keep files written before this record."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lens.errors import LensError, record_error

FORMAT = "lhd.jlens/1"


class LensMeta(BaseModel):
    """A lens's metadata in memory: a fitted, merged, control or published (`jlens.pt`) lens."""

    model_config = ConfigDict(strict=True, extra="allow")

    format: str | None = None  # FORMAT once saved; "jlens.pt" for a published lens
    model_id: str | None = None
    revision: str | None = None
    n_layers: int | None = None
    d_model: int | None = None
    source_layers: list[int] = Field(default_factory=list)
    target_layer: int | None = None
    skip_first: int | None = None
    max_length: int | None = None
    chat: bool = False  # a lens that does not say was fitted on plain text, BOS forced
    force_bos: bool = True
    n_prompts: int = 0
    estimator: str = "all"  # a lens written before estimators existed is an `all` lens
    sign_seed: int | None = None
    directions: str | None = None
    corpus: dict[str, Any] = Field(default_factory=dict)  # `lens.corpus.load_corpus`'s recipe, with its slice
    shard: dict[str, Any] = Field(default_factory=dict)  # index, count, slice of a sharded fit
    fit: dict[str, Any] = Field(default_factory=dict)  # dim_batch, method, complete, stopped_early
    merged_from: list[dict[str, Any]] = Field(default_factory=list)  # n_prompts, sha256, shard of each part
    control: dict[str, Any] = Field(default_factory=dict)  # kind, seed, of (`lens.controls`)
    file: str | None = None
    sha256: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The fields that were set (and unknown ones carried), by key."""
        return self.model_dump(mode="json", exclude_unset=True)


class LensRecord(LensMeta):
    """lens.json: what `save_lens` writes; the fields it has always written are required."""

    format: Literal["lhd.jlens/1"]
    source_layers: list[int]
    d_model: int
    shape: list[int]
    dtype: Literal["float16", "bfloat16", "float32"]
    file: str
    sha256: str
    saved_at: str


def read_lens_record(path: Path) -> LensRecord:
    """The checked sidecar at `path`; a file that is not one is a LensError naming it and the field."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise LensError(f"{path}: not valid JSON ({exc}); save the lens again (`lhd lens fit` resumes from its "
                        "checkpoint)") from None
    if not isinstance(data, dict):
        raise LensError(f"{path}: not a JSON object (a lens sidecar)")
    if data.get("format") != FORMAT:
        raise LensError(f"{path}: format {data.get('format')!r}, expected {FORMAT!r}")
    try:
        return LensRecord.model_validate(data)
    except ValidationError as exc:
        raise record_error(exc, path, LensRecord) from None
