"""Intra-operator sharding ILP: ``solve_sharding(problem) -> ShardingSolution``.

Pipeline: exact graph simplification (``simplify``) → a fast heuristic incumbent on large
cores (``local_search``) → the MIP (``mip_model`` + ``mip_backends``) warm-started from it, or,
when that MIP is too large for the time limit, exact sub-MIPs region by region (``lns``) →
the best assignment mapped back to every original node and re-checked with ``evaluate``.
The reported status is the solver's own: ``optimal`` only when the MIP proved it (or
simplification left nothing to decide), else ``feasible`` with a gap.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ..errors import (
    FractionalRelaxation,
    InfeasibleError,
    SolverInputError,
    SolverTimeLimitError,
)
from .backends import resolve_backend, run_mip
from .lns import improve_by_lns
from .local_search import local_search, min_peak_assignment
from .mip_model import build_mip
from .problem import ShardingProblem, evaluate, interval_peak
from .simplify import CoreProblem, Reduction, simplify

__all__ = ["ShardingSolution", "solve_sharding"]

#: Cores smaller than this many strategies go straight to the MIP (a heuristic adds nothing).
HEURISTIC_MIN_STRATEGIES = 1000
#: Under a time limit, a core whose MIP has more columns than this is improved by LNS
#: instead: HiGHS did not finish the root LP of V (680k columns) or K (1.3M) in 300 s.
FULL_MIP_MAX_COLUMNS = 250_000
#: Local search before a whole MIP only needs to hand it a good warm start.
WARM_START_SECONDS = 5.0
#: Under a usage limit that can bind, HiGHS's first feasible point can take longer than the
#: whole unconstrained solve (a 543-variable GPT core: 3.6 s idle, over 10 s on a loaded
#: machine); a short search hands the MIP one even on small cores.
BINDING_LIMIT_WARM_START_SECONDS = 0.5
BINDING_LIMIT_SECONDS_PER_STRATEGY = 5e-5


@dataclass(frozen=True)
class ShardingSolution:
    """The chosen strategy per node, its cost and how the solver got there.

    ``status`` is ``optimal`` (proven), ``feasible`` (stopped by the time limit; ``gap`` and
    ``lower_bound`` say how far from proven, None when unknown) or ``infeasible`` (only with
    ``on_infeasible="return"``: the lowest-peak assignment found).
    """

    choice: tuple[int, ...]
    objective: float
    node_cost: float
    edge_cost: float
    peak_usage: float
    usage_limit: float | None
    status: str
    gap: float | None  # relative (objective - lower_bound) / objective; 0 when optimal
    lower_bound: float | None
    backend: str
    solve_time: float
    timings: dict[str, float] = field(default_factory=dict)
    model_size: dict[str, int] = field(default_factory=dict)
    reduction: dict[str, Any] = field(default_factory=dict)
    heuristic_objective: float | None = None
    source: str = "mip"  # which stage produced the returned assignment
    detail: str = ""

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("objective", "lower_bound", "heuristic_objective", "gap"):
            value = data[key]
            if isinstance(value, float) and not math.isfinite(value):
                data[key] = None
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> ShardingSolution:
        data = json.loads(text)
        data["choice"] = tuple(data["choice"])
        for key in ("nodes", "edges", "strategies"):
            if key in data.get("reduction", {}):
                data["reduction"][key] = tuple(data["reduction"][key])
        return cls(**data)

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs for a summary table."""
        gap = "—" if self.gap is None else f"{100 * self.gap:.4f}%"
        out = [
            ("status", self.status),
            ("objective", f"{self.objective:,.6g}"),
            ("  node cost", f"{self.node_cost:,.6g}"),
            ("  edge cost", f"{self.edge_cost:,.6g}"),
            ("lower bound", "—" if self.lower_bound is None else f"{self.lower_bound:,.6g}"),
            ("gap", gap),
            ("peak usage", f"{self.peak_usage:,.6g}"),
            ("usage limit", "none" if self.usage_limit is None else f"{self.usage_limit:,.6g}"),
            ("backend", self.backend),
            ("found by", self.source),
            ("solve time", f"{self.solve_time:.3f} s"),
        ]
        red = self.reduction
        if red:
            out.append(("nodes", f"{red['nodes'][0]} → {red['nodes'][1]} after simplification"))
            out.append(("edges", f"{red['edges'][0]} → {red['edges'][1]}"))
            out.append(("strategies", f"{red['strategies'][0]} → {red['strategies'][1]}"))
        if self.model_size:
            ms = self.model_size
            out.append(
                (
                    "MIP size",
                    f"{ms['columns']} cols ({ms['binaries']} binary), "
                    f"{ms['rows']} rows, {ms['nonzeros']} nonzeros",
                )
            )
        return out


