"""Baselines on cases with known answers: which parallelism wins where, which fits where."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError
from alpa_mini.models import adam, make_train_step
from benchmarks.baselines import megatron_configs, run_baseline, run_baselines
from helpers.mlp import marked_mlp_loss

OPT = adam(1e-3)


def _mlp_args(width: int, batch: int, layers: int = 4):
    """An abstract MLP train step: ``layers`` square ``width`` layers, one pipeline layer
    each, on ``batch`` rows."""

    params = [jax.ShapeDtypeStruct((width, width), jnp.float32)] * layers
    batch = {
        "x": jax.ShapeDtypeStruct((batch, width), jnp.float32),
        "y": jax.ShapeDtypeStruct((batch, width), jnp.float32),
    }
    step = make_train_step(marked_mlp_loss, OPT, alpa_mini.value_and_grad)
    return step, (params, jax.eval_shape(OPT.init, params), batch)


CLUSTER = ClusterSpec.named("cpu-1x8").with_hosts(1)
FOUR = dataclasses.replace(CLUSTER, devices_per_host=4)


def test_megatron_grid_is_every_valid_dp_tp_pp_and_micro_batch_count():
    got = {
        (c["dp"], c["tp"], c["pp"], c["micro_batches"])
        for c in megatron_configs(8, 4, num_layers=4, batch_size=16, micro_batches=(1, 2, 16))
    }
    want = set()
    for pp, tps in ((1, (1, 2, 4)), (2, (1, 2, 4)), (4, (1, 2))):  # pp 8 > 4 layers
        for tp in tps:
            dp = 8 // pp // tp
            for b in (1, 2, 16):
                if 16 % b == 0 and (16 // b) % dp == 0:
                    want.add((dp, tp, pp, b))
    assert got == want
    assert (8, 1, 1, 16) not in got  # a micro-batch of 1 row cannot split over dp 8


def test_big_batch_small_weights_data_parallel_wins():
    """64x64 weights, 4096 rows: data parallel all-reduces 16 KiB of gradient per layer,
    tensor parallel 1 MiB of activations per layer: the grid picks pure dp."""
    step, args = _mlp_args(width=64, batch=4096)
    best = run_baseline(
        "strong-grid", step, args, FOUR, num_layers=4, batch_size=4096, micro_batches=(1,)
    )
    assert best.config == {"dp": 4, "tp": 1, "pp": 1, "micro_batches": 1}
    dp = run_baseline(
        "data-parallel", step, args, FOUR, num_layers=4, batch_size=4096, micro_batches=(1,)
    )
    assert dp.iteration_time == pytest.approx(best.iteration_time, rel=1e-6)


def test_tiny_batch_wide_weights_tensor_parallel_wins():
    """1024x1024 weights, 8 rows: the gradient all-reduce (4 MiB per layer) dwarfs the
    activations (32 KiB), so the grid's best splits the weights, not the batch."""
    step, args = _mlp_args(width=1024, batch=8)
    best = run_baseline(
        "strong-grid", step, args, FOUR, num_layers=4, batch_size=8, micro_batches=(1,)
    )
    dp = run_baseline(
        "data-parallel", step, args, FOUR, num_layers=4, batch_size=8, micro_batches=(1,)
    )
    assert best.config["tp"] > 1
    assert best.iteration_time < 0.9 * dp.iteration_time


def test_what_does_not_fit_is_reported_with_the_reason():
    """4 layers of 1024x1024 fp32: 16 MiB of weights, 16 of gradients, 32 of Adam state. With
    40 MiB per device, replicated data parallel (64 MiB) cannot fit; ZeRO-3 on 4 devices
    (a quarter of each) can."""
    small = dataclasses.replace(
        FOUR, device=dataclasses.replace(FOUR.device, memory_bytes=40 * 2**20)
    )
    step, args = _mlp_args(width=1024, batch=64)
    results = {
        r.name: r
        for r in run_baselines(
            step,
            args,
            small,
            num_layers=4,
            batch_size=64,
            names=("data-parallel", "zero-3"),
            micro_batches=(1,),
        )
    }
    dp, z3 = results["data-parallel"], results["zero-3"]
    assert not dp.feasible and math.isinf(dp.iteration_time)
    assert dp.infeasible == dp.tried == 1 and "memory_budget" in dp.reason
    assert z3.feasible and z3.peak_memory <= 40 * 2**20


