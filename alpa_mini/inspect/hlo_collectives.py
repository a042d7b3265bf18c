"""Read the collectives XLA's SPMD partitioner inserted out of compiled HLO text.

The compiled module (``jax.jit(f, in_shardings=..., out_shardings=...).lower(*args).compile()
.as_text()``) is the ground truth for the communication a sharded program performs; the
planner's predictions are checked against it. This module is pure text processing (no JAX
import): ``parse_collectives`` finds every ``all-reduce``, ``all-gather``, ``reduce-scatter``,
``all-to-all`` and ``collective-permute`` in every computation of the module, ``summarize``
totals them per kind with the cost model's byte convention, ``format_table`` prints that.

What the parser understands:

* shapes with layouts (``f32[32,16]{1,0}``), scalars (``f32[]``), bounded dynamic dims
  (``f32[<=16]``), every XLA element type, tuple shapes (with ``/*index=5*/`` comments);
* tuple-shaped instructions: XLA's all-reduce combiner merges several all-reduces into one
  instruction with a tuple result, and CPU's all-to-all is the tuple form (one operand per
  peer, no ``dimensions``);
* async pairs: ``all-reduce-start``/``-done``, ``all-gather-start``/``-done``,
  ``collective-permute-start``/``-done`` and the ``<op>-start`` sugar of wrapped async ops are
  counted once, from the start op; ``-done`` ops are skipped;
* every ``replica_groups`` form: explicit ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]`` and
  ``[4,2]<=[2,4]T(1,0)``, empty ``{}`` (all devices: ``num_partitions`` / ``replica_count``
  from the module header), and the named-mesh form JAX 0.10.2 prints, e.g.
  ``mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0','axis_1':(1)2}``; the
  groups of every form are expanded into explicit device lists (``Collective.replica_groups``).
  In the mesh form the axis names are XLA's own (``axis_0``, ...), not the user's mesh axis
  names, and the mesh may be a reshaped version of the user's mesh; compare groups, not names;
* loop context: a collective whose computation is a while body or condition, or is called
  (transitively) from one, has ``in_loop=True``; this is read from the ``body=`` /
  ``condition=`` attributes of ``while`` instructions, which is exact. Collectives in a loop
  appear once in the text and are reported once (no trip-count multiplication);
  ``trip_count`` gives the product of the enclosing loops' ``known_trip_count`` (from the
  while's backend_config) so a caller can scale, or None when XLA did not record it.

Operand bytes come from the operands' own definitions in the same computation (compiled HLO
does not print operand shapes at the call site); when an operand cannot be found they are
derived from the result: all-reduce, all-to-all and collective-permute operands equal the
result, an all-gather operand is the result divided by the group size, a reduce-scatter
operand is the result times the group size.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .._validate import format_bytes

__all__ = [
    "KINDS",
    "Collective",
    "CollectiveSummary",
    "format_table",
    "parse_collectives",
    "parse_shape",
    "shape_bytes",
    "summarize",
]

KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

# Bits per element of every XLA primitive type (sub-byte types are rounded up per array).
_TYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "f4e2m1fn": 4,
    "f8e8m0fnu": 8,
    "f8e3m4": 8,
    "f8e4m3": 8,
    "f8e4m3fn": 8,
    "f8e4m3b11fnuz": 8,
    "f8e4m3fnuz": 8,
    "f8e5m2": 8,
    "f8e5m2fnuz": 8,
    "token": 0,
    "opaque": 0,
}


# --------------------------------------------------------------------------- public objects


@dataclass(frozen=True)
class Collective:
    """One collective HLO instruction (an async start/done pair counts once).

    ``operand_bytes`` / ``result_bytes`` are per operand, per device (one entry per tensor of a
    combined or tuple-shaped instruction). ``group_size`` is the number of devices in one
    replica group and ``num_groups`` the number of groups; for a ``collective-permute``
    (which has source-target pairs, not groups) ``group_size`` is the number of distinct
    devices named in the pairs and ``num_groups`` is 1. ``mesh_axes`` is set only when the
    groups are printed in the named-mesh form (names as XLA prints them, quotes removed, a
    sub-axis as ``"axis_1:(2)2"``). ``dimension`` is the gather / scatter / split dimension
    (None for all-reduce, collective-permute and the tuple form of all-to-all).
    """

    kind: str
    name: str
    operand_bytes: tuple[int, ...]
    result_bytes: tuple[int, ...]
    group_size: int
    num_groups: int
    mesh_axes: tuple[str, ...] | None = None
    op_name: str | None = None
    dimension: int | None = None
    in_loop: bool = False
    trip_count: int | None = 1
    in_conditional: bool = False
    computation: str = ""
    dtypes: tuple[str, ...] = ()
    is_async: bool = False
    replica_groups: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    source_target_pairs: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)

    @property
    def num_tensors(self) -> int:
        """Logical tensors moved: operands, except the tuple form of all-to-all, whose
        ``group_size`` operands are the per-peer chunks of a single tensor."""
        n = len(self.operand_bytes)
        if self.kind == "all-to-all" and self.dimension is None and self.group_size > 1:
            return max(1, n // self.group_size)
        return n

    @property
    def bytes(self) -> int:
        """Bytes per device under the cost model's convention: the gathered result for an
        all-gather, the operands (for reduce-scatter: the full pre-scatter buffer) otherwise.
        A collective-permute counts its operand even where some pairs are self-sends
        (``(d, d)`` in ``source_target_pairs``), which XLA prints and which move nothing."""
        if self.kind == "all-gather":
            return sum(self.result_bytes)
        return sum(self.operand_bytes)


@dataclass(frozen=True)
class CollectiveSummary:
    """Totals for one collective kind: ``count`` tensors (a combined all-reduce of 3 tensors
    counts 3), ``instructions`` HLO instructions, ``bytes`` per device (see
    ``Collective.bytes``), and the part of each that sits inside while loops."""

    kind: str
    count: int = 0
    instructions: int = 0
    bytes: int = 0
    loop_instructions: int = 0
    loop_bytes: int = 0


# --------------------------------------------------------------------------- shapes

# A shape is either an array leaf ``(dtype, dims)`` or a list of shapes (a tuple shape).
_Shape = tuple[str, tuple[int, ...]] | list


def _matching(text: str, start: int) -> int:
    """Index just past the bracket that closes the one at ``text[start]``."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    stack: list[str] = []
    i = start
    quote = ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c == '"':
            quote = c
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced brackets in {text[start : start + 80]!r}")


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets or double-quoted strings."""
    parts: list[str] = []
    depth = 0
    quote = False
    cur = 0
    i = 0
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == '"':
                quote = False
        elif c == '"':
            quote = True
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(text[cur:i])
            cur = i + 1
        i += 1
    tail = text[cur:]
    if tail.strip() or parts:
        parts.append(tail)
    return [p.strip() for p in parts]


_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _parse_shape_at(text: str, pos: int) -> tuple[_Shape, int]:
    """Parse one shape starting at ``text[pos]``; return it and the index just past it."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    if text.startswith("(", pos):
        end = _matching(text, pos)
        inner = text[pos + 1 : end - 1]
        elems = [_parse_shape_at(part, 0)[0] for part in _split_top(inner)]
        return elems, end
    m = _ARRAY.match(text, pos)
    if not m:
        raise ValueError(f"not a shape: {text[pos : pos + 60]!r}")
    dtype = m.group(1)
    dims: list[int] = []
    for d in m.group(2).split(","):
        d = d.strip()
        if not d:
            continue
        d = d.removeprefix("<=")
        dims.append(int(d) if d.isdigit() else 0)  # "?" (unbounded dynamic) counts as 0
    end = m.end()
    if text.startswith("{", end):  # layout, possibly with tiling / memory space
        end = _matching(text, end)
    return (dtype, tuple(dims)), end


def parse_shape(text: str) -> _Shape:
    """Parse an HLO shape string (array or tuple) into ``(dtype, dims)`` / nested lists."""
    return _parse_shape_at(_COMMENT.sub("", text), 0)[0]


def _leaves(shape: _Shape) -> list[tuple[str, tuple[int, ...]]]:
    if isinstance(shape, list):
        return [leaf for s in shape for leaf in _leaves(s)]
    return [shape]


def _array_bytes(leaf: tuple[str, tuple[int, ...]]) -> int:
    dtype, dims = leaf
    if dtype not in _TYPE_BITS:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return (math.prod(dims) * _TYPE_BITS[dtype] + 7) // 8


def shape_bytes(shape: str | _Shape) -> int:
    """Total bytes of an HLO shape (a string such as ``"f32[32,16]{1,0}"`` or parsed)."""
    if isinstance(shape, str):
        shape = parse_shape(shape)
    return sum(_array_bytes(leaf) for leaf in _leaves(shape))


# --------------------------------------------------------------------------- replica groups


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape), dtype=np.int64).reshape(tuple(reshape))
    if perm is not None:
        arr = arr.transpose(tuple(perm))
    return arr


