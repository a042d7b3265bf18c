"""Unreduced parameter gradients: each data-parallel group's contribution kept apart.

A data-parallel stage's weight gradient is a sum over the micro-batch's rows. Left to the
partitioner, every backward reduces it across the groups of devices that hold different rows
(an all-reduce per micro-batch). Alpa and Megatron-LM instead add the per-group partial sums
locally over micro-batches and reduce once per step. JAX expresses "unreduced" only in
Explicit sharding mode, which arbitrary user code does not trace under, so this module keeps
the global semantics and makes the partial sums an ordinary array instead:

- every parameter ``p`` gets a zero-valued companion ``z`` of shape ``(D, *p.shape)``, its
  leading axis laid out over the stage's data-parallel mesh axes (``D`` groups);
- where an equation first mixes a value computed from ``p`` alone (``q = chain(p)``) with
  row-indexed values, and the rows sit on a free axis of it (a matmul's non-contracted axis,
  a broadcast's new axis, a convolution's or an embedding lookup's batch axis), the equation
  is evaluated through a custom VJP: the forward is the equation itself, and the backward
  gives ``p`` no cotangent and ``z`` the vmapped per-group cotangents (rows split into ``D``
  contiguous blocks), so the partitioner computes each block where its rows live;
- a remat block (``checkpoint``) or a ``scan`` that receives ``p`` itself (a scan as a
  constant or as stacked per-iteration slices) is planned the same way inside its body, and
  re-issued with the body's own companions (``_Nested``);
- every other use of ``p`` differentiates ``p`` as before (reduced by the partitioner). So
  does a contraction that pairs a dimension of ``p`` with the rows' values (a batch dimension
  of ``dot_general``, as a mixture of experts pairs each expert's weight with its tokens)
  where ``p``'s layout splits that dimension over the data-parallel axes (expert
  parallelism): each device already holds the tokens of its own experts, so their gradient
  needs no reduction, and a partial would have to hold every expert, unsplit, per group.

The total gradient is ``dp + sum(dz, axis=0)``: exact, whichever axis is split, because each
split equation is row-wise along it; the layout only decides whether the partials need no
communication. ``plan_partials`` decides statically which parameters get which kind of use,
``eval_with_partials`` evaluates a stage that way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal
from jax.sharding import NamedSharding, PartitionSpec

from ...graph.jaxpr_walk import bind_equation, equation_context, eval_eqns
from ..stage_slice import is_float

__all__ = ["GroupSplit", "PartialsPlan", "eval_with_partials", "partial_sharding", "plan_partials"]


@dataclass(frozen=True)
class GroupSplit:
    """How a stage's rows split into data-parallel groups: ``rows`` per micro-batch, ``groups``
    blocks, laid out over mesh ``axes`` (whose sizes multiply to ``groups``)."""

    rows: int
    groups: int
    axes: tuple[str, ...]


@dataclass(frozen=True)
class _Use:
    """Equation ``eqn`` uses parameter ``param`` through operand ``operand`` (computed from
    the parameter by ``chain``); ``in_axes``: the split axis of each operand (None: not
    split, the parameter's own operand included); ``out_axis``: the output's split axis."""

    param: Any
    operand: int
    chain: tuple[Any, ...]
    in_axes: tuple[int | None, ...]
    out_axis: int


@dataclass(frozen=True)
class _Nested:
    """Equation ``eqn`` (a ``checkpoint`` or a ``scan``) reads parameters directly: body
    input ``k`` is outer parameter ``params[k]`` (absent: not a parameter), planned by
    ``plan`` over the body; ``stacked`` holds the body inputs that are a scan's per-iteration
    slices of a stacked parameter; ``grouped``: the outer parameters with grouped uses."""

    params: dict[int, Any]
    plan: PartialsPlan
    stacked: frozenset[int]
    grouped: frozenset[Any]


@dataclass(frozen=True)
class PartialsPlan:
    """Per equation index, the grouped use it is (if any); which parameters have grouped
    uses and which still have ordinary (reduced-per-call) ones."""

    uses: dict[int, _Use | _Nested]
    grouped: frozenset[Any]
    plain: frozenset[Any]


def plan_partials(
    eqns: Sequence[Any],
    params: Sequence[Any],
    outputs: Sequence[Any],
    split: GroupSplit,
    local: Mapping[Any, frozenset[int]] | None = None,
) -> PartialsPlan:
    """Decide, from shapes (and ``local``: per parameter, the dimensions its layout splits
    over the data-parallel axes), which equations of a stage (reading ``params``, defining
    ``outputs``) become grouped uses of which parameter."""
    local = local or {}
    param_set = set(params)
    # var -> (parameter it is computed from alone, the equations that compute it)
    chain: dict[Any, tuple[Any, tuple[Any, ...]]] = {p: (p, ()) for p in params}
    uses: dict[int, _Use] = {}
    plain: set[Any] = set()
    for i, eqn in enumerate(eqns):
        origins = {chain[v][0] for v in eqn.invars if not isinstance(v, Literal) and v in chain}
        if not origins:
            continue
        if eqn.primitive.name in _NESTING:
            found = _nested_use(eqn, param_set, chain, split, local)
            if found is not None:
                uses[i], nested_plain = found
                plain.update(nested_plain)
                continue
        if len(origins) == 1 and not eqn.primitive.multiple_results:
            (p,) = origins
            use = _grouped_use(eqn, p, chain, split, local.get(p, frozenset()))
            if use is not None:
                uses[i] = use
                continue
            if all(isinstance(v, Literal) or v in chain for v in eqn.invars):
                pos = next(
                    k for k, v in enumerate(eqn.invars) if not isinstance(v, Literal) and v in chain
                )
                steps = (*chain[eqn.invars[pos]][1], eqn)
                for k, v in enumerate(eqn.invars):
                    if k != pos and not isinstance(v, Literal):
                        steps = (*chain[v][1], *steps)
                chain[eqn.outvars[0]] = (p, _dedupe(steps))
                continue
        plain.update(origins)
    # A value computed from a parameter alone that leaves the stage is an ordinary use too.
    plain.update(chain[v][0] for v in outputs if not isinstance(v, Literal) and v in chain)
    grouped: set[Any] = set()
    for u in uses.values():
        if isinstance(u, _Use):
            grouped.add(u.param)
        else:
            grouped.update(u.grouped)
    return PartialsPlan(uses, frozenset(grouped), frozenset(plain & param_set))


#: Equations whose body is planned for partials too (remat blocks, scanned stacks).
_NESTING = frozenset({"checkpoint", "remat2", "scan"})


def _body_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]]:
    """A nesting equation's body (its inputs match the equation's) and the body's consts."""
    body = eqn.params["jaxpr"]
    return (body.jaxpr, body.consts) if hasattr(body, "jaxpr") else (body, ())


