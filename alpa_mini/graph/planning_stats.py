"""``PlanningStats``: where one planning run spent its time and how much ILP work it did.

Both plans carry one (``ShardingPlan.planning``, ``PipeshardPlan.planning``), so benchmarks
and users read the phases from the plan instead of timing the planner from outside.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .._validate import check_int, check_number

__all__ = ["PlanningStats"]


@dataclass(frozen=True)
class PlanningStats:
    """Seconds per planning phase and ILP counts. ``trace_seconds``: tracing the step to a
    jaxpr; ``graph_seconds``: jaxpr -> op graphs; ``ilp_seconds``: building and solving the
    sharding ILPs (summed over threads, so it may exceed the wall time); ``dp_seconds``: the
    stage DP (0 for ShardParallel); ``total_seconds``: wall time of the whole planning call.
    ``ilps_unproven``: free stage MIPs stopped at the time limit before proving optimality;
    ``restricted_wins``: how many of those a restricted (ZeRO-3 or Megatron) plan replaced.
    ``ilps_bounded``: layer MIPs whose LP relaxation was fractional and that the stage DP
    never needed exactly, so they were never branched on (their cells hold the LP bound).
    ``micro_batches_tried``: with a searched micro-batch count, each count planned and its
    predicted iteration seconds (None: nothing fit), in the order planned;
    ``micro_batches_dominated``: the counts whose planning stopped once a lower bound on their
    seconds (given) exceeded a faster count's. ``total_seconds`` then covers the whole
    search, the other fields the chosen count's planning. ``refine_seconds``: the default
    whole-stage refinement of the chosen stages (``pipeline.refine``), of which
    ``stages_refined`` took their whole-stage plan."""

    trace_seconds: float = 0.0
    graph_seconds: float = 0.0
    ilp_seconds: float = 0.0
    dp_seconds: float = 0.0
    total_seconds: float = 0.0
    ilps_solved: int = 0
    ilps_unproven: int = 0
    restricted_wins: int = 0
    ilps_bounded: int = 0
    cost_entries: int = 0
    cache_hits: int = 0
    micro_batches_tried: tuple[tuple[int, float | None], ...] = ()
    micro_batches_dominated: tuple[tuple[int, float], ...] = ()
    refine_seconds: float = 0.0
    stages_refined: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(
        cls, data: dict[str, Any] | None, where: str = "planning"
    ) -> PlanningStats | None:
        """Read a saved record; unknown keys are ignored (older plans stored other fields)."""
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError(f"planning: expected a mapping or null, got {data!r}")
        known = {f.name: f.type for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "seconds" in data and "total_seconds" not in data:  # plans saved before this record
            values["total_seconds"] = data["seconds"]
        for k, v in values.items():
            if k in ("micro_batches_tried", "micro_batches_dominated"):
                values[k] = _tried(f"{where}.{k}", v, bounds=k.endswith("dominated"))
                continue
            check = check_int if known[k] in ("int", int) else check_number
            values[k] = check(f"{where}.{k}", v, low=0)
        return cls(**values)


def _tried(where: str, value: Any, *, bounds: bool) -> tuple[tuple[int, Any], ...]:
    """[count, seconds] pairs; seconds may be null (nothing fit) unless ``bounds``."""
    want = "[count, seconds]" if bounds else "[count, seconds or null]"
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: expected a list of {want}, got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if not isinstance(pair, list | tuple) or len(pair) != 2 or (bounds and pair[1] is None):
            raise ValueError(f"{where}[{i}]: expected {want}, got {pair!r}")
        b = check_int(f"{where}[{i}][0]", pair[0], low=1)
        t = None if pair[1] is None else check_number(f"{where}[{i}][1]", pair[1], low=0)
        out.append((b, t))
    return tuple(out)
