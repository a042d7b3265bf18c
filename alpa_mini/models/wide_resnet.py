"""Wide-ResNets, stateless: a small constant-width one, and the bottleneck one of Alpa's suite.

``block="basic"`` (the default): pre-activation residual blocks of 3x3 convolutions at one
constant width and full resolution. Parameter layout (fp32 arrays; C = in_channels,
W = width, K = num_classes)::

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

Parameter count: ``9*C*W + num_blocks*(18*W^2 + 4*W) + 2*W + W*K + K``. Every convolution is
3x3, stride 1, SAME padding, no bias (a norm follows). A block is
``x + conv2(relu(norm2(conv1(relu(norm1(x))))))``; the head is ``relu(norm_f(.))``, global
average pooling and a dense classifier.

``block="bottleneck"``: the ResNet-50/101-style Wide-ResNet of Alpa's benchmark suite (Alpa's
``WResNetModelConfig(image_size, num_layers, num_channels, width_factor)`` maps to
``width=num_channels``, ``width_factor=width_factor`` and ``stage_sizes`` (3, 4, 6, 3) for 50
layers or (3, 4, 23, 3) for 101, ``num_blocks`` being their sum). A 7x7 stride-2 stem conv
(width W), norm, relu and a 3x3 stride-2 max pool, then one stage per entry of
``stage_sizes``; stage i has F = W * 2^i filters and each block is (post-activation, ResNet
v1.5)::

    y = relu(norm1(conv1x1(x, F))); y = relu(norm2(conv3x3(y, F * width_factor, stride)))
    y = norm3(conv1x1(y, 4F)); x = relu(shortcut(x) + y)

with stride 2 in the first block of every stage but the first, and ``shortcut`` a 1x1 conv
(``"proj"``, stride as the block) plus norm (``"norm_p"``) in each stage's first block, the
identity elsewhere. The head is global average pooling and a dense classifier. Layout::

    params = {
        "stem": {"w": [7, 7, C, W], "norm": {"scale": [W], "bias": [W]}},
        "blocks": [{"conv1": {"w": [1, 1, I, F]}, "norm1": ..., "conv2": {"w": [3, 3, F, F*wf]},
                    "norm2": ..., "conv3": {"w": [1, 1, F*wf, 4F]}, "norm3": ...,
                    ("proj": {"w": [1, 1, I, 4F]}, "norm_p": ...)}, ...],
        "head": {"w": [4F_last, K], "b": [K]},
    }

Its parameter count (``wide_resnet_num_params``) is exactly that of Alpa's Flax model.

Both variants: images are NHWC. Normalisation is layer norm over the channels of each pixel,
so there is no batch statistic and no mutable state (Alpa used batch norm: the same scale and
bias parameters, plus running statistics that are state, not parameters). ``dtype`` is the
compute dtype (parameters stay fp32 and are cast where used; norms run in fp32; logits are
fp32). ``pipeline_marks`` puts a ``mark_pipeline_boundary()`` after the stem and after every
block but the last.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini.errors import ConfigError
from alpa_mini.graph.markers import mark_pipeline_boundary

from .gpt import DTYPES, check_dtype
from .mlp import (
    check_bools,
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
    "wide_resnet_abstract_batch",
    "wide_resnet_abstract_params",
    "wide_resnet_forward",
    "wide_resnet_loss",
    "wide_resnet_num_params",
]

Params = dict[str, Any]

_CONV_DIMS = ("NHWC", "HWIO", "NHWC")
_PATTERN_SEED = 2468  # fixed, so every batch comes from the same learnable task
_NOISE_STD = 0.5  # per-pixel noise on top of the unit-variance class pattern
BLOCKS = ("basic", "bottleneck")


@dataclass(frozen=True)
class WideResNetConfig:
    """Shape of a Wide-ResNet: constant-width basic blocks, or bottleneck stages (Alpa's WRN)."""

    image_size: int
    in_channels: int
    width: int  # basic: the constant width; bottleneck: the stem's and first stage's width
    num_blocks: int  # residual blocks in all (bottleneck: the sum of stage_sizes)
    num_classes: int
    block: str = "basic"  # "basic" or "bottleneck"
    stage_sizes: tuple[int, ...] = ()  # bottleneck: blocks per stage, e.g. (3, 4, 6, 3)
    width_factor: int = 1  # bottleneck: widening of every 3x3 conv
    dtype: str = "float32"
    pipeline_marks: bool = False  # mark_pipeline_boundary() after the stem and each block

    def __post_init__(self) -> None:
        for name in ("image_size", "in_channels", "width", "num_blocks", "num_classes"):
            check_positive_int("WideResNetConfig", name, getattr(self, name))
        check_positive_int("WideResNetConfig", "width_factor", self.width_factor)
        if self.block not in BLOCKS:
            raise ConfigError(
                f"WideResNetConfig.block: {self.block!r} is invalid; "
                f"expected one of {', '.join(BLOCKS)}"
            )
        if isinstance(self.stage_sizes, list):  # hashable, so the config can be a static arg
            object.__setattr__(self, "stage_sizes", tuple(self.stage_sizes))
        stages = self.stage_sizes
        if not isinstance(stages, tuple):
            raise ConfigError(
                f"WideResNetConfig.stage_sizes: {stages!r} is invalid; expected a tuple of "
                "integers >= 1"
            )
        for n in stages:
            check_positive_int("WideResNetConfig", "stage_sizes entry", n)
        if self.block == "basic":
            if stages:
                raise ConfigError(
                    f"WideResNetConfig.stage_sizes: {stages} is invalid for block 'basic' "
                    "(one full-resolution stage); expected () or block 'bottleneck'"
                )
            if self.width_factor != 1:
                raise ConfigError(
                    f"WideResNetConfig.width_factor: {self.width_factor} is invalid for block "
                    "'basic'; expected 1 (only bottleneck blocks widen their 3x3 conv)"
                )
        else:
            if not stages:
                raise ConfigError(
                    "WideResNetConfig.stage_sizes: () is invalid for block 'bottleneck'; "
                    "expected blocks per stage, e.g. (3, 4, 6, 3) for a ResNet-50"
                )
            if sum(stages) != self.num_blocks:
                raise ConfigError(
                    f"WideResNetConfig.num_blocks: {self.num_blocks} is invalid; stage_sizes "
                    f"{stages} has {sum(stages)} blocks"
                )
        check_bools("WideResNetConfig", self, ("pipeline_marks",))
        check_dtype("WideResNetConfig", self.dtype)


def _bottleneck_plan(config: WideResNetConfig) -> list[tuple[int, int, bool]]:
    """(input channels, filters F, starts a stage) of every bottleneck block, in order."""
    plan, in_ch = [], config.width
    for i, size in enumerate(config.stage_sizes):
        filters = config.width * 2**i
        for j in range(size):
            plan.append((in_ch, filters, j == 0))
            in_ch = 4 * filters
    return plan


def wide_resnet_num_params(config: WideResNetConfig) -> int:
    """Closed-form parameter count of ``init_wide_resnet(config, ...)``."""
    c, w, k = config.in_channels, config.width, config.num_classes
    if config.block == "basic":
        return 9 * c * w + config.num_blocks * (18 * w * w + 4 * w) + 2 * w + w * k + k
    wf = config.width_factor
    total = 49 * c * w + 2 * w  # stem conv and norm
    for in_ch, f, first in _bottleneck_plan(config):
        total += in_ch * f + 2 * f  # conv1, norm1
        total += 9 * f * f * wf + 2 * f * wf  # conv2, norm2
        total += f * wf * 4 * f + 8 * f  # conv3, norm3
        if first:
            total += in_ch * 4 * f + 8 * f  # proj, norm_p
    return total + 4 * w * 2 ** (len(config.stage_sizes) - 1) * k + k


def _conv(x: jax.Array, w: jax.Array, stride: int = 1, padding: Any = "SAME") -> jax.Array:
    """Convolution of NHWC ``x`` with an HWIO kernel ``w``, no bias."""
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(stride, stride), padding=padding, dimension_numbers=_CONV_DIMS
    )


