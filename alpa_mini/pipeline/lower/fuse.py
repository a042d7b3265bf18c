"""Run each stretch of one mesh's work that needs nothing from another mesh as one program.

Between two transfers, a stage's instructions (its split, the forward and backward of
adjacent tasks, the accumulations, its sync and apply) read only buffers already on its
mesh. Dispatched one program at a time, each costs a launch on every device of the mesh
(about 10 ms on 8 CPU devices sharing 2 cores, more than the math of a small layer), so a
one-stage step of B micro-batches paid 2B + 3 launches where one ``jax.jit`` pays one.
Fused, a stretch is one XLA program; stretches with the same structure (the steady 1F1B
micro-batches of the last stage) share one compiled program.

A fused program reads the stretch's live-in buffers and returns those of its results that a
later instruction or the step's outputs read. It consumes (donates) a live-in whose value no
name holds after the stretch, unless that value is a step argument: ``donate_inputs``
decides those, as for every apply program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

from ...runtime.instructions import Accumulate, Free, Instruction, Put, Run
from .apply_grad import Unjitted
from .roll import find_loops, run_ops

__all__ = ["fuse_stream", "fused_name"]


@dataclass(frozen=True)
class _Op:
    """One instruction inside a fused program, on slots (live-ins are slots 0..n-1)."""

    program: str | None  # None: an accumulate (dst = src, or dst + src)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    first: bool = False


@dataclass
class _Stretch:
    """Consecutive instructions of one mesh (and the frees met among them)."""

    mesh: int
    start: int  # index of its first instruction in the stream
    frees: list[tuple[str, int]] = field(default_factory=list)  # (name, its mesh)
    end: int = 0  # index of its last instruction
    items: list[Instruction] = field(default_factory=list)  # body and frees, in order
    pre: list[Put] = field(default_factory=list)  # puts met inside, run before it
    names: set[str] = field(default_factory=set)  # buffers the body reads or writes

    def independent(self, put: Put) -> bool:
        """Whether ``put`` may run before the stretch: it reads nothing the stretch writes
        or frees, and makes no name the stretch reads, writes or frees."""
        freed = {n for n, _ in self.frees}
        return not ({put.src, put.dst} & (self.names | freed))

    @property
    def body(self) -> list[Run | Accumulate]:
        """Its runs and accumulates, in order."""
        return [i for i in self.items if isinstance(i, Run | Accumulate)]

    @property
    def work(self) -> int:
        """Launches it would cost unfused (an accumulate's first write is a rename)."""
        return sum(isinstance(i, Run) or not i.first for i in self.body)


def _reads(ins: Instruction) -> tuple[str, ...]:
    if isinstance(ins, Run):
        return ins.inputs
    if isinstance(ins, Accumulate):
        return (ins.src,) if ins.first else (ins.src, ins.dst)
    src = getattr(ins, "src", None)
    return (src,) if src is not None else ()


def _writes(ins: Instruction) -> tuple[str, ...]:
    if isinstance(ins, Run):
        return ins.outputs
    return (ins.dst,) if isinstance(ins, Put | Accumulate) else ()


def fuse_stream(
    programs: dict[str, Any], stream: list[Instruction], out_names: list[str | None]
) -> tuple[list[Instruction], dict[str, tuple[str, ...]]]:
    """The stream with every stretch of two or more launches on one mesh replaced by one
    ``Run`` of a fused program (added to ``programs``; programs no run uses any more are
    removed). Returns the new stream and, per fused program, the programs it runs in order."""
    last_read: dict[str, int] = {}
    for i, ins in enumerate(stream):
        for n in _reads(ins):
            last_read[n] = i
    kept = {n for n in out_names if n is not None}
    # Puts of a step input (a name no instruction writes) onto one layout hold equal values:
    # a stretch reads the first of them only (two names of one array may not be donated).
    written = {n for ins in stream for n in _writes(ins)}
    same_as: dict[str, str] = {}
    first_put: dict[tuple[str, str], str] = {}
    for ins in stream:
        if isinstance(ins, Put) and ins.src not in written:
            same_as[ins.dst] = first_put.setdefault((ins.src, ins.layout), ins.dst)
    holders = _Holders()
    out: list[Instruction] = []
    made: dict[Any, str] = {}
    parts: dict[str, tuple[str, ...]] = {}
    stretch: _Stretch | None = None

    def close() -> None:
        nonlocal stretch
        if stretch is None:
            return
        out.extend(stretch.pre)
        if stretch.work < 2:
            out.extend(stretch.items)
        else:
            out.extend(_fuse(stretch, programs, made, parts, last_read, kept, holders, same_as))
        stretch = None

    for i, ins in enumerate(stream):
        if isinstance(ins, Run | Accumulate):
            writes = ins.outputs if isinstance(ins, Run) else (ins.dst,)
            if stretch is not None and (
                stretch.mesh != ins.mesh or any((n, ins.mesh) in stretch.frees for n in writes)
            ):
                close()  # another mesh, or a name freed earlier in the stretch made again
            if stretch is None:
                stretch = _Stretch(ins.mesh, i)
                holders.mark()
            stretch.items.append(ins)
            stretch.names.update(_reads(ins), writes)
            stretch.end = i
        elif isinstance(ins, Free) and stretch is not None:
            stretch.frees.extend((n, ins.mesh) for n in ins.names)
            stretch.items.append(ins)
            stretch.end = i
        elif isinstance(ins, Put) and stretch is not None and stretch.independent(ins):
            stretch.pre.append(ins)  # moved before the stretch: it needs nothing from it
        else:
            close()
            out.append(ins)
        holders.apply(ins, i)
    close()
    read = {n for ins in out for n in _reads(ins)} | kept
    out = [ins for ins in out if not (isinstance(ins, Put) and ins.dst not in read)]
    used = {ins.program for ins in out if isinstance(ins, Run)}
    for name in [p for p in programs if p not in used]:
        del programs[name]
    return out, parts


class _Holders:
    """Which array (a root: the write that made it) each buffer name holds, through the
    stream: a ``Put`` onto the same layout and an accumulate's first write may pass the same
    array on under a new name, so donating one name would delete the other's value."""

    def __init__(self) -> None:
        self.root: dict[str, str] = {}
        self.snapshot: dict[str, str] = {}

    def of(self, name: str) -> str:
        return self.root.get(name, name)  # names read before any write: step inputs

    def mark(self) -> None:
        self.snapshot = dict(self.root)

    def apply(self, ins: Instruction, i: int) -> None:
        if isinstance(ins, Run):
            for n in ins.outputs:
                self.root[n] = f"{n}#{i}"
        elif isinstance(ins, Put):
            self.root[ins.dst] = self.of(ins.src)
        elif isinstance(ins, Accumulate):
            self.root[ins.dst] = self.of(ins.src) if ins.first else f"{ins.dst}#{i}"
        elif isinstance(ins, Free):
            for n in ins.names:
                self.root.pop(n, None)


def _fuse(
    st: _Stretch,
    programs: dict[str, Any],
    made: dict[Any, str],
    parts: dict[str, tuple[str, ...]],
    last_read: dict[str, int],
    kept: set[str],
    holders: _Holders,
    same_as: dict[str, str],
) -> list[Instruction]:
    """One stretch as a ``Run`` of its fused program, then renames and frees."""
    slot: dict[str, int] = {}  # name -> slot holding its current value
    live_in: list[str] = []
    ops: list[_Op] = []
    count = 0

    slot_of_in: dict[str, int] = {}

    def read(n: str) -> int:
        nonlocal count
        twin = same_as.get(n, n)
        if n not in slot and twin != n and twin in holders.snapshot:  # alive at the start
            slot[n] = read(twin)
        if n not in slot:
            slot[n] = slot_of_in[n] = count
            live_in.append(n)
            count += 1
        return slot[n]

    def write(n: str) -> int:
        nonlocal count
        slot[n] = count
        count += 1
        return slot[n]

    for ins in st.body:
        if isinstance(ins, Run):
            ins_slots = tuple(read(n) for n in ins.inputs)
            ops.append(_Op(ins.program, ins_slots, tuple(write(n) for n in ins.outputs)))
        elif ins.first:
            slot[ins.dst] = read(ins.src)  # a rename, no op
        else:
            srcs = (read(ins.src), read(ins.dst))
            ops.append(_Op(None, srcs, (write(ins.dst),)))
    # Renumber: live-ins first (the program's arguments), then results in order of writing.
    order = [slot_of_in[n] for n in live_in] + sorted(
        set(range(count)) - {slot_of_in[n] for n in live_in}
    )
    renumber = {old: new for new, old in enumerate(order)}
    ops = [
        _Op(
            op.program,
            tuple(renumber[i] for i in op.inputs),
            tuple(renumber[i] for i in op.outputs),
        )
        for op in ops
    ]
    slot = {n: renumber[i] for n, i in slot.items()}
    freed = {n for n, _ in st.frees}
    # Results a later instruction or the step's outputs read (names freed here are dead).
    needed = [n for n in slot if n not in freed and (last_read.get(n, -1) > st.end or n in kept)]
    n_in = len(live_in)
    returned = [n for n in needed if slot[n] >= n_in]
    renamed = [n for n in needed if slot[n] < n_in and n not in live_in]
    donate = _donatable(live_in, freed, needed, slot, holders, last_read, kept, st.end)
    key = (st.mesh, tuple(ops), n_in, tuple(slot[n] for n in returned), donate)
    name = made.get(key)
    if name is None:
        run_names = tuple(op.program for op in ops if op.program is not None)
        base = fused_name([op.program or "acc" for op in ops])
        name, k = base, 1
        while name in programs:
            k += 1
            name = f"{base}#{k}"
        programs[name] = Unjitted(
            _fused_fn(ops, [slot[n] for n in returned], programs), None, donate
        )
        made[key] = name
        parts[name] = run_names
    result: list[Instruction] = [Run(name, tuple(live_in), tuple(returned), st.mesh)]
    result += [Accumulate(live_in[slot[n]], n, st.mesh, True) for n in renamed]
    for mesh in dict.fromkeys(m for _, m in st.frees):
        result.append(Free(tuple(dict.fromkeys(n for n, m in st.frees if m == mesh)), mesh))
    return result


def fused_name(parts: list[str]) -> str:
    """``fwd1+acc`` or ``split0.0+fwd0*4+...``: the programs a fused program runs, each with
    its count, in order of first run (``acc``: an accumulate)."""
    counts: dict[str, int] = {}
    for p in parts:
        counts[p] = counts.get(p, 0) + 1
    return "+".join(p if c == 1 else f"{p}*{c}" for p, c in counts.items())


def _donatable(
    live_in: list[str],
    freed: set[str],
    needed: list[str],
    slot: dict[str, int],
    holders: _Holders,
    last_read: dict[str, int],
    kept: set[str],
    end: int,
) -> tuple[int, ...]:
    """Live-ins whose array nothing reads after the stretch: freed or overwritten here, the
    only live-in holding that array, no other name holding it read later, and not a step
    input (a root that is a plain name was never written by the stream)."""
    root_at_start = {n: holders.snapshot.get(n, n) for n in live_in}
    carried = {slot[n] for n in needed}
    donate = []
    for k, n in enumerate(live_in):
        r = root_at_start[n]
        if "#" not in r or k in carried:
            continue
        if n not in freed and slot.get(n) == k:
            continue  # still held under its own name after the stretch
        if sum(root_at_start[m] == r for m in live_in) > 1:
            continue
        others = [m for m, rr in holders.root.items() if rr == r and m not in live_in]
        if any(last_read.get(m, -1) > end or m in kept for m in others):
            continue
        donate.append(k)
    return tuple(donate)


def _fused_fn(
    ops: list[_Op], returned: list[int], programs: dict[str, Any]
) -> Callable[..., tuple[Any, ...]]:
    """The stretch replayed on traced values (each program inlined into one jit), repeated
    micro-batch work as a loop (``roll.py``)."""
    calls = {op.program: _callable(programs[op.program]) for op in ops if op.program is not None}

    loops = find_loops(ops, returned)

    def call(op: _Op, args: list[Any]) -> list[Any]:
        if op.program is None:
            src, dst = args
            return [dst + src]
        return list(calls[op.program](*args))

    def fused(*args: Any) -> tuple[Any, ...]:
        env = dict(enumerate(args))
        run_ops(ops, loops, env, call)
        return tuple(env[i] for i in returned)

    return fused


def _callable(program: Any) -> Callable[..., Any]:
    if isinstance(program, Unjitted):
        if program.out_shardings is None:
            return jax.jit(program.fn)
        return jax.jit(program.fn, out_shardings=program.out_shardings)
    return program
