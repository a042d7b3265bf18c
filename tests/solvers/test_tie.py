"""Tying nodes to one choice: the tied problem prices every tied assignment exactly as the
original does, never calls an over-limit assignment feasible, and its optimum is the best
tied assignment of the original (brute force)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_mini.solvers.sharding.problem import ShardingProblem, evaluate
from alpa_mini.solvers.sharding.tie import tie_nodes, untie_choice
from helpers.problems import problems


@st.composite
def tied_problems(draw):
    """A random problem and a grouping of its nodes (only nodes with equal strategy counts)."""
    problem = draw(problems(max_nodes=6))
    k = problem.num_strategies.tolist()
    labels: list[int] = []
    heads: list[int] = []  # a node that starts each group
    for v in range(len(k)):
        same = [g for g, h in enumerate(heads) if k[h] == k[v]]
        if same and draw(st.booleans()):
            labels.append(draw(st.sampled_from(same)))
        else:
            labels.append(len(heads))
            heads.append(v)
    return problem, labels


@settings(max_examples=150, deadline=None)
@given(tied_problems())
def test_tied_costs_equal_and_tied_feasibility_is_conservative(case) -> None:
    problem, labels = case
    tied = tie_nodes(problem, labels)
    ranges = [range(int(k)) for k in tied.num_strategies]
    best_tied, best_untied = np.inf, np.inf
    for choice in itertools.product(*ranges):
        t = evaluate(tied, list(choice))
        u = evaluate(problem, untie_choice(labels, choice))
        if np.isfinite(u.cost) and u.cost < 1e16:
            assert t.cost == pytest.approx(u.cost)
        if t.feasible:
            assert u.feasible  # never the other way round
            best_tied = min(best_tied, t.cost)
        if u.feasible:
            best_untied = min(best_untied, u.cost)
    if problem.usage_limit is None and not len(problem.aliases):
        # Without a limit, the tied optimum is the best tied assignment of the original.
        assert best_tied == pytest.approx(best_untied) or best_tied == best_untied


def test_a_repeated_chain_ties_to_one_link() -> None:
    """Four identical nodes in a chain with equal edges: one group whose costs carry the
    three edges' diagonals; the tied optimum is the best shared choice."""
    node = [3.0, 1.0]
    edge = [[0.0, 5.0], [5.0, 2.0]]
    problem = ShardingProblem.from_lists(
        [node] * 4, edges=[[0, 1], [1, 2], [2, 3]], edge_costs=[edge] * 3
    )
    tied = tie_nodes(problem, [0, 0, 0, 0])
    assert tied.num_nodes == 1 and tied.num_edges == 0
    np.testing.assert_allclose(tied.costs_of(0), [12.0, 4.0 + 6.0])


def test_repeated_layers_fall_into_groups_and_the_ends_stay_apart() -> None:
    """A chain of 8 identical nodes: the middle four look alike; the two nodes nearest either
    end (a neighbour fewer within two rounds) each stay apart."""
    from alpa_mini.solvers.sharding.tie import repeated_groups

    problem = ShardingProblem.from_lists(
        [[1.0, 2.0]] * 8,
        edges=[[i, i + 1] for i in range(7)],
        edge_costs=[[[0.0, 1.0], [1.0, 0.0]]] * 7,
    )
    labels = repeated_groups(problem, rounds=2).tolist()
    assert len({labels[2], labels[3], labels[4], labels[5]}) == 1
    assert len(set(labels)) == 5


def _reference_groups(problem, rounds: int) -> list[int]:
    """Weisfeiler-Lehman refinement with exact multisets (sorted tuples of neighbours)."""
    names = problem.strategy_names
    colour = [
        (problem.costs_of(v).tobytes(), problem.usages_of(v).tobytes(),
         None if names is None else names[v])
        for v in range(problem.num_nodes)
    ]  # fmt: skip
    sig = [problem.edge_matrix(e).tobytes() for e in range(problem.num_edges)]
    outs = [[] for _ in colour]
    ins = [[] for _ in colour]
    for e, (u, v) in enumerate(problem.edges.tolist()):
        outs[u].append((e, v))
        ins[v].append((e, u))
    for _ in range(rounds):
        colour = [
            (colour[v], tuple(sorted((sig[e], colour[w]) for e, w in outs[v])),
             tuple(sorted((sig[e], colour[u]) for e, u in ins[v])))
            for v in range(len(colour))
        ]  # fmt: skip
    index: dict = {}
    return [index.setdefault(c, len(index)) for c in colour]


@pytest.mark.parametrize("seed", range(6))
def test_repeated_groups_are_exactly_the_alike_nodes(seed: int) -> None:
    """The hashed refinement groups nodes exactly as the one with exact multisets does, on
    random chains of repeated blocks with random extra edges and a few odd nodes."""
    from alpa_mini.solvers.sharding.tie import repeated_groups

    rng = np.random.default_rng(seed)
    block, copies = int(rng.integers(2, 6)), int(rng.integers(3, 8))
    kinds = [[float(x) for x in rng.integers(0, 3, 2)] for _ in range(block)]
    costs = [list(kinds[v % block]) for v in range(block * copies)]
    for v in rng.choice(len(costs), 2, replace=False):
        costs[v] = [9.0, 9.0]  # odd nodes
    matrices = [[[0.0, 1.0], [1.0, 0.0]], [[0.0, 2.0], [3.0, 0.0]]]
    edges, mats = [], []
    for v in range(len(costs) - 1):
        edges.append([v, v + 1])
        mats.append(matrices[(v % block) % 2])
        if v + block < len(costs) and v % block == 0:  # a skip edge within each copy
            edges.append([v, v + block])
            mats.append(matrices[1])
    problem = ShardingProblem.from_lists(costs, edges=edges, edge_costs=mats)
    for rounds in (1, 3, 6):
        got = repeated_groups(problem, rounds=rounds).tolist()
        want = _reference_groups(problem, rounds)
        pairs = {(g, w) for g, w in zip(got, want, strict=True)}
        assert len(pairs) == len(set(got)) == len(set(want))  # the same partition
        if rounds == 1:
            assert len(set(want)) < len(costs)  # something was tied