def test_unknown_baseline_is_named():
    step, args = _mlp_args(width=64, batch=64)
    with pytest.raises(ConfigError, match=r"baseline: 'fsdp' is not one of data-parallel"):
        run_baseline("fsdp", step, args, FOUR, num_layers=4, batch_size=64)


def test_gradient_sync_is_priced_after_the_solve_or_inside_it():
    """Data parallel of wide layers (4 layers of 1024x1024, 8 rows, 4 devices): each
    replicated parameter's gradient needs a sync, priced either way; inside the ILP
    ("ilp") the free ILP then prefers splitting the weights, which is cheaper."""
    import alpa_mini

    def latency(layout, sync, micro_batches=1):
        step, args = _mlp_args(width=1024, batch=8 * micro_batches)
        method = alpa_mini.PipeshardParallel(
            num_micro_batches=micro_batches,
            stage_option=alpa_mini.UniformStageOption(1, (1, 4)),
            default_auto_sharding_option=alpa_mini.ShardParallel(layout=layout),
            gradient_sync=sync,
        )
        return alpa_mini.plan(step, *args, method=method, cluster=FOUR).stages[0].latency

    data_after, data_ilp = latency("data", "after"), latency("data", "ilp")
    free_after, free_ilp = latency("auto", "after"), latency("auto", "ilp")
    # 4 MiB of gradient per layer to all-reduce (or all-gather) on 4 devices: milliseconds
    assert data_after > free_ilp and data_ilp > free_ilp
    assert free_ilp < free_after  # seeing the sync, the ILP avoids most of it
    # The sync runs once per step, so a micro-batch pays 1/B of it, priced inside the ILP
    # ("ilp") exactly as after it: with layouts pinned both see the same plan.
    data4_after, data4_ilp = latency("data", "after", 4), latency("data", "ilp", 4)
    assert data4_ilp == pytest.approx(data4_after, rel=1e-9)
    assert data4_after < data_after


def test_uniform_individual_profiling_composes_the_layer_costs():
    """Data-parallel layouts hand every activation on batch-split, so no resharding happens
    between layers: a 2-layer composed stage costs exactly the sum of its two one-layer
    stages in latency, less the host-to-device load each of those paid for the activation
    handed between them (forward, and its cotangent back), which is the whole stage's
    latency; residual bytes add up; its memory is the held-plus-largest-transient closed
    form, an upper bound on the whole stage's ILP peak."""
    import alpa_mini

    step, args = _mlp_args(width=64, batch=64)

    def stages(num, profiling):
        method = alpa_mini.PipeshardParallel(
            num_micro_batches=1,
            stage_option=alpa_mini.UniformStageOption(num, (1, 1), profiling=profiling),
            default_auto_sharding_option=alpa_mini.ShardParallel(layout="data"),
        )
        return alpa_mini.plan(step, *args, method=method, cluster=CLUSTER).stages

    layers = stages(4, "whole")
    pairs = stages(2, "individual")
    whole_pairs = stages(2, "whole")
    weights = 64 * 64 * 4  # one replicated fp32 weight per layer (data-parallel layouts)
    for s, stage in enumerate(pairs):
        a, b = layers[2 * s], layers[2 * s + 1]
        assert (stage.layer_start, stage.layer_end) == (2 * s, 2 * s + 1)
        handed = 2 * 64 * 64 * 4 / CLUSTER.intra_host.bandwidth  # (64, 64) fp32, both ways
        assert stage.latency == pytest.approx(a.latency + b.latency - handed, rel=1e-9)
        assert stage.latency == pytest.approx(whole_pairs[s].latency, rel=1e-9)
        assert stage.residual_bytes == pytest.approx(a.residual_bytes + b.residual_bytes)
        # Memory: each layer holds its weight, its gradient and its residuals while the other
        # runs; the larger transient (peak - held) counts once. A plan's stage peak also
        # counts the stage's Adam state (two weight-sized moments per layer), added after.
        state = 2 * weights
        held = [2 * weights + x.residual_bytes for x in (a, b)]
        transient = max(x.peak_memory - state - h for x, h in zip((a, b), held, strict=True))
        assert stage.peak_memory == pytest.approx(sum(held) + transient + 2 * state, abs=16)
        # ... which bounds the whole stage's own peak, below the plain sum of the two peaks.
        whole = whole_pairs[s].peak_memory
        assert whole <= stage.peak_memory * (1 + 1e-9) < a.peak_memory + b.peak_memory


