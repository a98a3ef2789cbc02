"""Jacobian lens (fit, load, apply), logit-lens and linear-probe baselines, position tagging,
entitlement probe sets and margin readouts: a torch and transformers library (its commands are
`lhd lens`, `lhd_train/cli/lens.py`).

Modules, in data-flow order: `model` (the model interface + HF adapter + hooks), `corpus`,
`positions`, `jacobian`, `fit`, `store`, `readout` (the readouts and their registry), `margins`,
`probes`, `runs`, `read`, `stats`, `tables`, `report`; lens quality: `promptsets`, `passk`, `causal`,
`quality`, `fidelity`. The toy test models live in tests/support/lens_toy.py.
"""
__version__ = "0.1.0"