_IOTA_GROUPS = re.compile(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_MESH_DEVICE_IOTA = re.compile(r"\s*\[([\d,\s]+)\](?:<=\[([\d,\s]+)\])?(?:T\(([\d,\s]+)\))?\s*$")
_AXIS_REF = re.compile(r"^'?([^':]+)'?(?::\((\d+)\)(\d+))?$")


@dataclass
class _Groups:
    groups: tuple[tuple[int, ...], ...] | None
    group_size: int
    num_groups: int
    mesh_axes: tuple[str, ...] | None = None


def _groups_from_array(arr: np.ndarray) -> _Groups:
    rows = tuple(tuple(int(v) for v in row) for row in arr)
    return _Groups(rows, arr.shape[1], arr.shape[0])


def _mesh_groups(axes_text: str, device_ids: str | None, refs_text: str) -> _Groups:
    names: list[str] = []
    sizes: list[int] = []
    for part in _split_top(axes_text):
        name, _, size = part.rpartition("=")
        names.append(name.strip().strip("'\""))
        sizes.append(int(size))
    total = math.prod(sizes)
    if device_ids is None:
        devices = np.arange(total, dtype=np.int64)
    else:
        m = _MESH_DEVICE_IOTA.match(device_ids)
        if m:
            reshape = _ints(m.group(2) or m.group(1))
            perm = _ints(m.group(3)) if m.group(3) else None
            devices = _iota(reshape, perm)
        else:
            devices = np.array(_ints(device_ids), dtype=np.int64)
    devices = devices.reshape(tuple(sizes))

    refs: list[tuple[int, int, int]] = []  # (mesh axis index, pre_size, size)
    printed: list[str] = []
    for part in _split_top(refs_text):
        m = _AXIS_REF.match(part.strip())
        if not m:
            raise ValueError(f"bad mesh axis reference {part!r}")
        axis = names.index(m.group(1))
        if m.group(2):
            refs.append((axis, int(m.group(2)), int(m.group(3))))
            printed.append(f"{m.group(1)}:({m.group(2)}){m.group(3)}")
        else:
            refs.append((axis, 1, sizes[axis]))
            printed.append(m.group(1))

    # Split every mesh axis into pieces at the sub-axis boundaries (major piece first: a
    # sub-axis ``(pre)size`` covers the boundary range [pre, pre*size)).
    bounds: list[set[int]] = [{1, s} for s in sizes]
    for axis, pre, size in refs:
        bounds[axis] |= {pre, pre * size}
    piece_dims: list[int] = []
    piece_of: list[list[tuple[int, int]]] = []  # per axis: (lower bound, flat dim index)
    for axis, b in enumerate(bounds):
        ordered = sorted(b)
        pieces = []
        for lo, hi in itertools.pairwise(ordered):
            pieces.append((lo, len(piece_dims)))
            piece_dims.append(hi // lo)
        piece_of.append(pieces)
        if any(hi % lo for lo, hi in itertools.pairwise(ordered)):
            raise ValueError(f"sub-axes do not tile mesh axis {names[axis]!r}")
    split = devices.reshape(tuple(piece_dims))
    grouped: list[int] = []
    for axis, pre, size in refs:
        grouped += [d for lo, d in piece_of[axis] if pre <= lo < pre * size]
    rest = [d for d in range(len(piece_dims)) if d not in grouped]
    group_size = math.prod(piece_dims[d] for d in grouped)
    arr = split.transpose(rest + grouped).reshape(total // group_size, group_size)
    g = _groups_from_array(arr)
    g.mesh_axes = tuple(printed)
    return g


def _parse_replica_groups(attrs: str, all_devices: int) -> _Groups | None:
    """Groups of the ``replica_groups=`` attribute in ``attrs`` (quoted strings masked)."""
    key = re.search(r"(?<![\w-])replica_groups=", attrs)
    if key is None:
        return None
    pos = key.end()
    rest = attrs[pos:]
    if rest.startswith("{"):
        body = rest[: _matching(rest, 0)]
        rows = [tuple(_ints(g)) for g in re.findall(r"\{([^{}]*)\}", body[1:-1])]
        if not rows:
            if all_devices <= 0:
                return _Groups(None, 0, 1)
            return _Groups((tuple(range(all_devices)),), all_devices, 1)
        return _Groups(tuple(rows), len(rows[0]), len(rows))
    m = _IOTA_GROUPS.match(rest)
    if m:
        shape = _ints(m.group(1))
        arr = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return _groups_from_array(arr.reshape(shape[0], -1))
    m = re.match(r"maximal_mesh\[device_id=(\d+)\]", rest)
    if m:
        return _Groups(((int(m.group(1)),),), 1, 1, ())
    if rest.startswith("mesh["):
        end = _matching(rest, 4)
        axes_text = rest[5 : end - 1]
        tail = rest[end:]
        device_ids = None
        m = re.match(r"\s*,\s*device_ids=", tail)
        if m:
            start = m.end()
            close = _matching(tail, start)
            device_ids = tail[start + 1 : close - 1]
            tail = tail[close:]
        m = re.match(r"\s*\{([^}]*)\}", tail)
        if not m:
            raise ValueError(f"mesh replica groups without axes: {rest[:120]!r}")
        return _mesh_groups(axes_text, device_ids, m.group(1))
    raise ValueError(f"unrecognised replica_groups form: {rest[:120]!r}")


# --------------------------------------------------------------------------- module structure

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z_][\w.\-]*)\s*=\s*")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([A-Za-z_][\w.\-]*)\s*\(")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_CALL_ATTR = re.compile(
    r"(?<![\w-])(to_apply|calls|body|condition|branch_computations|true_computation|"
    r"false_computation)=(\{[^}]*\}|%?[A-Za-z_][\w.\-]*)"
)
_COLLECTIVE_OPCODE = re.compile(
    r"\s(?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')

_ASYNC_START = {
    "all-reduce-start": "all-reduce",
    "all-gather-start": "all-gather",
    "collective-permute-start": "collective-permute",
    "reduce-scatter-start": "reduce-scatter",
    "all-to-all-start": "all-to-all",
}


@dataclass
class _Instr:
    name: str
    shape: _Shape
    opcode: str
    operands: list[str]
    attrs: str  # with quoted strings masked to ""
    raw_attrs: str


def _parse_instruction(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    text = _COMMENT.sub("", line)
    m = _INSTR.match(text)
    assert m is not None
    try:
        shape, pos = _parse_shape_at(text, m.end())
    except ValueError:
        return None
    op = _OPCODE.match(text, pos)
    if not op:
        return None
    open_paren = op.end() - 1
    close = _matching(text, open_paren)
    operands = _split_top(text[open_paren + 1 : close - 1])
    raw_attrs = text[close:]
    attrs = _STRING.sub('""', raw_attrs)
    return _Instr(m.group(1), shape, op.group(1), operands, attrs, raw_attrs)


@dataclass
class _Module:
    computations: dict[str, list[_Instr]]
    entry: str | None
    num_partitions: int
    replica_count: int


def _parse_module(hlo_text: str) -> _Module:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    num_partitions = replica_count = 1
    current: list[_Instr] | None = None
    for line in hlo_text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("HloModule"):
            m = re.search(r"(?<![\w-])num_partitions=(\d+)", stripped)
            if m:
                num_partitions = int(m.group(1))
            m = re.search(r"(?<![\w-])replica_count=(\d+)", stripped)
            if m:
                replica_count = int(m.group(1))
            continue
        if _INSTR.match(line):
            try:
                instr = _parse_instruction(line)
            except ValueError:
                # Only a line that holds a collective must parse; anything else is skipped.
                if _COLLECTIVE_OPCODE.search(line):
                    raise
                instr = None
            if instr is not None:
                if current is None:  # a bare instruction snippet without a computation
                    current = comps.setdefault("", [])
                current.append(instr)
            continue
        if stripped.startswith("}"):  # "}" or "}, execution_thread=..."
            current = None
            continue
        h = _HEADER.match(line)
        if h and stripped.endswith("{"):
            current = comps.setdefault(h.group(2), [])
            if h.group(1):
                entry = h.group(2)
    return _Module(comps, entry, num_partitions, replica_count)


@dataclass
class _Context:
    in_loop: bool = False
    in_conditional: bool = False
    trips: set[int | None] = field(default_factory=set)


def _contexts(module: _Module) -> dict[str, _Context]:
    """Loop / conditional context of every computation, following call attributes."""
    edges: dict[str, list[tuple[str, str, int | None]]] = {}
    called: set[str] = set()
    for comp, instrs in module.computations.items():
        out = edges.setdefault(comp, [])
        for ins in instrs:
            trip = None
            if ins.opcode == "while":
                t = _TRIP.search(ins.raw_attrs)
                trip = int(t.group(1)) if t else None
            for key, value in _CALL_ATTR.findall(ins.attrs):
                names = [v.strip().lstrip("%") for v in value.strip("{}").split(",") if v.strip()]
                if ins.opcode == "while" and key in ("body", "condition"):
                    kind = "loop"
                elif ins.opcode == "conditional":
                    kind = "cond"
                else:
                    kind = "call"
                for n in names:
                    out.append((n, kind, trip))
                    called.add(n)
    roots = [module.entry] if module.entry else [c for c in module.computations if c not in called]
    ctx: dict[str, _Context] = {c: _Context() for c in module.computations}
    seen: set[tuple[str, bool, bool, int | None]] = set()
    stack: list[tuple[str, bool, bool, int | None]] = [(r, False, False, 1) for r in roots]
    while stack:
        state = stack.pop()
        if state in seen:
            continue
        seen.add(state)
        comp, in_loop, in_cond, trip = state
        c = ctx.setdefault(comp, _Context())
        c.in_loop |= in_loop
        c.in_conditional |= in_cond
        c.trips.add(trip)
        for callee, kind, loop_trip in edges.get(comp, ()):
            if kind == "loop":
                t = None if trip is None or loop_trip is None else trip * loop_trip
                stack.append((callee, True, in_cond, t))
            else:
                stack.append((callee, in_loop, in_cond or kind == "cond", trip))
    return ctx


# --------------------------------------------------------------------------- collectives


def _derive_operand(kind: str, result: tuple[str, tuple[int, ...]], group_size: int) -> int:
    nbytes = _array_bytes(result)
    g = max(group_size, 1)
    if kind == "all-gather":
        return nbytes // g
    if kind == "reduce-scatter":
        return nbytes * g
    return nbytes


def _dimension(attrs: str) -> int | None:
    m = re.search(r"(?<![\w-])dimensions=\{([\d,\s]*)\}", attrs)
    if not m:
        return None
    dims = _ints(m.group(1))
    return dims[0] if dims else None


def _collective(
    ins: _Instr, symbols: dict[str, _Shape], module: _Module, ctx: _Context, comp: str
) -> Collective | None:
    opcode = ins.opcode
    is_async = opcode in _ASYNC_START
    kind = _ASYNC_START.get(opcode, opcode)
    if kind not in KINDS:
        return None

    use_global = re.search(r"use_global_device_ids=true", ins.attrs) is not None
    has_channel = re.search(r"(?<![\w-])channel_id=", ins.attrs) is not None
    if use_global:
        all_devices = module.num_partitions * module.replica_count
    elif has_channel:
        all_devices = module.num_partitions
    else:
        all_devices = module.replica_count

    pairs = None
    if kind == "collective-permute":
        m = re.search(r"source_target_pairs=", ins.attrs)
        groups = _Groups(None, 1, 1)
        if m:
            body = ins.attrs[m.end() : _matching(ins.attrs, m.end())]
            found = [tuple(_ints(p)) for p in re.findall(r"\{([^{}]*)\}", body[1:-1])]
            pairs = tuple((int(p[0]), int(p[1])) for p in found if len(p) == 2)
            members = {d for p in pairs for d in p}
            groups = _Groups(None, max(len(members), 1), 1)
    else:
        parsed = _parse_replica_groups(ins.attrs, all_devices)
        groups = (
            parsed if parsed is not None else _Groups((tuple(range(all_devices)),), all_devices, 1)
        )

    dimension = _dimension(ins.attrs) if kind != "all-reduce" else None

    # Result (and, for async starts, operand) shapes.
    operand_shapes: list[tuple[str, tuple[int, ...]]] | None = None
    if is_async and kind != "all-reduce" and isinstance(ins.shape, list) and len(ins.shape) >= 2:
        operand_shapes = _leaves(ins.shape[0])
        results = _leaves(ins.shape[1])
    else:
        results = _leaves(ins.shape)

    if operand_shapes is None:
        looked_up: list[tuple[str, tuple[int, ...]]] = []
        for text in ins.operands:
            tokens = text.split()
            name = tokens[-1].lstrip("%") if tokens else ""
            shape: _Shape | None = None
            if len(tokens) > 1:  # shape printed at the call site
                try:
                    shape = _parse_shape_at(" ".join(tokens[:-1]), 0)[0]
                except ValueError:
                    shape = None
            if shape is None:
                shape = symbols.get(name)
            if shape is None or isinstance(shape, list):
                looked_up = []
                break
            looked_up.append(shape)
        if looked_up and len(looked_up) == len(ins.operands):
            operand_shapes = looked_up
    if operand_shapes is not None:
        operand_bytes = tuple(_array_bytes(s) for s in operand_shapes)
    else:
        operand_bytes = tuple(_derive_operand(kind, r, groups.group_size) for r in results)

    op_name = None
    m = re.search(r'(?<![\w-])op_name="((?:[^"\\]|\\.)*)"', ins.raw_attrs)
    if m:
        op_name = m.group(1)

    trip = None
    if len(ctx.trips) == 1:
        trip = next(iter(ctx.trips))
    return Collective(
        kind=kind,
        name=ins.name,
        operand_bytes=operand_bytes,
        result_bytes=tuple(_array_bytes(r) for r in results),
        group_size=groups.group_size,
        num_groups=groups.num_groups,
        mesh_axes=groups.mesh_axes,
        op_name=op_name,
        dimension=dimension,
        in_loop=ctx.in_loop,
        trip_count=trip,
        in_conditional=ctx.in_conditional,
        computation=comp,
        dtypes=tuple(r[0] for r in results),
        is_async=is_async,
        replica_groups=groups.groups,
        source_target_pairs=pairs,
    )


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of an HLO module's text, in text order.

    ``hlo_text`` is usually ``compiled.as_text()``; a bare snippet of instruction lines also
    works (then the device count for empty ``replica_groups={}`` is 1 unless the text has an
    ``HloModule`` header with ``num_partitions`` / ``replica_count``).
    """
    module = _parse_module(hlo_text)
    contexts = _contexts(module)
    out: list[Collective] = []
    for comp, instrs in module.computations.items():
        symbols = {ins.name: ins.shape for ins in instrs}
        ctx = contexts.get(comp, _Context(trips={1}))
        for ins in instrs:
            c = _collective(ins, symbols, module, ctx, comp)
            if c is not None:
                out.append(c)
    return out


def summarize(
    collectives: Iterable[Collective], per_run: bool = False
) -> dict[str, CollectiveSummary]:
    """Per-kind totals, one entry for every kind in ``KINDS`` (zeros where absent). With
    ``per_run``, tensors and bytes of a collective inside loops count once per iteration
    (``trip_count``; once where XLA did not record it): what one run of the program moves."""
    totals = {k: [0, 0, 0, 0, 0] for k in KINDS}
    for c in collectives:
        n = (c.trip_count or 1) if per_run and c.in_loop else 1
        t = totals[c.kind]
        t[0] += c.num_tensors * n
        t[1] += 1
        t[2] += c.bytes * n
        if c.in_loop:
            t[3] += 1
            t[4] += c.bytes * n
    return {k: CollectiveSummary(k, *v) for k, v in totals.items()}


def format_table(summary: dict[str, CollectiveSummary] | Iterable[Collective]) -> str:
    """A plain-text table of a ``summarize`` result (or of a list of collectives)."""
    if not isinstance(summary, dict):
        summary = summarize(summary)
    header = ("kind", "tensors", "instructions", "bytes/device", "", "in loops")
    rows = [header]
    total = CollectiveSummary("total")
    for kind in [*KINDS, *(k for k in summary if k not in KINDS)]:
        s = summary.get(kind)
        if s is None:
            continue
        rows.append(
            (
                kind,
                str(s.count),
                str(s.instructions),
                str(s.bytes),
                format_bytes(s.bytes),
                str(s.loop_instructions),
            )
        )
        total = CollectiveSummary(
            "total",
            total.count + s.count,
            total.instructions + s.instructions,
            total.bytes + s.bytes,
            total.loop_instructions + s.loop_instructions,
            total.loop_bytes + s.loop_bytes,
        )
    rows.append(
        (
            "total",
            str(total.count),
            str(total.instructions),
            str(total.bytes),
            format_bytes(total.bytes),
            str(total.loop_instructions),
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(rows) - 2:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)
