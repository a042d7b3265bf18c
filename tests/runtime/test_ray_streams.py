"""Splitting a pipeshard instruction stream over Ray host workers (no Ray needed): every
host can run its part, every buffer is where it is read, and the hosts of a mesh that spans
hosts meet at its collectives in one order (no deadlock)."""

from __future__ import annotations

import jax
import pytest

import alpa_mini
from alpa_mini import ClusterSpec, ConfigError, PipeshardParallel, UniformStageOption
from alpa_mini.models import GPTConfig, adam, gpt_loss, init_gpt, make_gpt_batch, make_train_step
from alpa_mini.pipeline.ray_driver import split_stream, stage_hosts
from alpa_mini.runtime.instructions import Accumulate, Free, Put, Recv, Run, Send

GPT = GPTConfig(
    vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=4, pipeline_marks=True
)
OPT = adam(1e-2, eps=1e-3)


@pytest.fixture(scope="module")
def compiled():
    """A 4-stage GPipe stream of a GPT step (tied embedding: stage 0 and the last stage both
    read it), compiled by the local path on 8 simulated devices."""
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    params = init_gpt(GPT, jax.random.PRNGKey(1))
    batch = make_gpt_batch(GPT, jax.random.PRNGKey(2), 8)
    step = alpa_mini.parallelize(
        make_train_step(lambda p, b: gpt_loss(p, b, GPT), OPT, alpa_mini.value_and_grad),
        method=PipeshardParallel(
            num_micro_batches=2,
            stage_option=UniformStageOption(4, (1, 2)),
            pipeline_schedule="gpipe",
        ),
    )
    ex = step.get_executable(params, OPT.init(params), batch)
    return ex.compiled


def _simulate(split, stage_host, out_names):
    """Run every host's stream as the workers would: a ``Recv`` waits for its ``Send``, and
    an instruction on a mesh spanning hosts waits until all its hosts reach it (an SPMD
    program is one collective launch). Checks every read against what the host holds.
    Returns what each host holds at the end; fails on a deadlock or a missing buffer."""
    streams = split.streams
    held = {h: set(split.needs[h]) for h in streams}
    pos = dict.fromkeys(streams, 0)
    sent: set[tuple[str, int]] = set()

    def reads(ins):
        if isinstance(ins, Run):
            return ins.inputs
        if isinstance(ins, Put | Send):
            return (ins.src,)
        if isinstance(ins, Accumulate):
            return (ins.src,) if ins.first else (ins.src, ins.dst)
        return ()

    def ready(h, ins):
        if isinstance(ins, Recv):
            return (ins.tag, h) in sent
        members = stage_host[ins.mesh]
        if len(members) > 1 and isinstance(ins, Run | Put | Accumulate):
            return all(pos[m] < len(streams[m]) and streams[m][pos[m]] == ins for m in members)
        return True

    def apply(h, ins):
        missing = [n for n in reads(ins) if n not in held[h]]
        assert not missing, f"host {h} reads {missing} in {ins} without holding them"
        if isinstance(ins, Send):
            sent.add((ins.tag, ins.to))
        elif isinstance(ins, Recv):
            held[h].add(ins.dst)
        elif isinstance(ins, Run):
            held[h].update(ins.outputs)
        elif isinstance(ins, Put | Accumulate):
            held[h].add(ins.dst)
        elif isinstance(ins, Free):
            held[h].difference_update(ins.names)

    while any(pos[h] < len(streams[h]) for h in streams):
        moved = False
        for h in streams:
            if pos[h] >= len(streams[h]):
                continue
            ins = streams[h][pos[h]]
            if not ready(h, ins):
                continue
            members = stage_host[ins.mesh]
            lockstep = len(members) > 1 and isinstance(ins, Run | Put | Accumulate)
            for m in members if lockstep else (h,):
                apply(m, ins)
                pos[m] += 1
            moved = True
        stuck = [(h, streams[h][pos[h]]) for h in streams if pos[h] < len(streams[h])]
        assert moved, f"deadlock at {stuck}"
    for name in out_names:
        if name is not None and not name.startswith("arg"):
            assert split.where[name], name
            assert all(name in held[h] for h in split.where[name])
    return held


