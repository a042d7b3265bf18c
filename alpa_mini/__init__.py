"""alpa_mini: two-level auto-parallel planning for JAX.

Decorate a train step with ``@alpa_mini.parallelize(method=...)`` after ``alpa_mini.init()``;
the planning algorithms (everything ``alpa_mini.solvers`` exports) are public too.

Names that need JAX load on first use (PEP 562), so ``import alpa_mini.solvers`` and the
cluster descriptions stay free of JAX and Ray.
"""

from importlib import import_module
from typing import Any

from . import solvers as _solvers
from .cluster import ClusterSpec, ConfigError, LogicalMesh, available_clusters
from .solvers import *  # noqa: F403  (the explicit list is solvers.__all__)

# public name -> module that defines it (imported lazily)
_LAZY = {
    "Alternative": "plan",
    "AutoLayerOption": "pipeshard_method",
    "AutoStageOption": "pipeshard_method",
    "CollectiveReport": "executable",
    "CostModel": "cost_model",
    "DataParallel": "parallel_method",
    "Executable": "executable",
    "Explanation": "plan_explain",
    "ManualLayerOption": "pipeshard_method",
    "ManualStageOption": "pipeshard_method",
    "MemoryBudgetError": "auto_sharding",
    "WorkerFailedError": "ray_setup",
    "ModelSpec": "model_specs",
    "OpGraph": "op_graph",
    "ParallelizedFunction": "api",
    "PipeshardExecutable": "pipeshard_executable",
    "PipeshardParallel": "pipeshard_method",
    "PipeshardPlan": "pipeshard_plan",
    "ProfileDB": "profile_db",
    "Schedule": "schedules",
    "Simulation": "pipeline_sim",
    "StageTiming": "pipeline_sim",
    "TraceEvent": "runtime.trace",
    "ShardParallel": "parallel_method",
    "ShardingPlan": "plan",
    "ShardingSpec": "sharding_spec",
    "UniformStageOption": "pipeshard_method",
    "Zero2Parallel": "parallel_method",
    "Zero3Parallel": "parallel_method",
    "available_models": "model_specs",
    "bubble_fraction": "timeline",
    "current_cluster": "device_setup",
    "grad": "micro_batch",
    "init": "device_setup",
    "is_initialized": "device_setup",
    "make_schedule": "schedules",
    "mark_pipeline_boundary": "pipeline_marker",
    "measured_events": "runtime.trace",
    "parallelize": "api",
    "plot_timeline": "timeline",
    "profile_devices": "profiling",
    "ray_session": "device_setup",
    "shutdown": "device_setup",
    "simulate": "pipeline_sim",
    "simulate_plan": "pipeline_sim",
    "simulated_events": "timeline",
    "value_and_grad": "micro_batch",
    "write_chrome_trace": "runtime.trace",
    "write_timeline": "timeline",
}

__all__ = [  # noqa: F405  (lazy names resolve through __getattr__)
    "Alternative",
    "AutoLayerOption",
    "AutoStageOption",
    "ClusterSpec",
    "CollectiveReport",
    "ConfigError",
    "CostModel",
    "DataParallel",
    "Executable",
    "Explanation",
    "LogicalMesh",
    "ManualLayerOption",
    "ManualStageOption",
    "MemoryBudgetError",
    "WorkerFailedError",
    "ModelSpec",
    "OpGraph",
    "ParallelizedFunction",
    "PipeshardExecutable",
    "PipeshardParallel",
    "PipeshardPlan",
    "ProfileDB",
    "Schedule",
    "ShardParallel",
    "ShardingPlan",
    "ShardingSpec",
    "Simulation",
    "StageTiming",
    "TraceEvent",
    "UniformStageOption",
    "Zero2Parallel",
    "Zero3Parallel",
    "available_clusters",
    "available_models",
    "bubble_fraction",
    "current_cluster",
    "grad",
    "init",
    "is_initialized",
    "make_schedule",
    "mark_pipeline_boundary",
    "measured_events",
    "parallelize",
    "plot_timeline",
    "profile_devices",
    "ray_session",
    "shutdown",
    "simulate",
    "simulate_plan",
    "simulated_events",
    "value_and_grad",
    "write_chrome_trace",
    "write_timeline",
    *_solvers.__all__,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'alpa_mini' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
