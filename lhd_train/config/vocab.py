"""The benchmark's fixed vocabularies, named once: event categories and pressure levels (in the
reference's order: its sampler indexes them in exactly this order), deception types, audit
modes, training directions, roles and supervisor states."""
from __future__ import annotations

from typing import Literal, get_args

Category = Literal["GOAL_CONFLICT", "COMPETITIVE_INTERACTION", "MORAL_DILEMMA", "AUTHORITY_DIRECTIVE",
                   "INFORMATION_GAP"]
Level = Literal["LOW", "MEDIUM", "HIGH", "CRITICAL"]
CATEGORIES: tuple[str, ...] = get_args(Category)
LEVELS: tuple[str, ...] = get_args(Level)

DeceptionType = Literal["FALSIFICATION", "CONCEALMENT", "EQUIVOCATION"]
TYPES: tuple[str, ...] = get_args(DeceptionType)
Mode = Literal["full", "window", "causal", "task"]
MODES: tuple[str, ...] = get_args(Mode)
Direction = Literal["honest", "deceptive"]  # what a training dataset or recipe pushes the model towards

ROLES: tuple[str, ...] = ("performer", "supervisor", "summariser", "auditor")
STATES: tuple[str, ...] = ("trust", "satisfaction", "comfort")
