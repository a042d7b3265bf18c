"""ShardParallel plans an unrolled stack of repeated layers with alike ILP nodes tied to one
choice (as a scanned stack is planned): a far smaller ILP, a plan as good as the untied
one, numerics equal to serial JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import ShardParallel
from alpa_mini.shard import problem as shard_problem
from helpers.mlp import train_beside_serial


def _deep_mlp_loss(params, batch):
    x = batch["x"]
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean((x - batch["y"]) ** 2)


def _args(layers: int = 16, width: int = 64, rows: int = 64):
    k = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [jax.random.normal(k[i], (width, width)) * 0.2 for i in range(layers)]
    return params, {
        "x": jax.random.normal(k[-2], (rows, width)),
        "y": jax.random.normal(k[-1], (rows, width)),
    }


@pytest.mark.slow  # 3.5 s: full suite
def test_an_unrolled_stack_is_planned_tied_as_well_as_untied(devices8, monkeypatch) -> None:
    from alpa_mini.models import make_train_step, sgd

    params, batch = _args()
    opt = sgd(0.1)
    step = make_train_step(_deep_mlp_loss, opt)
    args = (params, opt.init(params), batch)
    method = ShardParallel(mesh_shape=(2, 4))
    tied = alpa_mini.plan(step, *args, method=method)
    nodes, groups = tied.solver["tied"]
    assert 2 * groups <= nodes  # sixteen alike layers: tied to at most half the nodes
    monkeypatch.setattr(shard_problem, "_solve_tied", lambda *a: None)
    untied = alpa_mini.plan(step, *args, method=method)
    assert untied.solver["tied"] is None and untied.solver["status"] == "optimal"
    assert tied.predicted_time == pytest.approx(untied.predicted_time, rel=1e-9)
    monkeypatch.undo()
    train_beside_serial(_deep_mlp_loss, params, batch, method)