def _nested_use(
    eqn: Any,
    param_set: set[Any],
    chain: dict[Any, Any],
    split: GroupSplit,
    local: Mapping[Any, frozenset[int]],
) -> tuple[_Nested, set[Any]] | None:
    """The nested plan of a remat block or a scan that receives parameters themselves, and
    the outer parameters left with ordinary uses; None when nothing inside is grouped."""
    body, _ = _body_jaxpr(eqn)
    scan = eqn.primitive.name == "scan"
    n_consts = eqn.params["num_consts"] if scan else len(eqn.invars)
    n_carry = eqn.params["num_carry"] if scan else 0
    params: dict[int, Any] = {}
    stacked: set[int] = set()
    plain: set[Any] = set()
    for k, v in enumerate(eqn.invars):
        if isinstance(v, Literal) or v not in chain:
            continue
        if v not in param_set or n_consts <= k < n_consts + n_carry:
            plain.add(chain[v][0])  # derived values and loop carries stay ordinary
            continue
        params[k] = v
        if k >= n_consts + n_carry:
            stacked.add(k)
    if not params:
        return None
    inner = [body.invars[k] for k in params]
    # A scan's per-iteration slice of a stacked parameter lacks its leading (layer) axis.
    shift = {k: int(k in stacked) for k in params}
    inner_local = {
        body.invars[k]: frozenset(d - shift[k] for d in local.get(p, ()) if d >= shift[k])
        for k, p in params.items()
    }
    sub = plan_partials(body.eqns, inner, body.outvars, split, inner_local)
    if not sub.grouped:
        return None
    outer_of = {body.invars[k]: p for k, p in params.items()}
    plain.update(outer_of[v] for v in sub.plain)
    grouped = frozenset(outer_of[v] for v in sub.grouped)
    return _Nested(params, sub, frozenset(stacked), grouped), plain


