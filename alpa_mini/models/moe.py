"""Mixture-of-experts models: one GShard-style top-2 MoE layer, and a GPT-like MoE language model.

**The MoE layer** (``MoEConfig``, ``init_moe``, ``moe_forward``). Parameter layout (fp32
arrays; H = hidden, F = ffn, E = num_experts)::

    params = {
        "ln": {"scale": [H], "bias": [H]},
        "gate": {"w": [H, E]},
        "experts": {"w_in": [E, H, F], "b_in": [E, F], "w_out": [E, F, H], "b_out": [E, H]},
    }

Parameter count: ``2*H + H*E + E*(2*H*F + F + H)``.

The layer is ``y = x + sum_k g_k * FFN_{e_k}(LN(x))`` over each token's top-2 experts e_1, e_2,
with the two softmax gate probabilities renormalised to sum to 1. Tokens are grouped per
sequence (GShard's group axis is the batch axis), so every einsum keeps the batch axis and
data parallelism stays a plain split. Each expert has ``C`` slots per sequence: ``C = seq_len``
without a ``capacity_factor`` (no token is ever dropped), else
``min(seq_len, ceil(capacity_factor * 2 * seq_len / E))``; first choices take slots before
second choices, in token order, and an assignment past capacity is dropped (its term vanishes;
the residual still carries the token).

**The MoE language model** (``MoELMConfig``, ``init_moe_lm``, ``moe_lm_forward``,
``moe_lm_loss``): the model of Alpa's MoE benchmark suite (after GShard). It is the GPT of
``gpt.py`` (token and learned position embeddings, pre-layer-norm causal attention, a final
layer norm and an LM head tied to the token embedding) in which every other block's FFN is the
MoE layer above: blocks 0, 2, 4, ... are MoE blocks, blocks 1, 3, ... dense, as in Alpa's
model. Layout (R = ffn_ratio, F = R*H, V = vocab_size, S = seq_len)::

    params = {
        "wte": [V, H], "wpe": [S, H],
        "layers": [moe_block, dense_block, moe_block, ...],   # num_layers of them
        "ln_f": {"scale": [H], "bias": [H]},
    }
    moe_block = {"ln1": ..., "attn": <gpt.py's attention>, "moe": <the MoE layer's params>}
    dense_block = {"ln1": ..., "attn": ..., "ln2": ...,
                   "mlp": {"w_in": [H, F], "b_in": [F], "w_out": [F, H], "b_out": [H]}}

Parameter count (``moe_lm_num_params``), with ``ceil(L/2)`` MoE and ``floor(L/2)`` dense
blocks: ``V*H + S*H + 2*H + L*(4*H^2 + 6*H) + floor(L/2)*(2*H*F + F + 3*H)
+ ceil(L/2)*(2*H + H*E + E*(2*H*F + F + H))``.

Gating groups: with ``expert_group_size = G`` the tokens of a (micro-)batch are regrouped into
groups of G consecutive tokens before routing (G a multiple or a divisor of seq_len), each
expert getting ``ceil(capacity_factor * 2 * G / E)`` slots per group; G larger than the
batch's token count shrinks to it, as Alpa's benchmark did. The regrouping is a split of one
axis followed by a merge of two, so the batch axis stays splittable for the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini.errors import ConfigError
from alpa_mini.graph.markers import mark_pipeline_boundary

from .gpt import (
    DTYPES,
    INIT_STD,
    GPTConfig,
    _attention,
    _block,
    check_dtype,
    gpt_abstract_batch,
    make_gpt_batch,
)
from .mlp import (
    check_bools,
    check_positive_int,
    init_layer_norm,
    layer_norm,
    softmax_cross_entropy,
    split_normal,
)

__all__ = [
    "MoEConfig",
    "MoELMConfig",
    "init_moe",
    "init_moe_lm",
    "make_moe_batch",
    "make_moe_lm_batch",
    "moe_capacity",
    "moe_forward",
    "moe_lm_abstract_batch",
    "moe_lm_abstract_params",
    "moe_lm_forward",
    "moe_lm_layer_kinds",
    "moe_lm_loss",
    "moe_lm_num_params",
    "moe_loss",
    "moe_num_params",
    "moe_routing",
]

Params = dict[str, Any]

TOP_K = 2
_TEACHER_SEED = 4321  # fixed, so every batch comes from the same learnable target


def _check_capacity_factor(owner: str, cf: object) -> None:
    """Raise a ``ConfigError`` naming ``owner.capacity_factor`` unless None or a number > 0."""
    if cf is not None and (
        isinstance(cf, bool) or not isinstance(cf, int | float) or not math.isfinite(cf) or cf <= 0
    ):
        raise ConfigError(
            f"{owner}.capacity_factor: {cf!r} is invalid; expected None or a number > 0"
        )


@dataclass(frozen=True)
class MoEConfig:
    """Shape of one top-2 MoE layer; ``capacity_factor=None`` means no token is dropped."""

    hidden: int
    ffn: int
    num_experts: int
    seq_len: int
    capacity_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn", "num_experts", "seq_len"):
            check_positive_int("MoEConfig", name, getattr(self, name))
        if self.num_experts < TOP_K:
            raise ConfigError(
                f"MoEConfig.num_experts: {self.num_experts} is invalid; top-2 gating needs >= 2"
            )
        _check_capacity_factor("MoEConfig", self.capacity_factor)


def moe_capacity(config: MoEConfig | None, seq_len: int, num_experts: int) -> int:
    """Slots per expert per sequence (see the module docstring)."""
    if config is None or config.capacity_factor is None:
        return seq_len
    wanted = math.ceil(config.capacity_factor * TOP_K * seq_len / num_experts)
    return max(1, min(seq_len, wanted))


def moe_num_params(config: MoEConfig) -> int:
    """Closed-form parameter count of ``init_moe(config, ...)``."""
    h, f, e = config.hidden, config.ffn, config.num_experts
    return 2 * h + h * e + e * (2 * h * f + f + h)


def init_moe(config: MoEConfig, key: jax.Array) -> Params:
    """LeCun-normal weights (std 1/sqrt(fan_in)), zero biases, unit layer-norm scale."""
    h, f, e = config.hidden, config.ffn, config.num_experts
    w_gate, w_in, w_out = split_normal(key, [(h, e), (e, h, f), (e, f, h)])
    return {
        "ln": init_layer_norm(h),
        "gate": {"w": w_gate / math.sqrt(h)},
        "experts": {
            "w_in": w_in / math.sqrt(h),
            "b_in": jnp.zeros((e, f), jnp.float32),
            "w_out": w_out / math.sqrt(f),
            "b_out": jnp.zeros((e, h), jnp.float32),
        },
    }


def _route(params: Params, h: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-2 expert indices and renormalised gate weights for normalised tokens ``h``."""
    logits = (h @ params["gate"]["w"]).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    top, idx = jax.lax.top_k(probs, TOP_K)
    return idx.astype(jnp.int32), top / jnp.sum(top, axis=-1, keepdims=True)


