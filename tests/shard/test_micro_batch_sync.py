"""ShardParallel(num_micro_batches=B): gradient reductions run once per step, after the
micro-batch loop, not in every iteration (``shard/deferred.py``); read from the compiled
HLO, with numerics equal to serial JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import ShardParallel
from alpa_mini.inspect.hlo_collectives import parse_collectives
from helpers.mlp import marked_mlp_args, train_beside_serial

REDUCTIONS = ("all-reduce", "reduce-scatter")


def _mlp_loss(params, batch):
    x = batch["x"]
    for w, b in params:
        x = jnp.tanh(x @ w + b)
    return jnp.mean((x - batch["y"]) ** 2)


def _scanned_loss(params, batch):
    """A scanned layer stack: the transposed scan accumulates the stacked weights' and the
    shared head's gradients inside the micro-batch loop."""
    stacked, head = params

    def body(x, w):
        return jnp.tanh(x @ w) + 0.1 * (x @ head), None

    x, _ = jax.lax.scan(body, batch["x"], stacked)
    return jnp.mean((x - batch["y"]) ** 2)


def _args(kind: str):
    ws, batch = marked_mlp_args(3, 64, 128)
    if kind == "mlp":
        return _mlp_loss, [(w, jnp.full((64,), 0.01)) for w in ws], batch
    return _scanned_loss, (jnp.stack(ws), ws[0] * 0.5), batch


def _run(loss, params, batch, method):
    ex = train_beside_serial(loss, params, batch, method)
    return parse_collectives(ex.get_hlo_text())


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("mlp", "data"),
        pytest.param("mlp", "zero3", marks=pytest.mark.slow),
        pytest.param("scan", "data", marks=pytest.mark.slow),
    ],
)
def test_gradients_are_reduced_after_the_micro_batch_loop(kind, layout):
    loss, params, batch = _args(kind)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    alpa_mini.init(cluster="cpu-1x8", num_cpu_devices=8)
    for B in (1, 4):
        colls = _run(loss, params, batch, ShardParallel(num_micro_batches=B, layout=layout))
    # B = 4: nothing is reduced inside the loop, and each gradient at most once per step (the
    # loss's 4 bytes besides). Before, every iteration all-reduced every gradient.
    reductions = [c for c in colls if c.kind in REDUCTIONS]
    assert not [c for c in reductions if c.in_loop], reductions
    assert sum(c.bytes for c in reductions) <= grad_bytes + 4, reductions


def test_an_output_moves_into_its_layout_as_often_as_its_producer_reduces():
    """An output's move into its returned (or aliased) layout runs once per run of the graph,
    less only where its producer's collectives run less often: a pipeshard stage's gradient,
    reduced once per B micro-batches (comm_scale 1/B), moves once per step; a deferred loop
    body (multiplier L, comm_scale 1/L) or an undeferred one (multiplier L) hands over once."""
    import dataclasses

    from alpa_mini.graph.tracing import trace_jaxpr
    from alpa_mini.shard.problem import _output_weight

    closed = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    graph = trace_jaxpr(closed, ["param", "batch"], ["w", "x"])
    last = len(graph.inputs) + len(graph.nodes) - 1

    def weight(multiplier: float, comm_scale: float) -> float:
        node = dataclasses.replace(graph.nodes[-1], multiplier=multiplier, comm_scale=comm_scale)
        nodes = (*graph.nodes[:-1], node)
        return _output_weight(dataclasses.replace(graph, nodes=nodes), last)

    assert weight(1, 1.0) == 1.0 and weight(1, 0.25) == 0.25
    assert weight(4, 0.25) == 1.0 and weight(4, 1.0) == 1.0
    assert _output_weight(graph, 0) == 1.0  # an input returned as it is
