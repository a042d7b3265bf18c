"""Exact graph simplification of a sharding problem before the ILP sees it.

Real sharding graphs are mostly bookkeeping: element-wise ops whose layout follows an
operand, strategies that are never better than a sibling, chains of single-use tensors. Each
rule below preserves the optimum exactly (for every assignment of the reduced problem there
is an assignment of the original with the same cost and memory, and the best one survives),
and every elimination is logged so a reduced solution maps back to every original node.

Rules, applied from a worklist until nothing changes:

* forbidden pruning: a strategy whose node cost is forbidden, or whose every pairing on some
  edge is forbidden, is removed (arc consistency);
* single strategy: a node left with one strategy is fixed; its edge rows fold into the
  neighbours' node costs;
* follower merge: when on edge (x, y) each strategy of x allows exactly one strategy of y,
  y is a function of x and merges into x (its costs, edges and memory terms move over);
  alias pairs are handled this way, as an edge that allows only the diagonal;
* separable edges: a matrix a_i + b_j is folded into the two node costs;
* dominance: strategy i is dropped when some j is no worse in node cost, in every memory
  term and in every row of every incident edge;
* leaf and chain elimination: a node whose memory never matters (constant usage, or only
  live where the limit cannot bind) and has one or two neighbours is minimised out
  (dynamic programming over its strategies), adding its best response to the neighbours.

The memory constraint is carried as *terms*: (interval, owning variable, usage per strategy
of that variable). Initially each node owns its own term; merged nodes hand theirs over.
"""

from __future__ import annotations

import functools
import operator
import time
from collections import deque
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import InfeasibleError
from .problem import FORBIDDEN_COST, ShardingProblem, interval_peak

__all__ = ["CoreProblem", "Reduction", "simplify"]

INF = np.inf
#: Chain elimination builds a k_u x k_w x k_v tensor; skip it beyond this many entries.
MAX_CHAIN_TENSOR = 4_000_000


