"""The baselines' names, apart from ``baselines.py`` so that reading result files imports no
planner: which run for every model family, which one each family's users run, and former
names that result files written before a rename still use."""

from __future__ import annotations

__all__ = [
    "BASELINES",
    "FAITHFUL",
    "FAITHFUL_TARGETS",
    "GENERIC",
    "RENAMED",
    "baseline_name",
    "faithful_target",
    "family_baselines",
]

#: Baselines for every model family.
GENERIC = ("data-parallel", "zero-2", "zero-3", "pp-dp", "strong-grid")
BASELINES = (*GENERIC, "megatron-lm", "deepspeed-moe")
#: The baseline each model family's users run, as Alpa's paper compared with.
FAITHFUL = {"gpt": "megatron-lm", "moe": "deepspeed-moe", "wresnet": "pp-dp"}
#: Issue 23's bound on ours / the faithful baseline on 16 or more GPUs (1.00 below that):
#: Alpa reports 3.5-9.7x over DeepSpeed-MoE, Mist 1.28x over Megatron-LM.
FAITHFUL_TARGETS = {"gpt": 0.95, "moe": 0.5, "wresnet": 0.8}
#: Former names, as result files written before the rename spell them.
RENAMED = {"megatron": "strong-grid"}


def baseline_name(name: str) -> str:
    """A baseline's current name (old result files say "megatron" for "strong-grid")."""
    return RENAMED.get(name, name)


def family_baselines(family: str) -> tuple[str, ...]:
    """The baselines a model family is compared with: the generic ones and its faithful one."""
    faithful = FAITHFUL.get(family)
    return GENERIC if faithful is None or faithful in GENERIC else (*GENERIC, faithful)


def faithful_target(family: str, gpus: int) -> float:
    """The bound on ours / the family's faithful baseline for a row on ``gpus`` GPUs."""
    return FAITHFUL_TARGETS.get(family, 1.0) if gpus >= 16 else 1.0
