"""Sharding strategies of one operator on an N-D logical mesh.

Every supported primitive is described as a loop nest: a set of loop dimensions, and for
each operand and result which loop each of its dimensions runs over. A strategy gives each
mesh axis (of size > 1) to at most one loop. Operands and results are then split over the
axes of their loops; an axis given to a reduction loop (the contracting dimension of a dot,
the reduced axes of ``reduce_sum``) leaves partial results that an all-reduce combines, or a
reduce-scatter combines into a result split over that axis as well. Loops marked ``fixed``
(a convolution's spatial window, the sorted axis of ``sort``) are never split. This one
description covers 1-D, 2-D and 3-D meshes alike.

A primitive without a rule gets one strategy, everything replicated, and one logged warning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..graph.op_graph import OpGraph, OpNode
from .cost_model import CostModel
from .loop_layouts import LoopNest, Map, candidate_layouts, canonical_order
from .spec import ShardingSpec, enumerate_specs

__all__ = [
    "LoopNest",
    "Strategy",
    "input_strategies",
    "loop_nest",
    "node_strategies",
    "node_work",
]

log = logging.getLogger("alpa_mini.shard.strategies")


@dataclass(frozen=True)
class Collective:
    """A collective an operator's strategy performs itself: kind, mesh axes, bytes per device."""

    kind: str
    axes: tuple[int, ...]
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: operand layouts it needs, result layouts it makes, its costs."""

    name: str
    in_specs: tuple[ShardingSpec | None, ...]
    out_specs: tuple[ShardingSpec, ...]
    compute: float
    comm: float
    memory: float
    collectives: tuple[Collective, ...] = ()


ELEMENTWISE = frozenset(
    """
    abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp complex
    conj convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp
    exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le lgamma log log1p
    logistic lt max min mul ne neg nextafter not or population_count pow real
    reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh xor
    threefry2x32 bitcast_convert_type optimization_barrier sharding_constraint
    """.split()  # noqa: SIM905  (a word list reads better than 80 quoted names)
)
REDUCTIONS = {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "reduce_and": "and",
    "reduce_or": "or",
    "argmax": None,
    "argmin": None,
}
CUMULATIVE = frozenset({"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"})


# ---------------------------------------------------------------------------- loop nests
def _elementwise(shapes_in: Sequence[tuple[int, ...] | None], out: tuple[int, ...]) -> LoopNest:
    operands: list[Map | None] = []
    for shape in shapes_in:
        if shape is None:
            operands.append(None)
        elif shape == out:
            operands.append(tuple(range(len(out))))
        elif shape == ():
            operands.append(())
        elif len(shape) == len(out) and all(s in (1, o) for s, o in zip(shape, out, strict=True)):
            pairs = enumerate(zip(shape, out, strict=True))
            operands.append(tuple(d if s == o else None for d, (s, o) in pairs))
        else:
            raise _NoRule
    return LoopNest(out, tuple(operands), (tuple(range(len(out))),))


class _NoRule(Exception):
    pass


def _reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims alone)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(a) or j >= len(b):
            raise _NoRule
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(a):
                    raise _NoRule
                pa *= a[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(b):
                    raise _NoRule
                pb *= b[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def loop_nest(node: OpNode, graph: OpGraph) -> LoopNest | None:
    """The loop nest of ``node``, or None when no rule covers it (it then stays replicated)."""
    shapes = [None if t is None else graph.tensors[t].shape for t in node.inputs]
    outs = [graph.tensors[t].shape for t in node.outputs]
    rule = _RULES.get(node.primitive)
    try:
        if rule is not None:
            return rule(node, shapes, outs)
        if node.primitive in ELEMENTWISE and all(o == outs[0] for o in outs):
            return _elementwise(shapes, outs[0])
    except _NoRule:
        return None
    return None


def _dot_general(node, shapes, outs) -> LoopNest:
    (lc, rc), (lb, rb) = node.params["dimension_numbers"]
    lhs, rhs = shapes[0], shapes[1]
    lf = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    sizes = (
        [lhs[d] for d in lb] + [lhs[d] for d in lf] + [rhs[d] for d in rf] + [lhs[d] for d in lc]
    )
    nb, nl, nr = len(lb), len(lf), len(rf)
    lmap: list[int | None] = [None] * len(lhs)
    rmap: list[int | None] = [None] * len(rhs)
    for k, (dl, dr) in enumerate(zip(lb, rb, strict=True)):
        lmap[dl] = rmap[dr] = k
    for k, d in enumerate(lf):
        lmap[d] = nb + k
    for k, d in enumerate(rf):
        rmap[d] = nb + nl + k
    first_c = nb + nl + nr
    for k, (dl, dr) in enumerate(zip(lc, rc, strict=True)):
        lmap[dl] = rmap[dr] = first_c + k
    reductions = tuple((first_c + k, "sum") for k in range(len(lc)))
    return LoopNest(
        tuple(sizes),
        (tuple(lmap), tuple(rmap)),
        (tuple(range(first_c)),),
        reductions,
    )


def _conv(node, shapes, outs) -> LoopNest:
    dn = node.params["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    out = outs[0]
    grouped = node.params.get("feature_group_count", 1) > 1
    batch_grouped = node.params.get("batch_group_count", 1) > 1
    # Loops: one per output dim, then the input-feature (contracting) loop.
    sizes = [*out, shapes[0][lhs_spec[1]]]
    c = len(out)
    lmap: list[int | None] = [None] * len(shapes[0])
    rmap: list[int | None] = [None] * len(shapes[1])
    lmap[lhs_spec[0]] = out_spec[0]
    rmap[rhs_spec[0]] = out_spec[1]
    lmap[lhs_spec[1]] = rmap[rhs_spec[1]] = c
    fixed = set(out_spec[2:])
    if grouped or batch_grouped:
        fixed |= {out_spec[1], c}
    if batch_grouped:
        fixed.add(out_spec[0])
    return LoopNest(
        tuple(sizes),
        (tuple(lmap), tuple(rmap)),
        (tuple(range(len(out))),),
        ((c, "sum"),),
        frozenset(fixed),
    )


def _reduction(node, shapes, outs) -> LoopNest:
    shape = shapes[0]
    axes = set(node.params["axes"])
    kept = [d for d in range(len(shape)) if d not in axes]
    kind = REDUCTIONS[node.primitive]
    reductions = () if kind is None else tuple((d, kind) for d in sorted(axes))
    fixed = frozenset(axes) if kind is None else frozenset()
    return LoopNest(
        tuple(shape),
        (tuple(range(len(shape))),),
        tuple(tuple(kept) for _ in outs),
        reductions,
        fixed,
    )


def _broadcast_in_dim(node, shapes, outs) -> LoopNest:
    out = outs[0]
    operand = shapes[0]
    dims = node.params["broadcast_dimensions"]
    omap = (
        None
        if operand is None
        else tuple(o if operand[i] == out[o] else None for i, o in enumerate(dims))
    )
    return LoopNest(tuple(out), (omap, *[None] * (len(shapes) - 1)), (tuple(range(len(out))),))


def _reshape(node, shapes, outs) -> LoopNest:
    if node.params.get("dimensions") is not None:
        raise _NoRule
    a, b = shapes[0], outs[0]
    sizes = list(b)
    imap: list[int | None] = [None] * len(a)
    fixed: set[int] = set()
    for gi, gj in _reshape_groups(a, b):
        if not gi or not gj:
            continue  # size-1 dims: nothing to split
        if len(gi) == 1:
            imap[gi[0]] = gj[0]  # split: the input dim follows the major output dim
        elif len(gj) == 1:
            imap[gi[0]] = gj[0]  # merge: the output dim follows the major input dim
            for d in gi[1:]:
                imap[d] = len(sizes)
                fixed.add(len(sizes))
                sizes.append(a[d])
        else:
            fixed.update(gj)
    return LoopNest(tuple(sizes), (tuple(imap),), (tuple(range(len(b))),), (), frozenset(fixed))


def _squeeze(node, shapes, outs) -> LoopNest:
    a = shapes[0]
    gone = set(d % len(a) for d in node.params["dimensions"])
    imap, k = [], 0
    for d in range(len(a)):
        if d in gone:
            imap.append(None)
        else:
            imap.append(k)
            k += 1
    return LoopNest(tuple(outs[0]), (tuple(imap),), (tuple(range(len(outs[0]))),))


def _transpose(node, shapes, outs) -> LoopNest:
    perm = node.params["permutation"]
    imap = [0] * len(perm)
    for o, i in enumerate(perm):
        imap[i] = o
    return LoopNest(tuple(outs[0]), (tuple(imap),), (tuple(range(len(perm))),))


def _same_shape_fixed(dims_of: Callable[[OpNode, int], set[int]]):
    """Operands and results share loops dim by dim; the dims ``dims_of`` names are fixed."""

    def rule(node, shapes, outs) -> LoopNest:
        base = next(s for s in shapes if s is not None and len(s) == len(outs[0]))
        ident = tuple(range(len(base)))
        ops = tuple(
            None if s is None else ident if len(s) == len(base) else () if s == () else _raise()
            for s in shapes
        )
        return LoopNest(
            tuple(base),
            ops,
            tuple(ident for _ in outs),
            (),
            frozenset(dims_of(node, len(base))),
        )

    return rule


def _raise():
    raise _NoRule


def _slice(node, shapes, outs) -> LoopNest:
    a = shapes[0]
    starts, limits = node.params["start_indices"], node.params["limit_indices"]
    strides = node.params.get("strides") or (1,) * len(a)
    bounds = zip(starts, limits, a, strides, strict=True)
    full = [s == 0 and l == n and st == 1 for s, l, n, st in bounds]
    return LoopNest(
        tuple(outs[0]),
        (tuple(range(len(a))),),
        (tuple(range(len(a))),),
        (),
        frozenset(d for d, ok in enumerate(full) if not ok),
    )


def _dynamic_slice(node, shapes, outs) -> LoopNest:
    a = shapes[0]
    sizes = node.params["slice_sizes"]
    ident = tuple(range(len(a)))
    ops = (ident, *[() if s == () else None for s in shapes[1:]])
    return LoopNest(
        tuple(outs[0]),
        ops,
        (ident,),
        (),
        frozenset(d for d in range(len(a)) if sizes[d] != a[d]),
    )


def _dynamic_update_slice(node, shapes, outs) -> LoopNest:
    a, u = shapes[0], shapes[1]
    ident = tuple(range(len(a)))
    fixed = frozenset(d for d in range(len(a)) if u[d] != a[d])
    umap = tuple(None if d in fixed else d for d in range(len(a)))
    ops = (ident, umap, *[() if s == () else None for s in shapes[2:]])
    return LoopNest(tuple(a), ops, (ident,), (), fixed)


def _pad(node, shapes, outs) -> LoopNest:
    cfg = node.params["padding_config"]
    out = outs[0]
    fixed = frozenset(d for d, (lo, hi, interior) in enumerate(cfg) if lo or hi or interior)
    ident = tuple(range(len(out)))
    return LoopNest(tuple(out), (ident, () if shapes[1] == () else None), (ident,), (), fixed)


def _windowed(node, shapes, outs) -> LoopNest:
    """Pooling (``reduce_window_*``) and its gradients (``select_and_scatter_add``,
    ``select_and_gather_add``): a dimension the window moves along is never split (a shard's
    windows would need its neighbours' rows); the others (batch, channels) split freely."""
    p = node.params
    rank = len(outs[0])
    trivial = {
        d
        for d in range(rank)
        if p["window_dimensions"][d] == 1
        and p["window_strides"][d] == 1
        and tuple(p["padding"][d]) == (0, 0)
        and p.get("base_dilation", (1,) * rank)[d] == 1
        and p.get("window_dilation", (1,) * rank)[d] == 1
    }
    ident = tuple(range(rank))
    ops = tuple(None if s is None else ident if len(s) == rank else _raise() for s in shapes)
    fixed = frozenset(d for d in range(rank) if d not in trivial)
    return LoopNest(tuple(outs[0]), ops, (ident,), (), fixed)


def _random_bits(node, shapes, outs) -> LoopNest:
    """Random bits from one key: each shard draws its own slice (JAX's threefry is
    partitionable, so the bits equal the unsharded ones)."""
    if shapes[0] != ():
        _raise()
    return LoopNest(tuple(outs[0]), ((),), (tuple(range(len(outs[0]))),))


def _key_op(node, shapes, outs) -> LoopNest:
    """PRNG key plumbing (``random_wrap``/``unwrap``/``fold_in``/``split``-like): the leading
    (batch-of-keys) dimensions split like an elementwise op, the key data dims never."""
    rank = min(len(x) for x in [*outs, *(s for s in shapes if s is not None)])

    def leading(shape: tuple[int, ...]) -> Map:
        return tuple(range(rank)) + (None,) * (len(shape) - rank)

    ops = tuple(None if s is None else leading(s) for s in shapes)
    return LoopNest(tuple(outs[0][:rank]), ops, tuple(leading(o) for o in outs))


def _concatenate(node, shapes, outs) -> LoopNest:
    out = outs[0]
    ident = tuple(range(len(out)))
    ops = tuple(None if s is None else ident for s in shapes)
    return LoopNest(tuple(out), ops, (ident,), (), frozenset({node.params["dimension"]}))


def _split(node, shapes, outs) -> LoopNest:
    a = shapes[0]
    ident = tuple(range(len(a)))
    return LoopNest(
        tuple(a), (ident,), tuple(ident for _ in outs), (), frozenset({node.params["axis"]})
    )


def _iota(node, shapes, outs) -> LoopNest:
    out = outs[0]
    return LoopNest(tuple(out), tuple(None for _ in shapes), (tuple(range(len(out))),))


def _gather(node, shapes, outs) -> LoopNest:
    dn = node.params["dimension_numbers"]
    operand, indices = shapes[0], shapes[1]
    out = outs[0]
    slice_sizes = node.params["slice_sizes"]
    batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
    if len(batch_out) != len(indices) - 1:
        raise _NoRule
    sizes = list(out)
    imap: list[int | None] = [None] * len(indices)
    for k, d in enumerate(batch_out):
        imap[k] = d
    omap: list[int | None] = [None] * len(operand)
    fixed = set()
    window = [
        d
        for d in range(len(operand))
        if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]
    for d, o in zip(window, dn.offset_dims, strict=True):
        if slice_sizes[d] == operand[d] and d not in dn.start_index_map:
            omap[d] = o  # the operand dim passes through whole
        else:
            fixed.add(o)
    for od, idim in zip(dn.operand_batching_dims, dn.start_indices_batching_dims, strict=True):
        omap[od] = imap[idim]
    return LoopNest(
        tuple(sizes), (tuple(omap), tuple(imap)), (tuple(range(len(out))),), (), frozenset(fixed)
    )


def _scatter(node, shapes, outs) -> LoopNest:
    dn = node.params["dimension_numbers"]
    operand, indices, updates = shapes[0], shapes[1], shapes[2]
    sizes = list(operand)
    fixed = set(dn.scatter_dims_to_operand_dims) | set(dn.inserted_window_dims)
    scatter_dims = [d for d in range(len(updates)) if d not in dn.update_window_dims]
    index_dims = list(range(len(indices) - 1))  # the last indices dim holds the index vector
    if len(scatter_dims) != len(index_dims):
        raise _NoRule
    batching = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims, strict=True))
    umap: list[int | None] = [None] * len(updates)
    imap: list[int | None] = [None] * len(indices)
    reductions = []
    summed = node.primitive in ("scatter-add", "scatter_add")
    for ud, idim in zip(scatter_dims, index_dims, strict=True):
        if idim in batching:  # each batch element scatters into its own operand slice
            loop = batching[idim]
        else:
            loop = len(sizes)
            sizes.append(updates[ud])
            if summed:  # contributions from different devices add up: a reduction
                reductions.append((loop, "sum"))
            else:
                fixed.add(loop)
        umap[ud] = imap[idim] = loop
    window = [
        d
        for d in range(len(operand))
        if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims
    ]
    for ud, od in zip(dn.update_window_dims, window, strict=True):
        if updates[ud] == operand[od] and od not in fixed:
            umap[ud] = od
        else:
            fixed.add(od)
    ident = tuple(range(len(operand)))
    return LoopNest(
        tuple(sizes),
        (ident, tuple(imap), tuple(umap)),
        (ident,),
        tuple(reductions),
        frozenset(fixed),
    )


