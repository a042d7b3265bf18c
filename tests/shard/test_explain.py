"""``ShardingPlan.explain`` and the plan's tables, checked against closed forms and the ILP.

The cost model's formulas (alpa_mini/cost_model.py): compute is the roofline
max(flops / peak, bytes / bandwidth) / parallel; over n devices an all-reduce of B bytes
costs alpha + 2 beta (n-1)/n B and an all-gather of a B-byte result alpha + beta (n-1)/n B.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ShardParallel
from alpa_mini.graph.tracing import trace_jaxpr
from alpa_mini.inspect import Alternative, Explanation
from alpa_mini.shard import CostModel
from alpa_mini.shard.plan import ShardingPlan
from alpa_mini.shard.problem import build_sharding_problem
from alpa_mini.shard.read_back import MAX_ALTERNATIVES, read_plan
from alpa_mini.solvers import solve_sharding
from helpers.mlp import all_reduce, mlp_forward, mlp_inputs, sgd_step

CPU = ClusterSpec.named("cpu-1x8")
ALPHA, BETA = CPU.intra_host.alpha, CPU.intra_host.beta
PEAK = CPU.device.flops_for("float32")
BANDWIDTH = CPU.device.memory_bandwidth


def all_gather(nbytes: float, n: int) -> float:
    return ALPHA + BETA * (n - 1) / n * nbytes


def megatron(batch: int = 8, hidden: int = 512):
    """test_shard_parallel's Megatron case: the weights cannot both be replicated."""
    p, x, _ = mlp_inputs(batch, hidden)
    budget = 0.6 * 2 * hidden * hidden * 4  # one replicated weight + a quarter of the other
    step = alpa_mini.parallelize(
        mlp_forward,
        method=ShardParallel(mesh_shape=(4,), memory_budget=budget, replicate_outputs=True),
    )
    return step.get_executable(p, x)


def op_reading(ex, name: str, primitive: str) -> int:
    (tid,) = [t for t in ex.plan.inputs if ex.plan.tensors[t].name == name]
    (op,) = [n.id for n in ex.graph.nodes if n.primitive == primitive and tid in n.inputs]
    return op


def sgd_plan(mesh_shape, batch: int, hidden: int):
    args = mlp_inputs(batch, hidden)
    step = alpa_mini.parallelize(
        sgd_step, method=ShardParallel(mesh_shape=mesh_shape), batch_argnums=(1, 2)
    )
    return step.get_executable(*args).plan


# --------------------------------------------------------------------- closed forms
def test_megatron_second_matmul_is_explained_by_its_all_reduce(devices4) -> None:
    batch, hidden, n = 8, 512, 4
    ex = megatron(batch, hidden)
    plan = ex.plan
    op = op_reading(ex, "[0]['w2']", "dot_general")
    expl = plan.explain(op)
    assert isinstance(expl, Explanation)
    assert (expl.kind, expl.primitive, expl.subject) == ("op", "dot_general", f"{op}:dot_general")
    # The same choice by label and through the tensor it produces.
    assert plan.explain(f"{op}:dot_general") == expl
    (out,) = [t.name for t in plan.tensors if t.producer == op]
    assert plan.explain(out) == expl

    # Row-split w2 and column-split hidden activations: a contraction split 4 ways whose
    # partial sums are all-reduced (batch x hidden fp32) into the replicated output.
    (ar,) = [c for c in expl.collectives if c.kind == "all-reduce"]
    assert ar.nbytes == batch * hidden * 4
    assert ar.seconds == pytest.approx(all_reduce(batch * hidden * 4, n), rel=1e-12)
    assert (ar.origin, ar.node) == ("op", op)
    full = max(2 * batch * hidden * hidden / PEAK, (2 * batch * hidden + hidden**2) * 4 / BANDWIDTH)
    c = expl.chosen
    assert c.strategy == plan.nodes[op].strategy
    assert c.compute == pytest.approx(full / n, rel=1e-12)
    assert c.comm == pytest.approx(ar.seconds, rel=1e-12)
    assert c.reshard == 0.0  # its operands arrive as it reads them; its result is returned as is

    # The neighbours' chosen layouts, which the replicated alternative must gather from.
    (relu,) = [n.id for n in ex.graph.nodes if n.primitive == "max"]
    (h,) = ex.graph.nodes[relu].outputs
    assert plan.tensors[h].spec.label(plan.axis_names) == "RS(x)"
    assert plan.tensor("[0]['w2']").spec.label(plan.axis_names) == "S(x)R"
    rep = expl.replicated
    assert rep is not None and rep.strategy == "replicated" and rep in expl.alternatives
    # The full matmul on one device: 2 b h^2 flops (compute bound: 8.4e-4 s against 2.2e-4 s
    # of memory traffic), no partial sums.
    assert rep.compute == pytest.approx(full, rel=1e-12)
    assert full == 2 * batch * hidden * hidden / PEAK
    assert rep.comm == 0.0
    # Replicated operands from the chosen neighbours: the activations RS(x) -> RR gather
    # dim 1 over x (one all-gather, result b*h*4 bytes), w2 S(x)R -> RR gathers dim 0
    # (result h*h*4 bytes). Its replicated result goes to the replicated output sink for free.
    expected = all_gather(batch * hidden * 4, n) + all_gather(hidden * hidden * 4, n)
    assert rep.reshard == pytest.approx(expected, rel=1e-12)
    assert rep.memory == batch * hidden * 4 and rep.fits  # as much as the chosen result
    assert rep.total > c.total
    assert expl.margin > 0 and expl.best_alternative.total - c.total == expl.margin
    text = str(expl)
    assert "all-reduce" in text and "replicated" in text and c.strategy in text
    assert "16.0 KiB" in text  # the all-reduce's bytes in human units

    # w2's own layout: replicating it is free in time but breaks the memory budget
    # (1 MiB + a quarter of w1 > 0.6 x 2 MiB), and the explanation says so.
    w2 = plan.explain("[0]['w2']")
    assert (w2.kind, w2.primitive, w2.chosen.strategy) == ("input", "", "S(x)R")
    assert w2.replicated is not None and w2.replicated.strategy == "RR"
    assert w2.replicated.memory == hidden * hidden * 4 and not w2.replicated.fits
    assert w2.replicated.total == w2.chosen.total == 0.0
    assert "does not fit" in str(w2)


