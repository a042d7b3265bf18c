"""A GPT-2-style decoder-only transformer in pure JAX, for planner tests and benchmarks.

Parameter layout (fp32 arrays; H = hidden, N = num_heads, D = H / N, F = mlp_ratio * H)::

    params = {
        "wte": [V, H],                      # token embedding, also the tied LM head
        "wpe": [S, H],                      # learned positional embedding
        "layers": [layer_0, ..., layer_{L-1}]   # unrolled layout (scan_layers=False)
                | layer with a leading [L] axis on every leaf   # stacked layout (scan_layers=True)
        "ln_f": {"scale": [H], "bias": [H]},
    }
    layer = {
        "ln1": {"scale": [H], "bias": [H]},
        "attn": {"w_q": [H, N, D], "w_k": [H, N, D], "w_v": [H, N, D],
                 "b_q": [N, D], "b_k": [N, D], "b_v": [N, D],
                 "w_out": [N, D, H], "b_out": [H]},
        "ln2": {"scale": [H], "bias": [H]},
        "mlp": {"w_in": [H, F], "b_in": [F], "w_out": [F, H], "b_out": [H]},
    }

Parameter count: ``V*H + S*H + L*((4 + 2r)*H^2 + (9 + r)*H) + 2*H`` with r = mlp_ratio, i.e.
``V*H + S*H + L*(12*H^2 + 13*H) + 2*H`` for r = 4. The head axis is explicit in the attention
weights, so the forward pass reads everything structural (heads, layers, layout) from the
parameter shapes; the optional ``config`` argument adds only ``remat`` and the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini.errors import ConfigError
from alpa_mini.graph.markers import mark_pipeline_boundary

from .mlp import (
    check_bools,
    check_positive_int,
    init_layer_norm,
    layer_norm,
    softmax_cross_entropy,
    split_normal,
)

__all__ = [
    "GPT2_1_3B",
    "GPT_SMALL",
    "GPT_TINY",
    "GPTConfig",
    "gpt_abstract_batch",
    "gpt_abstract_params",
    "gpt_forward",
    "gpt_loss",
    "gpt_num_params",
    "init_gpt",
    "make_gpt_batch",
    "stack_layers",
    "unstack_layers",
]

Params = dict[str, Any]

DTYPES: dict[str, Any] = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def check_dtype(owner: str, dtype: str) -> None:
    """Raise a ``ConfigError`` naming ``owner.dtype`` unless it is one of ``DTYPES``."""
    if dtype not in DTYPES:
        raise ConfigError(
            f"{owner}.dtype: {dtype!r} is invalid; expected one of {', '.join(sorted(DTYPES))}"
        )


INIT_STD = 0.02  # GPT-2's initialiser scale; keeps the loss at init close to log(vocab)


@dataclass(frozen=True)
class GPTConfig:
    """Shape and execution options of a GPT-2-style decoder."""

    vocab_size: int
    seq_len: int
    hidden: int
    num_heads: int
    num_layers: int
    mlp_ratio: int = 4
    scan_layers: bool = False
    remat: bool = False
    dtype: str = "float32"
    pipeline_marks: bool = False  # mark_pipeline_boundary() after the embedding and each block

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "hidden", "num_heads", "num_layers", "mlp_ratio"):
            check_positive_int("GPTConfig", name, getattr(self, name))
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"GPTConfig.num_heads: {self.num_heads} does not divide hidden {self.hidden}"
            )
        check_bools("GPTConfig", self, ("scan_layers", "remat", "pipeline_marks"))
        check_dtype("GPTConfig", self.dtype)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.num_heads


GPT_TINY = GPTConfig(vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_layers=2)
GPT_SMALL = GPTConfig(vocab_size=1024, seq_len=128, hidden=256, num_heads=8, num_layers=4)
GPT2_1_3B = GPTConfig(vocab_size=51200, seq_len=1024, hidden=2048, num_heads=32, num_layers=24)


def gpt_num_params(config: GPTConfig) -> int:
    """Closed-form parameter count of ``init_gpt(config, ...)``."""
    v, s, h, r = config.vocab_size, config.seq_len, config.hidden, config.mlp_ratio
    per_layer = (4 + 2 * r) * h * h + (9 + r) * h
    return v * h + s * h + config.num_layers * per_layer + 2 * h


def _layer_shapes(config: GPTConfig) -> list[tuple[int, ...]]:
    """Shapes of one block's random weights, in ``_init_layer``'s order."""
    h, n, d = config.hidden, config.num_heads, config.head_dim
    f = config.mlp_ratio * h
    return [(h, n, d), (h, n, d), (h, n, d), (n, d, h), (h, f), (f, h)]


def _init_layer(config: GPTConfig, normals: list[jax.Array]) -> Params:
    """One decoder block from standard normals; output projections get std 0.02/sqrt(2L)."""
    h, n, d = config.hidden, config.num_heads, config.head_dim
    f = config.mlp_ratio * h
    out_std = INIT_STD / math.sqrt(2 * config.num_layers)
    w_q, w_k, w_v, w_o, w_in, w_mo = normals

    def zeros(*shape: int) -> jax.Array:
        return jnp.zeros(shape, jnp.float32)

    return {
        "ln1": init_layer_norm(h),
        "attn": {
            "w_q": INIT_STD * w_q,
            "w_k": INIT_STD * w_k,
            "w_v": INIT_STD * w_v,
            "b_q": zeros(n, d),
            "b_k": zeros(n, d),
            "b_v": zeros(n, d),
            "w_out": out_std * w_o,
            "b_out": zeros(h),
        },
        "ln2": init_layer_norm(h),
        "mlp": {
            "w_in": INIT_STD * w_in,
            "b_in": zeros(f),
            "w_out": out_std * w_mo,
            "b_out": zeros(h),
        },
    }


def stack_layers(params: Params) -> Params:
    """Unrolled layout -> stacked layout (every layer leaf gains a leading [L] axis)."""
    layers = params["layers"]
    if not isinstance(layers, list | tuple):
        raise ValueError("stack_layers: params['layers'] is already stacked (not a list)")
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return {**params, "layers": stacked}


def unstack_layers(params: Params) -> Params:
    """Stacked layout -> unrolled layout (a list of per-layer dicts)."""
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        raise ValueError("unstack_layers: params['layers'] is already a list of layers")
    num_layers = jax.tree.leaves(layers)[0].shape[0]
    return {
        **params,
        "layers": [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(num_layers)],
    }


def init_gpt(config: GPTConfig, key: jax.Array) -> Params:
    """Initialise in ``config``'s layout; both layouts get the same weights for the same key."""
    h = config.hidden
    per_layer = _layer_shapes(config)
    normals = split_normal(
        key, [(config.vocab_size, h), (config.seq_len, h), *per_layer * config.num_layers]
    )
    wte, wpe, rest = normals[0], normals[1], normals[2:]
    k = len(per_layer)
    params = {
        "wte": INIT_STD * wte,
        "wpe": INIT_STD * wpe,
        "layers": [
            _init_layer(config, rest[i * k : (i + 1) * k]) for i in range(config.num_layers)
        ],
        "ln_f": init_layer_norm(h),
    }
    return stack_layers(params) if config.scan_layers else params


