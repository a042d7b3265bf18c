"""PipeshardParallel on Ray host workers (two simulated hosts x 4 CPU devices): numerics
against serial JAX and the local runtime, cross-host transfers, clear errors."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import time

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    AutoLayerOption,
    AutoStageOption,
    ClusterSpec,
    ConfigError,
    ManualStageOption,
    PipeshardParallel,
    UniformStageOption,
    WorkerFailedError,
)
from alpa_mini.models import (
    GPTConfig,
    adam,
    gpt_loss,
    init_gpt,
    make_gpt_batch,
    make_train_step,
    sgd,
)
from helpers.ray_heads import listening_outside_loopback

pytestmark = pytest.mark.slow

GPT = GPTConfig(
    vocab_size=64, seq_len=16, hidden=32, num_heads=4, num_layers=4, pipeline_marks=True
)
OPT = adam(1e-2, eps=1e-3)


def _loss(p, b):
    return gpt_loss(p, b, GPT)


def _data():
    return init_gpt(GPT, jax.random.PRNGKey(1)), make_gpt_batch(GPT, jax.random.PRNGKey(2), 8)


def _train(method, steps=3, keep=None):
    params, batch = _data()
    train_step = make_train_step(_loss, OPT, alpa_mini.value_and_grad)
    step = alpa_mini.parallelize(train_step, method=method)
    p, s, losses = params, OPT.init(params), []
    for _ in range(steps):
        p, s, loss = step(p, s, batch)
        losses.append(float(loss))
    if keep is not None:
        keep.update(p=p, s=s, batch=batch, loss=loss)
    return step, [np.asarray(x) for x in jax.tree.leaves((p, s))], losses


@functools.cache
def _serial_run() -> tuple[list[np.ndarray], list[float]]:
    """Serial JAX, compiled once for the module: the state after 3 steps, 4 losses."""
    params, batch = _data()
    serial = jax.jit(make_train_step(_loss, OPT))
    p, s, losses = params, OPT.init(params), []
    for i in range(4):
        p, s, loss = serial(p, s, batch)
        losses.append(float(loss))
        if i == 2:
            leaves = [np.asarray(x) for x in jax.tree.leaves((p, s))]
    return leaves, losses


def _serial() -> tuple[list[np.ndarray], list[float]]:
    """What ``_train`` (3 steps) gives on serial JAX: the final state and the losses."""
    leaves, losses = _serial_run()
    return leaves, losses[:3]


METHODS = {
    "2 stages, 1F1B": PipeshardParallel(
        num_micro_batches=4, stage_option=UniformStageOption(2, (1, 4), (2, 2))
    ),
    # The DP picks 4 stages of (1, 2): two meshes per host worker.
    "auto stages, GPipe": PipeshardParallel(
        num_micro_batches=4, stage_option=AutoStageOption(), pipeline_schedule="gpipe"
    ),
}


@pytest.fixture(scope="module")
def ray_results(tmp_path_factory):
    """Train every method on Ray (one embedded head for the module), then locally; trace
    one more step of the first method; then, in the same session, the worker failures."""
    alpa_mini.shutdown()
    results = {}
    try:
        alpa_mini.init(cluster="ray", num_hosts=2, num_cpu_devices=4)
        from alpa_mini.pipeline.ray_driver import RemoteArray
        from alpa_mini.runtime.ray_worker import Resident

        for name, method in METHODS.items():
            kept: dict = {}
            step, leaves, losses = _train(method, keep=kept)
            ex = step.get_executable(kept["p"], kept["s"], kept["batch"])
            state = jax.tree.leaves((kept["p"], kept["s"]))
            flat = jax.tree.leaves((kept["p"], kept["s"], kept["batch"]))
            # Parameters and optimiser state stay on their workers: a worker reading one
            # that lives there gets a reference to its own copy; data is sent only to a
            # worker where it does not live (a tied embedding read by the last stage).
            sent = [
                (x.host == h, isinstance(ex._input(x, h, n), Resident))
                for h, need in enumerate(ex.needs)
                for n in need
                for x in [flat[int(n[3:])]]
                if int(n[3:]) < len(state)
            ]
            results[name] = {
                "ray": (leaves, losses),
                "plan": ex.plan,
                "handles": all(isinstance(x, RemoteArray) for x in [*state, kept["loss"]]),
                "resident": sum(ref for _, ref in sent) > len(sent) // 2
                and all(here == ref for here, ref in sent),
            }
            if name == "2 stages, 1F1B":
                path = tmp_path_factory.mktemp("ray_trace") / "step.json"
                timings = ex.trace(path, kept["p"], kept["s"], kept["batch"])
                outs, _ = ex.profile(kept["p"], kept["s"], kept["batch"])
                results["trace"] = {
                    "timings": timings,
                    "path": path,
                    "loss": float(outs[2]),
                    "stage_host": ex.stage_host,
                }
                first_step = step
        results["scanned"] = _scanned_on_ray()
        results["row_loop"] = _row_loop_on_ray()
        results["keys"] = _keys_on_ray(tmp_path_factory.mktemp("ray_keys"))
        # Last, as it kills a worker: the errors, in the same session.
        results["errors"] = _worker_failures(first_step)
    finally:
        alpa_mini.shutdown()
    from helpers.ray_heads import gone

    results["errors"]["gone"] = gone(results["errors"].get("pids", []))
    alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4"))
    for name in METHODS:  # the very plan Ray ran, replayed by the local runtime
        _, leaves, losses = _train(PipeshardParallel.from_plan(results[name]["plan"]))
        results[name]["local"] = (leaves, losses)
    return results


def _args():
    params, batch = _data()
    return params, OPT.init(params), batch


SCANNED = dataclasses.replace(GPT, pipeline_marks=False, scan_layers=True)


def _scanned_loss(p, b):
    return gpt_loss(p, b, SCANNED)


def _scanned_on_ray() -> dict:
    """A scanned GPT cut into two stages (one per host), two SGD steps."""
    from alpa_mini.pipeline.ray_driver import StackedRemoteArray

    params = init_gpt(SCANNED, jax.random.PRNGKey(1))
    batch = make_gpt_batch(SCANNED, jax.random.PRNGKey(2), 8)
    opt = sgd(0.1)
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=AutoLayerOption(2), stage_option=UniformStageOption(2)
    )
    step = alpa_mini.parallelize(
        make_train_step(_scanned_loss, opt, alpa_mini.value_and_grad), method=method
    )
    p, s = params, opt.init(params)
    for _ in range(2):
        p, s, _ = step(p, s, batch)
    stacked = jax.tree.leaves(p["layers"])
    return {
        "got": [np.asarray(x) for x in jax.tree.leaves(p)],
        "stacked": all(isinstance(x, StackedRemoteArray) for x in stacked),
        "hosts": {h for x in stacked for h in x.hosts},
        "params": params,
        "batch": batch,
    }


def _row_loop_loss(p, b):
    """A Python loop over a stacked weight (``w[i]``): split into its rows at the edge."""
    x = b["x"]
    for i in range(p["w"].shape[0]):
        x = jax.numpy.tanh(x @ p["w"][i])
    return jax.numpy.mean((x - b["y"]) ** 2)


def _row_loop_on_ray() -> dict:
    """Two SGD steps of ``_row_loop_loss`` in two stages, one per host."""
    k = jax.random.split(jax.random.PRNGKey(5), 3)
    params = {"w": jax.random.normal(k[0], (4, 8, 8)) * 0.4}
    batch = {"x": jax.random.normal(k[1], (8, 8)), "y": jax.random.normal(k[2], (8, 8))}
    opt = sgd(0.1)
    method = PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(2))
    step = alpa_mini.parallelize(
        make_train_step(_row_loop_loss, opt, alpa_mini.value_and_grad), method=method
    )
    p, s = params, opt.init(params)
    for _ in range(2):
        p, s, _ = step(p, s, batch)
    plan = step.get_executable(p, s, batch).plan
    return {"got": np.asarray(p["w"]), "rows": plan.row_splits, "params": params, "batch": batch}


def _key_step(value_and_grad):
    """An SGD step that draws its noise from a typed key argument and returns the next key."""
    opt = sgd(0.1)

    def loss(p, b, key):
        noise = 0.01 * jax.random.normal(key, (GPT.hidden,))
        return gpt_loss(p, b, GPT) + jax.numpy.sum(noise * p["ln_f"]["scale"])

    def step(params, opt_state, batch, key):
        key, sub = jax.random.split(key)
        value, grads = value_and_grad(loss)(params, batch, sub)
        params, opt_state = opt.update(grads, opt_state, params)
        return params, opt_state, key, value

    return step, opt


def _keys_on_ray(ckpt) -> dict:
    """Two SGD steps of ``_key_step`` on two hosts, the key passed and returned each step;
    then the state and key saved, restored where the step reads them, and one more step."""
    params, batch = _data()
    step_fn, opt = _key_step(alpa_mini.value_and_grad)
    method = PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(2))
    step = alpa_mini.parallelize(step_fn, method=method)
    p, s, key = params, opt.init(params), jax.random.key(3, impl="rbg")
    for _ in range(2):
        p, s, key, loss = step(p, s, batch, key)
    layouts = step.input_layouts(p, s, batch, key)
    slots = jax.tree.leaves(layouts)
    alpa_mini.save_checkpoint(ckpt, (p, s, key), step=2, wait=True)
    p, s, key = alpa_mini.restore_checkpoint(ckpt, target=(layouts[0], layouts[1], layouts[3]))
    p, s, key, loss = step(p, s, batch, key)
    return {
        "got": [np.asarray(x) for x in jax.tree.leaves(p)],
        "key": key,
        "loss": float(loss),
        "slots": (type(slots[-1]).__name__, slots[-1].dtype, type(slots[0]).__name__),
    }


def test_a_typed_key_argument_travels_to_the_workers_as_its_data(ray_results):
    r = ray_results["keys"]
    step_fn, opt = _key_step(jax.value_and_grad)
    serial = jax.jit(step_fn)
    params, batch = _data()
    p, s, key = params, opt.init(params), jax.random.key(3, impl="rbg")
    for _ in range(3):
        p, s, key, loss = serial(p, s, batch, key)
    for a, b in zip(jax.tree.leaves(p), r["got"], strict=True):
        np.testing.assert_allclose(b, np.asarray(a), atol=1e-6, rtol=0)
    assert r["loss"] == pytest.approx(float(loss), abs=1e-6)
    # The key comes back a key of its own implementation, with the same bits.
    assert str(jax.random.key_impl(r["key"])) == "rbg"
    np.testing.assert_array_equal(jax.random.key_data(r["key"]), jax.random.key_data(key))
    # A checkpoint target reads the key on the driver (and restores it a key, as the third
    # step above shows); arrays are read on the workers.
    assert r["slots"][:2] == ("ShapeDtypeStruct", r["key"].dtype)
    assert r["slots"][2] == "RemoteSlot"


def _serial_params(loss, r: dict, steps: int = 2):
    """The parameters after ``steps`` SGD steps of serial JAX from ``r``'s params and batch."""
    opt = sgd(0.1)
    serial = jax.jit(make_train_step(loss, opt))
    p, s = r["params"], opt.init(r["params"])
    for _ in range(steps):
        p, s, _ = serial(p, s, r["batch"])
    return p


