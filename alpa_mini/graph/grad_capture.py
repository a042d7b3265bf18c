"""Trace a step that calls ``alpa_mini.grad``, splitting into micro-batches whatever derives
from the step's batch: arguments of the loss or values it closes over.

A step is traced twice (``trace_with_grads``):

1. *record*, with the step's batch leaves cut to one micro-batch, as Alpa traces. Each
   ``alpa_mini.value_and_grad(loss_fn)(*args)`` traces ``loss_fn`` into a jaxpr whose
   closed-over values are explicit and binds ``pipeline_grad_p`` on (closed-over values,
   arguments). ``loss_fold.fold_loss`` then follows each input back to the step's own inputs,
   so the loss becomes a function of step inputs (plus its differentiated arguments) at
   micro-batch shapes: a step input is split into micro-batches exactly when it is a batch leaf.
2. *replay*, at full shapes. Each call feeds its folded loss from the step's inputs. For
   PipeshardParallel it binds ``pipeline_grad_p`` (the pipeline lowering replaces it with
   staged programs); for ShardParallel it sums gradients over micro-batches in a ``lax.scan``.

The step's jaxpr is then "everything before the gradient" + the gradient + "apply gradient".
For the pipeline, a step whose losses read only its inputs and their own arguments is
traced once instead (``direct_trace``): the record pass would fold nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Primitive, jaxpr_as_fun
from jax.extend.core import Literal as JaxprLiteral

__all__ = [
    "GradCapture",
    "TracedStep",
    "pipeline_grad_p",
    "record_grads",
    "recorder_value_and_grad",
    "trace_with_grads",
]

GRAD_NAME = "alpa_pipeline_grad"

Mode = Literal["pipeline", "accumulate"]


@dataclass(frozen=True, eq=False)
class GradCapture:
    """One ``alpa_mini.grad`` call: the loss on one micro-batch and where its inputs come from.

    ``loss`` takes one value per ``sources`` entry and returns ``[value, *aux leaves]``.
    ``("arg", j)``: leaf j of the arguments the loss was called with (differentiated);
    ``("step", k)``: leaf k of the step's inputs. ``diff[i]``: input i is differentiated;
    ``batch[i]``: input i is split into micro-batches along its leading dimension.
    """

    loss: ClosedJaxpr
    diff: tuple[bool, ...]
    batch: tuple[bool, ...]
    num_aux: int
    num_micro_batches: int
    sources: tuple[tuple[str, int], ...] = ()
    aux_tree: Any = None


@dataclass(frozen=True, eq=False)
class Recorded:
    """One call as the record pass saw it: the loss over (closed-over values, argument
    leaves), and which argument leaves are differentiated or named the batch."""

    loss: Jaxpr  # constvars: the closed-over values, bound first on the equation
    num_consts: int
    diff: tuple[bool, ...]
    named_batch: tuple[bool, ...]
    batch_arg: int | None
    aux_tree: Any
    out_avals: tuple[Any, ...]
    name: str
    fun: Callable[..., Any] | None = None  # the loss function and its argument tree, kept
    in_tree: Any = None  # so that fold_loss can say how to trace it alone (LossRecipe)
    has_aux: bool = False


@dataclass(frozen=True)
class TracedStep:
    """The step traced at full shapes, its output shapes and each grad call's capture;
    ``recipes`` (one per capture, None where the step must be traced again) trace a
    capture's loss at another micro-batch count without tracing the step. ``closed`` and
    ``out_shape`` are None where only the loss was traced (``trace_with_grads(loss_only=True)``)."""

    closed: ClosedJaxpr | None
    out_shape: Any
    captures: tuple[GradCapture, ...]
    recipes: tuple[Any, ...] = ()


@dataclass
class _Recorder:
    mode: Literal["record", "pipeline", "accumulate", "direct"]
    num_micro_batches: int
    captures: Sequence[GradCapture] = ()
    recorded: list[Recorded] = field(default_factory=list)
    step_inputs: Sequence[Any] = ()
    calls: int = 0
    # "direct" (``direct_trace``): the step's inputs on one micro-batch and at full shape,
    # their roles and names, and per call so far its recipe and loss name.
    micro: Sequence[Any] = ()
    full: Sequence[Any] = ()
    roles: Sequence[str] = ()
    names: Sequence[str] | None = None
    recipes: list[Any] = field(default_factory=list)
    loss_names: list[str] = field(default_factory=list)
    loss_only: bool = False  # "direct": stop the trace once the first call is captured


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "alpa_mini_grad_recorder", default=None
)

pipeline_grad_p = Primitive(GRAD_NAME)
pipeline_grad_p.multiple_results = True


def _abstract_eval(*avals: Any, index: int, out_avals: tuple[Any, ...]) -> list[Any]:
    return list(out_avals)


def _impl(*args: Any, index: int, out_avals: tuple[Any, ...]) -> list[Any]:
    raise RuntimeError(
        "alpa_mini.grad was captured for PipeshardParallel but evaluated outside it; call the "
        "step through its @parallelize wrapper"
    )


pipeline_grad_p.def_abstract_eval(_abstract_eval)
pipeline_grad_p.def_impl(_impl)


@contextlib.contextmanager
def _active(rec: _Recorder) -> Iterator[_Recorder]:
    token = _ACTIVE.set(rec)
    try:
        yield rec
    finally:
        _ACTIVE.reset(token)


def trace_with_grads(
    fun: Callable[..., Any],
    avals: Sequence[Any],
    roles: Sequence[str],
    num_micro_batches: int,
    mode: Mode,
    names: Sequence[str] | None = None,
    earlier: TracedStep | None = None,
    loss_only: bool = False,
) -> TracedStep:
    """Trace ``fun`` over flat leaves ``avals`` (``roles[k] == "batch"`` marks batch leaves,
    ``names`` name them in errors) with ``alpa_mini.grad`` captured (``"pipeline"``) or
    accumulated (``"accumulate"``).

    ``earlier``: the same step traced in ``"pipeline"`` mode at another micro-batch count.
    Its replay is reused when every capture binds the same inputs and results, since the
    full-shape step then differs only in the captures it refers to by index.
    ``loss_only`` (``"pipeline"``, for a plan alone): where the step is traced once
    (``direct_trace``), stop at its first grad call, whose loss is all that planning reads;
    the step's jaxpr (its optimiser update: most of a large model's trace) is then None,
    and the step is checked in full when the plan is compiled."""
    names = names or getattr(fun, "leaf_names", None)  # (``executable.StepFun``'s paths)
    recipes = earlier.recipes if earlier is not None and mode == "pipeline" else ()
    if recipes and all(r is not None for r in recipes):
        # Every loss reads only step inputs and its own arguments: trace the losses alone at
        # this count's shapes (not the whole step, optimiser update included).
        micro = _micro_avals(avals, roles, num_micro_batches, names)
        captures = tuple(r.capture(micro, roles, num_micro_batches) for r in recipes)
    elif mode == "pipeline" and earlier is None:
        from .direct_trace import NotDirect, trace_direct

        try:  # once, where every loss reads only step inputs and its own arguments
            return trace_direct(fun, avals, roles, num_micro_batches, names, loss_only)
        except NotDirect:
            captures, recipes = record_grads(fun, avals, roles, num_micro_batches, names)
    else:
        captures, recipes = record_grads(fun, avals, roles, num_micro_batches, names)
    if (
        mode == "pipeline"
        and earlier is not None
        and len(earlier.captures) == len(captures)
        and all(map(_binds_alike, earlier.captures, captures))
    ):
        return TracedStep(earlier.closed, earlier.out_shape, captures, recipes)
    replay = _Recorder(mode, num_micro_batches, captures)
    with _active(replay):
        closed, out_shape = jax.make_jaxpr(lambda *a: _enter(replay, a, fun), return_shape=True)(
            *avals
        )
    # The replayed step still computes what the loss used to read (now folded into it).
    closed = _prune_dead(closed)
    if replay.calls != len(captures):
        raise RuntimeError(
            f"the step called alpa_mini.grad {len(captures)} times on one micro-batch and "
            f"{replay.calls} times on the full batch; the step must not branch on batch shapes"
        )
    return TracedStep(closed, out_shape, captures, recipes)


def record_grads(
    fun: Callable[..., Any],
    avals: Sequence[Any],
    roles: Sequence[str],
    num_micro_batches: int,
    names: Sequence[str] | None = None,
) -> tuple[tuple[GradCapture, ...], tuple[Any, ...]]:
    """The record pass alone: each ``alpa_mini.grad`` call's loss on one micro-batch, folded
    into a function of the step's inputs, and its ``LossRecipe`` (or None)."""
    from .loss_fold import fold_loss

    B = num_micro_batches
    micro = _micro_avals(avals, roles, B, names)
    rec = _Recorder("record", B)
    with _active(rec):
        try:
            # A fresh closure each time: JAX caches traces by function, and an equal function
            # kept alive elsewhere would be served from that cache without running.
            recorded = jax.make_jaxpr(lambda *a: _enter(rec, a, fun))(*micro)
        except Exception as err:
            add_micro_batch_note(err, avals, roles, B, names)
            raise
    folded = fold_loss(recorded, rec.recorded, roles, B)
    return tuple(c for c, _ in folded), tuple(r for _, r in folded)


