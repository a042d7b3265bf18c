"""ShardParallel against closed forms and the compiled HLO (Alpa's own test idea).

Costs come from the cluster's alpha-beta links: an all-reduce of B bytes over n devices
costs alpha + 2 beta (n - 1) / n B. Each case derives the expected plan by hand and checks
the ILP's choice, its predicted communication and the collectives XLA really emitted.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import MemoryBudgetError, ShardParallel
from helpers.mlp import all_reduce, mlp_forward, mlp_inputs, sgd_step


def specs(ex) -> dict[str, tuple]:
    return {ex.plan.tensors[t].name: tuple(ex.plan.partition_spec(t)) for t in ex.plan.inputs}


def assert_matches_serial(step, serial, args, steps: int = 3) -> None:
    p, ps = args[0], args[0]
    for _ in range(steps):
        p, loss = step(p, *args[1:])
        ps, loss_s = serial(ps, *args[1:])
        np.testing.assert_allclose(loss, loss_s, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ps), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_data_parallel_closed_form_batch_much_larger_than_hidden(devices4) -> None:
    batch, hidden, n = 1024, 16, 4
    args = mlp_inputs(batch, hidden)
    step = alpa_mini.parallelize(
        sgd_step, method=ShardParallel(mesh_shape=(4,)), batch_argnums=(1, 2)
    )
    ex = step.get_executable(*args)
    assert specs(ex) == {
        "[0]['w1']": (),
        "[0]['w2']": (),
        "[1]": ("x",),
        "[2]": ("x",),
    }
    # Communication: one all-reduce per gradient (hidden^2 fp32) plus the loss's scalar sum.
    grad_bytes = hidden * hidden * 4
    expected = 2 * all_reduce(grad_bytes, n) + all_reduce(4, n)
    assert ex.plan.comm_time == pytest.approx(expected, rel=1e-12)
    assert ex.plan.reshard_time == 0.0
    assert ex.plan.solver["objective"] == pytest.approx(ex.plan.predicted_time, rel=1e-9)
    # The compiled HLO: all-reduces only, for exactly the two gradients and the loss.
    report = ex.collectives()
    assert report.counts() == {"all-reduce": (3, 3)}
    assert report.hlo["all-reduce"].bytes == 2 * grad_bytes + 4
    assert_matches_serial(step, jax.jit(sgd_step), args)


def test_two_d_mesh_data_parallel_closed_form(devices8) -> None:
    """On a (2, 4) mesh the batch splits over both axes; each all-reduce spans all 8 devices."""
    batch, hidden = 1024, 16
    args = mlp_inputs(batch, hidden)
    step = alpa_mini.parallelize(
        sgd_step, method=ShardParallel(mesh_shape=(2, 4)), batch_argnums=(1, 2)
    )
    ex = step.get_executable(*args)
    assert specs(ex)["[1]"] == (("x", "y"),)
    assert specs(ex)["[0]['w1']"] == ()
    expected = 2 * all_reduce(hidden * hidden * 4, 8) + all_reduce(4, 8)
    assert ex.plan.comm_time == pytest.approx(expected, rel=1e-12)
    report = ex.collectives()
    assert report.counts() == {"all-reduce": (3, 3)}
    from alpa_mini.inspect.hlo_collectives import parse_collectives

    groups = {c.group_size for c in parse_collectives(ex.get_hlo_text())}
    assert groups == {8}
    assert_matches_serial(step, jax.jit(sgd_step), args)


def test_megatron_forward_closed_form_when_parameters_cannot_be_replicated(devices4) -> None:
    """hidden >> batch, a budget below the replicated weights and a replicated result:
    column-then-row split, one all-reduce of batch x hidden fp32 for the two-layer block
    ((layers - 1) = 1). (With the result's layout free, gathering the hidden activations and
    splitting both weights by columns is cheaper: an all-gather moves half an all-reduce.)"""
    batch, hidden, n = 8, 512, 4
    p, x, _ = mlp_inputs(batch, hidden)
    weights = 2 * hidden * hidden * 4
    budget = 0.6 * weights  # one replicated weight plus a quarter of the other does not fit
    step = alpa_mini.parallelize(
        mlp_forward,
        method=ShardParallel(mesh_shape=(4,), memory_budget=budget, replicate_outputs=True),
    )
    ex = step.get_executable(p, x)
    w1, w2 = specs(ex)["[0]['w1']"], specs(ex)["[0]['w2']"]
    # Megatron's pair: one weight split by columns, the other by rows (in either order).
    assert (w1, w2) == ((None, "x"), ("x",))
    assert ex.plan.comm_time + ex.plan.reshard_time == pytest.approx(
        all_reduce(batch * hidden * 4, n), rel=1e-12
    )
    assert ex.plan.peak_memory <= budget
    report = ex.collectives()
    assert report.counts() == {"all-reduce": (1, 1)}
    assert report.hlo["all-reduce"].bytes == batch * hidden * 4
    np.testing.assert_allclose(step(p, x), jax.jit(mlp_forward)(p, x), rtol=1e-5, atol=1e-5)


def test_megatron_train_step_shards_weights_and_beats_data_parallel(devices4) -> None:
    batch, hidden, n = 8, 512, 4
    args = mlp_inputs(batch, hidden)
    step = alpa_mini.parallelize(
        sgd_step, method=ShardParallel(mesh_shape=(4,)), batch_argnums=(1, 2)
    )
    ex = step.get_executable(*args)
    w = specs(ex)
    assert w["[0]['w1']"] != () and w["[0]['w2']"] != ()
    data_parallel = 2 * all_reduce(hidden * hidden * 4, n)
    assert ex.plan.comm_time + ex.plan.reshard_time < data_parallel / 10
    assert ex.collectives().counts() == {
        k: (c, c) for k, (c, _) in ex.collectives().counts().items()
    }
    assert_matches_serial(step, jax.jit(sgd_step), args)


def test_impossible_budget_names_the_minimum_and_the_minimum_is_feasible(devices4) -> None:
    p, x, _ = mlp_inputs(8, 256)
    tiny = 1024.0
    step = alpa_mini.parallelize(
        mlp_forward, method=ShardParallel(mesh_shape=(4,), memory_budget=tiny)
    )
    with pytest.raises(MemoryBudgetError, match="smallest peak found") as info:
        step.get_executable(p, x)
    minimum = info.value.min_budget
    assert minimum is not None and minimum > tiny
    # Fully sharded weights are the floor: at least the weights split over 4 devices.
    assert minimum >= 2 * 256 * 256 * 4 / 4
    ok = alpa_mini.parallelize(
        mlp_forward, method=ShardParallel(mesh_shape=(4,), memory_budget=minimum * 1.0001)
    )
    ex = ok.get_executable(p, x)
    assert ex.plan.peak_memory <= minimum * 1.0001


def test_plan_json_round_trip(devices4) -> None:
    args = mlp_inputs(64, 32)
    ex = alpa_mini.parallelize(sgd_step, method=ShardParallel(mesh_shape=(4,))).get_executable(
        *args
    )
    again = alpa_mini.ShardingPlan.from_json(ex.plan.to_json())
    assert again == ex.plan


def test_a_saved_plan_replays_without_planning_and_refuses_another_step(
    devices4, tmp_path, monkeypatch
) -> None:
    from alpa_mini import ConfigError
    from alpa_mini.shard import search

    args = mlp_inputs(64, 32)
    planned = alpa_mini.parallelize(sgd_step, method=ShardParallel(mesh_shape=(4,)))
    ex = planned.get_executable(*args)
    path = tmp_path / "plan.json"
    path.write_text(ex.plan.to_json())

    def no_planning(*a, **k):
        raise AssertionError("a replayed plan must not be planned again")

    monkeypatch.setattr(search, "_plan_on", no_planning)
    for saved in (ex.plan.to_json(), path, str(path)):
        replay = alpa_mini.parallelize(sgd_step, method=ShardParallel.from_plan(saved))
        assert replay.get_executable(*args).plan == ex.plan
        want, got = planned(*args), replay(*args)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    other = alpa_mini.parallelize(sgd_step, method=ShardParallel.from_plan(path))
    with pytest.raises(ConfigError, match=r"plan: made for another step: .*tensor"):
        other.get_executable(*mlp_inputs(64, 16))
    with pytest.raises(ConfigError, match=r"plan: 'nowhere\.json' is neither plan JSON nor a file"):
        ShardParallel.from_plan("nowhere.json")


def test_donated_inputs_outside_the_layout_are_copied_with_one_warning(devices4) -> None:
    import warnings

    args = mlp_inputs(64, 32)  # arrays on one device: not the plan's layout
    step = alpa_mini.parallelize(
        sgd_step, method=ShardParallel(mesh_shape=(4,)), donate_argnums=(0,)
    )
    with pytest.warns(UserWarning, match=r"donated argument leaves \[0, 1\] are not in their"):
        p, _ = step(*args)
    assert not any(x.is_deleted() for x in jax.tree.leaves(args[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(p, *args[1:])
    assert all(x.is_deleted() for x in jax.tree.leaves(p))


@pytest.mark.parametrize("mesh", [(8,), pytest.param((2, 4), marks=pytest.mark.slow)])
def test_gpt_collectives_in_hlo_equal_the_plans_prediction(devices8, mesh) -> None:
    from alpa_mini.models import GPT_TINY, gpt_loss, init_gpt, make_gpt_batch, make_train_step, sgd

    opt = sgd(0.1)
    step = make_train_step(gpt_loss, opt)
    params = init_gpt(GPT_TINY, jax.random.PRNGKey(0))
    batch = make_gpt_batch(GPT_TINY, jax.random.PRNGKey(1), 8)
    ex = alpa_mini.parallelize(step, method=ShardParallel(mesh_shape=mesh)).get_executable(
        params, opt.init(params), batch
    )
    counts = ex.collectives().counts()
    assert counts, "a sharded GPT step communicates"
    assert {k: c[0] for k, c in counts.items()} == {k: c[1] for k, c in counts.items()}
    assert ex.collectives().byte_ratio() == pytest.approx(1.0)


def _dead_cosine_loss(p, x, y):
    import jax.numpy as jnp

    h = jnp.tanh(x @ p["w1"])
    jnp.cos(h) * 3.0  # dead
    return jnp.mean((h @ p["w2"] - y) ** 2)


def _dead_cosine_step(p, x, y):
    value, g = alpa_mini.value_and_grad(_dead_cosine_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value


@jax.jit
def _dead_cosine_serial(p, x, y):
    value, g = jax.value_and_grad(_dead_cosine_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), value


@pytest.mark.parametrize("B", [1, 2])
def test_dead_code_in_the_step_is_neither_priced_nor_run(devices4, B: int) -> None:
    """The loss computes a cosine it never reads: XLA drops it, so the ILP does not price
    it, and the step (its micro-batch loop too) still equals serial JAX."""
    args = mlp_inputs(16, 8)
    method = ShardParallel(mesh_shape=(4,), num_micro_batches=B)
    pstep = alpa_mini.parallelize(_dead_cosine_step, method=method, batch_argnums=(1, 2))
    graph = pstep._trace(pstep._prepare(args)).graph
    ops = {n.primitive for n in graph.nodes}
    assert "tanh" in ops and "cos" not in ops
    assert_matches_serial(pstep, _dead_cosine_serial, args)


def test_a_plan_saved_with_the_dead_code_still_replays(devices4, monkeypatch) -> None:
    """A plan saved before dead code was dropped names its operators too: it is replayed on
    the whole jaxpr, and equals serial JAX."""
    from alpa_mini import api

    args = mlp_inputs(16, 8)
    with monkeypatch.context() as m:
        m.setattr(api, "without_dead_code", lambda closed: closed)
        old = alpa_mini.parallelize(
            _dead_cosine_step, method=ShardParallel(mesh_shape=(4,)), batch_argnums=(1, 2)
        )
        saved = old.get_executable(*args).plan.to_json()
    assert '"cos"' in saved
    method = ShardParallel.from_plan(saved)
    again = alpa_mini.parallelize(_dead_cosine_step, method=method, batch_argnums=(1, 2))
    replayed = json.loads(again.get_executable(*args).plan.to_json())
    assert {k: v for k, v in replayed.items() if k != "planning"} == {
        k: v for k, v in json.loads(saved).items() if k != "planning"
    }
    assert_matches_serial(again, _dead_cosine_serial, args)
