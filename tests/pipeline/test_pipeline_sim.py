"""The pipeline simulator against closed forms and hand-worked schedules."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import alpa_mini
from alpa_mini import ClusterSpec, PipeshardParallel, UniformStageOption
from alpa_mini.models import GPTConfig, adam, gpt_loss, init_gpt, make_gpt_batch, make_train_step
from alpa_mini.pipeline.schedules import make_schedule
from alpa_mini.pipeline.simulate import (
    StageTiming,
    chain_timings,
    simulate,
    simulate_plan,
    stage_timings,
)

times = st.lists(st.floats(0.01, 5.0), min_size=1, max_size=6)


@settings(max_examples=150, deadline=None)
@given(forward=times, B=st.integers(1, 12), ratio=st.sampled_from([1.0, 2.0, 3.0]))
def test_gpipe_without_transfers_is_the_closed_form(forward, B, ratio):
    """sum(t) + (B - 1) max(t), t = forward + backward, backward = ratio x forward."""
    stages = [StageTiming(f, ratio * f) for f in forward]
    t = [f * (1 + ratio) for f in forward]
    got = simulate(stages, make_schedule("gpipe", len(forward), B)).iteration_time
    assert got == pytest.approx(sum(t) + (B - 1) * max(t), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(S=st.integers(1, 6), B=st.integers(1, 12), f=st.floats(0.01, 5.0), r=st.floats(0.5, 3))
def test_1f1b_with_equal_stages_is_the_closed_form(S, B, f, r):
    stages = [StageTiming(f, r * f)] * S
    got = simulate(stages, make_schedule("1f1b", S, B)).iteration_time
    assert got == pytest.approx((S + B - 1) * f * (1 + r), rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(forward=times, B=st.integers(1, 12))
def test_1f1b_never_exceeds_the_closed_form(forward, B):
    stages = [StageTiming(f, 2 * f) for f in forward]
    t = [3 * f for f in forward]
    got = simulate(stages, make_schedule("1f1b", len(forward), B)).iteration_time
    assert got <= sum(t) + (B - 1) * max(t) + 1e-9
    assert got >= B * max(t) - 1e-9  # the slowest stage works B micro-batches


def test_hand_worked_two_stage_schedules():
    """S=2, B=2, forward (2, 1), backward (4, 2). GPipe: stage 1's backwards end at 9, stage
    0's at 11 and 15. 1F1B: stage 1 runs F0 B0 F1 B1 = [2,3] [3,5] [5,6] [6,8], so stage 0's
    B0 is [5,9] and B1 [9,13]: 13, below the closed form's 15."""
    stages = [StageTiming(2, 4), StageTiming(1, 2)]
    gpipe = simulate(stages, make_schedule("gpipe", 2, 2))
    one = simulate(stages, make_schedule("1f1b", 2, 2))
    assert gpipe.iteration_time == 15
    assert one.iteration_time == 13
    spans = {(s.stage, s.micro_batch, s.kind): (s.start, s.end) for s in one.spans}
    assert spans[(1, 1, "fwd")] == (5, 6) and spans[(0, 0, "bwd")] == (5, 9)
    # busy 2 * (6 + 6) / 2 stages over 13: the bubble is the rest
    assert one.bubble_fraction == pytest.approx(1 - 18 / 26)


def test_transfers_delay_the_receiver_and_updates_end_the_iteration():
    """F0 [0,1], send 0.5, F1 [1.5,2.5], B1 [2.5,4.5], cotangent 0.25, B0 [4.75,6.75]; then
    stage 0 applies its gradients for 0.5 s."""
    stages = [
        StageTiming(1, 2, send_forward=0.5, update=0.5),
        StageTiming(1, 2, send_backward=0.25),
    ]
    sim = simulate(stages, make_schedule("gpipe", 2, 1))
    assert sim.iteration_time == pytest.approx(7.25)


@pytest.mark.parametrize("schedule,in_flight", [("gpipe", [6, 6, 6]), ("1f1b", [3, 2, 1])])
def test_peak_memory_counts_the_micro_batches_in_flight(schedule, in_flight):
    stages = [StageTiming(1, 2, memory=100.0, residual=10.0)] * 3
    sim = simulate(stages, make_schedule(schedule, 3, 6))
    assert sim.peak_memory == tuple(100.0 + (k - 1) * 10.0 for k in in_flight)