def _top_k(node, shapes, outs) -> LoopNest:
    # XLA's SPMD partitioner gathers top_k's operand whatever its layout (checked on JAX
    # 0.10.2: a batch-split input compiles to an all-gather), so no loop is split here and
    # the gather shows up as a priced resharding.
    a = shapes[0]
    ident = tuple(range(len(a)))
    return LoopNest(tuple(a), (ident,), (ident, ident), (), frozenset(ident))


def _scan_boundary(node, shapes, outs) -> LoopNest:
    out = outs[0]
    ident = tuple(range(len(out)))
    if node.kind == "identity":
        return LoopNest(tuple(out), tuple(None if s is None else ident for s in shapes), (ident,))
    if node.kind == "unstack":  # [T, ...] -> [...]; the trip axis is never split
        t = len(out)
        return LoopNest((*out, shapes[0][0]), ((t, *ident),), (ident,), (), frozenset({t}))
    # stack: [...] -> [T, ...]
    inner = tuple(range(1, len(out)))
    return LoopNest(tuple(out), (inner,), (tuple(range(len(out))),), (), frozenset({0}))


_RULES: dict[str, Callable[..., LoopNest]] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "slice": _slice,
    "dynamic_slice": _dynamic_slice,
    "dynamic_update_slice": _dynamic_update_slice,
    "pad": _pad,
    "concatenate": _concatenate,
    "split": _split,
    "iota": _iota,
    "gather": _gather,
    "scatter-add": _scatter,
    "scatter_add": _scatter,
    "scatter": _scatter,
    "top_k": _top_k,
    "reduce_window_sum": _windowed,
    "reduce_window_max": _windowed,
    "reduce_window_min": _windowed,
    "select_and_scatter_add": _windowed,
    "select_and_gather_add": _windowed,
    "random_bits": _random_bits,
    "random_wrap": _key_op,
    "random_unwrap": _key_op,
    "random_fold_in": _key_op,
    "random_seed": _key_op,
    "sort": _same_shape_fixed(lambda n, r: {n.params["dimension"] % r}),
    "rev": _same_shape_fixed(lambda n, r: set(n.params["dimensions"])),
    "scan_identity": _scan_boundary,
    "scan_unstack": _scan_boundary,
    "scan_stack": _scan_boundary,
    **{name: _reduction for name in REDUCTIONS},
    **{name: _same_shape_fixed(lambda n, r: {n.params["axis"] % r}) for name in CUMULATIVE},
}


