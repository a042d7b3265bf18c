"""Gradients synchronised once per step: each data-parallel group adds its partial gradients
over the micro-batches and a stage reduces them once (``lower/partials.py``), counted in the
compiled HLO of every program through ``PipeshardExecutable.collectives()``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    ClusterSpec,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import GPTConfig, gpt_loss, init_gpt, make_gpt_batch, make_train_step
from alpa_mini.runtime.instructions import Run
from helpers.mlp import marked_mlp_args, marked_mlp_loss, train_beside_serial

REDUCTIONS = ("all-reduce", "reduce-scatter")


def _train(loss, params, data, method, steps: int = 2):
    """SGD steps beside serial JAX (to 1e-6) on a fresh 8-device session; the executable."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    return train_beside_serial(loss, params, data, method, steps)


def _method(B: int, stages: int = 1, layout: str = "data", fuse: bool = False) -> PipeshardParallel:
    """Unfused by default: the tests read each program's (forward, backward, sync, apply)
    collectives; ``test_fused_programs_move_the_same_gradient_bytes`` checks fusion."""
    return PipeshardParallel(
        num_micro_batches=B,
        fuse_programs=fuse,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(stages, (1, 8 // stages)),
        default_auto_sharding_option=ShardParallel(layout=layout),
    )


def _reduced_bytes(per_step: dict[str, tuple[int, int]]) -> int:
    return sum(per_step.get(k, (0, 0))[1] for k in REDUCTIONS)


def test_data_parallel_mlp_reduces_its_gradients_once_per_step():
    params, batch = marked_mlp_args(4, 64, 128)
    grad_bytes = 4 * 64 * 64 * 4  # four f32 64x64 gradients
    totals = {}
    for B in (1, 4, 16):
        c = _train(marked_mlp_loss, params, batch, _method(B)).collectives()
        assert not any(k in c.per_step("backward") for k in REDUCTIONS), str(c)
        sync = c["sync0"]
        assert sync.runs_per_step == 1
        assert sync.per_step() == {"all-reduce": (4, grad_bytes)}, str(c)
        totals[B] = _reduced_bytes(c.per_step())
    # Everything else reduced per step is the loss (4 bytes per micro-batch).
    assert max(totals.values()) <= 1.05 * min(totals.values()), totals


def test_zero3_reduce_scatters_each_gradient_once_per_step():
    params, batch = marked_mlp_args(4, 64, 128)
    for B in (1, 4):
        c = _train(marked_mlp_loss, params, batch, _method(B, layout="zero3")).collectives()
        assert "reduce-scatter" not in c.per_step("backward"), str(c)
        assert c["sync0"].per_step() == {"reduce-scatter": (4, 4 * 64 * 64 * 4)}, str(c)


@pytest.mark.slow
def test_zero2_reduce_scatters_each_gradient_once_and_keeps_state_sharded():
    """ZeRO-2: parameters replicated, gradients reduce-scattered once per step into the
    optimiser state's layout (sharded over the stage's 8 devices), the update computed on
    shards and the parameters all-gathered back."""
    params, batch = marked_mlp_args(4, 64, 128)
    grad_bytes = 4 * 64 * 64 * 4
    for B in (1, 4):
        c = _train(marked_mlp_loss, params, batch, _method(B, layout="zero2")).collectives()
        assert not any(k in c.per_step("backward") for k in REDUCTIONS), str(c)
        assert c["sync0"].per_step() == {"reduce-scatter": (4, grad_bytes)}, str(c)
        assert c["apply0"].per_step().get("all-gather", (0, 0))[0] == 4, str(c)
    # Adam's moments come back sharded over all 8 devices, and the step matches serial JAX
    # by loss (Adam turns reduction-order noise into lr-sized steps).
    from alpa_mini.models import adam

    opt = adam(1e-3)
    step = alpa_mini.parallelize(
        make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad),
        method=_method(4, layout="zero2"),
    )
    serial = jax.jit(make_train_step(marked_mlp_loss, opt))
    got = want = (params, opt.init(params))
    for _ in range(3):
        *got, l_got = step(*got, batch)
        *want, l_want = serial(*want, batch)
        np.testing.assert_allclose(float(l_got), float(l_want), rtol=2e-5)
    moments = [x for x in jax.tree.leaves(got[1]) if x.shape == (64, 64)]
    assert moments and all(len(x.sharding.device_set) == 8 for x in moments)
    assert all(x.addressable_shards[0].data.shape == (8, 64) for x in moments)


def test_two_stages_each_sync_once_per_step():
    params, batch = marked_mlp_args(4, 64, 128)
    c = _train(marked_mlp_loss, params, batch, _method(4, stages=2)).collectives()
    for s in (0, 1):
        assert c[f"sync{s}"].runs_per_step == 1
        assert c[f"sync{s}"].per_step() == {"all-reduce": (2, 2 * 64 * 64 * 4)}, str(c)
        # The first backward starts the accumulators; the other three add to them.
        assert (c[f"bwd{s}.0"].runs_per_step, c[f"bwd{s}"].runs_per_step) == (1, 3)
    assert not any(k in c.per_step("backward") for k in REDUCTIONS), str(c)
    # The sync follows the stage's last backward in the stream (it overlaps earlier stages).
    ex_stream = [ins.program for ins in _stream_runs(marked_mlp_loss, params, batch)]
    for s in (0, 1):
        assert (
            ex_stream.index(f"sync{s}")
            == max(i for i, p in enumerate(ex_stream) if p == f"bwd{s}") + 1
        )


def _remat_mlp_loss(params, batch):
    """Each layer a remat block (``jax.checkpoint``) reading its weight and bias."""
    x = batch["x"]
    for w, b in params:
        x = jax.checkpoint(lambda x, w, b: jnp.tanh(x @ w + b))(x, w, b)
    return jnp.mean((x - batch["y"]) ** 2)


def _scanned_mlp_loss(params, batch):
    """A ``lax.scan`` over stacked weights and biases, with a closed-over head weight used in
    every iteration (a scan constant) and remat inside the body."""
    stacked, head = params

    @jax.checkpoint
    def body(x, layer):
        w, b = layer
        return jnp.tanh(x @ w + b) + 0.1 * (x @ head), None

    x, _ = jax.lax.scan(body, batch["x"], stacked)
    return jnp.mean((x - batch["y"]) ** 2)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["remat", "scan"])
