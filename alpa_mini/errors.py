"""Every error a user of alpa_mini can catch, in one place.

The solver errors are defined in ``alpa_mini.solvers.errors`` (the solvers import nothing from
alpa_mini) and re-exported here.
"""

from __future__ import annotations

from typing import Any

from .solvers.errors import InfeasibleError, SolverInputError, SolverTimeLimitError

__all__ = [
    "ConfigError",
    "InfeasibleError",
    "MemoryBudgetError",
    "ProfileError",
    "SolverInputError",
    "SolverTimeLimitError",
    "WorkerFailedError",
]


class ConfigError(ValueError):
    """A cluster (or other) config is malformed; the message names the field and value."""


class ProfileError(ValueError):
    """A profile database is malformed; the message names the field and the value."""


class MemoryBudgetError(ValueError):
    """No layout fits the memory budget; ``min_budget`` is the smallest per-device peak found.
    ``timed_out``: the solver found no feasible layout within its time limit instead."""

    def __init__(self, message: str, min_budget: float | None, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.min_budget = min_budget
        self.timed_out = timed_out


class WorkerFailedError(RuntimeError):
    """A host worker died or stopped answering; ``host`` is its index in the cluster,
    ``lost`` the values that lived on it (step outputs not fetched before it failed)."""

    def __init__(
        self, host: int, info: dict[str, Any], reason: str, lost: tuple[str, ...] = ()
    ) -> None:
        self.host, self.reason, self.lost = host, reason, lost
        where = f"node {info['node_ip']}, pid {info['pid']}" if info else "unknown node"
        shown = "; ".join(lost[:8]) + (f"; and {len(lost) - 8} more" if len(lost) > 8 else "")
        values = f"; {len(lost)} values lived on it and are lost: {shown}" if lost else ""
        super().__init__(
            f"worker of host {host} ({where}) failed: {reason}{values}; call "
            "alpa_mini.shutdown() and alpa_mini.init(cluster='ray', ...) again, then "
            "alpa_mini.restore_checkpoint(...) to continue from the last checkpoint"
        )
