"""Hypothesis strategies shared by the solver tests."""

from __future__ import annotations

from hypothesis import strategies as st

from alpa_mini.solvers.sharding.problem import ShardingProblem

FORBID = 1e18


@st.composite
def problems(
    draw, *, max_nodes: int = 6, memory: bool = True, aliases: bool = True, coarse: bool = False
):
    """Small random problems: forbidden entries, parallel edges, overlapping lifetimes.
    ``coarse``: edge costs from {0, 7, forbidden} and up to 4 strategies, so edge matrices
    have many equal rows and columns."""
    n = draw(st.integers(1, max_nodes))
    ks = [draw(st.integers(1, 4 if coarse else 3)) for _ in range(n)]
    cost = st.one_of(st.integers(0, 20).map(float), st.just(FORBID))
    costs = [
        [draw(cost) if draw(st.booleans()) else float(draw(st.integers(0, 20))) for _ in range(k)]
        for k in ks
    ]
    usages = [[float(draw(st.integers(0, 6))) for _ in range(k)] for k in ks]
    intervals = []
    for _ in range(n):
        s = draw(st.integers(0, 6))
        intervals.append([s, s + draw(st.integers(0, 4))])
    m = draw(st.integers(0, 2 * n))
    edges, edge_costs = [], []
    for _ in range(m if n > 1 else 0):
        u = draw(st.integers(0, n - 1))
        v = draw(st.integers(0, n - 1).filter(lambda x, u=u: x != u))
        edges.append([u, v])
        entry = (
            st.sampled_from([0.0, 7.0, FORBID])
            if coarse
            else st.integers(0, 3).flatmap(
                lambda r: cost if r == 0 else st.integers(0, 15).map(float)
            )
        )
        edge_costs.append([draw(entry) for _ in range(ks[u] * ks[v])])
    alias = []
    pairs = [[a, b] for a in range(n) for b in range(n) if a != b and ks[a] == ks[b]]
    if aliases and pairs and draw(st.booleans()):
        alias.append(draw(st.sampled_from(pairs)))
    limit = None
    if memory and draw(st.booleans()):
        limit = float(draw(st.integers(0, 20)))
    return ShardingProblem.from_lists(costs, usages, intervals, edges, edge_costs, limit, alias)
