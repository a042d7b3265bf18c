"""The faithful baselines against closed forms: Megatron-LM's column/row/vocabulary splits and
its one all-reduce per attention and MLP, DeepSpeed-MoE's expert split, ZeRO-2 state and
all-to-all dispatch. Collective counts here are the planner's (its cost model's plan), not
compiled HLO: the A100 cost model is what the benchmarks price with."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError
from alpa_mini.models import adam, make_train_step
from alpa_mini.models.gpt import (
    GPTConfig,
    _block,
    gpt_abstract_batch,
    gpt_abstract_params,
    gpt_loss,
)
from alpa_mini.models.moe import (
    MoELMConfig,
    moe_lm_abstract_batch,
    moe_lm_abstract_params,
    moe_lm_loss,
)
from alpa_mini.options.param_splits import ParamSplit, ParamSplits
from alpa_mini.options.pipeshard import ManualLayerOption, PipeshardParallel, UniformStageOption
from alpa_mini.options.shard import ShardParallel
from alpa_mini.pipeline import stage_cost, stage_search
from alpa_mini.pipeline.grad_pricing import gradient_sync_seconds, reduced_every_micro_batch
from alpa_mini.pipeline.stage_cost import plan_held_bytes
from alpa_mini.shard.spec import ShardingSpec
from benchmarks.baselines import (
    FAITHFUL,
    deepspeed_moe_configs,
    expert_splits,
    family_baselines,
    megatron_configs,
    megatron_splits,
    run_baseline,
)

OPT = adam(1e-3)
A100 = ClusterSpec.named("dgx-a100")
A100_4 = dataclasses.replace(A100, num_hosts=1, devices_per_host=4)
# Unambiguous shapes: V, S, H, F = 512, 32, 64, 256 (no two roles share one).
GPT = GPTConfig(vocab_size=512, seq_len=32, hidden=64, num_heads=4, num_layers=2)
MOE = MoELMConfig(
    vocab_size=256, seq_len=128, hidden=256, num_heads=4, num_layers=2, num_experts=4, ffn_ratio=8
)

#: Megatron-LM's split of each gpt.py leaf: dimension over tp (None: replicated).
WANT = {
    "w_q": 1, "w_k": 1, "w_v": 1,  # [H, N, D]: column-parallel by heads
    "b_q": 0, "b_k": 0, "b_v": 0,  # [N, D]
    "attn/w_out": 0,  # [N, D, H]: row-parallel by heads
    "w_in": 1, "b_in": 0,  # [H, F], [F]: column-parallel
    "mlp/w_out": 0,  # [F, H]: row-parallel
    "wte": 0,  # [V, H]: vocabulary-parallel
}  # fmt: skip


def _want(path: tuple[Any, ...]) -> int | None:
    keys = [p.key for p in path if isinstance(p, jax.tree_util.DictKey)]
    return WANT.get(keys[-1], WANT.get("/".join(keys[-2:])))


def _step(config: GPTConfig | MoELMConfig, batch: int) -> tuple[Any, tuple[Any, ...]]:
    """(train step, abstract args) of a GPT or MoE LM config with pipeline marks."""
    config = dataclasses.replace(config, pipeline_marks=True)
    if isinstance(config, GPTConfig):
        params, data = gpt_abstract_params(config), gpt_abstract_batch(config, batch)
        loss = gpt_loss
    else:
        params, data = moe_lm_abstract_params(config), moe_lm_abstract_batch(config, batch)
        loss = moe_lm_loss
    step = make_train_step(lambda p, b: loss(p, b, config), OPT, alpa_mini.value_and_grad)
    return step, (params, jax.eval_shape(OPT.init, params), data)


@pytest.fixture
def stage_plans(monkeypatch):
    """Every stage ILP's plan, and every stage model, as planning makes them."""
    real, seen = stage_cost.plan_sharding, {"plans": [], "models": []}

    def spy(graph, cost, axis_names, **kw):
        plan = real(graph, cost, axis_names, **kw)
        seen["plans"].append(plan)
        return plan

    class Spy(stage_cost._StageModel):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen["models"].append(self)

    monkeypatch.setattr(stage_cost, "plan_sharding", spy)
    monkeypatch.setattr(stage_search, "_StageModel", Spy)
    return seen


