"""Cut a scanned layer stack into sub-scans, so the pipeline can place its pieces on stages.

A ``lax.scan`` over stacked layer parameters is one equation to layer clustering. Here it
becomes consecutive sub-scans over row ranges of the stack: the carry threads
through them and their per-iteration outputs are concatenated again. A stacked *step input*
that only feeds such scans is split into row pieces at the step's edge, so that each stage
holds, differentiates and updates its own rows; the optimiser's element-wise update and its
state (same-shape leaves such as Adam's moments) are split alike, and norms over a whole
stack are summed from the pieces. A stack that a Python loop reads row by row (``w[i]``,
a ``slice`` per block) is split alike (``row_sliced_inputs``): each slice then reads its
own piece. ``PieceMap`` says how the user's flat leaves map to the split step's, so the
runtime can cut inputs into pieces and join outputs again.

Anything that cannot follow the pieces (a value used whole) reads their concatenation, so
every split is exact; it is only slower where that happens.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

from .grad_capture import GRAD_NAME, GradCapture, pipeline_grad_p
from .jaxpr_walk import bind_equation, equation_context, flatten_calls

__all__ = [
    "PieceMap",
    "SplitStep",
    "even_lengths",
    "layer_scans",
    "row_sliced_inputs",
    "split_scans",
]

#: Primitives applied element by element: a piece of the result needs the same piece of
#: each same-shape operand (scalars broadcast).
# fmt: off
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "cos", "cosh", "convert_element_type", "copy", "copy_p", "digamma",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "pow", "real", "reduce_precision", "rem",
    "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square", "sub", "tan", "tanh",
    "xor",
})
# fmt: on
#: Reductions and how partial results over row pieces combine.
REDUCTIONS = {"reduce_sum": lax.add, "reduce_max": lax.max, "reduce_min": lax.min}


@dataclass(frozen=True)
class PieceMap:
    """User's flat step leaves <-> the split step's. ``inputs[i]``: split-step input i is
    user leaf ``(leaf, start, stop)`` rows (start None: the whole leaf); ``outputs[o]``:
    the split-step outputs whose rows, in order, make user output o."""

    inputs: tuple[tuple[int, int | None, int | None], ...]
    outputs: tuple[tuple[int, ...], ...]

    @property
    def is_identity(self) -> bool:
        return all(a is None for _, a, _ in self.inputs) and all(len(o) == 1 for o in self.outputs)

    def split_inputs(self, flat: Sequence[Any], take: Any) -> list[Any]:
        """The split step's inputs from the user's leaves; ``take(x, start, stop, i)``
        returns rows of ``x`` for split-step input i."""
        return [
            flat[k] if a is None else take(flat[k], a, b, i)
            for i, (k, a, b) in enumerate(self.inputs)
        ]

    def join_outputs(self, outs: Sequence[Any], join: Any) -> list[Any]:
        """The user's outputs from the split step's; ``join(parts)`` concatenates rows."""
        return [outs[o[0]] if len(o) == 1 else join([outs[i] for i in o]) for o in self.outputs]


@dataclass(frozen=True)
class SplitStep:
    """A step with its layer scans split: the step, its capture, the flat forward (which is
    the capture's loss) and the leaf map."""

    step: ClosedJaxpr
    capture: GradCapture
    forward: ClosedJaxpr
    pieces: PieceMap


def even_lengths(n: int, parts: int) -> tuple[int, ...]:
    """``n`` iterations in ``parts`` runs whose lengths differ by at most one."""
    q, r = divmod(n, parts)
    return tuple(q + (i < r) for i in range(parts))


def layer_scans(forward: ClosedJaxpr, capture: GradCapture) -> list[int]:
    """Forward equations that are scans over stacked parameters: a scan of two or more
    iterations reading a differentiated, non-batch loss input as a scanned operand."""
    fj = forward.jaxpr
    stacked = {v for j, v in enumerate(fj.invars) if capture.diff[j] and not capture.batch[j]}
    found = []
    for i, eqn in enumerate(fj.eqns):
        if eqn.primitive.name != "scan" or eqn.params["length"] < 2:
            continue
        xs = eqn.invars[eqn.params["num_consts"] + eqn.params["num_carry"] :]
        if any(not isinstance(v, Literal) and v in stacked for v in xs):
            found.append(i)
    return found


def row_sliced_inputs(forward: ClosedJaxpr, capture: GradCapture) -> dict[int, tuple[int, ...]]:
    """Loss input -> row lengths, for non-batch inputs read only by ``slice`` equations
    that take whole rows (``w[i]`` of a stacked weight in a Python loop): the pieces between
    the rows where those slices start and stop, two or more of them."""
    fj = forward.jaxpr
    cuts: dict[Any, set[int]] = {
        v: {0, v.aval.shape[0]}
        for j, v in enumerate(fj.invars)
        if not capture.batch[j] and getattr(v.aval, "ndim", 0) >= 1 and v.aval.shape[0] >= 2
    }
    for v in fj.outvars:
        if not isinstance(v, Literal):
            cuts.pop(v, None)
    for eqn in fj.eqns:
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, Literal) or v not in cuts:
                continue
            rows = _row_range(eqn) if pos == 0 else None
            if rows is None:
                cuts.pop(v)
            else:
                cuts[v] |= set(rows)
    out = {}
    for j, v in enumerate(fj.invars):
        bounds = sorted(cuts.get(v, ()))
        if len(bounds) > 2:
            out[j] = tuple(b - a for a, b in itertools.pairwise(bounds))
    return out