def _dedupe(eqns: tuple[Any, ...]) -> tuple[Any, ...]:
    seen: set[int] = set()
    out = []
    for e in eqns:
        if id(e) not in seen:
            seen.add(id(e))
            out.append(e)
    return tuple(out)


def _grouped_use(
    eqn: Any, p: Any, chain: dict[Any, Any], split: GroupSplit, local: frozenset[int]
) -> _Use | None:
    """The grouped form of ``eqn`` if it mixes the parameter-derived operand with rows on a
    free axis, else None (also where it pairs a ``local`` dimension with the rows' values)."""
    ins = eqn.invars
    qpos = [k for k, v in enumerate(ins) if not isinstance(v, Literal) and v in chain]
    if len(qpos) != 1 or not is_float(ins[qpos[0]].aval):
        return None
    q = qpos[0]
    steps = chain[ins[q]][1]
    name = eqn.primitive.name
    found: tuple[tuple[int | None, ...], int] | None = None
    if name == "broadcast_in_dim" and len(ins) == 1:
        found = _broadcast_axes(eqn, split)
    elif name == "dot_general" and len(ins) == 2:
        if _pairs_local(eqn, q, p, local):
            return None
        found = _dot_axes(eqn, q, split)
    elif name == "conv_general_dilated" and q == 1 and len(ins) == 2:
        found = _conv_axes(eqn, split)
    elif name == "gather" and q == 0 and len(ins) == 2:
        found = _gather_axes(eqn, split)
    elif name in _ELEMENTWISE:
        found = _elementwise_axes(eqn, q, split)
    if found is None:
        return None
    in_axes, out_axis = found
    return _Use(p, q, steps, in_axes, out_axis)


#: Binary elementwise primitives, which broadcast size-1 axes (a bias added to activations).
_ELEMENTWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem"})


def _splittable(size: int, split: GroupSplit) -> bool:
    return size % split.groups == 0 and size % split.rows == 0 and size >= split.rows


def _broadcast_axes(eqn: Any, split: GroupSplit) -> tuple[tuple[int | None, ...], int] | None:
    shape = eqn.params["shape"]
    kept = dict(zip(eqn.params["broadcast_dimensions"], eqn.invars[0].aval.shape, strict=True))
    for ax, size in enumerate(shape):
        if (ax not in kept or (kept[ax] == 1 and size > 1)) and _splittable(size, split):
            return (None,), ax
    return None


def _pairs_local(eqn: Any, q: int, p: Any, local: frozenset[int]) -> bool:
    """Whether a ``dot_general`` pairs a ``local`` dimension of the parameter with the other
    operand (a batch dimension: each expert's weight with its own tokens). Read only where
    the operand keeps the parameter's shape (a cast); otherwise its dimensions are unknown
    and the use is grouped as any other."""
    if not local or tuple(eqn.invars[q].aval.shape) != tuple(p.aval.shape):
        return False
    _, batch = eqn.params["dimension_numbers"]
    return bool(local & set(batch[q]))


def _dot_axes(eqn: Any, q: int, split: GroupSplit) -> tuple[tuple[int | None, ...], int] | None:
    (contract, batch) = eqn.params["dimension_numbers"]
    y = 1 - q
    shapes = [v.aval.shape for v in eqn.invars]
    taken = [set(contract[k]) | set(batch[k]) for k in range(2)]
    free = [[d for d in range(len(shapes[k])) if d not in taken[k]] for k in range(2)]
    for n, d in enumerate(free[y]):
        if _splittable(shapes[y][d], split):
            out = len(batch[0]) + (n if y == 0 else len(free[0]) + n)
            axes: list[int | None] = [None, None]
            axes[y] = d
            return tuple(axes), out
    return None


def _elementwise_axes(
    eqn: Any, q: int, split: GroupSplit
) -> tuple[tuple[int | None, ...], int] | None:
    out = eqn.outvars[0].aval.shape
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    if any(len(s) != len(out) for s in shapes):
        return None
    for ax, size in enumerate(out):
        if shapes[q][ax] == 1 and size > 1 and _splittable(size, split):
            axes = tuple(None if k == q or s[ax] == 1 else ax for k, s in enumerate(shapes))
            return axes, ax
    return None


def _conv_axes(eqn: Any, split: GroupSplit) -> tuple[tuple[int | None, ...], int] | None:
    dn = eqn.params["dimension_numbers"]
    if eqn.params.get("batch_group_count", 1) != 1:
        return None
    lhs_batch, out_batch = dn.lhs_spec[0], dn.out_spec[0]
    if not _splittable(eqn.invars[0].aval.shape[lhs_batch], split):
        return None
    return (lhs_batch, None), out_batch


