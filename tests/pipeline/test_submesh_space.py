"""The default submesh space ("divisors") end to end: on a host count that is no power of two
the stage DP may take a stage over every host, and that plan trains as serial JAX does."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import AutoLayerOption, AutoStageOption, ClusterSpec, PipeshardParallel
from alpa_mini.models import make_train_step, sgd
from helpers.mlp import marked_mlp_args, marked_mlp_loss

#: Three hosts of two CPU devices (six of the eight test devices).
THREE_HOSTS = dataclasses.replace(ClusterSpec.named("cpu-2x4"), num_hosts=3, devices_per_host=2)


@pytest.fixture
def three_hosts():
    alpa_mini.shutdown()
    alpa_mini.init(cluster=THREE_HOSTS)
    yield
    alpa_mini.shutdown()


def _method(space: str) -> PipeshardParallel:
    return PipeshardParallel(
        num_micro_batches=1,
        layer_option=AutoLayerOption(layer_num=2),
        stage_option=AutoStageOption(submesh_space=space),
    )


def test_one_micro_batch_takes_one_stage_over_all_three_hosts(three_hosts):
    """With one micro-batch nothing overlaps, so stages only add their hand-offs: the DP puts
    the step on all six devices at once, a (3, 2) submesh that only the divisors of the host
    count offer. Alpa's power-of-two space has 1 and 2 hosts alone, so it must slice. SGD
    steps of the three-host plan match serial JAX to 1e-6."""
    params, data = marked_mlp_args(4, 16, 24)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    serial = jax.jit(make_train_step(marked_mlp_loss, opt))
    pstep = alpa_mini.parallelize(step, method=_method("divisors"))
    p_par = p_ser = params
    s_par = s_ser = opt.init(params)
    for _ in range(3):
        p_par, s_par, l_par = pstep(p_par, s_par, data)
        p_ser, s_ser, l_ser = serial(p_ser, s_ser, data)
        np.testing.assert_allclose(float(l_par), float(l_ser), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_par), jax.tree.leaves(p_ser), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    plan = pstep.get_executable(params, opt.init(params), data).plan
    assert [st.submesh for st in plan.stages] == [(3, 2)]
    assert (3, 2) in plan.stage_problem.submesh_shapes

    alike = alpa_mini.parallelize(step, method=_method("power_of_two"))
    other = alike.get_executable(params, opt.init(params), data).plan
    assert len(other.stages) > 1 and (3, 2) not in other.stage_problem.submesh_shapes
    assert sorted(st.submesh[0] for st in other.stages) == [1, 2]
