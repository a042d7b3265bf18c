"""Large-neighbourhood search: improve a feasible assignment by exact MIPs on small regions.

The whole MIP of a large core (K: 1.3M columns) does not even finish its root LP within the
contest's limits, but the same MIP restricted to a few dozen connected variables, with the
rest fixed at the incumbent, solves in well under a second. Fixing variables is exact for
what stays free: their edges to fixed neighbours become node costs and the fixed variables'
memory becomes constant usage, so every sub-solution is feasible for the whole problem and
never worse than the incumbent (which is itself a solution of the sub-problem).

Regions are grown breadth-first from a seed, alternately a random variable and one live at
the current memory peak, and their size adapts: it grows after a sub-MIP proves optimality
quickly and shrinks after one times out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .backends import run_mip
from .mip_model import build_mip
from .problem import interval_peak
from .simplify import CoreProblem

__all__ = ["LnsResult", "improve_by_lns", "restrict"]

#: Upper bound on the columns of one sub-MIP (edge-pair variables dominate).
MAX_SUB_COLUMNS = 60_000


@dataclass(frozen=True)
class LnsResult:
    choice: np.ndarray
    cost: float
    rounds: int
    improvements: int
    seconds: float


class _Index:
    """Adjacency of a core, built once per search."""

    def __init__(self, core: CoreProblem) -> None:
        n = core.num_vars
        self.nbrs: list[list[int]] = [[] for _ in range(n)]
        self.incident: list[list[int]] = [[] for _ in range(n)]
        for e, (a, b) in enumerate(core.edges):
            self.nbrs[a].append(int(b))
            self.nbrs[b].append(int(a))
            self.incident[a].append(e)
            self.incident[b].append(e)
        self.terms: list[list[int]] = [[] for _ in range(n)]
        for j, x in enumerate(core.term_var):
            self.terms[int(x)].append(j)
        self.k = np.array([len(c) for c in core.costs], dtype=np.int64)


def restrict(
    core: CoreProblem, free: np.ndarray, choice: np.ndarray, index: _Index | None = None
) -> CoreProblem:
    """The sub-problem over variables where ``free`` is true, all others fixed at ``choice``.

    Costs of the fixed part are left out (they are the same for every sub-solution), so the
    sub-problem's objective differs from the full one by a constant.
    """
    index = index or _Index(core)
    ids = np.flatnonzero(free)
    remap = np.full(core.num_vars, -1, dtype=np.int64)
    remap[ids] = np.arange(len(ids))
    costs = [core.costs[x].astype(np.float64).copy() for x in ids]
    edges: list[tuple[int, int]] = []
    mats: list[np.ndarray] = []
    seen: set[int] = set()
    for x in ids:
        for e in index.incident[x]:
            if e in seen:
                continue
            seen.add(e)
            a, b = (int(v) for v in core.edges[e])
            mat = core.edge_costs[e]
            if free[a] and free[b]:
                edges.append((int(remap[a]), int(remap[b])))
                mats.append(mat)
            elif free[a]:
                costs[remap[a]] += mat[:, choice[b]]
            else:
                costs[remap[b]] += mat[choice[a], :]
    term_free = free[core.term_var] if len(core.term_var) else np.zeros(0, dtype=bool)
    fixed_terms = np.flatnonzero(~term_free)
    fixed_use = core.term_usage_of(choice)[fixed_terms]
    free_terms = np.flatnonzero(term_free)
    return CoreProblem(
        costs=tuple(costs),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(mats),
        term_var=remap[core.term_var[free_terms]],
        term_intervals=core.term_intervals[free_terms],
        term_usages=tuple(core.term_usages[j] for j in free_terms),
        const_intervals=np.concatenate([core.const_intervals, core.term_intervals[fixed_terms]]),
        const_usages=np.concatenate([core.const_usages, fixed_use]),
        usage_limit=core.usage_limit,
        const_cost=0.0,
    )


def _grow(index: _Index, seed: int, budget: int, rng: np.random.Generator) -> np.ndarray:
    """Breadth-first region from ``seed`` until adding a variable would pass ``budget`` columns.
    A component used up with budget left seeds another: the memory limit couples variables
    that share no edge, so a region confined to one component could never trade memory with
    the rest, and a small problem's region is the whole problem (its sub-MIP exact)."""
    free = np.zeros(len(index.k), dtype=bool)
    free[seed] = True
    cols = int(index.k[seed])
    frontier = [seed]
    reseeds = iter(rng.permutation(len(free)))  # drawn once: each variable is tried once

    def _cost(y: int) -> int:
        """Columns ``y`` would add: its strategies plus edge pairs with free neighbours."""
        return int(index.k[y]) + sum(int(index.k[y] * index.k[z]) for z in index.nbrs[y] if free[z])

    while True:
        if not frontier:
            fits = ((int(y), _cost(y)) for y in reseeds if not free[y])
            y, extra = next(((y, c) for y, c in fits if cols + c <= budget), (-1, 0))
            if y < 0:
                break
            free[y] = True
            cols += extra
            frontier = [y]
        nxt: list[int] = []
        order = rng.permutation(len(frontier))
        for i in order:
            x = frontier[i]
            for y in index.nbrs[x]:
                if free[y]:
                    continue
                extra = _cost(y)
                if cols + extra > budget:
                    continue
                free[y] = True
                cols += extra
                nxt.append(y)
        frontier = nxt
    return free


