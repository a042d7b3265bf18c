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