# ---------------------------------------------------------------------------- strategies
def node_work(node: OpNode, graph: OpGraph) -> tuple[float, float, str]:
    """(flops, bytes accessed, dtype) of one run of ``node`` per graph run, as its strategies
    price it: every strategy's compute is this work split over its ``parallel`` devices."""
    dtype = graph.tensors[node.outputs[0]].dtype if node.outputs else "float32"
    return node.flops * node.multiplier, node.bytes_accessed * node.multiplier, dtype


def node_strategies(node: OpNode, graph: OpGraph, cost: CostModel) -> list[Strategy]:
    """Every valid strategy of ``node`` on the cost model's mesh, with its own costs."""
    mesh_shape = cost.mesh.shape
    nest = loop_nest(node, graph) if node.kind != "opaque" else None
    out_tensors = [graph.tensors[t] for t in node.outputs]
    work, traffic, dtype = node_work(node, graph)
    if nest is None:
        return [_replicated(node, graph, cost, dtype, work, traffic)]
    in_shapes = tuple(None if t is None else graph.tensors[t].shape for t in node.inputs)
    out_shapes = tuple(t.shape for t in out_tensors)
    layouts = candidate_layouts(
        nest,
        in_shapes,
        out_shapes,
        tuple(mesh_shape),
        symmetric_axis_pairs(cost),
        cost.native_reduce_scatter,
    )
    if not layouts:
        return [_replicated(node, graph, cost, dtype, work, traffic)]
    out = []
    compute_of: dict[int, float] = {}
    for lay in layouts:
        compute = compute_of.get(lay.parallel)
        if compute is None:
            compute = compute_of[lay.parallel] = cost.compute(
                work, traffic, dtype, lay.parallel, node.primitive
            )
        colls: tuple[Collective, ...] = ()
        if lay.groups:
            partial = sum(
                t.nbytes / n for t, n in zip(out_tensors, lay.partial_shards, strict=True)
            )
            if lay.scatter is not None:
                kind = "reduce-scatter" if cost.native_reduce_scatter else "all-reduce"
                seconds = cost.reduce_scatter(partial, lay.scatter)
                colls = (Collective(kind, lay.scatter, partial, seconds),)
            else:
                colls = tuple(
                    Collective("all-reduce", g, partial, cost.all_reduce(partial, g))
                    for g in lay.groups
                )
        comm = sum(c.seconds for c in colls) * node.multiplier * node.comm_scale
        memory = sum(
            t.nbytes / s.num_shards(mesh_shape)
            for s, t in zip(lay.out_specs, out_tensors, strict=True)
        )
        out.append(Strategy(lay.name, lay.in_specs, lay.out_specs, compute, comm, memory, colls))
    return out