def _row_range(eqn: Any) -> tuple[int, int] | None:
    """(start, stop) rows a ``slice`` takes whole (every other dimension in full, unit
    strides); None for any other equation."""
    if eqn.primitive.name != "slice":
        return None
    p, shape = eqn.params, eqn.invars[0].aval.shape
    if p["strides"] is not None and any(st != 1 for st in p["strides"]):
        return None
    rest = zip(p["start_indices"][1:], p["limit_indices"][1:], shape[1:], strict=True)
    if any(a != 0 or b != n for a, b, n in rest):
        return None
    return p["start_indices"][0], p["limit_indices"][0]


# ---------------------------------------------------------------------- pieced values
class _Rows:
    """A value held as row pieces (tracers) of the given lengths."""

    def __init__(self, parts: list[Any], lengths: tuple[int, ...]) -> None:
        self.parts, self.lengths = parts, lengths
        self._whole: Any = None

    def whole(self) -> Any:
        if self._whole is None:
            self._whole = lax.concatenate(self.parts, 0)
        return self._whole


def _rows_of(x: Any, lengths: tuple[int, ...]) -> list[Any]:
    """Row pieces of a plain value (sliced) or of a ``_Rows`` with these lengths."""
    if isinstance(x, _Rows) and x.lengths == lengths:
        return x.parts
    x = x.whole() if isinstance(x, _Rows) else x
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [lax.slice_in_dim(x, a, a + n, axis=0) for a, n in zip(starts, lengths, strict=True)]


def _plain(x: Any) -> Any:
    return x.whole() if isinstance(x, _Rows) else x


def _slice_rows(eqn: Any, x: _Rows) -> Any:
    """A ``slice`` of a pieced value: from the one piece that holds its rows where there is
    one (the piece itself when it takes all of it), else from the whole."""
    p = eqn.params
    start, stop = p["start_indices"][0], p["limit_indices"][0]
    strides = p["strides"] or (1,) * len(p["start_indices"])
    a = 0
    for part, n in zip(x.parts, x.lengths, strict=True):
        if a <= start and stop <= a + n:
            begin = (start - a, *p["start_indices"][1:])
            end = (stop - a, *p["limit_indices"][1:])
            whole = begin == (0,) * part.ndim and end == tuple(part.shape)
            if whole and all(st == 1 for st in strides):
                return part
            return lax.slice(part, begin, end, p["strides"])
        a += n
    return bind_equation(eqn, [x.whole()])[0]


