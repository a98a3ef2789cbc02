"""Typed settings: `base` (strict models, the one error translator, YAML + overrides), `vocab`
(categories, levels, types, modes, roles), `run` (run configs), `auditor` (auditor settings and
options), `recipe` (training recipes). Import from the module that owns a name."""
