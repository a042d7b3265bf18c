"""A pipeshard step traced once, where every loss reads only step inputs and its arguments.

``trace_with_grads`` traces a step twice: a record pass on one micro-batch, whose jaxpr
``loss_fold`` follows back to fold each loss into a function of the step's inputs, then a
replay at full shapes. When each ``alpa_mini.grad`` call passes step inputs as they are (its
non-differentiated argument leaves) and its loss closes over nothing traced, the folded loss
is the loss function itself (``LossRecipe``), and the record pass only repeats the step's
other work (its optimiser update) at other shapes. Here the step is traced once at full
shapes, and each such call traces its loss at micro-batch shapes where it is made. The first
call that is not of that kind stops the trace (``NotDirect``), and the step is traced twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .grad_capture import (
    GRAD_NAME,
    TracedStep,
    _active,
    _enter,
    _flat_args,
    _micro_avals,
    _out_avals,
    _prune_dead,
    _Recorder,
    _source_values,
    add_micro_batch_note,
    pipeline_grad_p,
)
from .loss_fold import LossRecipe, _capture, _derives_from_batch

__all__ = ["NotDirect", "direct_call", "trace_direct"]


class NotDirect(Exception):
    """A grad call whose loss must be folded from a record pass."""


class _LossCaptured(BaseException):
    """Stops a ``loss_only`` trace at its first grad call, carrying the call's differentiated
    values out of the step. A BaseException, so that a step's own ``except Exception`` does
    not swallow it."""

    def __init__(self, differentiated: list[Any]) -> None:
        super().__init__()
        self.differentiated = differentiated


def trace_direct(
    fun: Callable[..., Any],
    avals: Sequence[Any],
    roles: Sequence[str],
    num_micro_batches: int,
    names: Sequence[str] | None = None,
    loss_only: bool = False,
) -> TracedStep:
    """The step at full shapes with every grad call captured, traced once; raises
    ``NotDirect`` where some call needs the record pass. ``loss_only``: stop at the first
    call once it is captured, having traced only what computes its differentiated values
    (checked as ``_check_calls`` checks them); the step's jaxpr and output shapes are then
    None."""
    rec = _Recorder("direct", num_micro_batches, [])
    rec.micro = _micro_avals(avals, roles, num_micro_batches, names)
    rec.roles = roles
    rec.full, rec.names = avals, names  # (for errors in a loss traced on one micro-batch)
    rec.loss_only = loss_only
    stopped: list[bool] = []

    def until_loss(*leaves: Any) -> Any:
        try:
            return _enter(rec, leaves, fun)
        except _LossCaptured as stop:
            stopped.append(True)
            return stop.differentiated

    with _active(rec):
        closed, out_shape = jax.make_jaxpr(until_loss, return_shape=True)(*avals)
    if stopped:  # ``closed``: from the step's inputs to the call's differentiated values
        _check_differentiated(closed.jaxpr, closed.jaxpr.outvars, rec, 0)
        return TracedStep(None, None, tuple(rec.captures), tuple(rec.recipes))
    _check_calls(closed, rec)
    return TracedStep(_prune_dead(closed), out_shape, tuple(rec.captures), tuple(rec.recipes))


def direct_call(
    rec: _Recorder,
    fun: Callable[..., Any],
    has_aux: bool,
    nums: list[int],
    b: int | None,
    args: tuple[Any, ...],
) -> tuple[list[Any], Any]:
    """Capture one grad call made while ``trace_direct`` traces: its loss traced on one
    micro-batch over (differentiated leaves, the step inputs passed), bound as the grad
    equation on full-shape values."""
    leaves, in_tree, owner = _flat_args(args)
    diff = tuple(o in nums for o in owner)
    index = {id(x): k for k, x in enumerate(rec.step_inputs)}
    leaf_step = []
    for j, (x, d) in enumerate(zip(leaves, diff, strict=True)):
        k = -1 if d else index.get(id(x), -1)
        if not d and (k < 0 or rec.step_inputs[k] is not x):
            raise NotDirect  # computed in the step, or a constant: fold it
        if not d and owner[j] == b and rec.roles[k] != "batch":
            raise ValueError(
                f"batch_argnum: argument {b} of {_name(fun)} (leaf {j}) does not derive from "
                "the step's batch arguments; name the step argument it comes from in "
                "parallelize(batch_argnums=...)"
            )
        leaf_step.append(k)
    step_ins = tuple(sorted({k for k in leaf_step if k >= 0}))
    diff_avals = tuple(_struct(x) for x, d in zip(leaves, diff, strict=True) if d)
    if any(a.weak_type for a in diff_avals) or any(
        getattr(rec.micro[k], "weak_type", False) for k in step_ins
    ):
        raise NotDirect  # weak types: fold as traced
    sources = tuple(("arg", j) for j, d in enumerate(diff) if d)
    sources += tuple(("step", k) for k in step_ins)
    recipe = LossRecipe(
        fun, in_tree, has_aux, diff, tuple(leaf_step), step_ins, diff_avals, sources, None
    )
    try:
        loss, aux_tree = recipe.trace(rec.micro)
    except Exception as err:
        add_micro_batch_note(err, rec.full, rec.roles, rec.num_micro_batches, rec.names)
        raise
    if loss.consts:
        raise NotDirect  # the loss closes over values: fold them
    value = loss.out_avals[0]
    if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{_name(fun)} must return a float scalar to differentiate, got {value.str_short()}"
        )
    capture = _capture(loss, sources, rec.roles, rec.num_micro_batches, aux_tree)
    rec.captures.append(capture)
    rec.recipes.append(dataclasses.replace(recipe, aux_tree=aux_tree))
    rec.loss_names.append(_name(fun))
    if rec.loss_only:
        differentiated = [x for x, d in zip(leaves, diff, strict=True) if d]
        # Inside a jit, vmap or scan of the step, its values are not the step's own: the
        # record pass says so (as ``_check_calls`` finds such a call missing at the top).
        # Where the trace cannot be told (JAX's tracers without ``_trace``), the record pass
        # decides too.
        step_trace = getattr(rec.step_inputs[0], "_trace", None) if rec.step_inputs else None
        if step_trace is None or any(
            getattr(x, "_trace", None) is not step_trace for x in differentiated
        ):
            raise NotDirect
        raise _LossCaptured(differentiated)
    values = _source_values(capture, leaves, rec.step_inputs)
    outs = pipeline_grad_p.bind(*values, index=len(rec.captures) - 1, out_avals=_out_avals(capture))
    return outs, aux_tree


def _check_calls(closed: Any, rec: _Recorder) -> None:
    """What the record pass's folding checks: every call is in the step itself, and no
    differentiated value derives from the batch or from an earlier call's results."""
    jaxpr = closed.jaxpr
    found = [e for e in jaxpr.eqns if e.primitive.name == GRAD_NAME]
    if len(found) != len(rec.captures):
        raise NotDirect  # a call inside a jit, vmap or scan: the record pass says so
    for eqn in found:
        index = eqn.params["index"]
        args = [v for (kind, _), v in zip(rec.captures[index].sources, eqn.invars, strict=True)
                if kind == "arg"]  # fmt: skip
        _check_differentiated(jaxpr, args, rec, index)


def _check_differentiated(jaxpr: Any, values: Sequence[Any], rec: _Recorder, index: int) -> None:
    """No differentiated value of call ``index`` (``values``, in its argument leaves' order)
    derives from the step's batch."""
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    leaves = [j for kind, j in rec.captures[index].sources if kind == "arg"]
    for j, v in zip(leaves, values, strict=True):
        if _derives_from_batch(jaxpr, v, producer, rec.roles):
            raise ValueError(
                f"{rec.loss_names[index]}: differentiated argument leaf {j} derives from the "
                "step's batch arguments; differentiate parameters, and pass or close over the "
                "batch"
            )


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct(np.shape(x), aval.dtype, weak_type=aval.weak_type)


def _name(fun: Callable[..., Any]) -> str:
    return getattr(fun, "__name__", "loss")
