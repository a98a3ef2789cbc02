"""The experiment's cells, named once: files condition x pressure (and the control question).

Kept apart from `conditions` (which renders them and needs the task pack and the lens probe
extraction) so the metrics, the comparison and the report can name cells without reaching them."""
from __future__ import annotations

FULL, DELETED, ALTERED, CONTROL = "full", "deleted", "altered", "control"
NONE, DEMAND = "none", "demand"
FILES = (FULL, DELETED, ALTERED)
PRESSURES = (NONE, DEMAND)
