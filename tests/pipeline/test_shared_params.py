"""A stage holding both readers of a shared parameter (GPT's tied embedding: the first layer
and the LM head) re-plans one of them to read it as the other does
(``compose.align_shared``) where that beats resharding it every micro-batch; the plan still
runs and equals serial JAX."""

from __future__ import annotations

import contextvars
import dataclasses
import math
import sys
import threading

import numpy as np
import pytest
from test_pipeshard import _gpt_case, _run

import alpa_mini
from alpa_mini import ClusterSpec, PipeshardParallel, UniformStageOption
from alpa_mini.models import make_train_step, sgd
from alpa_mini.pipeline import compose, stage_search
from helpers.floors import explore_every_pair


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


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_the_stage_dp_ranks_ranges_holding_both_readers_by_a_bound_of_aligning_them(
    monkeypatch, four_devices
):
    """Until the stage DP picks a range holding both readers, it ranks it by the least
    latency and memory of ``bound_alignments``' bounds, which are below the composition
    ``align_shared`` then makes (checked for every such range on every mesh). So auto
    stages are at least as fast as one aligned stage on the whole cluster (a DP that priced
    that slicing resharded could prefer a slower one), and the DP's objective is the plan's
    predicted time."""
    gaps = []
    real = stage_search.bound_alignments

    def checking(model, table, starts, ends, sub, config):
        real(model, table, starts, ends, sub, config)
        if not table.optimistic:
            return
        a, b = table.optimistic[0][:2]
        before = {i: compose._best_row(table, i)[0] for i in range(a + 1)}
        assert all(r[b - i].bound for i, r in before.items())
        compose.align_shared(model, table, starts, ends, sub, config, 0, len(starts) - 1)
        for i, bounds in before.items():
            for j, sc in enumerate(compose._best_row(table, i)[0][b - i :], start=b - i):
                assert not sc.bound
                assert bounds[j].latency <= sc.latency + 1e-12
                assert bounds[j].memory(3) <= sc.memory(3) + 1e-6
                gaps.append(sc.latency - bounds[j].latency)

    monkeypatch.setattr(stage_search, "bound_alignments", checking)
    explore_every_pair(monkeypatch)  # every mesh's table made and checked
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    auto = alpa_mini.plan(step, params, opt.init(params), data,
                          method=PipeshardParallel(num_micro_batches=2))  # fmt: skip
    monkeypatch.undo()
    assert len(gaps) >= 5 and max(gaps) > 0
    one = _one_stage_plan(None, aligned=True)
    assert auto.predicted_time <= one.predicted_time + 1e-12
    assert auto.stage_solution.objective == pytest.approx(auto.predicted_time, rel=1e-9)


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_work_given_to_the_settling_runs_once_on_the_callers_thread(four_devices):
    """``WHILE_SETTLING`` (the micro-batch search traces its next counts there) runs once,
    on the planning thread, while the DP's settling (here: aligning the tied embedding's
    readers) runs beside it; the plan is the one made without it."""
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=2)
    plain = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    threads: list[int] = []
    token = stage_search.WHILE_SETTLING.set(lambda: threads.append(threading.get_ident()))
    try:
        hooked = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    finally:
        stage_search.WHILE_SETTLING.reset(token)
    assert threads == [threading.get_ident()]
    assert hooked.predicted_time == plain.predicted_time
    assert [(s.layer_start, s.layer_end, s.logical_shape) for s in hooked.stages] == [
        (s.layer_start, s.layer_end, s.logical_shape) for s in plain.stages
    ]


def test_meanwhile_returns_the_work_and_raises_its_error():
    """``_meanwhile`` runs ``idle`` here while the work runs on a worker thread."""
    seen: list[int] = []
    done = stage_search._meanwhile(
        lambda: threading.get_ident(), lambda: seen.append(threading.get_ident())
    )
    assert seen == [threading.get_ident()] and done != seen[0]

    def fails() -> None:
        raise ValueError("no plan")

    with pytest.raises(ValueError, match="no plan"):
        stage_search._meanwhile(fails, lambda: None)


@pytest.mark.slow  # 16 s: the search planned twice
def test_the_micro_batch_search_traces_each_count_once_some_ahead(monkeypatch, four_devices):
    """While a count settles, the search traces the counts beside it (``trace_ahead``);
    planning one of them then uses that trace: no count is traced twice, and the search
    finds what it finds without tracing ahead."""
    from alpa_mini.pipeline import executable

    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=None)
    counts: list[tuple[int, str]] = []
    real = executable.trace_with_grads

    def counted(fun, avals, roles, b, *args, **kwargs):
        counts.append((b, sys._getframe(1).f_code.co_name))
        return real(fun, avals, roles, b, *args, **kwargs)

    monkeypatch.setattr(executable, "trace_with_grads", counted)
    searched = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    traced = [b for b, _ in counts]
    assert len(traced) == len(set(traced))
    assert any(caller == "trace_ahead" for _, caller in counts)
    planned = [b for b, _ in searched.planning.micro_batches_tried]
    planned += [b for b, _ in searched.planning.micro_batches_dominated]
    assert set(planned) <= set(traced)
    # Without tracing ahead (a variable nothing reads), the same count and plan.
    monkeypatch.setattr(executable, "WHILE_SETTLING", contextvars.ContextVar("unread"))
    plain = alpa_mini.plan(step, params, opt.init(params), data, method=method)
    assert searched.num_micro_batches == plain.num_micro_batches
    assert searched.predicted_time == plain.predicted_time


@pytest.mark.slow  # 3-10 s: the fast lane's 3 minutes (scripts/test)
def test_configs_aligned_alongside_the_chosen_one_leave_the_plan_as_it_was(
    monkeypatch, four_devices
):
    """Aligning the chosen stage's submesh's other configs at once (``ALIGN_ALONGSIDE``)
    only turns bounds into exact costs sooner: aligning none of them or all of them plans
    the same stages at the same predicted time."""
    loss, params, data = _gpt_case(marks=True)
    opt = sgd(0.1)
    step = make_train_step(loss, opt, alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=2)
    plans = []
    for alongside in (0.0, math.inf):
        monkeypatch.setattr(stage_search, "ALIGN_ALONGSIDE", alongside)
        plans.append(alpa_mini.plan(step, params, opt.init(params), data, method=method))
    none, every = plans
    assert every.predicted_time == none.predicted_time
    assert [s.logical_shape for s in every.stages] == [s.logical_shape for s in none.stages]
    # Cells aligned alongside hold their exact cost where the others kept a bound below it.
    a, b = every.stage_problem.cost, none.stage_problem.cost
    both = np.isfinite(a) & np.isfinite(b)
    assert (a[both] >= b[both] - 1e-12).all() and (a[both] > b[both] + 1e-12).any()
