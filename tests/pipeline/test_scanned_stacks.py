"""A ``lax.scan`` over stacked layers pipelined: ``AutoLayerOption`` cuts between its
iterations (sub-scans), each stage holds and updates its own rows of every stacked leaf, and
the step hands back ordinary arrays with the user's tree structure, sharded along the layer
axis over the stages' devices."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import alpa_mini
from alpa_mini import AutoLayerOption, PipeshardParallel, UniformStageOption
from alpa_mini.models import make_train_step, sgd
from alpa_mini.models.gpt import GPTConfig, gpt_loss, init_gpt, make_gpt_batch
from alpa_mini.pipeline.plan import PipeshardPlan
from alpa_mini.pipeline.stacked_rows import STACK_AXIS, take_rows

GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=4, scan_layers=True)
_loss = functools.partial(gpt_loss, config=GPT)


def _gpt_args():
    params = init_gpt(GPT, jax.random.key(0))
    return params, make_gpt_batch(GPT, jax.random.key(1), 8)


def _method(stages: int, submesh: tuple[int, int] | None = None, **kw) -> PipeshardParallel:
    return PipeshardParallel(
        num_micro_batches=kw.pop("B", 2),
        layer_option=AutoLayerOption(stages),
        stage_option=UniformStageOption(stages, submesh),
        **kw,
    )


def _run(step, params, opt, batch, steps: int):
    p, s = params, opt.init(params)
    losses = []
    for _ in range(steps):
        p, s, loss = step(p, s, batch)
        losses.append(float(loss))
    return p, s, losses


def _assert_close(got, want, tol: float = 1e-6) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def _train_and_compare(stages: int) -> dict:
    """Two SGD steps of the scanned GPT cut into ``stages`` stages, beside serial JAX."""
    params, batch = _gpt_args()
    opt = sgd(0.1)
    step = alpa_mini.parallelize(
        make_train_step(_loss, opt, alpa_mini.value_and_grad), method=_method(stages)
    )
    got_p, got_s, got_l = _run(step, params, opt, batch, 2)
    want_p, want_s, want_l = _run(jax.jit(make_train_step(_loss, opt)), params, opt, batch, 2)
    _assert_close((got_p, got_s), (want_p, want_s))
    np.testing.assert_allclose(got_l, want_l, rtol=1e-6)
    return {"step": step, "got": (got_p, got_s), "want": want_p, "batch": batch}


def _check_cut(run: dict, stages: int) -> None:
    (got_p, got_s), batch = run["got"], run["batch"]
    plan = run["step"].get_executable(got_p, got_s, batch).plan
    assert plan.num_stages == stages
    (split,) = plan.scan_splits  # the block stack, cut into one run of layers per stage
    assert split.lengths == (GPT.num_layers // stages,) * stages
    devices = [set(s.devices) for s in plan.stages]
    assert set().union(*devices) == set(range(8))
    assert sum(len(d) for d in devices) == 8  # disjoint
    # Every stacked leaf comes back whole, sharded along its layer axis over all 8 devices.
    for leaf in jax.tree.leaves(got_p["layers"]):
        assert leaf.shape[0] == GPT.num_layers
        assert {d.id for d in leaf.sharding.device_set} == set(range(8))
        assert leaf.sharding.spec[0] == STACK_AXIS


@pytest.fixture(scope="module")
def trained_two_stages():
    alpa_mini.shutdown()
    alpa_mini.init(cluster=alpa_mini.ClusterSpec.named("cpu-1x8"))
    try:
        yield _train_and_compare(2)
    finally:
        alpa_mini.shutdown()


@pytest.fixture
def two_stages(trained_two_stages):
    """The module's 2-stage run, with the session back if another test shut it down."""
    if not alpa_mini.is_initialized():
        alpa_mini.init(cluster=alpa_mini.ClusterSpec.named("cpu-1x8"))
    return trained_two_stages


def test_a_scanned_gpt_pipelines_into_two_stages_on_disjoint_devices_equal_to_serial(
    two_stages,
) -> None:
    _check_cut(two_stages, 2)