def test_a_scanned_stack_cut_over_two_hosts_equals_serial_jax(ray_results):
    r = ray_results["scanned"]
    p = _serial_params(_scanned_loss, r)
    for a, b in zip(r["got"], jax.tree.leaves(p), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-6)
    # Each stacked leaf comes back as one handle whose rows stay on both hosts' workers.
    assert r["stacked"] and r["hosts"] == {0, 1}


def test_a_stack_read_row_by_row_is_split_over_two_hosts_and_equals_serial_jax(ray_results):
    r = ray_results["row_loop"]
    p = _serial_params(_row_loop_loss, r)
    np.testing.assert_allclose(r["got"], np.asarray(p["w"]), rtol=1e-6, atol=1e-6)
    assert [x.lengths for x in r["rows"]] == [(1, 1, 1, 1)]


@pytest.mark.parametrize("name", list(METHODS))
def test_ray_steps_equal_serial_jax_and_the_local_runtime(ray_results, name):
    r = ray_results[name]
    leaves, losses = r["ray"]
    s_leaves, s_losses = _serial()
    np.testing.assert_allclose(losses, s_losses, rtol=2e-5)
    for a, b in zip(leaves, s_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
    l_leaves, l_losses = r["local"]
    np.testing.assert_allclose(losses, l_losses, rtol=1e-6)
    for a, b in zip(leaves, l_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The stages really sit on both simulated hosts, so activations crossed between workers.
    hosts = {d // 4 for s in r["plan"].stages for d in s.devices}
    assert hosts == {0, 1}
    assert all(len({d // 4 for d in s.devices}) == 1 for s in r["plan"].stages)
    assert r["handles"] and r["resident"]


def test_ray_trace_times_every_instruction_on_every_host(ray_results):
    """``trace`` on Ray: every worker's stream is timed once, in order; a ``Recv`` ends
    after its ``Send`` starts; the two hosts' programs overlap in time (they run side by
    side, unlike the local runtime's profile); the trace file holds one event per timing on
    the plan's mesh tracks; and a timed step computes what serial JAX does."""
    import json

    from alpa_mini.inspect.timeline import mesh_track_names
    from alpa_mini.runtime.instructions import Recv, Run, Send

    r = ray_results["trace"]
    timings, plan = r["timings"], ray_results["2 stages, 1F1B"]["plan"]
    by_host: dict[int, list] = {}
    for t in timings:
        by_host.setdefault(t.host, []).append(t)
    assert sorted(by_host) == [0, 1] and r["stage_host"] == ((0,), (1,))
    for host, ts in by_host.items():
        ts.sort(key=lambda t: t.index)
        assert [t.index for t in ts] == list(range(len(ts)))
        for a, b in itertools.pairwise(ts):
            assert a.start <= a.end <= b.start  # back to back on one worker
        assert {t.instruction.mesh for t in ts if isinstance(t.instruction, Run)} == {host}
    sends = {t.instruction.tag: t for t in timings if isinstance(t.instruction, Send)}
    recvs = {t.instruction.tag: t for t in timings if isinstance(t.instruction, Recv)}
    assert sends and set(sends) == set(recvs)
    assert all(recvs[tag].end >= sends[tag].start for tag in sends)
    runs = {
        h: [(t.start, t.end) for t in by_host[h] if isinstance(t.instruction, Run)] for h in (0, 1)
    }
    overlap = sum(max(0.0, min(e0, e1) - max(s0, s1)) for s0, e0 in runs[0] for s1, e1 in runs[1])
    assert overlap > 0
    trace = json.loads(r["path"].read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }
    assert threads == mesh_track_names(plan)
    assert len(xs) == len(timings)  # one host per mesh: every timing is shown
    t0 = min(t.start for t in timings)
    shown = {(x["args"]["host"], x["args"]["index"]): x for x in xs}
    for t in timings:
        x = shown[(t.host, t.index)]
        assert x["tid"] == t.instruction.mesh
        assert x["dur"] == pytest.approx((t.end - t.start) * 1e6, rel=1e-9, abs=1e-6)
        assert x["ts"] == pytest.approx((t.start - t0) * 1e6, rel=1e-9, abs=1e-6)
    assert r["path"].with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _, s_losses = _serial_run()  # the traced step is the fourth
    assert r["loss"] == pytest.approx(s_losses[3], rel=2e-5)


#: Stage 0 spans hosts 0 and 1 (two workers x 4 CPU devices, one jax.distributed group);
#: stage 1 is host 2. Activations and cotangents cross between the two meshes.
SPANNING = PipeshardParallel(
    num_micro_batches=4,
    stage_option=ManualStageOption(((0, 1, 2), (3, 4)), ((2, 4), (1, 4)), ((2, 4), (2, 2))),
)

_REPLAY = """
import sys
import numpy as np
import alpa_mini
from alpa_mini import ClusterSpec, PipeshardParallel, PipeshardPlan
from test_ray_runtime import _train
alpa_mini.init(cluster=ClusterSpec.named("cpu-2x4").with_hosts(3), num_cpu_devices=12)
plan = PipeshardPlan.from_json(open(sys.argv[1]).read())
_, leaves, losses = _train(PipeshardParallel.from_plan(plan))
np.savez(sys.argv[2], np.array(losses), *leaves)
"""


def test_a_stage_mesh_spanning_two_hosts_equals_serial_jax_and_the_local_runtime(tmp_path):
    """Three simulated hosts in one jax.distributed group; stage 0's mesh is hosts 0 and 1.
    3 Adam steps equal serial JAX and the local runtime replaying the same plan (12 devices,
    in a subprocess); stage 0's state stays sharded over both hosts and is used in place."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from alpa_mini.runtime.ray_worker import Resident

    alpa_mini.shutdown()
    try:
        cluster = alpa_mini.init(cluster="ray", num_hosts=3, num_cpu_devices=4, span_hosts=True)
        assert (cluster.num_hosts, cluster.devices_per_host) == (3, 4)
        assert alpa_mini.session.ray_session().span_hosts
        kept: dict = {}
        step, leaves, losses = _train(SPANNING, keep=kept)
        ex = step.get_executable(kept["p"], kept["s"], kept["batch"])
        plan = ex.plan
        assert [sorted({d // 4 for d in st.devices}) for st in plan.stages] == [[0, 1], [2]]
        state = jax.tree.leaves((kept["p"], kept["s"]))
        spread = [x for x in state if x.hosts == (0, 1)]
        assert spread and all(x.devices == tuple(range(8)) for x in spread)
        flat = jax.tree.leaves((kept["p"], kept["s"], kept["batch"]))
        in_place = [
            isinstance(ex._input(flat[int(n[3:])], h, n), Resident)
            for h in (0, 1)
            for n in ex.needs[h]
            if flat[int(n[3:])] in spread
        ]
        assert sum(in_place) > len(in_place) // 2
        # The group's coordinator listens on loopback too.
        outside = listening_outside_loopback()
        assert outside == [], outside
        # Checkpointed where it lives: each host writes its pieces of the state spread over
        # hosts 0 and 1; restored into the step's layouts, it is spread there again.
        ckpt = tmp_path / "ckpt"
        alpa_mini.save_checkpoint(ckpt, (kept["p"], kept["s"]), step=3, wait=True)
        layouts = step.input_layouts(kept["p"], kept["s"], kept["batch"])[:2]
        restored = jax.tree.leaves(alpa_mini.restore_checkpoint(ckpt, target=layouts))
        for a, b in zip(restored, leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b)
        again = [x for x in restored if x.hosts == (0, 1)]
        assert again and all(x.devices == tuple(range(8)) for x in again)
        reads = [(h, n) for h, need in enumerate(ex.needs) for n in need]
        assert all(  # every worker reads its restored state in place
            isinstance(ex._input(restored[int(n[3:])], h, n), Resident)
            for h, n in reads
            if int(n[3:]) < len(restored)
        )
    finally:
        alpa_mini.shutdown()
    s_leaves, s_losses = _serial()
    np.testing.assert_allclose(losses, s_losses, rtol=2e-5)
    for a, b in zip(leaves, s_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)

    (tmp_path / "plan.json").write_text(plan.to_json())
    tests = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tests), str(tests.parent), str(tests.parents[1])]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _REPLAY, str(tmp_path / "plan.json"), str(tmp_path / "l.npz")],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    local = np.load(tmp_path / "l.npz")
    l_losses, *l_leaves = (local[f"arr_{i}"] for i in range(len(local.files)))
    np.testing.assert_allclose(losses, l_losses, rtol=1e-6)
    for a, b in zip(leaves, l_leaves, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _worker_failures(step) -> dict:
    """In the module's Ray session, after its training runs: a stage mesh over two hosts
    without span_hosts; host 1's worker killed while steps run back to back; one more step
    after it died. What each raised, and how long the failures took to surface."""
    import threading

    import ray

    wide = PipeshardParallel(num_micro_batches=2, stage_option=UniformStageOption(1, (2, 4)))
    out: dict = {}
    try:
        _train(wide, steps=1)
    except Exception as err:  # the test checks which
        out["span"] = err
    session = alpa_mini.session.ray_session()
    out["pids"] = [w["pid"] for w in session.worker_info]
    p, s, batch = _args()
    p, s, _ = step(p, s, batch)
    killed = threading.Event()

    def kill():
        time.sleep(0.3)
        out["killed_at"] = time.monotonic()
        killed.set()  # before the kill: the failing step may return before ray.kill does
        ray.kill(session.workers[1], no_restart=True)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        for _ in range(500):  # a step takes about 0.1 s: the kill lands in one
            p, s, _ = step(p, s, batch)
    except Exception as err:  # the test checks which
        since = time.monotonic() - out.get("killed_at", float("nan"))  # nan: not killed yet
        out["mid_step"], out["mid_step_seconds"] = err, since
    killer.join(timeout=30)
    out["killed"] = killed.is_set()
    t0 = time.monotonic()
    try:
        step(p, s, batch)
    except Exception as err:  # the test checks which
        out["dead"] = err
    out["dead_seconds"] = time.monotonic() - t0
    # An output that lived on the dead worker, fetched: the error names the host and value.
    lost = next(x for x in jax.tree.leaves(p) if 1 in x.hosts and x._value is None)
    t0 = time.monotonic()
    try:
        np.asarray(lost)
    except Exception as err:  # the test checks which
        out["fetch"] = err
    out["fetch_seconds"] = time.monotonic() - t0
    return out


def test_spanning_hosts_and_killed_workers_are_clear_errors(ray_results):
    """A stage over two hosts without span_hosts is a ConfigError naming the fix. Killing a
    host worker while steps run back to back: the step in flight (or the next) raises
    WorkerFailedError naming that host within 30 s, and so does a step after the death;
    after shutdown() no worker of ours is left."""
    errors = ray_results["errors"]
    assert isinstance(errors.get("span"), ConfigError)
    assert re.search(r"stage 0: devices .* span hosts.*span_hosts=True", str(errors["span"]))
    assert errors["killed"]
    fetch = str(errors.get("fetch"))
    assert re.search(r"during a fetch of \w+ output\[0\]\[.*\] of step \d+", fetch), fetch
    assert errors["fetch"].lost and all("of step" in v for v in errors["fetch"].lost)
    for key in ("mid_step", "dead", "fetch"):
        assert isinstance(errors.get(key), WorkerFailedError), (key, errors.get(key))
        assert "worker of host 1" in str(errors[key]) and errors[key].host == 1
        assert errors[f"{key}_seconds"] < 30.0
    assert errors["gone"]


def test_ray_job_submit_runs_the_example(ray_head):
    """`ray job submit` of examples/train_gpt.py to a head of our own: the job succeeds and
    its loss decreases."""
    import subprocess
    import sys
    from pathlib import Path

    _, dashboard, _ = ray_head
    root = Path(__file__).resolve().parents[2]
    ray_cli = str(Path(sys.executable).with_name("ray"))
    command = [
        ray_cli, "job", "submit", "--address", dashboard, "--working-dir", str(root / "examples"),
        "--", sys.executable, "train_gpt.py", "--cluster", "ray", "--address", "auto",
        "--steps", "3",
    ]  # fmt: skip
    # A fresh head's dashboard may answer before its job agent registers; Ray then refuses
    # the job (nothing submitted) with "No available agent ... try again later".
    deadline = time.monotonic() + 120.0
    while True:
        out = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if "No available agent" not in out.stdout + out.stderr or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "succeeded" in out.stdout + out.stderr
    steps = [line.split() for line in out.stdout.splitlines() if line.startswith("step ")]
    losses = [float(words[3]) for words in steps]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "loss decreased" in out.stdout
