"""Event-driven pipeline simulator: the iteration time and per-device peak memory of a
pipeshard plan under its schedule, cross-stage transfers included.

Every mesh runs its tasks in the schedule's order. A task starts when its mesh is free and
its inputs have arrived: a forward needs the previous stage's forward of the same
micro-batch plus the activation transfer; a backward needs its own forward and the next
stage's backward plus the cotangent transfer. A transfer is a delay on its links (alpha +
bytes * beta, the bytes split over the hosts of the smaller mesh, which send at once): it
does not occupy either mesh and does not contend with other transfers.
After its last backward a stage applies its gradients (``update``); the iteration ends when
the last stage has.

With zero transfer and update time, GPipe and 1F1B both give sum(t) + (B - 1) max(t) when
every stage's backward is the same multiple of its forward (t = forward + backward).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .schedules import Schedule, make_schedule

if TYPE_CHECKING:
    from ..cluster.spec import ClusterSpec
    from .plan import PipeshardPlan

__all__ = [
    "Simulation",
    "StageTiming",
    "TaskSpan",
    "chain_timings",
    "simulate",
    "simulate_plan",
    "stage_timings",
]

#: Backward seconds per forward second when a plan gives one latency per stage (the
#: backward of a matmul is two matmuls of the forward's size).
BACKWARD_RATIO = 2.0


@dataclass(frozen=True)
class StageTiming:
    """What the simulator needs of one stage, per micro-batch unless said otherwise."""

    forward: float  # seconds
    backward: float  # seconds
    send_forward: float = 0.0  # seconds to move this stage's outputs to the next stage
    send_backward: float = 0.0  # seconds to move its input cotangents to the previous stage
    memory: float = 0.0  # bytes per device with one micro-batch in flight (weights included)
    residual: float = 0.0  # bytes per device for each further micro-batch in flight
    update: float = 0.0  # seconds to apply the gradients, once per iteration

    def __post_init__(self) -> None:
        for name in (
            "forward",
            "backward",
            "send_forward",
            "send_backward",
            "memory",
            "residual",
            "update",
        ):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"StageTiming.{name}: {value!r} is invalid; expected >= 0")


@dataclass(frozen=True)
class TaskSpan:
    """When one task ran in the simulation (seconds from the iteration's start)."""

    stage: int
    micro_batch: int
    kind: str  # "fwd", "bwd" or "update" (micro_batch -1)
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """A simulated iteration."""

    iteration_time: float  # seconds
    peak_memory: tuple[float, ...]  # bytes per device of each stage's mesh
    spans: tuple[TaskSpan, ...]  # every task, in the order the simulator placed them
    num_micro_batches: int

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' time spent idle within the iteration."""
        stages = len(self.peak_memory)
        busy = sum(s.end - s.start for s in self.spans)
        total = stages * self.iteration_time
        return 1.0 - busy / total if total > 0 else 0.0


def simulate(stages: Sequence[StageTiming], schedule: Schedule) -> Simulation:
    """Simulate one iteration of ``schedule`` over stages timed by ``stages``."""
    S = schedule.num_stages
    if len(stages) != S:
        raise ValueError(
            f"stages: {len(stages)} timings for a schedule of {S} stages; give one each"
        )
    end: dict[tuple[int, int, str], float] = {}
    free = [0.0] * S
    spans: list[TaskSpan] = []
    # Tick order is a topological order that keeps every mesh's own order.
    for task in schedule.order():
        s, m = task.stage, task.micro_batch
        st = stages[s]
        if task.kind == "fwd":
            ready = end[(s - 1, m, "fwd")] + stages[s - 1].send_forward if s > 0 else 0.0
            duration = st.forward
        else:
            ready = end[(s, m, "fwd")]
            if s < S - 1:
                ready = max(ready, end[(s + 1, m, "bwd")] + stages[s + 1].send_backward)
            duration = st.backward
        start = max(free[s], ready)
        free[s] = end[(s, m, task.kind)] = start + duration
        spans.append(TaskSpan(s, m, task.kind, start, start + duration))
    for s, st in enumerate(stages):
        if st.update > 0:
            spans.append(TaskSpan(s, -1, "update", free[s], free[s] + st.update))
            free[s] += st.update
    peak = tuple(
        st.memory + max(schedule.max_in_flight(s) - 1, 0) * st.residual
        for s, st in enumerate(stages)
    )
    return Simulation(max(free), peak, tuple(spans), schedule.num_micro_batches)


def stage_timings(
    plan: PipeshardPlan,
    cluster: ClusterSpec,
    *,
    backward_ratio: float = BACKWARD_RATIO,
    transfers: bool = True,
) -> list[StageTiming]:
    """Per-stage timings of a plan: its predicted latency split into forward and backward
    (1 : ``backward_ratio``), and each boundary's activation bytes over the links between
    the two meshes (inside one host: the intra-host link; else the inter-host links of as
    many hosts as the smaller mesh spans, in parallel)."""
    per_host = cluster.devices_per_host
    return chain_timings(
        [st.latency for st in plan.stages],
        [st.out_bytes if transfers else 0.0 for st in plan.stages],
        [frozenset(d // per_host for d in st.devices) for st in plan.stages],
        cluster,
        backward_ratio=backward_ratio,
        memory=[(st.peak_memory, st.residual_bytes) for st in plan.stages],
    )


def chain_timings(
    latencies: Sequence[float],
    out_bytes: Sequence[float],
    hosts: Sequence[frozenset[int]],
    cluster: ClusterSpec,
    *,
    backward_ratio: float = BACKWARD_RATIO,
    memory: Sequence[tuple[float, float]] | None = None,
) -> list[StageTiming]:
    """Timings of a chain of stages given each one's latency per micro-batch, the bytes it
    sends on, the hosts its devices are on and (optionally) its (memory, residual) bytes."""
    if not backward_ratio > 0:
        raise ValueError(f"backward_ratio: {backward_ratio!r} is invalid; expected > 0")
    n = len(latencies)

    def link_time(s: int, other: int, nbytes: float) -> float:
        if nbytes <= 0 or not 0 <= other < n:
            return 0.0
        if len(hosts[s]) == 1 and hosts[s] == hosts[other]:
            return cluster.intra_host.alpha + nbytes * cluster.intra_host.beta
        # Every sending host sends its own shards at once (runtime/instructions.py), so the
        # bytes share the links of the smaller side's hosts.
        lanes = max(min(len(hosts[s]), len(hosts[other])), 1)
        return cluster.inter_host.alpha + nbytes / lanes * cluster.inter_host.beta

    timings = []
    for s, latency in enumerate(latencies):
        fwd = latency / (1.0 + backward_ratio)
        mem, residual = memory[s] if memory is not None else (0.0, 0.0)
        timings.append(
            StageTiming(
                forward=fwd,
                backward=latency - fwd,
                send_forward=link_time(s, s + 1, out_bytes[s]),
                # the cotangents of this stage's inputs are the size of what it received
                send_backward=link_time(s, s - 1, out_bytes[s - 1] if s > 0 else 0.0),
                memory=mem,
                residual=residual,
            )
        )
    return timings


def simulate_plan(
    plan: PipeshardPlan,
    cluster: ClusterSpec,
    *,
    backward_ratio: float = BACKWARD_RATIO,
    transfers: bool = True,
) -> Simulation:
    """Simulate ``plan`` under its own schedule and micro-batch count on ``cluster``."""
    schedule = make_schedule(plan.schedule, plan.num_stages, plan.num_micro_batches)
    timings = stage_timings(plan, cluster, backward_ratio=backward_ratio, transfers=transfers)
    return simulate(timings, schedule)