def _pieced_lengths(eqn: Any, ins: Sequence[tuple[int, ...] | None]) -> tuple[int, ...] | None:
    """The row lengths ``eqn`` can be evaluated piece by piece with (given its operands'
    lengths, None for whole values), or None when it needs whole operands."""
    have = {n for n in ins if n is not None}
    if len(have) != 1:
        return None
    (lengths,) = have
    name = eqn.primitive.name
    rows = sum(lengths)
    if name in ELEMENTWISE:
        out = [v.aval for v in eqn.outvars]
        if not all(getattr(a, "shape", ())[:1] == (rows,) for a in out):
            return None
        for v, n in zip(eqn.invars, ins, strict=True):
            shape = getattr(v.aval, "shape", ())
            if n is None and shape != () and shape != out[0].shape:
                return None
        return lengths
    if name in REDUCTIONS and ins[0] is not None:
        return lengths
    return None


def _eval_pieced(eqn: Any, invals: list[Any], lengths: tuple[int, ...]) -> list[Any]:
    """``eqn`` evaluated per row piece; a reduction over the rows combines the pieces."""
    name = eqn.primitive.name
    if name in REDUCTIONS:
        parts = _rows_of(invals[0], lengths)
        per = [bind_equation(eqn, [p])[0] for p in parts]
        if 0 not in eqn.params["axes"]:
            return [_Rows(per, lengths)]
        total = per[0]
        for p in per[1:]:
            total = REDUCTIONS[name](total, p)
        return [total]
    split = [
        _rows_of(x, lengths) if getattr(v.aval, "shape", ()) != () else None
        for v, x in zip(eqn.invars, invals, strict=True)
    ]
    outs: list[list[Any]] = [[] for _ in eqn.outvars]
    for i in range(len(lengths)):
        args = [_plain(x) if s is None else s[i] for x, s in zip(invals, split, strict=True)]
        for o, r in zip(outs, bind_equation(eqn, args), strict=True):
            o.append(r)
    return [_Rows(o, lengths) for o in outs]


def _sub_scans(eqn: Any, invals: list[Any], lengths: tuple[int, ...]) -> list[Any]:
    """A scan run as consecutive sub-scans over row pieces of its scanned operands."""
    p = eqn.params
    nc, ncar = p["num_consts"], p["num_carry"]
    consts = [_plain(x) for x in invals[:nc]]
    carry = [_plain(x) for x in invals[nc : nc + ncar]]
    xs = [_rows_of(x, lengths) for x in invals[nc + ncar :]]
    ys: list[list[Any]] = [[None] * len(lengths) for _ in eqn.outvars[ncar:]]
    order = range(len(lengths) - 1, -1, -1) if p["reverse"] else range(len(lengths))
    for i in order:
        unroll = p["unroll"]
        if isinstance(unroll, int) and not isinstance(unroll, bool):
            unroll = max(1, min(unroll, lengths[i]))
        params = eqn.primitive.get_bind_params(dict(p, length=lengths[i], unroll=unroll))
        with equation_context(eqn):
            outs = eqn.primitive.bind(*consts, *carry, *[x[i] for x in xs], **params)
        carry = list(outs[:ncar])
        for y, part in zip(ys, outs[ncar:], strict=True):
            y[i] = part
    return [*carry, *(_Rows(y, lengths) for y in ys)]