def moe_routing(params: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(expert indices ``[tokens, 2]`` int32, gate weights ``[tokens, 2]``) for ``x [..., H]``."""
    idx, gates = _route(params, layer_norm(params["ln"], x))
    return idx.reshape(-1, TOP_K), gates.reshape(-1, TOP_K)


def _dispatch_combine(
    idx: jax.Array, gates: jax.Array, num_experts: int, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """One-hot dispatch ``[B, S, E, C]`` and gate-weighted combine tensors, first choices first."""
    dispatch = jnp.zeros((*idx.shape[:2], num_experts, capacity), jnp.float32)
    combine = dispatch
    taken = jnp.zeros((idx.shape[0], 1, num_experts), jnp.int32)  # slots used per (seq, expert)
    for k in range(TOP_K):
        mask = jax.nn.one_hot(idx[..., k], num_experts, dtype=jnp.int32)  # [B, S, E]
        slot = jnp.cumsum(mask, axis=1) - 1 + taken
        mask = mask * (slot < capacity)
        taken = taken + jnp.sum(mask, axis=1, keepdims=True)
        onehot = jax.nn.one_hot(slot, capacity, dtype=jnp.float32) * mask[..., None]
        dispatch = dispatch + onehot
        combine = combine + gates[..., k, None, None] * onehot
    return dispatch, combine


def moe_forward(params: Params, x: jax.Array, config: MoEConfig | None = None) -> jax.Array:
    """``x [B, S, H] -> x + MoE(LN(x))``; ``config`` only supplies the capacity factor."""
    h = layer_norm(params["ln"], x)
    idx, gates = _route(params, h)
    ex = params["experts"]
    num_experts = ex["w_in"].shape[0]
    capacity = moe_capacity(config, x.shape[1], num_experts)
    dispatch, combine = _dispatch_combine(idx, gates, num_experts, capacity)
    expert_in = jnp.einsum("bsec,bsh->bech", dispatch.astype(h.dtype), h)
    hid = jax.nn.gelu(jnp.einsum("bech,ehf->becf", expert_in, ex["w_in"]) + ex["b_in"][:, None])
    expert_out = jnp.einsum("becf,efh->bech", hid, ex["w_out"]) + ex["b_out"][:, None]
    return x + jnp.einsum("bsec,bech->bsh", combine.astype(h.dtype), expert_out)


def moe_loss(
    params: Params, batch: dict[str, jax.Array], config: MoEConfig | None = None
) -> jax.Array:
    """Mean squared error of ``moe_forward(batch["x"])`` against ``batch["y"]``."""
    return jnp.mean(jnp.square(moe_forward(params, batch["x"], config) - batch["y"]))


def make_moe_batch(config: MoEConfig, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """Inputs ``x [B, S, H]`` and a fixed-teacher target ``y = x + tanh(x @ T)``."""
    check_positive_int("make_moe_batch", "batch_size", batch_size)
    h = config.hidden
    (x,) = split_normal(key, [(batch_size, config.seq_len, h)])
    (teacher,) = split_normal(jax.random.key(_TEACHER_SEED), [(h, h)])
    teacher = teacher / math.sqrt(h)
    return {"x": x, "y": x + jnp.tanh(x @ teacher)}


# ============================================================================ MoE language model


@dataclass(frozen=True)
class MoELMConfig:
    """Shape and execution options of the MoE language model (MoE FFN in every other block)."""

    vocab_size: int
    seq_len: int
    hidden: int
    num_heads: int
    num_layers: int
    num_experts: int
    ffn_ratio: int = 4  # FFN width / hidden, for the dense FFNs and every expert (Alpa: 8)
    expert_group_size: int | None = None  # tokens per gating group; None: one sequence
    capacity_factor: float | None = None  # None: no token is ever dropped
    remat: bool = False
    dtype: str = "float32"
    pipeline_marks: bool = False  # mark_pipeline_boundary() after the embedding and each block

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "seq_len",
            "hidden",
            "num_heads",
            "num_layers",
            "num_experts",
            "ffn_ratio",
        ):
            check_positive_int("MoELMConfig", name, getattr(self, name))
        if self.num_experts < TOP_K:
            raise ConfigError(
                f"MoELMConfig.num_experts: {self.num_experts} is invalid; top-2 gating needs >= 2"
            )
        if self.hidden % self.num_heads:
            raise ConfigError(
                f"MoELMConfig.num_heads: {self.num_heads} does not divide hidden {self.hidden}"
            )
        if self.expert_group_size is not None:
            check_positive_int("MoELMConfig", "expert_group_size", self.expert_group_size)
            g, s = self.expert_group_size, self.seq_len
            if g % s and s % g:
                raise ConfigError(
                    f"MoELMConfig.expert_group_size: {g} is invalid; expected a multiple or a "
                    f"divisor of seq_len {s} (or null for one group per sequence)"
                )
        _check_capacity_factor("MoELMConfig", self.capacity_factor)
        check_bools("MoELMConfig", self, ("remat", "pipeline_marks"))
        check_dtype("MoELMConfig", self.dtype)

    @property
    def ffn(self) -> int:
        """Width of every FFN, dense or expert."""
        return self.ffn_ratio * self.hidden

    def moe_layer(self, group: int) -> MoEConfig:
        """The ``MoEConfig`` of one MoE block when routing groups of ``group`` tokens."""
        return MoEConfig(self.hidden, self.ffn, self.num_experts, group, self.capacity_factor)


def moe_lm_layer_kinds(config: MoELMConfig) -> tuple[str, ...]:
    """``"moe"`` or ``"dense"`` for each block, in order: MoE in blocks 0, 2, 4, ..."""
    return tuple("moe" if k % 2 == 0 else "dense" for k in range(config.num_layers))


def moe_lm_num_params(config: MoELMConfig) -> int:
    """Closed-form parameter count of ``init_moe_lm(config, ...)`` (see the module docstring)."""
    v, s, h, f = config.vocab_size, config.seq_len, config.hidden, config.ffn
    kinds = moe_lm_layer_kinds(config)
    attention = 4 * h * h + 4 * h + 2 * h  # q, k, v, out projections with biases, plus ln1
    dense_ffn = 2 * h + 2 * h * f + f + h  # ln2 and the two-layer MLP
    moe_ffn = moe_num_params(config.moe_layer(s))
    return (
        v * h
        + s * h
        + 2 * h
        + config.num_layers * attention
        + kinds.count("dense") * dense_ffn
        + kinds.count("moe") * moe_ffn
    )


def _dense_view(config: MoELMConfig) -> GPTConfig:
    """The GPT with this model's shape and no experts (its batches are this model's)."""
    return GPTConfig(
        vocab_size=config.vocab_size,
        seq_len=config.seq_len,
        hidden=config.hidden,
        num_heads=config.num_heads,
        num_layers=config.num_layers,
        mlp_ratio=config.ffn_ratio,
    )


def _init_attention(config: MoELMConfig, normals: list[jax.Array]) -> Params:
    """ln1 and gpt.py's attention from four standard normals, with gpt.py's init scales."""
    h, n = config.hidden, config.num_heads
    d = h // n
    out_std = INIT_STD / math.sqrt(2 * config.num_layers)
    w_q, w_k, w_v, w_o = normals
    zeros = jnp.zeros((n, d), jnp.float32)
    return {
        "ln1": init_layer_norm(h),
        "attn": {
            "w_q": INIT_STD * w_q,
            "w_k": INIT_STD * w_k,
            "w_v": INIT_STD * w_v,
            "b_q": zeros,
            "b_k": zeros,
            "b_v": zeros,
            "w_out": out_std * w_o,
            "b_out": jnp.zeros((h,), jnp.float32),
        },
    }


def init_moe_lm(config: MoELMConfig, key: jax.Array) -> Params:
    """GPT-2 init scales for embeddings, attention and dense FFNs; experts as ``init_moe``."""
    h, f = config.hidden, config.ffn
    d = h // config.num_heads
    kinds = moe_lm_layer_kinds(config)
    attn_shapes = [(h, config.num_heads, d)] * 3 + [(config.num_heads, d, h)]
    shapes = [(config.vocab_size, h), (config.seq_len, h)]
    for kind in kinds:
        shapes += attn_shapes + ([(h, f), (f, h)] if kind == "dense" else [])
    k_dense, *k_moe = jax.random.split(key, 1 + kinds.count("moe"))
    normals = iter(split_normal(k_dense, shapes))
    wte, wpe = next(normals), next(normals)
    out_std = INIT_STD / math.sqrt(2 * config.num_layers)
    moe_keys = iter(k_moe)
    layers = []
    for kind in kinds:
        layer = _init_attention(config, [next(normals) for _ in range(4)])
        if kind == "moe":
            layer["moe"] = init_moe(config.moe_layer(config.seq_len), next(moe_keys))
        else:
            layer["ln2"] = init_layer_norm(h)
            layer["mlp"] = {
                "w_in": INIT_STD * next(normals),
                "b_in": jnp.zeros((f,), jnp.float32),
                "w_out": out_std * next(normals),
                "b_out": jnp.zeros((h,), jnp.float32),
            }
        layers.append(layer)
    return {
        "wte": INIT_STD * wte,
        "wpe": INIT_STD * wpe,
        "layers": layers,
        "ln_f": init_layer_norm(h),
    }


def _grouped_moe(
    params: Params, x: jax.Array, group: int | None, capacity_factor: float | None
) -> jax.Array:
    """``moe_forward`` on ``x [B, S, H]`` with gating groups of ``group`` tokens.

    Groups of several sequences: [B, S, H] -> [B/k, k, S, H] -> [B/k, k*S, H]; groups within a
    sequence: [B, S, H] -> [B, S/g, g, H] -> [B*S/g, g, H]. Each step splits one axis or merges
    two, so the planner can keep the batch axis split through both reshapes.
    """
    b, s, h = x.shape
    g = s if group is None else min(group, b * s)

    def layer(xg: jax.Array) -> jax.Array:
        num_experts, ffn = params["experts"]["w_in"].shape[0], params["experts"]["w_in"].shape[2]
        cfg = (
            None
            if capacity_factor is None
            else MoEConfig(h, ffn, num_experts, xg.shape[1], capacity_factor)
        )
        return moe_forward(params, xg, cfg)

    if g == s:
        return layer(x)
    if g % s == 0:
        k = g // s
        if b % k:
            raise ValueError(
                f"moe_lm: expert_group_size {group} spans {k} sequences, which does not divide "
                f"the (micro-)batch of {b} sequences"
            )
        y = layer(x.reshape(b // k, k, s, h).reshape(b // k, g, h))
        return y.reshape(b // k, k, s, h).reshape(b, s, h)
    if s % g == 0:
        y = layer(x.reshape(b, s // g, g, h).reshape(b * (s // g), g, h))
        return y.reshape(b, s // g, g, h).reshape(b, s, h)
    raise ValueError(
        f"moe_lm: expert_group_size {group} is neither a multiple nor a divisor of the "
        f"sequence length {s}"
    )


def _moe_lm_block(
    layer: Params, x: jax.Array, group: int | None, capacity_factor: float | None
) -> jax.Array:
    """Pre-layer-norm block: x + attn(ln1(x)), then the MoE layer (a dense block is GPT's)."""
    if "moe" not in layer:
        return _block(layer, x)
    x = x + _attention(layer["attn"], layer_norm(layer["ln1"], x))
    return _grouped_moe(layer["moe"], x, group, capacity_factor)


def _check_lm_matches(params: Params, config: MoELMConfig) -> None:
    """Raise ``ValueError`` when ``params`` do not have the shapes ``config`` describes."""
    vocab, hidden = params["wte"].shape
    layers = params["layers"]
    found = {
        "vocab_size": vocab,
        "hidden": hidden,
        "num_layers": len(layers),
        "num_heads": layers[0]["attn"]["w_q"].shape[-2],
        "num_experts": layers[0]["moe"]["experts"]["w_in"].shape[0],
    }
    for name, value in found.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"moe_lm: params have {name}={value} but MoELMConfig.{name} is "
                f"{getattr(config, name)}"
            )


