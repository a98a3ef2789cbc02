"""lhd's lens-reading pipelines: runs, probe sets and experiment answers read through the `lens` library."""