def _gather_axes(eqn: Any, split: GroupSplit) -> tuple[tuple[int | None, ...], int] | None:
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims or dn.start_indices_batching_dims:
        return None
    idx_shape = eqn.invars[1].aval.shape
    out_ndim = len(eqn.outvars[0].aval.shape)
    batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
    # Indices' last axis is the index vector (JAX's convention); the others map, in order,
    # onto the output's non-offset axes.
    for k in range(len(idx_shape) - 1):
        if _splittable(idx_shape[k], split):
            return (None, k), batch_out[k]
    return None


def partial_sharding(param_sharding: NamedSharding, split: GroupSplit) -> NamedSharding:
    """The layout of a parameter's partials: groups over the data-parallel axes, the rest as
    the parameter (minus those axes, which ZeRO layouts also use)."""
    dp = set(split.axes)
    rest = []
    for entry in param_sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,) if entry is not None else ()
        kept = tuple(n for n in names if n not in dp)
        rest.append(kept if len(kept) > 1 else kept[0] if kept else None)
    lead = split.axes if len(split.axes) > 1 else split.axes[0]
    return NamedSharding(param_sharding.mesh, PartitionSpec(lead, *rest))


def eval_with_partials(
    eqns: Sequence[Any],
    env: dict[Any, Any],
    plan: PartialsPlan,
    partials: dict[Any, Any],
    split: GroupSplit,
    shardings: Mapping[Any, NamedSharding],
    start: int = 0,
) -> None:
    """Evaluate ``eqns`` (the plan's equations from index ``start`` on) into ``env`` like
    ``eval_eqns``, routing each grouped use's parameter cotangent into ``partials[param]``
    (zeros of shape ``(D, *param.shape)`` laid out as ``shardings[param]``)."""
    for i, eqn in enumerate(eqns, start):
        use = plan.uses.get(i)
        if use is None:
            eval_eqns([eqn], env)
            continue
        invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
        if isinstance(use, _Nested):
            outs = _nested_call(eqn, use, invals, partials, split, shardings)
            env.update(zip(eqn.outvars, outs, strict=True))
            continue
        others = [x for k, x in enumerate(invals) if k != use.operand]
        fn = _grouped_call(eqn, use, split, shardings[use.param])
        env[eqn.outvars[0]] = fn(env[use.param], partials[use.param], *others)


def _nested_call(
    eqn: Any,
    use: _Nested,
    invals: list[Any],
    partials: dict[Any, Any],
    split: GroupSplit,
    shardings: Mapping[Any, NamedSharding],
) -> list[Any]:
    """Re-issue a remat block or a scan with its body evaluated with partials: the
    companions enter as extra inputs (a scan's stacked ones as per-iteration slices)."""
    body, consts = _body_jaxpr(eqn)
    grouped = [k for k, p in use.params.items() if p in use.grouped]
    sub_sh = {
        body.invars[k]: _drop_axis(shardings[use.params[k]], 1)
        if k in use.stacked
        else shardings[use.params[k]]
        for k in grouped
    }

    def run_body(args: Sequence[Any], zs: dict[int, Any]) -> list[Any]:
        local: dict[Any, Any] = dict(zip(body.constvars, consts, strict=True))
        local.update(zip(body.invars, args, strict=True))
        sub_partials = {body.invars[k]: z for k, z in zs.items()}
        eval_with_partials(body.eqns, local, use.plan, sub_partials, split, sub_sh)
        return [v.val if isinstance(v, Literal) else local[v] for v in body.outvars]

    zs = {k: partials[use.params[k]] for k in grouped}
    if eqn.primitive.name != "scan":
        fn = jax.checkpoint(
            run_body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
        )
        return fn(invals, zs)
    n_consts, n_carry = eqn.params["num_consts"], eqn.params["num_carry"]
    const_z = {k: z for k, z in zs.items() if k not in use.stacked}
    # A stacked companion (D, L, ...) is scanned along L: each iteration gets (D, ...).
    xs_z = {k: jnp.moveaxis(z, 1, 0) for k, z in zs.items() if k in use.stacked}
    const_vals = invals[:n_consts]

    def step(carry: list[Any], x: tuple[list[Any], dict[int, Any]]) -> tuple[Any, Any]:
        xs, zx = x
        outs = run_body([*const_vals, *carry, *xs], {**const_z, **zx})
        return outs[:n_carry], outs[n_carry:]

    carry, ys = jax.lax.scan(
        step,
        invals[n_consts : n_consts + n_carry],
        (invals[n_consts + n_carry :], xs_z),
        length=eqn.params["length"],
        reverse=eqn.params["reverse"],
        unroll=eqn.params["unroll"],
    )
    return [*carry, *ys]


