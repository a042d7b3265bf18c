"""A plain multi-layer perceptron, plus the small building blocks the other models share.

Parameter layout (a pytree of fp32 arrays)::

    params = {"layers": [{"w": [d_i, d_{i+1}], "b": [d_{i+1}]}, ...]}

with ``d = (in_dim, hidden, ..., hidden, out_dim)`` (``num_layers`` dense layers, so
``num_layers - 1`` hidden widths). ``"b"`` is absent when ``use_bias=False``. The activation
is applied between layers, never after the last one. Parameter count:
``sum_i d_i * d_{i+1} (+ d_{i+1} with bias)``.

The shared blocks (``layer_norm``, ``softmax_cross_entropy``, ``split_normal``,
``count_params``, ``check_positive_int``) live here because every other model in the
package builds on them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini._validate import MAX_SIZE, positive_int
from alpa_mini.errors import ConfigError

__all__ = [
    "ACTIVATIONS",
    "MLPConfig",
    "check_positive_int",
    "count_params",
    "init_layer_norm",
    "init_mlp",
    "layer_norm",
    "make_mlp_batch",
    "mlp_forward",
    "mlp_loss",
    "mlp_num_params",
    "softmax_cross_entropy",
    "split_normal",
]

Params = dict[str, Any]

_TEACHER_SEED = 1234  # fixed, so every batch comes from the same learnable target

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "tanh": jnp.tanh,
}


def check_positive_int(owner: str, name: str, value: object) -> None:
    """Raise a ``ConfigError`` naming ``owner.name`` unless ``value`` is an int from 1 to
    ``MAX_SIZE`` (the largest dimension the planner represents)."""
    positive_int(f"{owner}.{name}", value, high=MAX_SIZE)


def check_bools(owner: str, config: object, names: tuple[str, ...]) -> None:
    """Raise a ``ConfigError`` naming ``owner.name`` for the first field that is not a bool."""
    for name in names:
        if not isinstance(getattr(config, name), bool):
            raise ConfigError(
                f"{owner}.{name}: {getattr(config, name)!r} is invalid; expected a bool"
            )


def count_params(params: Any) -> int:
    """Total number of scalars in a pytree of arrays or ``jax.ShapeDtypeStruct`` leaves."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


def split_normal(key: jax.Array, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    """Standard-normal fp32 arrays of the given shapes, all cut from one flat draw.

    One 1-D draw compiles in a fraction of a second, while each separate N-D
    ``jax.random.normal`` adds about a second of XLA compile time on CPU.
    """
    sizes = [math.prod(shape) for shape in shapes]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out


def init_layer_norm(dim: int) -> Params:
    """Layer-norm parameters: unit scale and zero bias over the last axis."""
    return {"scale": jnp.ones((dim,), jnp.float32), "bias": jnp.zeros((dim,), jnp.float32)}


def layer_norm(params: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Normalise over the last axis in fp32 (stable in low precision), then scale and shift."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * params["scale"] + params["bias"]
    return y.astype(x.dtype)


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of integer ``labels`` under ``logits`` (class axis last)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)
    return -jnp.mean(picked)


@dataclass(frozen=True)
class MLPConfig:
    """Shape of an MLP: ``num_layers`` dense layers ``in_dim -> hidden ... -> out_dim``."""

    in_dim: int
    hidden: int
    out_dim: int
    num_layers: int = 2
    use_bias: bool = True
    activation: str = "relu"

    def __post_init__(self) -> None:
        for name in ("in_dim", "hidden", "out_dim", "num_layers"):
            check_positive_int("MLPConfig", name, getattr(self, name))
        if not isinstance(self.use_bias, bool):
            raise ConfigError(f"MLPConfig.use_bias: {self.use_bias!r} is invalid; expected a bool")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"MLPConfig.activation: {self.activation!r} is invalid; "
                f"expected one of {', '.join(sorted(ACTIVATIONS))}"
            )

    @property
    def dims(self) -> tuple[int, ...]:
        """Feature widths at every layer boundary, input first."""
        return (self.in_dim, *([self.hidden] * (self.num_layers - 1)), self.out_dim)


def mlp_num_params(config: MLPConfig) -> int:
    """Closed-form parameter count of ``init_mlp(config, ...)``."""
    d = config.dims
    return sum(a * b + (b if config.use_bias else 0) for a, b in itertools.pairwise(d))


def init_mlp(config: MLPConfig, key: jax.Array) -> Params:
    """LeCun-normal weights (std 1/sqrt(fan_in)) and zero biases, in the documented layout."""
    d = config.dims
    weights = split_normal(key, list(itertools.pairwise(d)))
    layers = []
    for w in weights:
        fan_in, fan_out = w.shape
        layer = {"w": w / fan_in**0.5}
        if config.use_bias:
            layer["b"] = jnp.zeros((fan_out,), jnp.float32)
        layers.append(layer)
    return {"layers": layers}


def mlp_forward(params: Params, x: jax.Array, config: MLPConfig | None = None) -> jax.Array:
    """Apply the MLP to ``x [..., in_dim]``; ``config`` only supplies the activation (relu)."""
    act = ACTIVATIONS[config.activation if config is not None else "relu"]
    layers = params["layers"]
    for i, layer in enumerate(layers):
        x = x @ layer["w"]
        if "b" in layer:
            x = x + layer["b"]
        if i < len(layers) - 1:
            x = act(x)
    return x


def mlp_loss(
    params: Params, batch: dict[str, jax.Array], config: MLPConfig | None = None
) -> jax.Array:
    """Mean squared error of ``mlp_forward(batch["x"])`` against ``batch["y"]``."""
    pred = mlp_forward(params, batch["x"], config)
    return jnp.mean(jnp.square(pred - batch["y"]))


def make_mlp_batch(config: MLPConfig, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """A learnable regression batch: ``y = tanh(x @ W_teacher)``, one fixed teacher for all keys."""
    check_positive_int("make_mlp_batch", "batch_size", batch_size)
    (x,) = split_normal(key, [(batch_size, config.in_dim)])
    (teacher,) = split_normal(jax.random.key(_TEACHER_SEED), [(config.in_dim, config.out_dim)])
    return {"x": x, "y": jnp.tanh(x @ teacher / config.in_dim**0.5)}
