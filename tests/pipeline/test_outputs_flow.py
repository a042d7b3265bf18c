"""A pipeshard step's outputs live on several submeshes; they flow on into other parallelized
functions as they are, and ``alpa_mini.gather`` lays them out on one mesh for plain JAX."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import alpa_mini
from alpa_mini import (
    ClusterSpec,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd
from helpers.mlp import marked_mlp_args, marked_mlp_loss


@pytest.fixture
def trained():
    """One pipeshard step (two stages of 4 devices) beside the same step in serial JAX."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    params, batch = marked_mlp_args(4, 16, 32)
    opt = sgd(0.1)
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=ManualLayerOption(), stage_option=UniformStageOption(2)
    )
    step = alpa_mini.parallelize(
        make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad), method=method
    )
    got, _, _ = step(params, opt.init(params), batch)
    want, _, _ = jax.jit(make_train_step(marked_mlp_loss, opt))(params, opt.init(params), batch)
    yield got, want, batch
    alpa_mini.shutdown()


def _eval(params, batch):
    return marked_mlp_loss(params, batch)


def test_outputs_live_on_their_stages_and_feed_a_parallelized_eval_step(trained) -> None:
    got, want, batch = trained
    homes = {frozenset(d.id for d in w.sharding.device_set) for w in got}
    assert homes == {frozenset(range(4)), frozenset(range(4, 8))}
    evaluate = alpa_mini.parallelize(_eval, method=ShardParallel(mesh_shape=(8,)))
    np.testing.assert_allclose(float(evaluate(got, batch)), float(_eval(want, batch)), rtol=1e-6)


def test_gather_lays_outputs_out_on_one_mesh_for_plain_jit(trained) -> None:
    got, want, batch = trained
    gathered = alpa_mini.gather(got)
    for w in gathered:
        assert {d.id for d in w.sharding.device_set} == set(range(8))
        assert w.sharding.is_fully_replicated
    np.testing.assert_allclose(
        float(jax.jit(_eval)(gathered, batch)), float(_eval(want, batch)), rtol=1e-6
    )
    for a, b in zip(gathered, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    two = NamedSharding(Mesh(np.array(jax.devices()[:2]), ("d",)), PartitionSpec("d"))
    on_two = alpa_mini.gather(got, two)
    assert all({d.id for d in w.sharding.device_set} == {0, 1} for w in on_two)
    with pytest.raises(TypeError, match=r"sharding: str is not a jax\.sharding\.Sharding"):
        alpa_mini.gather(got, "replicated")
