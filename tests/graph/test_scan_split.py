"""``graph.scan_split``: a scanned stack cut into sub-scans, its leaves split into row pieces at
the step's edge, and the optimiser's update following the pieces."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini.graph.grad_capture import GRAD_NAME, trace_with_grads
from alpa_mini.graph.jaxpr_walk import flatten_calls
from alpa_mini.graph.scan_split import (
    PieceMap,
    even_lengths,
    layer_scans,
    row_sliced_inputs,
    split_scans,
)

L, H = 6, 8


def _loss(params, batch):
    def body(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(body, batch["x"] @ params["w_in"], params["stack"])
    return jnp.mean((h - batch["y"]) ** 2)


def _clipped_momentum_step(params, mom, batch, update=None):
    """SGD with momentum after clipping by the global norm (a reduction over whole stacks)."""
    loss, g = alpa_mini.value_and_grad(_loss)(params, batch)
    norm = jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(g)))
    g = jax.tree.map(lambda x: x * jnp.minimum(1.0, 1.0 / norm), g)
    mom = jax.tree.map(lambda m, x: 0.9 * m + x, mom, g)
    if update is not None:
        mom = update(mom)
    return jax.tree.map(lambda p, m: p - 0.1 * m, params, mom), mom, loss


def _traced(update=None):
    params = {
        "stack": jax.ShapeDtypeStruct((L, H, H), jnp.float32),
        "w_in": jax.ShapeDtypeStruct((4, H), jnp.float32),
    }
    batch = {
        "x": jax.ShapeDtypeStruct((16, 4), jnp.float32),
        "y": jax.ShapeDtypeStruct((16, H), jnp.float32),
    }
    args = (params, params, batch)
    flat, tree = jax.tree.flatten(args)
    roles = ["param", "param", "state", "state", "batch", "batch"]

    def fun(*leaves):
        return _clipped_momentum_step(*jax.tree.unflatten(tree, leaves), update=update)

    traced = trace_with_grads(fun, flat, roles, 2, "pipeline")
    step = traced.closed
    g = next(i for i, e in enumerate(step.jaxpr.eqns) if e.primitive.name == GRAD_NAME)
    capture = traced.captures[step.jaxpr.eqns[g].params["index"]]
    return step, capture, flatten_calls(capture.loss), roles


def test_the_stack_and_its_momentum_are_split_and_the_update_follows_the_pieces() -> None:
    step, capture, forward, roles = _traced()
    (i,) = layer_scans(forward, capture)
    split = split_scans(step, capture, forward, {i: (2, 4)}, roles)
    # Leaves: stack, w_in, momentum of stack, momentum of w_in, x, y.
    assert split.pieces.inputs == (
        (0, 0, 2), (0, 2, 6), (1, None, None), (2, 0, 2), (2, 2, 6), (3, None, None),
        (4, None, None), (5, None, None),
    )  # fmt: skip
    assert split.pieces.outputs == ((0, 1), (2,), (3, 4), (5,), (6,))
    scans = [e for e in split.forward.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [2, 4]
    # The clipping norm sums per-piece squares; nothing joins the pieces again.
    names = [e.primitive.name for e in split.step.jaxpr.eqns]
    assert "concatenate" not in names and "slice" not in names
    # The loss reads one more input (the stack's second piece), differentiated like the first.
    assert len(split.capture.diff) == len(capture.diff) + 1
    assert sum(split.capture.diff) == sum(capture.diff) + 1
    assert [a.shape for a in split.step.in_avals[:2]] == [(2, H, H), (4, H, H)]


def test_a_use_that_needs_the_whole_stack_joins_it_and_leaves_that_state_whole() -> None:
    step, capture, forward, roles = _traced(
        update=lambda m: jax.tree.map(lambda x: jnp.cumsum(x, axis=0), m)
    )
    (i,) = layer_scans(forward, capture)
    split = split_scans(step, capture, forward, {i: even_lengths(L, 2)}, roles)
    # The momentum goes through a cumulative sum over the layer axis: it stays whole, and
    # the gradient pieces are joined for it.
    assert split.pieces.inputs[3] == (2, None, None)
    assert "concatenate" in [e.primitive.name for e in split.step.jaxpr.eqns]


def test_bad_splits_are_refused_by_name() -> None:
    step, capture, forward, roles = _traced()
    (i,) = layer_scans(forward, capture)
    with pytest.raises(ValueError, match=r"scan_splits: lengths \[2, 2\] .* sum to its 6"):
        split_scans(step, capture, forward, {i: (2, 2)}, roles)
    with pytest.raises(ValueError, match=r"scan_splits: equation 0 of the loss is not a scan"):
        split_scans(step, capture, forward, {0: (3, 3)}, roles)


def test_even_lengths_and_the_identity_map() -> None:
    assert even_lengths(7, 3) == (3, 2, 2)
    assert PieceMap(((0, None, None),), ((0,),)).is_identity
    assert not PieceMap(((0, 0, 1), (0, 1, 2)), ((0, 1),)).is_identity


def _row_pieces(loss) -> dict[int, tuple[int, ...]]:
    """``row_sliced_inputs`` of an SGD step of ``loss(w, batch)``, w a (4, 8, 8) stack."""
    w = jax.ShapeDtypeStruct((4, 8, 8), jnp.float32)
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32)

    def fun(w, x):
        value, g = alpa_mini.value_and_grad(loss)(w, {"x": x})
        return w - 0.1 * g, value

    traced = trace_with_grads(fun, [w, x], ["param", "batch"], 1, "pipeline")
    capture = traced.captures[0]
    return row_sliced_inputs(flatten_calls(capture.loss), capture)


def test_a_stack_is_split_into_rows_only_where_every_read_takes_whole_rows() -> None:
    """Rows read one by one give one piece each, slices of several rows pieces of those
    lengths; a stack also read whole, or sliced within a row, is not split."""

    def rows(w, b):
        return sum(jnp.sum(b["x"] @ w[i]) for i in range(4))

    def pairs(w, b):
        return jnp.sum(b["x"] @ w[0:2].sum(0)) + jnp.sum(b["x"] @ w[2])

    def whole(w, b):
        return rows(w, b) + jnp.sum(w)

    def part(w, b):
        return sum(jnp.sum(b["x"] @ w[i, :, :4]) for i in range(4))

    assert _row_pieces(rows) == {0: (1, 1, 1, 1)}
    assert _row_pieces(pairs) == {0: (2, 1, 1)}
    assert _row_pieces(whole) == {} and _row_pieces(part) == {}
