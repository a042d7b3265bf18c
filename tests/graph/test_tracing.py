"""Tracing: nested jaxprs become one OpGraph whose flops equal the program's; strategies and
resharding costs follow their closed forms."""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_mini.cluster.spec import ClusterSpec
from alpa_mini.graph.tracing import trace_jaxpr
from alpa_mini.models import GPT_TINY, gpt_abstract_batch, gpt_abstract_params, gpt_loss
from alpa_mini.shard.cost_model import CostModel
from alpa_mini.shard.spec import ShardingSpec
from alpa_mini.shard.strategies import loop_nest, node_strategies

CPU = ClusterSpec.named("cpu-1x8")


def graph_of(fun, *args, roles=None):
    flat, tree = jax.tree.flatten(args)
    closed = jax.make_jaxpr(lambda *a: fun(*jax.tree.unflatten(tree, a)))(*flat)
    return trace_jaxpr(closed, roles or ["param"] * len(flat))


def test_call_like_sub_jaxprs_are_inlined() -> None:
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))

    def step(w, x):
        h = jax.jit(lambda a, b: a @ b)(x, w)
        h = jax.checkpoint(lambda a: jnp.tanh(a) * 2.0)(h)
        return f(h).sum()

    g = graph_of(jax.grad(step), jnp.ones((8, 8)), jnp.ones((4, 8)))
    prims = g.primitive_counts()
    assert not {"jit", "pjit", "custom_jvp_call", "checkpoint", "remat2"} & set(prims)
    # forward x @ w, and the weight gradient x^T @ dh: 2 * 4 * 8 * 8 flops each
    dots = [n for n in g.nodes if n.primitive == "dot_general"]
    assert sum(n.flops for n in dots) == 2 * (2 * 4 * 8 * 8)


def test_scan_body_is_planned_once_and_weighted_by_its_trip_count() -> None:
    unrolled = GPT_TINY
    stacked = dataclasses.replace(GPT_TINY, scan_layers=True, num_layers=GPT_TINY.num_layers)

    def graph(cfg):
        p, b = gpt_abstract_params(cfg), gpt_abstract_batch(cfg, 8)
        return graph_of(jax.value_and_grad(gpt_loss), p, b)

    g_unrolled, g_scan = graph(unrolled), graph(stacked)
    # The two programs differ slightly (gradient accumulation, slicing), not by a layer.
    assert g_scan.total_flops == pytest.approx(g_unrolled.total_flops, rel=1e-2)
    unweighted = sum(n.flops for n in g_scan.nodes)
    assert unweighted < 0.75 * g_scan.total_flops  # the weight is what makes them agree
    body = [n for n in g_scan.nodes if n.multiplier == stacked.num_layers]
    assert body and all(n.path[0] in {m.path[0] for m in body} for n in body)
    assert len(g_scan.nodes) < len(g_unrolled.nodes)
    kinds = {n.kind for n in g_scan.nodes}
    assert {"unstack", "stack", "identity"} <= kinds


def test_while_and_cond_are_one_opaque_node_with_their_bodies_flops() -> None:
    def f(x):
        y = jax.lax.cond(x.sum() > 0, lambda v: v @ v, lambda v: v, x)
        return jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] @ s[1]), (0, y))[1]

    g = graph_of(f, jnp.ones((4, 4)))
    opaque = {n.primitive: n for n in g.nodes if n.kind == "opaque"}
    assert set(opaque) == {"cond", "while"}
    assert opaque["cond"].flops >= 2 * 4 * 4 * 4


def test_unknown_primitive_runs_replicated_with_one_warning(caplog) -> None:
    g = graph_of(lambda x: jnp.fft.fft(x).real, jnp.ones((8, 8)))
    node = next(n for n in g.nodes if n.primitive == "fft")
    assert loop_nest(node, g) is None
    cost = CostModel(CPU, CPU.logical_mesh((8,)))
    strategies = node_strategies(node, g, cost)
    assert [s.name for s in strategies] == ["replicated"]
    from alpa_mini.shard.problem import build_sharding_problem

    with caplog.at_level(logging.WARNING, logger="alpa_mini.shard.problem"):
        build_sharding_problem(g, cost)
        build_sharding_problem(g, cost)
    hits = [r for r in caplog.records if "'fft'" in r.getMessage()]
    assert len(hits) <= 1  # once per process (an earlier test may have warned already)