def add_micro_batch_note(
    err: BaseException,
    avals: Sequence[Any],
    roles: Sequence[str],
    count: int,
    names: Sequence[str] | None,
) -> None:
    """Say on ``err``, raised while the step was traced on one micro-batch, that its batch
    leaves were cut, with each one's rows where they differ (a value every row shares, put
    in the batch argument, is cut with it)."""
    if count <= 1:
        return
    note = (
        f"(while tracing the step on one micro-batch: its batch leaves cut to 1/{count} of "
        "their leading dimension, so that what derives from them is split too"
    )
    rows = [(k, a.shape[0]) for k, (a, r) in enumerate(zip(avals, roles, strict=True))
            if r == "batch" and a.shape]  # fmt: skip
    if len({n for _, n in rows}) > 1:
        shown = ", ".join(f"{names[k] if names else f'leaf {k}'}: {n}" for k, n in rows[:6])
        note += (
            f"; the batch leaves' rows differ ({shown}{', ...' if len(rows) > 6 else ''}): a "
            "value every row shares, such as position ids, belongs in another argument"
        )
    batch = [a for a, r in zip(avals, roles, strict=True) if r == "batch"]
    if batch and all(a.dtype == np.uint32 and a.shape[-1:] == (2,) for a in batch):
        note += (
            "; the batch looks like a raw PRNG key (jax.random.PRNGKey), which is cut with it: "
            "pass a typed key (jax.random.key), never split, or name the batch in "
            "parallelize(batch_argnums=...)"
        )
    err.add_note(note + ")")


