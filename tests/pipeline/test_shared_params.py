"""A stage holding both readers of a shared parameter (GPT's tied embedding: the first layer
and the LM head) re-plans one of them to read it as the other does
(``compose.align_shared``) where that beats resharding it every micro-batch; the plan still
runs and equals serial JAX."""

from __future__ import annotations

import dataclasses

import pytest
from test_pipeshard import _gpt_case, _run

import alpa_mini
from alpa_mini import ClusterSpec, PipeshardParallel, UniformStageOption
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline import compose, stage_search


def _one_stage_plan(monkeypatch, aligned: bool, profiling: str = "individual"):
    if not aligned:
        monkeypatch.setattr(stage_search, "align_shared", lambda *a, **k: None)
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    option = UniformStageOption(num_stages=1, profiling=profiling)
    method = PipeshardParallel(num_micro_batches=2, stage_option=option)
    plan = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    if monkeypatch is not None:
        monkeypatch.undo()
    return plan


@pytest.fixture
def four_devices():
    alpa_mini.shutdown()
    alpa_mini.init(cluster=dataclasses.replace(ClusterSpec.named("cpu-1x8"), devices_per_host=4))
    yield
    alpa_mini.shutdown()


def test_a_stage_with_both_readers_of_the_tied_embedding_reads_it_in_one_layout(
    monkeypatch, four_devices
):
    plain = _one_stage_plan(monkeypatch, aligned=False)
    aligned = _one_stage_plan(monkeypatch, aligned=True)
    whole = _one_stage_plan(monkeypatch, aligned=True, profiling="whole")
    # Re-planning a reader to take the embedding as the other does beats resharding it
    # there and back every micro-batch; the whole-stage ILP (20 s limit) stays above both.
    assert aligned.predicted_time < plain.predicted_time
    assert aligned.predicted_time < whole.predicted_time


@pytest.mark.slow
def test_an_aligned_stage_runs_and_equals_serial_jax(four_devices):
    loss, params, data = _gpt_case(marks=True)
    option = UniformStageOption(1, profiling="individual")
    method = PipeshardParallel(num_micro_batches=2, stage_option=option)
    ex = _run(loss, params, data, method, steps=1)
    assert ex.plan.num_stages == 1 and ex.plan.stages[0].inner_specs


def test_the_alignment_bound_is_below_every_aligned_composition(monkeypatch, four_devices):
    """``bound_alignments``' rows, which the stage DP ranks ranges holding both readers by
    until it picks one, are below the compositions ``align_shared`` then makes: latency and
    memory, for every range holding both readers, on every mesh of the table."""
    checked = []
    real = stage_search.bound_alignments

    def checking(model, table, starts, ends, sub, config):
        real(model, table, starts, ends, sub, config)
        L = len(starts)
        for a, b, lb in list(table.optimistic):
            compose.align_shared(model, table, starts, ends, sub, config, 0, L - 1)
            for i in range(a + 1):
                bounds = compose._row(lb, i)
                for _, _, aligned in table.aligned:
                    for j, sc in enumerate(compose._row(aligned, i)[b - i :], start=b):
                        assert bounds[j - i].latency <= sc.latency + 1e-12
                        assert bounds[j - i].memory(3) <= sc.memory(3) + 1e-6
                        checked.append(sc.latency - bounds[j - i].latency)

    monkeypatch.setattr(stage_search, "bound_alignments", checking)
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=2)
    alpa_mini.plan(step, params, opt.init(params), data, method=method)
    assert len(checked) >= 10 and max(checked) > 0


def test_the_stage_dp_ranks_a_stage_holding_both_readers_as_aligned(four_devices):
    """Auto stages are at least as fast as one aligned stage on the whole cluster: the DP
    priced the one-stage slicing aligned (a DP that priced it resharded could prefer a slower
    slicing), and its objective is the plan's predicted time."""
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    auto = alpa_mini.plan(step, params, opt.init(params), data,
                          method=PipeshardParallel(num_micro_batches=2))  # fmt: skip
    one = _one_stage_plan(None, aligned=True)
    assert auto.predicted_time <= one.predicted_time + 1e-12
    assert auto.stage_solution.objective == pytest.approx(auto.predicted_time, rel=1e-9)