def _params(plan):
    return [plan.tensors[t] for t in plan.inputs if plan.tensors[t].role == "param"]


def test_megatron_splits_are_column_row_and_vocabulary_for_both_layer_layouts():
    """Every leaf of a GPT, unrolled or stacked (a leading layer axis, matched for any row
    piece a pipeline stage may get), maps to Megatron-LM's split, and the ``megatron``
    layout admits exactly that split over tp (mesh axis 1), replicated over dp."""
    for scan in (False, True):
        params = gpt_abstract_params(dataclasses.replace(GPT, scan_layers=scan))
        splits = megatron_splits(params)
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
            stacked = scan and "layers" in jax.tree_util.keystr(path)
            want = _want(path)
            assert splits.dim(leaf.shape) == (None if want is None else want + stacked)
            if stacked:  # a piece of one layer's rows
                assert splits.dim((1, *leaf.shape[1:])) == splits.dim(leaf.shape)
    unrolled = megatron_splits(gpt_abstract_params(GPT))
    option = alpa_mini.ShardParallel(layout="megatron", tensor_splits=unrolled)
    w_q = (64, 4, 16)
    keep = option.input_filter("param", w_q, (2, 2))
    assert keep(ShardingSpec(((), (1,), ())))
    for other in (((), (0,), ()), ((), (0, 1), ()), ((1,), (), ()), ((), (), ())):
        assert not keep(ShardingSpec(other))
    assert option.input_filter("param", (64,), (2, 2))(ShardingSpec(((),)))  # a layer norm
    batch = option.input_filter("batch", (8, 32), (2, 2))  # split over dp alone
    assert batch(ShardingSpec(((0,), ()))) and not batch(ShardingSpec(((0, 1), ())))
    # Optimiser state as its parameter; a step count the table does not know: replicated.
    assert option.input_filter("state", w_q, (2, 2))(ShardingSpec(((), (1,), ())))
    assert option.input_filter("state", (), (2, 2))(ShardingSpec(()))
    assert option.state_devices(w_q, (2, 2)) == 2 and option.state_devices((64,), (2, 2)) == 1


def test_megatron_lm_block_has_one_all_reduce_per_attention_and_mlp(stage_plans):
    """One GPT block on a (1, 4) A100 mesh, Megatron-LM's layouts pinned: the forward has
    exactly two all-reduces over tp (attention output, MLP output), each of the block's
    activation, rows x seq x hidden x 4 bytes; the backward of a whole stage adds four more
    reductions of that size: the MLP input's gradient and one per q, k, v matmul (gpt.py
    keeps three where Megatron-LM fuses one). Nothing else is communicated."""
    rows, seq, hidden = 2, 16, 256
    config = GPTConfig(vocab_size=256, seq_len=seq, hidden=hidden, num_heads=8, num_layers=2)
    params = gpt_abstract_params(config)
    layer, splits = params["layers"][0], megatron_splits(params)
    act = rows * seq * hidden * 4
    x = jax.ShapeDtypeStruct((rows, seq, hidden), jnp.float32)
    option = alpa_mini.ShardParallel(
        layout="megatron", tensor_splits=splits, mesh_shape=(1, 4), replicate_outputs=True
    )
    plan = alpa_mini.plan(_block, layer, x, method=option, cluster=A100_4)
    assert Counter((c.kind, c.axes, c.nbytes) for c in plan.collectives) == {
        ("all-reduce", (1,), act): 2
    }
    for t in _params(plan):
        key = t.name.split("'")[-2]
        want = WANT.get(key, WANT.get(t.name.split("'")[-4] + "/" + key))
        dims = tuple((1,) if d == want else () for d in range(len(t.shape)))
        assert t.spec.dims == dims, t.name
    # Forward + backward as a pipeline stage: the middle one of embedding | block | block+head.
    step, args = _step(config, rows)
    sub = dataclasses.replace(A100_4, num_hosts=3)
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=1,
        layer_option=alpa_mini.ManualLayerOption(),
        stage_option=alpa_mini.UniformStageOption(3, (1, 4), (1, 4)),
        default_auto_sharding_option=alpa_mini.ShardParallel(
            layout="megatron", tensor_splits=splits
        ),
        gradient_sync="ilp",
    )
    alpa_mini.plan(step, *args, method=method, cluster=sub)
    (block,) = [p for p in stage_plans["plans"] if len(_params(p)) == 16]
    reductions = Counter((c.kind in ("all-reduce", "reduce-scatter"), c.axes, c.nbytes)
                         for c in block.collectives)  # fmt: skip
    assert reductions == {(True, (1,), act): 6}