def test_params_inside_remat_blocks_and_scans_are_reduced_once_per_step(kind):
    """Weights used only inside ``checkpoint`` bodies or a ``scan`` (stacked slices and a
    constant) still leave their gradients unreduced until the stage's sync."""
    ws, batch = marked_mlp_args(3, 64, 128)
    bs = [jnp.full((64,), 0.01 * (i + 1)) for i in range(3)]
    if kind == "remat":
        loss, params = _remat_mlp_loss, list(zip(ws, bs, strict=True))
    else:
        loss, params = _scanned_mlp_loss, ((jnp.stack(ws), jnp.stack(bs)), ws[0] * 0.5)
    grad_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    count = len(jax.tree.leaves(params))
    for B in (1, 4):
        c = _train(loss, params, batch, _method(B)).collectives()
        assert not any(k in c.per_step("backward") for k in REDUCTIONS), str(c)
        assert c["sync0"].per_step() == {"all-reduce": (count, grad_bytes)}, str(c)


def _stream_runs(loss, params, batch):
    ex = _train(loss, params, batch, _method(4, stages=2), steps=1)
    return [ins for ins in ex.compiled.stream if isinstance(ins, Run)]


def test_inspection_names_programs_and_refuses_unknown_ones():
    params, batch = marked_mlp_args(4, 64, 128)
    ex = _train(marked_mlp_loss, params, batch, _method(4), steps=1)
    text = ex.get_hlo_text("sync0")
    assert "all-reduce" in text
    c = ex.collectives()
    assert {p.role for p in c.programs} >= {"forward", "backward", "sync", "apply"}
    assert "sync0" in str(c)
    with pytest.raises(ValueError, match="no program 'nope'"):
        ex.get_hlo_text("nope")


