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

from .._validate import Fields, check_int, check_list
from ..cluster.spec import ClusterSpec
from ..errors import ConfigError
from ..graph.planning_stats import PlanningStats
from ..shard.spec import ShardingSpec
from ..solvers.stages import StageProblem, StageSolution, stage_objective
from .schedules import SCHEDULES

if TYPE_CHECKING:
    from .simulate import Simulation

__all__ = ["PipeshardPlan", "RowSplit", "ScanSplit", "StagePlan"]


def _spec_list(specs: tuple[ShardingSpec | None, ...]) -> list[Any]:
    return [None if s is None else s.to_list() for s in specs]


def _spec_tuple(where: str, data: Any) -> tuple[ShardingSpec | None, ...]:
    return tuple(
        None if spec is None else _spec(f"{where}[{i}]", spec)
        for i, spec in enumerate(check_list(where, data))
    )


def _spec(where: str, data: Any) -> ShardingSpec:
    """A ``ShardingSpec`` from its saved form: per tensor dimension, the mesh axes (ints)."""
    dims = [
        tuple(
            check_int(f"{where}[{d}][{k}]", a, low=0)
            for k, a in enumerate(check_list(f"{where}[{d}]", axes))
        )
        for d, axes in enumerate(check_list(where, data))
    ]
    try:
        return ShardingSpec(tuple(dims))
    except ValueError as err:
        raise ConfigError(f"{where}: {data!r} uses a mesh axis twice ({err})") from None


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
    def from_dict(cls, d: Any, where: str = "stage") -> StagePlan:
        """Read a saved stage; each malformed field is a ``ConfigError`` naming it."""
        f = Fields(d, where)
        layers = f.ints("layers", length=2, low=0)
        equations = f.ints("equations", length=2, low=0)
        inner = []
        for i, item in enumerate(f.list("inner_specs", default=[])):
            at = f"{where}.inner_specs[{i}]"
            e, o, spec = check_list(at, item, length=3)
            inner.append((check_int(f"{at}[0]", e, low=0), check_int(f"{at}[1]", o, low=0),
                          _spec(f"{at}[2]", spec)))  # fmt: skip
        return cls(
            layer_start=layers[0],
            layer_end=layers[1],
            eqn_start=equations[0],
            eqn_end=equations[1],
            submesh=f.ints("submesh", length=2, low=1),  # type: ignore[arg-type]
            devices=f.ints("devices", low=0),
            logical_shape=f.ints("logical_shape", low=1),
            latency=f.number("latency", low=0.0),
            peak_memory=f.number("peak_memory", low=0.0),
            in_specs=_spec_tuple(f"{where}.in_specs", f.list("in_specs")),
            out_specs=_spec_tuple(f"{where}.out_specs", f.list("out_specs")),
            inner_specs=tuple(inner),
            out_bytes=f.number("out_bytes", low=0.0, default=0.0),
            residual_bytes=f.number("residual_bytes", low=0.0, default=0.0),
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
    def from_dict(cls, d: Any, where: str = "scan_split") -> ScanSplit:
        f = Fields(d, where)
        return cls(f.int("eqn", low=0), f.ints("lengths", low=1))


@dataclass(frozen=True)
class RowSplit:
    """Loss input ``input`` (a stack a loop reads row by row) held as row pieces of
    ``lengths``, each its own parameter (``graph.scan_split.row_sliced_inputs``)."""

    input: int
    lengths: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input, "lengths": list(self.lengths)}

    @classmethod
    def from_dict(cls, d: Any, where: str = "row_split") -> RowSplit:
        f = Fields(d, where)
        return cls(f.int("input", low=0), f.ints("lengths", low=1))


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
    #: Stacks read row by row split into row pieces (plans saved before this field split
    #: none); loss input indices are the traced loss's.
    row_splits: tuple[RowSplit, ...] = ()

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
            "row_splits": [s.to_dict() for s in self.row_splits],
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
            raise ConfigError(f"plan: not valid JSON ({err})") from None
        if not isinstance(d, dict) or d.get("format") != "alpa_mini.PipeshardPlan/1":
            raise ConfigError(
                "plan.format: expected 'alpa_mini.PipeshardPlan/1', got "
                f"{d.get('format') if isinstance(d, dict) else type(d).__name__!r}"
            )
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipeshardPlan:
        """Read a saved plan: every field typed and in range as a file can say (``check_plan``
        checks it against a cluster and a step); a malformed one is a ``ConfigError`` naming
        its path, its value and what is valid."""
        f = Fields(d, "plan")
        stages = f.list("stages")
        if not stages:
            raise ConfigError("plan.stages: empty; a plan has at least one stage")
        splits = f.list("scan_splits", default=None) or []
        rows = f.list("row_splits", default=None) or []
        try:
            return cls(
                stages=tuple(
                    StagePlan.from_dict(s, f"plan.stages[{i}]") for i, s in enumerate(stages)
                ),
                layer_starts=f.ints("layer_starts", low=0),
                num_equations=f.int("num_equations", low=1),
                schedule=f.text("schedule", SCHEDULES),
                num_micro_batches=f.int("num_micro_batches", low=1),
                cluster=f.text("cluster"),
                stage_problem=_record(d, "stage_problem", StageProblem.from_dict),
                stage_solution=_record(d, "stage_solution", StageSolution.from_dict),
                planning=_record(d, "planning", PlanningStats.from_dict),
                cluster_spec=_record(d, "cluster_spec", ClusterSpec.from_dict),
                layer_eps=None if d.get("layer_eps") is None else f.number("layer_eps", low=0.0),
                scan_splits=tuple(
                    ScanSplit.from_dict(s, f"plan.scan_splits[{i}]") for i, s in enumerate(splits)
                ),
                row_splits=tuple(
                    RowSplit.from_dict(s, f"plan.row_splits[{i}]") for i, s in enumerate(rows)
                ),
            )
        except ConfigError:
            raise
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise ConfigError(f"plan: malformed record ({type(err).__name__}: {err})") from None

    def summary(self) -> Any:
        """A rich table of the stages and the predicted iteration time; with several stages
        on a known cluster, also the simulated one, which adds the transfers between stages
        (what the micro-batch search ranks counts by)."""
        from rich.table import Table

        from .simulate import simulate_plan

        simulated = ""
        if self.num_stages > 1 and self.cluster_spec is not None:
            seconds = simulate_plan(self, self.cluster_spec).iteration_time
            simulated = f" ({seconds * 1e3:.3f} simulated with transfers)"
        t = Table(
            title=f"Pipeshard plan: {self.num_stages} stages, {self.num_layers} layers, "
            f"{self.schedule}, B={self.num_micro_batches}, predicted "
            f"{self.predicted_time * 1e3:.3f} ms/iter{simulated}"
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


def _record(d: dict[str, Any], key: str, parse: Any) -> Any:
    """An informational record of a saved plan (the stage DP's table and solution, planning
    times, the cluster): parsed, and refused by name unless it reads back as saved, so that
    nothing in a plan file is coerced or dropped silently."""
    raw = d.get(key)
    if raw is None:
        return None
    try:
        value = parse(raw)
        canon = json.loads(json.dumps(value.to_dict()))
    except ConfigError as err:  # named inside the record: name it inside the plan
        head, _, rest = str(err).partition(":")
        inner = head.partition(".")[2]
        raise ConfigError(f"plan.{key}{'.' + inner if inner else ''}:{rest}") from None
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as err:
        raise ConfigError(f"plan.{key}: malformed ({type(err).__name__}: {err})") from None
    where = _first_difference(raw, canon, f"plan.{key}")
    if where is not None:
        raise ConfigError(
            f"{where}: not read back as saved (a value of the wrong type, out of range or not "
            "finite)"
        )
    return value


def _first_difference(raw: Any, canon: Any, where: str) -> str | None:
    """The path of the first value of ``raw`` that its parsed form does not reproduce; keys
    the parsed form does not write (older formats) are not compared."""
    if isinstance(canon, dict):
        if not isinstance(raw, dict):
            return where
        for key, value in canon.items():
            if key in raw:
                found = _first_difference(raw[key], value, f"{where}.{key}")
                if found is not None:
                    return found
        return None
    if isinstance(canon, list):
        if not isinstance(raw, list) or len(raw) != len(canon):
            return where
        for i, (a, b) in enumerate(zip(raw, canon, strict=True)):
            found = _first_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(canon, bool) or isinstance(raw, bool):
        return None if raw is canon else where
    if isinstance(canon, int | float) and isinstance(raw, int | float):
        return None if raw == canon else where
    return None if raw == canon else where
