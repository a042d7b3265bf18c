"""Accumulation loops in a jaxpr: which scan carries only add up per-iteration values, and
which values reach them through linear operations alone.

``alpa_mini.grad``'s micro-batch loop is such a scan (``carry = carry + grads``). A reduction
across devices that feeds a carry only through linear steps can wait until after the loop:
the sum of per-group partial sums is the same number. The planner prices those reductions
once per loop (``tracing.py``) and the lowering defers them (``shard/deferred.py``); both
read the same two functions here, so the price and the program agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax.extend.core import Jaxpr, Literal

from .jaxpr_walk import INLINED_PRIMITIVES, call_jaxpr_of

__all__ = [
    "LINEAR_UNARY",
    "accumulating_carries",
    "deferrable_vars",
    "is_float_var",
    "linear_operands",
    "loop_deferrable",
]

#: Primitives linear in their single array operand (layout, dtype, sums along axes).
LINEAR_UNARY = frozenset(
    {
        "neg",
        "convert_element_type",
        "transpose",
        "reshape",
        "reduce_sum",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "copy",
        "copy_p",
        "slice",
        "rev",
    }
)
#: Primitives linear in every operand together (sums of contributions).
_SUMS = frozenset({"add", "add_any", "sub"})


def linear_operands(eqn: Any) -> tuple[int, ...]:
    """Operands the equation is linear in, jointly, given the others: every operand of a
    sum, the one array operand of a layout or dtype change, the non-scalar factor of a
    product or the numerator of a division by a scalar (a loss scale, ``1 / count``)."""
    name, ins = eqn.primitive.name, eqn.invars
    if name in LINEAR_UNARY:
        return (0,)
    if name in _SUMS:  # a literal term would make it affine, not linear
        return () if any(isinstance(v, Literal) for v in ins) else tuple(range(len(ins)))
    if name in ("mul", "div") and len(ins) == 2:
        fixed = [isinstance(v, Literal) for v in ins]
        scalar = [f or not getattr(v.aval, "shape", ()) for f, v in zip(fixed, ins, strict=True)]
        if name == "div":
            return (0,) if scalar[1] and not fixed[0] else ()
        for k in (0, 1):  # the other factor a literal, or a scalar beside an array
            if not fixed[k] and (fixed[1 - k] or (scalar[1 - k] and not scalar[k])):
                return (k,)
    return ()


def is_float_var(v: Any) -> bool:
    dtype = getattr(getattr(v, "aval", None), "dtype", None)
    return dtype is not None and getattr(dtype, "kind", "") == "f"


def accumulating_carries(body: Jaxpr, n_consts: int, n_carry: int) -> dict[int, Any]:
    """Carry index -> the body variable added to it, for the carries a scan body updates as
    ``carry + d`` and reads nowhere else."""
    uses: dict[Any, int] = {}
    for eqn in body.eqns:
        for v in eqn.invars:
            if not isinstance(v, Literal):
                uses[v] = uses.get(v, 0) + 1
    for v in body.outvars:
        if not isinstance(v, Literal):
            uses[v] = uses.get(v, 0) + 1
    producer = {o: eqn for eqn in body.eqns for o in eqn.outvars}
    found: dict[int, Any] = {}
    for c in range(n_carry):
        carry, out = body.invars[n_consts + c], body.outvars[c]
        eqn = producer.get(out)
        if eqn is None or eqn.primitive.name not in ("add", "add_any") or len(eqn.invars) != 2:
            continue
        a, b = eqn.invars
        d = b if a is carry else a if b is carry else None
        if d is None or isinstance(d, Literal) or d is carry or not is_float_var(carry):
            continue
        if uses.get(carry, 0) == 1 and uses.get(out, 0) == 1:
            found[c] = d
    return found


def deferrable_vars(
    jaxpr: Jaxpr, seeds: Sequence[Any], path: tuple[int, ...]
) -> set[tuple[tuple[int, ...], Any]]:
    """``(path, var)`` of every value that reaches one of ``seeds`` (variables of ``jaxpr``,
    which sits at ``path``) through linear operations only, inside inlined calls too."""
    wanted: set[Any] = {v for v in seeds if not isinstance(v, Literal)}
    found: set[tuple[tuple[int, ...], Any]] = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        hit = [k for k, o in enumerate(eqn.outvars) if o in wanted]
        if not hit:
            continue
        name = eqn.primitive.name
        if name in INLINED_PRIMITIVES:
            sub, _ = call_jaxpr_of(eqn)
            here = (*path, i)
            inner = deferrable_vars(sub, [sub.outvars[k] for k in hit], here)
            found |= inner
            wanted.update(
                v
                for v, s in zip(eqn.invars, sub.invars, strict=True)
                if not isinstance(v, Literal) and (here, s) in inner
            )
        elif name == "scan":
            found |= _scan_deferrable(eqn, hit, (*path, i))
        else:
            for k in linear_operands(eqn):
                v = eqn.invars[k]
                if not isinstance(v, Literal) and is_float_var(v):
                    wanted.add(v)
    found |= {(path, v) for v in wanted}
    return found


def _scan_deferrable(eqn: Any, hit: Sequence[int], here: tuple[int, ...]) -> set[Any]:
    """Inside a scan whose results ``hit`` are wanted: what reaches its accumulators and the
    wanted stacked results. (The scan's own inputs are not followed: a partial value entering
    a loop is reduced there.)"""
    n_carry = eqn.params["num_carry"]
    ys = [k - n_carry for k in hit if k >= n_carry]
    return loop_deferrable(eqn.params["jaxpr"].jaxpr, eqn.params["num_consts"], n_carry, here, ys)


def loop_deferrable(
    body: Jaxpr, n_consts: int, n_carry: int, here: tuple[int, ...], ys: Sequence[int] = ()
) -> set[tuple[tuple[int, ...], Any]]:
    """``(here, var)`` of the scan body's values that may stay partial: those reaching its
    accumulating carries (and the stacked results ``ys``) linearly, the new carries too."""
    acc = accumulating_carries(body, n_consts, n_carry)
    seeds = [*acc.values(), *(body.outvars[n_carry + k] for k in ys)]
    found = deferrable_vars(body, seeds, here)
    found |= {(here, body.outvars[c]) for c in acc}
    return found