def _drop_axis(sharding: NamedSharding, axis: int) -> NamedSharding:
    """``sharding`` without the spec entry of ``axis`` (a stacked axis scanned away)."""
    spec = tuple(sharding.spec) + (None,) * max(0, axis + 1 - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:axis], *spec[axis + 1 :]))


def _grouped_call(
    eqn: Any, use: _Use, split: GroupSplit, sharding: NamedSharding
) -> Callable[..., Any]:
    def operand(pv: Any) -> Any:
        # The chain reads only the parameter and literals (plan_partials), so it closes over
        # no traced value: a custom VJP may not.
        local = {use.param: pv}
        eval_eqns(use.chain, local)
        return local[eqn.invars[use.operand]] if use.chain else pv

    def apply(pv: Any, others: Sequence[Any], per_group: bool) -> Any:
        args = list(others)
        args.insert(use.operand, operand(pv))
        if per_group and eqn.primitive.name == "broadcast_in_dim":
            shape = list(eqn.params["shape"])
            shape[use.out_axis] //= split.groups
            params = dict(eqn.params, shape=tuple(shape))
            with equation_context(eqn):
                return eqn.primitive.bind(*args, **params)
        return bind_equation(eqn, args)[0]

    other_vars = [v for k, v in enumerate(eqn.invars) if k != use.operand]
    diff = [k for k, v in enumerate(other_vars) if is_float(v.aval)]

    @jax.custom_vjp
    def grouped(pv: Any, z: Any, *others: Any) -> Any:
        del z  # zero-valued; only its cotangent matters
        return apply(pv, others, False)

    def fwd(pv: Any, z: Any, *others: Any) -> tuple[Any, Any]:
        # Both halves of the backward are linearised here, so the residuals are what JAX's
        # own rules keep (none for a bias add, the other operand for a matmul), not the
        # operands themselves (which kept every bias add's input alive until the backward).
        del z

        def of_diff(*dvals: Any) -> Any:
            xs = list(others)
            for k, x in zip(diff, dvals, strict=True):
                xs[k] = x
            return apply(pv, xs, False)

        out, vjp_others = jax.vjp(of_diff, *(others[k] for k in diff))
        return out, (vjp_others, _group_residuals(eqn, use, split, operand, apply, pv, others))

    def bwd(res: Any, ct: Any) -> tuple[Any, ...]:
        vjp_others, group_res = res
        d_others: list[Any] = [None] * len(other_vars)
        for k, d in zip(diff, vjp_others(ct), strict=True):
            d_others[k] = d
        dz = _group_cotangents(eqn, use, split.groups, group_res, ct)
        dz = jax.lax.with_sharding_constraint(dz, sharding)
        return (None, dz, *d_others)

    grouped.defvjp(fwd, bwd)
    return grouped


def _group_residuals(
    eqn: Any,
    use: _Use,
    split: GroupSplit,
    operand: Callable[[Any], Any],
    apply: Callable[[Any, Sequence[Any], bool], Any],
    pv: Any,
    others: Sequence[Any],
) -> Any:
    """What the per-group cotangents of a grouped use need from its forward (a pytree of
    arrays: the linearisation in per-group copies of the parameter, or for a matmul the
    chain's and the other operand)."""
    copies = jnp.broadcast_to(pv, (split.groups, *jnp.shape(pv)))
    if eqn.primitive.name == "dot_general":
        _, vjp_chain = jax.vjp(jax.vmap(operand), copies)
        return vjp_chain, others[0]
    if eqn.primitive.name in _ELEMENTWISE:
        # Each group's operand repeated over its rows, the equation at its own shape: the
        # backward reduces the cotangent at its own shape (fused by XLA with its producer,
        # as for a plain bias) before summing rows into groups. (Reshaping the cotangent
        # into groups first cost a small GPT's step about 10%.)
        def per_group(c: Any) -> Any:
            args = list(others)
            rows = _repeat_groups(jax.vmap(operand)(c), use.out_axis, eqn.outvars[0].aval.shape)
            args.insert(use.operand, rows)
            return bind_equation(eqn, args)[0]
    else:
        axes = [a for k, a in enumerate(use.in_axes) if k != use.operand]

        def per_group(c: Any) -> Any:
            parts = [
                x if a is None else _split(x, a, split.groups)
                for x, a in zip(others, axes, strict=True)
            ]
            one = jax.vmap(lambda p, o_g: apply(p, o_g, True), in_axes=(0, axes))
            return _merge(one(c, parts), use.out_axis)

    _, vjp = jax.vjp(per_group, copies)
    return vjp