# ---------------------------------------------------------------------- the split step
def split_scans(
    step: ClosedJaxpr,
    capture: GradCapture,
    forward: ClosedJaxpr,
    splits: dict[int, tuple[int, ...]],
    roles: Sequence[str],
    rows: dict[int, tuple[int, ...]] | None = None,
) -> SplitStep:
    """``step`` (one captured grad equation; ``forward`` its flat loss) with the scans
    ``splits`` names (loss equation -> iterations per sub-scan, in array order; a reverse
    scan runs the last piece first) run as sub-scans, and the stacks they read split at the
    step's edge where nothing else needs them whole. ``rows``: loss inputs split into row
    pieces of these lengths too (``row_sliced_inputs``). ``roles``: per step input,
    param/state/batch."""
    rows = dict(rows or {})
    _check_rows(forward, capture, rows)
    by_eqn = dict(splits)
    for i, lengths in by_eqn.items():
        eqn = forward.jaxpr.eqns[i] if 0 <= i < len(forward.jaxpr.eqns) else None
        if eqn is None or eqn.primitive.name != "scan":
            raise ValueError(f"scan_splits: equation {i} of the loss is not a scan")
        if sum(lengths) != eqn.params["length"] or min(lengths) < 1:
            raise ValueError(
                f"scan_splits: lengths {list(lengths)} for equation {i} must be positive "
                f"and sum to its {eqn.params['length']} iterations"
            )
    step = flatten_calls(step)  # optimiser updates inside jitted helpers become visible
    sj = step.jaxpr
    g = next(i for i, e in enumerate(sj.eqns) if e.primitive.name == GRAD_NAME)
    geqn = sj.eqns[g]
    step_in = {v: k for k, v in enumerate(sj.invars)}
    arg_of = [step_in[v] for v in geqn.invars]
    loss_split = _alike_only({**_loss_inputs_to_split(forward, capture, by_eqn), **rows}, arg_of)
    step_split = _step_inputs_to_split(sj, g, capture, loss_split, arg_of, roles)
    new_forward = _split_forward(forward, by_eqn, loss_split)
    new_capture = _expand_capture(capture, new_forward, loss_split)
    new_step, outputs = _split_step(step, g, loss_split, step_split, capture, new_capture)
    inputs: list[tuple[int, int | None, int | None]] = []
    for k in range(len(sj.invars)):
        if k in step_split:
            a = 0
            for n in step_split[k]:
                inputs.append((k, a, a + n))
                a += n
        else:
            inputs.append((k, None, None))
    return SplitStep(new_step, new_capture, new_forward, PieceMap(tuple(inputs), outputs))


def _check_rows(
    forward: ClosedJaxpr, capture: GradCapture, rows: dict[int, tuple[int, ...]]
) -> None:
    """Each row split names a non-batch loss input and positive lengths summing to its
    rows."""
    invars = forward.jaxpr.invars
    for j, lengths in rows.items():
        if not 0 <= j < len(invars) or capture.batch[j] or not invars[j].aval.shape:
            raise ValueError(f"row_splits: loss input {j} is not a non-batch array input")
        n = invars[j].aval.shape[0]
        if sum(lengths) != n or min(lengths, default=0) < 1:
            raise ValueError(
                f"row_splits: lengths {list(lengths)} for loss input {j} must be positive "
                f"and sum to its {n} rows"
            )


def _alike_only(
    chosen: dict[int, tuple[int, ...]], arg_of: list[int]
) -> dict[int, tuple[int, ...]]:
    """``chosen`` less the loss inputs whose step input is read as another loss input that
    is not split alike (a step input is split once, for all its reads)."""
    out = dict(chosen)
    for j in chosen:
        alike = [i for i, k in enumerate(arg_of) if k == arg_of[j]]
        if any(chosen.get(i) != chosen[j] for i in alike):
            out.pop(j)
    return out


def _loss_inputs_to_split(
    forward: ClosedJaxpr,
    capture: GradCapture,
    by_eqn: dict[int, tuple[int, ...]],
) -> dict[int, tuple[int, ...]]:
    """Loss input -> row lengths, for non-batch inputs read only as scanned operands of
    split scans (all with the same lengths)."""
    fj = forward.jaxpr
    uses: dict[Any, set[tuple[int, ...] | None]] = {}
    for i, eqn in enumerate(fj.eqns):
        first_xs = eqn.params["num_consts"] + eqn.params["num_carry"] if i in by_eqn else None
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, Literal):
                continue
            scanned = first_xs is not None and pos >= first_xs
            uses.setdefault(v, set()).add(by_eqn[i] if scanned else None)
    for v in fj.outvars:
        if not isinstance(v, Literal):
            uses.setdefault(v, set()).add(None)
    chosen = {}
    for j, v in enumerate(fj.invars):
        u = uses.get(v, set())
        if not capture.batch[j] and len(u) == 1 and None not in u:
            chosen[j] = next(iter(u))
    return chosen


