"""Pipeline timelines: simulated and measured Chrome traces, bubble fractions, Gantt PNGs."""

from __future__ import annotations

import dataclasses
import json

import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError, PipeshardParallel, PipeshardPlan, UniformStageOption
from alpa_mini.inspect.timeline import (
    bubble_fraction,
    mesh_track_names,
    plot_timeline,
    simulated_events,
    write_timeline,
)
from alpa_mini.models import adam, make_train_step
from alpa_mini.pipeline.schedules import make_schedule
from alpa_mini.pipeline.simulate import StageTiming, simulate, simulate_plan
from alpa_mini.runtime.chrome_trace import TraceEvent, chrome_trace, measured_events
from helpers.mlp import marked_mlp_args, marked_mlp_loss

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _load(path) -> tuple[list[dict], dict[int, str]]:
    """The "X" events and the thread names of a written trace."""
    with open(path) as f:
        trace = json.load(f)
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    threads = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    names = {e["tid"]: e["args"]["name"] for e in threads}
    assert len(names) == len(threads)  # exactly one name per track
    return [e for e in events if e["ph"] == "X"], names


# ---------------------------------------------------------------------- simulated


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("S,B", [(1, 1), (2, 4), (4, 4), (4, 1), (3, 8)])
def test_equal_stages_bubble_is_the_closed_form(schedule, S, B):
    """S equal stages, B micro-batches, no transfers: (S - 1) / (B + S - 1)."""
    sim = simulate([StageTiming(1.0, 2.0)] * S, make_schedule(schedule, S, B))
    events = simulated_events(sim)
    assert bubble_fraction(events, S) == pytest.approx((S - 1) / (B + S - 1), abs=1e-12)
    assert bubble_fraction(events, S) == pytest.approx(sim.bubble_fraction, abs=1e-12)


def test_bubble_fraction_counts_idle_tracks_and_overlaps_once():
    a = TraceEvent(0, "a", 0.0, 2.0)
    b = TraceEvent(0, "b", 1.0, 3.0)  # overlaps a: the track is busy 0..3 once
    c = TraceEvent(1, "c", 3.0, 4.0)
    assert bubble_fraction([a, b, c], 2) == pytest.approx(1 - 4 / 8)
    assert bubble_fraction([a, b, c], 4) == pytest.approx(1 - 4 / 16)  # two idle tracks
    with pytest.raises(ValueError, match="num_tracks"):
        bubble_fraction([a, b, c], 1)
    with pytest.raises(ValueError, match="end"):
        TraceEvent(0, "x", 2.0, 1.0)


def test_simulated_trace_has_one_event_per_task_with_the_spans_durations(tmp_path):
    S, B = 3, 4
    stages = [StageTiming(1e-3 * (s + 1), 2e-3 * (s + 1), update=5e-4) for s in range(S)]
    sim = simulate(stages, make_schedule("1f1b", S, B))
    events = simulated_events(sim)
    names = {s: f"mesh {s}" for s in range(S)}
    json_path, png_path = write_timeline(
        tmp_path / "sim.json", events, names, title="sim", process_name="test"
    )
    assert (json_path, png_path) == (tmp_path / "sim.json", tmp_path / "sim.png")
    xs, threads = _load(json_path)
    assert threads == names
    assert len(xs) == S * B * 2 + S  # every forward, backward and update
    assert sorted(e["cat"] for e in xs) == sorted(["fwd", "bwd"] * S * B + ["update"] * S)
    for x, span in zip(xs, sim.spans, strict=True):
        assert x["tid"] == span.stage
        assert x["dur"] == pytest.approx((span.end - span.start) * 1e6, rel=1e-12)
        assert x["ts"] == pytest.approx(span.start * 1e6, rel=1e-12)
        if span.kind != "update":
            assert x["name"] == f"{'F' if span.kind == 'fwd' else 'B'}{span.micro_batch}"
            assert x["args"]["micro_batch"] == span.micro_batch
    assert png_path.read_bytes()[:8] == PNG_MAGIC


