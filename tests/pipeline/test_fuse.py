"""``lower/fuse.py``: stretches of one mesh's instructions run as one program, with the same
results, donating only values nothing reads afterwards and never a step input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from alpa_mini.pipeline.lower.apply_grad import Unjitted
from alpa_mini.pipeline.lower.fuse import fuse_stream, fused_name
from alpa_mini.runtime.instructions import Accumulate, Free, Put, Run
from alpa_mini.runtime.local import LocalRuntime


def _programs():
    return {
        "seed0": jax.jit(lambda: (jnp.full((4,), 0.5),)),
        "add0": jax.jit(lambda a, b: (a + b,)),
        "mul0": jax.jit(lambda x: (x * 3.0,)),
        "mul1": jax.jit(lambda x: (x * 5.0,)),
    }


def _stream():
    """Mesh 0 makes a seed, adds it to a step input twice (two stretches, split by a put to
    mesh 1 of the first sum), mesh 1 reads that sum after the second stretch."""
    return [
        Put("arg0", "a@0", 0, "l0"),
        Put("arg0", "a2@0", 0, "l0"),  # the same input on the same layout: one live-in
        Run("seed0", (), ("seed",), 0),
        Accumulate("seed", "ct0", 0, True),
        Run("add0", ("ct0", "a@0"), ("acc",), 0),
        Free(("ct0",), 0),
        Put("acc", "acc@1", 1, "l1"),
        Accumulate("seed", "ct1", 0, True),
        Run("add0", ("ct1", "acc"), ("acc2",), 0),
        Run("add0", ("acc2", "a2@0"), ("acc3",), 0),
        Accumulate("acc3", "acc2", 0, False),
        Run("mul0", ("acc2",), ("out0",), 0),
        Free(("ct1", "seed", "acc", "acc2", "acc3", "a@0", "a2@0"), 0),
        Run("mul1", ("acc@1",), ("out1",), 1),
    ]


def _run(programs, stream):
    devices = jax.devices()
    layouts = {
        "l0": NamedSharding(jax.sharding.Mesh(devices[:1], ("x",)), PartitionSpec()),
        "l1": NamedSharding(jax.sharding.Mesh(devices[1:2], ("x",)), PartitionSpec()),
    }
    jitted = {
        n: jax.jit(p.fn, donate_argnums=p.donate) if isinstance(p, Unjitted) else p
        for n, p in programs.items()
    }
    runtime = LocalRuntime(jitted, layouts, jnp.add)
    arg = jnp.arange(4.0)
    buffers = runtime.execute(stream, {"arg0": arg})
    return arg, {n: np.asarray(buffers[n]) for n in ("out0", "out1")}


def test_fused_stream_computes_what_the_stream_computes():
    plain = _run(_programs(), _stream())[1]
    programs = _programs()
    fused, parts = fuse_stream(programs, _stream(), ["out0", "out1"])
    arg, got = _run(programs, fused)
    for name in plain:
        np.testing.assert_array_equal(got[name], plain[name])
    assert not arg.is_deleted()  # a step input is never consumed by a fused program
    runs = [i for i in fused if isinstance(i, Run)]
    assert [r.program for r in runs] == [
        "seed0+add0",
        "add0*2+acc+mul0",
        "mul1",
    ], fused
    assert parts["add0*2+acc+mul0"] == ("add0", "add0", "mul0")
    # The twin put of arg0 is gone: the second stretch reads a@0 for both.
    assert not any(isinstance(i, Put) and i.dst == "a2@0" for i in fused)
    assert "mul0" not in programs and "mul1" in programs  # runs only inside a fused program


def test_fused_programs_consume_only_what_nothing_reads_later():
    programs = _programs()
    fused, _ = fuse_stream(programs, _stream(), ["out0", "out1"])
    second = next(i for i in fused if isinstance(i, Run) and i.program.startswith("add0*2"))
    donated = {second.inputs[k] for k in programs[second.program].donate}
    # seed: dead after this stretch. acc: its put to mesh 1 may share its array and is read
    # later. a@0: a step input (donate_inputs decides those).
    assert donated == {"seed"}, second
    # Frees keep their mesh, after the fused run.
    frees = [i for i in fused if isinstance(i, Free)]
    assert all(f.mesh == 0 for f in frees)
    assert {"seed", "acc", "a@0"} <= {n for f in frees for n in f.names}


def test_fused_names_count_repeated_programs():
    assert fused_name(["fwd1", "acc", "bwd1"]) == "fwd1+acc+bwd1"
    assert fused_name(["fwd0", "fwd0", "bwd0", "acc", "bwd0", "acc"]) == "fwd0*2+bwd0*2+acc*2"
