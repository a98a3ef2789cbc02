"""Jacobian lens (fit, load, apply), logit-lens and linear-probe baselines, position tagging,
entitlement probe sets and margin readouts.

Modules, in data-flow order: `model` (the model interface + HF adapter + hooks), `corpus`,
`positions`, `fit`, `store`, `readout`, `margins`, `probes`, `runs`, `read`, `stats`, `report`,
`cli`. The toy test models live in tests/support/lens_toy.py.
"""
__version__ = "0.1.0"
