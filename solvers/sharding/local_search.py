"""Heuristic search for the simplified sharding problem (ILP warm start and fallback).

The ILP is exact but can time out on large or memory-tight graphs; this module finds good
feasible assignments of a :class:`~.simplify.CoreProblem` within a time limit, so the ILP
gets a warm start and the planner always has an answer. It also finds assignments of least
peak memory, which tell a user how far over budget a model is when nothing fits.

Building blocks (numpy per variable, Python over variables):

* **Memory model**: time is compressed to the segments between interval endpoints and the
  usage profile ``U`` (one float per segment) is kept up to date. A variable's memory terms
  are pre-summed into *blocks* (segment ranges on which its set of live terms is constant),
  giving a (strategies x blocks) matrix ``D``; the usage a move would leave on its blocks is
  ``blockmax(U) - D[cur] + D[s]``, one ``np.maximum.reduceat`` for all strategies at once.
* **Descent** (iterated conditional modes): a variable moves to its cheapest strategy given
  its neighbours (``cost[x] + Σ_e W_e[:, choice[nb]]``, one gather over its edge matrices
  laid side by side) among those that keep its blocks within the limit, so feasibility is
  kept; a work list re-visits neighbours of moved variables.
* **Repair**: while over the limit, lazy-greedy moves that remove excess memory at the
  least cost per unit removed, never raising an over-limit block nor pushing one over;
  if that gets stuck, moves at the peak segment that may trade memory between segments.
* **Priced rounds** (Lagrangian relaxation): multipliers on time segments price memory into
  the node costs, ``Σ_seg λ_seg usage_seg(s)``; sequential tree-reweighted message passing
  (TRW-S, Kolmogorov 2006) minimises the priced problem, whose solution is repaired and
  also decoded memory-safely from the messages; subgradient steps update the multipliers
  (two trajectories, bold and cautious steps, on small graphs). Without memory, TRW-S
  finds the exact optimum of contest instances A, B, P and V (checked against HiGHS), and
  the prices find memory trade-offs that single moves cannot.
* **Large-neighbourhood search**: exact tree DP over a random induced forest (about three
  quarters of the variables, the rest fixed) with memory priced by a random multiple of the
  multipliers, then repair and descent; ejection chains (a move that breaks the limit,
  repaired around); restarts from elite assignments or from random kicks when it stalls.

:func:`local_search` interleaves priced rounds and LNS moves (half the time each) from a
memory-aware greedy start. The loops check the clock, so ``time_limit`` holds to within
one step (about 0.2 s on the largest contest instance, K, with 5167 core variables) plus
the one-off setup (about a second on K).
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .problem import check_choice
from .simplify import CoreProblem

__all__ = [
    "HeuristicResult",
    "exact_peak",
    "greedy_assignment",
    "local_search",
    "min_peak_assignment",
]

_INF = math.inf
#: Share of the time limit spent in priced TRW-S rounds; the rest goes to neighbourhood search.
LAGRANGIAN_SHARE = 0.5
#: Initial relative step of each multiplier trajectory (they take rounds in turn).
THETA0S = (0.5, 0.1)
#: Graphs with at most this many variables count as small (cheap rounds, see _Driver.run).
SMALL_GRAPH = 2000
#: Distinct good assignments from the priced rounds kept as restart points for the LNS.
ELITE_SIZE = 8
#: The LNS restarts after this many moves without gain that also took this share of the time.
LNS_STALL = 25
LNS_STALL_SHARE = 0.01


@dataclass(frozen=True)
class HeuristicResult:
    """A heuristic assignment of a core problem and what it achieves.

    ``cost`` includes the core's ``const_cost`` (it is what ``CoreProblem.evaluate`` returns)
    and is ``inf`` when no assignment without a forbidden pair was found.
    """

    choice: np.ndarray
    cost: float
    peak_usage: float
    feasible: bool
    seconds: float
    iterations: int


class _Search:
    """Precomputed structure of a core problem plus one mutable assignment and its profile."""

    def __init__(
        self, core: CoreProblem, seed: int, deadline: float, *, track_memory: bool | None = None
    ) -> None:
        self.core = core
        # Memory is modelled when there is a limit (or when asked, to minimise the peak).
        self.track_memory = core.usage_limit is not None if track_memory is None else track_memory
        self.rng = np.random.default_rng(seed)
        self.deadline = deadline
        n = core.num_vars
        self.n = n
        self.k = np.array([len(c) for c in core.costs], dtype=np.int64)
        self.costs = [np.asarray(c, dtype=np.float64) for c in core.costs]
        self._build_edges()
        self._build_memory()
        self.unary = self.costs  # what descent minimises: true costs, or priced ones
        self.choice = np.zeros(n, dtype=np.int64)
        self.iterations = 0

    # ------------------------------------------------------------------ structure
    def _build_edges(self) -> None:
        core, n = self.core, self.n
        nb_lists: list[list[int]] = [[] for _ in range(n)]
        mat_lists: list[list[np.ndarray]] = [[] for _ in range(n)]
        for (a, b), mat in zip(core.edges.tolist(), core.edge_costs, strict=True):
            m = np.asarray(mat, dtype=np.float64)
            nb_lists[a].append(b)
            mat_lists[a].append(m)
            nb_lists[b].append(a)
            mat_lists[b].append(m.T)
        self.nbrs: list[np.ndarray] = []
        self.coloff: list[np.ndarray] = []
        self.wide: list[np.ndarray] = []  # (k_x, Σ k_nb): x's edge matrices side by side
        self.has_inf = np.zeros(n, dtype=bool)
        for x in range(n):
            nbs = np.array(nb_lists[x], dtype=np.int64)
            self.nbrs.append(nbs)
            widths = self.k[nbs] if len(nbs) else np.zeros(0, dtype=np.int64)
            off = np.zeros(len(nbs), dtype=np.int64)
            if len(nbs) > 1:
                np.cumsum(widths[:-1], out=off[1:])
            self.coloff.append(off)
            if mat_lists[x]:
                w = np.ascontiguousarray(np.concatenate(mat_lists[x], axis=1))
            else:
                w = np.zeros((self.k[x], 0))
            self.wide.append(w)
            self.has_inf[x] = bool(np.isinf(w).any())
        self.nbr_pos = [{int(y): i for i, y in enumerate(v.tolist())} for v in self.nbrs]
        # Flat copies for fast whole-assignment costing.
        self.node_off = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.k, out=self.node_off[1:])
        self.flat_costs = np.concatenate(self.costs) if n else np.zeros(0)
        m = core.num_edges
        self.ea = core.edges[:, 0].astype(np.int64) if m else np.zeros(0, np.int64)
        self.eb = core.edges[:, 1].astype(np.int64) if m else np.zeros(0, np.int64)
        sizes = np.array([mat.size for mat in core.edge_costs], dtype=np.int64)
        self.edge_off = np.zeros(m + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.edge_off[1:])
        self.flat_edges = (
            np.concatenate([np.asarray(mat, np.float64).ravel() for mat in core.edge_costs])
            if m
            else np.zeros(0)
        )

    def _build_memory(self) -> None:
        """Compressed time grid, constant profile and per-variable block matrices."""
        core, n = self.core, self.n
        self.limit = core.usage_limit
        self.mem = [False] * n  # variable has at least one block where its strategy matters
        self.span_lo = np.zeros(n, dtype=np.int64)
        self.span_hi = np.zeros(n, dtype=np.int64)
        self.bstart: list[np.ndarray] = [np.zeros(0, np.int64)] * n  # block starts - span_lo
        self.blen: list[np.ndarray] = [np.zeros(0, np.int64)] * n
        self.dmat: list[np.ndarray] = [np.zeros((int(kx), 0)) for kx in self.k]
        self.rel: list[np.ndarray] = [np.zeros(0, np.int64)] * n  # blocks whose D varies
        self.drel: list[np.ndarray] = [np.zeros((int(kx), 0)) for kx in self.k]
        ti = np.asarray(core.term_intervals, dtype=np.int64).reshape(-1, 2)
        ci = np.asarray(core.const_intervals, dtype=np.int64).reshape(-1, 2)
        t_live = ti[:, 0] < ti[:, 1]
        c_live = ci[:, 0] < ci[:, 1]
        grid = np.unique(np.concatenate([ti[t_live].ravel(), ci[c_live].ravel()]))
        self.nseg = max(len(grid) - 1, 0)
        base = np.zeros(self.nseg + 1)
        if self.nseg:
            cu = np.asarray(core.const_usages, dtype=np.float64)[c_live]
            np.add.at(base, np.searchsorted(grid, ci[c_live, 0]), cu)
            np.add.at(base, np.searchsorted(grid, ci[c_live, 1]), -cu)
        self.base = np.cumsum(base)[: self.nseg]
        self.U = self.base.copy()
        self.mem_vars = np.zeros(0, dtype=np.int64)
        if self.limit is None:
            self.tlimit = _INF
        else:
            # Integer usages (the contest's) are summed exactly; the slack only absorbs
            # rounding of fractional ones, far below evaluate()'s 1e-9 relative tolerance.
            self.tlimit = float(self.limit) * (1 + 1e-12) + 1e-9
        if not self.track_memory or not self.nseg:
            return
        tv = np.asarray(core.term_var, dtype=np.int64)
        lo = np.searchsorted(grid, ti[:, 0])
        hi = np.searchsorted(grid, ti[:, 1])
        order = np.argsort(tv, kind="stable")
        order = order[t_live[order]]
        bounds = np.searchsorted(tv[order], np.arange(n + 1))
        for x in range(n):
            ids = order[bounds[x] : bounds[x + 1]]
            if not len(ids):
                continue
            tlo, thi = lo[ids], hi[ids]
            pts = np.unique(np.concatenate([tlo, thi]))
            kx = int(self.k[x])
            diff = np.zeros((len(pts), kx))
            use = np.stack([np.asarray(core.term_usages[j], np.float64) for j in ids])
            np.add.at(diff, np.searchsorted(pts, tlo), use)
            np.add.at(diff, np.searchsorted(pts, thi), -use)
            d = np.ascontiguousarray(np.cumsum(diff, axis=0)[:-1].T)  # (k, blocks)
            rel = np.flatnonzero(np.ptp(d, axis=0) > 0)
            if not len(rel):
                # Memory does not depend on x's strategy: its usage is a constant.
                self.base[pts[0] : pts[-1]] += np.repeat(d[0], np.diff(pts))
                continue
            self.mem[x] = True
            self.span_lo[x], self.span_hi[x] = pts[0], pts[-1]
            self.bstart[x] = pts[:-1] - pts[0]
            self.blen[x] = np.diff(pts)
            self.dmat[x] = d
            self.rel[x] = rel
            self.drel[x] = np.ascontiguousarray(d[:, rel])
        self.U = self.base.copy()
        self.mem_vars = np.flatnonzero(np.array(self.mem, dtype=bool))

    # ------------------------------------------------------------------ state
    def reset(self, choice: np.ndarray) -> None:
        """Make ``choice`` the current assignment and rebuild the profile from scratch."""
        self.choice = np.asarray(choice, dtype=np.int64).copy()
        self.U = self.base.copy()
        for x in np.flatnonzero(self.mem):
            lo, hi = self.span_lo[x], self.span_hi[x]
            self.U[lo:hi] += np.repeat(self.dmat[x][self.choice[x]], self.blen[x])

    def set(self, x: int, s: int) -> None:
        """Move variable x to strategy s, updating the profile."""
        old = self.choice[x]
        if old == s:
            return
        if self.mem[x]:
            d = self.dmat[x]
            lo, hi = self.span_lo[x], self.span_hi[x]
            self.U[lo:hi] += np.repeat(d[s] - d[old], self.blen[x])
        self.choice[x] = s

    def local(self, x: int) -> np.ndarray:
        """Cost of each strategy of x given its neighbours' current choices (inf: forbidden)."""
        nbs = self.nbrs[x]
        if not len(nbs):
            return self.unary[x]
        return self.unary[x] + self.wide[x][:, self.coloff[x] + self.choice[nbs]].sum(axis=1)

    def local_conflicts(self, x: int) -> tuple[np.ndarray, np.ndarray]:
        """(forbidden pairs, cost ignoring them) per strategy of x: to climb out of conflicts."""
        nbs = self.nbrs[x]
        if not len(nbs):
            return np.zeros(self.k[x], dtype=np.int64), self.unary[x]
        g = self.wide[x][:, self.coloff[x] + self.choice[nbs]]
        bad = np.isinf(g)
        return bad.sum(axis=1), self.unary[x] + np.where(bad, 0.0, g).sum(axis=1)

    def block_max(self, x: int) -> np.ndarray:
        """Max of the profile over each of x's blocks."""
        lo, hi = self.span_lo[x], self.span_hi[x]
        return np.maximum.reduceat(self.U[lo:hi], self.bstart[x])

    def new_max(self, x: int) -> np.ndarray:
        """Per strategy s, the highest usage on x's blocks if x moved to s (-inf: no memory)."""
        if not self.mem[x]:
            return np.full(self.k[x], -_INF)
        rel = self.rel[x]
        drel = self.drel[x]
        base = self.block_max(x)[rel] - drel[self.choice[x]]
        return (drel + base).max(axis=1)

    def cost_of(self, choice: np.ndarray) -> float:
        """Total cost of an assignment (inf if it uses a forbidden pair)."""
        c = float(self.flat_costs[self.node_off[:-1] + choice].sum()) if self.n else 0.0
        if len(self.ea):
            kb = self.k[self.eb]
            at = self.edge_off[:-1] + choice[self.ea] * kb + choice[self.eb]
            c += float(self.flat_edges[at].sum())
        return c + float(self.core.const_cost)

    def peak(self) -> float:
        return float(self.U.max()) if self.nseg else 0.0

    def feasible_mem(self) -> bool:
        return self.peak() <= self.tlimit

    def time_left(self) -> bool:
        return time.perf_counter() < self.deadline

    # ------------------------------------------------------------------ starts
    def bfs_order(self) -> np.ndarray:
        """Variables in breadth-first order, each component rooted at its busiest variable."""
        seen = np.zeros(self.n, dtype=bool)
        out: list[int] = []
        degree = np.array([len(v) for v in self.nbrs])
        for root in np.argsort(-degree, kind="stable"):
            if seen[root]:
                continue
            seen[root] = True
            queue = deque([int(root)])
            while queue:
                x = queue.popleft()
                out.append(x)
                for y in self.nbrs[x].tolist():
                    if not seen[y]:
                        seen[y] = True
                        queue.append(y)
        return np.array(out, dtype=np.int64)

    def greedy(self, *, memory: bool, init: np.ndarray | None = None) -> np.ndarray:
        """Fix variables in BFS order, each at its cheapest strategy given fixed neighbours.

        Forbidden pairs with fixed neighbours are avoided whenever some strategy allows it.
        With ``memory`` the unfixed variables sit at ``init`` (which should fit the limit),
        and a variable takes its cheapest strategy that keeps the profile within the limit.
        """
        if init is None:
            init = np.zeros(self.n, dtype=np.int64)
        self.reset(init)
        fixed = np.zeros(self.n, dtype=bool)
        for x in self.bfs_order().tolist():
            nbs = self.nbrs[x]
            mask = fixed[nbs]
            loc = self.costs[x]
            if mask.any():
                g = self.wide[x][:, self.coloff[x][mask] + self.choice[nbs[mask]]]
                if self.has_inf[x]:
                    bad = np.isinf(g).sum(axis=1)
                    fin = loc + np.where(np.isinf(g), 0.0, g).sum(axis=1)
                    loc = np.where(bad > bad.min(), _INF, fin)
                else:
                    loc = loc + g.sum(axis=1)
            if memory and self.mem[x]:
                ok = self.new_max(x) <= self.tlimit
                ok[self.choice[x]] = True
                loc = np.where(ok, loc, _INF)
            if np.isfinite(loc).any():
                self.set(x, int(np.argmin(loc)))
            fixed[x] = True
        return self.choice.copy()

    def min_usage_choice(self) -> np.ndarray:
        """Per variable, the strategy with least usage summed over its blocks (time-weighted)."""
        out = np.zeros(self.n, dtype=np.int64)
        for x in np.flatnonzero(self.mem).tolist():
            d = self.dmat[x]
            # Least peak over its own blocks first, then least time-weighted total.
            peak = d.max(axis=1)
            area = d @ self.blen[x].astype(np.float64)
            out[x] = int(np.lexsort((area, peak))[0])
        return out

    # ------------------------------------------------------------------ descent
    def improve_var(self, x: int) -> bool:
        """Move x to its cheapest strategy that keeps memory within the limit, if better.

        Only blocks of x can change, and a move is allowed only if they all stay within the
        limit, so a feasible profile stays feasible.
        """
        self.iterations += 1
        cur = self.choice[x]
        loc = self.local(x)
        cur_cost = loc[cur]
        if not math.isfinite(cur_cost):
            best = self._conflict_move(x)
            if best is None:
                return False
        else:
            better = loc < cur_cost - 1e-12 * abs(cur_cost)
            if not better.any():
                return False
            if self.mem[x]:
                better &= self.new_max(x) <= self.tlimit
                if not better.any():
                    return False
            best = int(np.argmin(np.where(better, loc, _INF)))
        self.set(x, best)
        return True

    def _conflict_move(self, x: int) -> int | None:
        """Best strategy for x when it sits on a forbidden pair: fewer conflicts, then cost."""
        bad, fin = self.local_conflicts(x)
        cur = int(self.choice[x])
        ok = np.ones(self.k[x], dtype=bool)
        if self.mem[x]:
            ok = self.new_max(x) <= self.tlimit
        ok[cur] = True
        key = np.where(ok, bad, np.iinfo(np.int64).max)
        best = int(np.lexsort((fin, key))[0])
        if (bad[best], fin[best]) < (bad[cur], fin[cur]):
            return best
        return None

    def fix_conflicts(self) -> None:
        """Move variables off forbidden pairs (fewest conflicts first, then cost)."""
        changed = True
        while changed and self.time_left():
            changed = False
            for x in np.flatnonzero(self.has_inf).tolist():
                if math.isfinite(self.local(x)[self.choice[x]]):
                    continue
                best = self._conflict_move(x)
                if best is not None:
                    self.set(x, best)
                    changed = True

    def descend(self, queue: list[int] | np.ndarray | None = None, *, sweeps: bool = True) -> int:
        """Coordinate descent from a work list (default: every variable); returns the moves.

        Neighbours of a moved variable are re-queued, which re-establishes local optimality
        with respect to edge costs. A move that lowers memory somewhere can also enable
        moves of variables sharing no edge with it, so with ``sweeps`` every variable is
        queued again after such a move, until a pass frees no memory.
        """
        n = self.n
        inq = np.zeros(n, dtype=bool)
        work: deque[int] = deque()

        def push(order: np.ndarray) -> None:
            for y in order.tolist():
                if not inq[y]:
                    inq[y] = True
                    work.append(y)

        push(self.rng.permutation(n) if queue is None else np.asarray(queue, dtype=np.int64))
        moves = 0
        while True:
            freed = False
            while work:
                if not self.time_left():
                    return moves
                x = work.popleft()
                inq[x] = False
                old = self.choice[x]
                if self.improve_var(x):
                    moves += 1
                    push(self.nbrs[x])
                    if self.mem[x] and not freed:
                        d = self.dmat[x]
                        freed = bool((d[self.choice[x]] < d[old]).any())
            if not (sweeps and freed):
                return moves
            push(self.rng.permutation(n))

    # ------------------------------------------------------------------ memory repair
    def _repair_candidate(self, x: int) -> tuple[float, int, float] | None:
        """x's best repair move as (cost per unit of excess removed, strategy, cost delta).

        Allowed moves never raise a block that is over the limit and never push a block
        over it, so the total excess cannot grow; the gain counts, per over-limit block,
        its over-limit segments times the amount removed (capped at the excess).
        """
        if not self.mem[x]:
            return None
        self.iterations += 1
        lo, hi = self.span_lo[x], self.span_hi[x]
        seg = self.U[lo:hi]
        tlimit = self.tlimit
        rel = self.rel[x]
        bm = np.maximum.reduceat(seg, self.bstart[x])[rel]
        over = bm > tlimit
        if not over.any():
            return None
        cur = int(self.choice[x])
        drel = self.drel[x]
        delta = drel - drel[cur]
        ok = np.where(over, delta <= 0, bm + delta <= tlimit).all(axis=1)
        n_over = np.add.reduceat((seg > tlimit).astype(np.int64), self.bstart[x])[rel]
        removed = np.minimum(np.where(over, bm - tlimit, 0.0), np.maximum(-delta, 0.0))
        gain = removed @ n_over.astype(np.float64)
        ok &= gain > 0
        if not ok.any():
            return None
        loc = self.local(x)
        ok &= np.isfinite(loc)
        if not ok.any():
            return None
        dc = loc - loc[cur] if math.isfinite(loc[cur]) else np.where(np.isfinite(loc), 0.0, _INF)
        score = np.where(ok, dc / np.where(ok, gain, 1.0), _INF)
        s = int(np.argmin(score))
        return float(score[s]), s, float(dc[s])

    def repair(self, frozen: np.ndarray | None = None, budget: float = _INF) -> float | None:
        """Bring the profile within the limit; returns the cost added, or None on failure.

        Lazy greedy: every variable on an over-limit segment offers its best move (least
        cost per unit of excess removed) on a heap; a popped offer is re-evaluated and taken
        only if it still beats the next one. The total excess strictly falls with every
        move, so this terminates. When no such move is left, the peak-driven repair (which
        may trade memory between segments) finishes the job. ``frozen`` variables never
        move; exceeding ``budget`` (cost added) aborts. On failure the state is left as is.
        """
        if not self.nseg or self.peak() <= self.tlimit:
            return 0.0
        total = 0.0
        version = np.zeros(self.n, dtype=np.int64)
        heap: list[tuple[float, int, int]] = []

        def offer(y: int) -> None:
            if frozen is not None and frozen[y]:
                return
            version[y] += 1
            cand = self._repair_candidate(y)
            if cand is not None:
                heapq.heappush(heap, (cand[0], int(version[y]), y))

        def fill() -> None:
            over = self.tlimit < self.U
            prefix = np.concatenate([[0], np.cumsum(over)])
            vars_ = self.mem_vars
            hit = prefix[self.span_hi[vars_]] - prefix[self.span_lo[vars_]] > 0
            for y in vars_[hit].tolist():
                offer(y)

        fill()
        refilled = False
        while self.peak() > self.tlimit:
            if not self.time_left():
                return None
            if not heap:
                if refilled:
                    break
                refilled = True
                fill()
                continue
            _, ver, x = heapq.heappop(heap)
            if ver != version[x]:
                continue
            cand = self._repair_candidate(x)
            if cand is None:
                continue
            score, s, dc = cand
            if heap and score > heap[0][0]:
                version[x] += 1
                heapq.heappush(heap, (score, int(version[x]), x))
                continue
            total += dc
            if total > budget:
                return None
            self.set(x, s)
            refilled = False
            # Only x is re-offered now; other offers went stale (their edge costs or
            # block maxima moved) and are re-evaluated when popped.
            offer(x)
        if self.peak() <= self.tlimit:
            return total
        rest = self.repair_peak(frozen, budget - total)
        return None if rest is None else total + rest

    def repair_peak(
        self, frozen: np.ndarray | None = None, budget: float = _INF, *, ignore_cost: bool = False
    ) -> float | None:
        """Bring the profile within the limit by greedy moves at the peak segment.

        Returns the cost added (each move's local delta is the exact change of the total), or
        None when no allowed move lowers the peak segment or the cost would exceed
        ``budget``; the caller restores the state then. ``frozen`` variables never move.
        With ``ignore_cost`` the move that removes the most excess wins (forbidden pairs
        are still never entered).
        """
        total = 0.0
        tlimit = self.tlimit
        mem_vars = self.mem_vars
        lo_all = self.span_lo[mem_vars]
        hi_all = self.span_hi[mem_vars]
        while True:
            if not self.nseg:
                return total
            t = int(np.argmax(self.U))
            peak = float(self.U[t])
            if peak <= tlimit:
                return total
            if not self.time_left():
                return None
            live = mem_vars[(lo_all <= t) & (t < hi_all)]
            best_score = _INF
            best: tuple[int, int, float] | None = None
            for x in live.tolist():
                if frozen is not None and frozen[x]:
                    continue
                self.iterations += 1
                starts = self.bstart[x]
                b = int(np.searchsorted(starts, t - self.span_lo[x], side="right")) - 1
                d = self.dmat[x]
                cur = int(self.choice[x])
                ok = d[:, b] < d[cur, b]
                if not ok.any():
                    continue
                loc = self.local(x)
                ok &= np.isfinite(loc)
                if not ok.any():
                    continue
                bm = self.block_max(x)[self.rel[x]]
                drel = self.drel[x]
                newv = bm - drel[cur] + drel
                # No block may rise to the peak: the count of segments at the peak (or the
                # peak itself) then strictly falls, so the repair cannot cycle.
                ok &= ((newv <= bm) | (newv < peak)).all(axis=1)
                gain = np.maximum(bm - tlimit, 0.0).sum() - np.maximum(newv - tlimit, 0.0).sum(1)
                ok &= gain > 0
                if not ok.any():
                    continue
                if ignore_cost:
                    score = np.where(ok, -gain, _INF)
                else:
                    dc = loc - loc[cur] if math.isfinite(loc[cur]) else loc
                    score = np.where(ok, dc / np.where(ok, gain, 1.0), _INF)
                s = int(np.argmin(score))
                if score[s] < best_score:
                    best_score = float(score[s])
                    delta = float(loc[s] - loc[cur]) if math.isfinite(loc[cur]) else 0.0
                    best = (x, s, delta)
            if best is None:
                return None
            x, s, delta = best
            total += delta
            if total > budget:
                return None
            self.set(x, s)

    # ------------------------------------------------------------------ forest DP
    def random_region(self, size: int) -> np.ndarray:
        """Variables of a breadth-first ball of about ``size`` around a random variable."""
        root = int(self.rng.integers(self.n))
        seen = {root}
        queue = deque([root])
        out = []
        while queue and len(out) < size:
            x = queue.popleft()
            out.append(x)
            nbs = self.nbrs[x]
            for y in nbs[self.rng.permutation(len(nbs))].tolist():
                if y not in seen:
                    seen.add(y)
                    queue.append(y)
        return np.array(out, dtype=np.int64)

    def random_forest(self) -> np.ndarray:
        """A maximal induced forest in random order: ``inS`` mask.

        A variable joins when its neighbours already in the forest lie in distinct trees
        (union-find), so the induced subgraph stays acyclic and a tree DP over it is exact.
        """
        n = self.n
        parent = np.arange(n)

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        ins = np.zeros(n, dtype=bool)
        for x in self.rng.permutation(n).tolist():
            roots = [find(y) for y in self.nbrs[x].tolist() if ins[y]]
            if len(roots) != len(set(roots)):
                continue
            ins[x] = True
            for r in roots:
                parent[r] = x
        return ins

    def forest_dp(self, ins: np.ndarray, extra: list[np.ndarray] | None = None) -> np.ndarray:
        """Exact best choice of the forest variables with all others fixed.

        ``extra[x]`` (optional) is added to x's unary cost (memory prices). Returns the new
        assignment (not applied).
        """
        choice = self.choice
        new = choice.copy()
        visited = np.zeros(self.n, dtype=bool)
        for root in np.flatnonzero(ins).tolist():
            if visited[root]:
                continue
            # Iterative DFS: order lists parents before children.
            order: list[int] = []
            par: dict[int, int] = {root: -1}
            stack = [root]
            visited[root] = True
            while stack:
                x = stack.pop()
                order.append(x)
                for y in self.nbrs[x].tolist():
                    if ins[y] and not visited[y]:
                        visited[y] = True
                        par[y] = x
                        stack.append(y)
            belief: dict[int, np.ndarray] = {}
            back: dict[int, np.ndarray] = {}
            if not self.time_left():
                return choice.copy()  # out of time: propose no change
            for x in order:
                nbs = self.nbrs[x]
                out = ~ins[nbs]
                u = self.costs[x]
                if out.any():
                    u = u + self.wide[x][:, self.coloff[x][out] + choice[nbs[out]]].sum(axis=1)
                if extra is not None:
                    u = u + extra[x]
                belief[x] = u
            for x in reversed(order):
                p = par[x]
                if p < 0:
                    continue
                if not self.time_left():
                    return choice.copy()
                pos = self.nbr_pos[p][x]
                off = self.coloff[p][pos]
                mat = self.wide[p][:, off : off + self.k[x]] + belief[x][None, :]
                arg = np.argmin(mat, axis=1)
                back[x] = arg
                belief[p] = belief[p] + mat[np.arange(mat.shape[0]), arg]
            new[root] = int(np.argmin(belief[root]))
            for x in order:
                p = par[x]
                if p >= 0:
                    new[x] = back[x][new[p]]
        return new

    # ------------------------------------------------------------------ TRW-S
    def trws_setup(self) -> None:
        """Static data for sequential tree-reweighted message passing (Kolmogorov 2006)."""
        n = self.n
        order = self.bfs_order()
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.arange(n)
        self.t_order = order
        finite_max = [float(np.max(w[np.isfinite(w)], initial=0.0)) for w in self.wide]
        # Forbidden pairs become a finite BIG so that message arithmetic never meets inf-inf.
        big = 10.0 * (sum(finite_max) + sum(float(c.max(initial=0.0)) for c in self.costs) + 1.0)
        self.t_wide = [
            np.where(np.isinf(w), big, w) if self.has_inf[x] else w for x, w in enumerate(self.wide)
        ]
        self.t_in = [np.zeros((len(self.nbrs[x]), self.k[x])) for x in range(n)]
        self.t_rev = [
            np.array([self.nbr_pos[y][x] for y in self.nbrs[x].tolist()], dtype=np.int64)
            for x in range(n)
        ]
        self.t_gamma = np.ones(n)
        self.t_up: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.t_down: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for x in range(n):
            nbs = self.nbrs[x]
            higher = rank[nbs] > rank[x]
            self.t_gamma[x] = max(int(higher.sum()), int((~higher).sum()), 1)
            for mask, store in ((higher, self.t_up), (~higher, self.t_down)):
                idx = np.flatnonzero(mask)
                widths = self.k[nbs[idx]]
                cols = (
                    np.concatenate(
                        [
                            np.arange(o, o + w)
                            for o, w in zip(
                                self.coloff[x][idx].tolist(), widths.tolist(), strict=True
                            )
                        ]
                    )
                    if len(idx)
                    else np.zeros(0, dtype=np.int64)
                )
                owner = np.repeat(np.arange(len(idx)), widths)  # column -> position in idx
                starts = np.zeros(len(idx), dtype=np.int64)
                if len(idx) > 1:
                    np.cumsum(widths[:-1], out=starts[1:])
                store.append((idx, cols, owner, starts))

    def trws_pass(self, forward: bool, unary: list[np.ndarray]) -> np.ndarray:
        """One sweep of TRW-S messages; returns the labeling decoded along the sweep."""
        order = self.t_order if forward else self.t_order[::-1]
        plan = self.t_up if forward else self.t_down
        label = np.full(self.n, -1, dtype=np.int64)
        t_in, t_wide, t_rev = self.t_in, self.t_wide, self.t_rev
        for x in order.tolist():
            if not self.time_left():
                # Out of time: undecoded variables keep their current strategy.
                return np.where(label >= 0, label, self.choice)
            inc = t_in[x]
            theta = unary[x] + inc.sum(axis=0) if len(inc) else unary[x]
            idx, cols, owner, starts = plan[x]
            # Decode: assigned (earlier) neighbours exactly, later ones through messages.
            nbs = self.nbrs[x]
            prev = label[nbs] >= 0
            dec = unary[x]
            if prev.any():
                dec = dec + t_wide[x][:, self.coloff[x][prev] + label[nbs[prev]]].sum(axis=1)
            if (~prev).any():
                dec = dec + inc[~prev].sum(axis=0)
            label[x] = int(np.argmin(dec))
            if not len(idx):
                continue
            vec = theta / self.t_gamma[x]
            mat = t_wide[x][:, cols] + (vec[None, :] - inc[idx][owner]).T
            out = mat.min(axis=0)
            out -= np.repeat(np.minimum.reduceat(out, starts), self.k[nbs[idx]])
            rev = t_rev[x]
            for j, i in enumerate(idx.tolist()):
                y = int(nbs[i])
                t_in[y][rev[i]] = out[starts[j] : starts[j] + self.k[y]]
        return label

    # ------------------------------------------------------------------ memory prices
    def price_setup(self) -> None:
        """Absolute block bounds of each memory variable, for pricing segments."""
        self.p_starts = [np.zeros(0, np.int64)] * self.n
        self.p_ends = [np.zeros(0, np.int64)] * self.n
        for x in self.mem_vars.tolist():
            s = self.span_lo[x] + self.bstart[x]
            self.p_starts[x] = s
            self.p_ends[x] = s + self.blen[x]

    def prices(self, lam: np.ndarray) -> list[np.ndarray]:
        """Per variable, the priced usage ``Σ_seg lam[seg] * usage_seg(s)`` of each strategy."""
        cum = np.concatenate([[0.0], np.cumsum(lam)])
        out = [np.zeros(int(kx)) for kx in self.k]
        for x in self.mem_vars.tolist():
            out[x] = self.dmat[x] @ (cum[self.p_ends[x]] - cum[self.p_starts[x]])
        return out

    def profile_of(self, choice: np.ndarray) -> np.ndarray:
        u = self.base.copy()
        for x in self.mem_vars.tolist():
            u[self.span_lo[x] : self.span_hi[x]] += np.repeat(self.dmat[x][choice[x]], self.blen[x])
        return u

    def decode_mem(self, unary: list[np.ndarray], order: np.ndarray, init: np.ndarray) -> None:
        """Sequential decoding from TRW-S messages that never breaks the memory limit.

        Unassigned variables sit at ``init`` (which must fit); each variable in ``order``
        takes the strategy minimising its unary plus exact edge costs to assigned neighbours
        plus incoming messages from unassigned ones, among strategies that keep memory within
        the limit. The result is the current assignment.
        """
        self.reset(init)
        done = np.zeros(self.n, dtype=bool)
        for x in order.tolist():
            if not self.time_left():
                return
            nbs = self.nbrs[x]
            prev = done[nbs]
            dec = unary[x]
            if prev.any():
                dec = dec + self.t_wide[x][:, self.coloff[x][prev] + self.choice[nbs[prev]]].sum(1)
            if (~prev).any():
                dec = dec + self.t_in[x][~prev].sum(axis=0)
            if self.mem[x]:
                ok = self.new_max(x) <= self.tlimit
                ok[self.choice[x]] = True
                dec = np.where(ok, dec, _INF)
            self.set(x, int(np.argmin(dec)))
            done[x] = True

    # ------------------------------------------------------------------ compound moves
    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.choice.copy(), self.U.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        self.choice = snap[0].copy()
        self.U = snap[1].copy()

    def eject(self, x: int) -> bool:
        """Take x's cheapest strategy even if memory breaks, then repair around it.

        Kept only when the repaired assignment is cheaper; otherwise the state is restored.
        """
        loc = self.local(x)
        cur = int(self.choice[x])
        cur_cost = float(loc[cur])
        if not math.isfinite(cur_cost) or not self.mem[x]:
            return False
        better = loc < cur_cost - 1e-12 * abs(cur_cost)
        better &= self.new_max(x) > self.tlimit  # feasible improvements are descent's job
        if not better.any():
            return False
        s = int(np.argmin(np.where(better, loc, _INF)))
        gain = cur_cost - float(loc[s])
        snap = self.snapshot()
        self.set(x, s)
        frozen = np.zeros(self.n, dtype=bool)
        frozen[x] = True
        added = self.repair(frozen, budget=gain - 1e-9 * abs(cur_cost))
        if added is None or added >= gain:
            self.restore(snap)
            return False
        moved = np.flatnonzero(self.choice != snap[0])
        queue = np.unique(np.concatenate([moved] + [self.nbrs[y] for y in moved.tolist()]))
        self.descend(queue, sweeps=False)
        return True

    def relaxed_descend(self, unary: list[np.ndarray], start: np.ndarray) -> None:
        """Coordinate descent on ``unary`` (priced costs) with memory ignored, from ``start``."""
        saved = self.tlimit, self.unary
        self.tlimit, self.unary = _INF, unary
        try:
            self.reset(start)
            self.descend()
        finally:
            self.tlimit, self.unary = saved


