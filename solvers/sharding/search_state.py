"""The heuristics' shared state: a core problem's precomputed structure (edge matrices side by
side, the memory model of per-variable blocks over time segments) and one mutable assignment
with its cost and usage profile. The techniques (``descent``, ``priced``, ``forest``) are
mixins over it; ``local_search`` composes them.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .simplify import CoreProblem

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


class _SearchState:
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

    # ------------------------------------------------------------------ compound moves
    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.choice.copy(), self.U.copy()

    def restore(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        self.choice = snap[0].copy()
        self.U = snap[1].copy()

    def profile_of(self, choice: np.ndarray) -> np.ndarray:
        u = self.base.copy()
        for x in self.mem_vars.tolist():
            u[self.span_lo[x] : self.span_hi[x]] += np.repeat(self.dmat[x][choice[x]], self.blen[x])
        return u
