"""A one-stage pipeshard step against one ``jax.jit`` of the same plan, and donation's effect
on peak memory.

*Parity*: the same train step on 8 CPU devices, data parallel (layout "data"), B
micro-batches: as ``PipeshardParallel`` with one stage of all 8 devices (our runtime: split,
forward/backward per micro-batch, one gradient sync, apply; fused into one program), as one
``jax.jit`` with the same shardings (``data_parallel_value_and_grad``), and as
``ShardParallel(layout="data")`` for reference. After two warm-up steps each, pipeshard and
jit steps alternate in pairs of flipping order; the reference is timed after them. The table
gives medians.

*Donation*: the 2-stage Adam step of ``tests/pipeline/test_donation.py`` scaled up, with and
without ``donate_argnums="auto"``: live device bytes (``jax.live_arrays``) added by a step
whose inputs are the previous step's outputs, and the peak of live bytes sampled after every
instruction (``PipeshardExecutable.profile``).

Run alone: ``python -m benchmarks.runtime_parity [--steps N]``; it rewrites the
``runtime-parity`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import alpa_mini  # noqa: E402
from alpa_mini import (  # noqa: E402
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import (  # noqa: E402
    GPTConfig,
    adam,
    gpt_loss,
    init_gpt,
    make_gpt_batch,
    make_train_step,
    sgd,
)

from ._report import update_section  # noqa: E402
from .grad_sync import marked_mlp  # noqa: E402


def _mlp(width: int = 1024, layers: int = 6, batch: int = 64):
    """A parameter-heavy, compute-light MLP: six 1024x1024 layers, batch 64 (8 rows per
    device at B = 1, one per device at B = 8)."""
    return marked_mlp(width, layers, batch, scale=0.03)


def _gpt():
    config = dataclasses.replace(
        GPTConfig(vocab_size=512, seq_len=64, hidden=128, num_heads=4, num_layers=4),
        pipeline_marks=True,
    )
    params = init_gpt(config, jax.random.PRNGKey(0))
    data = make_gpt_batch(config, jax.random.PRNGKey(1), 64)
    return (lambda p, b: gpt_loss(p, b, config)), params, data


MODELS: dict[str, Callable[[], Any]] = {"mlp-6x1024": _mlp, "gpt-4x128": _gpt}


def data_parallel_value_and_grad(mesh: jax.sharding.Mesh, B: int) -> Callable[..., Any]:
    """``value_and_grad`` as a careful JAX user writes data parallelism with gradient
    accumulation: per device, a ``lax.scan`` over its rows' B micro-batches adds unreduced
    gradients; one ``pmean`` over the devices after the loop. Parameters replicated, the
    batch split over every device: the shardings of the one-stage pipeshard plan."""
    from jax.sharding import PartitionSpec as P

    axes = mesh.axis_names

    def value_and_grad(loss: Callable[..., Any]) -> Callable[..., Any]:
        def local(params: Any, batch: Any) -> tuple[Any, Any]:
            mbs = jax.tree.map(lambda x: x.reshape(B, x.shape[0] // B, *x.shape[1:]), batch)

            def body(acc: Any, mb: Any) -> tuple[Any, None]:
                value, grads = jax.value_and_grad(loss)(params, mb)
                return jax.tree.map(jnp.add, acc, (value, grads)), None

            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
            total, _ = jax.lax.scan(body, zeros, mbs)
            return jax.lax.pmean(jax.tree.map(lambda t: t / B, total), axes)

        def run(params: Any, batch: Any) -> tuple[Any, Any]:
            return jax.shard_map(
                local, mesh=mesh, in_specs=(P(), P(axes)), out_specs=P(), check_vma=False
            )(params, batch)

        return run

    return value_and_grad


def _same_shardings_jit(loss: Any, opt: Any, B: int, num_devices: int = 8) -> Any:
    """One ``jax.jit`` of the step with the pipeshard stage's shardings (see above), on the
    first ``num_devices`` devices."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(jax.devices()[:num_devices], ("x",))
    train = make_train_step(loss, opt, data_parallel_value_and_grad(mesh, B))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("x"))
    return jax.jit(
        train, in_shardings=(rep, rep, rows), out_shardings=(rep, rep, rep), donate_argnums=(0, 1)
    )


