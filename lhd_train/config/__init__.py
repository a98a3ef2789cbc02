"""Typed settings: `base` (strict models, the one error translator, YAML + overrides), `vocab`
(categories, levels, types, modes, roles), `run` (run configs), `auditor` (auditor settings and
options), `recipe` (training recipes); the variables of each `lhd slurm render` stage are
`lhd_train.ops.slurm_vars`.
Import from the module that owns a name."""
