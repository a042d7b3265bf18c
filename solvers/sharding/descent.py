"""Moves on one assignment: memory-aware greedy construction, descent (iterated conditional
modes with a work list), repair of memory overflows (lazy-greedy, then at the peak) and
ejection chains.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

import numpy as np

from .search_state import (
    _INF,
    _SearchState,
)


class _Descent(_SearchState):
    """Moves on one assignment: memory-aware greedy construction, descent (iterated conditional"""

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