class _Driver:
    """Runs the phases of :func:`local_search` and keeps the best feasible assignment."""

    def __init__(self, search: _Search) -> None:
        self.s = search
        self.best_cost = _INF
        self.best_choice: np.ndarray | None = None
        self.best_lam: np.ndarray | None = None
        self.lam = np.zeros(search.nseg)
        self.owner = ""  # which phase last set the search state
        self.init = np.zeros(search.n, dtype=np.int64)
        self.lam_mean: np.ndarray | None = None
        self.elite: list[tuple[float, np.ndarray, np.ndarray]] = []
        self.phase = "start"
        self.stall = int(LNS_STALL)
        self.stall_share = LNS_STALL_SHARE

    def consider(self) -> bool:
        """Record the current assignment if it is feasible and the cheapest so far."""
        s = self.s
        if not s.feasible_mem():
            return False
        cost = s.cost_of(s.choice)
        if self.phase == "lagrangian" and math.isfinite(cost):
            self._offer_elite(cost)
        if cost < self.best_cost - 1e-9 * abs(self.best_cost) or (
            self.best_choice is None and math.isfinite(cost)
        ):
            self.best_cost = cost
            self.best_choice = s.choice.copy()
            self.best_lam = self.lam.copy()
            return True
        return False

    def _offer_elite(self, cost: float) -> None:
        """Keep the cheapest distinct assignments seen, as restart points for the LNS."""
        if any(abs(cost - c) <= 1e-12 * abs(c) for c, _, _ in self.elite):
            return
        if len(self.elite) >= ELITE_SIZE and cost >= self.elite[-1][0]:
            return
        self.elite.append((cost, self.s.choice.copy(), self.lam.copy()))
        self.elite.sort(key=lambda item: item[0])
        del self.elite[ELITE_SIZE:]

    # ------------------------------------------------------------------ phases
    def start(self, initial: np.ndarray | None) -> None:
        """Feasible starting points: the caller's assignment, then a memory-aware greedy."""
        s = self.s
        self.init = s.min_usage_choice()
        if initial is not None:
            s.reset(np.asarray(initial, dtype=np.int64))
            if s.repair() is not None:
                s.descend()
                self.consider()
        s.greedy(memory=True, init=self.init)
        if s.repair() is not None:
            s.descend()
            self.consider()

    def _lagrangian_rounds(self, theta0: float) -> Iterator[None]:
        """Price memory per time segment and let TRW-S solve the priced problem (one round
        per step).

        Subgradient ascent on the multipliers (step ``theta * |UB - q| / |g|^2``, ``theta``
        starting at ``theta0``, shrinking when successive subgradients disagree, growing
        while they agree). Each round turns the priced solution into feasible candidates
        twice: by repair and by memory-safe decoding of the messages, each followed by
        descent on true costs. The multipliers and TRW-S messages are this generator's own,
        so several trajectories can run side by side.
        """
        s = self.s
        limit = float(s.limit) if s.limit is not None else _INF
        theta, gprev, rounds = theta0, None, 0
        # The step uses the best cost these rounds found themselves (not the LNS's), so the
        # multipliers follow the same path however the time is shared.
        upper = self.best_cost
        lam = np.zeros(s.nseg)
        lam_mean = np.zeros(s.nseg)
        messages = [np.zeros_like(m) for m in s.t_in]
        small = s.n <= SMALL_GRAPH
        while True:
            s.t_in = messages
            self.lam, self.lam_mean = lam, lam_mean  # what consider() and the LNS see
            unary = [c + p for c, p in zip(s.costs, s.prices(lam), strict=True)]
            labels = [s.trws_pass(True, unary), s.trws_pass(False, unary)]
            if not s.time_left():
                yield
                continue
            # Pick the better decoding by priced energy (skipped on big graphs: the
            # backward pass used the freshest messages and the profiles cost time).
            pick = int(np.argmin([self._priced(lab) for lab in labels])) if small else 1
            s.relaxed_descend(unary, labels[pick])
            profile = s.U.copy()
            q = s.cost_of(s.choice) + float(lam @ (profile - limit))
            if s.repair() is not None:
                s.descend()
                self.consider()
                upper = min(upper, s.cost_of(s.choice) if s.feasible_mem() else _INF)
            if s.time_left():
                s.decode_mem(unary, s.t_order, self.init)
                s.descend()
                self.consider()
                upper = min(upper, s.cost_of(s.choice) if s.feasible_mem() else _INF)
            g = profile - limit
            g = np.where((lam > 0) | (g > 0), g, 0.0)
            gg = float(g @ g)
            if gg > 0.0 and math.isfinite(q):
                if gprev is not None:
                    theta *= 0.7 if float(g @ gprev) < 0 else 1.1
                    theta = min(max(theta, 0.03), 1.0)
                gprev = g
                # Until something fits, aim the step at twice the priced value instead.
                gap = abs(upper - q) if math.isfinite(upper) else abs(q) + 1.0
                lam = np.maximum(lam + theta * gap / gg * g, 0.0)
                rounds += 1
                lam_mean += (lam - lam_mean) / rounds
            yield

    def _priced(self, label: np.ndarray) -> float:
        s = self.s
        cost = s.cost_of(label)
        if s.limit is None or not math.isfinite(cost):
            return cost
        return cost + float(self.lam @ (s.profile_of(label) - float(s.limit)))

    def _lns_steps(self) -> Iterator[None]:
        """Large-neighbourhood search, one move per step, with restarts when it stalls.

        Moves: exact DP over a random induced forest with memory priced by a random
        multiple of one of the multiplier vectors (those that found the start, the last
        ones, their running mean), then repair and local descent; and ejection chains on
        random variables. A move is kept if it is no worse. The search jumps to any new
        best the priced rounds find. After ``stall`` moves and a share of the time without
        gain it restarts: from an unused elite assignment of the priced rounds, or from the
        best with a region set to random strategies (iterated local search); the best is
        kept apart.
        """
        s = self.s
        assert self.best_choice is not None
        cur, choice, lam_start = self.best_cost, self.best_choice.copy(), self.best_lam
        seen_best = self.best_cost
        used: list[np.ndarray] = [choice]
        span = max(s.deadline - time.perf_counter(), 1e-9)
        since, t_gain = 0, time.perf_counter()
        while True:
            if self.best_cost < seen_best * (1 - 1e-12):
                seen_best = self.best_cost
                if self.best_cost < cur * (1 - 1e-12):
                    cur, choice, lam_start = self.best_cost, self.best_choice.copy(), self.best_lam
                    since, t_gain = 0, time.perf_counter()
                    self.owner = ""
            elif since >= self.stall and time.perf_counter() - t_gain > self.stall_share * span:
                fresh = [e for e in self.elite if not any(np.array_equal(e[1], u) for u in used)]
                if fresh and s.rng.random() < 0.5:
                    cur, choice, lam_start = fresh[0][0], fresh[0][1].copy(), fresh[0][2]
                    used.append(choice)
                    self.owner = ""
                else:
                    cur, choice, lam_start = self._kick(), s.choice.copy(), self.best_lam
                    self.owner = "lns"
                since, t_gain = 0, time.perf_counter()
            if self.owner != "lns":
                s.reset(choice)
                self.owner = "lns"
            lams = [v for v in (lam_start, self.lam, self.lam_mean) if v is not None and v.any()]
            cost = self._lns_move(lams, cur)
            if cost is not None:
                if cost < cur * (1 - 1e-12):
                    since, t_gain = 0, time.perf_counter()
                cur, choice = cost, s.choice.copy()
                self.consider()
            else:
                since += 1
            yield

    def _kick(self) -> float:
        """Set a random region of the best assignment to random strategies, repair, descend.

        Returns the cost of the resulting (feasible) state; if the repair fails, the state
        is the best assignment itself.
        """
        s = self.s
        assert self.best_choice is not None
        s.reset(self.best_choice)
        region = s.random_region(int(s.rng.integers(4, 32)))
        for x in region.tolist():
            s.set(x, int(s.rng.integers(s.k[x])))
        if s.repair() is not None:
            queue = np.unique(np.concatenate([region] + [s.nbrs[y] for y in region.tolist()]))
            s.descend(queue, sweeps=False)
            cost = s.cost_of(s.choice)
            if math.isfinite(cost) and s.feasible_mem():
                self.consider()
                return cost
        s.reset(self.best_choice)
        return self.best_cost

    def run(self) -> None:
        """Alternate priced rounds and LNS moves, each getting its share of the time.

        Interleaving (rather than phases) lets small graphs run many priced rounds, which
        find the memory trade-offs, while big graphs, where a round takes seconds, still
        get neighbourhood moves early; both feed one best assignment.
        """
        s = self.s
        # Two multiplier trajectories on small graphs, taking rounds in turn: bold steps find
        # the memory trade-offs of small graphs within a second, cautious ones give better
        # prices (and elites) for the LNS where the relaxation is weaker. On big graphs a
        # round takes seconds, and the cautious one alone does best.
        theta0s = THETA0S if s.n <= SMALL_GRAPH else THETA0S[-1:]
        lags = [self._lagrangian_rounds(theta0) for theta0 in theta0s]
        lns = None
        spent_lag = spent_lns = 0.0
        turn = 0
        while s.time_left():
            use_lag = self.best_choice is None or spent_lag <= LAGRANGIAN_SHARE * (
                spent_lag + spent_lns
            )
            t = time.perf_counter()
            if use_lag:
                self.phase, self.owner = "lagrangian", "lagrangian"
                next(lags[turn % len(lags)])
                turn += 1
                spent_lag += time.perf_counter() - t
            else:
                self.phase = "lns"
                if lns is None:
                    lns = self._lns_steps()
                next(lns)
                spent_lns += time.perf_counter() - t

    def _lns_move(self, lams: list[np.ndarray], cur: float) -> float | None:
        """One LNS move; its cost if feasible and no worse than ``cur``, else None (undone)."""
        s = self.s
        snap = s.snapshot()
        if s.rng.random() < 0.7:
            extra = None
            if lams:
                mu = float(np.exp(s.rng.uniform(np.log(0.1), np.log(10.0))))
                extra = s.prices(lams[int(s.rng.integers(len(lams)))] * mu)
            s.reset(s.forest_dp(s.random_forest(), extra=extra))
            if s.repair() is None:
                s.restore(snap)
                return None
            changed = np.flatnonzero(s.choice != snap[0])
            if len(changed):
                queue = np.unique(np.concatenate([changed] + [s.nbrs[y] for y in changed]))
                s.descend(queue, sweeps=False)
        else:
            for x in s.rng.choice(s.n, size=min(s.n, 16), replace=False).tolist():
                if not s.time_left():
                    break
                s.eject(x)
        cost = s.cost_of(s.choice)
        if s.feasible_mem() and cost <= cur:
            return cost
        s.restore(snap)
        return None


