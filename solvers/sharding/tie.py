"""Tie nodes that must pick the same strategy: the problem over the groups, and back.

Repeated layers of an unrolled model make many nodes with the same strategies in the same
surroundings. Tying each such group to one choice gives a much smaller problem whose
solutions are solutions of the original (every member takes its group's choice):

- a group's strategy costs are the sum of its members' costs;
- an edge between two groups sums the matrices of the member edges it stands for; an edge
  inside one group adds its diagonal to the group's costs (both ends take the same choice);
- a group is live from its first member's start to its last member's end and uses, per
  strategy, the most its members use together at any one time. That never undercounts, so a
  tied solution that fits the limit also fits it untied; it can overcount (a member's usage
  counted over the whole hull), which only rejects some tied solutions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SolverInputError
from .problem import ShardingProblem

__all__ = ["NotTied", "repeated_groups", "tie_nodes", "untie_choice"]


def tie_nodes(problem: ShardingProblem, groups: Sequence[int]) -> ShardingProblem:
    """The problem over groups (``groups[v]``: node v's group, numbered 0..G-1)."""
    labels = np.asarray(groups, dtype=np.int64)
    n = problem.num_nodes
    if labels.shape != (n,):
        raise SolverInputError(f"groups: expected one label per node ({n}), got {labels.shape}")
    G = int(labels.max()) + 1 if n else 0
    if n and (labels.min() < 0 or len(np.unique(labels)) != G):
        raise SolverInputError("groups: labels must be 0..G-1, each used at least once")
    k = problem.num_strategies
    first = np.full(G, -1, dtype=np.int64)
    for v in range(n):
        g = labels[v]
        if first[g] < 0:
            first[g] = v
        elif k[v] != k[first[g]]:
            raise SolverInputError(
                f"groups: nodes {first[g]} and {v} are tied but have {k[first[g]]} and "
                f"{k[v]} strategies"
            )
    costs = [np.zeros(int(k[first[g]])) for g in range(G)]
    for v in range(n):
        costs[labels[v]] += problem.costs_of(v)
    usages = _group_usages(problem, labels, G, k[first])
    starts = np.full(G, np.iinfo(np.int64).max, dtype=np.int64)
    ends = np.zeros(G, dtype=np.int64)
    np.minimum.at(starts, labels, problem.intervals[:, 0])
    np.maximum.at(ends, labels, problem.intervals[:, 1])
    matrices: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v) in enumerate(problem.edges.tolist()):
        gu, gv = int(labels[u]), int(labels[v])
        m = problem.edge_matrix(e)
        if gu == gv:
            costs[gu] += np.diag(m)
        elif (gu, gv) in matrices:
            matrices[(gu, gv)] += m
        else:
            matrices[(gu, gv)] = m.astype(np.float64, copy=True)
    aliases = {
        (int(labels[u]), int(labels[v]))
        for u, v in problem.aliases.tolist()
        if labels[u] != labels[v]
    }
    names = None
    if problem.node_names is not None:
        names = [problem.node_names[int(first[g])] for g in range(G)]
    strategy_names = None
    if problem.strategy_names is not None:
        strategy_names = [problem.strategy_names[int(first[g])] for g in range(G)]
    pairs = list(matrices)
    return ShardingProblem(
        num_strategies=k[first],
        node_costs=np.concatenate(costs) if costs else np.zeros(0),
        node_usages=np.concatenate(usages) if usages else np.zeros(0),
        intervals=np.stack([starts, ends], axis=1) if G else np.zeros((0, 2)),
        edges=np.array(pairs, dtype=np.int64).reshape(-1, 2),
        edge_costs=np.concatenate([matrices[p].ravel() for p in pairs]) if pairs else [],
        usage_limit=problem.usage_limit,
        aliases=np.array(sorted(aliases), dtype=np.int64).reshape(-1, 2),
        name=f"{problem.name} (tied: {G} of {n} nodes)",
        node_names=names,
        strategy_names=strategy_names,
    )