# --------------------------------------------------------------------- the ILP's optimality
def _check_alternatives(plan: ShardingPlan) -> int:
    """Invariants of every stored choice; returns how many fitting alternatives it checked."""
    assert plan.solver["status"] == "optimal"
    # Moving one choice of an optimal plan (to a strategy that fits) changes the objective by
    # alt.total - chosen.total >= 0; the tolerance covers HiGHS's round-off only.
    tol = 1e-9 * plan.solver["objective"]
    checked = 0
    choices = [(n.strategy, n.alternatives, n.num_strategies) for n in plan.nodes]
    for t in plan.inputs:
        tp = plan.tensors[t]
        choices.append((tp.spec.label(plan.axis_names), tp.alternatives, None))
    for strategy, alts, num in choices:
        totals = [a.total for a in alts]
        assert totals == sorted(totals)
        names = [a.strategy for a in alts]
        assert len(set(names)) == len(names) and strategy in names
        assert len(alts) <= MAX_ALTERNATIVES + 2 and (num is None or len(alts) <= num)
        if num is not None:
            assert len(alts) >= min(num, MAX_ALTERNATIVES + 1)
        chosen = alts[names.index(strategy)]
        assert chosen.fits
        for a in alts:
            if a.fits and a is not chosen:
                assert a.total >= chosen.total - tol, (strategy, a)
                checked += 1
    for i, n in enumerate(plan.nodes):
        chosen = plan.explain(i).chosen
        assert (chosen.compute, chosen.comm) == (n.compute, n.comm)
    return checked


def test_single_moves_never_improve_optimal_plans_1d(devices4) -> None:
    dp = sgd_plan((4,), 1024, 16)  # data parallel
    mt = megatron().plan  # Megatron under a memory budget
    train = sgd_plan((4,), 8, 512)  # sharded weights in a train step
    assert all(_check_alternatives(p) > 5 for p in (dp, mt, train))


def test_single_moves_never_improve_optimal_plans_2d(devices8) -> None:
    plan = sgd_plan((2, 4), 64, 32)
    assert _check_alternatives(plan) > 20
    # On a 2-D mesh a matmul has more strategies than a plan keeps: the list is bounded.
    dots = [n for n in plan.nodes if n.primitive == "dot_general"]
    assert any(n.num_strategies > MAX_ALTERNATIVES + 2 for n in dots)
    assert all(len(n.alternatives) <= MAX_ALTERNATIVES + 2 for n in dots)