def test_outputs_feed_the_next_step_in_place_in_their_planned_layouts(two_stages) -> None:
    step, (p, s), batch = two_stages["step"], two_stages["got"], two_stages["batch"]
    ex = step.get_executable(p, s, batch)
    flat = jax.tree.leaves((p, s, batch))
    layouts = ex.extra["arg_layouts"]
    for i, (k, a, b) in enumerate(ex.pieces.inputs):
        if a is None or layouts[i] is None:
            continue
        piece = take_rows(flat[k], a, b, layouts[i])
        # The very buffers the previous step left on the stage's devices, in the layout the
        # step consumes (and would donate) them in: no copy.
        assert {x.data.unsafe_buffer_pointer() for x in piece.addressable_shards} <= {
            x.data.unsafe_buffer_pointer() for x in flat[k].addressable_shards
        }
        assert piece.sharding.is_equivalent_to(layouts[i], piece.ndim)


def test_an_eval_step_reads_stacked_outputs_directly_and_after_gather(two_stages) -> None:
    (got, _), want, batch = two_stages["got"], two_stages["want"], two_stages["batch"]
    expected = float(_loss(want, batch))
    evaluate = alpa_mini.parallelize(_loss, method=alpa_mini.ShardParallel(mesh_shape=(8,)))
    np.testing.assert_allclose(float(evaluate(got, batch)), expected, rtol=1e-6)
    np.testing.assert_allclose(
        float(jax.jit(_loss)(alpa_mini.gather(got), batch)), expected, rtol=1e-6
    )


@pytest.mark.slow  # 7-14 s: the fast suite keeps its 3-minute limit
def test_flax_nn_scan_with_optax_adamw_and_clipping_trains_as_serial(devices8) -> None:
    import flax.linen as nn
    import optax

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            return h + jnp.tanh(nn.Dense(16)(h)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(16)(x)
            stack = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4
            )
            h, _ = stack()(h, None)
            return nn.Dense(4)(h)

    x = jax.random.normal(jax.random.key(1), (16, 8))
    batch = {"x": x, "y": jnp.tanh(x[:, :4])}
    model = Model()
    params = model.init(jax.random.key(0), x)
    lr = 1e-2
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(lr))

    def train_step(params, opt_state, batch, grad=jax.value_and_grad):
        def loss_fn(p):
            return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

        loss, grads = grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = alpa_mini.parallelize(
        functools.partial(train_step, grad=alpa_mini.value_and_grad),
        method=_method(2, B=4, pipeline_schedule="1f1b"),
    )
    p, s = params, tx.init(params)
    q, t = params, tx.init(params)
    serial = jax.jit(train_step)
    for _ in range(3):
        p, s, got = step(p, s, batch)
        q, t, want = serial(q, t, batch)
        assert abs(float(got) - float(want)) < 3 * lr
    assert jax.tree.structure(p) == jax.tree.structure(q)
    for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q), strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3 * 3 * lr)
    plan = step.get_executable(p, s, batch).plan
    assert plan.scan_splits and plan.num_stages == 2


def _odd_loss(params, frozen, batch):
    """A reverse scan whose per-layer outputs feed the loss, over a trained and a frozen
    stack, with the batch closed over."""

    def body(h, layer):
        w, scale = layer
        h = jnp.tanh(h @ w) * scale
        return h, jnp.mean(h**2)

    h, per_layer = jax.lax.scan(
        body, batch["x"] @ params["w_in"], (params["stack"], frozen), reverse=True
    )
    return jnp.mean((h - batch["y"]) ** 2) + 0.1 * jnp.sum(per_layer)


def _odd_step(params, frozen, batch, grad=jax.value_and_grad):
    loss, g = grad(lambda p: _odd_loss(p, frozen, batch))(params)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


@pytest.mark.slow  # 7-14 s: the fast suite keeps its 3-minute limit
def test_a_reverse_scan_with_outputs_and_a_frozen_stack_equals_serial(devices8) -> None:
    k = jax.random.split(jax.random.key(3), 4)
    params = {
        "w_in": jax.random.normal(k[0], (8, 16)) / 4,
        "stack": jax.random.normal(k[1], (6, 16, 16)) / 4,
    }
    frozen = 1.0 + 0.1 * jax.random.normal(k[2], (6, 16))
    x = jax.random.normal(k[3], (16, 8))
    batch = {"x": x, "y": jnp.tanh(x @ jnp.ones((8, 16)) / 8)}
    step = alpa_mini.parallelize(
        functools.partial(_odd_step, grad=alpa_mini.value_and_grad),
        method=_method(3, (1, 2)),
        batch_argnums=(2,),
    )
    got, got_loss = step(params, frozen, batch)
    got, got_loss = step(got, frozen, batch)
    want, want_loss = jax.jit(_odd_step)(params, frozen, batch)
    want, want_loss = jax.jit(_odd_step)(want, frozen, batch)
    _assert_close(got, want)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    plan = step.get_executable(got, frozen, batch).plan
    assert [s.lengths for s in plan.scan_splits] == [(2, 2, 2)]


