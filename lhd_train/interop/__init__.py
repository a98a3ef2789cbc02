"""Conversions between our run directories and other formats, a stage above `rundir/`:
`reference_import` (`lhd import-reference`: the authors' session folders, read and checked in
`reference_files`, written as one of our runs) and `export` (`lhd export`: a run as a `datasets`
dataset). They use the config, bench and audit layers, which `rundir/` must not import."""
