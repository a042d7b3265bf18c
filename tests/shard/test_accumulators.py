"""Gradient accumulators priced in the ILP (``shard/accumulators.py``): the relaxed count,
the re-pricing with the plan's own data-parallel axes, and the exact re-solve, checked
against an oracle that pins every input layout and treats the accumulator as a constant."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_mini import ClusterSpec
from alpa_mini.errors import MemoryBudgetError
from alpa_mini.graph.tracing import trace_jaxpr
from alpa_mini.pipeline.stage_cost import plan_held_bytes
from alpa_mini.shard import CostModel, problem
from alpa_mini.shard.accumulators import accumulator_bytes, data_parallel_axes
from alpa_mini.shard.problem import build_sharding_problem, plan_sharding
from alpa_mini.shard.spec import ShardingSpec
from alpa_mini.solvers import FractionalRelaxation

A100 = ClusterSpec.named("dgx-a100")
MiB = 2**20


def _fwd_bwd(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)


@pytest.fixture(scope="module")
def case():
    """A (1024, 1024) weight read by 4096 rows on 2 GPUs: a 4 MiB parameter whose data-parallel
    accumulator is the whole 4 MiB per device whatever the parameter's layout."""
    w, x = np.ones((1024, 1024), np.float32), np.ones((4096, 1024), np.float32)
    graph = trace_jaxpr(jax.make_jaxpr(_fwd_bwd)(w, x), ["param", "batch"])
    return graph, CostModel(A100, A100.logical_mesh((2,), (1, 2)))


def _oracle(graph, cost, budget: float):
    """The fastest plan over every pinned (weight, batch) layout pair, its accumulator a
    constant taken off the budget: (seconds, peak bytes), or None."""
    inst = build_sharding_problem(graph, cost)
    layouts = [[s.out_specs[0] for s in inst.strategies[i]] for i in range(2)]
    nbytes = graph.tensors[graph.inputs[0]].nbytes
    best = None
    for sw, sx in itertools.product(*layouts):
        acc = accumulator_bytes(nbytes, sw, (2,), data_parallel_axes([sx], (2,)))
        pins = [lambda s, sw=sw: s == sw, lambda s, sx=sx: s == sx]
        try:
            p = plan_sharding(graph, cost, ("x",), input_filters=pins, memory_budget=budget - acc)
        except MemoryBudgetError:
            continue
        if best is None or p.predicted_time < best[0]:
            best = (p.predicted_time, p.peak_memory + acc)
    return best


def test_accumulator_bytes_leave_out_the_axes_that_split_the_rows() -> None:
    zero = ShardingSpec(((0,), ()))
    assert accumulator_bytes(1024, zero, (4,), ()) == 256  # tensor parallel: as the parameter
    assert accumulator_bytes(1024, zero, (4,), (0,)) == 1024  # ZeRO: a whole copy per group
    both = ShardingSpec(((0,), (1,)))
    assert accumulator_bytes(1024, both, (2, 4), (0,)) == 256
    assert data_parallel_axes([ShardingSpec(((), ())), ShardingSpec(((1,), ()))], (2, 4)) == (1,)
    assert data_parallel_axes([ShardingSpec(((0,),))], (1, 4)) == ()  # a size-1 axis splits nothing


@pytest.mark.parametrize("budget_mib", [42, 44, 45, 46, 47, 48, 56, None])
def test_the_plan_with_accumulators_is_the_pinned_oracles_optimum(case, budget_mib, monkeypatch):
    graph, cost = case
    budget = None if budget_mib is None else budget_mib * MiB
    refits = []
    real = problem.fit_accumulators
    monkeypatch.setattr(
        problem, "fit_accumulators", lambda *a, **k: refits.append(1) or real(*a, **k)
    )
    want = _oracle(graph, cost, 1e18 if budget is None else budget)
    if want is None:
        with pytest.raises(MemoryBudgetError, match="memory_budget"):
            plan_sharding(graph, cost, ("x",), memory_budget=budget, accumulated=[0])
        return
    plan = plan_sharding(graph, cost, ("x",), memory_budget=budget, accumulated=[0])
    assert plan.predicted_time == pytest.approx(want[0], rel=1e-12)
    assert plan.peak_memory == pytest.approx(want[1], rel=1e-12)
    assert budget is None or plan.peak_memory <= budget
    # At 44 and 45 MiB the relaxed ILP (the accumulator in the weight's layout) picks ZeRO's
    # layouts, which truly hold 46 MiB: only the exact re-solve finds the plan that fits.
    assert bool(refits) == (budget_mib in (44, 45))


