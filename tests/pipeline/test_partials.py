"""``lower/partials.py``: per-group partial gradients sum to JAX's own gradient, for every
kind of equation that gets a grouped use, and the groups sit on the data-parallel axis."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_mini.pipeline.lower.partials import (
    GroupSplit,
    eval_with_partials,
    partial_sharding,
    plan_partials,
)

ROWS, GROUPS = 8, 4


def _grads_with_partials(f, params, x):
    """(plain cotangents, per-group partials) of ``f(params, x)`` evaluated with partials,
    and the parameters that got grouped uses."""
    closed = jax.make_jaxpr(f)(params, x)
    jaxpr = closed.jaxpr
    flat, tree = jax.tree.flatten(params)
    pvars = jaxpr.invars[: len(flat)]
    split = GroupSplit(ROWS, GROUPS, ("x",))
    plan = plan_partials(jaxpr.eqns, pvars, jaxpr.outvars, split)
    mesh = Mesh(jax.devices()[:GROUPS], ("x",))
    grouped = [p for p in pvars if p in plan.grouped]
    sh = {p: partial_sharding(NamedSharding(mesh, PartitionSpec()), split) for p in grouped}

    def run(pvals, zs, xval):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(pvars, pvals, strict=True))
        env[jaxpr.invars[-1]] = xval
        eval_with_partials(jaxpr.eqns, env, plan, dict(zip(grouped, zs, strict=True)), split, sh)
        return env[jaxpr.outvars[0]]

    zs = [jnp.zeros((GROUPS, *p.aval.shape), p.aval.dtype) for p in grouped]
    x = jax.device_put(x, NamedSharding(mesh, PartitionSpec("x")))
    dp, dz = jax.jit(jax.grad(run, argnums=(0, 1)))(flat, zs, x)
    total = list(dp)
    for p, z in zip(grouped, dz, strict=True):
        k = pvars.index(p)
        assert z.shape == (GROUPS, *flat[k].shape)
        total[k] = total[k] + jnp.sum(z, axis=0)
    return jax.tree.unflatten(tree, total), {pvars.index(p) for p in grouped}


def _rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(key), shape).astype(dtype)


CASES = {
    # matmul, parameter on the right (x @ W) and on the left (W @ x^T), a bias add
    "dense": (
        lambda p, x: jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2),
        {"w": _rand(1, (6, 5)), "b": _rand(2, (5,))},
        (ROWS, 6),
    ),
    "left_matmul": (
        lambda p, x: jnp.sum(jnp.sin(p["w"] @ x.T)),
        {"w": _rand(3, (5, 6))},
        (ROWS, 6),
    ),
    # a 3-d activation: rows, sequence; heads by einsum with two contracted axes
    "einsum_heads": (
        lambda p, x: jnp.sum(jnp.einsum("bsh,hnd->bsnd", x, p["w"]) ** 2),
        {"w": _rand(4, (6, 2, 3))},
        (ROWS, 3, 6),
    ),
    "two_contracted": (
        lambda p, x: jnp.sum(jnp.cos(jnp.einsum("bnd,ndk->bk", x, p["w"]))),
        {"w": _rand(5, (2, 3, 4))},
        (ROWS, 2, 3),
    ),
    # a transposed parameter (the chain) and a scale/shift as layer norm applies them
    "transposed": (
        lambda p, x: jnp.sum(jnp.tanh(x @ p["w"].T)),
        {"w": _rand(6, (5, 6))},
        (ROWS, 6),
    ),
    "norm_affine": (
        lambda p, x: jnp.sum(jnp.tanh(x * p["g"] - p["b"]) / (1.5 + p["s"] ** 2)),
        {"g": _rand(7, (6,)), "b": _rand(8, (6,)), "s": _rand(9, (6,))},
        (ROWS, 3, 6),
    ),
    "bf16_matmul": (
        lambda p, x: jnp.sum(
            jnp.tanh(jnp.dot(x, p["w"], preferred_element_type=jnp.float32)).astype(jnp.float32)
        ),
        {"w": _rand(10, (6, 5), jnp.bfloat16)},
        (ROWS, 6),
    ),
    "embedding": (
        lambda p, x: jnp.sum(jnp.tanh(p["e"][jnp.abs(x[:, 0] * 3).astype(jnp.int32) % 7])),
        {"e": _rand(11, (7, 4))},
        (ROWS, 2),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_partials_sum_to_the_gradient(case):
    f, params, xshape = CASES[case]
    x = _rand(100, xshape, jnp.bfloat16 if case == "bf16_matmul" else jnp.float32)
    got, grouped = _grads_with_partials(f, params, x)
    want = jax.grad(f)(params, x)
    assert grouped == set(range(len(params)))  # every parameter's use was grouped
    # The partials add the same terms in another order: fp32 noise relative to the scale.
    tol = 2e-2 if case == "bf16_matmul" else 1e-6
    for k in want:
        w = np.asarray(want[k], np.float32)
        atol = tol * max(1.0, float(np.abs(w).max()))
        np.testing.assert_allclose(np.asarray(got[k], np.float32), w, rtol=tol, atol=atol)


def _expert_plan(f, params, xshape, local_dims):
    """``plan_partials`` of ``f(params, x)`` with each parameter's ``local_dims`` (the
    dimensions its layout splits over the data-parallel axis)."""
    jaxpr = jax.make_jaxpr(f)(params, jnp.zeros(xshape)).jaxpr
    flat = jax.tree.leaves(params)
    pvars = jaxpr.invars[: len(flat)]
    local = {p: frozenset(d) for p, d in zip(pvars, local_dims, strict=True)}
    plan = plan_partials(jaxpr.eqns, pvars, jaxpr.outvars, GroupSplit(ROWS, GROUPS, ("x",)), local)
    return plan, pvars


def test_expert_weights_split_over_the_rows_axis_stay_plain():
    """A mixture of experts pairs each expert's weight with its own tokens (the einsum's
    batch dimension e). Split over the data-parallel axis along e (expert parallelism), the
    weight's gradient needs no reduction and is left to the partitioner; split along another
    dimension (ZeRO-like), or not split, it is grouped as before. The same holds for a
    scanned stack of expert layers, whose slices lack the stacked axis."""
    w = _rand(12, (4, 6, 5))  # [e, h, f]
    f = lambda p, x: jnp.sum(jnp.tanh(jnp.einsum("bech,ehf->becf", x, p["w"])))  # noqa: E731
    xshape = (ROWS, 4, 3, 6)
    for dims, grouped in (((0,), False), ((1,), True), ((), True)):
        plan, (pw,) = _expert_plan(f, {"w": w}, xshape, [dims])
        assert (pw in plan.grouped, pw in plan.plain) == (grouped, not grouped), dims

    def stacked(p, x):
        def layer(h, wl):
            return jnp.tanh(jnp.einsum("bech,ehf->becf", h, wl)), None

        return jnp.sum(jax.lax.scan(layer, x, p["w"])[0])

    ws = _rand(13, (2, 4, 6, 6))  # [layers, e, h, f]
    for dims, grouped in (((1,), False), ((2,), True)):
        plan, (pw,) = _expert_plan(stacked, {"w": ws}, (ROWS, 4, 3, 6), [dims])
        assert (pw in plan.grouped) == grouped, dims
