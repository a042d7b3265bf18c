"""Run a ``MipModel`` on HiGHS (through highspy, from numpy arrays) or CBC (through pulp).

HiGHS gets the arrays directly: building large models through pulp's Python objects was the
bottleneck (minutes for a 1M-column model), while ``Highs.passModel`` takes the CSR arrays
as they are. CBC is reached through pulp, which bundles it. Both report the solver's own
status and bounds; we never trust a status word alone (HiGHS stopping on its time limit with
a 100% gap is *not* optimal, whatever a wrapper says).

The solvers are silent by default: HiGHS's log and its once-per-process banner, and CBC's
messages, are shown only when the ``alpa_mini.solvers`` logger is enabled for DEBUG, e.g.
``logging.getLogger("alpa_mini.solvers").setLevel(logging.DEBUG)`` with a handler set up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .mip_model import MipModel

__all__ = ["MipResult", "available_backends", "resolve_backend", "run_mip"]

BACKENDS = ("auto", "highs", "cbc")

_log = logging.getLogger("alpa_mini.solvers")
# HiGHS prints its banner once per process, when the first Highs object is made.
_banner_lock = threading.Lock()
_banner_done = False


def _solver_logs() -> bool:
    """Whether the user asked for the solvers' own output."""
    return _log.isEnabledFor(logging.DEBUG)


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """Send file descriptor 1 (where HiGHS's C++ code prints) to the null device."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _new_highs() -> object:
    """A ``highspy.Highs``; the first one of the process is made with the banner silenced
    unless the user asked for solver logs."""
    global _banner_done
    import highspy

    with _banner_lock:
        if _banner_done or _solver_logs():
            _banner_done = True
            return highspy.Highs()
        with _stdout_silenced():
            h = highspy.Highs()
        _banner_done = True
        return h


@dataclass(frozen=True)
class MipResult:
    """What a backend returned, in the model's own (scaled) units."""

    status: str  # "optimal" | "feasible" | "infeasible" | "no_solution" | "fractional"
    x: np.ndarray | None
    objective: float  # scaled objective of x (inf when there is none)
    bound: float  # proven lower bound, scaled (-inf when unknown)
    seconds: float
    backend: str
    detail: str


def available_backends() -> tuple[str, ...]:
    found = []
    if importlib.util.find_spec("highspy") is not None:
        found.append("highs")
    if importlib.util.find_spec("pulp") is not None:
        found.append("cbc")
    return tuple(found)


