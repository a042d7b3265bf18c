"""``flatten_calls`` splices nested plain calls into one flat jaxpr: no call is left, every
other equation is kept (the same primitives, as re-tracing the function gives them), the
jaxpr type-checks, and it computes what the original computes."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal, check_jaxpr, jaxpr_as_fun

from alpa_mini.graph.jaxpr_walk import (
    CALL_PRIMITIVES,
    call_jaxpr_of,
    eval_eqns,
    flatten_calls,
    subjaxprs,
)

CONST = np.arange(4.0, dtype=np.float32)


@jax.jit
def _inner(x, w):
    # A closed-over array (a constant of the callee), a literal, a dropped result.
    y, _ = jnp.linalg.qr(w)
    return jnp.tanh(x @ y) * 2.0 + CONST, x


@jax.jit
def _outer(x, w):
    a, passthrough = _inner(x, w)  # the callee hands an input straight back
    b, _ = _inner(a, w)  # the same callee again: its jaxpr is spliced twice
    return jax.nn.gelu(b) + passthrough


def _loss(x, w):
    h = _outer(x, w)
    h = jax.lax.scan(lambda c, _: (_inner(c, w)[0], None), h, None, length=2)[0]
    return jnp.sum(jax.checkpoint(lambda v: jnp.sin(v) ** 2)(h)), 3.0


def _retraced(closed):
    """The reference: the function traced again with every call evaluated inline."""

    def run(jaxpr, consts, args):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))
        for e in jaxpr.eqns:
            if e.primitive.name in CALL_PRIMITIVES:
                ins = [v.val if isinstance(v, Literal) else env[v] for v in e.invars]
                env.update(zip(e.outvars, run(*call_jaxpr_of(e), ins), strict=True))
            else:
                eval_eqns([e], env)
        return [v.val if isinstance(v, Literal) else env[v] for v in jaxpr.outvars]

    return jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, a))(*closed.in_avals)


def _primitives(jaxpr) -> collections.Counter:
    """Primitives of a jaxpr's own equations, calls looked through."""
    count: collections.Counter = collections.Counter()
    for e in jaxpr.eqns:
        if e.primitive.name in CALL_PRIMITIVES:
            count += _primitives(subjaxprs(e)[0])
        else:
            count[e.primitive.name] += 1
    return count


def test_calls_are_spliced_and_the_function_is_unchanged():
    x, w = jnp.ones((3, 4)), jax.random.normal(jax.random.PRNGKey(0), (4, 4))
    closed = jax.make_jaxpr(_loss)(x, w)
    flat = flatten_calls(closed)
    check_jaxpr(flat.jaxpr)
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert not CALL_PRIMITIVES & set(names)
    assert "scan" in names and {"checkpoint", "remat2"} & set(names)  # kept whole
    assert _primitives(flat.jaxpr) == _primitives(closed.jaxpr)
    assert names == [e.primitive.name for e in _retraced(closed).jaxpr.eqns]
    # Two splices of one callee get variables of their own.
    outs = [v for e in flat.jaxpr.eqns for v in e.outvars]
    assert len(set(map(id, outs))) == len(outs)
    got = jaxpr_as_fun(flat)(x, w)
    want = jaxpr_as_fun(_retraced(closed))(x, w)  # op by op too (a jit call fuses)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_jaxpr_without_calls_is_returned_as_is():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    assert flatten_calls(closed) is closed
