"""Checkpoint throughput: ``save_checkpoint`` and ``restore_checkpoint`` of a GPT's
parameters and Adam state (a few hundred MB) in the CPU test mode, on the local runtime
(8 devices) and on an embedded Ray of 2 host workers x 4 devices.

The state lives as a 2-stage pipeshard step leaves it (locally: two stage meshes, the
scanned block stack sharded along its layer axis over all 8 devices; on Ray: on the
workers). Per repetition, alternating which goes first: a save (timed until it is on disk;
how long the call itself blocks is reported beside it) and a restore into the step's
``input_layouts`` (timed until every array is ready). Run alone:
``python -m benchmarks.checkpoint_io``.
"""

from __future__ import annotations

import datetime
import functools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import alpa_mini  # noqa: E402
from alpa_mini import AutoLayerOption, ClusterSpec, PipeshardParallel, UniformStageOption  # noqa: E402
from alpa_mini.models import adam, make_train_step  # noqa: E402
from alpa_mini.models.gpt import GPTConfig, gpt_loss, init_gpt, make_gpt_batch  # noqa: E402

from ._report import update_section  # noqa: E402

CONFIG = GPTConfig(
    vocab_size=8192, seq_len=64, hidden=512, num_heads=8, num_layers=8, scan_layers=True
)
REPEATS = 3


def _state():
    """The parameters and Adam state as a 2-stage pipeshard step returns them."""
    opt = adam(1e-4)
    loss = functools.partial(gpt_loss, config=CONFIG)
    method = PipeshardParallel(
        num_micro_batches=2, layer_option=AutoLayerOption(2), stage_option=UniformStageOption(2)
    )
    step = alpa_mini.parallelize(
        make_train_step(loss, opt, alpa_mini.value_and_grad), method=method
    )
    params = init_gpt(CONFIG, jax.random.key(0))
    batch = make_gpt_batch(CONFIG, jax.random.key(1), 8)
    p, s, _ = step(params, opt.init(params), batch)
    return (p, s), step.input_layouts(p, s, batch)[:2]


def _measure(state, layouts, root: Path) -> tuple[float, float, float]:
    """Median seconds of: the save call, the save until on disk, the restore until every
    array is ready (``REPEATS`` each, alternating which goes first)."""
    saves, calls, restores = [], [], []
    for rep in range(REPEATS):
        directory = root / f"run{rep}"
        order = ("save", "restore") if rep % 2 == 0 else ("restore", "save")
        for what in order:
            if what == "save":
                t0 = time.perf_counter()
                alpa_mini.save_checkpoint(directory, state, step=rep + 1)
                calls.append(time.perf_counter() - t0)
                alpa_mini.session.checkpoint.wait_for_checkpoints()
                saves.append(time.perf_counter() - t0)
            else:
                source = root / "run0"
                if not source.exists():  # nothing saved yet: save one first (not timed)
                    alpa_mini.save_checkpoint(source, state, step=1, wait=True)
                t0 = time.perf_counter()
                restored = alpa_mini.restore_checkpoint(source, target=layouts)
                jax.block_until_ready(restored)  # on Ray: ready when the handles return
                restores.append(time.perf_counter() - t0)
                del restored
    return tuple(statistics.median(x) for x in (calls, saves, restores))


def main() -> None:
    rows = {}
    root = Path(tempfile.mkdtemp(prefix="alpa-mini-ckpt-bench-"))
    try:
        alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
        state, layouts = _state()
        nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
        count = len(jax.tree.leaves(state))
        rows["local runtime, cpu-1x8 (the driver writes)"] = _measure(
            state, layouts, root / "local"
        )
        del state, layouts
        alpa_mini.shutdown()
        alpa_mini.init(cluster="ray", num_hosts=2, num_cpu_devices=4)
        state, layouts = _state()
        rows["Ray, 2 hosts x 4 (each worker writes its own)"] = _measure(
            state, layouts, root / "ray"
        )
        del state, layouts
    finally:
        alpa_mini.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    mb = nbytes / 2**20
    lines = [
        f"| {where} | {call:.2f} | {save:.2f} | {mb / save:.0f} | {restore:.2f} | "
        f"{mb / restore:.0f} |"
        for where, (call, save, restore) in rows.items()
    ]
    text = "\n".join(
        [
            "## Checkpoint throughput",
            "",
            f"Command: `python -m benchmarks.checkpoint_io` ({datetime.date.today().isoformat()}),"
            " alone. CPU test mode; a scanned GPT (8 layers, hidden 512, vocab 8192) with Adam "
            f"state: {mb:.0f} MiB in {count} arrays as a 2-stage pipeshard step returns them "
            "(locally: two stage meshes of `cpu-1x8`, the block stack sharded along its layer "
            "axis over all 8 devices; on Ray: one stage per host worker, the values on the "
            f"workers). Median of {REPEATS} runs, save and restore alternating first. Save: "
            "until on disk; restore: into the step's `input_layouts`, until every array is "
            "ready (on Ray: on the workers that read it, in their layouts).",
            "",
            "| where | save call s | save s | save MiB/s | restore s | restore MiB/s |",
            "|---|---:|---:|---:|---:|---:|",
            *lines,
        ]
    )
    print(text)
    update_section("checkpoint-io", text)


if __name__ == "__main__":
    main()
