"""Gradient accumulation: ``alpa_mini.grad`` / ``value_and_grad`` split the batch into
micro-batches when the parallel method asks for them, and behave like ``jax.grad`` otherwise.

The micro-batches run as a ``lax.scan`` that sums gradients, so the planner sees one
micro-batch's work weighted by the count. The loss (and aux) is the mean over micro-batches,
which equals the full-batch value when the loss is a mean over examples.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from . import grad_capture as pipeline_capture

__all__ = ["grad", "micro_batches", "num_micro_batches", "value_and_grad"]

_COUNT: contextvars.ContextVar[int] = contextvars.ContextVar("alpa_mini_micro_batches", default=1)


@contextlib.contextmanager
def micro_batches(count: int) -> Iterator[None]:
    """Within this block, ``alpa_mini.grad`` accumulates over ``count`` micro-batches."""
    token = _COUNT.set(int(count))
    try:
        yield
    finally:
        _COUNT.reset(token)


def num_micro_batches() -> int:
    return _COUNT.get()


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    batch_argnum: int = -1,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` that accumulates over micro-batches of argument ``batch_argnum``."""
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any) -> Any:
        if pipeline_capture.is_capturing():
            return pipeline_capture.capture_value_and_grad(
                fun, argnums, has_aux, batch_argnum, args
            )
        count = num_micro_batches()
        if count == 1:
            return vg(*args)
        b = batch_argnum % len(args)
        for path, leaf in jax.tree_util.tree_flatten_with_path(args[b])[0]:
            size = leaf.shape[0] if getattr(leaf, "ndim", 0) else None
            if size is None or size % count:
                raise ValueError(
                    f"num_micro_batches: {count} does not divide the batch dimension of "
                    f"argument {b}{jax.tree_util.keystr(path)} (size {size})"
                )
        split = jax.tree.map(lambda x: x.reshape(count, x.shape[0] // count, *x.shape[1:]), args[b])

        def body(acc: Any, mb: Any) -> tuple[Any, None]:
            call = list(args)
            call[b] = mb
            value, grads = vg(*call)
            return jax.tree.map(jnp.add, acc, (value, grads)), None

        first = jax.eval_shape(vg, *args)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), first)
        total, _ = jax.lax.scan(body, zeros, split)
        return jax.tree.map(lambda x: x / count, total)

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    batch_argnum: int = -1,
) -> Callable[..., Any]:
    """``jax.grad`` with micro-batch accumulation (see ``value_and_grad``)."""
    vg = value_and_grad(fun, argnums, has_aux, batch_argnum)

    def wrapped(*args: Any) -> Any:
        (value, grads) = vg(*args)
        if has_aux:
            return grads, value[1]
        return grads

    return wrapped
