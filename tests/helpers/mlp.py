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


def _tanh_mlp_loss(params, batch, marks: bool):
    """A tanh MLP, one weight per layer; ``marks``: a pipeline boundary between layers."""
    from alpa_mini import mark_pipeline_boundary

    x = batch["x"]
    for i, w in enumerate(params):
        x = jnp.tanh(x @ w)
        if marks and i < len(params) - 1:
            mark_pipeline_boundary()
    return jnp.mean((x - batch["y"]) ** 2)


def marked_mlp_loss(params, batch):
    """A tanh MLP with a pipeline boundary between layers (one layer per weight)."""
    return _tanh_mlp_loss(params, batch, marks=True)


def loop_mlp_loss(params, batch):
    """``marked_mlp_loss`` without its markers: a plain Python loop over the layers."""
    return _tanh_mlp_loss(params, batch, marks=False)


def marked_mlp_args(
    layers: int = 4, width: int = 16, batch: int = 32, *, scale: float = 0.3, zero_y: bool = False
):
    """(params, batch) for ``marked_mlp_loss``: ``layers`` square weights, normal data."""
    k = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [jax.random.normal(k[i], (width, width)) * scale for i in range(layers)]
    y = jnp.zeros((batch, width)) if zero_y else jax.random.normal(k[-1], (batch, width))
    return params, {"x": jax.random.normal(k[-2], (batch, width)), "y": y}


def plan_marked_mlp(num_micro_batches: int = 4, **method_options):
    """The pipeshard plan of a fresh ``cpu-2x4`` runtime for an SGD step of the 4-layer
    marked MLP (width 32, batch 64), stages searched (``method_options``: more
    ``PipeshardParallel`` fields)."""
    import alpa_mini
    from alpa_mini.models import make_train_step, sgd

    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    params, data = marked_mlp_args(4, 32, 64)
    opt = sgd(0.1)
    step = make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad)
    method = alpa_mini.PipeshardParallel(num_micro_batches=num_micro_batches, **method_options)
    return alpa_mini.plan(step, params, opt.init(params), data, method=method)


def train_beside_serial(loss, params, batch, method, steps: int = 2):
    """``steps`` SGD steps of ``loss`` under ``method`` and under plain ``jax.jit``: losses
    and the final parameters equal to 1e-6. Returns the parallel executable."""
    import alpa_mini
    from alpa_mini.models import make_train_step, sgd

    opt = sgd(0.1)
    step = alpa_mini.parallelize(
        make_train_step(loss, opt, alpa_mini.value_and_grad), method=method
    )
    serial = jax.jit(make_train_step(loss, opt))
    got = want = (params, opt.init(params))
    for _ in range(steps):
        *got, l_got = step(*got, batch)
        *want, l_want = serial(*want, batch)
        np.testing.assert_allclose(float(l_got), float(l_want), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    return step.get_executable(params, opt.init(params), batch)
