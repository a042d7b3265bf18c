"""Errors shared by every solver: bad input and proven infeasibility."""

from __future__ import annotations

__all__ = ["InfeasibleError", "SolverInputError", "SolverTimeLimitError"]


class SolverInputError(ValueError):
    """A problem given to a solver is malformed.

    The message always names the field, the offending index (node, edge, layer...) and the
    value, and says what would be valid.
    """


class InfeasibleError(RuntimeError):
    """The problem has no feasible solution; the message says which constraint binds.

    ``details`` carries machine-readable facts (e.g. the smallest usage limit that would fit)
    so callers can build their own messages.
    """

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.details = dict(details)


class SolverTimeLimitError(RuntimeError):
    """No feasible solution was found in time, and infeasibility was not proven either."""
