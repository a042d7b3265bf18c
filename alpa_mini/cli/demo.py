"""The main job: a GPT train step planned by alpa_mini on 8 simulated CPU devices, run, and
checked against serial JAX. ``alpa-mini demo`` runs the two-level (pipeshard) demo;
``alpa-mini demo --method shard`` the intra-operator (ShardParallel) one. Either must start
before anything else starts JAX.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["run_demo", "run_pipeshard_demo"]


def run_demo(
    *,
    num_devices: int = 8,
    steps: int = 5,
    mesh_shape: tuple[int, ...] | None = None,
    scan_layers: bool = False,
    console: Console | None = None,
) -> dict[str, Any]:
    """Plan, compile and run a small GPT with ShardParallel; returns the figures it printed."""
    import alpa_mini

    console = console or Console()
    cluster = alpa_mini.init(cluster="local", num_cpu_devices=num_devices)

    import jax

    from alpa_mini.models import GPT_TINY, adam, gpt_loss, init_gpt, make_gpt_batch, make_train_step

    config = dataclasses.replace(GPT_TINY, scan_layers=scan_layers)
    optimizer = adam(1e-3, eps=1e-3)
    train_step = make_train_step(gpt_loss, optimizer)
    key = jax.random.PRNGKey(0)
    params = init_gpt(config, key)
    state = optimizer.init(params)
    batch = make_gpt_batch(config, jax.random.PRNGKey(1), 16)
    console.print(
        f"[bold]alpa_mini demo[/]: GPT (vocab {config.vocab_size}, seq {config.seq_len}, "
        f"hidden {config.hidden}, {config.num_layers} layers) with Adam on "
        f"{cluster.num_devices} simulated {cluster.device.name} devices"
    )
    step = alpa_mini.parallelize(train_step, method=alpa_mini.ShardParallel(mesh_shape=mesh_shape))
    t0 = time.perf_counter()
    ex = step.get_executable(params, state, batch)
    planning = time.perf_counter() - t0
    console.print(ex.plan.summary(max_rows=16))
    console.print(f"planned in {planning:.2f} s (trace {ex.trace_time:.2f} s)")

    run = _train_and_compare(step, jax.jit(train_step), params, state, batch, steps, console)
    console.print(
        f"step time: predicted {ex.plan.predicted_time * 1e3:.2f} ms, measured "
        f"{run['measured_step_time'] * 1e3:.2f} ms (median of {steps - 1}; simulated devices "
        "share this machine's cores, so the cost model's CPU figures are nominal)"
    )
    console.print("collectives, plan vs compiled HLO:\n" + str(ex.collectives()))
    _verdict(run, console)
    return {
        **run,
        "planning_time": planning,
        "predicted_step_time": ex.plan.predicted_time,
        "mesh_shape": ex.plan.mesh_shape,
    }


def run_pipeshard_demo(
    *,
    num_devices: int = 8,
    steps: int = 5,
    num_micro_batches: int = 4,
    num_layers: int = 4,
    num_blocks: int = 4,
    cluster_name: str = "cpu-2x4",
    console: Console | None = None,
) -> dict[str, Any]:
    """Plan a small GPT with PipeshardParallel (auto layers, auto stages), run it on the local
    pipeline runtime and compare with serial JAX; returns the figures it printed."""
    import alpa_mini

    console = console or Console()
    cluster = alpa_mini.init(cluster=cluster_name, num_cpu_devices=num_devices)

    import jax

    from alpa_mini.models import GPT_TINY, adam, gpt_loss, init_gpt, make_gpt_batch, make_train_step

    config = dataclasses.replace(GPT_TINY, num_layers=num_blocks)
    optimizer = adam(1e-3, eps=1e-3)
    # alpa_mini.value_and_grad marks where the backward ends and apply-gradient begins.
    train_step = make_train_step(gpt_loss, optimizer, value_and_grad=alpa_mini.value_and_grad)
    params = init_gpt(config, jax.random.PRNGKey(0))
    state = optimizer.init(params)
    batch = make_gpt_batch(config, jax.random.PRNGKey(1), 16)
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=num_micro_batches,
        layer_option=alpa_mini.AutoLayerOption(layer_num=num_layers),
        stage_option=alpa_mini.AutoStageOption(),
    )
    console.print(
        f"[bold]alpa_mini demo[/]: GPT (vocab {config.vocab_size}, seq {config.seq_len}, "
        f"hidden {config.hidden}, {config.num_layers} blocks) with Adam, PipeshardParallel "
        f"({num_layers} auto layers, auto stages, {num_micro_batches} micro-batches) on "
        f"{cluster.num_devices} simulated {cluster.device.name} devices ({cluster.name}: "
        f"{cluster.num_hosts} hosts x {cluster.devices_per_host})"
    )
    step = alpa_mini.parallelize(train_step, method=method)
    t0 = time.perf_counter()
    ex = step.get_executable(params, state, batch)
    planning = time.perf_counter() - t0
    console.print(ex.plan.summary())
    stats = ex.plan.planning
    console.print(
        f"planned and compiled in {planning:.2f} s: {stats.ilps_solved} ILPs for "
        f"{stats.cost_entries} stage-cost entries"
    )
    run = _train_and_compare(step, jax.jit(train_step), params, state, batch, steps, console)
    console.print(
        f"iteration time: predicted {ex.plan.predicted_time * 1e3:.2f} ms, measured "
        f"{run['measured_step_time'] * 1e3:.2f} ms (median of {steps - 1}; the cost model's CPU "
        "figures are nominal, and the simulated devices share this machine's cores)"
    )
    _verdict(run, console)
    return {
        **run,
        "planning_time": planning,
        "predicted_step_time": ex.plan.predicted_time,
        "num_stages": ex.plan.num_stages,
        "submeshes": [s.submesh for s in ex.plan.stages],
    }


def _train_and_compare(step, serial, params, state, batch, steps, console) -> dict[str, Any]:
    """``steps`` training steps of ``step`` beside serial ``jax.jit``; a loss table."""
    import jax
    import numpy as np

    p, s, ps, ss = params, state, params, state
    losses, serial_losses, times = [], [], []
    for i in range(steps):
        t = time.perf_counter()
        p, s, loss = step(p, s, batch)
        loss.block_until_ready()
        if i:  # the first call compiles
            times.append(time.perf_counter() - t)
        ps, ss, loss_s = serial(ps, ss, batch)
        losses.append(float(loss))
        serial_losses.append(float(loss_s))
    diff = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ps), strict=True)
    )
    table = Table(title="Training")
    for col in ("step", "loss (alpa_mini)", "loss (serial jax.jit)"):
        table.add_column(col)
    for i, (a, b) in enumerate(zip(losses, serial_losses, strict=True)):
        table.add_row(str(i), f"{a:.6f}", f"{b:.6f}")
    console.print(table)
    pairs = zip(losses, serial_losses, strict=True)
    ok = diff <= 1e-4 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in pairs)
    return {
        "ok": ok,
        "losses": losses,
        "serial_losses": serial_losses,
        "max_param_diff": diff,
        "measured_step_time": statistics.median(times) if times else float("nan"),
    }


def _verdict(run: dict[str, Any], console: Console) -> None:
    verdict = "[green]matches[/]" if run["ok"] else "[red]DIFFERS FROM[/]"
    console.print(
        f"result {verdict} serial JAX: max |param difference| = {run['max_param_diff']:.2e}"
    )