def solve_sharding(
    problem: ShardingProblem,
    *,
    backend: str = "auto",
    time_limit: float | None = None,
    mip_rel_gap: float = 0.0,
    simplify_graph: bool = True,
    heuristic_time: float | None = None,
    heuristic_min_strategies: int | None = None,
    full_mip_max_columns: int = FULL_MIP_MAX_COLUMNS,
    on_infeasible: str = "raise",
    threads: int = 1,
    seed: int = 0,
    lp_first: bool = False,
    defer_fractional: bool = False,
) -> ShardingSolution:
    """Solve a sharding problem to optimality, or as well as ``time_limit`` (seconds) allows.

    ``heuristic_time`` caps the local search that seeds the MIP (default: only on large
    cores, a quarter of the limit); ``heuristic_min_strategies`` skips it on cores with fewer
    strategies than that. Under a time limit, MIPs with more than ``full_mip_max_columns``
    columns are improved region by region instead of solved whole.
    ``lp_first`` tries to settle the whole MIP by its LP relaxation first (see
    ``mip_backends.run_mip``); the planner's layer MIPs gain 5-10x from it.
    ``defer_fractional`` (with ``lp_first``, HiGHS) raises ``FractionalRelaxation`` with the
    relaxation's bound where the LP does not settle the MIP, instead of branching: a caller
    that may never need this MIP's exact optimum (the stage DP) solves it only if it must.
    ``on_infeasible="raise"`` raises ``InfeasibleError`` naming the smallest achievable peak
    usage; ``"return"`` returns a solution with status
    ``infeasible`` holding the lowest-peak assignment found.
    """
    _check_arguments(problem, on_infeasible, time_limit, mip_rel_gap)
    t0 = time.perf_counter()
    run = _Run(
        problem=problem,
        backend=resolve_backend(backend),
        t0=t0,
        deadline=math.inf if time_limit is None else t0 + time_limit,
        time_limit=time_limit,
        on_infeasible=on_infeasible,
        simplify_graph=simplify_graph,
        reduction=_simplify(problem, simplify_graph),
    )
    run.timings["simplify"] = run.reduction.stats.seconds
    core = run.reduction.core
    if _constant_usage_over_limit(core):
        return run.infeasible()

    # 1. The whole MIP, and whether it is small enough to run under the time limit.
    model = None
    if core.num_vars:
        tb = time.perf_counter()
        model = build_mip(core)
        run.timings["build"] = time.perf_counter() - tb
        run.model_size = model.size()
    region_by_region = (
        model is not None and time_limit is not None and model.num_cols > full_mip_max_columns
    )
    # 2. A heuristic incumbent on large cores: a short warm start before the whole MIP, or
    #    the starting point of the region-by-region search.
    seconds = _heuristic_seconds(
        core, simplify_graph, heuristic_time, heuristic_min_strategies, time_limit,
        region_by_region,
    )  # fmt: skip
    run.find_incumbent(seconds, seed)
    # 3. The MIP on what is left: whole, or region by region when it is too big for the time.
    mip = None
    if region_by_region and run.incumbent is not None:
        run.improve_by_regions(seed)
    elif model is not None:
        warm = model.columns_from(core, run.incumbent) if run.incumbent is not None else None
        mip = run_mip(
            model,
            run.backend,
            time_limit=None if time_limit is None else _left(run.deadline),
            mip_rel_gap=mip_rel_gap,
            warm_start=warm,
            threads=threads,
            lp_first=lp_first,
            defer_fractional=defer_fractional,
        )
        run.timings["mip"] = mip.seconds
        if mip.status == "fractional":
            bound = mip.bound * model.cost_scale + model.offset
            raise FractionalRelaxation(
                f"the LP relaxation is fractional (bound {bound:.6g}); MIP not solved", bound
            )
    # 4. Pick the best assignment and report honestly.
    picked = run.pick(model, mip)
    return picked if isinstance(picked, ShardingSolution) else run.solution(*picked)


