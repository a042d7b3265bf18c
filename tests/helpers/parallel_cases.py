"""Tiny models, serial references and tree comparisons for ``test_parallel_numerics.py``.

Every model is as small as still exercises its structure (several layers, attention heads, a
scanned stack, top-2 routing, convolutions), because planning is the slow part of a parallel
numerics test. Serial references (plain ``jax.jit`` on one device) are cached per model and
optimiser, so each is compiled once however many mesh shapes are compared with it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

import alpa_mini.models as M

NUM_STEPS = 3
BATCH = 8  # divisible by every mesh axis product used here
SGD_LR = 0.1
ADAM_LR = 1e-2


@dataclass(frozen=True)
class ModelCase:
    """A model as a loss over (params, batch), its initial params and a batch factory."""

    name: str
    loss: Callable[[Any, Any], jax.Array]
    init: Callable[[], Any]
    batch: Callable[[int], Any]  # step index -> batch (a different batch every step)


def _mlp() -> ModelCase:
    cfg = M.MLPConfig(in_dim=16, hidden=32, out_dim=8, num_layers=3)
    return ModelCase(
        "mlp",
        M.mlp_loss,
        lambda: M.init_mlp(cfg, jax.random.key(0)),
        lambda i: M.make_mlp_batch(cfg, jax.random.key(100 + i), BATCH),
    )


def _gpt(scan: bool) -> ModelCase:
    cfg = M.GPTConfig(
        vocab_size=32, seq_len=8, hidden=16, num_heads=2, num_layers=2, scan_layers=scan
    )
    return ModelCase(
        "gpt_scan" if scan else "gpt",
        M.gpt_loss,
        lambda: M.init_gpt(cfg, jax.random.key(0)),
        lambda i: M.make_gpt_batch(cfg, jax.random.key(100 + i), BATCH),
    )


def _gpt_tiny() -> ModelCase:
    cfg = M.GPT_TINY
    return ModelCase(
        "gpt_tiny",
        M.gpt_loss,
        lambda: M.init_gpt(cfg, jax.random.key(0)),
        lambda i: M.make_gpt_batch(cfg, jax.random.key(100 + i), BATCH),
    )


def _moe() -> ModelCase:
    cfg = M.MoEConfig(hidden=8, ffn=16, num_experts=4, seq_len=8)
    return ModelCase(
        "moe",
        M.moe_loss,
        lambda: M.init_moe(cfg, jax.random.key(0)),
        lambda i: M.make_moe_batch(cfg, jax.random.key(100 + i), BATCH),
    )


def _wide_resnet() -> ModelCase:
    cfg = M.WideResNetConfig(image_size=8, in_channels=3, width=8, num_blocks=1, num_classes=4)
    return ModelCase(
        "wide_resnet",
        M.wide_resnet_loss,
        lambda: M.init_wide_resnet(cfg, jax.random.key(0)),
        lambda i: M.make_wide_resnet_batch(cfg, jax.random.key(100 + i), BATCH),
    )


_FACTORIES: dict[str, Callable[[], ModelCase]] = {
    "mlp": _mlp,
    "gpt": functools.partial(_gpt, False),
    "gpt_scan": functools.partial(_gpt, True),
    "moe": _moe,
    "wide_resnet": _wide_resnet,
    "gpt_tiny": _gpt_tiny,
}


@functools.cache
def model_case(name: str) -> ModelCase:
    return _FACTORIES[name]()


@functools.cache
def initial(name: str) -> tuple[Any, tuple[Any, ...]]:
    """(params, batches) of a model, built once: identical inputs for every comparison."""
    case = model_case(name)
    params = jax.device_get(case.init())
    batches = tuple(jax.device_get(case.batch(i)) for i in range(NUM_STEPS))
    return params, batches


def optimizer(name: str) -> M.Optimizer:
    return {"sgd": M.sgd(SGD_LR), "adam": M.adam(ADAM_LR)}[name]


def train_step(model: str, opt: str) -> Callable[..., Any]:
    return M.make_train_step(model_case(model).loss, optimizer(opt))


def run_steps(step: Callable[..., Any], params: Any, state: Any, batches: Any) -> Any:
    """Apply ``step`` once per batch; return (params, state, losses, state after step 1)."""
    losses, first_state = [], None
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(loss)
        first_state = state if first_state is None else first_state
    return jax.device_get((params, state, np.stack([np.asarray(x) for x in losses]), first_state))


@functools.cache
def serial_result(model: str, opt: str) -> Any:
    """The reference: ``jax.jit(train_step)`` on one device, from the shared inputs."""
    params, batches = initial(model)
    state = optimizer(opt).init(params)
    return run_steps(jax.jit(train_step(model, opt)), params, state, batches)


def assert_trees_close(actual: Any, expected: Any, *, rtol: float, atol: float, what: str) -> None:
    """``np.testing.assert_allclose`` leaf by leaf, naming the worst leaf on failure."""
    a_leaves, a_tree = jax.tree_util.tree_flatten_with_path(actual)
    e_leaves, e_tree = jax.tree.flatten(expected)
    assert a_tree == e_tree or len(a_leaves) == len(e_leaves), f"{what}: tree structures differ"
    bad = []
    for (path, a), e in zip(a_leaves, e_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}{jax.tree_util.keystr(path)}"
        excess = np.abs(a.astype(np.float64) - e) - (atol + rtol * np.abs(e.astype(np.float64)))
        if excess.size and excess.max() > 0:
            worst = np.unravel_index(np.argmax(excess), excess.shape)
            bad.append(
                f"{what}{jax.tree_util.keystr(path)}: max |diff| "
                f"{np.abs(a.astype(np.float64) - e).max():.3g} (at {worst}: {a[worst]} vs "
                f"{e[worst]}; rtol={rtol}, atol={atol})"
            )
    assert not bad, "\n".join(bad)


def max_abs_diff(actual: Any, expected: Any) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(e, np.float64)), initial=0.0))
        for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    )