def _step_inputs_to_split(
    sj: Jaxpr,
    g: int,
    capture: GradCapture,
    loss_split: dict[int, tuple[int, ...]],
    arg_of: list[int],
    roles: Sequence[str],
) -> dict[int, tuple[int, ...]]:
    """Step input -> row lengths: the split loss inputs' step inputs, plus non-batch inputs
    shaped like one of them (optimiser state) whose every use can follow the pieces."""
    split = {arg_of[j]: n for j, n in loss_split.items()}
    grad_in = set(arg_of)
    shape_lengths = {sj.invars[k].aval.shape: n for k, n in split.items()}
    candidates = {
        k: shape_lengths[v.aval.shape]
        for k, v in enumerate(sj.invars)
        if k not in grad_in and roles[k] != "batch" and v.aval.shape in shape_lengths
    }
    while candidates:
        spoiled = _spoiled(sj, g, capture, {**split, **candidates}, set(candidates), loss_split)
        if not spoiled:
            break
        for k in spoiled:
            candidates.pop(k)
    return {**split, **candidates}


def _spoiled(
    sj: Jaxpr,
    g: int,
    capture: GradCapture,
    split: dict[int, tuple[int, ...]],
    candidates: set[int],
    loss_split: dict[int, tuple[int, ...]],
) -> set[int]:
    """Candidate step inputs whose pieces would be joined again: some value derived from
    one is read by an equation that cannot follow the pieces. (Returned values are fine:
    they are returned as pieces.)"""
    lengths: dict[Any, tuple[int, ...]] = {}
    source: dict[Any, set[int]] = {}
    for k, n in split.items():
        v = sj.invars[k]
        lengths[v], source[v] = n, {k} & candidates
    for j, ov in _grad_outputs(sj.eqns[g], capture):
        if j in loss_split:
            lengths[ov], source[ov] = loss_split[j], set()
    spoiled: set[int] = set()
    for i, eqn in enumerate(sj.eqns):
        ins = [None if isinstance(v, Literal) else lengths.get(v) for v in eqn.invars]
        if i == g or all(n is None for n in ins):
            continue
        from_ = set().union(
            *(source.get(v, set()) for v in eqn.invars if not isinstance(v, Literal))
        )
        got = _pieced_lengths(eqn, ins)
        if got is None:
            spoiled |= from_
        elif not (eqn.primitive.name in REDUCTIONS and 0 in eqn.params["axes"]):
            for ov in eqn.outvars:
                lengths[ov], source[ov] = got, from_
    return spoiled


def _grad_outputs(geqn: Any, capture: GradCapture) -> list[tuple[int, Any]]:
    """(loss input, its gradient output) per differentiated loss input: the grad equation
    returns [value, *aux, *gradients in input order]."""
    diff_leaves = [j for j, d in enumerate(capture.diff) if d]
    return list(zip(diff_leaves, geqn.outvars[1 + capture.num_aux :], strict=True))


def _split_forward(
    forward: ClosedJaxpr,
    by_eqn: dict[int, tuple[int, ...]],
    loss_split: dict[int, tuple[int, ...]],
) -> ClosedJaxpr:
    """The flat forward with split scans run as sub-scans and split inputs taken as pieces."""
    fj = forward.jaxpr
    avals = _expanded_avals([v.aval for v in fj.invars], loss_split)

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(fj.constvars, forward.consts, strict=True))
        _bind_inputs(env, fj.invars, args, loss_split)
        for i, eqn in enumerate(fj.eqns):
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if i in by_eqn:
                outs = _sub_scans(eqn, invals, by_eqn[i])
            elif eqn.primitive.name == "slice" and isinstance(invals[0], _Rows):
                outs = [_slice_rows(eqn, invals[0])]
            else:
                outs = bind_equation(eqn, [_plain(x) for x in invals])
            env.update(zip(eqn.outvars, outs, strict=True))
        return [_plain(v.val if isinstance(v, Literal) else env[v]) for v in fj.outvars]

    return jax.make_jaxpr(run)(*avals)


def _expanded_avals(avals: Sequence[Any], split: dict[int, tuple[int, ...]]) -> list[Any]:
    out = []
    for k, a in enumerate(avals):
        if k in split:
            out += [jax.ShapeDtypeStruct((n, *a.shape[1:]), a.dtype) for n in split[k]]
        else:
            out.append(jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type))
    return out