# --------------------------------------------------------------------------- public API
def greedy_assignment(core: CoreProblem, *, seed: int = 0) -> np.ndarray:
    """The cost-greedy start (memory ignored): BFS order, cheapest given fixed neighbours.

    Forbidden pairs with already fixed neighbours are avoided whenever some strategy can.
    """
    s = _Search(core, seed, _INF, track_memory=False)
    return s.greedy(memory=False)


def exact_peak(core: CoreProblem, choice: np.ndarray) -> float:
    """Peak usage of a core assignment by an event sweep (independent of the search state)."""
    tv = np.asarray(core.term_var, dtype=np.int64)
    sizes = np.array([len(u) for u in core.term_usages], dtype=np.int64)
    off = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=off[1:])
    flat = np.concatenate(core.term_usages) if len(sizes) else np.zeros(0)
    use = flat[off[:-1] + np.asarray(choice, dtype=np.int64)[tv]] if len(tv) else np.zeros(0)
    iv = np.concatenate(
        [np.reshape(core.term_intervals, (-1, 2)), np.reshape(core.const_intervals, (-1, 2))]
    )
    val = np.concatenate([use, np.asarray(core.const_usages, dtype=np.float64)])
    live = iv[:, 0] < iv[:, 1]
    if not live.any():
        return 0.0
    times = np.concatenate([iv[live, 0], iv[live, 1]])
    deltas = np.concatenate([val[live], -val[live]])
    order = np.argsort(times, kind="stable")
    _, first = np.unique(times[order], return_index=True)
    # Usage from a distinct time to the next is the sum of all deltas at times up to it.
    return float(np.cumsum(np.add.reduceat(deltas[order], first)).max())