def _check_arguments(
    problem: Any, on_infeasible: str, time_limit: float | None, mip_rel_gap: float
) -> None:
    if not isinstance(problem, ShardingProblem):
        raise SolverInputError(f"problem: expected a ShardingProblem, got {type(problem).__name__}")
    if on_infeasible not in ("raise", "return"):
        raise SolverInputError(f"on_infeasible: {on_infeasible!r} is not 'raise' or 'return'")
    if time_limit is not None and not (time_limit > 0):
        raise SolverInputError(
            f"time_limit: {time_limit!r} must be a positive number of seconds or None"
        )
    if not (0.0 <= mip_rel_gap < 1.0):
        raise SolverInputError(f"mip_rel_gap: {mip_rel_gap!r} must be in [0, 1)")


def _simplify(problem: ShardingProblem, enabled: bool) -> Reduction:
    try:
        return simplify(problem, enabled=enabled)
    except InfeasibleError as err:
        # Forbidden costs alone leave a node without choices: no budget can help.
        raise InfeasibleError(
            f"no assignment avoids forbidden costs: {err}", **err.details
        ) from None


def _heuristic_seconds(
    core: CoreProblem,
    simplify_graph: bool,
    heuristic_time: float | None,
    heuristic_min_strategies: int | None,
    time_limit: float | None,
    region_by_region: bool,
) -> float:
    """How long the local search that seeds the MIP may run (0: not at all)."""
    n_strategies = sum(len(c) for c in core.costs)
    if not simplify_graph:
        return 0.0  # the heuristic expects a simplified core (no forbidden nodes)
    if heuristic_min_strategies is not None:
        small = n_strategies < heuristic_min_strategies
    else:  # an explicit heuristic_time alone runs the search whatever the core's size
        small = heuristic_time is None and n_strategies < HEURISTIC_MIN_STRATEGIES
    if small:
        if not _limit_can_bind(core):
            return 0.0
        # Scaled by size: a few-variable core needs no more than its starting points.
        cap = min(
            BINDING_LIMIT_WARM_START_SECONDS, BINDING_LIMIT_SECONDS_PER_STRATEGY * n_strategies
        )
        return min(cap, heuristic_time if heuristic_time is not None else cap)
    if heuristic_time is not None:
        return heuristic_time
    if region_by_region:
        return 0.3 * time_limit
    return min(WARM_START_SECONDS, 0.1 * (time_limit or 50.0))


