"""One mixture-of-experts layer (GShard-style top-2 gating, dense dispatch/combine einsums).

Parameter layout (fp32 arrays; H = hidden, F = ffn, E = num_experts)::

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from alpa_mini.cluster import ConfigError

from .mlp import check_positive_int, init_layer_norm, layer_norm, split_normal

__all__ = [
    "MoEConfig",
    "init_moe",
    "make_moe_batch",
    "moe_capacity",
    "moe_forward",
    "moe_loss",
    "moe_num_params",
    "moe_routing",
]

Params = dict[str, Any]

TOP_K = 2
_TEACHER_SEED = 4321  # fixed, so every batch comes from the same learnable target


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
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool)
            or not isinstance(cf, int | float)
            or not math.isfinite(cf)
            or cf <= 0
        ):
            raise ConfigError(
                f"MoEConfig.capacity_factor: {cf!r} is invalid; expected None or a number > 0"
            )


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