def test_alternatives_equal_a_plain_loop_over_the_ilp_edges() -> None:
    """The vectorised pricing in read_plan against the ILP read edge by edge: every kept
    strategy's reshard, the choice of the kept ones, and chosen.total = own costs + edges."""
    batch, hidden = 64, 32
    p, x, y = mlp_inputs(batch, hidden)
    closed = jax.make_jaxpr(sgd_step)(p, x, y)
    graph = trace_jaxpr(closed, ["param", "param", "batch", "batch"])
    cost = CostModel(CPU, CPU.logical_mesh((2, 4)))
    budget = 0.9 * sum(graph.tensors[t].nbytes for t in graph.inputs)
    inst = build_sharding_problem(graph, cost, memory_budget=budget)
    sol = solve_sharding(inst.problem, lp_first=True)
    plan = read_plan(graph, cost, ("x", "y"), inst, sol, budget, 0.0)
    prob = inst.problem
    reshard = [np.zeros(int(k)) for k in prob.num_strategies]
    for e, (u, v) in enumerate(prob.edges.tolist()):
        m = prob.edge_matrix(e)
        reshard[u] += m[:, sol.choice[v]]
        reshard[v] += m[sol.choice[u], :]
    stored = [t.alternatives for t in (plan.tensors[t] for t in graph.inputs)]
    stored += [n.alternatives for n in plan.nodes]
    kept_some_out = False
    for v, alts in enumerate(stored):
        strats = inst.strategies[v]
        names = [
            s.out_specs[0].label(plan.axis_names) if v < len(graph.inputs) else s.name
            for s in strats
        ]
        index = {name: i for i, name in enumerate(names)}
        totals = [s.compute + s.comm + reshard[v][i] for i, s in enumerate(strats)]
        c = sol.choice[v]
        for a in alts:
            i = index[a.strategy]
            assert a.reshard == pytest.approx(reshard[v][i], rel=1e-12, abs=1e-18)
            assert (a.compute, a.comm, a.memory) == (
                strats[i].compute,
                strats[i].comm,
                strats[i].memory,
            )
            peak = plan.peak_memory - strats[c].memory + a.memory
            assert a.fits == (peak <= budget)
        # Kept: the chosen one, the MAX_ALTERNATIVES cheapest others, the replicated one.
        others = sorted((i for i in range(len(strats)) if i != c), key=lambda i: totals[i])
        cutoff = totals[others[MAX_ALTERNATIVES - 1]] if len(others) >= MAX_ALTERNATIVES else 0
        kept = {index[a.strategy] for a in alts}
        assert c in kept
        assert {i for i in others if totals[i] < cutoff} <= kept
        assert len(kept) <= min(len(strats), MAX_ALTERNATIVES + 2)
        replicated = [i for i, name in enumerate(names) if name in ("replicated", "RR")]
        assert len(replicated) == 1 and replicated[0] in kept
        kept_some_out |= len(kept) < len(strats)
    assert kept_some_out
    # Chosen totals from the plan's own records: compute + comm of the node, plus its edges.
    for i, n in enumerate(plan.nodes):
        v = inst.num_inputs + i
        chosen = plan.explain(i).chosen
        assert chosen.total == pytest.approx(
            n.compute + n.comm + reshard[v][sol.choice[v]], rel=1e-12, abs=1e-18
        )


def test_a_plan_read_without_alternatives_is_the_same_plan_without_them() -> None:
    """``read_plan(alternatives=False)`` (stage ILPs): every layout, cost, collective and the
    peak as with them; no choice carries alternatives."""
    p, x, y = mlp_inputs(64, 32)
    graph = trace_jaxpr(jax.make_jaxpr(sgd_step)(p, x, y), ["param", "param", "batch", "batch"])
    cost = CostModel(CPU, CPU.logical_mesh((2, 4)))
    inst = build_sharding_problem(graph, cost)
    sol = solve_sharding(inst.problem, lp_first=True)
    full = read_plan(graph, cost, ("x", "y"), inst, sol, None, 0.0)
    bare = read_plan(graph, cost, ("x", "y"), inst, sol, None, 0.0, alternatives=False)
    assert any(n.alternatives for n in full.nodes)
    assert all(n.alternatives == () for n in bare.nodes)
    assert all(t.alternatives == () for t in bare.tensors)
    strip = functools.partial(dataclasses.replace, alternatives=())
    assert bare.nodes == tuple(map(strip, full.nodes))
    assert bare.tensors == tuple(map(strip, full.tensors))
    assert (bare.collectives, bare.peak_memory, bare.predicted_time) == (
        full.collectives, full.peak_memory, full.predicted_time,
    )  # fmt: skip