def resolve_backend(backend: str) -> str:
    """Map ``auto`` to HiGHS where highspy is installed, else CBC; validate the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    have = available_backends()
    if backend == "auto":
        if not have:
            raise RuntimeError("backend: neither highspy nor pulp is installed")
        return have[0]
    if backend not in have:
        package = "highspy" if backend == "highs" else "pulp"
        raise RuntimeError(
            f"backend: {backend!r} needs the {package} package, which is not installed"
        )
    return backend


def run_mip(
    model: MipModel,
    backend: str,
    *,
    time_limit: float | None,
    mip_rel_gap: float = 0.0,
    warm_start: np.ndarray | None = None,
    threads: int = 1,
    lp_first: bool = False,
    defer_fractional: bool = False,
) -> MipResult:
    """Solve ``model``. ``lp_first`` (HiGHS only) first tries to prove the LP relaxation's
    optimum integral (see ``_lp_dive``): 5-10x faster on the planner's layer MIPs, whose
    relaxations are nearly always integral, but pure overhead on MIPs whose relaxations are
    not (the contest instances: +1 s on B, +16 s on A). ``defer_fractional`` (with
    ``lp_first``) stops where the dive fails: status "fractional", ``bound`` the root LP's
    optimum, no branch-and-bound."""
    backend = resolve_backend(backend)
    if time_limit is not None and time_limit <= 0:
        return MipResult("no_solution", None, math.inf, -math.inf, 0.0, backend, "no time left")
    if backend == "highs":
        return _run_highs(
            model, time_limit, mip_rel_gap, warm_start, threads, lp_first, defer_fractional
        )
    return _run_cbc(model, time_limit, mip_rel_gap, warm_start, threads)


def _highs_lp(model: MipModel, integer: bool) -> object:
    import highspy

    lp = highspy.HighsLp()
    lp.num_col_ = model.num_cols
    lp.num_row_ = model.num_rows
    lp.col_cost_ = model.c
    lp.col_lower_ = model.col_lower
    lp.col_upper_ = model.col_upper
    lp.row_lower_ = model.row_lower
    lp.row_upper_ = model.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.num_col_ = model.num_cols
    lp.a_matrix_.num_row_ = model.num_rows
    lp.a_matrix_.start_ = model.start.astype(np.int32)
    lp.a_matrix_.index_ = model.index.astype(np.int32)
    lp.a_matrix_.value_ = model.value
    if integer:
        kinds = [highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger]
        lp.integrality_ = [kinds[int(b)] for b in model.integer]
    return lp


def _highs(threads: int, time_limit: float | None) -> object:

    h = _new_highs()
    h.setOptionValue("output_flag", _solver_logs())
    h.setOptionValue("threads", int(threads))
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    return h


#: Integrality tolerance for accepting an LP vertex as integral.
LP_INTEGRAL_TOL = 1e-7
#: Relative slack within which a dive's LP objective still counts as the root bound.
LP_BOUND_RTOL = 1e-9
#: Most nodes an LP dive fixes before it hands the problem to branch-and-bound.
LP_MAX_DIVES = 8
#: Strategies of one node a dive tries before it gives up on the LP alone.
LP_DIVE_TRIES = 2


def _lp_dive(
    model: MipModel, time_limit: float | None, threads: int
) -> tuple[np.ndarray | None, float]:
    """An optimal MIP solution found by LP alone (or None), and the root LP's optimum, a
    lower bound on the MIP's (-inf where the LP was not solved to optimality).

    Sharding MIPs mostly have "integral LPs": the relaxation's optimal vertex picks one
    strategy per node, so it is the MIP's optimum (the LP bound equals its cost). Dual simplex
    reaches it 5-10x sooner than HiGHS's MIP path, whose presolve and root processing dominate
    on these 100k-column models. When the optimum is degenerate (a 2-D mesh with two equal
    axes has mirror-image plans of equal cost, and the LP averages them), fixing one
    fractional node to its largest strategy and re-solving from the same basis usually
    lands on an integral vertex (of a tie, the first choice that keeps the bound); it is
    accepted only if its objective still equals the root LP bound, which proves it optimal.
    """
    import highspy

    t0 = time.perf_counter()
    h = _highs(threads, time_limit)
    # Measured on GPT layer MIPs (126k-193k columns): presolve costs more than it saves, and
    # the default scaling tripled the dual simplex iterations (2.3 s vs 11.8 s on the worst).
    h.setOptionValue("presolve", "off")
    h.setOptionValue("simplex_scale_strategy", 0)
    h.passModel(_highs_lp(model, integer=False))
    offs = model.s_offsets
    deadline = math.inf if time_limit is None else t0 + time_limit

    def solve() -> float | None:
        left = deadline - time.perf_counter()
        if left <= 0:
            return None
        if math.isfinite(left):
            h.setOptionValue("time_limit", left)
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        return float(h.getInfo().objective_function_value)

    def bound(cols: np.ndarray, upper: np.ndarray) -> None:
        h.changeColsBounds(len(cols), cols.astype(np.int32), model.col_lower[cols], upper)

    root = solve()
    if root is None:
        return None, -math.inf
    tol = LP_BOUND_RTOL * max(abs(root), 1.0)
    for _ in range(LP_MAX_DIVES + 1):
        x = np.asarray(h.getSolution().col_value)
        frac = np.abs(x[: offs[-1]] - np.round(x[: offs[-1]])) > LP_INTEGRAL_TOL
        if not frac.any():
            x[: offs[-1]] = np.round(x[: offs[-1]])
            return x, root
        v = int(np.searchsorted(offs, np.flatnonzero(frac)[0], side="right")) - 1
        seg = np.arange(offs[v], offs[v + 1])
        # Try the node's fractional strategies, largest share first: with mirror-image
        # optima the two halves tie, and only one orientation may keep the root bound.
        tries = seg[np.argsort(-x[seg], kind="stable")]
        for keep in tries[x[tries] > LP_INTEGRAL_TOL][:LP_DIVE_TRIES]:
            others = seg[seg != keep]
            bound(others, np.zeros(len(others)))
            objective = solve()
            if objective is not None and objective <= root + tol:
                break
            bound(others, model.col_upper[others])
        else:
            return None, root  # no choice keeps the bound; branch-and-bound decides
    return None, root


def _run_highs(
    model: MipModel,
    time_limit: float | None,
    mip_rel_gap: float,
    warm_start: np.ndarray | None,
    threads: int,
    lp_first: bool,
    defer_fractional: bool = False,
) -> MipResult:
    t0 = time.perf_counter()
    if lp_first and model.integer.any():
        # At most half the time: a slow relaxation must leave the MIP room for a solution.
        x, root = _lp_dive(model, None if time_limit is None else time_limit / 2, threads)
        seconds = time.perf_counter() - t0
        if x is not None:
            objective = float(model.c @ x)
            return MipResult("optimal", x, objective, objective, seconds, "highs", "Optimal (LP)")
        if defer_fractional and math.isfinite(root):
            detail = "LP relaxation fractional; branch-and-bound deferred"
            return MipResult("fractional", None, math.inf, root, seconds, "highs", detail)
        time_limit = _time_left(time_limit, t0)
    result = _highs_mip(model, time_limit, mip_rel_gap, warm_start, threads)
    if warm_start is not None and not _vector_matches_objective(model, result):
        # HiGHS can hand back the user's start unchanged beside the objective of the point
        # it actually found (seen in 1.16 when presolve empties the model: the reported
        # objective is right, the vector is the stale start). Solve again without the
        # start rather than return a vector that is not the optimum it claims.
        time_limit = _time_left(time_limit, t0)
        result = _highs_mip(model, time_limit, mip_rel_gap, None, threads)
    if not _vector_matches_objective(model, result):
        result = _demoted(model, result)
    return dataclasses.replace(result, seconds=time.perf_counter() - t0)


def _time_left(time_limit: float | None, t0: float) -> float | None:
    """What is left of ``time_limit`` since ``t0`` (at least a millisecond; None: no limit)."""
    return None if time_limit is None else max(time_limit - (time.perf_counter() - t0), 1e-3)


#: Relative slack between c·x and the objective HiGHS reports for x (round-off only).
OBJECTIVE_MATCH_RTOL = 1e-6


def _vector_matches_objective(model: MipModel, result: MipResult) -> bool:
    """Whether the returned vector's own objective is the one the solver reported."""
    if result.x is None:
        return True
    own = float(model.c @ result.x)
    return abs(own - result.objective) <= OBJECTIVE_MATCH_RTOL * max(1.0, abs(result.objective))


