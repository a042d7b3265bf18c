"""alpa_mini: two-level auto-parallel planning for JAX.

Decorate a train step with ``@alpa_mini.parallelize(method=...)`` after ``alpa_mini.init()``;
``alpa_mini.plan`` returns the plan without compiling. Inspection helpers live in
``alpa_mini.inspect``, the planning algorithms in ``alpa_mini.solvers``, the model zoo in
``alpa_mini.models`` and cluster descriptions in ``alpa_mini.cluster``.

Names that need JAX load on first use (PEP 562), so ``import alpa_mini`` and the cluster
descriptions stay free of JAX and Ray.
"""

from ._lazy import lazy_exports
from .cluster.spec import ClusterSpec
from .cluster.spec import LogicalMesh as LogicalMesh  # kept importable; alpa_mini.cluster has it
from .errors import (
    ConfigError,
    InfeasibleError,
    MemoryBudgetError,
    SolverTimeLimitError,
    WorkerFailedError,
)

# public name -> module that defines it (imported on first use)
_LAZY = {
    "AutoLayerOption": "options.pipeshard",
    "AutoStageOption": "options.pipeshard",
    "DataParallel": "options.shard",
    "ManualLayerOption": "options.pipeshard",
    "ManualStageOption": "options.pipeshard",
    "PipeshardParallel": "options.pipeshard",
    "PipeshardPlan": "pipeline.plan",
    "ShardParallel": "options.shard",
    "ShardingPlan": "shard.plan",
    "UniformStageOption": "options.pipeshard",
    "Zero2Parallel": "options.shard",
    "Zero3Parallel": "options.shard",
    "current_cluster": "session.local",
    "gather": "session.gather",
    "restore_checkpoint": "session.checkpoint",
    "save_checkpoint": "session.checkpoint",
    "grad": "graph.micro_batch",
    "init": "session.local",
    "is_initialized": "session.local",
    "mark_pipeline_boundary": "graph.markers",
    "parallelize": "api",
    "plan": "api",
    "shutdown": "session.local",
    "value_and_grad": "graph.micro_batch",
}

# names alpa_mini exported before 0.2 -> where they live now
_MOVED = {
    **{
        name: f"alpa_mini.inspect.{name}"
        for name in (
            "Alternative",
            "CollectiveReport",
            "Explanation",
            "Schedule",
            "Simulation",
            "StageTiming",
            "TraceEvent",
            "bubble_fraction",
            "make_schedule",
            "measured_events",
            "plot_timeline",
            "simulate",
            "simulate_plan",
            "simulated_events",
            "write_chrome_trace",
            "write_timeline",
        )
    },
    **{
        name: f"alpa_mini.solvers.{name}"
        for name in (
            "Evaluation",
            "LayerClustering",
            "LayerCountSearch",
            "SolverInputError",
            "Stage",
            "ShardingProblem",
            "ShardingSolution",
            "StageProblem",
            "StageSolution",
            "cluster_layers",
            "evaluate",
            "load_iopddl",
            "save_iopddl",
            "search_num_layers",
            "solve_sharding",
            "solve_stages",
        )
    },
    "ModelSpec": "alpa_mini.models.ModelSpec",
    "available_models": "alpa_mini.models.available_models",
    "available_clusters": "alpa_mini.cluster.available_clusters",
    "ProfileDB": "alpa_mini.cluster.ProfileDB",
    "profile_devices": "alpa_mini.cluster.profile_devices",
    "CostModel": "alpa_mini.shard.CostModel",
    "ShardingSpec": "alpa_mini.shard.ShardingSpec",
    "OpGraph": "alpa_mini.graph.OpGraph",
    "ParallelizedFunction": "alpa_mini.api.ParallelizedFunction",
    "Executable": "alpa_mini.shard.Executable",
    "PipeshardExecutable": "alpa_mini.pipeline.PipeshardExecutable",
    "ray_session": "alpa_mini.session.ray_session",
}

__all__ = [  # noqa: RUF022  (grouped: entry points, methods and options, plans, session, errors)
    "parallelize",
    "plan",
    "grad",
    "value_and_grad",
    "mark_pipeline_boundary",
    "gather",
    "save_checkpoint",
    "restore_checkpoint",
    "ShardParallel",
    "DataParallel",
    "Zero2Parallel",
    "Zero3Parallel",
    "PipeshardParallel",
    "AutoLayerOption",
    "ManualLayerOption",
    "AutoStageOption",
    "UniformStageOption",
    "ManualStageOption",
    "ShardingPlan",
    "PipeshardPlan",
    "ClusterSpec",
    "init",
    "shutdown",
    "is_initialized",
    "current_cluster",
    "ConfigError",
    "InfeasibleError",
    "MemoryBudgetError",
    "SolverTimeLimitError",
    "WorkerFailedError",
]

_SUBPACKAGES = (
    "cluster",
    "graph",
    "inspect",
    "models",
    "options",
    "pipeline",
    "session",
    "shard",
)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, _MOVED, _SUBPACKAGES)
