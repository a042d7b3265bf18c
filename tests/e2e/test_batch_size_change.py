"""A new batch size reuses the plan when only the batch rows changed and the plan's layouts
still divide them; otherwise it plans again and says why, once."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    ClusterSpec,
    ConfigError,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd
from helpers.mlp import marked_mlp_args, marked_mlp_loss


def _no_planning(*args, **kwargs):
    raise AssertionError("a new batch size that fits the plan must not be planned again")


def _check(step, params, opt, rows: int) -> None:
    _, batch = marked_mlp_args(4, 16, rows)
    serial = jax.jit(make_train_step(marked_mlp_loss, opt))
    got = step(params, opt.init(params), batch)
    want = serial(params, opt.init(params), batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["shard", "pipeshard"])
def test_new_batch_rows_reuse_the_plan_or_replan_once_with_the_reason(kind, monkeypatch) -> None:
    from alpa_mini.pipeline import executable
    from alpa_mini.shard import search

    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    if kind == "shard":
        method = ShardParallel(mesh_shape=(8,), layout="data")
        planner, name = search, "_plan_on"
    else:
        method = PipeshardParallel(
            num_micro_batches=2,
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(2),
        )
        planner, name = executable, "_plan"
    params, _ = marked_mlp_args(4, 16, 32)
    opt = sgd(0.1)
    step = alpa_mini.parallelize(
        make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad), method=method
    )
    _check(step, params, opt, 32)
    planned = getattr(planner, name)
    monkeypatch.setattr(planner, name, _no_planning)
    _check(step, params, opt, 64)  # same layouts, twice the rows
    monkeypatch.setattr(planner, name, planned)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _check(step, params, opt, 36)  # 36 rows (18 per micro-batch) split neither 8 nor 4 ways
        except ConfigError:
            assert kind == "shard"  # and the data-parallel layout cannot be planned for them
        if kind == "pipeshard":
            _check(step, params, opt, 44)  # planned again too, without a second warning
    replans = [str(w.message) for w in seen if "planning again" in str(w.message)]
    assert len(replans) == 1 and "divide" in replans[0], replans
    alpa_mini.shutdown()