@pytest.mark.slow
def test_data_parallel_gpt_reduces_its_gradients_once_per_step():
    config = dataclasses.replace(
        GPTConfig(vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=2),
        pipeline_marks=True,
    )
    params = init_gpt(config, jax.random.PRNGKey(1))
    data = make_gpt_batch(config, jax.random.PRNGKey(2), 128)

    def loss(p, b):
        return gpt_loss(p, b, config)

    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    totals = {}
    for B in (1, 4, 16):
        c = _train(loss, params, data, _method(B)).collectives()
        assert not any(k in c.per_step("backward") for k in REDUCTIONS), str(c)
        count, nbytes = c["sync0"].per_step()["all-reduce"]
        assert (count, nbytes) == (len(jax.tree.leaves(params)), param_bytes), str(c)
        totals[B] = _reduced_bytes(c.per_step())
    assert max(totals.values()) <= 1.05 * min(totals.values()), totals


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_fused_programs_move_the_same_gradient_bytes():
    """Fusion (the default) runs a one-stage step as one program and the last stage's
    forward and backward of a micro-batch as one (``lower/fuse.py``); the gradient bytes
    reduced per step do not change, and the numerics still equal serial JAX."""
    params, batch = marked_mlp_args(4, 64, 128)
    grad_bytes = 4 * 64 * 64 * 4
    for stages in (1, 2):
        plain = _train(marked_mlp_loss, params, batch, _method(4, stages))
        fused = _train(marked_mlp_loss, params, batch, _method(4, stages, fuse=True))
        got = _reduced_bytes(fused.collectives().per_step())
        want = _reduced_bytes(plain.collectives().per_step())
        assert grad_bytes <= got <= want <= 1.01 * grad_bytes, (got, want)
        runs = [i.program for i in fused.compiled.stream if isinstance(i, Run)]
        plain_runs = [i.program for i in plain.compiled.stream if isinstance(i, Run)]
        parts = fused.compiled.fused
        if stages == 1:
            assert len(runs) == 1, runs
            assert {"fwd0", "bwd0.0", "bwd0", "sync0", "apply0"} <= set(parts[runs[0]])
        else:
            assert any({"fwd1", "bwd1"} <= set(parts.get(r, ())) for r in runs), runs
            assert len(runs) < len(plain_runs)


def _mlp_executable(B: int, layout: str):
    """The four-layer MLP's SGD step on 8 CPU devices as one stage, and its arguments."""
    from alpa_mini.models import sgd

    params, batch = marked_mlp_args(4, 64, 128)
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    args = (params, opt.init(params), batch)
    return alpa_mini.parallelize(step, method=_method(B, layout=layout)).get_executable(*args), args


def _held_accumulator_bytes(ex, args, program: str = "bwd0") -> list[int]:
    """One step of ``ex``: per run of stage 0's backward ``program``, the bytes on device 0
    of the accumulators it returns (its last outputs)."""
    num_accs, run, held = len(ex.compiled.accumulators[0]), ex.runtime.programs[program], []

    def recorded(*a):
        outs = run(*a)
        held.append(sum(x.addressable_shards[0].data.nbytes for x in outs[-num_accs:]))
        return outs

    ex.runtime.programs[program] = recorded
    ex(*args)
    return held


@pytest.mark.parametrize("layout", ["zero3", "data"])
def test_accumulators_hold_per_device_what_the_planner_counts(layout):
    """Each of the later backwards returns the stage's accumulators. ZeRO-3 shards the
    parameters over the 8 devices, but a data-parallel group's unreduced partial is still a
    whole gradient per device: what ``shard.accumulators`` prices (and 8x the parameter)."""
    from alpa_mini.shard.accumulators import accumulator_bytes
    from alpa_mini.shard.spec import ShardingSpec

    ex, args = _mlp_executable(4, layout)
    held = _held_accumulator_bytes(ex, args)
    # The parameters' layout: split over the one mesh axis (ZeRO-3) or replicated, the rows
    # split over it either way.
    spec = ShardingSpec(((0,), ()) if layout == "zero3" else ((), ()))
    want = 4 * accumulator_bytes(64 * 64 * 4, spec, (8,), (0,))
    assert held == [want] * 3 and want == 4 * 64 * 64 * 4


