"""The run directory (docs/formats.md): the contract between stages.

`layout` names every path (`RunDir`), `files` is the one JSONL / atomic-write / hash / timestamp
toolkit, `store` holds the checked readers, the message store and the `.done` markers, `rows` the
schema versions, `lock` the one-writer lock, `names` the rule for names that become folder names,
`export` and `reference_import` the conversions to and from other formats. Every stage reads and
writes a run through these modules and never spells a file name itself."""
from lhd_train.rundir.layout import RunDir, TrialFiles

__all__ = ["RunDir", "TrialFiles"]