def symmetric_axis_pairs(cost: CostModel) -> tuple[tuple[int, int], ...]:
    """Pairs of consecutive interchangeable axes (same size and link) on meshes of 3+ axes.

    On such a mesh every plan has copies that differ only by renaming interchangeable axes,
    and the ILP drowns in them (a (2, 2, 2) GPT has millions of columns). Requiring the first
    axis of each pair to take a loop no later than the second keeps one representative of
    most copies. It is a restriction, not an equivalence: a plan that needs the other order
    at some operator pays a resharding there instead. 1-D and 2-D meshes are searched in full.
    """
    mesh = cost.mesh
    if len(mesh.shape) < 3:
        return ()
    key = [(n, mesh.alphas[a], mesh.betas[a]) for a, n in enumerate(mesh.shape)]
    return tuple((a, a + 1) for a in range(len(key) - 1) if key[a] == key[a + 1] and key[a][0] > 1)


def _replicated(node, graph, cost, dtype, work, traffic) -> Strategy:
    ins = tuple(
        None if t is None else ShardingSpec.replicated(len(graph.tensors[t].shape))
        for t in node.inputs
    )
    outs = tuple(ShardingSpec.replicated(len(graph.tensors[t].shape)) for t in node.outputs)
    memory = sum(graph.tensors[t].nbytes for t in node.outputs)
    compute = cost.compute(work, traffic, dtype, 1, node.primitive)
    return Strategy("replicated", ins, outs, compute, 0.0, memory)


def input_strategies(
    shape: tuple[int, ...],
    nbytes: int,
    mesh_shape: tuple[int, ...],
    allowed: Callable[[ShardingSpec], bool] | None = None,
    twins: Sequence[tuple[int, int]] = (),
) -> list[Strategy]:
    """Layouts a graph input (or output) may take; it computes nothing. ``twins``: see
    ``symmetric_axis_pairs``."""
    out = []
    axes = list(range(len(mesh_shape)))
    for spec in enumerate_specs(shape, mesh_shape):
        if allowed is not None and not allowed(spec):
            continue
        if twins:
            dim_of = {a: d for d, ax in enumerate(spec.dims) for a in ax}
            if not canonical_order([dim_of.get(a) for a in axes], axes, twins):
                continue
        out.append(
            Strategy(spec.label(), (), (spec,), 0.0, 0.0, nbytes / spec.num_shards(mesh_shape))
        )
    return out
