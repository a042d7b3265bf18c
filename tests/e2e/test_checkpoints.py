"""``save_checkpoint``/``restore_checkpoint``: step outputs saved from where they live (stage
meshes, stacks sharded along their layer axis) and restored into the layouts another plan
reads them in; saves in the background, atomically, keeping the newest few."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest

import alpa_mini
from alpa_mini import (
    AutoLayerOption,
    ClusterSpec,
    ConfigError,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd
from alpa_mini.models.gpt import GPTConfig, gpt_loss, init_gpt, make_gpt_batch

GPT = GPTConfig(vocab_size=64, seq_len=8, hidden=32, num_heads=4, num_layers=4, scan_layers=True)
OPT = sgd(0.1)
_loss = functools.partial(gpt_loss, config=GPT)


def _data():
    return init_gpt(GPT, jax.random.key(0)), make_gpt_batch(GPT, jax.random.key(1), 8)


def _pipeshard(stages: int):
    method = PipeshardParallel(
        num_micro_batches=2,
        layer_option=AutoLayerOption(stages),
        stage_option=UniformStageOption(stages),
    )
    return alpa_mini.parallelize(
        make_train_step(_loss, OPT, alpa_mini.value_and_grad), method=method
    )


def _same(got, want) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_pipeshard_outputs_restore_into_another_plans_layouts_and_train_on(devices8, tmp_path):
    params, batch = _data()
    two = _pipeshard(2)
    p, s, _ = two(params, OPT.init(params), batch)
    alpa_mini.save_checkpoint(tmp_path, (p, s), step=1)  # in the background
    serial = jax.jit(make_train_step(_loss, OPT))
    want_p, want_s, _ = serial(*serial(params, OPT.init(params), batch)[:2], batch)
    alpa_mini.shutdown()

    # Another number of stages, then another mesh shape, and another host count (cpu-2x4).
    for cluster, step in [
        ("cpu-1x8", _pipeshard(4)),
        ("cpu-1x8", alpa_mini.parallelize(make_train_step(_loss, OPT), method=ShardParallel(
            mesh_shape=(2, 4)))),
        ("cpu-2x4", _pipeshard(2)),
    ]:  # fmt: skip
        alpa_mini.init(cluster=ClusterSpec.named(cluster))
        layouts = step.input_layouts(params, OPT.init(params), batch)
        restored = alpa_mini.restore_checkpoint(tmp_path, target=layouts[:2])
        for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(layouts[:2]), strict=True):
            assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim)
        _same(restored, (p, s))
        got_p, got_s, _ = step(*restored, batch)
        got, want = jax.tree.leaves((got_p, got_s)), jax.tree.leaves((want_p, want_s))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        alpa_mini.shutdown()


def _mlp_loss(p, b):
    return jax.numpy.mean((jax.numpy.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def test_shard_parallel_outputs_round_trip_and_the_newest_are_kept(devices8, tmp_path):
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k[0], (16, 32)), "w2": jax.random.normal(k[1], (32, 8))}
    batch = {"x": jax.random.normal(k[2], (32, 16)), "y": jax.numpy.zeros((32, 8))}
    step = alpa_mini.parallelize(
        make_train_step(_mlp_loss, OPT), method=ShardParallel(mesh_shape=(8,))
    )
    state = (params, OPT.init(params))
    for i in range(1, 4):
        p, s, _ = step(*state, batch)
        state = (p, s)
        alpa_mini.save_checkpoint(tmp_path, state, step=i, keep=2)
    alpa_mini.session.checkpoint.wait_for_checkpoints()
    assert sorted(int(d.name) for d in tmp_path.iterdir() if d.name.isdigit()) == [2, 3]
    layouts = step.input_layouts(*state, batch)[:2]
    latest = alpa_mini.restore_checkpoint(tmp_path, target=layouts)
    _same(latest, state)
    for leaf, want in zip(jax.tree.leaves(latest), jax.tree.leaves(layouts), strict=True):
        assert leaf.sharding.is_equivalent_to(want.sharding, leaf.ndim)
    assert alpa_mini.restore_checkpoint(tmp_path, step=2, target=state) is not None
    plain = alpa_mini.restore_checkpoint(tmp_path)  # no target: the saved tree, default device
    assert [np.shape(x) for x in jax.tree.leaves(plain)] == [
        np.shape(x) for x in jax.tree.leaves(state)
    ]


def test_checkpoint_errors_name_the_argument(devices8, tmp_path):
    params, _ = _data()
    alpa_mini.save_checkpoint(tmp_path, params, step=5, wait=True)
    with pytest.raises(ConfigError, match=r"step: 5 is invalid; .* already holds step 5"):
        alpa_mini.save_checkpoint(tmp_path, params, step=5)
    with pytest.raises(ConfigError, match=r"step: 4 is not saved in .*saved steps: \[5\]"):
        alpa_mini.restore_checkpoint(tmp_path, step=4, target=params)
    bad = jax.tree.map(lambda x: np.zeros((*x.shape, 2), x.dtype), params)
    with pytest.raises(ConfigError, match=r"target\[.*\]: shape .* but checkpoint step 5 saved"):
        alpa_mini.restore_checkpoint(tmp_path, target=bad)
    with pytest.raises(ConfigError, match=r"ckpt_dir: .*missing does not exist"):
        alpa_mini.restore_checkpoint(tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"step: -1 is invalid"):
        alpa_mini.save_checkpoint(tmp_path, params, step=-1)
    with pytest.raises(ConfigError, match=r"target\['name'\]: str .* not an array of numbers"):
        alpa_mini.save_checkpoint(tmp_path / "other", {"name": "gpt", "w": 1.0}, step=1)


def test_an_edited_manifest_is_refused_naming_the_field(tmp_path):
    import json

    half = jax.numpy.ones(3, jax.numpy.bfloat16)
    tree = {"w": np.arange(6.0).reshape(2, 3), "n": 7, "h": half}
    alpa_mini.save_checkpoint(tmp_path, tree, 1, wait=True)
    back = alpa_mini.restore_checkpoint(tmp_path)
    assert back["n"] == 7 and back["h"].dtype == half.dtype  # bfloat16 kept
    file = tmp_path / "1" / "manifest.json"
    good = json.loads(file.read_text())
    edits = {
        r"unreadable checkpoint manifest": "{not json",
        r"format: not an alpa_mini checkpoint": {**good, "format": "other"},
        r"version: 9 is not supported": {**good, "version": 9},
        r"leaves\[0\]\.dtype: 'float99' is not a dtype": _edit(good, dtype="float99"),
        r"leaves\[0\]\.shape: \[-2\] is invalid": _edit(good, shape=[-2]),
        r"leaves\[0\]\.parts\[0\]: region \[0\]\.\.\[9\] is not inside": _edit(
            good, parts=[{"writer": "driver", "name": "0", "start": [0], "stop": [9]}]
        ),
        r"leaves\[0\]\.parts: cover 1 values of an array of 2": _edit(
            good, shape=[2], parts=[{"writer": "driver", "name": "1", "start": [0], "stop": [1]}]
        ),
        r"leaves\[0\]\.parts\[0\]\.writer: '\.\./x' is not a writer": _edit(
            good, parts=[{"writer": "../x", "name": "0", "start": [], "stop": []}]
        ),
    }
    for message, data in edits.items():
        file.write_text(data if isinstance(data, str) else json.dumps(data))
        with pytest.raises(ConfigError, match=message):
            alpa_mini.restore_checkpoint(tmp_path)


def _edit(manifest: dict, **fields) -> dict:
    """``manifest`` with its leaf ``n`` (a scalar) changed."""
    leaves = [dict(leaf) for leaf in manifest["leaves"]]
    at = next(i for i, leaf in enumerate(leaves) if leaf["path"] == [["key", "n"]])
    leaves[at].update(fields)
    leaves.insert(0, leaves.pop(at))
    return {**manifest, "leaves": leaves}


CRASH = textwrap.dedent(
    """
    import os, signal, sys
    import jax, jax.numpy as jnp
    import alpa_mini
    directory = sys.argv[1]
    alpa_mini.save_checkpoint(directory, {"w": jnp.full((4,), 1.0)}, step=1, wait=True)
    big = {"w": jnp.full((4,), 2.0), "pad": jnp.ones((64, 1024, 1024), jnp.float32)}
    alpa_mini.save_checkpoint(directory, big, step=2)  # 256 MiB, in the background
    os.kill(os.getpid(), signal.SIGKILL)  # dies mid-save
    """
)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_readable(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path)], env=env, timeout=120, capture_output=True
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    restored = alpa_mini.restore_checkpoint(tmp_path)
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones(4))
    assert "pad" not in restored
    assert Path(tmp_path, "1").is_dir()


def test_prng_keys_round_trip_with_their_implementation(tmp_path):
    import json

    tree = {
        "w": np.ones(3, np.float32),
        "key": jax.random.key(5),
        "keys": jax.random.split(jax.random.key(6, impl="rbg"), 4),
    }
    alpa_mini.save_checkpoint(tmp_path, tree, 1, wait=True)
    saved_tree = alpa_mini.restore_checkpoint(tmp_path)
    for back in (saved_tree, alpa_mini.restore_checkpoint(tmp_path, target=tree)):
        for name in ("key", "keys"):
            assert back[name].dtype == tree[name].dtype and back[name].shape == tree[name].shape
            np.testing.assert_array_equal(
                jax.random.key_data(back[name]), jax.random.key_data(tree[name])
            )
        # the restored key draws what the saved one draws
        np.testing.assert_array_equal(
            jax.random.normal(back["key"], (4,)), jax.random.normal(tree["key"], (4,))
        )
    with pytest.raises(ConfigError, match=r"target\['key'\]: uint32, but .* saved a PRNG key"):
        alpa_mini.restore_checkpoint(tmp_path, target={**tree, "key": np.zeros(2, np.uint32)})
    with pytest.raises(ConfigError, match=r"target\['w'\]: key<fry>, but .* saved a float32"):
        alpa_mini.restore_checkpoint(tmp_path, target={**tree, "w": jax.random.key(0)})
    file = tmp_path / "1" / "manifest.json"
    good = json.loads(file.read_text())
    leaves = [dict(leaf, prng=7) if leaf["path"] == [["key", "key"]] else leaf
              for leaf in good["leaves"]]  # fmt: skip
    file.write_text(json.dumps({**good, "leaves": leaves}))
    with pytest.raises(ConfigError, match=r"leaves\[\d\]\.prng: 7 is invalid; expected a PRNG"):
        alpa_mini.restore_checkpoint(tmp_path)
