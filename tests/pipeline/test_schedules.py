"""Pipeline schedules against invariants: tick counts, dependencies, in-flight bounds, tables."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from alpa_mini.pipeline.schedules import (
    SCHEDULES,
    Schedule,
    Task,
    _asap,
    check_schedule,
    gpipe,
    make_schedule,
    one_f_one_b,
)

GRID = list(itertools.product(range(1, 7), range(1, 9)))
BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def deps(task: Task, num_stages: int) -> list[Task]:
    """Written out here again, independently of the module, from the stated semantics."""
    s, m = task.stage, task.micro_batch
    if task.kind == "fwd":
        return [Task(s - 1, m, "fwd")] if s else []
    return [Task(s, m, "fwd")] + ([Task(s + 1, m, "bwd")] if s + 1 < num_stages else [])


def all_tasks(S: int, B: int) -> set[Task]:
    return {Task(s, m, k) for s in range(S) for m in range(B) for k in ("fwd", "bwd")}


def tick_of(schedule: Schedule) -> dict[Task, int]:
    return {task: t for t, row in enumerate(schedule.ticks) for task in row if task is not None}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("S", "B"), GRID)
def test_grid_invariants(name, S, B):
    sched = make_schedule(name, S, B)
    assert sched.name == name
    assert (sched.num_stages, sched.num_micro_batches) == (S, B)
    assert sched.num_ticks == 2 * (B + S - 1)
    check_schedule(sched)
    counts = Counter(sched.order())
    assert set(counts) == all_tasks(S, B)
    assert set(counts.values()) == {1}
    for t, row in enumerate(sched.ticks):
        assert len(row) == S
        for mesh, task in enumerate(row):
            assert task is None or task.stage == mesh, (t, mesh, task)
    # The first and last ticks are busy: no padding at either end.
    assert any(task is not None for task in sched.ticks[0])
    assert any(task is not None for task in sched.ticks[-1])


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("S", "B"), GRID)
def test_order_respects_dependencies(name, S, B):
    order = make_schedule(name, S, B).order()
    position = {task: i for i, task in enumerate(order)}
    for task in order:
        for dep in deps(task, S):
            assert position[dep] < position[task], (task, dep)
    ticks = tick_of(make_schedule(name, S, B))
    assert [ticks[task] for task in order] == sorted(ticks[task] for task in order)


@pytest.mark.parametrize(("S", "B"), GRID)
def test_in_flight(S, B):
    f1b, gp = one_f_one_b(S, B), gpipe(S, B)
    for mesh in range(S):
        assert f1b.max_in_flight(mesh) <= S - mesh
        assert f1b.max_in_flight(mesh) == min(S - mesh, B)
        assert gp.max_in_flight(mesh) == B
    assert gp.max_in_flight(0) == B


@pytest.mark.parametrize(("S", "B"), GRID)
def test_1f1b_per_mesh_pattern(S, B):
    sched = one_f_one_b(S, B)
    for mesh in range(S):
        warmup = min(S - mesh, B)
        tasks = sched.tasks_of(mesh)
        kinds = "".join(str(task)[0] for task in tasks)
        assert kinds == "F" * warmup + "BF" * (B - warmup) + "B" * warmup
        for kind in ("fwd", "bwd"):
            assert [t.micro_batch for t in tasks if t.kind == kind] == list(range(B))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("S", "B"), GRID)
def test_tasks_are_as_soon_as_possible(name, S, B):
    """Every task starts the tick after the later of its mesh's previous task and its deps."""
    sched = make_schedule(name, S, B)
    ticks = tick_of(sched)
    for mesh in range(S):
        previous = -1
        for task in sched.tasks_of(mesh):
            earliest = max([previous] + [ticks[d] for d in deps(task, S)]) + 1
            assert ticks[task] == earliest, (name, task)
            previous = ticks[task]


@pytest.mark.parametrize(("S", "B"), GRID)
def test_gpipe_closed_form_equals_simulation(S, B):
    per_mesh = [
        [Task(s, m, "fwd") for m in range(B)] + [Task(s, m, "bwd") for m in range(B)]
        for s in range(S)
    ]
    assert gpipe(S, B) == _asap("gpipe", S, B, per_mesh)


def test_exact_tables_two_stages_two_micro_batches():
    def F(s: int, m: int) -> Task:
        return Task(s, m, "fwd")

    def Bw(s: int, m: int) -> Task:
        return Task(s, m, "bwd")

    assert gpipe(2, 2).ticks == (
        (F(0, 0), None),
        (F(0, 1), F(1, 0)),
        (None, F(1, 1)),
        (None, Bw(1, 0)),
        (Bw(0, 0), Bw(1, 1)),
        (Bw(0, 1), None),
    )
    assert one_f_one_b(2, 2).ticks == (
        (F(0, 0), None),
        (F(0, 1), F(1, 0)),
        (None, Bw(1, 0)),
        (Bw(0, 0), F(1, 1)),
        (None, Bw(1, 1)),
        (Bw(0, 1), None),
    )
    assert gpipe(2, 2).to_text() == "mesh 0 | F0 F1 .  .  B0 B1\nmesh 1 | .  F0 F1 B0 B1 ."
    assert one_f_one_b(2, 2).to_text() == "mesh 0 | F0 F1 .  B0 .  B1\nmesh 1 | .  F0 B0 F1 B1 ."