def test_uniform_profiling_is_checked():
    with pytest.raises(ConfigError, match=r"UniformStageOption.profiling: 'exact' is not"):
        alpa_mini.UniformStageOption(2, profiling="exact")


@pytest.mark.parametrize(
    ("width", "batch"),
    [(64, 4096), pytest.param(1024, 8, marks=pytest.mark.slow)],  # 5 s each: one is fast
)
def test_screened_grid_finds_the_exhaustive_best(width, batch):
    """Screening with composed stages and re-planning the best two whole finds the plan the
    exhaustive whole-stage search finds (or a faster composed one), on both known cases."""
    step, args = _mlp_args(width=width, batch=batch)
    kw = dict(num_layers=4, batch_size=batch, micro_batches=(1, 2))
    full = run_baseline("strong-grid", step, args, FOUR, **kw)
    screened = run_baseline("strong-grid", step, args, FOUR, refine_top=2, **kw)
    assert screened.tried == full.tried
    assert screened.iteration_time <= full.iteration_time * (1 + 1e-9)
    assert screened.config["tp"] == full.config["tp"]


def test_refine_top_is_checked():
    step, args = _mlp_args(width=64, batch=64)
    with pytest.raises(ConfigError, match=r"refine_top: 0 is not None or a positive integer"):
        run_baseline("strong-grid", step, args, FOUR, num_layers=4, batch_size=64, refine_top=0)


@pytest.mark.slow  # 6 s: full suite
def test_unproven_free_stage_ilp_falls_back_to_restricted_layouts(monkeypatch):
    """When the free stage MIP stops unproven, the stage planner also solves two restricted
    MIPs inside the free space, ZeRO-3's pinned layouts and Megatron's (batch split on the
    mesh's first axis, the rest free), and keeps the fastest plan. Here the free plan is made
    100x slower and marked "feasible": the stage must come out exactly as the better of the
    two presets plans it, after three ILPs."""
    import alpa_mini
    from alpa_mini.pipeline import stage_cost

    real = stage_cost.plan_sharding

    def unproven_free(graph, cost, axis_names, *, input_filters=None, **kw):
        plan = real(graph, cost, axis_names, input_filters=input_filters, **kw)
        if input_filters is not None:
            return plan
        return dataclasses.replace(
            plan, compute_time=100 * plan.compute_time, solver={**plan.solver, "status": "feasible"}
        )

    def stage(layout, batch_axis=None, logical=(4,)):
        method = alpa_mini.PipeshardParallel(
            stage_option=alpa_mini.UniformStageOption(1, (1, 4), logical),
            default_auto_sharding_option=alpa_mini.ShardParallel(
                layout=layout, batch_axis=batch_axis
            ),
            gradient_sync="ilp",
        )
        plan = alpa_mini.plan(step, *args, method=method, cluster=FOUR)
        return plan.stages[0], plan.planning

    for width, batch, logical in ((256, 64, (4,)), (256, 512, (2, 2))):
        step, args = _mlp_args(width=width, batch=batch)
        monkeypatch.setattr(stage_cost, "plan_sharding", real)
        presets = [stage("zero3", None, logical)[0], stage("auto", 0, logical)[0]]
        best = min(presets, key=lambda s: s.latency)
        monkeypatch.setattr(stage_cost, "plan_sharding", unproven_free)
        fallback, stats = stage("auto", None, logical)
        assert fallback.latency == pytest.approx(best.latency, rel=1e-12)
        assert fallback.in_specs == best.in_specs
        assert stats.ilps_solved == 3
    # ZeRO-3 wins (ties) the first case and the batch split the second (39.281 vs 39.307 ms),
    # so both restrictions are exercised.
    assert fallback.latency < presets[0].latency
    monkeypatch.setattr(stage_cost, "plan_sharding", real)
    _, stats = stage("auto")
    assert stats.ilps_solved == 1  # proven optimal: no second MIP
    # A batch of 6 rows has no ZeRO-3 or batch-split layout on 4 devices: the unproven free
    # plan stays.
    step, args = _mlp_args(width=256, batch=6)
    monkeypatch.setattr(stage_cost, "plan_sharding", unproven_free)
    kept, stats = stage("auto")
    assert stats.ilps_solved == 3  # both pinned attempts are counted, then given up
    assert kept.latency > 0


