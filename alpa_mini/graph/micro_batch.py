"""``alpa_mini.grad`` / ``value_and_grad``: ``jax.grad`` that a parallelized step splits into
micro-batches.

Inside a step traced for ``ShardParallel(num_micro_batches>1)`` or ``PipeshardParallel``,
whatever the loss reads that derives from the step's batch arguments (passed to the loss or
closed over) is split into micro-batches; gradients are summed over them and the loss (and
aux) averaged, which equals the full-batch value when the loss is a mean over examples
(``grad_capture`` has how). Anywhere else they behave exactly like ``jax.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from .grad_capture import recorder_value_and_grad

__all__ = ["grad", "value_and_grad"]


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    batch_argnum: int | None = None,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` with micro-batch accumulation in a parallelized step.

    What is split follows the data flow from the step's ``batch_argnums``; ``batch_argnum``
    (an argument of ``fun``) only asserts that argument is part of the batch, with an error
    naming it when it is not.
    """
    vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any) -> Any:
        out = recorder_value_and_grad(fun, argnums, has_aux, batch_argnum, args)
        return vg(*args) if out is None else out

    return wrapped


def grad(
    fun: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    batch_argnum: int | None = None,
) -> Callable[..., Any]:
    """``jax.grad`` with micro-batch accumulation (see ``value_and_grad``)."""
    vg = value_and_grad(fun, argnums, has_aux, batch_argnum)

    def wrapped(*args: Any) -> Any:
        (value, grads) = vg(*args)
        if has_aux:
            return grads, value[1]
        return grads

    return wrapped
