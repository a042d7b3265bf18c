"""Large-neighbourhood moves: exact tree DP over a random induced forest of variables (the
rest fixed at the incumbent), with memory priced by a multiple of the multipliers.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .search_state import (
    _SearchState,
)


class _Forest(_SearchState):
    """Large-neighbourhood moves: exact tree DP over a random induced forest of variables (the"""

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