@pytest.mark.slow  # 7 s
def test_megatron_lm_baseline_pins_every_stage_and_keeps_state_like_its_parameters(
    stage_plans,
):
    """The megatron-lm grid is Megatron's with tp dividing the heads (2 here, so no tp 4);
    every stage ILP it solves has each parameter split exactly as Megatron-LM splits it over
    tp and replicated over dp, and the batch split over dp alone. Optimiser state is priced
    like the parameters: a split one's over tp, a replicated one's whole on every device."""
    config = dataclasses.replace(GPT, num_heads=2)
    step, args = _step(config, 16)
    got = run_baseline(
        "megatron-lm", step, args, A100_4, num_layers=3, batch_size=16, micro_batches=(2,)
    )
    grid = megatron_configs(4, 4, num_layers=3, batch_size=16, micro_batches=(2,))
    assert got.feasible and got.tried == sum(c["tp"] <= 2 for c in grid) < len(grid)
    splits = megatron_splits(args[0])
    assert stage_plans["plans"]
    for plan in stage_plans["plans"]:
        dp, tp = plan.mesh_shape
        for t in _params(plan):
            dim = splits.dim(t.shape)
            want = tuple((1,) if d == dim and tp > 1 else () for d in range(len(t.shape)))
            assert t.spec.dims == want
        for t in (plan.tensors[i] for i in plan.inputs):
            if t.role == "batch" and t.shape and dp > 1:
                assert t.spec.dims[0] == (0,) and not any(t.spec.dims[1:])
    # The whole step as one stage on a (2, 2) mesh, priced by a stage model of the search.
    model = stage_plans["models"][-1]
    start, end = 0, len(model.forward.jaxpr.eqns)
    params = [v for v in model._io(start, end)[1] if model.role(v) == "param"]
    want = model.state_ratio * sum(
        math.prod(v.aval.shape) * 4 / (2 if splits.dim(v.aval.shape) is not None else 1)
        for v in params
    )
    assert len(params) == len(jax.tree.leaves(args[0]))
    cost = model.cost(start, end, (1, 4), (2, 2))
    assert cost.state_bytes == pytest.approx(want, rel=1e-12)


