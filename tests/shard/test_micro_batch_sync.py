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