def conv3x3(x: jax.Array, w: jax.Array) -> jax.Array:
    """3x3, stride-1, SAME convolution of NHWC ``x`` with an HWIO kernel ``w``."""
    return _conv(x, w)


def _max_pool_3x3_s2(x: jax.Array) -> jax.Array:
    """3x3, stride-2, SAME max pool of NHWC ``x``, as a max over nine strided slices.

    Pad, slice and max are primitives the planner shards (``reduce_window`` it would not).
    """
    n, height, width, c = x.shape

    def same(size: int) -> tuple[int, int, int]:
        out = -(-size // 2)
        total = max(2 * (out - 1) + 3 - size, 0)
        return total // 2, total - total // 2, out

    lo_h, hi_h, out_h = same(height)
    lo_w, hi_w, out_w = same(width)
    low = jnp.array(-jnp.inf, x.dtype)
    xp = jax.lax.pad(x, low, [(0, 0, 0), (lo_h, hi_h, 0), (lo_w, hi_w, 0), (0, 0, 0)])
    taps = [
        jax.lax.slice(xp, (0, i, j, 0), (n, i + 2 * out_h - 1, j + 2 * out_w - 1, c), (1, 2, 2, 1))
        for i in range(3)
        for j in range(3)
    ]
    return functools.reduce(jnp.maximum, taps)


def _he(shape: tuple[int, ...]) -> float:
    """He-normal std sqrt(2 / fan_in) of an HWIO kernel."""
    return math.sqrt(2.0 / math.prod(shape[:-1]))


def _init_bottleneck(config: WideResNetConfig, key: jax.Array) -> Params:
    """He-normal convs; each block's last norm starts at scale 0, as in Alpa's (Flax) ResNet.

    A zero last scale makes every residual branch start at zero, so deep stacks are stable.
    """
    c, w, k, wf = config.in_channels, config.width, config.num_classes, config.width_factor
    plan = _bottleneck_plan(config)
    shapes = [(7, 7, c, w)]
    for in_ch, f, first in plan:
        shapes += [(1, 1, in_ch, f), (3, 3, f, f * wf), (1, 1, f * wf, 4 * f)]
        shapes += [(1, 1, in_ch, 4 * f)] if first else []
    head_in = 4 * plan[-1][1]
    shapes.append((head_in, k))
    normals = iter(split_normal(key, shapes))

    def conv(shape: tuple[int, ...]) -> Params:
        return {"w": _he(shape) * next(normals)}

    stem = {"w": _he(shapes[0]) * next(normals), "norm": init_layer_norm(w)}
    blocks = []
    for in_ch, f, first in plan:
        block = {
            "conv1": conv((1, 1, in_ch, f)),
            "norm1": init_layer_norm(f),
            "conv2": conv((3, 3, f, f * wf)),
            "norm2": init_layer_norm(f * wf),
            "conv3": conv((1, 1, f * wf, 4 * f)),
            "norm3": {
                "scale": jnp.zeros((4 * f,), jnp.float32),
                "bias": jnp.zeros((4 * f,), jnp.float32),
            },
        }
        if first:
            block["proj"] = conv((1, 1, in_ch, 4 * f))
            block["norm_p"] = init_layer_norm(4 * f)
        blocks.append(block)
    head = {"w": next(normals) / math.sqrt(head_in), "b": jnp.zeros((k,), jnp.float32)}
    return {"stem": stem, "blocks": blocks, "head": head}


def init_wide_resnet(config: WideResNetConfig, key: jax.Array) -> Params:
    """He-normal convs (std sqrt(2 / fan_in)); residual branches start small (see below).

    Basic blocks: each block's second conv is scaled down 10x. Bottleneck blocks: each block's
    last norm starts at scale 0. Either keeps every residual branch small at init, so deep
    stacks are stable.
    """
    if config.block == "bottleneck":
        return _init_bottleneck(config, key)
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


def _basic_block(block: Params, x: jax.Array) -> jax.Array:
    """``x + conv2(relu(norm2(conv1(relu(norm1(x))))))``."""
    h = conv3x3(jax.nn.relu(layer_norm(block["norm1"], x)), block["conv1"]["w"])
    h = conv3x3(jax.nn.relu(layer_norm(block["norm2"], h)), block["conv2"]["w"])
    return x + h


def _bottleneck_block(block: Params, x: jax.Array) -> jax.Array:
    """Post-activation bottleneck block (module docstring); a stage's first block projects.

    A projecting block whose input has twice its bottleneck width (the previous stage's 4F/2
    = 2F) starts a later stage, so it strides by 2; the first stage's input has width F.
    """
    proj = block.get("proj")
    in_ch, filters = block["conv1"]["w"].shape[2:]
    stride = 2 if proj is not None and in_ch == 2 * filters else 1
    y = jax.nn.relu(layer_norm(block["norm1"], _conv(x, block["conv1"]["w"])))
    y = jax.nn.relu(layer_norm(block["norm2"], _conv(y, block["conv2"]["w"], stride)))
    y = layer_norm(block["norm3"], _conv(y, block["conv3"]["w"]))
    if proj is not None:
        x = layer_norm(block["norm_p"], _conv(x, proj["w"], stride))
    return jax.nn.relu(x + y)


def wide_resnet_forward(
    params: Params, images: jax.Array, config: WideResNetConfig | None = None
) -> jax.Array:
    """Class logits ``[B, K]`` (fp32) for NHWC ``images [B, H, W, C]``.

    The variant and every shape come from the parameters; ``config`` adds the compute dtype
    and the pipeline marks.
    """
    dtype = DTYPES[config.dtype] if config is not None else jnp.float32
    marks = config is not None and config.pipeline_marks

    def cast(tree: Any) -> Any:
        # Cast where used, so a pipeline stage casts only its own parameters (as gpt.py does).
        return tree if dtype == jnp.float32 else jax.tree.map(lambda a: a.astype(dtype), tree)

    x = images.astype(dtype)
    stem = cast(params["stem"])
    bottleneck = "norm" in stem
    if bottleneck:
        x = _conv(x, stem["w"], 2, [(3, 3), (3, 3)])
        x = _max_pool_3x3_s2(jax.nn.relu(layer_norm(stem["norm"], x)))
    else:
        x = conv3x3(x, stem["w"])
    if marks:
        x = mark_pipeline_boundary(x)
    block_fn = _bottleneck_block if bottleneck else _basic_block
    blocks = params["blocks"]
    for i, block in enumerate(blocks):
        x = block_fn(cast(block), x)
        if marks and i < len(blocks) - 1:
            x = mark_pipeline_boundary(x)
    if not bottleneck:
        x = jax.nn.relu(layer_norm(cast(params["norm_f"]), x))
    pooled = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(dtype)
    head = cast(params["head"])
    return (pooled @ head["w"] + head["b"]).astype(jnp.float32)


def wide_resnet_loss(
    params: Params, batch: dict[str, jax.Array], config: WideResNetConfig | None = None
) -> jax.Array:
    """Mean softmax cross-entropy of ``batch["labels"]`` given ``batch["images"]``."""
    logits = wide_resnet_forward(params, batch["images"], config)
    return softmax_cross_entropy(logits, batch["labels"])


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


def wide_resnet_abstract_params(config: WideResNetConfig) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
    return jax.eval_shape(lambda key: init_wide_resnet(config, key), jax.random.key(0))


def wide_resnet_abstract_batch(
    config: WideResNetConfig, batch_size: int
) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of ``jax.ShapeDtypeStruct`` leaves (fp32 images, int32 labels)."""
    check_positive_int("wide_resnet_abstract_batch", "batch_size", batch_size)
    s, c = config.image_size, config.in_channels
    return {
        "images": jax.ShapeDtypeStruct((batch_size, s, s, c), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
    }