def test_deepspeed_moe_splits_experts_shards_state_and_dispatches_by_all_to_all(stage_plans):
    """DeepSpeed-MoE on 4 A100s with 4 experts: one stage, the batch over all 4 devices,
    each expert weight split along its expert dimension over ep = 4, every other parameter
    replicated (ZeRO-2), optimiser state sharded over all devices, and the tokens reach
    their experts by all-to-all over the expert axis: dispatch and combine, forward and
    backward, each of one device's dispatched tokens, rows / 4 x experts x capacity x hidden
    x 4 bytes (capacity = seq: one group per sequence, nothing dropped). Sizes are large
    enough for bandwidth to matter: with a few KiB per collective the ILP finds gathering
    the tokens and all-reducing the combined output cheaper (fewer collectives)."""
    rows, seq, hidden, experts = 32, MOE.seq_len, MOE.hidden, MOE.num_experts
    step, args = _step(MOE, rows)
    got = run_baseline(
        "deepspeed-moe", step, args, A100_4, num_layers=3, batch_size=rows, micro_batches=(1,)
    )
    assert got.config == {"dp": 4, "ep": 4, "pp": 1, "micro_batches": 1}
    (stage,) = got.plan.stages
    assert stage.logical_shape == (1, 4)
    (plan,) = stage_plans["plans"]
    shapes = {e.shape for e in expert_splits(args[0]).entries if e.dim is not None}
    assert shapes == {(4, 256, 2048), (4, 2048), (4, 2048, 256), (4, 256)}
    for t in _params(plan):
        split = ((1,),) + ((),) * (len(t.shape) - 1)
        assert t.spec.dims == (split if t.shape in shapes else ((),) * len(t.shape))
    dispatched = rows // 4 * experts * seq * hidden * 4
    assert Counter((c.axes, c.nbytes) for c in plan.collectives if c.kind == "all-to-all") == {
        ((1,), dispatched): 4
    }
    model = stage_plans["models"][-1]
    cost = model.cost(stage.eqn_start, stage.eqn_end, stage.submesh, stage.logical_shape)
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    # Adam's state and ZeRO-2's gradient partitions, both split over the 4 devices.
    want = (model.state_ratio + 1.0) * param_bytes / 4
    assert cost.state_bytes == pytest.approx(want, rel=1e-12)


def test_deepspeed_zero2_reduces_every_micro_batch_into_partitions(stage_plans):
    """DeepSpeed's ZeRO-2 keeps only its partition of each gradient, so it reduces after
    every micro-batch (its maintainers: deepspeedai/DeepSpeed#2252). Priced so at B = 2:
    every gradient leaves the stage in its optimiser state's layout, split over all 4
    devices, its reduction charged in full each micro-batch (nothing scaled by 1/B as this
    runtime's once-per-step sync is); the partitions are held all step beside the state,
    no unreduced accumulator is; the updated parameters are gathered once per step."""
    step, args = _step(MOE, 32)
    splits = expert_splits(args[0])
    method = PipeshardParallel(
        num_micro_batches=2,
        layer_option=ManualLayerOption(),
        stage_option=UniformStageOption(1, (1, 4), (1, 4), profiling="whole"),
        default_auto_sharding_option=ShardParallel(layout="zero2", tensor_splits=splits),
    )
    with reduced_every_micro_batch():
        deep = alpa_mini.plan(step, *args, method=method, cluster=A100_4)
    ours = alpa_mini.plan(step, *args, method=method, cluster=A100_4)
    costs, jobs, ios = [], [], []
    for model, plan in zip(stage_plans["models"], (deep, ours), strict=True):
        (st,) = plan.stages
        ios.append(model._io(st.eqn_start, st.eqn_end))
        costs.append(model.cost(st.eqn_start, st.eqn_end, st.submesh, st.logical_shape))
        jobs.append(model._job(ios[-1], st.submesh, st.logical_shape, "auto"))
    (d, o), (dj, oj) = costs, jobs
    assert {n.comm_scale for n in dj.graph.nodes} == {1.0}
    assert 0.5 in {n.comm_scale for n in oj.graph.nodes}
    assert dj.aliases == [] and len(oj.aliases) == len(oj.params) > 0
    for k in dj.params:
        assert d.plan.output_specs[dj.first_grad + k].num_shards((1, 4)) == 4
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    assert d.state_bytes == pytest.approx(o.state_bytes + param_bytes / 4, rel=1e-12)
    residual = d.residual_bytes
    assert d.held_bytes == plan_held_bytes(d.plan, residual, accumulators=False)
    assert d.held_bytes < plan_held_bytes(d.plan, residual)
    gather = gradient_sync_seconds(d.plan, dj.cost, ios[0][1], dj.params, dj.first_grad)
    assert gather > 0.0
    assert d.latency == pytest.approx(d.plan.predicted_time + gather / 2, rel=1e-12)