@dataclass
class _Run:
    """One ``solve_sharding`` call: its inputs, clock, incumbent and timings."""

    problem: ShardingProblem
    backend: str
    t0: float
    deadline: float
    time_limit: float | None
    on_infeasible: str
    simplify_graph: bool
    reduction: Reduction
    timings: dict[str, float] = field(default_factory=dict)
    model_size: dict[str, int] = field(default_factory=dict)
    incumbent: np.ndarray | None = None
    heuristic_cost: float = math.inf
    incumbent_source: str = "heuristic"

    def infeasible(self) -> ShardingSolution:
        return _infeasible(
            self.problem, self.reduction, self.backend, self.deadline, self.t0, self.timings,
            self.on_infeasible, self.simplify_graph,
        )  # fmt: skip

    def find_incumbent(self, seconds: float, seed: int) -> None:
        core = self.reduction.core
        if not core.num_vars or seconds <= 0:
            return
        th = time.perf_counter()
        result = local_search(core, time_limit=min(seconds, _left(self.deadline)), seed=seed)
        self.timings["heuristic"] = time.perf_counter() - th
        if result.feasible:
            self.incumbent, self.heuristic_cost = result.choice, result.cost

    def improve_by_regions(self, seed: int) -> None:
        tl = time.perf_counter()
        lns = improve_by_lns(
            self.reduction.core,
            self.incumbent,
            time_limit=_left(self.deadline),
            backend=self.backend,
            seed=seed,
        )
        self.timings["lns"] = time.perf_counter() - tl
        if lns.improvements:
            self.incumbent, self.heuristic_cost = lns.choice, lns.cost
            self.incumbent_source = "heuristic+lns"

    def pick(self, model: Any, mip: Any) -> ShardingSolution | tuple:
        """The best assignment of the core and (status, bound, source, detail), or the
        infeasible solution."""
        core = self.reduction.core
        if not core.num_vars:
            choice = np.zeros(0, dtype=np.int64)
            return choice, "optimal", None, "simplify", "simplification decided every node"
        if mip is None:  # large core under a time limit: local search + LNS
            if self.incumbent is None:
                raise SolverTimeLimitError(
                    f"no feasible assignment found within time_limit={self.time_limit} s by the "
                    "local search, and the whole MIP is too large to try; give it more time or "
                    "a larger usage_limit"
                )
            detail = "whole MIP too large for the time limit; improved region by region (LNS)"
            return self.incumbent, "feasible", None, self.incumbent_source, detail
        candidates = []
        if mip.x is not None:
            candidates.append((model.strategies_from(mip.x), "mip"))
        if self.incumbent is not None:
            candidates.append((self.incumbent, self.incumbent_source))
        if not candidates:
            if mip.status == "infeasible":
                return self.infeasible()
            raise SolverTimeLimitError(
                f"no feasible assignment found within time_limit={self.time_limit} s "
                f"({mip.detail}); give it more time or a larger usage_limit"
            )
        scored = [(core.evaluate(c)[0], i, c, s) for i, (c, s) in enumerate(candidates)]
        _, _, choice, source = min(scored, key=lambda t: (t[0], t[1]))
        bound = mip.bound * model.cost_scale + model.offset if math.isfinite(mip.bound) else None
        status = "optimal" if mip.status == "optimal" else "feasible"
        return choice, status, bound, source, mip.detail

    def solution(
        self, core_choice: np.ndarray, status: str, bound: float | None, source: str, detail: str
    ) -> ShardingSolution:
        choice = self.reduction.expand(core_choice)
        ev = evaluate(self.problem, choice)
        if not ev.feasible:  # a bug guard: every path must yield a feasible assignment
            raise RuntimeError(
                f"internal error: solver returned an assignment that is {ev.explain()}"
            )
        if status == "optimal":
            bound = ev.cost
        gap = None if bound is None else max(0.0, (ev.cost - bound) / max(abs(ev.cost), 1e-12))
        return ShardingSolution(
            choice=tuple(int(c) for c in choice),
            objective=ev.cost,
            node_cost=ev.node_cost,
            edge_cost=ev.edge_cost,
            peak_usage=ev.peak_usage,
            usage_limit=self.problem.usage_limit,
            status=status,
            gap=0.0 if status == "optimal" else gap,
            lower_bound=bound,
            backend=self.backend,
            solve_time=time.perf_counter() - self.t0,
            timings={k: round(v, 4) for k, v in self.timings.items()},
            model_size=self.model_size,
            reduction=self.reduction.stats.as_dict(),
            heuristic_objective=None
            if not math.isfinite(self.heuristic_cost)
            else self.heuristic_cost,
            source=source,
            detail=detail,
        )


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.perf_counter()) if math.isfinite(deadline) else math.inf


def _limit_can_bind(core: CoreProblem) -> bool:
    """Whether some assignment could exceed the usage limit (every term at its largest
    usage is an upper bound on any assignment's peak)."""
    if core.usage_limit is None or not len(core.term_var):
        return False
    largest = np.array([float(u.max()) for u in core.term_usages])
    starts = np.concatenate([core.term_intervals[:, 0], core.const_intervals[:, 0]])
    ends = np.concatenate([core.term_intervals[:, 1], core.const_intervals[:, 1]])
    worst = interval_peak(starts, ends, np.concatenate([largest, core.const_usages]))[0]
    return worst > core.usage_limit


