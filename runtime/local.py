"""Run an instruction stream in one process: every stage's mesh is a slice of local devices.

JAX dispatches asynchronously, so issuing the stream in order already overlaps stages that
run on disjoint devices; a ``Put`` between meshes is a ``jax.device_put``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax

from .instructions import Accumulate, Free, Instruction, Put, Run

__all__ = ["LocalRuntime"]


class LocalRuntime:
    """Holds compiled programs and layouts; ``execute`` replays a stream over a buffer dict."""

    def __init__(
        self,
        programs: Mapping[str, Callable[..., Any]],
        layouts: Mapping[str, jax.sharding.Sharding],
        add: Callable[[Any, Any], Any],
    ) -> None:
        self.programs = dict(programs)
        self.layouts = dict(layouts)
        self.add = add

    def execute(self, stream: list[Instruction], buffers: dict[str, Any]) -> dict[str, Any]:
        """Run ``stream``; ``buffers`` holds the named inputs and receives every result."""
        for ins in stream:
            if isinstance(ins, Run):
                outs = self.programs[ins.program](*(buffers[n] for n in ins.inputs))
                if len(ins.outputs) != len(outs):
                    raise RuntimeError(
                        f"program {ins.program} returned {len(outs)} values for "
                        f"{len(ins.outputs)} outputs"
                    )
                buffers.update(zip(ins.outputs, outs, strict=True))
            elif isinstance(ins, Put):
                buffers[ins.dst] = jax.device_put(buffers[ins.src], self.layouts[ins.layout])
            elif isinstance(ins, Accumulate):
                src = buffers[ins.src]
                buffers[ins.dst] = src if ins.first else self.add(buffers[ins.dst], src)
            elif isinstance(ins, Free):
                for name in ins.names:
                    buffers.pop(name, None)
            else:  # pragma: no cover - the union above is closed
                raise TypeError(f"unknown instruction {ins!r}")
        return buffers
