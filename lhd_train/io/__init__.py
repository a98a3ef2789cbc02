"""The file toolkit every layer writes and reads through, below the run directory and the config:
append-only JSONL, atomic replacement, refused writes (`StorageError`), hashes and YAML/JSON
mappings (`files.py`), the YAML loader that refuses repeated keys (`strict_yaml.py`), safe CSV cells
(`csv_cells.py`), and provenance (`provenance.py`: timestamps, package versions). It knows
nothing about runs, stages or models (docs/formats.md)."""
