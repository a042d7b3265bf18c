"""Profile databases: the alpha-beta fit, JSON round trips and errors, and the cost model and
planner pricing with measured figures instead of the cluster's nominal ones."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

import alpa_mini
from alpa_mini import AutoStageOption, ClusterSpec, ConfigError
from alpa_mini.cluster import ProfileDB
from alpa_mini.cluster.microbench import profile_devices
from alpa_mini.cluster.profile_db import (
    CollectiveFit,
    ComputeFit,
    ProfileError,
    byte_factor,
    fit_alpha_beta,
)
from alpa_mini.graph.tracing import trace_jaxpr
from alpa_mini.models import GPTConfig, adam, gpt_loss, init_gpt, make_gpt_batch, make_train_step
from alpa_mini.shard import CostModel
from alpa_mini.shard.problem import plan_sharding

CPU = ClusterSpec.named("cpu-1x8")

DB = ProfileDB(
    device="cpu",
    compute=(
        ComputeFit(1, 100e9, 40e9),
        ComputeFit(4, 40e9, 4e9, 200e-6, 3e-6, (("transcendental", 1e9),)),
        ComputeFit(8, 20e9, 1e9),
    ),
    collectives=(
        CollectiveFit("all-reduce", 4, 50e-6, 0.3e-9),
        CollectiveFit("all-to-all", 8, 0.0, 7e-9),
    ),
    machine="a test",
)


# ---------------------------------------------------------------------- the fit
def test_fit_recovers_a_line_exactly() -> None:
    xs = [1e3, 1e4, 1e5, 1e6]
    alpha, beta = fit_alpha_beta(xs, [2e-5 + 3e-10 * x for x in xs])
    assert alpha == pytest.approx(2e-5, rel=1e-9)
    assert beta == pytest.approx(3e-10, rel=1e-9)


def test_fit_never_returns_negative_latency_or_slope() -> None:
    xs = [1.0, 2.0, 3.0]
    # The intercept is -1: refit through the origin with the same 1/t^2 weights,
    # slope sum(w x t) / sum(w x x).
    ts = [1.0, 3.0, 5.0]
    alpha, beta = fit_alpha_beta(xs, ts)
    w = [1 / t**2 for t in ts]
    expected = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True)) / sum(
        wi * x * x for wi, x in zip(w, xs, strict=True)
    )
    assert alpha == 0.0 and beta == pytest.approx(expected)
    # Falling times (noise): all latency, the weighted mean time.
    alpha, beta = fit_alpha_beta(xs, [3.0, 2.0, 1.0])
    assert beta == 0.0 and alpha == pytest.approx((3 / 9 + 2 / 4 + 1) / (1 / 9 + 1 / 4 + 1))
    # Relative weighting: one large outlier moves the small-size intercept little.
    xs = [1e3, 1e4, 1e5, 1e6]
    ts = [1e-5 + 1e-9 * x for x in xs]
    ts[-1] *= 1.5
    assert fit_alpha_beta(xs, ts)[0] == pytest.approx(1e-5, rel=0.1)
    with pytest.raises(ValueError, match="two distinct"):
        fit_alpha_beta([1.0, 1.0], [1.0, 2.0])


def test_byte_factors_are_the_cost_models() -> None:
    assert byte_factor("all-reduce", 4) == 2 * 3 / 4
    assert byte_factor("all-gather", 4) == byte_factor("reduce-scatter", 4) == 3 / 4
    assert byte_factor("all-to-all", 8) == 7 / 16
    with pytest.raises(ProfileError, match=r"kind: 'broadcast' is not one of"):
        byte_factor("broadcast", 2)


# ---------------------------------------------------------------------- data
def test_lookup_takes_the_exact_or_nearest_entry() -> None:
    assert DB.compute_for(4).busy_devices == 4
    assert DB.compute_for(2).busy_devices == 1  # 1 and 4 are not equally near: 1 is
    assert DB.compute_for(6).busy_devices == 8  # a tie between 4 and 8: the slower, 8
    assert DB.compute_for(64).busy_devices == 8
    assert DB.collective("all-reduce", 4) == DB.collectives[0]
    assert DB.collective("all-reduce", 8) is None


def test_json_round_trips(tmp_path) -> None:
    assert ProfileDB.from_json(DB.to_json()) == DB
    path = tmp_path / "db.json"
    DB.save(path)
    assert ProfileDB.load(path) == DB
    cluster = CPU.with_profile(DB)
    again = ClusterSpec.from_json(cluster.to_json())
    assert again == cluster and again.profile == DB
    assert "profile" not in CPU.to_dict()  # a plain cluster's JSON is unchanged


def _edit(path: tuple, value) -> dict:
    data = json.loads(DB.to_json())
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "path, value, match",
    [
        (("device",), KeyError, r"profile\.device: missing field"),
        (("speed",), 1, r"profile\.speed: unknown field; valid fields: collectives, compute"),
        (("compute", 0, "busy_devices"), 0, r"compute\[0\]\.busy_devices: 0 is invalid"),
        (("compute", 1, "matmul_flops"), -1.0, r"compute\[1\]\.matmul_flops: -1\.0 is invalid"),
        (("compute", 2, "busy_devices"), 4, r"busy_devices repeat: \[1, 4, 4\]"),
        (("compute",), [], r"compute: needs at least one entry"),
        (("collectives", 0, "kind"), "bcast", r"collectives\[0\]\.kind: 'bcast' is not one of"),
        (("collectives", 1, "group_size"), 1, r"group_size: 1 is invalid; expected >= 2"),
        (("collectives", 1, "beta"), "fast", r"collectives\[1\]\.beta: 'fast' is invalid"),
        (("compute", 1, "rates", "gemm"), 1e9, r"compute\[1\]\.rates\.gemm: unknown op class"),
        (("compute", 1, "launch_overhead"), -1, r"compute\[1\]\.launch_overhead: -1 is invalid"),
    ],
)
def test_bad_fields_are_named(path: tuple, value, match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        ProfileDB.from_dict(_edit(path, value))
    # Inside a cluster description the same error is a ConfigError under cluster.profile.
    data = CPU.to_dict()
    data["profile"] = _edit(path, value)
    with pytest.raises(ConfigError, match=match.replace(r"profile\.", r"cluster\.profile\.")):
        ClusterSpec.from_dict(data)


def test_load_errors_name_the_file(tmp_path) -> None:
    with pytest.raises(ProfileError, match="no such profile file"):
        ProfileDB.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"bad\.json: not valid JSON"):
        ProfileDB.load(bad)
    with pytest.raises(ConfigError, match="profile: expected a ProfileDB"):
        CPU.with_profile({"device": "cpu"})


# ---------------------------------------------------------------------- pricing
def test_the_cost_model_prices_with_the_profile() -> None:
    cluster = CPU.with_profile(DB)
    on4 = CostModel(cluster, cluster.logical_mesh((4,), (1, 4)))
    # Compute: the 4-busy entry's roofline, split 4 ways.
    assert on4.compute(8e9, 1e6, "float32", 4) == pytest.approx(8e9 / 40e9 / 4)
    assert on4.compute(1e3, 8e9, "float32", 2) == pytest.approx(8e9 / 4e9 / 2)
    # All-reduce over 4: the fit; all-gather over 4 was not measured: the link.
    nbytes = 1 << 20
    assert on4.all_reduce(nbytes, [0]) == pytest.approx(50e-6 + 0.3e-9 * 2 * 3 / 4 * nbytes)
    link = CPU.intra_host
    assert on4.all_gather(nbytes, [0]) == pytest.approx(link.alpha + link.beta * 3 / 4 * nbytes)
    # The same cluster without a profile keeps its nominal figures.
    plain = CostModel(CPU, CPU.logical_mesh((4,), (1, 4)))
    assert plain.compute(8e9, 1e6, "float32", 4) == pytest.approx(
        8e9 / CPU.device.flops_for("float32") / 4
    )
    # A transcendental op has its own measured rate (elements/s); others the matmul rate.
    assert on4.compute(4e6, 1.0, "float32", 4, "tanh") == pytest.approx(4e6 / 1e9 / 4)
    assert on4.compute(4e6, 1.0, "float32", 4, "add") == pytest.approx(4e6 / 40e9 / 4)
    # Program overheads: launches and kernels at the 4-busy entry; none without a profile.
    assert on4.program_overhead(10, launches=2) == pytest.approx(2 * 200e-6 + 10 * 3e-6)
    assert plain.program_overhead(10, launches=2) == 0.0
    on8 = CostModel(cluster, cluster.logical_mesh((8,)))
    assert on8.all_to_all(nbytes, [0]) == pytest.approx(7e-9 * 7 / 16 * nbytes)


def test_a_profiled_plan_predicts_the_profiles_roofline() -> None:
    # One matmul on 4 devices: the plan splits it 4 ways, compute bound, at the profile's
    # 4-busy-device rate.
    m = 256
    a = jnp.ones((m, m), jnp.float32)
    graph = trace_jaxpr(jax.make_jaxpr(lambda x, y: x @ y)(a, a), ["batch", "param"])
    plans = []
    for rate in (1e9, 2e9):
        db = dataclasses.replace(DB, compute=(ComputeFit(4, rate, 1e15),), collectives=())
        cluster = CPU.with_profile(db)
        cost = CostModel(cluster, cluster.logical_mesh((4,), (1, 4)))
        plans.append(plan_sharding(graph, cost, ["x"]))
    (dot,) = [n for n in plans[0].nodes if n.primitive == "dot_general"]
    assert dot.compute == pytest.approx(2 * m**3 / 1e9 / 4, rel=1e-9)
    # Only the compute term depends on the rate: doubling it saves half the matmul's time.
    saved = plans[0].predicted_time - plans[1].predicted_time
    assert saved == pytest.approx(dot.compute / 2, rel=1e-6)


# ---------------------------------------------------------------------- measuring
def test_profile_devices_measures_what_it_was_asked() -> None:
    devices = jax.devices()[:2]
    db = profile_devices(
        devices, busy_counts=[1, 2], group_sizes=[2], kinds=["all-reduce"], repeats=1
    )
    assert db.device == "cpu"
    assert [c.busy_devices for c in db.compute] == [1, 2]
    assert [(c.kind, c.group_size) for c in db.collectives] == [("all-reduce", 2)]
    assert all(c.matmul_flops > 0 and c.memory_bandwidth > 0 for c in db.compute)
    assert ProfileDB.from_json(db.to_json()) == db
    with pytest.raises(ValueError, match=r"busy_counts: 3 is invalid; expected 1\.\.2"):
        profile_devices(devices, busy_counts=[3])


def test_a_stage_pays_its_two_program_launches_once_however_many_layers_it_composes() -> None:
    # GPT with marked layers on one device: the stage DP composes the single stage from
    # per-layer ILPs. Raising the launch overhead by d raises the stage latency by exactly
    # 2 d (forward + backward program), not 2 d per layer.
    gpt = GPTConfig(
        vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=4, pipeline_marks=True
    )
    opt = adam(1e-2)
    params = jax.eval_shape(lambda: init_gpt(gpt, jax.random.PRNGKey(1)))
    batch = jax.eval_shape(lambda: make_gpt_batch(gpt, jax.random.PRNGKey(2), 8))
    step = make_train_step(lambda p, b: gpt_loss(p, b, gpt), opt, alpa_mini.value_and_grad)
    one = dataclasses.replace(CPU, num_hosts=1, devices_per_host=1)
    method = alpa_mini.PipeshardParallel(num_micro_batches=2, stage_option=AutoStageOption())
    latencies = []
    for launch in (0.0, 1e-3):
        db = dataclasses.replace(DB, compute=(ComputeFit(1, 100e9, 40e9, launch, 0.0),))
        args = (params, jax.eval_shape(opt.init, params), batch)
        plan = alpa_mini.plan(step, *args, method=method, cluster=one.with_profile(db))
        assert len(plan.stages) == 1 and plan.stages[0].layer_end > plan.stages[0].layer_start
        latencies.append(plan.stages[0].latency)
    assert latencies[1] - latencies[0] == pytest.approx(2e-3, rel=1e-9)