def test_bad_timings_are_named():
    with pytest.raises(ValueError, match=r"StageTiming.backward: -1"):
        StageTiming(1.0, -1.0)
    with pytest.raises(ValueError, match=r"stages: 1 timings for a schedule of 2 stages"):
        simulate([StageTiming(1, 1)], make_schedule("gpipe", 2, 2))


GPT = GPTConfig(
    vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=4, pipeline_marks=True
)


def test_a_planned_gpt_simulates_to_its_prediction_plus_the_activation_transfer():
    """2 stages on cpu-2x4 (one per host), 4 micro-batches of 2: stage 0 sends the hidden
    states, 2 x 16 x 32 fp32 = 4096 bytes per micro-batch, over the inter-host link."""
    opt = adam(1e-2)
    params = jax.eval_shape(lambda: init_gpt(GPT, jax.random.PRNGKey(1)))
    batch = jax.eval_shape(lambda: make_gpt_batch(GPT, jax.random.PRNGKey(2), 8))
    cluster = ClusterSpec.named("cpu-2x4")
    plan = alpa_mini.plan(
        make_train_step(lambda p, b: gpt_loss(p, b, GPT), opt, alpa_mini.value_and_grad),
        params,
        jax.eval_shape(opt.init, params),
        batch,
        method=PipeshardParallel(
            num_micro_batches=4,
            stage_option=UniformStageOption(2, (1, 4)),
            pipeline_schedule="gpipe",
        ),
        cluster=cluster,
    )
    assert [s.out_bytes for s in plan.stages] == [2 * 16 * 32 * 4, 0]
    assert all(s.residual_bytes > 0 for s in plan.stages)
    bare = simulate_plan(plan, cluster, transfers=False)
    assert bare.iteration_time == pytest.approx(plan.predicted_time, rel=1e-12)
    link = cluster.inter_host
    hop = link.alpha + 4096 * link.beta
    timings = stage_timings(plan, cluster)
    assert timings[0].send_forward == pytest.approx(hop)
    assert timings[1].send_backward == pytest.approx(hop)
    full = simulate_plan(plan, cluster)
    # GPipe: the forward chain waits one hop and the backward chain one hop, once each
    assert full.iteration_time == pytest.approx(plan.predicted_time + 2 * hop, rel=1e-9)
    # The plan's summary gives both: what the DP predicted and what the simulator adds.
    both = f"{plan.predicted_time * 1e3:.3f} ms/iter ({full.iteration_time * 1e3:.3f} simulated"
    assert both in plan.summary().title
    # Round trip through JSON keeps what the simulator reads.
    again = alpa_mini.PipeshardPlan.from_json(plan.to_json())
    assert simulate_plan(again, cluster).iteration_time == full.iteration_time
    assert np.isclose(full.peak_memory[1], plan.stages[1].peak_memory + 3 * timings[1].residual)


def test_a_hop_between_meshes_of_several_hosts_shares_the_smaller_sides_links():
    """Each host of a mesh sends its own shards at once, so a boundary's bytes cross as many
    inter-host links as the smaller mesh has hosts; inside one host, the intra-host link."""
    cluster = ClusterSpec.named("dgx-a100").with_hosts(16)
    inter, intra = cluster.inter_host, cluster.intra_host
    hosts = [frozenset(range(4)), frozenset(range(4, 12)), frozenset({12}), frozenset({12})]
    nbytes = [8e9, 6e9, 2e9, 0.0]
    t = chain_timings([1.0] * 4, nbytes, hosts, cluster)
    assert t[0].send_forward == pytest.approx(inter.alpha + 8e9 / 4 * inter.beta)  # 4 vs 8
    assert t[1].send_backward == t[0].send_forward  # the cotangents of the same values
    assert t[1].send_forward == pytest.approx(inter.alpha + 6e9 * inter.beta)  # 8 vs 1
    assert t[2].send_forward == pytest.approx(intra.alpha + 2e9 * intra.beta)  # one host
    assert t[3].send_forward == 0.0 and t[0].send_backward == 0.0