@dataclass(frozen=True, eq=False)
class CoreProblem:
    """What is left for the ILP: variables, edges and memory terms over current strategies.

    ``costs[x]`` has one entry per remaining strategy of variable x (``inf`` never occurs in
    node costs after simplification; edge matrices may hold ``inf`` for forbidden pairs).
    Memory at time t is ``const_usage_at(t) + Σ_terms live at t usage[choice]``.
    """

    costs: tuple[np.ndarray, ...]
    edges: np.ndarray
    edge_costs: tuple[np.ndarray, ...]
    term_var: np.ndarray
    term_intervals: np.ndarray
    term_usages: tuple[np.ndarray, ...]
    const_intervals: np.ndarray
    const_usages: np.ndarray
    usage_limit: float | None
    const_cost: float

    @property
    def num_vars(self) -> int:
        return len(self.costs)

    @property
    def num_edges(self) -> int:
        return len(self.edges)

    @cached_property
    def _flat(self) -> dict[str, np.ndarray]:
        """Flat copies of the ragged arrays, so evaluation is a few gathers."""

        def flatten(parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
            sizes = np.array([p.size for p in parts], dtype=np.int64)
            offsets = np.zeros(len(parts) + 1, dtype=np.int64)
            np.cumsum(sizes, out=offsets[1:])
            flat = np.concatenate([p.reshape(-1) for p in parts]) if parts else np.zeros(0)
            return flat.astype(np.float64), offsets

        cost, cost_off = flatten(self.costs)
        edge, edge_off = flatten(self.edge_costs)
        use, use_off = flatten(self.term_usages)
        kb = np.array([m.shape[1] for m in self.edge_costs], dtype=np.int64)
        return {
            "cost": cost, "cost_off": cost_off, "edge": edge, "edge_off": edge_off,
            "edge_kb": kb, "use": use, "use_off": use_off,
        }  # fmt: skip

    def term_usage_of(self, choice: np.ndarray) -> np.ndarray:
        """Usage of every memory term under a core assignment."""
        f = self._flat
        return f["use"][f["use_off"][:-1] + choice[self.term_var]]

    def evaluate(self, choice: np.ndarray) -> tuple[float, float]:
        """(cost, peak usage) of a core assignment; cost is inf if a forbidden pair is used."""
        choice = np.asarray(choice, dtype=np.int64)
        f = self._flat
        cost = self.const_cost + float(f["cost"][f["cost_off"][:-1] + choice].sum())
        if len(self.edges):
            a, b = self.edges[:, 0], self.edges[:, 1]
            cost += float(
                f["edge"][f["edge_off"][:-1] + choice[a] * f["edge_kb"] + choice[b]].sum()
            )
        starts = np.concatenate([self.term_intervals[:, 0], self.const_intervals[:, 0]])
        ends = np.concatenate([self.term_intervals[:, 1], self.const_intervals[:, 1]])
        values = np.concatenate([self.term_usage_of(choice), self.const_usages])
        return cost, interval_peak(starts, ends, values)[0]


@dataclass
class ReductionStats:
    """Sizes before and after, and how many times each rule fired."""

    nodes_before: int = 0
    edges_before: int = 0
    strategies_before: int = 0
    nodes_after: int = 0
    edges_after: int = 0
    strategies_after: int = 0
    edge_entries_after: int = 0
    rule_counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def bump(self, rule: str, n: int = 1) -> None:
        self.rule_counts[rule] = self.rule_counts.get(rule, 0) + n

    def as_dict(self) -> dict[str, Any]:
        return {
            "nodes": (self.nodes_before, self.nodes_after),
            "edges": (self.edges_before, self.edges_after),
            "strategies": (self.strategies_before, self.strategies_after),
            "edge_entries_after": self.edge_entries_after,
            "rules": dict(self.rule_counts),
            "seconds": round(self.seconds, 3),
        }


@dataclass(frozen=True, eq=False)
class Reduction:
    """A simplified problem plus what is needed to map its solutions back."""

    core: CoreProblem
    var_nodes: np.ndarray  # original node id of each core variable
    var_alive: tuple[np.ndarray, ...]  # original strategy index of each core strategy
    log: tuple[tuple[Any, ...], ...]
    num_nodes: int
    stats: ReductionStats

    def expand(self, core_choice: np.ndarray) -> np.ndarray:
        """Original strategy per original node, from one strategy index per core variable."""
        choice = np.full(self.num_nodes, -1, dtype=np.int64)
        for x, node in enumerate(self.var_nodes):
            choice[node] = self.var_alive[x][core_choice[x]]
        # Every record names only nodes that outlived it, so reverse order resolves all.
        for record in reversed(self.log):
            kind = record[0]
            if kind == "fixed":
                choice[record[1]] = record[2]
            elif kind == "follow":
                _, y, x, mapping = record
                choice[y] = mapping[choice[x]]
            elif kind == "leaf":
                _, x, y, table = record
                choice[x] = table[choice[y]]
            else:  # chain
                _, x, y, z, table2 = record
                choice[x] = table2[choice[y], choice[z]]
        return choice

    def contract(self, choice: np.ndarray) -> np.ndarray | None:
        """Core strategy per variable for an original assignment, or None if it left the core."""
        out = np.empty(len(self.var_nodes), dtype=np.int64)
        for x, node in enumerate(self.var_nodes):
            hit = np.flatnonzero(self.var_alive[x] == choice[node])
            if not hit.size:
                return None
            out[x] = hit[0]
        return out


class _Graph:
    """Mutable working state of the simplifier; variables are named by original node id."""

    def __init__(self, p: ShardingProblem) -> None:
        n = p.num_nodes
        self.n = n
        self.base_k = p.num_strategies.copy()
        self.alive: dict[int, np.ndarray] = {}
        self.cost: dict[int, np.ndarray] = {}
        costs = np.where(p.node_costs >= FORBIDDEN_COST, INF, p.node_costs)
        for v in range(n):
            o0, o1 = p.node_offsets[v], p.node_offsets[v + 1]
            self.alive[v] = np.arange(o1 - o0)
            self.cost[v] = costs[o0:o1].copy()
        self.adj: dict[int, set[int]] = {v: set() for v in range(n)}
        self.edge_end: dict[int, list[int]] = {}
        self.edge_mat: dict[int, np.ndarray] = {}
        self.pair: dict[tuple[int, int], int] = {}
        self.next_eid = 0
        # Memos keyed by the arrays they were computed from (arrays are replaced, never
        # changed in place, so identity means unchanged): whether an edge matrix has no
        # forbidden pair; edges whose matrix passed every edge rule; nodes with nothing
        # dominated over their current cost, terms and edges.
        self._finite: dict[int, tuple[np.ndarray, bool]] = {}
        self.settled: dict[int, np.ndarray] = {}
        self.undominated: dict[int, tuple[np.ndarray, ...]] = {}
        ecosts = np.where(p.edge_costs >= FORBIDDEN_COST, INF, p.edge_costs)
        for e in range(p.num_edges):
            a, b = (int(x) for x in p.edges[e])
            mat = ecosts[p.edge_offsets[e] : p.edge_offsets[e + 1]].reshape(
                self.base_k[a], self.base_k[b]
            )
            self.add_edge(a, b, mat.copy())
        for a, b in p.aliases:
            a, b = int(a), int(b)
            if a != b:
                eq = np.full((self.base_k[a], self.base_k[b]), INF)
                np.fill_diagonal(eq, 0.0)
                self.add_edge(a, b, eq)
        # Memory terms: each node owns its own interval to begin with.
        self.terms: dict[int, list[int]] = {v: [] for v in range(n)}
        self.term_interval: list[tuple[int, int]] = []
        self.term_usage: list[np.ndarray] = []
        self.term_owner: list[int] = []
        self.const_mem: list[tuple[int, int, float]] = []
        self.const_cost = 0.0
        self.usage_limit = p.usage_limit
        self.memory_matters = p.usage_limit is not None
        if self.memory_matters:
            binding = _binding_mask(p)
            for v in range(n):
                s, t = (int(x) for x in p.intervals[v])
                if s >= t:
                    continue
                use = p.usages_of(v).astype(np.float64)
                if not binding[v]:
                    continue  # never live where the limit can bind: memory is irrelevant
                lo = float(use.min())
                if lo > 0:
                    self.const_mem.append((s, t, lo))
                if np.ptp(use) > 0:
                    tid = len(self.term_usage)
                    self.term_interval.append((s, t))
                    self.term_usage.append(use - lo)
                    self.term_owner.append(v)
                    self.terms[v].append(tid)
        self.log: list[tuple[Any, ...]] = []

    # ------------------------------------------------------------- edges
    def add_edge(self, a: int, b: int, mat: np.ndarray) -> None:
        """Add (or sum into an existing) edge; a self edge folds into the node cost."""
        if a == b:
            self.cost[a] = self.cost[a] + np.diagonal(mat)
            return
        key = (a, b) if a < b else (b, a)
        eid = self.pair.get(key)
        if eid is not None:
            ea, _ = self.edge_end[eid]
            self.edge_mat[eid] = self.edge_mat[eid] + (mat if ea == a else mat.T)
            return
        eid = self.next_eid
        self.next_eid += 1
        self.edge_end[eid] = [a, b]
        self.edge_mat[eid] = mat
        self.pair[key] = eid
        self.adj[a].add(eid)
        self.adj[b].add(eid)

    def remove_edge(self, eid: int) -> None:
        a, b = self.edge_end.pop(eid)
        del self.edge_mat[eid]
        self._finite.pop(eid, None)
        self.settled.pop(eid, None)
        del self.pair[(a, b) if a < b else (b, a)]
        self.adj[a].discard(eid)
        self.adj[b].discard(eid)

    def all_finite(self, eid: int) -> bool:
        """Whether edge ``eid`` allows every pair (no forbidden entry)."""
        mat = self.edge_mat[eid]
        hit = self._finite.get(eid)
        if hit is None or hit[0] is not mat:
            hit = self._finite[eid] = (mat, bool(np.isfinite(mat).all()))
        return hit[1]

    def oriented(self, eid: int, x: int) -> tuple[int, np.ndarray]:
        """(other end, matrix with x's strategies as rows)."""
        a, b = self.edge_end[eid]
        mat = self.edge_mat[eid]
        return (b, mat) if a == x else (a, mat.T)

    # ------------------------------------------------------------- variables
    def restrict(self, x: int, keep: np.ndarray) -> None:
        """Keep only the strategies of x where ``keep`` is true."""
        if keep.all():
            return
        if not keep.any():
            raise InfeasibleError(
                f"node {x}: every strategy is forbidden by its own cost or by an edge "
                "(no choice avoids a forbidden cost)",
                node=x,
            )
        self.alive[x] = self.alive[x][keep]
        self.cost[x] = self.cost[x][keep]
        for eid in self.adj[x]:
            a, _ = self.edge_end[eid]
            mat = self.edge_mat[eid]
            self.edge_mat[eid] = mat[keep] if a == x else mat[:, keep]
        for tid in self.terms[x]:
            self.term_usage[tid] = self.term_usage[tid][keep]

    def base_table(self, x: int, values: np.ndarray) -> np.ndarray:
        """Array over x's original strategies holding ``values`` at its live ones."""
        table = np.full(self.base_k[x], -1, dtype=np.int64)
        table[self.alive[x]] = values
        return table

    def weight(self, x: int) -> int:
        """How much moving x costs: its edges and memory terms."""
        return len(self.adj[x]) + len(self.terms[x])

    def memory_constant(self, x: int) -> bool:
        return all(np.ptp(self.term_usage[t]) == 0 for t in self.terms[x])

    def drop_terms(self, x: int, at: int) -> None:
        """Turn x's memory terms into constants (x's strategy is settled or irrelevant)."""
        for tid in self.terms[x]:
            s, t = self.term_interval[tid]
            value = float(self.term_usage[tid][at])
            if value:
                self.const_mem.append((s, t, value))
        self.terms[x] = []

    def remove_var(self, x: int) -> None:
        del self.alive[x], self.cost[x], self.adj[x], self.terms[x]
        self.undominated.pop(x, None)


def _binding_mask(p: ShardingProblem) -> np.ndarray:
    """Nodes live at some time where the largest possible usage exceeds the limit.

    Memory can only be violated at such times, so a node live only elsewhere never affects
    feasibility; treating its usage as irrelevant is exact.
    """
    n = p.num_nodes
    k = p.num_strategies
    owner = np.repeat(np.arange(n), k)
    usage_max = np.full(n, -np.inf)
    np.maximum.at(usage_max, owner, p.node_usages)
    s, t = p.intervals[:, 0], p.intervals[:, 1]
    live = s < t
    grid = np.unique(np.concatenate([s[live], t[live]]))
    if grid.size == 0:
        return np.zeros(n, dtype=bool)
    delta = np.zeros(len(grid) + 1)
    np.add.at(delta, np.searchsorted(grid, s[live]), usage_max[live])
    np.add.at(delta, np.searchsorted(grid, t[live]), -usage_max[live])
    worst = np.cumsum(delta)[:-1]  # worst-case usage on [grid[i], grid[i+1])
    over = worst > float(p.usage_limit) * (1 + 1e-12)
    # A node is binding if any grid cell inside its interval is over the limit.
    prefix = np.concatenate([[0], np.cumsum(over)])
    lo = np.searchsorted(grid, s)
    hi = np.searchsorted(grid, t)
    return live & (prefix[hi] - prefix[lo] > 0)


def simplify(problem: ShardingProblem, *, enabled: bool = True) -> Reduction:
    """Reduce ``problem`` exactly; raises InfeasibleError if forbidden costs leave no choice.

    ``enabled=False`` only translates the problem into core form (every node a variable,
    forbidden entries as ``inf``), which is how tests show that simplification is exact.
    """
    t0 = time.perf_counter()
    g = _Graph(problem)
    stats = ReductionStats(
        nodes_before=problem.num_nodes,
        edges_before=problem.num_edges,
        strategies_before=int(problem.num_strategies.sum()),
    )
    queue: deque[int] = deque(range(problem.num_nodes) if enabled else ())
    queued = set(queue)

    def push(x: int) -> None:
        if x in g.alive and x not in queued:
            queued.add(x)
            queue.append(x)

    while queue:
        x = queue.popleft()
        queued.discard(x)
        if x not in g.alive:
            continue
        _visit(g, x, push, stats)

    core, var_nodes, var_alive = _export(g)
    stats.nodes_after = core.num_vars
    stats.edges_after = core.num_edges
    stats.strategies_after = int(sum(len(c) for c in core.costs))
    stats.edge_entries_after = int(sum(m.size for m in core.edge_costs))
    stats.seconds = time.perf_counter() - t0
    return Reduction(core, var_nodes, var_alive, tuple(g.log), problem.num_nodes, stats)


def _visit(g: _Graph, x: int, push: Any, stats: ReductionStats) -> None:
    """Apply every rule to variable x once; neighbours that may now simplify are re-queued."""
    # Forbidden node costs.
    finite = np.isfinite(g.cost[x])
    if not finite.all():
        g.restrict(x, finite)
        stats.bump("forbidden")
        for eid in g.adj[x]:
            push(g.oriented(eid, x)[0])
    # Arc consistency on every incident edge holding a forbidden pair.
    for eid in list(g.adj[x]):
        if g.settled.get(eid) is g.edge_mat[eid] or g.all_finite(eid):
            continue
        y, mat = g.oriented(eid, x)
        row_ok = np.isfinite(mat).any(axis=1)
        if not row_ok.all():
            g.restrict(x, row_ok)
            stats.bump("forbidden")
            for e2 in g.adj[x]:
                push(g.oriented(e2, x)[0])
            y, mat = g.oriented(eid, x)
        col_ok = np.isfinite(mat).any(axis=0)
        if not col_ok.all():
            g.restrict(y, col_ok)
            stats.bump("forbidden")
            push(y)
    if len(g.alive[x]) == 1:
        _fix(g, x, push, stats)
        return
    # Followers: a neighbour whose strategy is a function of x's merges into x.
    for eid in list(g.adj[x]):
        if eid not in g.edge_end or g.settled.get(eid) is g.edge_mat[eid]:
            continue
        y, mat = g.oriented(eid, x)
        y_follows, x_follows, fin = _follows(g, eid, mat)
        if y_follows and x_follows:
            # A bijection: either direction is exact, so move the lighter variable; always
            # moving the heavier one makes hubs migrate again and again (quadratic).
            y_follows = g.weight(y) <= g.weight(x)
        if y_follows:
            _merge(g, y, into=x, f=fin.argmax(axis=1), eid=eid)
            stats.bump("follower")
            push(x)
            return
        if x_follows:
            _merge(g, x, into=y, f=fin.argmax(axis=0), eid=eid)
            stats.bump("follower")
            push(y)
            return
    # Separable edges (a_i + b_j, which includes constant ones) fold into node costs.
    for eid in list(g.adj[x]):
        if g.settled.get(eid) is g.edge_mat[eid] or not g.all_finite(eid):
            continue
        y, mat = g.oriented(eid, x)
        a = mat[:, 0]
        b = mat[0, :] - mat[0, 0]
        sep = a[:, None] + b[None, :]
        # np.allclose(mat, sep, rtol=1e-12, atol=0) without its per-call overhead (hot loop).
        if (np.abs(mat - sep) <= 1e-12 * np.abs(sep)).all():
            g.cost[x] = g.cost[x] + a
            g.cost[y] = g.cost[y] + b
            g.remove_edge(eid)
            stats.bump("separable")
            push(y)
    # Every edge of x has now passed the three edge rules: none fires again on the same matrix.
    for eid in g.adj[x]:
        g.settled[eid] = g.edge_mat[eid]
    # Dominated strategies.
    if _drop_dominated(g, x):
        stats.bump("dominated")
        for eid in g.adj[x]:
            push(g.oriented(eid, x)[0])
        if len(g.alive[x]) == 1:
            _fix(g, x, push, stats)
            return
    # Leaf and chain elimination for variables whose memory never matters.
    if g.memory_constant(x):
        degree = len(g.adj[x])
        if degree == 0:
            at = int(np.argmin(g.cost[x]))
            g.const_cost += float(g.cost[x][at])
            g.drop_terms(x, at)
            g.log.append(("fixed", x, int(g.alive[x][at])))
            g.remove_var(x)
            stats.bump("isolated")
        elif degree == 1:
            _eliminate_leaf(g, x, push)
            stats.bump("leaf")
        elif degree == 2:
            (e1, e2) = tuple(g.adj[x])
            y, m1 = g.oriented(e1, x)
            z, m2 = g.oriented(e2, x)
            if len(g.alive[y]) * len(g.alive[x]) * len(g.alive[z]) <= MAX_CHAIN_TENSOR:
                _eliminate_chain(g, x, y, z, m1, m2, push)
                stats.bump("chain")


def _follows(g: _Graph, eid: int, mat: np.ndarray) -> tuple[bool, bool, np.ndarray]:
    """(each row allows exactly one column, each column exactly one row, finite mask) of an
    edge matrix oriented with x's strategies as rows."""
    fin = np.isfinite(mat)
    if g.all_finite(eid):  # every pair allowed: a function only of a single strategy
        return mat.shape[1] == 1, mat.shape[0] == 1, fin
    return bool((fin.sum(axis=1) == 1).all()), bool((fin.sum(axis=0) == 1).all()), fin


def _fix(g: _Graph, x: int, push: Any, stats: ReductionStats) -> None:
    """x has one strategy left: fold its edges into neighbours and drop it."""
    g.const_cost += float(g.cost[x][0])
    for eid in list(g.adj[x]):
        y, mat = g.oriented(eid, x)
        g.cost[y] = g.cost[y] + mat[0]
        g.remove_edge(eid)
        push(y)
    g.drop_terms(x, 0)
    g.log.append(("fixed", x, int(g.alive[x][0])))
    g.remove_var(x)
    stats.bump("single")


def _merge(g: _Graph, y: int, *, into: int, f: np.ndarray, eid: int) -> None:
    """Merge y into x where y's strategy is ``f[x's strategy]`` (current indices)."""
    x = into
    _, mat = g.oriented(eid, x)
    g.cost[x] = g.cost[x] + g.cost[y][f] + mat[np.arange(len(f)), f]
    g.remove_edge(eid)
    for e2 in list(g.adj[y]):
        z, m2 = g.oriented(e2, y)
        g.remove_edge(e2)
        g.add_edge(x, z, m2[f])
    for tid in g.terms[y]:
        g.term_usage[tid] = g.term_usage[tid][f]
        g.term_owner[tid] = x
        g.terms[x].append(tid)
    g.terms[y] = []
    g.log.append(("follow", y, x, g.base_table(x, g.alive[y][f])))
    g.remove_var(y)


def _drop_dominated(g: _Graph, x: int) -> bool:
    """Remove strategies of x that another strategy matches or beats everywhere."""
    k = len(g.alive[x])
    eids = sorted(g.adj[x])
    key = (g.cost[x], *(g.term_usage[t] for t in g.terms[x]), *(g.edge_mat[e] for e in eids))
    seen = g.undominated.get(x)
    if seen is not None and len(seen) == len(key) and all(map(operator.is_, seen, key)):
        return False  # nothing changed since the last check found nothing
    cols = [g.cost[x][:, None]]
    cols += [g.term_usage[t][:, None] for t in g.terms[x]]
    cols += [g.oriented(eid, x)[1] for eid in eids]
    sig = np.concatenate(cols, axis=1)
    if k * k * sig.shape[1] > 20_000_000:
        return False
    le = (sig[:, None, :] <= sig[None, :, :]).all(axis=2)  # le[j, i]: j no worse than i
    eq = le & le.T
    # j dominates i if no worse everywhere and either strictly better somewhere or an
    # identical earlier copy; this order is strict, so every dropped strategy keeps a
    # surviving dominator.
    # Strictly upper-triangular ``earlier`` also keeps a strategy from dominating itself.
    dominates = le & (~eq | _earlier(k))
    dropped = dominates.any(axis=0)
    if not dropped.any():
        g.undominated[x] = key
        return False
    g.restrict(x, ~dropped)
    return True


@functools.cache
def _earlier(k: int) -> np.ndarray:
    """``out[j, i]``: j < i (read-only, shared)."""
    out = np.triu(np.ones((k, k), dtype=bool), 1)
    out.flags.writeable = False
    return out


def _eliminate_leaf(g: _Graph, x: int, push: Any) -> None:
    (eid,) = tuple(g.adj[x])
    y, mat = g.oriented(eid, x)
    total = g.cost[x][:, None] + mat  # (k_x, k_y)
    best = np.argmin(total, axis=0)
    g.cost[y] = g.cost[y] + total[best, np.arange(total.shape[1])]
    g.remove_edge(eid)
    g.drop_terms(x, 0)
    g.log.append(("leaf", x, y, g.base_table(y, g.alive[x][best])))
    g.remove_var(x)
    push(y)


def _eliminate_chain(
    g: _Graph, x: int, y: int, z: int, m1: np.ndarray, m2: np.ndarray, push: Any
) -> None:
    """Minimise x out of y - x - z: new edge (y, z) with min over x of the path cost."""
    # total[i, j, k] = m1[i, j] + cost_x[i] + m2[i, k] for x-strategy i, y-strategy j and
    # z-strategy k (both matrices are oriented with x's strategies as rows).
    total = m1[:, :, None] + g.cost[x][:, None, None] + m2[:, None, :]
    best = total.argmin(axis=0)
    new = total.min(axis=0)  # equals total at best: argmin and min pick the same entry
    g.remove_edge(next(iter(g.adj[x])))
    g.remove_edge(next(iter(g.adj[x])))
    table = np.full((g.base_k[y], g.base_k[z]), -1, dtype=np.int64)
    table[g.alive[y][:, None], g.alive[z][None, :]] = g.alive[x][best]
    g.drop_terms(x, 0)
    g.log.append(("chain", x, y, z, table))
    g.remove_var(x)
    g.add_edge(y, z, new)
    push(y)
    push(z)


def _export(g: _Graph) -> tuple[CoreProblem, np.ndarray, tuple[np.ndarray, ...]]:
    var_nodes = np.array(sorted(g.alive), dtype=np.int64)
    index = {int(v): i for i, v in enumerate(var_nodes)}
    edges = []
    mats = []
    for eid in sorted(g.edge_end):
        a, b = g.edge_end[eid]
        edges.append((index[a], index[b]))
        mats.append(g.edge_mat[eid])
    term_ids = [t for v in var_nodes for t in g.terms[int(v)]]
    const = np.array(g.const_mem, dtype=np.float64).reshape(-1, 3)
    core = CoreProblem(
        costs=tuple(g.cost[int(v)] for v in var_nodes),
        edges=np.array(edges, dtype=np.int64).reshape(-1, 2),
        edge_costs=tuple(mats),
        term_var=np.array([index[g.term_owner[t]] for t in term_ids], dtype=np.int64),
        term_intervals=np.array([g.term_interval[t] for t in term_ids], dtype=np.int64).reshape(
            -1, 2
        ),
        term_usages=tuple(g.term_usage[t] for t in term_ids),
        const_intervals=const[:, :2].astype(np.int64),
        const_usages=const[:, 2].copy(),
        usage_limit=g.usage_limit,
        const_cost=g.const_cost,
    )
    return core, var_nodes, tuple(g.alive[int(v)] for v in var_nodes)
