"""The run directory (docs/formats.md): the contract between stages.

`layout` names every path (`RunDir`), `files` is the one JSONL / atomic-write / hash / timestamp
toolkit, `store` holds the checked readers, the message store and the `.done` markers, `rows` the
schema versions, `lock` the one-writer lock, `names` the rule for names that become folder names,
`shard` the split of a run's trials (and a lens's prompts) into shards and the shard runs' names
(the conversions to and from other formats are a stage above, `lhd_train.interop`). Every stage
reads and writes a run through these modules and never spells a file name itself. This package
imports nothing above it (no config, stage, CLI or lens module: `tests/test_layout.py`)."""
from lhd_train.rundir.layout import RunDir, TrialFiles

__all__ = ["RunDir", "TrialFiles"]