def _attention(attn: Params, x: jax.Array) -> jax.Array:
    """Causal multi-head self-attention on ``x [B, S, H]``; softmax in fp32."""
    q = jnp.einsum("bsh,hnd->bsnd", x, attn["w_q"]) + attn["b_q"]
    k = jnp.einsum("bsh,hnd->bsnd", x, attn["w_k"]) + attn["b_k"]
    v = jnp.einsum("bsh,hnd->bsnd", x, attn["w_v"]) + attn["b_v"]
    seq, head_dim = x.shape[1], q.shape[-1]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v)
    return jnp.einsum("bqnd,ndh->bqh", ctx, attn["w_out"]) + attn["b_out"]


def _block(layer: Params, x: jax.Array) -> jax.Array:
    """Pre-layernorm decoder block: x + attn(ln1(x)), then + mlp(ln2(.))."""
    x = x + _attention(layer["attn"], layer_norm(layer["ln1"], x))
    mlp = layer["mlp"]
    h = jax.nn.gelu(layer_norm(layer["ln2"], x) @ mlp["w_in"] + mlp["b_in"])
    return x + h @ mlp["w_out"] + mlp["b_out"]


def _check_matches(params: Params, config: GPTConfig) -> None:
    """Raise ``ValueError`` when ``params`` do not have the shapes ``config`` describes."""
    vocab, hidden = params["wte"].shape
    layers = params["layers"]
    first = layers[0] if isinstance(layers, list | tuple) else layers
    found = {"vocab_size": vocab, "hidden": hidden, "num_heads": first["attn"]["w_q"].shape[-2]}
    for name, value in found.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"gpt: params have {name}={value} but GPTConfig.{name} is {getattr(config, name)}"
            )


