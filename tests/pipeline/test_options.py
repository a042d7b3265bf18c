"""Options accept only what they use: choices from their ``Literal`` types, one positive-int
check, one place for a pipeline's memory budget, and no ShardParallel field a stage ignores."""

from __future__ import annotations

import typing

import pytest

from alpa_mini import (
    AutoLayerOption,
    AutoStageOption,
    ConfigError,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.options import pipeshard, shard
from alpa_mini.pipeline.schedules import SCHEDULES, ScheduleName


def test_choice_sets_are_the_literal_types() -> None:
    want = ("auto", "data", "zero2", "zero3", "megatron")
    assert shard.LAYOUTS == typing.get_args(shard.Layout) == want
    assert typing.get_args(pipeshard.LogicalShapeSpace) == pipeshard.LOGICAL_SHAPE_SPACES
    assert SCHEDULES == typing.get_args(ScheduleName) == ("gpipe", "1f1b")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: ShardParallel(layout="zero4"), r"layout: 'zero4' is not one of 'auto', 'data'"),
        (lambda: ShardParallel(backend="gurobi"), r"backend: 'gurobi' is not one of 'auto'"),
        (lambda: AutoStageOption(submesh_space="any"), r"AutoStageOption.submesh_space: 'any'"),
        (lambda: UniformStageOption(2, profiling="x"), r"UniformStageOption.profiling: 'x' is not"),
        (lambda: PipeshardParallel(gradient_sync="now"), r"gradient_sync: 'now' is not one of"),
        (lambda: AutoLayerOption(0), r"AutoLayerOption.layer_num: 0 is invalid; expected an int"),
        (lambda: PipeshardParallel(num_micro_batches=True), r"num_micro_batches: True is invalid"),
        (lambda: PipeshardParallel(memory_budget=-1.0), r"PipeshardParallel.memory_budget: -1.0"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_valid(make, match) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_the_pipeline_budget_has_one_place() -> None:
    with pytest.raises(ConfigError, match=r"PipeshardParallel\(memory_budget=\.\.\.\)"):
        AutoStageOption(memory_budget=2**30)
    with pytest.raises(ConfigError, match=r"default_auto_sharding_option.memory_budget: "):
        PipeshardParallel(default_auto_sharding_option=ShardParallel(memory_budget=2**30))
    assert PipeshardParallel(memory_budget=2**30).memory_budget == 2**30


@pytest.mark.parametrize(
    "field", [{"mesh_shape": (8,)}, {"num_micro_batches": 4}, {"replicate_outputs": True}]
)
def test_stage_sharding_options_refuse_fields_stages_ignore(field) -> None:
    (name,) = field
    with pytest.raises(ConfigError, match=rf"default_auto_sharding_option.{name}: .* not used"):
        PipeshardParallel(default_auto_sharding_option=ShardParallel(**field))
    used = ShardParallel(layout="zero3", backend="cbc", time_limit=5.0, batch_axis=0)
    assert PipeshardParallel(default_auto_sharding_option=used).default_auto_sharding_option == used


@pytest.mark.parametrize(
    ("stages", "cluster", "submesh"),
    [(1, "cpu-1x8", (1, 8)), (2, "cpu-1x8", (1, 4)), (8, "cpu-1x8", (1, 1)),
     (2, "cpu-2x4", (1, 4)), (4, "cpu-2x4", (1, 2)), (1, "cpu-2x4", (2, 4))],
)  # fmt: skip
def test_uniform_stages_divide_every_device_evenly_by_default(stages, cluster, submesh) -> None:
    from alpa_mini import ClusterSpec
    from alpa_mini.pipeline.stage_search import even_submesh

    assert UniformStageOption(stages).submesh_shape is None
    assert even_submesh(stages, ClusterSpec.named(cluster)) == submesh


def test_an_uneven_default_split_names_the_stage_count() -> None:
    from alpa_mini import ClusterSpec
    from alpa_mini.pipeline.stage_search import even_submesh

    with pytest.raises(ConfigError, match=r"num_stages: 3 stages cannot divide cluster cpu-1x8"):
        even_submesh(3, ClusterSpec.named("cpu-1x8"))


def test_submesh_spaces_name_the_host_counts_they_search() -> None:
    """192 hosts of 8: powers of two up to 128, and with "divisors" (the default) every host
    count dividing 192, so Megatron-LM's 8 stages of 24 hosts are in reach."""
    from alpa_mini.pipeline.stage_configs import _allowed_submeshes
    from alpa_mini.solvers.stages import submesh_shapes

    shapes = submesh_shapes(192, 8)

    def hosts(space: str) -> list[int]:
        allowed = _allowed_submeshes(shapes, space)
        return sorted({h for (h, d), ok in zip(shapes, allowed, strict=True) if ok and d == 8})

    assert AutoStageOption().submesh_space == "divisors"
    assert hosts("power_of_two") == [1, 2, 4, 8, 16, 32, 64, 128]
    assert hosts("divisors") == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192]
    assert hosts("all") == list(range(1, 193))
    assert hosts("one_host") == [1]
    # a power-of-two cluster: the same space either way
    small = submesh_shapes(8, 8)
    assert _allowed_submeshes(small, "divisors") == _allowed_submeshes(small, "power_of_two")
