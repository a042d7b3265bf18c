"""The instruction stream a pipeshard step compiles to (DESIGN 6).

Buffers are named by strings; every instruction runs on one mesh (a pipeline stage's
devices). The stream is fixed per executable and replayed every step, in order:

- ``Put``: place a buffer on a mesh in a layout (a step input arriving, or an activation,
  gradient or cotangent crossing from one stage's mesh to another's, resharded on the way).
- ``Run``: call a compiled program on buffers, naming its results.
- ``Accumulate``: ``dst += src`` (or ``dst = src`` the first time); gradients over
  micro-batches, cotangents from several consumers.
- ``Free``: drop buffers no later instruction reads.
- ``Send``/``Recv`` (Ray runtime only): a buffer crossing from one host worker to another
  through Ray's object store; the ``Put`` that follows lays it out on the receiving mesh.
  Where either side spans hosts, each sender sends only the shards it holds that the
  receiving host's devices need (``Send.layout``), and the receiver assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "Accumulate",
    "Free",
    "Instruction",
    "Put",
    "Recv",
    "Run",
    "Send",
    "format_stream",
    "program_runs",
]


@dataclass(frozen=True)
class Put:
    src: str
    dst: str
    mesh: int
    layout: str  # key of a sharding registered with the runtime


@dataclass(frozen=True)
class Run:
    program: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    mesh: int


@dataclass(frozen=True)
class Accumulate:
    src: str
    dst: str
    mesh: int
    first: bool  # dst does not exist yet: it becomes src (src stays until freed)


@dataclass(frozen=True)
class Free:
    names: tuple[str, ...]
    mesh: int


@dataclass(frozen=True)
class Send:
    """Ray runtime: hand buffer ``src`` to host worker ``to`` under ``tag``: whole, or with
    ``layout`` (the destination's layout key) only the shards held here that ``to``'s
    devices need under it, each piece sent by its first holder."""

    src: str
    to: int
    tag: str
    mesh: int
    layout: str | None = None


@dataclass(frozen=True)
class Recv:
    """Ray runtime: wait for ``tag`` from host worker ``frm`` and name it ``dst``."""

    tag: str
    frm: int
    dst: str
    mesh: int


Instruction = Put | Run | Accumulate | Free | Send | Recv


def format_stream(stream: list[Instruction], limit: int | None = None) -> str:
    """One readable line per instruction."""
    lines = []
    for ins in stream[:limit]:
        if isinstance(ins, Put):
            lines.append(f"mesh{ins.mesh}  PUT   {ins.src} -> {ins.dst} [{ins.layout}]")
        elif isinstance(ins, Run):
            lines.append(
                f"mesh{ins.mesh}  RUN   {ins.program}({', '.join(ins.inputs)}) -> "
                f"{', '.join(ins.outputs)}"
            )
        elif isinstance(ins, Accumulate):
            op = "=" if ins.first else "+="
            lines.append(f"mesh{ins.mesh}  ACC   {ins.dst} {op} {ins.src}")
        elif isinstance(ins, Send):
            part = " (its shards)" if ins.layout is not None else ""
            lines.append(f"mesh{ins.mesh}  SEND  {ins.src}{part} -> host{ins.to} [{ins.tag}]")
        elif isinstance(ins, Recv):
            lines.append(f"mesh{ins.mesh}  RECV  host{ins.frm} [{ins.tag}] -> {ins.dst}")
        else:
            lines.append(f"mesh{ins.mesh}  FREE  {', '.join(ins.names)}")
    if limit is not None and len(stream) > limit:
        lines.append(f"... {len(stream) - limit} more")
    return "\n".join(lines)


def program_runs(stream: list[Instruction]) -> list[tuple[str, int]]:
    """Each program the stream runs and how often, in order of first run."""
    runs: dict[str, int] = {}
    for ins in stream:
        if isinstance(ins, Run):
            runs[ins.program] = runs.get(ins.program, 0) + 1
    return list(runs.items())
