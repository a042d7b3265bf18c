"""Timelines as Chrome Trace Event Format files (open in Perfetto or chrome://tracing).

A ``TraceEvent`` is one interval on one track; every track is a mesh (a pipeline stage's
devices), so simulated and measured timelines of the same plan line up track for track.
``measured_events`` turns what ``LocalRuntime.execute`` timed into events. Standard library
only: the runtime never imports the planner, and traces need nothing else.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .instructions import Accumulate, Free, Put, Recv, Run, Send

if TYPE_CHECKING:
    from .local import InstructionTiming

__all__ = ["TraceEvent", "chrome_trace", "measured_events", "write_chrome_trace"]

_PID = 1


@dataclass(frozen=True)
class TraceEvent:
    """One interval on one track (seconds from the timeline's start)."""

    track: int  # the mesh (stage) index
    name: str  # "F3" / "B3": forward / backward of micro-batch 3; "update"; a program; ...
    start: float
    end: float
    category: str = ""  # "fwd", "bwd", "update", "transfer", "accumulate", "free", ...
    args: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(
                f"TraceEvent {self.name!r}: end {self.end!r} is before start {self.start!r}"
            )

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _track_name(track: int, track_names: Mapping[int, str]) -> str:
    return track_names.get(track, f"track {track}")


def chrome_trace(
    events: Sequence[TraceEvent], track_names: Mapping[int, str], *, process_name: str
) -> dict[str, Any]:
    """The events as a Chrome trace: one process, one thread (``tid``) per track, "X"
    (complete) events with ``ts``/``dur`` in microseconds, metadata naming the process and
    every track. Tracks that have events but no name are called "track N"."""
    tracks = sorted(set(track_names) | {e.track for e in events})
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": _PID, "tid": 0, "args": {"name": process_name}}
    ]
    for t in tracks:
        out.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": _PID,
                "tid": t,
                "args": {"name": _track_name(t, track_names)},
            }
        )
        # Perfetto orders tracks by this index, so mesh 0 comes first.
        out.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": _PID,
                "tid": t,
                "args": {"sort_index": t},
            }
        )
    for e in events:
        out.append(
            {
                "name": e.name,
                "cat": e.category,
                "ph": "X",
                "ts": e.start * 1e6,
                "dur": (e.end - e.start) * 1e6,
                "pid": _PID,
                "tid": e.track,
                "args": dict(e.args),
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | Path,
    events: Sequence[TraceEvent],
    track_names: Mapping[int, str],
    *,
    process_name: str,
) -> Path:
    """Write ``chrome_trace(...)`` as JSON to ``path`` (parents created); return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(events, track_names, process_name=process_name)
    path.write_text(json.dumps(trace, default=str))
    return path


# Program names as the pipeshard compiler gives them: fwd{s}, bwd{s}, apply{s},
# accumulate{s}.{n}, split{s}.{j}, seed{s}, mean{s}, zeros{j}.
_PROGRAM = re.compile(r"^(fwd|bwd|apply|accumulate|split|seed|mean|zeros)\d")
_PROGRAM_CATEGORY = {
    "fwd": "fwd",
    "bwd": "bwd",
    "apply": "update",
    "accumulate": "accumulate",
    "split": "input",
}
# A buffer of one micro-batch: "res0.mb3", "v2.mb3@1", "d0.1.mb3@0".
_MICRO_BATCH = re.compile(r"\.mb(\d+)(?:@|$)")


def _buffers(ins: Any) -> list[str]:
    if isinstance(ins, Run):
        return [*ins.inputs, *ins.outputs]
    if isinstance(ins, Put | Accumulate):
        return [ins.src, ins.dst]
    if isinstance(ins, Send):
        return [ins.src]
    if isinstance(ins, Recv):
        return [ins.dst]
    if isinstance(ins, Free):
        return list(ins.names)
    return []


def _micro_batch(ins: Any) -> int | None:
    """The one micro-batch every per-micro-batch buffer of ``ins`` belongs to, if any."""
    found = {int(m.group(1)) for b in _buffers(ins) for m in [_MICRO_BATCH.search(b)] if m}
    return found.pop() if len(found) == 1 else None


def _describe(ins: Any) -> tuple[str, str]:
    """(name, category) of one instruction; forward and backward runs are named like the
    simulator's tasks ("F3", "B3") and an optimiser run "update", so traces compare."""
    if isinstance(ins, Run):
        if "+" in ins.program or "*" in ins.program:  # fused: fwd1+bwd1, fwd0*2
            return ins.program, "fused"
        match = _PROGRAM.match(ins.program)
        kind = match.group(1) if match else ""
        category = _PROGRAM_CATEGORY.get(kind, "other")
        m = _micro_batch(ins)
        if kind in ("fwd", "bwd") and m is not None:
            return f"{'F' if kind == 'fwd' else 'B'}{m}", category
        if kind == "apply":
            return "update", category
        return ins.program, category
    kind = type(ins).__name__.lower()
    if isinstance(ins, Put | Send | Recv):
        return kind, "transfer"
    return kind, kind  # "accumulate", "free"


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def measured_events(timings: Sequence[InstructionTiming]) -> list[TraceEvent]:
    """One event per measured instruction, on its mesh's track, in seconds from the first
    instruction's start. Args hold the instruction's index (and host, on Ray), its buffers
    and fields (the program for a run) and its micro-batch where every buffer names the same
    one."""
    if not timings:
        return []
    t0 = min(t.start for t in timings)
    events = []
    for t in timings:
        ins = t.instruction
        name, category = _describe(ins)
        args: dict[str, Any] = {"index": t.index}
        if t.host is not None:
            args["host"] = t.host
        if dataclasses.is_dataclass(ins):
            for f in dataclasses.fields(ins):
                if f.name != "mesh":
                    args[f.name] = _jsonable(getattr(ins, f.name))
        m = _micro_batch(ins)
        if m is not None:
            args["micro_batch"] = m
        events.append(TraceEvent(ins.mesh, name, t.start - t0, t.end - t0, category, args))
    return events
