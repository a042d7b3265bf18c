"""``PipeshardPlan``: the frozen, JSON-round-trippable result of two-level planning.

It records every stage (layer range, equation range, submesh, device indices, logical mesh,
the layouts of the values crossing its edges, predicted latency and memory), the schedule,
the number of micro-batches, the predicted iteration time and, for auto stages, the stage
DP's cost table and solution. ``PipeshardParallel(plan=...)`` replays it without planning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..cluster.spec import ClusterSpec
from ..graph.planning_stats import PlanningStats
from ..shard.spec import ShardingSpec
from ..solvers.stages import StageProblem, StageSolution, stage_objective

if TYPE_CHECKING:
    from .simulate import Simulation

__all__ = ["PipeshardPlan", "ScanSplit", "StagePlan"]


def _spec_list(specs: tuple[ShardingSpec | None, ...]) -> list[Any]:
    return [None if s is None else s.to_list() for s in specs]


def _spec_tuple(data: list[Any]) -> tuple[ShardingSpec | None, ...]:
    return tuple(None if s is None else ShardingSpec.from_list(s) for s in data)


@dataclass(frozen=True)
class StagePlan:
    layer_start: int
    layer_end: int  # inclusive
    eqn_start: int
    eqn_end: int
    submesh: tuple[int, int]
    devices: tuple[int, ...]
    logical_shape: tuple[int, ...]
    latency: float
    peak_memory: float
    in_specs: tuple[ShardingSpec | None, ...]
    out_specs: tuple[ShardingSpec | None, ...]
    inner_specs: tuple[tuple[int, int, ShardingSpec], ...] = ()  # (equation, result, spec)
    out_bytes: float = 0.0  # bytes per micro-batch of its results that later stages read
    residual_bytes: float = 0.0  # bytes per device held per micro-batch in flight

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": [self.layer_start, self.layer_end],
            "equations": [self.eqn_start, self.eqn_end],
            "submesh": list(self.submesh),
            "devices": list(self.devices),
            "logical_shape": list(self.logical_shape),
            "latency": self.latency,
            "peak_memory": self.peak_memory,
            "in_specs": _spec_list(self.in_specs),
            "out_specs": _spec_list(self.out_specs),
            "inner_specs": [[e, o, spec.to_list()] for e, o, spec in self.inner_specs],
            "out_bytes": self.out_bytes,
            "residual_bytes": self.residual_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StagePlan:
        return cls(
            layer_start=int(d["layers"][0]),
            layer_end=int(d["layers"][1]),
            eqn_start=int(d["equations"][0]),
            eqn_end=int(d["equations"][1]),
            submesh=(int(d["submesh"][0]), int(d["submesh"][1])),
            devices=tuple(int(x) for x in d["devices"]),
            logical_shape=tuple(int(x) for x in d["logical_shape"]),
            latency=float(d["latency"]),
            peak_memory=float(d["peak_memory"]),
            in_specs=_spec_tuple(d["in_specs"]),
            out_specs=_spec_tuple(d["out_specs"]),
            inner_specs=tuple(
                (int(e), int(o), ShardingSpec.from_list(spec))
                for e, o, spec in d.get("inner_specs", [])
            ),
            out_bytes=float(d.get("out_bytes", 0.0)),
            residual_bytes=float(d.get("residual_bytes", 0.0)),
        )


@dataclass(frozen=True)
class ScanSplit:
    """Loss equation ``eqn`` (a scan over stacked layers) run as sub-scans of ``lengths``
    iterations each, in array order (``graph.scan_split``)."""

    eqn: int
    lengths: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"eqn": self.eqn, "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScanSplit:
        return cls(int(d["eqn"]), tuple(int(n) for n in d["lengths"]))


@dataclass(frozen=True, eq=False)
class PipeshardPlan:
    stages: tuple[StagePlan, ...]
    layer_starts: tuple[int, ...]
    num_equations: int
    schedule: str
    num_micro_batches: int
    cluster: str
    stage_problem: StageProblem | None = None
    stage_solution: StageSolution | None = None
    planning: PlanningStats | None = None
    #: The cluster it was planned for, so that the plan can be simulated on its own (plans
    #: saved before this field name only ``cluster``).
    cluster_spec: ClusterSpec | None = None
    #: The flop balance ``AutoLayerOption`` clustered layers within (None: markers).
    layer_eps: float | None = None
    #: Scans over stacked layers run as sub-scans, so that layers may cut between their
    #: iterations (``graph.scan_split``); equation indices are the traced loss's, and
    #: ``num_equations`` counts the loss after the split.
    scan_splits: tuple[ScanSplit, ...] = ()

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_layers(self) -> int:
        return len(self.layer_starts)

    @property
    def predicted_time(self) -> float:
        """sum(t) + (B - 1) max(t): the pipeline's predicted iteration time (seconds)."""
        return stage_objective([s.latency for s in self.stages], self.num_micro_batches)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PipeshardPlan) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "alpa_mini.PipeshardPlan/1",
            "cluster": self.cluster,
            "schedule": self.schedule,
            "num_micro_batches": self.num_micro_batches,
            "layer_starts": list(self.layer_starts),
            "layer_eps": self.layer_eps,
            "num_equations": self.num_equations,
            "scan_splits": [s.to_dict() for s in self.scan_splits],
            "stages": [s.to_dict() for s in self.stages],
            "stage_problem": None if self.stage_problem is None else self.stage_problem.to_dict(),
            "stage_solution": None
            if self.stage_solution is None
            else self.stage_solution.to_dict(),
            "planning": None if self.planning is None else self.planning.to_dict(),
            "cluster_spec": None if self.cluster_spec is None else self.cluster_spec.to_dict(),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> PipeshardPlan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"plan: not valid JSON ({err})") from None
        if not isinstance(d, dict) or d.get("format") != "alpa_mini.PipeshardPlan/1":
            raise ValueError(
                "plan.format: expected 'alpa_mini.PipeshardPlan/1', got "
                f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}"
            )
        try:
            return cls(
                stages=tuple(StagePlan.from_dict(s) for s in d["stages"]),
                layer_starts=tuple(int(x) for x in d["layer_starts"]),
                num_equations=int(d["num_equations"]),
                schedule=str(d["schedule"]),
                num_micro_batches=int(d["num_micro_batches"]),
                cluster=str(d["cluster"]),
                stage_problem=None
                if d.get("stage_problem") is None
                else StageProblem.from_dict(d["stage_problem"]),
                stage_solution=None
                if d.get("stage_solution") is None
                else StageSolution.from_dict(d["stage_solution"]),
                planning=PlanningStats.from_dict(d.get("planning")),
                cluster_spec=None
                if d.get("cluster_spec") is None
                else ClusterSpec.from_dict(d["cluster_spec"]),
                layer_eps=None if d.get("layer_eps") is None else float(d["layer_eps"]),
                scan_splits=tuple(ScanSplit.from_dict(s) for s in d.get("scan_splits") or ()),
            )
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"plan: missing or malformed field {err}") from None

    def summary(self) -> Any:
        """A rich table of the stages and the predicted iteration time."""
        from rich.table import Table

        t = Table(
            title=f"Pipeshard plan: {self.num_stages} stages, {self.num_layers} layers, "
            f"{self.schedule}, B={self.num_micro_batches}, predicted "
            f"{self.predicted_time * 1e3:.3f} ms/iter"
            + ("" if self.layer_eps is None else f", layer flops within 1+{self.layer_eps:.3g}")
        )
        for col in (
            "stage",
            "layers",
            "submesh",
            "devices",
            "logical mesh",
            "latency ms",
            "peak MiB",
        ):
            t.add_column(col, justify="right")
        for k, s in enumerate(self.stages):
            t.add_row(
                str(k),
                f"{s.layer_start}..{s.layer_end}",
                f"{s.submesh[0]}x{s.submesh[1]}",
                ",".join(map(str, s.devices)),
                "x".join(map(str, s.logical_shape)),
                f"{s.latency * 1e3:.3f}",
                f"{s.peak_memory / 2**20:.2f}",
            )
        return t

    def to_records(self) -> list[dict[str, Any]]:
        """One flat row per stage (layers, submesh, devices, logical mesh, predicted latency
        and memory), for tables and dataframes."""
        return [
            {
                "stage": k,
                "first_layer": s.layer_start,
                "last_layer": s.layer_end,
                "submesh": f"{s.submesh[0]}x{s.submesh[1]}",
                "devices": ",".join(map(str, s.devices)),
                "logical_mesh": "x".join(map(str, s.logical_shape)),
                "latency_s": s.latency,
                "peak_memory_bytes": s.peak_memory,
                "residual_bytes": s.residual_bytes,
                "out_bytes": s.out_bytes,
            }
            for k, s in enumerate(self.stages)
        ]

    def to_dataframe(self) -> Any:
        """``to_records()`` as a pandas DataFrame indexed by stage."""
        try:
            import pandas as pd
        except ImportError:
            raise ImportError(
                "PipeshardPlan.to_dataframe needs pandas: pip install pandas"
            ) from None
        return pd.DataFrame.from_records(self.to_records(), index="stage")

    def timeline(
        self,
        path: str | Path,
        cluster: ClusterSpec | str | None = None,
        *,
        png: bool = True,
        transfers: bool = True,
    ) -> Simulation:
        """Simulate one iteration (``simulate_plan``) and write it as a Chrome trace to
        ``path``, one track per mesh, plus a Gantt chart beside it (same stem, .png), to see
        where the schedule's bubbles are before running anything.

        ``cluster``: a ``ClusterSpec``, a bundled name or a cluster YAML path; None: the
        cluster the plan was made for (stored in it; older plan files name a bundled one).
        """
        from ..errors import ConfigError
        from ..inspect.timeline import mesh_track_names, simulated_events, write_timeline
        from .simulate import simulate_plan

        if cluster is None and self.cluster_spec is not None:
            spec = self.cluster_spec
        elif cluster is None:
            try:
                spec = ClusterSpec.named(self.cluster)
            except ConfigError as err:
                raise ConfigError(
                    f"cluster: the plan file stores no cluster_spec and its cluster "
                    f"{self.cluster!r} is not a bundled one; pass cluster= a ClusterSpec or a "
                    f"bundled name ({err})"
                ) from None
        elif isinstance(cluster, ClusterSpec):
            spec = cluster
        elif isinstance(cluster, str):
            try:
                spec = ClusterSpec.load(cluster)
            except ConfigError as err:
                message = str(err)  # an unknown name already reads "cluster '...': ..."
                if not message.startswith("cluster"):
                    message = f"cluster {cluster!r}: {message}"
                raise ConfigError(message) from None
        else:
            raise ConfigError(
                f"cluster: expected a ClusterSpec, a cluster name or None, got {cluster!r}"
            )
        sim = simulate_plan(self, spec, transfers=transfers)
        events = simulated_events(sim)
        names = mesh_track_names(self)
        process = f"alpa_mini simulated ({spec.name})"
        title = (
            f"simulated {self.schedule}, {self.num_stages} stages, B={self.num_micro_batches}, "
            f"{sim.iteration_time * 1e3:.3f} ms/iter on {spec.name}"
        )
        write_timeline(path, events, names, title=title, process_name=process, png=png)
        return sim
