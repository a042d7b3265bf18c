"""The two-layer MLP of the ShardParallel closed-form tests, its SGD step and the cost of an
all-reduce on the test cluster's links (alpha + 2 beta (n - 1) / n bytes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from alpa_mini import ClusterSpec

CPU = ClusterSpec.named("cpu-1x8")
ALPHA, BETA = CPU.intra_host.alpha, CPU.intra_host.beta


def all_reduce(nbytes: float, n: int) -> float:
    return ALPHA + 2 * BETA * (n - 1) / n * nbytes


def mlp_loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def sgd_step(p, x, y):
    loss, g = jax.value_and_grad(mlp_loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def mlp_inputs(batch: int, hidden: int):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {
        "w1": jax.random.normal(k[0], (hidden, hidden)) / np.sqrt(hidden),
        "w2": jax.random.normal(k[1], (hidden, hidden)) / np.sqrt(hidden),
    }
    return p, jax.random.normal(k[2], (batch, hidden)), jax.random.normal(k[3], (batch, hidden))


def mlp_forward(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]