def _constant_usage_over_limit(core: CoreProblem) -> bool:
    """Usage that no choice can change must fit on its own; if not, no budget search helps."""
    if core.usage_limit is None or not len(core.const_usages):
        return False
    peak = interval_peak(core.const_intervals[:, 0], core.const_intervals[:, 1], core.const_usages)[
        0
    ]
    return peak > core.usage_limit * (1 + 1e-9)


def _infeasible(
    problem: ShardingProblem,
    reduction: Reduction,
    backend: str,
    deadline: float,
    t0: float,
    timings: dict[str, float],
    on_infeasible: str,
    simplified: bool,
) -> ShardingSolution:
    """The MIP proved the problem infeasible: say why, with the smallest achievable peak."""
    core = reduction.core
    forbidden_only = InfeasibleError(
        "no assignment avoids forbidden costs (proven); no usage limit can help",
        proven=True,
    )
    if core.usage_limit is None:
        raise forbidden_only
    budget = min(_left(deadline), 30.0)
    best_choice, best_peak = None, math.inf
    if not core.num_vars:  # simplification decided everything: the peak is what it is
        return _report_infeasible(
            problem,
            reduction,
            np.zeros(0, np.int64),
            True,
            0.0,
            backend,
            t0,
            timings,
            on_infeasible,
        )
    if simplified:
        heur = min_peak_assignment(core, time_limit=max(0.5, 0.3 * budget))
        if math.isfinite(core.evaluate(heur.choice)[0]):
            best_choice, best_peak = heur.choice, heur.peak_usage
    model = build_mip(core, objective="peak")
    warm = model.columns_from(core, best_choice) if best_choice is not None else None
    mip = run_mip(model, backend, time_limit=max(1.0, 0.7 * budget), warm_start=warm)
    if mip.status == "infeasible":
        raise forbidden_only
    if mip.x is not None:
        choice = model.strategies_from(mip.x)
        peak = core.evaluate(choice)[1]
        if peak < best_peak:
            best_choice, best_peak = choice, peak
    if best_choice is None:
        raise SolverTimeLimitError(
            f"usage_limit {core.usage_limit:.6g} cannot be met (proven by the MIP), and no "
            "assignment was found in time to say how much memory would be needed"
        )
    proven_bound = mip.bound * model.mem_usage_scale if math.isfinite(mip.bound) else 0.0
    timings["min_peak"] = mip.seconds
    return _report_infeasible(
        problem,
        reduction,
        best_choice,
        mip.status == "optimal",
        proven_bound,
        backend,
        t0,
        timings,
        on_infeasible,
    )


def _report_infeasible(
    problem: ShardingProblem,
    reduction: Reduction,
    core_choice: np.ndarray,
    proven: bool,
    proven_bound: float,
    backend: str,
    t0: float,
    timings: dict[str, float],
    on_infeasible: str,
) -> ShardingSolution:
    """Raise (or return) the memory infeasibility with the lowest-peak assignment found."""
    choice = reduction.expand(core_choice)
    ev = evaluate(problem, choice)
    limit = problem.usage_limit
    how = "the minimum" if proven else f"the best found; proven lower bound {proven_bound:.6g}"
    message = (
        f"usage_limit {limit:.6g} cannot be met (proven); the smallest achievable "
        f"peak usage is {ev.peak_usage:.6g} ({how})"
    )
    if on_infeasible == "raise":
        raise InfeasibleError(
            message, min_peak=ev.peak_usage, proven=proven, lower_bound=proven_bound
        )
    return ShardingSolution(
        choice=tuple(int(c) for c in choice),
        objective=ev.cost,
        node_cost=ev.node_cost,
        edge_cost=ev.edge_cost,
        peak_usage=ev.peak_usage,
        usage_limit=limit,
        status="infeasible",
        gap=None,
        lower_bound=None,
        backend=backend,
        solve_time=time.perf_counter() - t0,
        timings=timings,
        model_size={},
        reduction=reduction.stats.as_dict(),
        source="min_peak",
        detail=message,
    )