def _timed(step: Any, args: tuple[Any, ...]) -> tuple[float, tuple[Any, ...]]:
    t0 = time.perf_counter()
    *new, loss = step(*args)
    jax.block_until_ready((new, loss))
    return time.perf_counter() - t0, (*new, args[-1])


def parity_row(model: str, B: int, steps: int, num_devices: int = 8) -> dict[str, Any]:
    """One row of the parity table: the one-stage pipeshard step, the same-shardings jit
    and the ILP jit on the first ``num_devices`` devices (8 CPU devices here; 1 on a
    one-GPU machine)."""
    have = jax.device_count()
    if not 1 <= num_devices <= have:
        raise ValueError(f"num_devices: {num_devices!r} is invalid; JAX has {have} devices")
    loss, params, data = MODELS[model]()
    opt = sgd(0.01)
    train = make_train_step(loss, opt, alpa_mini.value_and_grad)
    pipe = alpa_mini.parallelize(
        train,
        method=PipeshardParallel(
            num_micro_batches=B,
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(1, (1, num_devices)),
            default_auto_sharding_option=ShardParallel(layout="data"),
        ),
        donate_argnums="auto",
    )
    jit = _same_shardings_jit(loss, opt, B, num_devices)
    ilp = alpa_mini.parallelize(
        train, method=ShardParallel(layout="data", num_micro_batches=B), donate_argnums="auto"
    )
    steps_of = {"pipe": pipe, "jit": jit, "ilp": ilp}
    state = {}
    for name in steps_of:
        state[name] = (jax.tree.map(jnp.copy, params), opt.init(params), data)
        for _ in range(2):
            _, state[name] = _timed(steps_of[name], state[name])
    # Pipeshard and jit alternate in pairs whose order flips every step (AB BA AB ...), so
    # each runs after itself and after the other equally often; the ILP jit, a reference,
    # is timed after them, alone.
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for i in range(steps):
        for name in ("pipe", "jit") if i % 2 == 0 else ("jit", "pipe"):
            t, state[name] = _timed(steps_of[name], state[name])
            times[name].append(t)
    for _ in range(steps):
        t, state["ilp"] = _timed(ilp, state["ilp"])
        times["ilp"].append(t)
    ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
    return {"model": model, "B": B, "pipe_ms": ms["pipe"], "jit_ms": ms["jit"], "ilp_ms": ms["ilp"]}


def donation_row(donate: bool) -> dict[str, Any]:
    width, layers = 512, 8
    k = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [jax.random.normal(k[i], (width, width)) * 0.03 for i in range(layers)]
    loss, _, _ = _mlp(width, layers, 64)
    data = {"x": jax.random.normal(k[-2], (64, width)), "y": jax.random.normal(k[-1], (64, width))}
    opt = adam(1e-3)
    step = alpa_mini.parallelize(
        make_train_step(loss, opt, alpa_mini.value_and_grad),
        method=PipeshardParallel(
            num_micro_batches=4,
            layer_option=ManualLayerOption(),
            stage_option=UniformStageOption(2, (1, 4)),
        ),
        donate_argnums="auto" if donate else (),
    )
    p, s, _ = step(jax.tree.map(jnp.copy, params), opt.init(params), data)
    p, s, _ = step(p, s, data)
    jax.block_until_ready((p, s))
    state_bytes = sum(x.nbytes for x in jax.tree.leaves((p, s)))
    before = sum(a.nbytes for a in jax.live_arrays())
    out = step(p, s, data)
    jax.block_until_ready(out)
    added = sum(a.nbytes for a in jax.live_arrays()) - before
    consumed = sum(x.is_deleted() for x in jax.tree.leaves((p, s)))
    p2, s2, _ = out
    del out, p, s
    peak = _profiled_peak(step, p2, s2, data)
    return {
        "donate": donate,
        "state_mib": state_bytes / 2**20,
        "added_mib": added / 2**20,
        "peak_mib": peak / 2**20,
        "consumed": consumed,
        "leaves": len(jax.tree.leaves((p2, s2))),
    }


