"""``lower/roll.py``: repeated micro-batch work inside a fused program runs as one loop with
the values the unrolled ops compute; ops that do not repeat uniformly stay unrolled."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alpa_mini import ManualLayerOption, PipeshardParallel, ShardParallel, UniformStageOption
from alpa_mini.pipeline.lower.fuse import _Op
from alpa_mini.pipeline.lower.roll import find_loops, run_ops
from helpers.mlp import marked_mlp_args, marked_mlp_loss, train_beside_serial


def _one_stage_1f1b(B: int) -> tuple[list[_Op], list[int]]:
    """The ops of a fused one-stage 1F1B step: inputs x_m are slots 0..B-1, the parameter
    slot B; fwd(x, w) -> (loss, res); bwd(res, x, acc) -> (acc,); acc: loss sums."""
    w = B
    ops: list[_Op] = []
    nxt = B + 1

    def new() -> int:
        nonlocal nxt
        nxt += 1
        return nxt - 1

    loss, res = new(), new()
    ops.append(_Op("fwd", (0, w), (loss, res)))
    acc = new()
    ops.append(_Op("bwd.0", (res, 0), (acc,)))
    total = loss
    for m in range(1, B):
        loss, res_m = new(), new()
        ops.append(_Op("fwd", (m, w), (loss, res_m)))
        acc2 = new()
        ops.append(_Op("bwd", (res_m, m, acc), (acc2,)))
        t2 = new()
        ops.append(_Op(None, (loss, total), (t2,)))
        acc, total = acc2, t2
    return ops, [acc, total]


def _gpipe(B: int) -> tuple[list[_Op], list[int]]:
    """All forwards, then all backwards: each backward reads its forward's residual."""
    w = B
    ops, res, slot = [], [], B + 1
    for m in range(B):
        ops.append(_Op("gfwd", (m, w), (slot,)))
        res.append(slot)
        slot += 1
    acc = None
    for m in range(B):
        ins = (res[m], m) if acc is None else (res[m], m, acc)
        ops.append(_Op("bwd" if acc is not None else "bwd.0", ins, (slot,)))
        acc, slot = slot, slot + 1
    return ops, [acc]


_FNS = {
    "fwd": lambda x, w: [jnp.sum(jnp.tanh(x @ w)), jnp.tanh(x @ w)],
    "gfwd": lambda x, w: [jnp.tanh(x @ w)],
    "bwd.0": lambda r, x: [x.T @ (1 - r**2)],
    "bwd": lambda r, x, acc: [acc + x.T @ (1 - r**2)],
}


def _call(op, args):
    if op.program is None:
        return [args[1] + args[0]]
    return _FNS[op.program](*args)


def _evaluate(ops, returned, loops, B):
    k = jax.random.split(jax.random.PRNGKey(0), B + 1)
    inputs = [jax.random.normal(k[m], (4, 3)) for m in range(B)] + [jax.random.normal(k[B], (3, 5))]

    def run(*args):
        env = dict(enumerate(args))
        run_ops(ops, loops, env, _call)
        return [env[s] for s in returned]

    return jax.jit(run)(*inputs), jax.make_jaxpr(run)(*inputs)


@pytest.mark.parametrize("B", [4, 8])
def test_one_stage_1f1b_rolls_into_one_loop_with_the_same_values(B):
    ops, returned = _one_stage_1f1b(B)
    loops = find_loops(ops, returned)
    # fwd(0) bwd.0(0) | [fwd(m) bwd(m) acc] for m = 1..B-1
    assert [(lp.start, lp.width, lp.reps) for lp in loops] == [(2, 3, B - 1)]
    (loop,) = loops
    assert len(loop.xs) == 2  # the micro-batch inputs (read by fwd and bwd), stacked
    assert {rel for rel, _ in loop.carry} == {(1, 0), (2, 0)}  # accumulators
    rolled, jaxpr = _evaluate(ops, returned, loops, B)
    unrolled, plain = _evaluate(ops, returned, [], B)
    for a, b in zip(rolled, unrolled, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "scan" in str(jaxpr) and "scan" not in str(plain)


def test_gpipe_rolls_forwards_and_backwards_apart():
    ops, returned = _gpipe(6)
    loops = find_loops(ops, returned)
    assert [(lp.start, lp.width, lp.reps) for lp in loops] == [(0, 1, 6), (7, 1, 5)]
    assert loops[0].ys == ((0, 0),)  # every forward's residual is read by a later backward
    rolled, _ = _evaluate(ops, returned, loops, 6)
    unrolled, _ = _evaluate(ops, returned, [], 6)
    np.testing.assert_allclose(rolled[0], unrolled[0], rtol=1e-6, atol=1e-6)


def test_values_read_two_iterations_later_are_not_rolled():
    # op m reads op m-2's output: no uniform one-iteration carry exists for width 1.
    ops = [_Op("f", (0,), (1,)), _Op("f", (0,), (2,))]
    for m in range(2, 6):
        ops.append(_Op("f", (m - 1,), (m + 1,)))
    assert all(lp.width != 1 for lp in find_loops(ops, [6]))


def test_too_few_repeats_stay_unrolled():
    ops, returned = _one_stage_1f1b(3)
    assert find_loops(ops, returned, min_reps=3) == []  # B - 1 = 2 iterations


def test_one_stage_step_runs_its_micro_batches_as_a_loop(devices4):
    """The fused one-stage program of B = 6 holds one while loop of B - 1 iterations, its
    per-step collectives count the loop's loss all-reduce once per iteration, and the
    numerics equal serial JAX (SGD, 1e-6)."""
    B = 6
    params, data = marked_mlp_args(layers=3, width=64, batch=48, scale=0.1)
    method = PipeshardParallel(
        num_micro_batches=B,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(1, (1, 4)),
        default_auto_sharding_option=ShardParallel(layout="data"),
    )
    ex = train_beside_serial(marked_mlp_loss, params, data, method)
    (fused,) = [n for n in ex.compiled.fused]
    hlo = ex.get_hlo_text(fused)
    trips = [int(t) for t in re.findall(r'"known_trip_count":\{"n":"(\d+)"\}', hlo)]
    assert trips == [B - 1], trips
    report = ex.collectives()[fused]
    loss_reduces = report.collectives["all-reduce"].count - len(params)
    assert report.collectives["all-reduce"].loop_instructions >= 1
    assert loss_reduces == B  # one per micro-batch: 1 before the loop, B - 1 inside