def test_one_micro_batch_plans_count_the_whole_partials_its_backward_returns():
    """With one micro-batch, ZeRO-3's backward still returns each gradient as its data-parallel
    group's unreduced partial, a whole gradient per device (8x the parameter's shard), held
    until the sync; the planned peak counts that, where it used to count the gradient in the
    parameter's layout (63,497 bytes planned against 65,536 of partials alone)."""
    ex, args = _mlp_executable(1, "zero3")
    held = _held_accumulator_bytes(ex, args, "bwd0.0")  # (with one micro-batch, the only one)
    whole = 4 * 64 * 64 * 4  # four f32 64x64 gradients, each whole on every device
    assert held == [whole]
    shards = whole // 8  # the parameters themselves, ZeRO-3 sharded
    assert ex.plan.stages[0].peak_memory >= whole + shards


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_expert_parallel_weights_accumulate_in_their_own_layout():
    """DeepSpeed's expert parallelism on 8 devices (batch and experts both split over the
    one axis): each device computes its own experts' weight gradients, so the runtime keeps
    them in their own layout (1/8 per device), not as a whole partial per group, and the
    planner counts the same; the step still trains as serial JAX does."""
    from alpa_mini.graph import trace_jaxpr
    from alpa_mini.models import sgd
    from alpa_mini.models.moe import MoEConfig, init_moe, make_moe_batch, moe_loss
    from alpa_mini.options.param_splits import ParamSplit, ParamSplits
    from alpa_mini.shard.accumulators import accumulator_bytes, held_accumulators, paired_dims
    from alpa_mini.shard.spec import ShardingSpec

    cfg = MoEConfig(hidden=16, ffn=32, num_experts=8, seq_len=4)
    params = init_moe(cfg, jax.random.key(0))
    batch = make_moe_batch(cfg, jax.random.key(1), 32)
    experts = params["experts"]
    splits = ParamSplits(
        tuple(
            ParamSplit(jax.tree_util.keystr(path), v.shape, 0 if "experts" in str(path) else None)
            for path, v in jax.tree_util.tree_flatten_with_path(params)[0]
        )
    )
    method = dataclasses.replace(
        _method(4),
        default_auto_sharding_option=ShardParallel(layout="zero2", tensor_splits=splits),
    )
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    ex = train_beside_serial(moe_loss, params, batch, method)
    held = _held_accumulator_bytes(ex, (params, sgd(0.1).init(params), batch))
    weights = 4 * (experts["w_in"].size + experts["w_out"].size)
    others = 4 * sum(x.size for x in jax.tree.leaves(params)) - weights
    # The biases' broadcast adds still group (a whole partial each); the weights do not.
    assert held == [others + weights / 8] * 3, held  # 6272 bytes; whole: 34944
    # The planner's side: the expert dimension is what the contractions pair, and a layout
    # splitting it over the rows' axis accumulates in its own layout; split elsewhere (a
    # ZeRO-like split of the hidden dimension), the partial is whole.
    split_e, split_h = ShardingSpec(((0,), (), ())), ShardingSpec(((), (0,), ()))
    assert accumulator_bytes(1024.0, split_e, (8,), (0,), (0,)) == 128.0
    assert accumulator_bytes(1024.0, split_h, (8,), (0,), (0,)) == 1024.0
    closed = jax.make_jaxpr(jax.value_and_grad(moe_loss))(params, batch)
    roles = ["param"] * len(jax.tree.leaves(params)) + ["batch"] * len(batch)
    graph = trace_jaxpr(closed, roles)
    names = {graph.tensors[t].shape: i for i, t in enumerate(graph.inputs)}
    found = paired_dims(graph)
    assert found[names[experts["w_in"].shape]] == (0,)
    assert found[names[experts["w_out"].shape]] == (0,)
    assert names[experts["b_in"].shape] not in found
    # A plan read back carries them (and keeps them through JSON): its held accumulators are
    # the runtime's bytes above.
    plan = alpa_mini.plan(
        make_train_step(moe_loss, sgd(0.1)),
        params,
        sgd(0.1).init(params),
        batch,
        method=ShardParallel(layout="zero2", tensor_splits=splits),
    )
    again = type(plan).from_json(plan.to_json())
    assert held_accumulators(plan) == held_accumulators(again) == others + weights / 8