def moe_lm_forward(
    params: Params, tokens: jax.Array, config: MoELMConfig | None = None
) -> jax.Array:
    """Logits ``[B, S, V]`` (fp32) for int tokens ``[B, S]``.

    Structure (blocks, experts, heads) comes from the parameter shapes; ``config`` adds the
    gating groups, the capacity factor, remat, the compute dtype and the pipeline marks.
    Without it, every sequence is one group and no token is dropped.
    """
    if config is not None:
        _check_lm_matches(params, config)
    dtype = DTYPES[config.dtype] if config is not None else jnp.float32
    group = config.expert_group_size if config is not None else None
    capacity_factor = config.capacity_factor if config is not None else None

    def cast(tree: Any) -> Any:
        # Cast where used, so a pipeline stage casts only its own parameters (as gpt.py does).
        return tree if dtype == jnp.float32 else jax.tree.map(lambda a: a.astype(dtype), tree)

    seq = tokens.shape[-1]
    if seq > params["wpe"].shape[0]:
        raise ValueError(
            f"moe_lm_forward: sequence length {seq} exceeds the {params['wpe'].shape[0]} positions"
        )

    def block(layer: Params, x: jax.Array) -> jax.Array:
        return _moe_lm_block(layer, x, group, capacity_factor)

    if config is not None and config.remat:
        block = jax.checkpoint(block)
    marks = config is not None and config.pipeline_marks
    x = cast(params["wte"])[tokens] + cast(params["wpe"])[:seq]
    if marks:
        x = mark_pipeline_boundary(x)
    layers = params["layers"]
    for k, layer in enumerate(layers):
        x = block(cast(layer), x)
        if marks and k < len(layers) - 1:
            x = mark_pipeline_boundary(x)
    x = layer_norm(cast(params["ln_f"]), x)
    return jnp.einsum("bsh,vh->bsv", x, cast(params["wte"])).astype(jnp.float32)


def moe_lm_loss(
    params: Params, batch: dict[str, jax.Array], config: MoELMConfig | None = None
) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["labels"]`` given ``batch["tokens"]``.

    There is no auxiliary load-balancing loss (Alpa's benchmark model had none either).
    """
    return softmax_cross_entropy(moe_lm_forward(params, batch["tokens"], config), batch["labels"])


def make_moe_lm_batch(config: MoELMConfig, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
    """The learnable token sequences of ``make_gpt_batch``, at this model's vocab and length."""
    return make_gpt_batch(_dense_view(config), key, batch_size)


def moe_lm_abstract_params(config: MoELMConfig) -> Params:
    """The parameter pytree as ``jax.ShapeDtypeStruct`` leaves; nothing is allocated."""
    return jax.eval_shape(lambda key: init_moe_lm(config, key), jax.random.key(0))


def moe_lm_abstract_batch(config: MoELMConfig, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
    """A batch of ``jax.ShapeDtypeStruct`` leaves, for tracing without data."""
    check_positive_int("moe_lm_abstract_batch", "batch_size", batch_size)
    return gpt_abstract_batch(_dense_view(config), batch_size)