def _demoted(model: MipModel, result: MipResult) -> MipResult:
    """A result whose vector disagrees with its objective: keep the vector, priced by itself,
    and claim no optimality for it (the bound stays the solver's)."""
    assert result.x is not None
    objective = float(model.c @ result.x)
    claimed = result.objective
    detail = f"{result.detail}; the vector's objective {objective:.9g} != reported {claimed:.9g}"
    return dataclasses.replace(result, status="feasible", objective=objective, detail=detail)


def _highs_mip(
    model: MipModel,
    time_limit: float | None,
    mip_rel_gap: float,
    warm_start: np.ndarray | None,
    threads: int,
) -> MipResult:
    """One branch-and-bound run of HiGHS on the whole MIP, optionally from a start."""
    import highspy

    t0 = time.perf_counter()
    h = _highs(threads, time_limit)
    h.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    # Costs are scaled to ~1e6; an absolute gap far below one unit of the smallest real
    # cost difference keeps "optimal" honest without chasing round-off.
    h.setOptionValue("mip_abs_gap", 1e-7)
    h.passModel(_highs_lp(model, integer=True))
    if warm_start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(map(float, warm_start))
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    seconds = time.perf_counter() - t0
    status = h.getModelStatus()
    info = h.getInfo()
    ms = highspy.HighsModelStatus
    detail = h.modelStatusToString(status)
    if status == ms.kInfeasible:
        return MipResult("infeasible", None, math.inf, math.inf, seconds, "highs", detail)
    has_x = info.primal_solution_status == 2  # kSolutionStatusFeasible
    x = np.asarray(h.getSolution().col_value) if has_x else None
    objective = float(info.objective_function_value) if has_x else math.inf
    bound = float(info.mip_dual_bound)
    if not math.isfinite(bound):
        bound = -math.inf
    if status == ms.kOptimal and has_x:
        return MipResult("optimal", x, objective, bound, seconds, "highs", detail)
    if has_x:
        return MipResult("feasible", x, objective, bound, seconds, "highs", detail)
    return MipResult("no_solution", None, math.inf, bound, seconds, "highs", detail)