# --------------------------------------------------------------------- JSON
def test_json_round_trip_keeps_explanations_and_old_json_still_loads(devices4) -> None:
    ex = megatron()
    plan = ex.plan
    again = ShardingPlan.from_json(plan.to_json())
    assert again == plan
    subjects = [*range(len(plan.nodes)), *(plan.tensors[t].name for t in plan.inputs)]
    for s in subjects:
        assert again.explain(s) == plan.explain(s)

    # A plan saved before alternatives and producers existed: it loads, explain says why not.
    data = json.loads(plan.to_json())
    for row in data["nodes"] + data["tensors"]:
        del row["alternatives"]
        row.pop("producer", None)
    old = ShardingPlan.from_json(json.dumps(data))
    stripped = dataclasses.replace(
        plan,
        nodes=tuple(dataclasses.replace(n, alternatives=()) for n in plan.nodes),
        tensors=tuple(dataclasses.replace(t, alternatives=(), producer=None) for t in plan.tensors),
    )
    assert old == stripped
    with pytest.raises(ValueError, match="no alternatives stored for '0:dot_general'"):
        old.explain(0)
    with pytest.raises(ValueError, match=r"no alternatives stored for \"\[0\]\['w1'\]\""):
        old.explain("[0]['w1']")
    intermediate = next(t.name for t in plan.tensors if t.producer is not None)
    with pytest.raises(ValueError, match="does not record which operator produces"):
        old.explain(intermediate)
    assert old.to_records("nodes")[0]["reshard"] is None


# --------------------------------------------------------------------- bad arguments
def test_bad_arguments_name_the_argument_the_value_and_what_is_valid(devices4) -> None:
    plan = megatron().plan
    last = len(plan.nodes) - 1
    for bad in (last + 1, -1):
        with pytest.raises(
            KeyError, match=rf"tensor_or_op: {bad} is not an operator id \(0\.\.{last}\)"
        ):
            plan.explain(bad)
    with pytest.raises(KeyError) as info:
        plan.explain("nope")
    message = info.value.args[0]  # str(KeyError) would quote it again
    assert message.startswith("tensor_or_op: 'nope' is neither a tensor name")
    assert "[0]['w1']" in message and f"ids 0..{last}" in message
    wrong = next(f"{i}:max" for i, n in enumerate(plan.nodes) if n.primitive != "max")
    with pytest.raises(KeyError) as info:
        plan.explain(wrong)
    assert info.value.args[0].startswith(f"tensor_or_op: '{wrong}' is neither")
    for bad in (1.5, True, None, ("[1]",)):
        with pytest.raises(TypeError, match="tensor_or_op: expected an operator id"):
            plan.explain(bad)
    assert plan.explain(np.int64(0)) == plan.explain(0)
    for call in (plan.to_records, plan.to_dataframe):
        with pytest.raises(ValueError, match=r"table: 'edges' is not .*'nodes', 'tensors'"):
            call("edges")


# --------------------------------------------------------------------- tables
def test_records_and_dataframes_have_one_row_per_item(devices4, monkeypatch) -> None:
    ex = megatron()
    plan = ex.plan
    op = op_reading(ex, "[0]['w2']", "dot_general")
    nodes = plan.to_records("nodes")
    assert len(nodes) == len(plan.nodes) and len(plan.to_records()) == len(plan.nodes)
    row = nodes[op]
    assert row["op"] == f"{op}:dot_general" and row["strategy"] == plan.nodes[op].strategy
    assert row["operands"] == "RS(x), S(x)R"
    assert row["total"] == plan.explain(op).chosen.total
    assert row["margin"] == plan.explain(op).margin
    tensors = plan.to_records("tensors")
    assert len(tensors) == len(plan.tensors)
    (w2,) = [r for r in tensors if r["name"] == "[0]['w2']"]
    assert (w2["layout"], w2["role"], w2["is_input"], w2["producer"]) == (
        "S(x)R",
        "param",
        True,
        None,
    )
    colls = plan.to_records("collectives")
    assert len(colls) == len(plan.collectives) == 1
    assert (colls[0]["kind"], colls[0]["axes"], colls[0]["op"]) == (
        "all-reduce",
        "x",
        f"{op}:dot_general",
    )
    for table, n in (
        ("nodes", plan.nodes),
        ("tensors", plan.tensors),
        ("collectives", plan.collectives),
    ):
        df = plan.to_dataframe(table)
        assert len(df) == len(n)
    df = plan.to_dataframe("tensors")
    assert df.set_index("name").loc["[0]['w1']", "layout"] == "RS(x)"
    assert plan.to_dataframe("collectives")["nbytes"].sum() == 8 * 512 * 4

    expl = plan.explain(op)
    recs = expl.to_records()
    assert len(recs) == len(expl.alternatives) and sum(r["chosen"] for r in recs) == 1
    assert [r["delta"] for r in recs if r["chosen"]] == [0.0]
    assert [r["strategy"] for r in recs if r["replicated"]] == ["replicated"]
    assert all(math.isclose(r["total"] - r["delta"], expl.chosen.total) for r in recs)
    assert isinstance(expl.chosen, Alternative)

    monkeypatch.setitem(sys.modules, "pandas", None)  # as if pandas were not installed
    with pytest.raises(ImportError, match="pip install pandas"):
        plan.to_dataframe()
