"""Repeated micro-batch work inside a fused program, run as one loop (``lax.scan``).

Fused, a one-stage 1F1B step of B micro-batches is one program whose middle is B - 1 copies
of the same work (the forward of micro-batch m, its backward, the accumulations).
Unrolled, XLA's CPU runtime runs such a program markedly slower than the same work as a loop:
on 8 CPU devices a small GPT's step at B = 8 took 425 ms as one jit with its micro-batch loop
unrolled and 300 ms with it as a ``lax.scan``; our fused program took 368 ms unrolled and
290 ms rolled. Here the copies become one ``lax.scan``: what an iteration hands to the next
travels in the carry, per-micro-batch inputs are stacked, and what is read after the loop
comes out of the last iteration's carry (stacked, when earlier iterations' values are read).
The compiled program no longer grows with B either.

The ops are those of ``fuse.py``: single-assignment slots, ``program`` None for an
accumulate. ``find_loops`` is static; ``run_ops`` replays the ops on traced values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import jax
import jax.numpy as jnp

__all__ = ["Loop", "find_loops", "run_ops"]

#: The longest repeated unit searched for (ops per iteration).
MAX_WIDTH = 32


class _OpLike(Protocol):
    program: str | None
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


Rel = tuple[int, int]  # (op within the iteration, output position)


@dataclass(frozen=True)
class Ref:
    """Where an input of an iteration's op comes from: ``local`` (an earlier op of the same
    iteration, ``Rel``), ``carry`` (the previous iteration, ``Rel``), ``const`` (an outer
    slot, the same every iteration) or ``xs`` (the k-th stacked outer input)."""

    kind: Literal["local", "carry", "const", "xs"]
    at: Any


@dataclass(frozen=True)
class Loop:
    """``ops[start : start + width * reps]``: ``reps`` iterations of ``width`` ops. ``refs``:
    per op of the first iteration, per input, its ``Ref``. ``carry``: the outputs carried,
    each with the outer slot the first iteration reads instead (None: nothing reads it
    before the loop ends; it starts as zeros). ``xs``: per stacked input, the outer slot of
    each iteration. ``ys``: outputs every iteration of which is read after the loop."""

    start: int
    width: int
    reps: int
    refs: tuple[tuple[Ref, ...], ...]
    carry: tuple[tuple[Rel, int | None], ...]
    xs: tuple[tuple[int, ...], ...]
    ys: tuple[Rel, ...]

    @property
    def end(self) -> int:
        return self.start + self.width * self.reps


def find_loops(ops: Sequence[_OpLike], returned: Sequence[int], min_reps: int = 3) -> list[Loop]:
    """Non-overlapping loops covering as many ops as possible (greedily, the largest first)."""
    writer = {s: (k, o) for k, op in enumerate(ops) for o, s in enumerate(op.outputs)}
    readers: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        for s in op.inputs:
            readers.setdefault(s, []).append(k)
    for s in returned:
        readers.setdefault(s, []).append(len(ops))  # read after every op
    names = [op.program for op in ops]
    loops: list[Loop] = []

    def search(lo: int, hi: int) -> None:
        best: Loop | None = None
        for width in range(1, min(MAX_WIDTH, (hi - lo) // min_reps) + 1):
            reps_from = _repeats(names[lo:hi], width)
            for start in range(lo, hi - width * min_reps + 1):
                reps = reps_from[start - lo]
                if reps < min_reps or (best and width * reps <= best.width * best.reps):
                    continue
                loop = _plan(ops, start, width, reps, writer, readers)
                if loop is not None:
                    best = loop
        if best is not None:
            loops.append(best)
            search(lo, best.start)
            search(best.end, hi)

    search(0, len(ops))
    return sorted(loops, key=lambda loop: loop.start)


def _repeats(names: list[str | None], width: int) -> list[int]:
    """Per start, how many times the ``width`` names from it repeat back to back (one pass
    from the end: ``same[i]`` runs of ``names[i] == names[i + width]``)."""
    n = len(names)
    run = [0] * (n + 1)  # run[i]: length of the streak of matches starting at i
    for i in range(n - width - 1, -1, -1):
        run[i] = run[i + 1] + 1 if names[i] == names[i + width] else 0
    return [1 + run[i] // width if i + width <= n else 0 for i in range(n)]


def _plan(
    ops: Sequence[_OpLike],
    start: int,
    width: int,
    reps: int,
    writer: dict[int, Rel],
    readers: dict[int, list[int]],
) -> Loop | None:
    """The loop of ``reps`` iterations from ``start``, or None when the iterations do not
    hand values on uniformly (each only to the next one, the same way every time)."""
    end = start + width * reps

    def origin(slot: int, r: int) -> tuple[str, Any]:
        w = writer.get(slot)
        if w is None or w[0] < start:
            return "out", slot
        it, j = divmod(w[0] - start, width)
        if it == r:
            return "local", (j, w[1])
        if it == r - 1:
            return "prev", (j, w[1])
        return "bad", None

    refs: list[tuple[Ref, ...]] = []
    carry: dict[Rel, int | None] = {}
    xs: list[tuple[int, ...]] = []
    for j in range(width):
        row = []
        for i in range(len(ops[start + j].inputs)):
            slots = [ops[start + r * width + j].inputs[i] for r in range(reps)]
            seen = [origin(s, r) for r, s in enumerate(slots)]
            kinds = {k for k, _ in seen[1:]}
            if len(kinds) != 1 or "bad" in kinds:
                return None
            (kind,) = kinds
            ats = {at for _, at in seen[1:]}
            if kind == "local" and seen[0][0] == "local" and len(ats | {seen[0][1]}) == 1:
                row.append(Ref("local", seen[0][1]))
            elif kind == "prev" and seen[0][0] == "out" and len(ats) == 1:
                (rel,) = ats
                if carry.setdefault(rel, seen[0][1]) != seen[0][1]:
                    return None
                row.append(Ref("carry", rel))
            elif kind == "out" and seen[0][0] == "out":
                if len(set(slots)) == 1:
                    row.append(Ref("const", slots[0]))
                else:
                    row.append(Ref("xs", len(xs)))
                    xs.append(tuple(slots))
            else:
                return None
        refs.append(tuple(row))
    after: dict[Rel, bool] = {}  # read after the loop: True if earlier iterations' are too
    for r in range(reps):
        for j in range(width):
            for o, s in enumerate(ops[start + r * width + j].outputs):
                for k in readers.get(s, []):
                    if k >= end:
                        after[(j, o)] = after.get((j, o), False) or r < reps - 1
                    elif (k - start) // width > r + 1:
                        return None  # read two iterations later
    ys = tuple(rel for rel, every in after.items() if every)
    for rel in after:
        if rel not in ys:
            carry.setdefault(rel, None)
    return Loop(start, width, reps, tuple(refs), tuple(carry.items()), tuple(xs), ys)


Call = Callable[[Any, list[Any]], list[Any]]


def run_ops(ops: Sequence[_OpLike], loops: Sequence[Loop], env: dict[int, Any], call: Call) -> None:
    """Evaluate ``ops`` into ``env`` (slot -> value), each loop as one ``lax.scan``;
    ``call(op, args)`` evaluates one op."""
    by_start = {loop.start: loop for loop in loops}
    k = 0
    while k < len(ops):
        loop = by_start.get(k)
        if loop is not None and _run_loop(ops, loop, env, call):
            k = loop.end
            continue
        op = ops[k]
        env.update(zip(op.outputs, call(op, [env[s] for s in op.inputs]), strict=True))
        k += 1


def _run_loop(ops: Sequence[_OpLike], loop: Loop, env: dict[int, Any], call: Call) -> bool:
    """Run ``loop`` as a scan; False (nothing done) when its carry's types would change
    between iterations (a weakly typed value), so the caller unrolls it instead."""
    body_ops = ops[loop.start : loop.start + loop.width]
    xs = [jnp.stack([env[s] for s in slots]) for slots in loop.xs]

    def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
        held = dict(zip((rel for rel, _ in loop.carry), carry, strict=True))
        local: dict[Rel, Any] = {}
        for j, (op, row) in enumerate(zip(body_ops, loop.refs, strict=True)):
            args = [_value(ref, local, held, x, env) for ref in row]
            local.update(((j, o), v) for o, v in enumerate(call(op, args)))
        return [local[rel] for rel, _ in loop.carry], [local[rel] for rel in loop.ys]

    x0 = [a[0] for a in xs]
    # Carries nothing reads before the loop ends start as zeros of the type they get.
    placeholder = [env[s] if s is not None else jnp.zeros(()) for _, s in loop.carry]
    out_types, _ = jax.eval_shape(body, placeholder, x0)
    init = [
        env[s] if s is not None else jnp.zeros(t.shape, t.dtype)
        for (_, s), t in zip(loop.carry, out_types, strict=True)
    ]
    if any(_type(a) != _type(t) for a, t in zip(init, out_types, strict=True)):
        return False
    carry, ys = jax.lax.scan(body, init, xs, length=loop.reps)
    last = loop.start + (loop.reps - 1) * loop.width
    for (rel, _), v in zip(loop.carry, carry, strict=True):
        env[ops[last + rel[0]].outputs[rel[1]]] = v
    for rel, stacked in zip(loop.ys, ys, strict=True):
        for r in range(loop.reps):
            env[ops[loop.start + r * loop.width + rel[0]].outputs[rel[1]]] = stacked[r]
    return True


def _value(ref: Ref, local: dict[Rel, Any], held: dict[Rel, Any], x: list[Any], env: dict) -> Any:
    if ref.kind == "local":
        return local[ref.at]
    if ref.kind == "carry":
        return held[ref.at]
    if ref.kind == "xs":
        return x[ref.at]
    return env[ref.at]


def _type(v: Any) -> tuple[Any, ...]:
    aval = v if isinstance(v, jax.ShapeDtypeStruct) else jax.typeof(v)
    return (tuple(aval.shape), jnp.dtype(aval.dtype), bool(getattr(aval, "weak_type", False)))
