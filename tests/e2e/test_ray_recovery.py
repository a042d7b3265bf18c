"""Training on Ray that survives a worker: checkpoints written by the host workers holding
the values, a failed step that leaves the session usable, a stopped and a killed worker
reported within 30 s with the values lost, and the documented recovery (shutdown, init,
restore, continue) ending where an uninterrupted run ends."""

from __future__ import annotations

import functools
import json
import os
import signal
import time

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import AutoLayerOption, PipeshardParallel, UniformStageOption, WorkerFailedError
from alpa_mini.models import make_train_step, sgd
from alpa_mini.models.gpt import GPTConfig, gpt_loss, init_gpt, make_gpt_batch

pytestmark = pytest.mark.slow

GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=4, scan_layers=True)
OPT = sgd(0.1)
_loss = functools.partial(gpt_loss, config=GPT)


def _step():
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=AutoLayerOption(2), stage_option=UniformStageOption(2)
    )
    return alpa_mini.parallelize(
        make_train_step(_loss, OPT, alpa_mini.value_and_grad), method=method
    )


def _serial(steps: int):
    params, batch = init_gpt(GPT, jax.random.key(0)), make_gpt_batch(GPT, jax.random.key(1), 8)
    serial = jax.jit(make_train_step(_loss, OPT))
    p, s = params, OPT.init(params)
    for _ in range(steps):
        p, s, _ = serial(p, s, batch)
    return p, s


def _close(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def _elapsed(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # the test checks which
        return err, time.monotonic() - t0
    return None, time.monotonic() - t0


def test_train_save_lose_a_worker_restore_on_other_hosts_and_continue(tmp_path):
    from alpa_mini.pipeline.ray_driver import RemoteArray, StackedRemoteArray
    from alpa_mini.runtime.ray_worker import Resident

    params, batch = init_gpt(GPT, jax.random.key(0)), make_gpt_batch(GPT, jax.random.key(1), 8)
    alpa_mini.shutdown()
    try:
        alpa_mini.init(cluster="ray", num_hosts=2, num_cpu_devices=4)
        session = alpa_mini.session.ray_session()
        step = _step()
        p, s = params, OPT.init(params)
        for _ in range(2):
            p, s, _ = step(p, s, batch)
        alpa_mini.save_checkpoint(tmp_path, (p, s), step=2)  # in the background
        p, s, _ = step(p, s, batch)  # may overwrite what was saved: the save has its copy
        alpa_mini.session.checkpoint.wait_for_checkpoints()
        manifest = json.loads((tmp_path / "2" / "manifest.json").read_text())
        writers = {part["writer"] for leaf in manifest["leaves"] for part in leaf["parts"]}
        assert writers == {"host_0", "host_1"}  # every value written where it lives

        # A step that fails on one host (an input its worker no longer holds) stops on
        # every host; the next step runs at once.
        ex = step.get_executable(p, s, batch)
        leaves, tree = jax.tree.flatten((p, s))
        k = next(i for i, x in enumerate(leaves) if isinstance(x, RemoteArray)
                 and not isinstance(x, StackedRemoteArray) and x.hosts == (0,))  # fmt: skip
        bad = list(leaves)
        bad[k] = RemoteArray(session, ((0, "gone"),), leaves[k].shape, leaves[k].dtype)
        err, seconds = _elapsed(lambda: step(*jax.tree.unflatten(tree, bad), batch))
        assert isinstance(err, RuntimeError) and "host 0 failed in step" in str(err), err
        assert "ready for the next one" in str(err) and seconds < 15.0
        err, seconds = _elapsed(lambda: step(p, s, batch))
        assert err is None and seconds < 15.0, (err, seconds)

        # A stopped worker: the step and a fetch of what it holds fail naming it, in 30 s.
        pid = session.worker_info[1]["pid"]
        held = next(x for x in jax.tree.leaves(p) if x.hosts == (1,) and x._value is None)
        os.kill(pid, signal.SIGSTOP)
        try:
            err, seconds = _elapsed(lambda: step(p, s, batch))
            assert isinstance(err, WorkerFailedError) and err.host == 1, err
            assert seconds < 30.0, seconds
            err, seconds = _elapsed(lambda: np.asarray(held))
            assert isinstance(err, WorkerFailedError) and err.host == 1, err
            assert held.label in str(err) and seconds < 30.0, (str(err), seconds)
        finally:
            os.kill(pid, signal.SIGKILL)  # then killed: what it held is gone
        err, seconds = _elapsed(lambda: step(p, s, batch))
        assert isinstance(err, WorkerFailedError) and err.host == 1 and seconds < 30.0
        assert any("output[0]" in v for v in err.lost) and held.label in err.lost
        assert "restore_checkpoint" in str(err)
        alpa_mini.shutdown()

        # Recovery on another number of hosts: one host of 8 devices.
        alpa_mini.init(cluster="ray", num_hosts=1, num_cpu_devices=8)
        step = _step()
        layouts = step.input_layouts(params, OPT.init(params), batch)[:2]
        p, s = alpa_mini.restore_checkpoint(tmp_path, target=layouts)
        ex = step.get_executable(p, s, batch)
        flat = jax.tree.leaves((p, s))
        assert all(isinstance(x, RemoteArray) for x in flat)
        args = jax.tree.leaves((p, s, batch))
        used = [
            ex._input(_rows(args[leaf], a, b), h, n)
            for h, need in enumerate(ex.needs)
            for n in need
            for leaf, a, b in [ex.pieces.inputs[int(n[3:])]]
            if leaf < len(flat)
        ]
        assert used
        assert all(isinstance(u, Resident) for u in used)  # restored where the step reads it
        for _ in range(2):
            p, s, _ = step(p, s, batch)
        _close((p, s), _serial(4))
    finally:
        alpa_mini.shutdown()
    # The checkpoint also restores without Ray, onto the default device (sequences come
    # back as lists).
    _close(tuple(alpa_mini.restore_checkpoint(tmp_path)), _serial(2))


def _rows(x, a, b):
    """Rows a:b of a restored stacked value: the piece the step uses in place."""
    if a is None:
        return x
    return next(q for q, start in zip(x.parts, x.starts, strict=False) if start == a)
