"""Pipeline schedules as clock tables: which (stage, micro-batch, fwd|bwd) each mesh runs per tick.

The runtime compiles a table into per-mesh instruction streams and the cost model reads its
length and in-flight counts, so the tables are plain data with checked invariants (GPipe, 1F1B).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from .._validate import positive_int

__all__ = [
    "SCHEDULES",
    "Schedule",
    "Task",
    "check_schedule",
    "gpipe",
    "make_schedule",
    "one_f_one_b",
]

#: The pipeline schedules: GPipe (all forwards, then all backwards) and 1F1B.
ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[str, ...] = get_args(ScheduleName)
_KINDS = ("fwd", "bwd")


@dataclass(frozen=True)
class Task:
    """One unit-time job: the forward or backward of ``micro_batch`` through ``stage``."""

    stage: int
    micro_batch: int
    kind: str  # "fwd" or "bwd"

    def __post_init__(self) -> None:
        for field in ("stage", "micro_batch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Task.{field} must be a non-negative int, got {value!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"Task.kind must be one of {_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        return f"{'F' if self.kind == 'fwd' else 'B'}{self.micro_batch}"


@dataclass(frozen=True)
class Schedule:
    """A clock table: ``ticks[t][mesh]`` is the task mesh ``mesh`` runs at tick ``t``, or None.

    Only the table's shape is checked on construction; ``check_schedule`` checks semantics.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    ticks: tuple[tuple[Task | None, ...], ...]

    def __post_init__(self) -> None:
        positive_int("num_stages", self.num_stages)
        positive_int("num_micro_batches", self.num_micro_batches)
        ticks = tuple(tuple(row) for row in self.ticks)
        for t, row in enumerate(ticks):
            if len(row) != self.num_stages:
                raise ValueError(
                    f"tick {t} has {len(row)} entries, expected one per mesh ({self.num_stages})"
                )
            for mesh, task in enumerate(row):
                if task is not None and not isinstance(task, Task):
                    raise ValueError(f"tick {t} mesh {mesh}: expected Task or None, got {task!r}")
        object.__setattr__(self, "ticks", ticks)

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def tasks_of(self, mesh: int) -> list[Task]:
        """The tasks mesh ``mesh`` runs, in tick order."""
        return [row[mesh] for row in self.ticks if row[mesh] is not None]

    def order(self) -> list[Task]:
        """All tasks tick-major, then by mesh: a valid sequential execution order."""
        return [task for row in self.ticks for task in row if task is not None]

    def max_in_flight(self, mesh: int) -> int:
        """Peak over time of (forwards done - backwards done) on ``mesh``."""
        live = peak = 0
        for task in self.tasks_of(mesh):
            live += 1 if task.kind == "fwd" else -1
            peak = max(peak, live)
        return peak

    def to_text(self) -> str:
        """ASCII table: one row per mesh, one column per tick; idle is ``.``."""
        cells = [
            ["." if row[mesh] is None else str(row[mesh]) for row in self.ticks]
            for mesh in range(self.num_stages)
        ]
        width = max((len(c) for line in cells for c in line), default=1)
        label = len(f"mesh {self.num_stages - 1}")
        lines = []
        for mesh, line in enumerate(cells):
            body = " ".join(c.ljust(width) for c in line)
            lines.append(f"{f'mesh {mesh}'.ljust(label)} | {body}".rstrip())
        return "\n".join(lines)

    def to_json(self) -> str:
        ticks = [
            [
                None
                if task is None
                else {"stage": task.stage, "micro_batch": task.micro_batch, "kind": task.kind}
                for task in row
            ]
            for row in self.ticks
        ]
        return json.dumps(
            {
                "name": self.name,
                "num_stages": self.num_stages,
                "num_micro_batches": self.num_micro_batches,
                "ticks": ticks,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        data = json.loads(text)
        ticks = tuple(
            tuple(None if task is None else Task(**task) for task in row) for row in data["ticks"]
        )
        return cls(
            name=data["name"],
            num_stages=data["num_stages"],
            num_micro_batches=data["num_micro_batches"],
            ticks=ticks,
        )


def _dependencies(task: Task, num_stages: int) -> list[Task]:
    """Tasks that must finish at a strictly earlier tick than ``task``."""
    s, m = task.stage, task.micro_batch
    if task.kind == "fwd":
        return [Task(s - 1, m, "fwd")] if s > 0 else []
    deps = [Task(s, m, "fwd")]
    if s < num_stages - 1:
        deps.append(Task(s + 1, m, "bwd"))
    return deps


def _asap(
    name: str, num_stages: int, num_micro_batches: int, per_mesh: Sequence[Sequence[Task]]
) -> Schedule:
    """Place each mesh's tasks, in the given order, at the earliest tick their deps allow."""
    done: dict[Task, int] = {}
    nxt = [0] * num_stages
    remaining = sum(len(tasks) for tasks in per_mesh)
    ticks: list[tuple[Task | None, ...]] = []
    while remaining:
        t = len(ticks)
        row: list[Task | None] = [None] * num_stages
        for mesh, tasks in enumerate(per_mesh):
            if nxt[mesh] == len(tasks):
                continue
            task = tasks[nxt[mesh]]
            if all(done.get(d, t) < t for d in _dependencies(task, num_stages)):
                row[mesh] = task
        if all(task is None for task in row):
            raise RuntimeError(f"{name}: per-mesh task orders deadlock at tick {t}")
        for mesh, task in enumerate(row):
            if task is not None:
                done[task] = t
                nxt[mesh] += 1
                remaining -= 1
        ticks.append(tuple(row))
    return Schedule(name, num_stages, num_micro_batches, tuple(ticks))


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """All forwards pipelined, then all backwards pipelined in reverse; 2(B+S-1) ticks."""
    S = positive_int("num_stages", num_stages)
    B = positive_int("num_micro_batches", num_micro_batches)
    ticks: list[list[Task | None]] = [[None] * S for _ in range(2 * (B + S - 1))]
    first_bwd = S + B - 1  # the last stage's first backward follows its last forward
    for s in range(S):
        for m in range(B):
            ticks[s + m][s] = Task(s, m, "fwd")
            ticks[first_bwd + (S - 1 - s) + m][s] = Task(s, m, "bwd")
    return Schedule("gpipe", S, B, tuple(tuple(row) for row in ticks))


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """PipeDream-flush 1F1B: min(S-s, B) warm-up forwards, then alternate backward/forward."""
    S = positive_int("num_stages", num_stages)
    B = positive_int("num_micro_batches", num_micro_batches)
    per_mesh = []
    for s in range(S):
        warmup = min(S - s, B)
        tasks = [Task(s, m, "fwd") for m in range(warmup)]
        for i in range(B - warmup):
            tasks += [Task(s, i, "bwd"), Task(s, warmup + i, "fwd")]
        tasks += [Task(s, m, "bwd") for m in range(B - warmup, B)]
        per_mesh.append(tasks)
    return _asap("1f1b", S, B, per_mesh)


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
    """Build the schedule called ``name`` (case-insensitive, one of ``SCHEDULES``)."""
    key = name.lower() if isinstance(name, str) else None
    if key == "gpipe":
        return gpipe(num_stages, num_micro_batches)
    if key == "1f1b":
        return one_f_one_b(num_stages, num_micro_batches)
    raise ValueError(f"pipeline_schedule must be one of {SCHEDULES}, got {name!r}")


def check_schedule(schedule: Schedule) -> None:
    """Raise ValueError describing the first violated invariant, else return None."""
    S, B = schedule.num_stages, schedule.num_micro_batches
    placed: dict[Task, int] = {}
    for t, row in enumerate(schedule.ticks):
        if len(row) != S:
            raise ValueError(f"tick {t} has {len(row)} entries, expected {S}")
        for mesh, task in enumerate(row):
            if task is None:
                continue
            if task.stage != mesh:
                raise ValueError(f"{task!r} runs on mesh {mesh} at tick {t}, not its own mesh")
            if task.stage >= S or task.micro_batch >= B:
                raise ValueError(f"{task!r} at tick {t} is out of range for S={S}, B={B}")
            if task in placed:
                raise ValueError(f"{task!r} appears twice, at ticks {placed[task]} and {t}")
            placed[task] = t
    for s in range(S):
        for m in range(B):
            for kind in _KINDS:
                if Task(s, m, kind) not in placed:
                    raise ValueError(f"{Task(s, m, kind)!r} is missing from the schedule")
    for task in schedule.order():
        for dep in _dependencies(task, S):
            if placed[dep] >= placed[task]:
                raise ValueError(
                    f"{task!r} at tick {placed[task]} does not follow its dependency "
                    f"{dep!r} at tick {placed[dep]}"
                )