class NotTied(Exception):
    """Tying alike nodes would not halve a problem, or its tied version has no solution: for
    callers that asked for a tied solution or none (``plan_sharding(tie_repeats="only")``)."""


def repeated_groups(problem: ShardingProblem, rounds: int = 4) -> np.ndarray:
    """Group labels (0..G-1) of nodes that look alike ``rounds`` edges out: the same strategy
    costs, usages and names, reached over the same edge matrices from alike neighbours
    (Weisfeiler-Lehman refinement; lifetimes are left out, as they differ by position). The
    same position in repeated layers ends up in one group; nodes near the ends of a stack,
    whose surroundings differ, in their own.

    Vectorised: a node's neighbours enter its next colour as a multiset hash, the wrapping
    sum of one mixed 64-bit hash per (edge matrix, direction, neighbour colour), so alike
    nodes get equal colours and different ones collide only by a 64-bit hash collision."""
    n, m = problem.num_nodes, problem.num_edges
    names = problem.strategy_names
    colour = _hashes(
        (problem.costs_of(v).tobytes(), problem.usages_of(v).tobytes(),
         None if names is None else names[v])
        for v in range(n)
    )  # fmt: skip
    sig = _hashes(problem.edge_matrix(e).tobytes() for e in range(m))
    src, dst = (problem.edges[:, 0], problem.edges[:, 1]) if m else (np.zeros(0, int),) * 2
    out_key, in_key = _mix(sig ^ _SALT[0]), _mix(sig ^ _SALT[1])
    for _ in range(rounds):
        outs, ins = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
        np.add.at(outs, src, _mix(out_key + _mix(colour[dst])))
        np.add.at(ins, dst, _mix(in_key + _mix(colour[src])))
        colour = _mix(colour ^ _mix(outs ^ _SALT[2]) ^ _mix(ins ^ _SALT[3]))
    _, labels = np.unique(colour, return_inverse=True)
    return labels.reshape(-1).astype(np.int64)


#: Constants of splitmix64's finaliser, and salts that keep the hashed roles apart.
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_SALT = tuple(np.uint64(x) for x in (0x9E3779B97F4A7C15, 0x632BE59BD9B4E019,
                                     0x85EBCA77C2B2AE63, 0xC2B2AE3D27D4EB4F))  # fmt: skip


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping): a well-spread 64-bit hash."""
    x = (x ^ (x >> np.uint64(30))) * _MIX[0]
    x = (x ^ (x >> np.uint64(27))) * _MIX[1]
    return x ^ (x >> np.uint64(31))


def _hashes(items) -> np.ndarray:
    """Python's hash of each item, as uint64."""
    return np.fromiter((hash(x) for x in items), dtype=np.int64).view(np.uint64)


def untie_choice(groups: Sequence[int], group_choice: Sequence[int]) -> np.ndarray:
    """Each node's strategy: its group's."""
    return np.asarray(group_choice, dtype=np.int64)[np.asarray(groups, dtype=np.int64)]


def _group_usages(
    problem: ShardingProblem, labels: np.ndarray, G: int, k: np.ndarray
) -> list[np.ndarray]:
    """Per group and strategy, the most its members use together at any time (a sweep over
    member interval ends, releases before acquisitions at equal times: [start, end))."""
    members: list[list[int]] = [[] for _ in range(G)]
    for v in range(problem.num_nodes):
        members[labels[v]].append(v)
    out = []
    for g in range(G):
        vs = members[g]
        if len(vs) == 1:
            out.append(problem.usages_of(vs[0]).astype(np.float64))
            continue
        events = []
        for v in vs:
            s, e = (int(x) for x in problem.intervals[v])
            if e > s:
                events.append((s, 1, v))
                events.append((e, 0, v))
        live = np.zeros(int(k[g]))
        peak = np.zeros(int(k[g]))
        for _, kind, v in sorted(events):
            if kind:
                live += problem.usages_of(v)
                np.maximum(peak, live, out=peak)
            else:
                live -= problem.usages_of(v)
        out.append(peak)
    return out