def _profiled_peak(step: Any, p: Any, s: Any, data: Any) -> float:
    """Peak live device bytes over one step, sampled after every instruction (each run to
    completion by ``profile``)."""
    ex = step.get_executable(p, s, data)
    peak = 0
    runtime = ex.runtime
    original = runtime.execute_one

    def sampled(ins: Any, buffers: dict[str, Any]) -> None:
        nonlocal peak
        original(ins, buffers)
        live = [b for b in buffers.values() if isinstance(b, jax.Array) and not b.is_deleted()]
        jax.block_until_ready(live)
        peak = max(peak, sum(a.nbytes for a in jax.live_arrays()))

    runtime.execute_one = sampled
    try:
        ex(p, s, data)
    finally:
        runtime.execute_one = original
    return float(peak)


def _table(parity: list[dict[str, Any]], donation: list[dict[str, Any]], command: str) -> str:
    lines = [
        "## Runtime parity: one pipeshard stage against one jit, and donation",
        "",
        f"Command: `{command}` ({datetime.date.today().isoformat()}), run alone on this "
        "machine's 2 CPU cores, 8 simulated devices.",
        "",
        'Data-parallel step on all 8 devices (layout "data", SGD): `PipeshardParallel` with '
        "one stage (programs fused, the default) against *jit*: one `jax.jit` of the same step "
        "with the same shardings (parameters and state replicated, the batch split over all 8 "
        "devices) and micro-batching, written as a careful JAX user would (`shard_map`: a "
        "`lax.scan` over each device's B micro-batches adds unreduced gradients, one `pmean` "
        "after it; `data_parallel_value_and_grad`). *ILP jit* is "
        '`ShardParallel(layout="data", num_micro_batches=B)`, which pins only the inputs: its '
        "ILP shards the gradient computation differently (no gradient all-reduce), so it is a "
        "different plan, given for reference (timed after the pairs, alone). Medians of "
        "pipeshard and jit steps alternating in pairs of flipping order (AB BA AB ...).",
        "",
        "| model | B | pipeshard ms | jit ms | ILP jit ms | pipeshard / jit | ≤ 1.05 |",
        "|---|---:|---:|---:|---:|---:|:---|",
    ]
    for r in parity:
        ratio = r["pipe_ms"] / r["jit_ms"]
        lines.append(
            f"| {r['model']} | {r['B']} | {r['pipe_ms']:.1f} | {r['jit_ms']:.1f} "
            f"| {r['ilp_ms']:.1f} | {ratio:.3f} | {'yes' if ratio <= 1.05 else '**no**'} |"
        )
    lines += [
        "",
        "Donation: 2 stages of 4 devices, 8 layers 512x512, Adam, 4 micro-batches. *Added* is "
        "the live device memory a step leaves behind when its inputs are the previous step's "
        "outputs (held by the caller); *peak* is the most live device memory seen after any "
        "instruction of one step.",
        "",
        "| donate_argnums | params + state MiB | inputs consumed | added MiB | peak MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in donation:
        donate = '"auto"' if r["donate"] else "()"
        lines.append(
            f"| {donate} | {r['state_mib']:.1f} | "
            f"{r['consumed']} of {r['leaves']} | {r['added_mib']:.1f} | {r['peak_mib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    opts = parser.parse_args(argv)
    alpa_mini.init(cluster="cpu-1x8")
    parity, donation = [], []
    for m in MODELS:
        for B in (1, 8):
            parity.append(parity_row(m, B, opts.steps))
            print("ROW", parity[-1], flush=True)
    for donate in (False, True):
        donation.append(donation_row(donate))
        print("ROW", donation[-1], flush=True)
    text = _table(parity, donation, f"python -m benchmarks.runtime_parity --steps {opts.steps}")
    print(text)
    if not opts.no_write:
        update_section("runtime-parity", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