def test_dot_strategies_on_a_2d_mesh_price_partial_sums_with_all_reduce() -> None:
    g = graph_of(lambda a, b: a @ b, jnp.ones((64, 32)), jnp.ones((32, 16)))
    cost = CostModel(CPU, CPU.logical_mesh((2, 4)))
    strategies = node_strategies(g.nodes[0], g, cost)
    by_name = {s.name: s for s in strategies}
    # contracting loop (index 2) split over axis 1 (4 devices): all-reduce of the 64x16 output
    s = by_name["L2=1 AR(1)"]
    link = CPU.intra_host
    expected = link.alpha + 2 * link.beta * 3 / 4 * 64 * 16 * 4
    assert s.comm == pytest.approx(expected, rel=1e-12)
    assert s.in_specs == (ShardingSpec(((), (1,))), ShardingSpec(((1,), ())))
    # every strategy's layouts divide the shapes they split
    assert all(
        sp.fits(g.tensors[t].shape, (2, 4))
        for st in strategies
        for sp, t in zip(st.in_specs, g.nodes[0].inputs, strict=True)
    )


def test_reshard_costs_follow_the_alpha_beta_forms() -> None:
    cost = CostModel(CPU, CPU.logical_mesh((8,)))
    link, shape, n = CPU.intra_host, (64, 32), 8
    full = 64 * 32 * 4
    split0, split1, rep = (ShardingSpec(d) for d in (((0,), ()), ((), (0,)), ((), ())))
    assert cost.reshard(shape, 4, split0, rep) == pytest.approx(
        link.alpha + link.beta * (n - 1) / n * full
    )
    assert cost.reshard(shape, 4, split0, split1) == pytest.approx(
        link.alpha + link.beta * (n - 1) / (2 * n) * full / n
    )
    assert cost.reshard(shape, 4, rep, split1) == 0.0


def test_a_carried_cost_model_keeps_only_shape_free_entries_and_prices_alike() -> None:
    """``CostModel.carried``: what another micro-batch count's stage models start from."""
    from alpa_mini.shard.spec import enumerate_specs

    cost = CostModel(CPU, CPU.logical_mesh((2, 4)))
    specs = list(enumerate_specs((64, 32), (2, 4)))
    cost.reshard_table((64, 32), 4, specs, specs)
    cost.reshard((64, 32), 4, specs[1], specs[2])
    carried = cost.carried()
    assert carried.mesh == cost.mesh and not carried.op_strategies
    assert {k[0] for k in carried._reshard_cache} == {"terms", "group"}
    for shape in ((64, 32), (16, 32)):  # another micro-batch size: the same steps, new bytes
        fresh = CostModel(CPU, CPU.logical_mesh((2, 4))).reshard_table(shape, 4, specs, specs)
        np.testing.assert_array_equal(carried.reshard_table(shape, 4, specs, specs), fresh)


def test_reshape_keeps_a_split_on_the_major_dimension_only() -> None:
    g = graph_of(lambda x: x.reshape(8, 4, 16), jnp.ones((32, 16)))
    nest = loop_nest(g.nodes[0], g)
    # input dim 0 (32) splits into output dims (8, 4): it follows the major one
    assert nest.operands[0] == (0, 2)
    assert nest.outputs[0] == (0, 1, 2)


def test_closed_over_constants_become_const_tensors_without_edges() -> None:
    c = jnp.arange(4.0) + 1.0  # a concrete array closed over: a constant of the jaxpr
    closed = jax.make_jaxpr(lambda x: x * c)(jnp.ones(4))
    assert len(closed.consts) == 1
    g = trace_jaxpr(closed, ["batch"])
    consts = [t for t in g.tensors if t.role == "const"]
    assert len(consts) == 1 and consts[0].shape == (4,)
