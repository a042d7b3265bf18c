"""Capture ``alpa_mini.grad`` inside a step traced for ``PipeshardParallel``.

While a step is traced for pipelining, ``alpa_mini.value_and_grad(loss_fn)(*args)`` does not
differentiate: it traces ``loss_fn`` on one micro-batch into a flat jaxpr, records it, and
binds ``pipeline_grad_p``, an opaque equation with the shapes of ``(value, aux, grads)``.
The step's jaxpr is then "everything before the gradient" + that equation + "apply
gradient"; the pipeline lowering replaces the equation with staged forward/backward programs.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Primitive

__all__ = ["GradCapture", "capture_value_and_grad", "capturing", "is_capturing", "pipeline_grad_p"]

GRAD_NAME = "alpa_pipeline_grad"


@dataclass(frozen=True, eq=False)
class GradCapture:
    """One ``alpa_mini.grad`` call: the loss on one micro-batch and how its inputs are used.

    ``loss`` takes the flat leaves of the loss function's arguments (micro-batch shapes for
    batch leaves) and returns ``[value, *aux leaves]``. ``diff[i]``: leaf i is differentiated;
    ``batch[i]``: leaf i is split into micro-batches along its leading dimension.
    """

    loss: ClosedJaxpr
    diff: tuple[bool, ...]
    batch: tuple[bool, ...]
    num_aux: int
    num_micro_batches: int


class _Recorder:
    def __init__(self, num_micro_batches: int) -> None:
        self.num_micro_batches = num_micro_batches
        self.captures: list[GradCapture] = []


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    "alpa_mini_pipeline_capture", default=None
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
def capturing(num_micro_batches: int) -> Iterator[list[GradCapture]]:
    """Within this block ``alpa_mini.grad`` records its loss instead of differentiating."""
    rec = _Recorder(num_micro_batches)
    token = _ACTIVE.set(rec)
    try:
        yield rec.captures
    finally:
        _ACTIVE.reset(token)


def is_capturing() -> bool:
    return _ACTIVE.get() is not None


def capture_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...],
    has_aux: bool,
    batch_argnum: int,
    args: tuple[Any, ...],
) -> tuple[Any, Any]:
    """``jax.value_and_grad(fun, argnums, has_aux)(*args)`` as a recorded pipeline equation."""
    rec = _ACTIVE.get()
    assert rec is not None
    count = rec.num_micro_batches
    n = len(args)
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -n <= a < n:
            raise ValueError(f"argnums: {a} is out of range for {n} arguments")
    nums_set = {a % n for a in nums}
    b = batch_argnum % n
    if b in nums_set:
        raise ValueError(
            f"batch_argnum: argument {b} is both differentiated (argnums={argnums}) and the batch"
        )
    leaves, in_tree = jax.tree.flatten(args)
    owner = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    diff = tuple(o in nums_set for o in owner)
    batch = tuple(o == b for o in owner)
    micro = []
    for leaf, is_batch, path in zip(
        leaves,
        batch,
        (jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]),
        strict=True,
    ):
        shape, dtype = np.shape(leaf), jax.dtypes.canonicalize_dtype(np.result_type(leaf))
        if is_batch:
            if not shape or shape[0] % count:
                raise ValueError(
                    f"num_micro_batches: {count} does not divide the batch dimension of "
                    f"argument {b}{path} (shape {shape})"
                )
            shape = (shape[0] // count, *shape[1:])
        micro.append(jax.ShapeDtypeStruct(shape, dtype))
    aux_tree: list[Any] = []

    def flat_loss(*flat: Any) -> list[Any]:
        out = fun(*jax.tree.unflatten(in_tree, flat))
        value, aux = out if has_aux else (out, None)
        aux_leaves, tree = jax.tree.flatten(aux)
        aux_tree.append(tree)
        return [value, *aux_leaves]

    loss = jax.make_jaxpr(flat_loss)(*micro)
    value_aval = loss.out_avals[0]
    if value_aval.shape != () or not jax.numpy.issubdtype(value_aval.dtype, jax.numpy.floating):
        raise TypeError(
            f"{getattr(fun, '__name__', 'loss')} must return a float scalar to differentiate, "
            f"got {value_aval.str_short()}"
        )
    num_aux = len(loss.out_avals) - 1
    grad_avals = [
        jax.core.ShapedArray(np.shape(x), m.dtype)
        for x, m, d in zip(leaves, micro, diff, strict=True)
        if d
    ]
    out_avals = (*loss.out_avals, *grad_avals)
    index = len(rec.captures)
    rec.captures.append(GradCapture(loss, diff, batch, num_aux, count))
    outs = pipeline_grad_p.bind(*leaves, index=index, out_avals=out_avals)
    value = outs[0]
    aux = jax.tree.unflatten(aux_tree[-1], outs[1 : 1 + num_aux])
    flat_grads = iter(outs[1 + num_aux :])
    grads_per_arg = []
    for i in sorted(nums_set):
        arg_leaves, tree = jax.tree.flatten(args[i])
        grads_per_arg.append((i, jax.tree.unflatten(tree, [next(flat_grads) for _ in arg_leaves])))
    by_arg = dict(grads_per_arg)
    grads = by_arg[nums[0] % n] if isinstance(argnums, int) else tuple(by_arg[a % n] for a in nums)
    return ((value, aux) if has_aux else value), grads