def test_zero3_fallback_and_memory_lean_column_share_one_ilp(monkeypatch):
    """The free MIP's ZeRO-3 fallback and the memory-lean ZeRO-3 column are one ILP (same
    graph, mesh, pins and budget): a stage model solves it once, in either order."""
    import alpa_mini
    from alpa_mini.pipeline import stage_cost, stage_search

    real = stage_cost.plan_sharding
    models = []

    class Spy(stage_cost._StageModel):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            models.append(self)

    def unproven_free(graph, cost, axis_names, *, input_filters=None, **kw):
        plan = real(graph, cost, axis_names, input_filters=input_filters, **kw)
        if input_filters is not None:
            return plan
        return dataclasses.replace(plan, solver={**plan.solver, "status": "feasible"})

    monkeypatch.setattr(stage_search, "_StageModel", Spy)
    monkeypatch.setattr(stage_cost, "plan_sharding", unproven_free)
    step, args = _mlp_args(width=256, batch=64)

    def planned(layout):
        method = alpa_mini.PipeshardParallel(
            stage_option=alpa_mini.UniformStageOption(1, (1, 4), (4,)),
            default_auto_sharding_option=alpa_mini.ShardParallel(layout=layout),
            gradient_sync="ilp",
        )
        plan = alpa_mini.plan(step, *args, method=method, cluster=FOUR)
        stage = plan.stages[0]
        return models[-1], stage.eqn_start, stage.eqn_end, plan

    zero3_model, start, end, _ = planned("zero3")
    zero3 = zero3_model.cost(start, end, (1, 4), (4,))  # its cached StageCost
    # Free first: its fallbacks solve ZeRO-3's and Megatron's ILPs; the column then reuses.
    model, start, end, plan = planned("auto")
    assert plan.planning.ilps_solved == 3
    column = model.cost(start, end, (1, 4), (4,), "zero3")
    assert model.stats.ilps_solved == 3
    assert column.latency == pytest.approx(zero3.latency, rel=1e-12)
    # Column first (the DP's prefetch order is not fixed): the fallback reuses it.
    model.cache.clear()
    model._presets.clear()
    model.stats.ilps_solved = 0
    again = model.cost(start, end, (1, 4), (4,), "zero3")
    assert again.latency == pytest.approx(zero3.latency, rel=1e-12)
    model.cost(start, end, (1, 4), (4,))
    assert model.stats.ilps_solved == 3  # ZeRO-3 once, the free MIP, Megatron's restriction


