"""Errors shared by every solver: bad input, proven infeasibility, and a MIP left unsolved at
the caller's request."""

from __future__ import annotations

__all__ = [
    "FractionalRelaxation",
    "InfeasibleError",
    "SolverInputError",
    "SolverTimeLimitError",
]


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


class FractionalRelaxation(RuntimeError):
    """The MIP's LP relaxation is fractional and the caller asked for its bound instead of
    branch-and-bound (``solve_sharding(defer_fractional=True)``): ``lower_bound`` is the
    relaxation's optimum, in the problem's own cost units, which no assignment beats."""

    def __init__(self, message: str, lower_bound: float) -> None:
        super().__init__(message, lower_bound)  # both in args, so that it pickles whole
        self.lower_bound = lower_bound

    def __str__(self) -> str:
        return str(self.args[0])