def _result(s: _Search, choice: np.ndarray, t0: float) -> HeuristicResult:
    """Evaluate ``choice`` from scratch (no incremental drift) and package it."""
    choice = np.asarray(choice, dtype=np.int64).copy()
    cost = s.cost_of(choice)
    peak = exact_peak(s.core, choice)
    limit = s.core.usage_limit
    feasible = math.isfinite(cost) and (limit is None or peak <= s.tlimit)
    if not feasible:
        cost = _INF
    return HeuristicResult(
        choice=choice,
        cost=cost,
        peak_usage=peak,
        feasible=feasible,
        seconds=time.perf_counter() - t0,
        iterations=s.iterations,
    )


def local_search(
    core: CoreProblem,
    *,
    time_limit: float = 10.0,
    seed: int = 0,
    initial: np.ndarray | None = None,
) -> HeuristicResult:
    """Find a cheap assignment of ``core`` within its memory limit, in ``time_limit`` seconds.

    ``initial`` (one strategy per core variable, e.g. a previous plan) is repaired and used
    as an extra start. The result is the best feasible assignment found; if none was found,
    ``feasible`` is False, ``cost`` is inf and ``choice`` is the least-peak assignment found
    (so a caller can still report how far over the limit the problem is).

    The search has no optimality proof, so it uses the whole ``time_limit`` (it returns
    early only when even the least usage of every term breaks the limit). Results depend
    on ``seed`` and, through the clock, slightly on machine speed.
    """
    t0 = time.perf_counter()
    deadline = t0 + max(float(time_limit), 0.0)
    s = _Search(core, seed, deadline)
    if initial is not None:
        initial = check_choice("initial", initial, s.k, owner="core variable")
    if s.n == 0:
        return _result(s, np.zeros(0, dtype=np.int64), t0)
    if s.nseg and float(s.base.max()) > s.tlimit:
        # Even the least usage of every term is over the limit somewhere: nothing fits.
        s.deadline = min(deadline, time.perf_counter() + 1.0)
        return _result(s, _min_peak(s), t0)
    d = _Driver(s)
    d.start(initial)
    s.trws_setup()
    if s.limit is not None and s.nseg:
        s.price_setup()
    d.run()
    if d.best_choice is None:
        # Nothing fits: report the least-peak assignment (with a short extra search).
        s.deadline = time.perf_counter() + min(1.0, max(float(time_limit), 0.0) * 0.1)
        return _result(s, _min_peak(s), t0)
    return _result(s, d.best_choice, t0)