def test_held_bytes_count_a_zero_layouts_accumulator_whole(case) -> None:
    graph, cost = case
    plan = plan_sharding(graph, cost, ("x",), memory_budget=46 * MiB, accumulated=[0])
    w = plan.tensors[plan.inputs[0]]
    x = plan.tensors[plan.inputs[1]]
    assert (w.spec.dims, x.spec.dims) == (((0,), ()), ((0,), ()))  # ZeRO: both split
    # Half the weight (2 MiB) plus a whole accumulator (4 MiB), plus the residuals given.
    assert plan_held_bytes(plan, 1.0) == 2 * MiB + 4 * MiB + 1.0


def test_a_composed_layers_accumulators_are_added_after_the_solve(case) -> None:
    """``accumulators_in_ilp=False`` (the layers a stage is composed from): the plan of the
    ILP without accumulators, its peak raised by exactly its own accumulators, even past the
    budget, which the composed stage's memory then judges."""
    graph, cost = case
    plain = plan_sharding(graph, cost, ("x",), memory_budget=46 * MiB)
    after = plan_sharding(
        graph, cost, ("x",), memory_budget=46 * MiB, accumulated=[0], accumulators_in_ilp=False
    )
    assert [t.spec for t in after.tensors] == [t.spec for t in plain.tensors]
    assert after.predicted_time == plain.predicted_time
    w, x = (after.tensors[t] for t in after.inputs)
    dp = data_parallel_axes([x.spec], (2,))
    assert after.peak_memory == plain.peak_memory + accumulator_bytes(4 * MiB, w.spec, (2,), dp)


def test_one_micro_batch_adds_the_partials_excess_over_the_gradients_layout(case) -> None:
    """``gradient_partials`` (one micro-batch): the same plan, its peak raised by what the
    weight gradient's partial (whole per data-parallel group) holds beyond the gradient's own
    layout, which the ILP counted."""
    graph, cost = case
    plain = plan_sharding(graph, cost, ("x",), memory_budget=46 * MiB)
    one = plan_sharding(graph, cost, ("x",), memory_budget=46 * MiB, gradient_partials=[(0, 0)])
    assert [t.spec for t in one.tensors] == [t.spec for t in plain.tensors]
    w, x = (one.tensors[t] for t in one.inputs)
    dp = data_parallel_axes([x.spec], (2,))
    partial = accumulator_bytes(4 * MiB, w.spec, (2,), dp)
    own = accumulator_bytes(4 * MiB, one.output_specs[0], (2,), ())
    assert dp == (0,) and partial == 4 * MiB  # the rows split: a whole partial
    assert one.peak_memory == plain.peak_memory + max(0.0, partial - own)


def test_a_deferred_solve_whose_relaxed_plan_does_not_fit_raises_a_bound(case) -> None:
    """Where bounds are asked for (``defer_fractional``), a relaxed plan that does not fit
    with its accumulators gives its optimum as the bound, which the exact plan never beats."""
    graph, cost = case
    budget = 44 * MiB  # the relaxed plan is ZeRO's, 46 MiB with its accumulator
    with pytest.raises(FractionalRelaxation, match="accumulators do not fit") as info:
        plan_sharding(
            graph, cost, ("x",), memory_budget=budget, accumulated=[0], defer_fractional=True
        )
    exact = plan_sharding(graph, cost, ("x",), memory_budget=budget, accumulated=[0])
    assert 0 < info.value.lower_bound <= exact.solver["objective"]
