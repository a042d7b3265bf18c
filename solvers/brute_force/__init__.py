"""Exhaustive reference solvers, for tests only: obviously correct, exponentially slow."""

from .clustering import brute_force_clustering
from .sharding import brute_force_min_peak, brute_force_sharding
from .stage_reference import random_stage_problem, solve_stages_reference
from .stages import brute_force_stages

__all__ = [
    "brute_force_clustering",
    "brute_force_min_peak",
    "brute_force_sharding",
    "brute_force_stages",
    "random_stage_problem",
    "solve_stages_reference",
]