def test_exact_1f1b_table_four_stages():
    expected = "\n".join(
        [
            "mesh 0 | F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 .  B3 .  B4 .  B5",
            "mesh 1 | .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5 .",
            "mesh 2 | .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 .  B5 .  .",
            "mesh 3 | .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .  .  .",
        ]
    )
    assert one_f_one_b(4, 6).to_text() == expected


def test_to_text_pads_wide_cells():
    text = gpipe(1, 11).to_text()
    assert text.startswith("mesh 0 | F0  F1  ")
    assert text.endswith("B9  B10")


def test_task_str_and_validation():
    assert str(Task(2, 3, "fwd")) == "F3"
    assert str(Task(0, 12, "bwd")) == "B12"
    with pytest.raises(ValueError, match="kind"):
        Task(0, 0, "forward")
    with pytest.raises(ValueError, match="micro_batch"):
        Task(0, -1, "fwd")
    with pytest.raises(ValueError, match="stage"):
        Task(True, 0, "fwd")


def _swap(sched: Schedule, i: int, j: int) -> Schedule:
    ticks = list(sched.ticks)
    ticks[i], ticks[j] = ticks[j], ticks[i]
    return dataclasses.replace(sched, ticks=tuple(ticks))


def test_check_schedule_catches_bwd_before_fwd():
    sched = one_f_one_b(2, 2)
    broken = _swap(sched, 1, 2)  # mesh 1 now runs B0 at tick 1, before its F0 at tick 2
    assert broken.ticks[1][1] == Task(1, 0, "bwd")
    with pytest.raises(ValueError, match=r"kind='bwd'.*tick 1.*kind='fwd'.*tick 2"):
        check_schedule(broken)


def test_check_schedule_catches_bwd_before_next_stage_bwd():
    broken = _swap(gpipe(2, 2), 3, 4)  # mesh 0's B0 at tick 3, mesh 1's B0 at tick 4
    with pytest.raises(ValueError, match="does not follow"):
        check_schedule(broken)


def test_check_schedule_catches_missing_duplicate_and_misplaced():
    sched = gpipe(2, 2)
    rows = [list(row) for row in sched.ticks]
    rows[5][0] = None  # drop B1 on stage 0
    with pytest.raises(ValueError, match="missing"):
        check_schedule(dataclasses.replace(sched, ticks=tuple(map(tuple, rows))))
    rows[5][0] = Task(0, 0, "bwd")  # B0 on stage 0 twice
    with pytest.raises(ValueError, match="twice"):
        check_schedule(dataclasses.replace(sched, ticks=tuple(map(tuple, rows))))
    rows = [list(row) for row in sched.ticks]
    rows[2][0] = Task(1, 1, "fwd")  # F1 of stage 1 also on mesh 0
    with pytest.raises(ValueError, match="mesh 0"):
        check_schedule(dataclasses.replace(sched, ticks=tuple(map(tuple, rows))))
    rows = [list(row) for row in sched.ticks]
    rows[2][0] = Task(0, 7, "fwd")
    with pytest.raises(ValueError, match="out of range"):
        check_schedule(dataclasses.replace(sched, ticks=tuple(map(tuple, rows))))


def test_schedule_rejects_ragged_table():
    with pytest.raises(ValueError, match="tick 0"):
        Schedule("gpipe", 2, 1, ((Task(0, 0, "fwd"),),))


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("S", "B"), [(1, 1), (2, 2), (3, 5), (6, 8)])
def test_json_round_trip(name, S, B):
    sched = make_schedule(name, S, B)
    back = Schedule.from_json(sched.to_json())
    assert back == sched
    assert back.to_json() == sched.to_json()
    assert back.ticks[0][0] == Task(0, 0, "fwd")
    broken = _swap(sched, 0, sched.num_ticks - 1)
    assert Schedule.from_json(broken.to_json()) == broken


def test_make_schedule_names():
    assert make_schedule("GPipe", 3, 4) == gpipe(3, 4)
    assert make_schedule("1F1B", 3, 4) == one_f_one_b(3, 4)
    assert make_schedule("1f1b", 3, 4).name == "1f1b"
    with pytest.raises(ValueError, match="pipeline_schedule") as info:
        make_schedule("interleaved", 2, 2)
    assert "'interleaved'" in str(info.value)
    assert all(valid in str(info.value) for valid in SCHEDULES)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        make_schedule(None, 2, 2)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b, lambda S, B: make_schedule("1f1b", S, B)])
@pytest.mark.parametrize("bad", [0, -2, True, 2.0, "2", None])
def test_bad_sizes_name_the_field(builder, bad):
    with pytest.raises(ValueError, match=r"num_stages.*" + repr(bad).replace(".", r"\.")):
        builder(bad, 2)
    with pytest.raises(ValueError, match=r"num_micro_batches.*" + repr(bad).replace(".", r"\.")):
        builder(2, bad)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 16), st.integers(1, 40))
def test_larger_instances(name, S, B):
    sched = make_schedule(name, S, B)
    assert sched.num_ticks == 2 * (B + S - 1)
    check_schedule(sched)
    bound = (lambda mesh: min(S - mesh, B)) if name == "1f1b" else (lambda mesh: B)
    assert [sched.max_in_flight(m) for m in range(S)] == [bound(m) for m in range(S)]
    assert Schedule.from_json(sched.to_json()) == sched
