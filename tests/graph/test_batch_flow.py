"""``alpa_mini.grad`` splits into micro-batches whatever derives from the step's batch: a loss
that closes over the batch (Alpa's documented pattern), values the step computes from the
batch before the call, with flax and optax as users write them; each equal to serial JAX
(SGD to 1e-6)."""

from __future__ import annotations

from typing import Any

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

WIDTH, BATCH = 16, 32


def _flax_mlp() -> tuple[Any, Any, dict[str, np.ndarray]]:
    """A flax.linen MLP with a pipeline boundary after each hidden layer."""
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(3):
                x = jnp.tanh(nn.Dense(WIDTH, name=f"dense{i}")(x))
                alpa_mini.mark_pipeline_boundary()
            return nn.Dense(4, name="head")(x)

    key = jax.random.key(3)
    x = jax.random.normal(key, (BATCH, WIDTH))
    batch = {"x": np.asarray(x), "y": np.asarray(jnp.tanh(x[:, :4] * 2.0))}
    model = MLP()
    return model, jax.device_get(model.init(jax.random.key(0), x)), batch


def _closure_step(model: Any, tx: Any, value_and_grad: Any):
    """Alpa's pattern: the loss closes over the batch and over values the step computed
    from it (scaled inputs) and from nothing (a noise key)."""
    import optax

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        x = batch["x"] * 0.5 + 0.1
        key = jax.random.fold_in(jax.random.key(5), 3)

        def loss_fn(p: Any) -> jax.Array:
            noise = 0.01 * jax.random.normal(key, (WIDTH,))
            return jnp.mean(jnp.square(model.apply(p, x + noise) - batch["y"]))

        loss, grads = value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _train_beside_serial(method: Any, steps: int = 3) -> Any:
    import optax

    model, params, batch = _flax_mlp()
    tx = optax.sgd(0.1)
    pstep = alpa_mini.parallelize(_closure_step(model, tx, alpa_mini.value_and_grad), method=method)
    serial = jax.jit(_closure_step(model, tx, jax.value_and_grad))
    got = want = (params, tx.init(params))
    for _ in range(steps):
        *got, l_got = pstep(*got, batch)
        *want, l_want = serial(*want, batch)
        np.testing.assert_allclose(float(l_got), float(l_want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    return pstep.get_executable(params, tx.init(params), batch)


@pytest.fixture
def cpu8():
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    yield
    alpa_mini.shutdown()


@pytest.mark.parametrize("B", [1, 4])
def test_closure_over_the_batch_under_shard_parallel(cpu8, B: int) -> None:
    _train_beside_serial(ShardParallel(mesh_shape=(2, 4), num_micro_batches=B))


PIPESHARD = [
    ("1f1b", 4),
    pytest.param("gpipe", 4, marks=pytest.mark.slow),
    pytest.param("1f1b", 1, marks=pytest.mark.slow),
    pytest.param("gpipe", 1, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("schedule,B", PIPESHARD)
def test_closure_over_the_batch_under_pipeshard(cpu8, schedule: str, B: int) -> None:
    method = PipeshardParallel(
        num_micro_batches=B,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(2),  # by default: 4 devices each
        pipeline_schedule=schedule,
    )
    ex = _train_beside_serial(method)
    assert [tuple(s.devices) for s in ex.plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_the_loss_reads_micro_batches_of_what_derives_from_the_batch() -> None:
    """Numerics cannot tell a closed-over batch that was split from one that was not (the
    mean of full-batch losses is the full-batch loss): the traced structure can."""
    import optax

    from alpa_mini.graph.grad_capture import trace_with_grads

    model, params, batch = _flax_mlp()
    tx = optax.sgd(0.1)
    step = _closure_step(model, tx, alpa_mini.value_and_grad)
    flat, tree = jax.tree.flatten((params, tx.init(params), batch))
    avals = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in flat]
    first_batch = len(flat) - len(jax.tree.leaves(batch))
    roles = ["param"] * first_batch + ["batch"] * (len(flat) - first_batch)

    def fun(*leaves: Any) -> Any:
        return step(*jax.tree.unflatten(tree, leaves))

    (capture,) = trace_with_grads(fun, avals, roles, 4, "pipeline").captures
    # The loss reads the step's batch leaves (x through the step's scaling, folded in) and
    # nothing else of the step: the noise key is recomputed inside it.
    assert [k for kind, k in capture.sources if kind == "step"] == [first_batch, first_batch + 1]
    shapes = [a.shape for a, b in zip(capture.loss.in_avals, capture.batch, strict=True) if b]
    assert shapes == [(BATCH // 4, WIDTH), (BATCH // 4, 4)]
    assert sum(capture.diff) == len(jax.tree.leaves(params))
    accumulated = trace_with_grads(fun, avals, roles, 4, "accumulate").closed.jaxpr
    scans = [e for e in accumulated.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [4]
    assert all(
        e.primitive.name != "mul" or e.outvars[0].aval.shape != (BATCH, WIDTH)
        for e in accumulated.eqns
    ), "the full-batch scaling of x should be pruned"


def _error_step(kind: str):
    def step(params: Any, other: Any, batch: Any) -> Any:
        if kind == "diff-batch":
            grads = alpa_mini.grad(lambda x: jnp.sum(x @ params))(batch)
        elif kind == "named-not-batch":
            grads = alpa_mini.grad(lambda p, o: jnp.sum(o @ p), batch_argnum=1)(params, other)
        else:  # a grad call inside a jitted helper

            @jax.jit
            def inner(p: Any) -> Any:
                return alpa_mini.grad(lambda q: jnp.sum(batch @ q))(p)

            grads = inner(params)
        return params - 0.1 * grads

    return step


@pytest.mark.parametrize(
    "kind,match",
    [
        ("diff-batch", "derives from the step's batch arguments"),
        ("named-not-batch", "batch_argnum: argument 1 .* does not derive from the step's batch"),
        ("nested", "call it from the step, not inside a jax.jit"),
    ],
)
def test_what_cannot_be_split_is_refused_by_name(cpu8, kind: str, match: str) -> None:
    w = jnp.ones((WIDTH, WIDTH))
    step = alpa_mini.parallelize(
        _error_step(kind), method=ShardParallel(mesh_shape=(1, 8), num_micro_batches=2)
    )
    with pytest.raises(ValueError, match=match):
        step(w, jnp.ones((BATCH, WIDTH)), jnp.ones((BATCH, WIDTH)))


def _counted_mlp_step(opt):
    """The marked MLP's train step over flat leaves, counting its calls: (step, its
    arguments, their avals and roles, the calls so far)."""
    from alpa_mini.models import make_train_step
    from helpers.mlp import marked_mlp_args, marked_mlp_loss

    params, batch = marked_mlp_args(2, 8, 16)
    args = (params, opt.init(params), batch)
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(args)]
    n_state = len(jax.tree.leaves(args[:2]))
    roles = ["param"] * n_state + ["batch"] * (len(avals) - n_state)
    calls = []

    def step(*leaves):
        calls.append(1)
        p, s, b = jax.tree.unflatten(jax.tree.structure(args), leaves)
        return make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)(p, s, b)

    return step, args, avals, roles, calls


def _traced_at_two_counts(step, avals, roles):
    from alpa_mini.graph.grad_capture import record_grads, trace_with_grads

    first = trace_with_grads(step, avals, roles, 4, "pipeline")
    again = trace_with_grads(step, avals, roles, 8, "pipeline", earlier=first)
    recorded, _ = record_grads(step, avals, roles, 8)
    return first, again, recorded


def test_a_step_whose_losses_read_its_inputs_is_traced_once_as_record_and_replay_would(
    monkeypatch,
):
    """Every loss reads step inputs as they are: the first count traces the step once
    (``direct_trace``), and its step jaxpr and captures equal those of the record pass and
    replay equation for equation; a loss of a value the step computed falls back to them."""
    import alpa_mini.graph.direct_trace as direct
    from alpa_mini.graph.grad_capture import trace_with_grads
    from alpa_mini.models import adam

    step, _, avals, roles, calls = _counted_mlp_step(adam(0.1))

    once = trace_with_grads(step, avals, roles, 4, "pipeline")
    assert len(calls) == 1 and all(r is not None for r in once.recipes)

    def refuse(*a, **k):
        raise direct.NotDirect

    monkeypatch.setattr(direct, "trace_direct", refuse)
    twice = trace_with_grads(step, avals, roles, 4, "pipeline")
    assert len(calls) == 3
    assert str(once.closed) == str(twice.closed)
    for got, want in zip(once.captures, twice.captures, strict=True):
        assert (got.sources, got.diff, got.batch, got.num_aux) == (
            want.sources, want.diff, want.batch, want.num_aux,
        )  # fmt: skip
        assert got.aux_tree == want.aux_tree and str(got.loss) == str(want.loss)


def test_a_later_count_traces_the_loss_alone_as_the_record_pass_would():
    """A loss that reads the step's inputs as they are: the first count keeps a LossRecipe,
    and another count's capture from it (the step not traced) equals that count's record
    pass equation for equation; a loss of a value the step computed from the batch has no
    recipe, so each count records the step."""
    from alpa_mini.models import make_train_step, sgd
    from helpers.mlp import marked_mlp_loss

    opt = sgd(0.1)
    step, args, avals, roles, calls = _counted_mlp_step(opt)

    first, again, recorded = _traced_at_two_counts(step, avals, roles)
    assert all(r is not None for r in first.recipes)
    assert len(calls) == 2  # first count: traced once (direct_trace); the record pass at 8
    for got, want in zip(again.captures, recorded, strict=True):
        assert got.num_micro_batches == want.num_micro_batches == 8
        assert (got.sources, got.diff, got.batch) == (want.sources, want.diff, want.batch)
        assert str(got.loss) == str(want.loss)
    assert again.closed is first.closed  # the full-shape replay is reused

    def scaled(p, b):  # the loss reads x / 2, which the step computes
        return marked_mlp_loss(p, b)

    def step2(*leaves):
        p, s, b = jax.tree.unflatten(jax.tree.structure(args), leaves)
        b = {"x": b["x"] / 2, "y": b["y"]}
        return make_train_step(scaled, opt, alpa_mini.value_and_grad)(p, s, b)

    first, again, recorded = _traced_at_two_counts(step2, avals, roles)
    assert first.recipes == (None,)
    assert str(again.captures[0].loss) == str(recorded[0].loss)


def _shared_positions_step(params: Any, batch: Any) -> Any:
    """Position ids shared by every row, put in the batch (where they are cut with it)."""

    def loss(p: Any) -> Any:
        x = batch["x"] + batch["pos"][None, :]
        return jnp.mean(jnp.tanh(x @ p) ** 2)

    return params - 0.1 * alpa_mini.grad(loss)(params)


@pytest.mark.parametrize(
    "method",
    [
        ShardParallel(mesh_shape=(1, 8), num_micro_batches=2),
        PipeshardParallel(
            num_micro_batches=2,
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(1),
        ),
    ],
    ids=["shard", "pipeshard"],
)
def test_a_shared_leaf_cut_with_the_batch_is_named_with_its_rows(cpu8, method) -> None:
    batch = {"x": np.ones((BATCH, WIDTH), np.float32), "pos": np.arange(WIDTH, dtype=np.float32)}
    step = alpa_mini.parallelize(_shared_positions_step, method=method)
    with pytest.raises(TypeError, match="incompatible shapes") as err:
        step(jnp.eye(WIDTH), batch)
    note = " ".join(getattr(err.value, "__notes__", []))
    assert "cut to 1/2 of their leading dimension" in note
    assert f"['pos']: {WIDTH}, " in note and f"['x']: {BATCH}" in note and "position ids" in note
