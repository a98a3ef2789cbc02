"""Jacobian lens (fit, load, apply), logit-lens, tuned-lens and linear-probe readouts, position
tagging and margin readouts: a torch and transformers library that knows no run. It takes a model,
prompts, positions and token sets; reading lhd's runs and probe sets is `lhd_train/reading/`, and
its commands are `lhd lens` (`lhd_train/cli/lens.py`).

Modules, in data-flow order: `settings` (a fit's and a tuned lens's settings, declared once), `model`
(the model interface + HF adapter + hooks), `corpus`,
`positions`, `jacobian`, `fit`, `store`, `readout` (the readouts and their registry), `margins`,
`stats`; lens quality: `promptsets`, `passk`, `causal`, `quality`, `fidelity`; `files` and
`errors` (its own file toolkit and errors). The toy test models live in tests/support/lens_toy.py.
"""
__version__ = "0.1.0"