def _peak_vars(core: CoreProblem, index: _Index, choice: np.ndarray) -> np.ndarray:
    """Variables owning a memory term live at the current peak time."""
    if not len(core.term_var):
        return np.zeros(0, dtype=np.int64)
    use = core.term_usage_of(choice)
    starts = np.concatenate([core.term_intervals[:, 0], core.const_intervals[:, 0]])
    ends = np.concatenate([core.term_intervals[:, 1], core.const_intervals[:, 1]])
    _, t = interval_peak(starts, ends, np.concatenate([use, core.const_usages]))
    at_peak = (core.term_intervals[:, 0] <= t) & (t < core.term_intervals[:, 1])
    return np.unique(core.term_var[at_peak])


def improve_by_lns(
    core: CoreProblem,
    choice: np.ndarray,
    *,
    time_limit: float,
    backend: str = "auto",
    seed: int = 0,
    sub_time_limit: float = 5.0,
) -> LnsResult:
    """Improve a feasible core assignment until ``time_limit`` seconds have passed."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    rng = np.random.default_rng(seed)
    index = _Index(core)
    choice = np.asarray(choice, dtype=np.int64).copy()
    cost = core.evaluate(choice)[0]
    budget = 4_000
    rounds = improvements = 0
    stale = 0
    while time.perf_counter() < deadline - 0.2 and core.num_vars:
        rounds += 1
        if rounds % 2 == 0:
            hot = _peak_vars(core, index, choice)
            seed_var = int(rng.choice(hot)) if len(hot) else int(rng.integers(core.num_vars))
        else:
            seed_var = int(rng.integers(core.num_vars))
        free = _grow(index, seed_var, budget, rng)
        if free.all() and stale > 0:
            break  # the region is the whole problem and it was already solved exactly
        sub = restrict(core, free, choice, index)
        model = build_mip(sub)
        sub_choice = choice[free]
        left = deadline - time.perf_counter()
        result = run_mip(
            model, backend, time_limit=max(0.1, min(sub_time_limit, left)),
            warm_start=model.columns_from(sub, sub_choice),
        )  # fmt: skip
        if result.x is not None:
            proposal = choice.copy()
            proposal[free] = model.strategies_from(result.x)
            new_cost, peak = core.evaluate(proposal)
            fits = core.usage_limit is None or peak <= core.usage_limit * (1 + 1e-9)
            if fits and new_cost < cost - 1e-9 * max(1.0, abs(cost)):
                choice, cost = proposal, new_cost
                improvements += 1
                stale = 0
            else:
                stale += 1
        # Adapt the region size to what the solver handles within its slice of time.
        if result.status == "optimal" and result.seconds < 0.3 * sub_time_limit:
            budget = min(int(budget * 1.5), MAX_SUB_COLUMNS)
        elif result.status != "optimal":
            budget = max(500, int(budget * 0.7))
    return LnsResult(choice, cost, rounds, improvements, time.perf_counter() - t0)