def test_memory_lean_configs_fit_where_speed_chosen_layers_do_not():
    """Four 1024x1024 layers, 512 rows, 4 devices: per-layer ILPs pick layouts for speed,
    and stages composed from them need about 38 MiB per device; with memory_lean the DP can
    take ZeRO-3-sharded layers instead, fits in less, and says which column it used.
    (Gradient sync priced after the solve: tied inside it, the per-layer ILPs already lean
    towards sharded layouts here.)"""
    import alpa_mini

    step, args = _mlp_args(width=1024, batch=512)

    def plan(lean: bool, budget: float):
        option = alpa_mini.AutoStageOption(memory_lean=lean)
        method = alpa_mini.PipeshardParallel(
            num_micro_batches=1, stage_option=option, memory_budget=budget, gradient_sync="after"
        )
        return alpa_mini.plan(step, *args, method=method, cluster=FOUR)

    with pytest.raises(alpa_mini.MemoryBudgetError) as info:
        plan(False, 1024)
    need = info.value.min_budget
    with pytest.raises(alpa_mini.MemoryBudgetError) as info:
        plan(True, 1024)
    lean_need = info.value.min_budget
    # ZeRO-3's gradient accumulators are whole per data-parallel group (shard.accumulators),
    # so it saves only parameters and state here: 35.5 against 38 MiB.
    assert lean_need < 0.95 * need
    budget = (need + lean_need) / 2
    with pytest.raises(alpa_mini.MemoryBudgetError):
        plan(False, budget)
    lean = plan(True, budget)
    names = lean.stage_problem.config_names
    for stage, st in zip(lean.stages, lean.stage_solution.stages, strict=True):
        assert "zero3" in names[st.config_index]
        assert stage.peak_memory <= budget
    with pytest.raises(ConfigError, match=r"AutoStageOption.memory_lean: 'yes' is not True"):
        alpa_mini.AutoStageOption(memory_lean="yes")


def test_refine_replans_the_memory_lean_column_whole(monkeypatch):
    """With free layouts made 100x slower (still proven optimal, so no ZeRO-3 fallback), the
    DP picks the memory-lean column; ``refine`` must then re-plan the chosen stage whole in
    that column too, and land exactly on the whole-stage ZeRO-3 plan, which beats the
    composition (whose per-layer pieces reshard between layers). The default refinement
    solves only tied ILPs, and tying four layers' nodes would not halve this one: it leaves
    the composition."""
    import alpa_mini
    from alpa_mini.pipeline import stage_cost

    real = stage_cost.plan_sharding

    def slow_free(graph, cost, axis_names, *, input_filters=None, **kw):
        plan = real(graph, cost, axis_names, input_filters=input_filters, **kw)
        if input_filters is not None:
            return plan
        return dataclasses.replace(plan, compute_time=100 * plan.compute_time)

    monkeypatch.setattr(stage_cost, "plan_sharding", slow_free)
    step, args = _mlp_args(width=256, batch=64)

    def plan(stage_option, layout="auto"):
        method = alpa_mini.PipeshardParallel(
            num_micro_batches=1,
            stage_option=stage_option,
            default_auto_sharding_option=alpa_mini.ShardParallel(layout=layout),
        )
        return alpa_mini.plan(step, *args, method=method, cluster=FOUR)

    default = plan(alpa_mini.AutoStageOption(memory_lean=True))
    refined = plan(alpa_mini.AutoStageOption(memory_lean=True, refine=True))
    whole = plan(alpa_mini.UniformStageOption(1, (1, 4)), layout="zero3")
    names = default.stage_problem.config_names
    assert [names[st.config_index] for st in default.stage_solution.stages] == ["1d-zero3"]
    assert [s.submesh for s in refined.stages] == [(1, 4)]
    assert refined.stages[0].latency == pytest.approx(whole.stages[0].latency, rel=1e-12)
    assert refined.stages[0].in_specs == whole.stages[0].in_specs
    assert default.planning.stages_refined == 0
    assert whole.stages[0].latency < default.stages[0].latency