def _min_peak(s: _Search, max_stale: int = 8) -> np.ndarray:
    """Least-peak assignment found by peak descent from greedy starts and random restarts.

    Descent moves a variable live at the peak segment to a strategy that lowers it, never
    raising any other segment to the peak, and never enters a forbidden pair (once out of
    them); cost is ignored. The peak of the starting point never increases. Restarts
    perturb the best assignment until the time is up, ``max_stale`` restarts bring no gain,
    or the peak meets its lower bound (every term at its least usage).
    """
    saved = s.tlimit
    bound = float(s.base.max()) if s.nseg else 0.0
    best: np.ndarray | None = None
    best_key = (True, _INF)  # (uses a forbidden pair, peak): conflict-free wins first

    def run(start: np.ndarray) -> None:
        nonlocal best, best_key
        s.reset(start)
        s.tlimit = _INF
        s.fix_conflicts()
        s.tlimit = 0.0  # every segment counts as "over": push the peak down as far as it goes
        s.repair_peak(ignore_cost=True)
        key = (not math.isfinite(s.cost_of(s.choice)), s.peak())
        if (
            best is None
            or key[0] < best_key[0]
            or (key[0] == best_key[0] and key[1] < best_key[1] * (1 - 1e-12))
        ):
            best, best_key = s.choice.copy(), key

    def at_bound() -> bool:
        return not best_key[0] and best_key[1] <= bound * (1 + 1e-12) + 1e-9

    run(s.min_usage_choice())
    greedy = s.greedy(memory=False)
    s.reset(greedy)
    if (not math.isfinite(s.cost_of(greedy)), s.peak()) < best_key:
        # The promise is a peak no higher than the cost-greedy start's; descend from it too.
        run(greedy)
    stale = 0
    while s.time_left() and stale < max_stale and not at_bound():
        assert best is not None
        start = best.copy()
        kick = s.rng.choice(s.n, size=max(1, min(s.n // 10, 50)), replace=False)
        start[kick] = s.rng.integers(0, s.k[kick])
        before = best_key
        run(start)
        stale = stale + 1 if best_key >= before else 0
    assert best is not None
    # One cheap descent pass on cost, never raising the peak that was reached.
    s.reset(best)
    s.tlimit = max(best_key[1], 0.0) * (1 + 1e-12) + 1e-9
    if not best_key[0]:
        s.descend(sweeps=False)
    s.tlimit = saved
    return s.choice.copy()


def min_peak_assignment(
    core: CoreProblem, *, time_limit: float = 10.0, seed: int = 0
) -> HeuristicResult:
    """Heuristically minimise the peak memory, ignoring cost except forbidden pairs.

    Used to tell a user how far over the limit the best assignment we can find is when no
    assignment fits. The peak never exceeds that of :func:`greedy_assignment` when the
    latter avoids forbidden pairs. ``cost`` is the assignment's true cost when it fits the
    limit and has no forbidden pair, else inf; among assignments of equal peak the descent
    also lowers cost.
    """
    t0 = time.perf_counter()
    s = _Search(core, seed, t0 + max(float(time_limit), 0.0), track_memory=True)
    if s.n == 0:
        return _result(s, np.zeros(0, dtype=np.int64), t0)
    return _result(s, _min_peak(s), t0)
