"""What the user asks for: ``ShardParallel`` and its presets, ``PipeshardParallel`` with its
layer and stage options. Small frozen dataclasses, validated on construction."""

from .pipeshard import (
    AutoLayerOption,
    AutoStageOption,
    ManualLayerOption,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
)
from .shard import DataParallel, ShardParallel, Zero2Parallel, Zero3Parallel

__all__ = [
    "AutoLayerOption",
    "AutoStageOption",
    "DataParallel",
    "ManualLayerOption",
    "ManualStageOption",
    "PipeshardParallel",
    "ShardParallel",
    "UniformStageOption",
    "Zero2Parallel",
    "Zero3Parallel",
]