def _micro_avals(
    avals: Sequence[Any], roles: Sequence[str], count: int, names: Sequence[str] | None
) -> list[Any]:
    """The step's input avals on one micro-batch: batch leaves cut to 1/count of their rows."""
    names = names or [f"leaf {k}" for k in range(len(avals))]
    return [
        _micro_aval(a, count, names[k]) if r == "batch" else a
        for k, (a, r) in enumerate(zip(avals, roles, strict=True))
    ]


def _binds_alike(a: GradCapture, b: GradCapture) -> bool:
    """Whether the full-shape replay binds ``a`` and ``b`` alike: the same step inputs and
    argument leaves in (batch inputs aside, which differ by design), the same results out."""

    def fixed(c: GradCapture) -> list[Any]:
        return [x for x, is_batch in zip(c.loss.in_avals, c.batch, strict=True) if not is_batch]

    return (
        (a.sources, a.diff, a.batch, a.num_aux) == (b.sources, b.diff, b.batch, b.num_aux)
        and a.aux_tree == b.aux_tree
        and fixed(a) == fixed(b)
        and _out_avals(a) == _out_avals(b)
    )


def _prune_dead(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` without equations whose results nothing reads (effects and grad calls kept)."""
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if not isinstance(v, JaxprLiteral)}
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or eqn.primitive.name == GRAD_NAME or any(v in live for v in eqn.outvars):
            kept.append(eqn)
            live.update(v for v in eqn.invars if not isinstance(v, JaxprLiteral))
    if len(kept) == len(jaxpr.eqns):
        return closed
    return ClosedJaxpr(jaxpr.replace(eqns=kept[::-1]), closed.consts)


def _enter(rec: _Recorder, leaves: Sequence[Any], fun: Callable[..., Any]) -> Any:
    rec.step_inputs = leaves
    return fun(*leaves)


def _micro_aval(a: Any, count: int, name: str) -> jax.ShapeDtypeStruct:
    shape = tuple(a.shape)
    if not shape or shape[0] % count:
        raise ValueError(
            f"num_micro_batches: {count} does not divide the batch dimension of the batch "
            f"argument {name} (shape {shape}); use a count that divides the batch size"
        )
    weak = getattr(a, "weak_type", False)
    return jax.ShapeDtypeStruct((shape[0] // count, *shape[1:]), a.dtype, weak_type=weak)


def recorder_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...],
    has_aux: bool,
    batch_argnum: int | None,
    args: tuple[Any, ...],
) -> Any:
    """``jax.value_and_grad(fun, argnums, has_aux)(*args)`` inside ``trace_with_grads``, or
    ``None`` when no step is being traced (plain JAX then differentiates)."""
    rec = _ACTIVE.get()
    if rec is None:
        return None
    n = len(args)
    nums = _check_argnums(argnums, n)
    if batch_argnum is not None and not -n <= batch_argnum < n:
        raise ValueError(f"batch_argnum: {batch_argnum} is out of range for {n} arguments")
    b = None if batch_argnum is None else batch_argnum % n
    if b is not None and b in nums:
        raise ValueError(
            f"batch_argnum: argument {b} is both differentiated (argnums={argnums}) and the batch"
        )
    leaves = jax.tree.leaves(args)
    index = rec.calls
    rec.calls += 1
    if rec.mode == "record":
        outs, aux_tree = _record(rec, fun, has_aux, nums, b, args)
    elif rec.mode == "direct":
        from .direct_trace import direct_call

        outs, aux_tree = direct_call(rec, fun, has_aux, nums, b, args)
    else:
        if index >= len(rec.captures):
            raise RuntimeError(
                "the step called alpa_mini.grad more often on the full batch than on one "
                "micro-batch; the step must not branch on batch shapes"
            )
        capture = rec.captures[index]
        values = _source_values(capture, leaves, rec.step_inputs)
        if rec.mode == "pipeline":
            outs = pipeline_grad_p.bind(*values, index=index, out_avals=_out_avals(capture))
        else:
            outs = _accumulate(capture, values)
        aux_tree = capture.aux_tree
    return _results(outs, aux_tree, has_aux, argnums, nums, args)


def _check_argnums(argnums: int | tuple[int, ...], n: int) -> list[int]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -n <= a < n:
            raise ValueError(f"argnums: {a} is out of range for {n} arguments")
    return [a % n for a in nums]


def _record(
    rec: _Recorder,
    fun: Callable[..., Any],
    has_aux: bool,
    nums: list[int],
    b: int | None,
    args: tuple[Any, ...],
) -> tuple[list[Any], Any]:
    """Trace the loss (closed-over values made explicit) and bind the grad equation."""
    leaves, in_tree, owner = _flat_args(args)
    abstract = [
        jax.ShapeDtypeStruct(
            np.shape(x),
            # (a PRNG key's dtype is not a NumPy one: it is read off the value)
            jax.dtypes.canonicalize_dtype(getattr(x, "dtype", None) or np.result_type(x), True),
        )
        for x in leaves
    ]
    aux_trees: list[Any] = []

    def flat_loss(*flat: Any) -> list[Any]:
        out = fun(*jax.tree.unflatten(in_tree, flat))
        value, aux = out if has_aux else (out, None)
        aux_leaves, tree = jax.tree.flatten(aux)
        aux_trees.append(tree)
        return [value, *aux_leaves]

    loss = jax.make_jaxpr(flat_loss)(*abstract)
    value_aval = loss.out_avals[0]
    name = getattr(fun, "__name__", "loss")
    if value_aval.shape != () or not jnp.issubdtype(value_aval.dtype, jnp.floating):
        raise TypeError(
            f"{name} must return a float scalar to differentiate, got {value_aval.str_short()}"
        )
    diff = tuple(o in nums for o in owner)
    grad_avals = [
        jax.core.ShapedArray(a.shape, a.dtype) for a, d in zip(abstract, diff, strict=True) if d
    ]
    out_avals = (*loss.out_avals, *grad_avals)
    rec.recorded.append(
        Recorded(
            loss.jaxpr,
            len(loss.consts),
            diff,
            tuple(o == b for o in owner),
            b,
            aux_trees[-1],
            out_avals,
            name,
            fun,
            in_tree,
            has_aux,
        )
    )
    index = len(rec.recorded) - 1
    outs = pipeline_grad_p.bind(*loss.consts, *leaves, index=index, out_avals=out_avals)
    return outs, aux_trees[-1]


def _flat_args(args: tuple[Any, ...]) -> tuple[list[Any], Any, list[int]]:
    """A grad call's argument leaves, their tree, and per leaf the argument it is of."""
    leaves, in_tree = jax.tree.flatten(args)
    return leaves, in_tree, [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]


def _source_values(
    capture: GradCapture, leaves: Sequence[Any], step_inputs: Sequence[Any]
) -> list[Any]:
    values = []
    for kind, i in capture.sources:
        if kind == "arg":
            want = capture.loss.in_avals[len(values)]
            if np.shape(leaves[i]) != want.shape:
                raise ValueError(
                    f"differentiated argument leaf {i} has shape {np.shape(leaves[i])} on the "
                    f"full batch and {want.shape} on one micro-batch: a differentiated value "
                    "must not derive from the batch"
                )
            values.append(leaves[i])
        else:
            values.append(step_inputs[i])
    return values


def _out_avals(capture: GradCapture) -> tuple[Any, ...]:
    outs = capture.loss.out_avals
    grads = [a for a, d in zip(capture.loss.in_avals, capture.diff, strict=True) if d]
    return (*outs, *(jax.core.ShapedArray(a.shape, a.dtype) for a in grads))


def _accumulate(capture: GradCapture, values: list[Any]) -> list[Any]:
    """Value, aux and gradients summed over micro-batches in a ``lax.scan``, then averaged,
    which equals the full-batch value when the loss is a mean over examples."""
    B = capture.num_micro_batches
    loss = jaxpr_as_fun(capture.loss)
    split = [
        x.reshape(B, x.shape[0] // B, *x.shape[1:])
        for x, is_batch in zip(values, capture.batch, strict=True)
        if is_batch
    ]
    fixed = [x for x, is_batch in zip(values, capture.batch, strict=True) if not is_batch]

    def evaluate(micro: Sequence[Any]) -> list[Any]:
        it_micro, it_fixed = iter(micro), iter(fixed)
        full = [next(it_micro) if is_batch else next(it_fixed) for is_batch in capture.batch]
        diff = [x for x, d in zip(full, capture.diff, strict=True) if d]

        def of_diff(d_vals: list[Any]) -> tuple[Any, list[Any]]:
            it = iter(d_vals)
            outs = loss(*[next(it) if d else x for x, d in zip(full, capture.diff, strict=True)])
            return outs[0], list(outs[1:])

        (value, aux), grads = jax.value_and_grad(of_diff, has_aux=True)(diff)
        return [value, *aux, *grads]

    if B == 1 or not split:  # one micro-batch, or a loss that reads nothing of the batch
        return evaluate([x.reshape(x.shape[1:]) for x in split])

    def body(acc: list[Any], micro: list[Any]) -> tuple[list[Any], None]:
        return [a + x for a, x in zip(acc, evaluate(micro), strict=True)], None

    first = jax.eval_shape(evaluate, [x[0] for x in split])
    zeros = [jnp.zeros(s.shape, s.dtype) for s in first]
    total, _ = jax.lax.scan(body, zeros, split)
    return [x / B for x in total]


def _results(
    outs: Sequence[Any],
    aux_tree: Any,
    has_aux: bool,
    argnums: int | tuple[int, ...],
    nums: list[int],
    args: tuple[Any, ...],
) -> tuple[Any, Any]:
    """``((value, aux) or value, grads)`` shaped as ``jax.value_and_grad`` returns them."""
    num_aux = aux_tree.num_leaves
    value = outs[0]
    aux = jax.tree.unflatten(aux_tree, outs[1 : 1 + num_aux])
    flat_grads = iter(outs[1 + num_aux :])
    by_arg = {}
    for i in sorted(set(nums)):
        arg_leaves, tree = jax.tree.flatten(args[i])
        by_arg[i] = jax.tree.unflatten(tree, [next(flat_grads) for _ in arg_leaves])
    grads = by_arg[nums[0]] if isinstance(argnums, int) else tuple(by_arg[a] for a in nums)
    return ((value, aux) if has_aux else value), grads
