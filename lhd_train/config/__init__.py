"""Typed settings: `base` (strict models, the one error translator, YAML + overrides), `vocab`
(categories, levels, types, modes, roles), `run` (run configs), `auditor` (auditor settings and
options), `recipe` (training recipes), `slurm` (the variables of each `lhd slurm render` stage).
Import from the module that owns a name."""