def _group_cotangents(eqn: Any, use: _Use, groups: int, res: Any, ct: Any) -> Any:
    """The per-group cotangents ``(groups, *param.shape)`` of a grouped use, from the
    output cotangent ``ct`` and ``_group_residuals``."""
    if eqn.primitive.name == "dot_general":
        vjp_chain, y = res
        (dz,) = vjp_chain(_dot_group_cotangents(eqn, use, groups, y, ct))
    else:
        (dz,) = res(ct)
    return dz


def _dot_group_cotangents(eqn: Any, use: _Use, groups: int, y: Any, ct: Any) -> Any:
    """Per-group cotangents of a matmul's parameter operand ``q``, groups first, from the
    other operand ``y`` and the output cotangent ``ct``: one batched ``dot_general`` whose
    output is already in ``q``'s axis order (JAX's own transpose rule for the batched matmul
    ends in a transpose that XLA's CPU backend materialises: a parameter-sized copy per
    use and micro-batch)."""
    (contract, batch) = eqn.params["dimension_numbers"]
    q, yk = use.operand, 1 - use.operand
    nd = [len(v.aval.shape) for v in eqn.invars]
    free = [[d for d in range(nd[k]) if d not in contract[k] and d not in batch[k]] for k in (0, 1)]
    first_free = [len(batch[0]), len(batch[0]) + len(free[0])]
    ct_of = {k: [first_free[k] + n for n in range(len(free[k]))] for k in (0, 1)}
    dims = ((tuple(free[yk]), tuple(ct_of[yk])), (tuple(batch[yk]), tuple(range(len(batch[0])))))
    y_contract = sorted(contract[yk])
    q_axes = [
        *batch[q],
        *(contract[q][list(contract[yk]).index(d)] for d in y_contract),
        *free[q],
    ]
    out_dtype = eqn.invars[q].aval.dtype

    def one(y_g: Any, ct_g: Any) -> Any:
        d = jax.lax.dot_general(
            y_g,
            ct_g,
            dims,
            precision=eqn.params.get("precision"),
            preferred_element_type=eqn.params.get("preferred_element_type"),
        )
        order = sorted(range(len(q_axes)), key=lambda i: q_axes[i])
        d = d if order == list(range(len(order))) else jnp.transpose(d, order)
        return d.astype(out_dtype)

    y_axis = use.in_axes[yk]
    return jax.vmap(one)(
        jnp.moveaxis(_split(y, y_axis, groups), y_axis, 0),
        jnp.moveaxis(_split(ct, use.out_axis, groups), use.out_axis, 0),
    )


def _merge(x: Any, axis: int) -> Any:
    """Inverse of ``_split``: ``x`` with groups first, merged back into ``axis``."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape((*x.shape[:axis], -1, *x.shape[axis + 2 :]))


def _repeat_groups(q: Any, axis: int, shape: Sequence[int]) -> Any:
    """Per-group operands ``q`` (groups first; size 1 at ``axis``) laid out over the rows:
    group g's value repeated over the g-th block of ``shape[axis]``."""
    groups = q.shape[0]
    q = jnp.moveaxis(q, 0, axis)  # (..., groups, 1, ...)
    blocks = list(q.shape)
    blocks[axis + 1] = shape[axis] // groups
    q = jnp.broadcast_to(q, blocks)
    return q.reshape((*blocks[:axis], shape[axis], *blocks[axis + 2 :]))


def _split(x: Any, axis: int, groups: int) -> Any:
    """``x`` with ``axis`` reshaped into ``(groups, size // groups)`` (contiguous blocks)."""
    shape = x.shape
    return x.reshape((*shape[:axis], groups, shape[axis] // groups, *shape[axis + 1 :]))
