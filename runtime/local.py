"""Run an instruction stream in one process: every stage's mesh is a slice of local devices.

JAX dispatches asynchronously, so issuing the stream in order already overlaps stages that
run on disjoint devices; a ``Put`` between meshes is a ``jax.device_put``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax

from .instructions import Accumulate, Free, Instruction, Put, Run

__all__ = ["CPU_IN_FLIGHT", "InstructionTiming", "LocalRuntime", "is_deleted"]

#: Programs the local runtime lets run ahead on the CPU client (see ``LocalRuntime``).
CPU_IN_FLIGHT = 4


class LocalRuntime:
    """Holds compiled programs and layouts; ``execute`` replays a stream over a buffer dict."""

    def __init__(
        self,
        programs: Mapping[str, Callable[..., Any]],
        layouts: Mapping[str, jax.sharding.Sharding],
        add: Callable[[Any, Any], Any],
        place: Callable[[Any, jax.sharding.Sharding], Any] = jax.device_put,
    ) -> None:
        self.programs = dict(programs)
        self.layouts = dict(layouts)
        self.add = add
        self.place = place  # how a Put lays a buffer out (the Ray worker's also spans hosts)
        # On the CPU client, collectives of many dispatched programs can deadlock the shared
        # thread pool (seen with a ZeRO-3 stage and 16 micro-batches): keep at most this many
        # programs in flight there (0: no bound; devices with their own queues need none).
        self.max_in_flight = CPU_IN_FLIGHT if jax.default_backend() == "cpu" else 0
        # Each program's argument shapes and layouts at its first run (for ``hlo_text``).
        self.signatures: dict[str, tuple[Any, ...]] = {}

    def execute(
        self,
        stream: list[Instruction],
        buffers: dict[str, Any],
        timeline: list[InstructionTiming] | None = None,
    ) -> dict[str, Any]:
        """Run ``stream``; ``buffers`` holds the named inputs and receives every result.

        With a ``timeline`` list, every instruction waits for its results before the next one
        starts, and its measured wall-clock interval is appended: the stream then runs back
        to back (no overlap between meshes), which is what a per-instruction trace measures.
        """
        in_flight: collections.deque[list[Any]] = collections.deque()
        for index, ins in enumerate(stream):
            start = time.perf_counter() if timeline is not None else 0.0
            self.execute_one(ins, buffers)
            if self.max_in_flight and isinstance(ins, Run) and timeline is None:
                in_flight.append([buffers[n] for n in ins.outputs])
                if len(in_flight) > self.max_in_flight:
                    done = jax.tree.leaves(in_flight.popleft())  # residuals are tuples
                    jax.block_until_ready([x for x in done if not is_deleted(x)])
            if timeline is not None:
                jax.block_until_ready([buffers[n] for n in self.written(ins) if n in buffers])
                end = time.perf_counter()
                timeline.append(InstructionTiming(index, ins, start, end))
        return buffers

    def execute_one(self, ins: Instruction, buffers: dict[str, Any]) -> None:
        """Interpret one instruction against ``buffers``."""
        if isinstance(ins, Run):
            args = [buffers[n] for n in ins.inputs]
            if ins.program not in self.signatures:
                self.signatures[ins.program] = tuple(jax.tree.map(_spec, args))
            outs = self.programs[ins.program](*args)
            if len(ins.outputs) != len(outs):
                raise RuntimeError(
                    f"program {ins.program} returned {len(outs)} values for "
                    f"{len(ins.outputs)} outputs"
                )
            buffers.update(zip(ins.outputs, outs, strict=True))
        elif isinstance(ins, Put):
            buffers[ins.dst] = self.place(buffers[ins.src], self.layouts[ins.layout])
        elif isinstance(ins, Accumulate):
            src = buffers[ins.src]
            buffers[ins.dst] = src if ins.first else self.add(buffers[ins.dst], src)
        elif isinstance(ins, Free):
            for name in ins.names:
                buffers.pop(name, None)
        else:  # pragma: no cover - the union above is closed
            raise TypeError(f"unknown instruction {ins!r}")

    def hlo_text(self, program: str) -> str:
        """The compiled HLO of ``program`` for the arguments it ran with (after a step)."""
        if program not in self.programs:
            raise ValueError(f"program: no program {program!r}; valid: {sorted(self.programs)}")
        if program not in self.signatures:
            raise ValueError(
                f"program: {program!r} has not run yet; run one step before inspecting it"
            )
        jitted = self.programs[program]
        return jitted.lower(*self.signatures[program]).compile().as_text()

    @staticmethod
    def written(ins: Instruction) -> tuple[str, ...]:
        """The buffers ``ins`` writes."""
        if isinstance(ins, Run):
            return ins.outputs
        if isinstance(ins, Put | Accumulate):
            return (ins.dst,)
        return ()


def is_deleted(x: Any) -> bool:
    """Whether ``x`` is an array whose buffer was donated or deleted."""
    check = getattr(x, "is_deleted", None)
    return bool(check()) if check is not None else False


def _spec(x: Any) -> Any:
    """An array's shape, dtype and layout (other leaves as they are)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(x, "shape"):
        return x
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding, weak_type=getattr(x, "weak_type", False)
    )


@dataclass(frozen=True)
class InstructionTiming:
    """One instruction's measured interval: ``time.perf_counter`` seconds in the local
    runtime; on Ray workers ``time.time`` seconds (one clock for every process of a machine)
    and the ``host`` whose worker ran it."""

    index: int
    instruction: Instruction
    start: float
    end: float
    host: int | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start