def test_chrome_trace_names_every_track_once_and_the_process():
    events = [TraceEvent(2, "x", 0.0, 1e-6, "fwd", {"micro_batch": 0})]
    trace = chrome_trace(events, {0: "mesh 0", 1: "mesh 1"}, process_name="proc")
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == ["proc"]
    threads = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {0: "mesh 0", 1: "mesh 1", 2: "track 2"}  # unnamed track 2 still listed
    (x,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (x["tid"], x["ts"], x["dur"], x["cat"]) == (2, 0.0, pytest.approx(1.0), "fwd")


def test_plot_timeline_labels_wide_bars_with_their_micro_batch():
    sim = simulate([StageTiming(1.0, 2.0)] * 2, make_schedule("gpipe", 2, 3))
    ax = plot_timeline(simulated_events(sim), title="gpipe")
    labels = sorted(t.get_text() for t in ax.texts)
    assert labels == sorted(["0", "1", "2"] * 4)  # 2 stages x (F, B) x 3 micro-batches
    assert "bubble 25.0%" in ax.get_title()  # (S - 1) / (B + S - 1) = 1/4
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


# ---------------------------------------------------------------------- measured


@pytest.fixture(scope="module")
def mlp():
    """A 2-stage, 4-micro-batch 1F1B MLP on cpu-1x8 (two 1x4 meshes) and its arguments."""
    alpa_mini.shutdown()
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    params, data = marked_mlp_args(4, 16, 32)
    opt = adam(1e-2, eps=1e-3)
    method = PipeshardParallel(  # a program per task: the trace shows F/B per micro-batch
        num_micro_batches=4,
        stage_option=UniformStageOption(2, (1, 4)),
        pipeline_schedule="1f1b",
        fuse_programs=False,
    )
    step = alpa_mini.parallelize(
        make_train_step(marked_mlp_loss, opt, alpa_mini.value_and_grad), method=method
    )
    args = (params, opt.init(params), data)
    return step.get_executable(*args), args


def test_measured_trace_holds_the_runtime_timings(mlp, tmp_path):
    ex, args = mlp
    timings = ex.trace(tmp_path / "t.json", *args)
    assert [t.index for t in timings] == list(range(len(ex.compiled.stream)))
    xs, threads = _load(tmp_path / "t.json")
    assert len(threads) == ex.plan.num_stages == 2
    assert threads == {
        0: "mesh 0 (stage 0, devices 0-3)",
        1: "mesh 1 (stage 1, devices 4-7)",
    }
    # One event per timed instruction: the runtime's measured interval, not the simulator's.
    assert len(xs) == len(timings)
    t0 = timings[0].start
    for x, t in zip(xs, timings, strict=True):
        assert x["args"]["index"] == t.index
        assert x["tid"] == t.instruction.mesh
        assert x["dur"] == pytest.approx((t.end - t.start) * 1e6, rel=1e-9, abs=1e-6)
        assert x["ts"] == pytest.approx((t.start - t0) * 1e6, rel=1e-9, abs=1e-6)
    assert min(x["ts"] for x in xs) == 0.0
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG_MAGIC
    # Forward / backward runs carry the simulator's names and their program.
    runs = [x for x in xs if x["cat"] in ("fwd", "bwd")]
    assert len(runs) == 2 * 2 * 4
    for x in runs:
        program = x["args"]["program"]
        # (a stage's first backward, bwd{s}.0, starts its gradient accumulators)
        assert program.split(".")[0] == f"{x['cat']}{x['tid']}"
        assert x["name"] == f"{'F' if x['cat'] == 'fwd' else 'B'}{x['args']['micro_batch']}"
    assert [x["tid"] for x in xs if x["cat"] == "update"] == [0, 1]  # one apply per stage


def test_measured_and_simulated_traces_name_the_same_tasks_in_the_same_order(mlp, tmp_path):
    ex, args = mlp
    _, timings = ex.profile(*args)
    measured = measured_events(timings)
    sim = ex.plan.timeline(tmp_path / "plan.json")
    simulated = simulated_events(sim)
    for track in range(ex.plan.num_stages):

        def tasks(events, track=track):
            on = [e for e in events if e.track == track and e.category in ("fwd", "bwd")]
            return [e.name for e in sorted(on, key=lambda e: e.start)]

        assert tasks(measured) == tasks(simulated)
        assert len(tasks(measured)) == 2 * 4


def test_plan_timeline_writes_the_simulated_iteration(mlp, tmp_path):
    ex, _ = mlp
    plan = ex.plan
    sim = plan.timeline(tmp_path / "plan.json")
    expected = simulate_plan(plan, ClusterSpec.named("cpu-1x8"))
    assert sim.iteration_time == expected.iteration_time
    assert sim.spans == expected.spans
    xs, threads = _load(tmp_path / "plan.json")
    assert threads == mesh_track_names(plan)
    assert len(threads) == plan.num_stages
    assert len(xs) == len(sim.spans) == plan.num_stages * plan.num_micro_batches * 2
    assert max(x["ts"] + x["dur"] for x in xs) == pytest.approx(sim.iteration_time * 1e6)
    assert (tmp_path / "plan.png").read_bytes()[:8] == PNG_MAGIC
    # Without transfers, and a cluster given by name; no PNG when asked for none.
    bare = plan.timeline(tmp_path / "bare.json", "cpu-2x4", png=False, transfers=False)
    assert bare.iteration_time == pytest.approx(plan.predicted_time, rel=1e-12)
    assert (tmp_path / "bare.json").exists() and not (tmp_path / "bare.png").exists()


def test_plan_timeline_names_the_cluster_it_cannot_resolve(mlp, tmp_path):
    ex, _ = mlp
    # A plan file saved before plans stored their cluster names a cluster that is not bundled.
    custom = dataclasses.replace(ex.plan, cluster="my-own-cluster", cluster_spec=None)
    with pytest.raises(ConfigError, match=r"cluster: the plan file stores no cluster_spec and"):
        custom.timeline(tmp_path / "x.json")
    with pytest.raises(ConfigError, match=r"cluster 'no-such-cluster'"):
        ex.plan.timeline(tmp_path / "x.json", "no-such-cluster")
    with pytest.raises(ConfigError, match="cluster: expected"):
        ex.plan.timeline(tmp_path / "x.json", 3)
    # The plan's own (bundled) cluster name is not needed when a ClusterSpec is given.
    sim = custom.timeline(tmp_path / "y.json", ClusterSpec.named("cpu-1x8"), png=False)
    assert sim.iteration_time == simulate_plan(ex.plan, ClusterSpec.named("cpu-1x8")).iteration_time
    assert not (tmp_path / "x.json").exists()


def test_a_plan_carries_its_cluster(mlp, tmp_path):
    """A plan made for a cluster that is not bundled (e.g. init("local")'s "detected-...")
    simulates on that cluster by itself, also from its JSON, whatever alpa_mini.init says."""
    ex, _ = mlp
    lab = dataclasses.replace(ClusterSpec.named("cpu-2x4"), name="my-lab")
    plan = dataclasses.replace(ex.plan, cluster="my-lab", cluster_spec=lab)
    plan = PipeshardPlan.from_json(plan.to_json())
    assert plan.cluster_spec == lab
    sim = plan.timeline(tmp_path / "lab.json", png=False)
    assert sim.spans == simulate_plan(plan, lab).spans
    # two hosts: the activations cross the slower inter-host link, so cpu-1x8 differs
    assert sim.iteration_time > simulate_plan(plan, ClusterSpec.named("cpu-1x8")).iteration_time
    assert ex.plan.cluster_spec == ClusterSpec.named("cpu-1x8")  # what it was planned for