def _bind_inputs(
    env: dict[Any, Any], invars: Sequence[Any], args: Sequence[Any], split: dict[int, Any]
) -> None:
    it = iter(args)
    for k, v in enumerate(invars):
        if k in split:
            env[v] = _Rows([next(it) for _ in split[k]], split[k])
        else:
            env[v] = next(it)


def _expand_capture(
    capture: GradCapture, forward: ClosedJaxpr, loss_split: dict[int, tuple[int, ...]]
) -> GradCapture:
    """The capture of the split loss: its flags and sources repeated for each piece."""

    def rep(seq: Sequence[Any]) -> tuple[Any, ...]:
        out: list[Any] = []
        for j, x in enumerate(seq):
            out += [x] * len(loss_split.get(j, (0,)))
        return tuple(out)

    return dataclasses.replace(
        capture,
        loss=forward,
        diff=rep(capture.diff),
        batch=rep(capture.batch),
        sources=rep(capture.sources) if capture.sources else (),
    )


def _split_step(
    step: ClosedJaxpr,
    g: int,
    loss_split: dict[int, tuple[int, ...]],
    step_split: dict[int, tuple[int, ...]],
    old: GradCapture,
    new: GradCapture,
) -> tuple[ClosedJaxpr, tuple[tuple[int, ...], ...]]:
    """The step over split inputs: the grad equation on pieces, the rest evaluated piece
    by piece where it can; and, per original output, the new outputs holding its rows."""
    sj = step.jaxpr
    avals = _expanded_avals([v.aval for v in sj.invars], step_split)
    shapes: list[tuple[int, ...]] = []

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(sj.constvars, step.consts, strict=True))
        _bind_inputs(env, sj.invars, args, step_split)
        for i, eqn in enumerate(sj.eqns):
            invals = [v.val if isinstance(v, Literal) else env[v] for v in eqn.invars]
            if i == g:
                outs = _grad_on_pieces(eqn, invals, loss_split, old, new)
            else:
                ins = [x.lengths if isinstance(x, _Rows) else None for x in invals]
                lengths = _pieced_lengths(eqn, ins) if any(ins) else None
                if lengths is not None:
                    outs = _eval_pieced(eqn, invals, lengths)
                else:
                    outs = bind_equation(eqn, [_plain(x) for x in invals])
            env.update(zip(eqn.outvars, outs, strict=True))
        flat = []
        shapes.clear()
        for v in sj.outvars:
            x = v.val if isinstance(v, Literal) else env[v]
            parts = x.parts if isinstance(x, _Rows) else [x]
            shapes.append(tuple(range(len(flat), len(flat) + len(parts))))
            flat += parts
        return flat

    closed = jax.make_jaxpr(run)(*avals)
    return closed, tuple(shapes)


def _grad_on_pieces(
    geqn: Any,
    invals: list[Any],
    loss_split: dict[int, tuple[int, ...]],
    old: GradCapture,
    new: GradCapture,
) -> list[Any]:
    """The grad equation bound on the split loss's inputs (``new``'s); the gradients of
    split inputs come back as pieces, in ``old``'s output order."""
    args: list[Any] = []
    for j, x in enumerate(invals):
        args += _rows_of(x, loss_split[j]) if j in loss_split else [_plain(x)]
    grads = [a for a, d in zip(new.loss.in_avals, new.diff, strict=True) if d]
    out_avals = (*new.loss.out_avals, *(jax.core.ShapedArray(a.shape, a.dtype) for a in grads))
    with equation_context(geqn):
        flat = pipeline_grad_p.bind(*args, index=geqn.params["index"], out_avals=out_avals)
    head = 1 + old.num_aux
    outs, it = list(flat[:head]), iter(flat[head:])
    for j, d in enumerate(old.diff):
        if d and j in loss_split:
            outs.append(_Rows([next(it) for _ in loss_split[j]], loss_split[j]))
        elif d:
            outs.append(next(it))
    return outs
