"""A small Wide-ResNet (pre-activation residual blocks of 3x3 convolutions), stateless.

Parameter layout (fp32 arrays; C = in_channels, W = width, K = num_classes)::

    params = {
        "stem": {"w": [3, 3, C, W]},                       # HWIO kernel
        "blocks": [
            {"norm1": {"scale": [W], "bias": [W]}, "conv1": {"w": [3, 3, W, W]},
             "norm2": {"scale": [W], "bias": [W]}, "conv2": {"w": [3, 3, W, W]}},
            ...                                            # num_blocks of them
        ],
        "norm_f": {"scale": [W], "bias": [W]},
        "head": {"w": [W, K], "b": [K]},
    }

Parameter count: ``9*C*W + num_blocks*(18*W^2 + 4*W) + 2*W + W*K + K``.

Images are NHWC; every convolution is 3x3, stride 1, SAME padding, no bias (a norm follows).
Normalisation is layer norm over the channels of each pixel, so there is no batch statistic
and no mutable state. A block is ``x + conv2(relu(norm2(conv1(relu(norm1(x))))))``; the head
is ``relu(norm_f(.))``, global average pooling and a dense classifier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .mlp import (
    check_positive_int,
    init_layer_norm,
    layer_norm,
    softmax_cross_entropy,
    split_normal,
)

__all__ = [
    "WideResNetConfig",
    "conv3x3",
    "init_wide_resnet",
    "make_wide_resnet_batch",
    "wide_resnet_forward",
    "wide_resnet_loss",
    "wide_resnet_num_params",
]

Params = dict[str, Any]

_CONV_DIMS = ("NHWC", "HWIO", "NHWC")
_PATTERN_SEED = 2468  # fixed, so every batch comes from the same learnable task
_NOISE_STD = 0.5  # per-pixel noise on top of the unit-variance class pattern


@dataclass(frozen=True)
class WideResNetConfig:
    """Shape of a Wide-ResNet: square images, a constant width and ``num_blocks`` blocks."""

    image_size: int
    in_channels: int
    width: int
    num_blocks: int
    num_classes: int

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "width", "num_blocks", "num_classes"):
            check_positive_int("WideResNetConfig", name, getattr(self, name))


def wide_resnet_num_params(config: WideResNetConfig) -> int:
    """Closed-form parameter count of ``init_wide_resnet(config, ...)``."""
    c, w, k = config.in_channels, config.width, config.num_classes
    return 9 * c * w + config.num_blocks * (18 * w * w + 4 * w) + 2 * w + w * k + k


def conv3x3(x: jax.Array, w: jax.Array) -> jax.Array:
    """3x3, stride-1, SAME convolution of NHWC ``x`` with an HWIO kernel ``w``."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(1, 1), padding="SAME", dimension_numbers=_CONV_DIMS
    )


def init_wide_resnet(config: WideResNetConfig, key: jax.Array) -> Params:
    """He-normal convs (std sqrt(2 / fan_in)); each block's second conv is scaled down 10x.

    The small last conv keeps every residual branch small at init, so deep stacks are stable.
    """
    c, w, k = config.in_channels, config.width, config.num_classes
    he = math.sqrt(2.0 / (9 * w))
    stem, head, *convs = split_normal(
        key, [(3, 3, c, w), (w, k), *[(3, 3, w, w)] * (2 * config.num_blocks)]
    )
    blocks = [
        {
            "norm1": init_layer_norm(w),
            "conv1": {"w": he * convs[2 * i]},
            "norm2": init_layer_norm(w),
            "conv2": {"w": 0.1 * he * convs[2 * i + 1]},
        }
        for i in range(config.num_blocks)
    ]
    return {
        "stem": {"w": math.sqrt(2.0 / (9 * c)) * stem},
        "blocks": blocks,
        "norm_f": init_layer_norm(w),
        "head": {"w": head / math.sqrt(w), "b": jnp.zeros((k,), jnp.float32)},
    }


def wide_resnet_forward(params: Params, images: jax.Array) -> jax.Array:
    """Class logits ``[B, K]`` for NHWC ``images [B, H, W, C]``."""
    x = conv3x3(images, params["stem"]["w"])
    for block in params["blocks"]:
        h = conv3x3(jax.nn.relu(layer_norm(block["norm1"], x)), block["conv1"]["w"])
        h = conv3x3(jax.nn.relu(layer_norm(block["norm2"], h)), block["conv2"]["w"])
        x = x + h
    pooled = jnp.mean(jax.nn.relu(layer_norm(params["norm_f"], x)), axis=(1, 2))
    return pooled @ params["head"]["w"] + params["head"]["b"]


def wide_resnet_loss(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean softmax cross-entropy of ``batch["labels"]`` given ``batch["images"]``."""
    return softmax_cross_entropy(wide_resnet_forward(params, batch["images"]), batch["labels"])


def make_wide_resnet_batch(
    config: WideResNetConfig, key: jax.Array, batch_size: int
) -> dict[str, jax.Array]:
    """Noisy images of one fixed random pattern per class; the label names the pattern.

    The patterns come from a fixed seed, so every batch poses the same learnable task.
    """
    check_positive_int("make_wide_resnet_batch", "batch_size", batch_size)
    s, c, k = config.image_size, config.in_channels, config.num_classes
    k_label, k_noise = jax.random.split(key)
    (patterns,) = split_normal(jax.random.key(_PATTERN_SEED), [(k, s, s, c)])
    labels = jax.random.randint(k_label, (batch_size,), 0, k, jnp.int32)
    (noise,) = split_normal(k_noise, [(batch_size, s, s, c)])
    return {"images": patterns[labels] + _NOISE_STD * noise, "labels": labels}
