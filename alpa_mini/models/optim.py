"""Pure-JAX optimisers (SGD, Adam) and a generic train step, so nothing depends on optax.

An ``Optimizer`` is a pair of pure functions: ``init(params) -> state`` and
``update(grads, state, params) -> (new_params, new_state)``. States are pytrees of arrays:
SGD keeps ``{"count"}``, Adam ``{"count", "mu", "nu"}`` with ``mu``/``nu`` shaped like the
params. ``count`` is an int32 scalar holding the number of updates applied so far. A
learning rate is a number or a schedule ``count -> rate`` (called with the count before
the update, so the first step sees 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini.errors import ConfigError

__all__ = ["LearningRate", "Optimizer", "adam", "make_train_step", "sgd"]

PyTree = Any
LearningRate = float | Callable[[jax.Array], jax.Array | float]


@dataclass(frozen=True)
class Optimizer:
    """A named pair of pure functions: ``init`` builds the state, ``update`` applies a step."""

    name: str
    init: Callable[[PyTree], PyTree]
    update: Callable[[PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]


def _check_rate(owner: str, learning_rate: LearningRate) -> Callable[[jax.Array], Any]:
    """Validate a learning rate and return it as a schedule."""
    if callable(learning_rate):
        return learning_rate
    if (
        isinstance(learning_rate, bool)
        or not isinstance(learning_rate, int | float)
        or not math.isfinite(learning_rate)
        or learning_rate < 0
    ):
        raise ConfigError(
            f"{owner}.learning_rate: {learning_rate!r} is invalid; "
            "expected a finite number >= 0 or a callable schedule"
        )
    rate = float(learning_rate)
    return lambda count: rate


def _check_unit(owner: str, name: str, value: float) -> None:
    """Require ``0 <= value < 1`` (Adam's decay rates)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ConfigError(f"{owner}.{name}: {value!r} is invalid; expected 0 <= {name} < 1")


def sgd(learning_rate: LearningRate) -> Optimizer:
    """Plain gradient descent: ``p <- p - lr * g``."""
    schedule = _check_rate("sgd", learning_rate)

    def init(params: PyTree) -> PyTree:
        return {"count": jnp.zeros((), jnp.int32)}

    def update(grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        lr = schedule(state["count"])
        new_params = jax.tree.map(lambda p, g: (p - lr * g).astype(p.dtype), params, grads)
        return new_params, {"count": state["count"] + 1}

    return Optimizer("sgd", init, update)


def adam(
    learning_rate: LearningRate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8
) -> Optimizer:
    """Adam with bias correction: ``p <- p - lr * m_hat / (sqrt(v_hat) + eps)``."""
    schedule = _check_rate("adam", learning_rate)
    _check_unit("adam", "b1", b1)
    _check_unit("adam", "b2", b2)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ConfigError(f"adam.eps: {eps!r} is invalid; expected a number > 0")

    def init(params: PyTree) -> PyTree:
        def zeros() -> PyTree:  # separate buffers: a donated step must not see one twice
            return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        return {"count": jnp.zeros((), jnp.int32), "mu": zeros(), "nu": zeros()}

    def update(grads: PyTree, state: PyTree, params: PyTree) -> tuple[PyTree, PyTree]:
        lr = schedule(state["count"])
        count = state["count"] + 1
        t = count.astype(jnp.float32)
        mu = jax.tree.map(
            lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), state["mu"], grads
        )
        nu = jax.tree.map(
            lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), state["nu"], grads
        )
        mu_scale = 1.0 / (1.0 - b1**t)
        nu_scale = 1.0 / (1.0 - b2**t)

        def step(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            delta = lr * (m * mu_scale) / (jnp.sqrt(v * nu_scale) + eps)
            return (p - delta).astype(p.dtype)

        new_params = jax.tree.map(step, params, mu, nu)
        return new_params, {"count": count, "mu": mu, "nu": nu}

    return Optimizer("adam", init, update)


def make_train_step(
    loss_fn: Callable[[PyTree, Any], jax.Array],
    optimizer: Optimizer,
    value_and_grad: Callable[..., Any] = jax.value_and_grad,
) -> Callable[[PyTree, PyTree, Any], tuple[PyTree, PyTree, jax.Array]]:
    """``train_step(params, opt_state, batch) -> (params, opt_state, loss)``, not jitted.

    It is an ordinary function so that users decorate it themselves (``jax.jit``,
    ``alpa_mini.parallelize``); pass ``alpa_mini.value_and_grad`` for pipelined steps.
    """

    def train_step(
        params: PyTree, opt_state: PyTree, batch: Any
    ) -> tuple[PyTree, PyTree, jax.Array]:
        loss, grads = value_and_grad(loss_fn)(params, batch)
        new_params, new_state = optimizer.update(grads, opt_state, params)
        return new_params, new_state, loss

    return train_step