def test_refine_within_limits_the_whole_stage_ilps_to_close_configs():
    """``refine_within=0`` re-plans only the configs whose composed estimate ties the chosen
    one's (one whole-stage ILP fewer here: of the submesh (1, 4)'s three configs, the DP
    chose the 1-D one, the (2, 2) one ties it and the ZeRO-3 column does not); a bound no
    config misses re-plans them all, exactly as None does; re-planning more configs is
    never worse."""
    import alpa_mini
    from alpa_mini.pipeline.stage_configs import stage_configs

    step, args = _mlp_args(width=512, batch=256)

    def plan(within):
        option = alpa_mini.AutoStageOption(
            refine=True,
            memory_lean=True,
            logical_shapes="model_parallel_in_host",
            refine_within=within,
        )
        # Sync priced after the solve, as when these counts were worked out.
        method = alpa_mini.PipeshardParallel(
            num_micro_batches=2, stage_option=option, gradient_sync="after"
        )
        p = alpa_mini.plan(step, *args, method=method, cluster=FOUR)
        return p.planning.ilps_solved, [s.latency for s in p.stages], p

    every, lat_every, p = plan(None)
    (submesh,) = {s.submesh for s in p.stages}
    assert submesh == (1, 4) and len(p.stages) == 1
    lean = alpa_mini.AutoStageOption(memory_lean=True, logical_shapes="model_parallel_in_host")
    assert len(stage_configs(submesh, lean)) == 3
    only, lat_only, _ = plan(0.0)
    wide, lat_wide, _ = plan(1e9)
    assert only == every - 1
    assert (wide, lat_wide) == (every, lat_every)
    assert all(a <= b for a, b in zip(lat_every, lat_only, strict=True))
    for bad in (-0.1, "5%", True):
        with pytest.raises(ConfigError, match=r"AutoStageOption.refine_within: .* is invalid"):
            alpa_mini.AutoStageOption(refine_within=bad)


def test_pp_dp_replicates_every_stages_weights_and_splits_its_batch():
    """Pipeline + data parallelism (Alpa's Wide-ResNet baseline): its grid is Megatron's
    with tp = 1; every stage holds whole weights (no operator sharding), splits its batch
    over all of its devices, and pp = 1 is exactly the data-parallel baseline."""
    step, args = _mlp_args(width=64, batch=64)
    kw = dict(num_layers=4, batch_size=64, micro_batches=(1, 2))
    grid = {
        (c["dp"], c["pp"], c["micro_batches"])
        for c in megatron_configs(4, 4, 4, 64, (1, 2))
        if c["tp"] == 1
    }
    assert grid == {(4, 1, 1), (4, 1, 2), (2, 2, 1), (2, 2, 2), (1, 4, 1), (1, 4, 2)}
    ppdp = run_baseline("pp-dp", step, args, FOUR, **kw)
    assert ppdp.tried == len(grid) and ppdp.config["tp"] == 1
    dp = ppdp.config["dp"]
    for stage in ppdp.plan.stages:
        assert math.prod(stage.logical_shape) == len(stage.devices) == dp
        specs = [s for s in stage.in_specs if s is not None and len(s.dims) == 2]
        assert specs  # the stage's weights, activations and batch rows
        for spec in specs:  # no operator sharding: no (width) column is ever split
            assert math.prod(stage.logical_shape[a] for a in spec.dims[1]) == 1
    only_dp = run_baseline("data-parallel", step, args, FOUR, **kw)
    pp1 = run_baseline("pp-dp", step, args, FOUR, num_layers=1, batch_size=64,
                       micro_batches=(1, 2))  # fmt: skip
    assert pp1.config["pp"] == 1
    assert pp1.iteration_time == pytest.approx(only_dp.iteration_time, rel=1e-6)
