"""Priced rounds: Lagrangian multipliers on time segments price memory into node costs;
sequential tree-reweighted message passing (TRW-S, Kolmogorov 2006) minimises the priced
problem and its messages decode memory-safe assignments.
"""

from __future__ import annotations

import numpy as np

from .search_state import (
    _INF,
    _SearchState,
)


class _Priced(_SearchState):
    """Priced rounds: Lagrangian multipliers on time segments price memory into node costs;"""

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
