"""Schema versions of the records a run directory holds (docs/formats.md), named once.

Writers stamp these into every row; readers and tests compare against them."""
from __future__ import annotations

ROW_SCHEMA = "lhd.round/1"        # trials/<trial>.jsonl
AUDIT_SCHEMA = "lhd.audit/1"      # audit/<auditor-id>/<trial>.jsonl
AUDITOR_SCHEMA = "lhd.auditor/1"  # audit/<auditor-id>/auditor.json
