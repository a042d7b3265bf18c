"""The main job: a GPT train step auto-sharded over 8 simulated CPU devices, checked against
serial JAX. ``alpa-mini demo`` runs it; it must start before anything else starts JAX.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["run_demo"]


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
    import numpy as np

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

    serial = jax.jit(train_step)
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
    measured = statistics.median(times) if times else float("nan")
    console.print(
        f"step time: predicted {ex.plan.predicted_time * 1e3:.2f} ms, measured "
        f"{measured * 1e3:.2f} ms (median of {len(times)}; simulated devices share this "
        "machine's cores, so the cost model's CPU figures are nominal)"
    )
    console.print("collectives, plan vs compiled HLO:\n" + str(ex.collectives()))
    pairs = zip(losses, serial_losses, strict=True)
    ok = diff <= 1e-4 and all(abs(a - b) <= 1e-4 * abs(b) for a, b in pairs)
    verdict = "[green]matches[/]" if ok else "[red]DIFFERS FROM[/]"
    console.print(f"result {verdict} serial JAX: max |param difference| = {diff:.2e}")
    return {
        "ok": ok,
        "losses": losses,
        "serial_losses": serial_losses,
        "max_param_diff": diff,
        "planning_time": planning,
        "predicted_step_time": ex.plan.predicted_time,
        "measured_step_time": measured,
        "mesh_shape": ex.plan.mesh_shape,
    }