def gpt_forward(params: Params, tokens: jax.Array, config: GPTConfig | None = None) -> jax.Array:
    """Logits ``[B, S, V]`` (fp32) for int tokens ``[B, S]``; ``config`` adds remat and dtype."""
    if config is not None:
        _check_matches(params, config)
    remat = config is not None and config.remat
    dtype = DTYPES[config.dtype] if config is not None else jnp.float32

    def cast(tree: Any) -> Any:
        # Each part is cast where it is used, so that a pipeline stage casts only its own
        # parameters (casting all up front would put every layer's cast in the first stage).
        return tree if dtype == jnp.float32 else jax.tree.map(lambda a: a.astype(dtype), tree)

    seq = tokens.shape[-1]
    if seq > params["wpe"].shape[0]:
        raise ValueError(
            f"gpt_forward: sequence length {seq} exceeds the {params['wpe'].shape[0]} positions"
        )
    # Plain indexing lowers to a top-level ``gather`` (``jnp.take`` would wrap it in a jit).
    x = cast(params["wte"])[tokens] + cast(params["wpe"])[:seq]
    block = jax.checkpoint(_block) if remat else _block
    layers = params["layers"]
    marks = config is not None and config.pipeline_marks
    if marks:
        x = mark_pipeline_boundary(x)
    if isinstance(layers, list | tuple):
        for k, layer in enumerate(layers):
            x = block(cast(layer), x)
            if marks and k < len(layers) - 1:
                x = mark_pipeline_boundary(x)
    else:
        x, _ = jax.lax.scan(lambda carry, layer: (block(cast(layer), carry), None), x, layers)
    x = layer_norm(cast(params["ln_f"]), x)
    return jnp.einsum("bsh,vh->bsv", x, cast(params["wte"])).astype(jnp.float32)


def gpt_loss(
    params: Params, batch: dict[str, jax.Array], config: GPTConfig | None = None
) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["labels"]`` given ``batch["tokens"]``."""
    return softmax_cross_entropy(gpt_forward(params, batch["tokens"], config), batch["labels"])


def make_gpt_batch(config: GPTConfig, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """Arithmetic token sequences (random start and stride per row), labels shifted by one.

    The next token is predictable from the previous two, so training visibly lowers the loss.
    """
    check_positive_int("make_gpt_batch", "batch_size", batch_size)
    k_start, k_stride = jax.random.split(key)
    v = config.vocab_size
    start = jax.random.randint(k_start, (batch_size, 1), 0, v, jnp.int32)
    stride = jax.random.randint(k_stride, (batch_size, 1), 1, max(2, min(v, 8)), jnp.int32)
    seq = (start + stride * jnp.arange(config.seq_len + 1, dtype=jnp.int32)) % v
    return {"tokens": seq[:, :-1], "labels": seq[:, 1:]}


def gpt_abstract_params(config: GPTConfig) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
    return jax.eval_shape(lambda key: init_gpt(config, key), jax.random.key(0))


def gpt_abstract_batch(config: GPTConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of ``jax.ShapeDtypeStruct`` leaves, for tracing without data."""
    check_positive_int("gpt_abstract_batch", "batch_size", batch_size)
    spec = jax.ShapeDtypeStruct((batch_size, config.seq_len), jnp.int32)
    return {"tokens": spec, "labels": spec}
