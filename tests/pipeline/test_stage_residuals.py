"""A stage's residuals (``StageCost.residual_bytes``): what its forward keeps for its backward
per micro-batch in flight. Parameters the backward reads are held once, not per micro-batch,
as the runtime passes them to the backward as inputs (``lower.compile``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import alpa_mini
from alpa_mini import ClusterSpec, PipeshardParallel, UniformStageOption
from alpa_mini.models import make_train_step, sgd
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def _kept(w, x) -> list:
    """The leaves of ``jax.vjp``'s closure for one layer, and whether each is the weight."""
    kept = []

    def layer(w, x):
        out, vjp = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
        kept.extend((leaf.size * leaf.dtype.itemsize, leaf is w) for leaf in jax.tree.leaves(vjp))
        return out

    jax.eval_shape(layer, w, x)
    return kept


def test_a_layers_residuals_are_what_its_backward_reads_less_its_weight():
    """The middle of three one-layer stages, tanh(x @ w) with x the first stage's output:
    its backward reads x (for w's gradient), w (for x's) and what tanh keeps. Per
    micro-batch (16 rows of width 24) all of it but the 24 x 24 weight is held; the weight
    is the stage's parameter, held once."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    params, data = marked_mlp_args(3, width=24, batch=32)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(
        num_micro_batches=2, stage_option=UniformStageOption(3, (1, 1), (1, 1))
    )
    plan = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    middle = plan.stages[1]
    assert (middle.layer_start, middle.layer_end) == (1, 1)
    kept = _kept(params[1], data["x"][:16])
    assert (24 * 24 * 4, True) in kept
    assert middle.residual_bytes == sum(n for n, weight in kept if not weight)
    assert middle.residual_bytes >= 2 * 16 * 24 * 4  # x and tanh's output at least
    alpa_mini.shutdown()