@pytest.mark.slow
def test_a_plan_with_scan_splits_replays_from_json(devices8) -> None:
    params, batch = _gpt_args()
    opt = sgd(0.1)
    train = make_train_step(_loss, opt, alpa_mini.value_and_grad)
    plan = alpa_mini.plan(train, params, opt.init(params), batch, method=_method(2))
    again = PipeshardPlan.from_json(plan.to_json())
    assert again.scan_splits == plan.scan_splits and again == plan
    step = alpa_mini.parallelize(train, method=PipeshardParallel(num_micro_batches=2, plan=again))
    got, _, _ = step(params, opt.init(params), batch)
    want, _, _ = jax.jit(make_train_step(_loss, opt))(params, opt.init(params), batch)
    _assert_close(got, want)


@pytest.mark.slow
def test_a_scanned_gpt_pipelines_into_four_stages_on_disjoint_devices_equal_to_serial(
    devices8,
) -> None:
    _check_cut(_train_and_compare(4), 4)


# --------------------------------------------------------------- stacks read row by row
N_ROWS = 4


def _row_loop_loss(params, batch):
    """A Python loop over a stacked weight (``w[i]``), as a scan body unrolled by hand."""
    x = batch["x"]
    for i in range(N_ROWS):
        x = x + jnp.tanh(jnp.tanh(x @ params["w0"][i]) @ params["w1"][i])
    return jnp.mean((x - batch["y"]) ** 2)


def _row_loop_args():
    k = jax.random.split(jax.random.key(4), 4)
    params = {f"w{j}": jax.random.normal(k[j], (N_ROWS, 16, 16)) * 0.3 for j in range(2)}
    batch = {"x": jax.random.normal(k[2], (32, 16)), "y": jax.random.normal(k[3], (32, 16))}
    return params, batch


def test_a_stack_a_loop_reads_row_by_row_is_split_into_its_rows_and_equals_serial(
    devices8,
) -> None:
    """Each row becomes a parameter of its own (``plan.row_splits``): no block's gradient is
    padded to the whole stack. Two stages at B = 4 equal serial JAX, the step hands back the
    stacks whole, and the plan replays from its JSON."""
    from alpa_mini.pipeline.plan import RowSplit

    params, batch = _row_loop_args()
    opt = sgd(0.1)
    train = make_train_step(_row_loop_loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=4, stage_option=UniformStageOption(2))
    step = alpa_mini.parallelize(train, method=method)
    serial = jax.jit(make_train_step(_row_loop_loss, opt))
    got, want = _run(step, params, opt, batch, 2), _run(serial, params, opt, batch, 2)
    _assert_close(got[0], want[0])
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
    plan = step.get_executable(params, opt.init(params), batch).plan
    assert plan.row_splits == (RowSplit(0, (1,) * N_ROWS), RowSplit(1, (1,) * N_ROWS))
    # The loop's blocks now read whole pieces: one layer per block, no slice left in them.
    assert plan.num_layers == N_ROWS + 1
    again = PipeshardPlan.from_json(plan.to_json())
    assert again == plan
    replay = alpa_mini.parallelize(train, method=PipeshardParallel.from_plan(again))
    _assert_close(_run(replay, params, opt, batch, 2)[0], want[0])


def test_bad_row_splits_in_a_saved_plan_are_refused_by_name(devices8) -> None:
    from alpa_mini import ConfigError

    params, batch = _row_loop_args()
    opt = sgd(0.1)
    train = make_train_step(_row_loop_loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(2))
    record = json.loads(
        alpa_mini.plan(train, params, opt.init(params), batch, method=method).to_json()
    )
    with pytest.raises(ConfigError, match=r"plan\.row_splits\[0\]\.lengths"):
        PipeshardPlan.from_dict({**record, "row_splits": [{"input": 0, "lengths": [0, 4]}]})
    first, second = record["row_splits"]
    cases = {
        "sum to its 4 rows": [{"input": 0, "lengths": [3, 2]}, second],
        "split twice": [first, first, second],
    }
    for why, rows in cases.items():
        plan = PipeshardPlan.from_dict({**record, "row_splits": rows})
        step = alpa_mini.parallelize(train, method=PipeshardParallel.from_plan(plan))
        with pytest.raises(ConfigError, match=rf"plan\.row_splits: .*{why}"):
            step(params, opt.init(params), batch)