@pytest.mark.parametrize(
    "stage_host",
    [
        ((0,), (0,), (1,), (1,)),  # one host per stage pair: the plain cross-host case
        ((0, 1), (2,), (2,), (0, 1)),  # the tied embedding lives on a mesh spanning hosts
        ((0,), (1, 2), (1, 2), (0,)),  # consecutive stages on the same spanning hosts
        ((0, 1, 2), (3,), (0,), (1, 2, 3)),  # overlapping host sets
    ],
)
def test_split_streams_run_to_completion_with_every_read_satisfied(compiled, stage_host):
    split = split_stream(compiled.stream, stage_host, compiled.arg_names)
    _simulate(split, stage_host, compiled.out_names)
    spanning = {m for m, hs in enumerate(stage_host) if len(hs) > 1}
    # A buffer crossing to or from a spanning mesh travels as shards: every holder sends
    # each receiving host its part (under the destination layout); between single hosts a
    # whole copy goes from the one holder to the one receiver.
    crossing = [
        ins
        for ins in compiled.stream
        if isinstance(ins, Put)
        and ins.src in split.mesh_of
        and split.mesh_of[ins.src] != ins.mesh
        and not (len(stage_host[ins.mesh]) == 1 and split.where[ins.src] == stage_host[ins.mesh])
    ]
    sends = [ins for st in split.streams.values() for ins in st if isinstance(ins, Send)]
    expected_piecewise = sum(
        len(stage_host[split.mesh_of[p.src]]) * len(stage_host[p.mesh])
        for p in crossing
        if split.mesh_of[p.src] in spanning or p.mesh in spanning
    )
    assert sum(ins.layout is not None for ins in sends) == expected_piecewise
    assert (expected_piecewise > 0) == bool(spanning)
    # Sends pair one to one with receives, each on its own host.
    sends = sorted(
        (ins.tag, ins.to) for s in split.streams.values() for ins in s if isinstance(ins, Send)
    )
    recvs = sorted(
        (ins.tag, h) for h, s in split.streams.items() for ins in s if isinstance(ins, Recv)
    )
    assert sends == recvs and len(sends) > 0


def test_a_put_within_one_host_or_one_mesh_stays_a_put(compiled):
    stage_host = ((0,), (0,), (0,), (0,))
    split = split_stream(compiled.stream, stage_host, compiled.arg_names)
    assert split.streams[0] == list(compiled.stream)


def test_stage_hosts_refuses_a_spanning_mesh_without_the_group(compiled):
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    plan = alpa_mini.PipeshardPlan.from_json(_one_wide_stage_plan_json())
    with pytest.raises(ConfigError, match=r"stage 0: devices .* span hosts \[0, 1\].*span_hosts"):
        stage_hosts(plan, 4, span_hosts=False)
    assert stage_hosts(plan, 4, span_hosts=True) == [(0, 1)]


def _one_wide_stage_plan_json() -> str:
    params = init_gpt(GPT, jax.random.PRNGKey(1))
    batch = make_gpt_batch(GPT, jax.random.PRNGKey(2), 8)
    plan = alpa_mini.plan(
        make_train_step(lambda p, b: gpt_loss(p, b, GPT), OPT, alpa_mini.value_and_grad),
        params,
        OPT.init(params),
        batch,
        method=PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(1, (2, 4))),
        cluster=ClusterSpec.named("cpu-2x4"),
    )
    return plan.to_json()


def test_shards_travel_once_each_and_assemble_into_any_layout():
    """``pieces_for`` sends each distinct shard once (a shard replicated over an axis goes
    from one of its holders), and ``place`` builds the destination's shards from them."""
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from alpa_mini.runtime.ray_worker import Pieces, pieces_for, place

    devices = np.array(jax.devices()[:8])
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    src = jax.device_put(x, NamedSharding(Mesh(devices.reshape(4, 2), ("x", "y")), P("x")))
    dst = NamedSharding(Mesh(devices[::-1].reshape(2, 4), ("a", "b")), P("b", "a"))
    pieces = pieces_for(src, dst, to=0)
    assert len(pieces.parts) == 4  # 8 shards, 4 distinct
    assert sum(d.nbytes for _, d in pieces.parts) == x.nbytes
    out = place(pieces, dst)
    assert out.sharding == dst
    np.testing.assert_array_equal(np.asarray(out), x)
    # A part missing is an error that says so, not garbage.
    partial = Pieces(pieces.shape, pieces.dtype, pieces.parts[:3])
    with pytest.raises(RuntimeError, match="lacks part of"):
        place(partial, dst)
