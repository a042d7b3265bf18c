"""Donation under PipeshardParallel: the apply programs consume donated parameters and
optimiser state, so a step holds one copy of them, not two."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import alpa_mini
from alpa_mini import ClusterSpec, ManualLayerOption, PipeshardParallel, UniformStageOption
from alpa_mini.models import adam, make_train_step
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def _live_bytes() -> int:
    return sum(a.nbytes for a in jax.live_arrays())


def _two_steps(donate):
    """Two steps holding the first step's outputs while the second runs: the second step's
    inputs (were they donated?), how many live device bytes it added, and its outputs."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    params, batch = marked_mlp_args(4, 128, 64)
    opt = adam(1e-3)
    method = PipeshardParallel(
        num_micro_batches=4,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(2, (1, 4)),
    )
    step = alpa_mini.parallelize(
        make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad),
        method=method,
        donate_argnums=donate,
    )
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        p, s, _ = step(jax.tree.map(jnp.copy, params), opt.init(params), batch)
    with warnings.catch_warnings(record=True) as second:
        warnings.simplefilter("always")
        jax.block_until_ready((p, s))
        before = _live_bytes()
        out = step(p, s, batch)
        jax.block_until_ready(out)
        added = _live_bytes() - before
    inputs = jax.tree.leaves((p, s))
    return inputs, added, out, first, second


def test_donated_state_is_consumed_and_a_step_holds_one_copy():
    kept, live_kept, out_kept, _, _ = _two_steps(())
    donated, live_donated, out_donated, first, second = _two_steps("auto")
    big = [x for x in kept if x.size > 1]  # parameters, mu and nu (not the step count)
    assert not any(x.is_deleted() for x in kept)
    assert all(x.is_deleted() for x in donated if x.size > 1)
    state_bytes = sum(x.nbytes for x in big)
    # Without donation the old and the new state are alive together after the step.
    assert live_kept >= state_bytes
    assert live_kept - live_donated >= state_bytes
    for a, b in zip(jax.tree.leaves(out_kept), jax.tree.leaves(out_donated), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # The first call's inputs were in no planned layout: copied once, with one warning;
    # the second call's inputs are the first's outputs, donated in place, silently.
    assert len([w for w in first if "donated argument leaves" in str(w.message)]) == 1
    assert not [w for w in second if "donated argument leaves" in str(w.message)]