def test_deepspeed_grid_and_family_mapping():
    """ep: the most devices dividing both the experts and the devices (DeepSpeed's rule);
    micro-batch counts: those given and the powers of two below the largest, each
    micro-batch splitting over every device."""
    assert deepspeed_moe_configs(4, 8, 16, (1, 2, 8)) == [
        {"dp": 4, "ep": 4, "pp": 1, "micro_batches": b} for b in (1, 2, 4)
    ]  # B = 8 leaves 2 rows, which do not split over 4 devices
    assert deepspeed_moe_configs(8, 2, 16, (1,))[0]["ep"] == 2
    assert deepspeed_moe_configs(4, 3, 16, (1,))[0]["ep"] == 1  # experts replicated
    assert deepspeed_moe_configs(4, 6, 16, (1,))[0]["ep"] == 2  # 6 experts, 2 per group
    # MoE-27B's 48 experts on 32 GPUs: 16 expert groups; its batch of 1024 gives each
    # of the 32 devices whole rows up to 32 micro-batches.
    got = deepspeed_moe_configs(32, 48, 1024, (32, 64, 128, 256))
    assert {c["ep"] for c in got} == {16}
    assert [c["micro_batches"] for c in got] == [1, 2, 4, 8, 16, 32]
    assert FAITHFUL == {"gpt": "megatron-lm", "moe": "deepspeed-moe", "wresnet": "pp-dp"}
    assert family_baselines("moe")[-1] == "deepspeed-moe"
    assert family_baselines("wresnet") == family_baselines("mlp")  # PP-DP is generic


def test_bad_inputs_name_the_field_the_value_and_what_is_valid():
    gpt = gpt_abstract_params(GPT)
    splits = megatron_splits(gpt)
    with pytest.raises(ConfigError, match=r"tensor_splits: None is invalid with layout='megatron'"):
        alpa_mini.ShardParallel(layout="megatron")
    with pytest.raises(ConfigError, match=r"tensor_splits: given with layout='auto'; valid only"):
        alpa_mini.ShardParallel(tensor_splits=splits)
    option = alpa_mini.ShardParallel(layout="megatron", tensor_splits=splits)
    with pytest.raises(ConfigError, match=r"mesh_shape: None is invalid with layout='megatron'"):
        option.mesh_shapes(4)
    with pytest.raises(
        ConfigError, match=r"'megatron' plans on a \(dp, tp\) mesh; got mesh \(4,\)"
    ):
        option.input_filter("param", (64, 4, 16), (4,))
    with pytest.raises(ConfigError, match=r"splits dim 1 \(4\) over mesh axis 1 of 8 devices"):
        option.input_filter("param", (64, 4, 16), (1, 8))
    with pytest.raises(ConfigError, match=r"no parameter of shape \(3, 3\) in the table"):
        option.input_filter("param", (3, 3), (2, 2))
    # wpe [S, H] (replicated) and the MLP's w_out [F, H] (row-split) alike when S = F.
    clash = gpt_abstract_params(dataclasses.replace(GPT, seq_len=256))
    with pytest.raises(ConfigError, match=r"w_out'\] \(256, 64\) \(split dim 0\) and \['wpe'\]"):
        megatron_splits(clash)
    with pytest.raises(ConfigError, match=r"ParamSplit.dim: 3 of w is invalid; expected None"):
        ParamSplits((ParamSplit("w", (4, 4), 3),))
    moe = moe_lm_abstract_params(
        MoELMConfig(vocab_size=64, seq_len=8, hidden=16, num_heads=2, num_layers=2, num_experts=2)
    )
    with pytest.raises(ConfigError, match=r"megatron-lm: .*'experts'.* is an expert weight"):
        megatron_splits(moe)
    with pytest.raises(ConfigError, match=r"deepspeed-moe: no parameter lives under an 'exp"):
        expert_splits(gpt)
    step, args = _step(GPT, 16)
    with pytest.raises(ConfigError, match=r"baseline: 'megatron' is now 'strong-grid'"):
        run_baseline("megatron", step, args, A100_4, num_layers=3, batch_size=16)