def _run_cbc(
    model: MipModel,
    time_limit: float | None,
    mip_rel_gap: float,
    warm_start: np.ndarray | None,
    threads: int,
) -> MipResult:
    import pulp

    t0 = time.perf_counter()
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    cols = []
    for j in range(model.num_cols):
        hi = model.col_upper[j]
        # Integer with explicit bounds, not LpBinary: pulp's binary type resets the upper
        # bound to 1, which would re-open strategies the model pinned to 0.
        var = prob.add_variable(
            f"x{j}",
            lowBound=float(model.col_lower[j]),
            upBound=None if math.isinf(hi) else float(hi),
            cat=pulp.LpInteger if model.integer[j] else pulp.LpContinuous,
        )
        if warm_start is not None:
            var.setInitialValue(
                float(round(warm_start[j])) if model.integer[j] else float(warm_start[j])
            )
        cols.append(var)
    nz = np.flatnonzero(model.c)
    prob += pulp.LpAffineExpression([(cols[j], float(model.c[j])) for j in nz])
    for r in range(model.num_rows):
        lo, hi = float(model.row_lower[r]), float(model.row_upper[r])
        a, b = model.start[r], model.start[r + 1]
        expr = pulp.LpAffineExpression(
            [(cols[j], float(v)) for j, v in zip(model.index[a:b], model.value[a:b], strict=True)]
        )
        if lo == hi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"r{r}", lo)
            continue
        if math.isfinite(lo):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"r{r}lo", lo)
        if math.isfinite(hi):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"r{r}hi", hi)
    with warnings.catch_warnings():
        # pulp 3.x announces that 4.0 will unbundle CBC; the bundled binary is what we use.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(
            msg=_solver_logs(),
            timeLimit=None if time_limit is None else max(1, math.ceil(time_limit)),
            gapRel=mip_rel_gap,
            gapAbs=1e-7,
            threads=threads,
            warmStart=warm_start is not None,
        )
        prob.solve(solver)
    seconds = time.perf_counter() - t0
    # pulp: status 1 optimal, -1 infeasible; sol_status 1 optimal, 2 integer feasible
    # (stopped early with a solution), 0 none found.
    sol_status = prob.sol_status
    detail = pulp.LpStatus.get(prob.status, str(prob.status))
    if prob.status == pulp.LpStatusInfeasible:
        return MipResult("infeasible", None, math.inf, math.inf, seconds, "cbc", detail)
    if sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        x = np.array([v.value() or 0.0 for v in cols])
        objective = float(model.c @ x)
        if sol_status == pulp.LpSolutionOptimal:
            return MipResult("optimal", x, objective, objective, seconds, "cbc", detail)
        return MipResult("feasible", x, objective, -math.inf, seconds, "cbc", detail)
    return MipResult("no_solution", None, math.inf, -math.inf, seconds, "cbc", detail)
