"""Gradient bytes per step against the micro-batch count, counted in compiled HLO.

One data-parallel stage (8 CPU devices, the "data" layout) and a 2-stage plan of a 4-layer
MLP; for B = 1, 4, 16 every program's collectives come from ``collectives()`` and are
weighed by its runs per step. Prints a Markdown table. Run: ``python -m benchmarks.grad_sync``.
"""

from __future__ import annotations

import datetime

import jax

jax.config.update("jax_num_cpu_devices", 8)

import alpa_mini  # noqa: E402
from alpa_mini import (  # noqa: E402
    ClusterSpec,
    ManualLayerOption,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import make_train_step, sgd  # noqa: E402

from ._report import update_section  # noqa: E402


def marked_mlp(width: int, layers: int, batch: int, scale: float = 0.05):
    """(loss, params, batch) of a tanh MLP with a pipeline boundary after every layer."""
    import jax.numpy as jnp

    def loss(params, b):
        x = b["x"]
        for i, w in enumerate(params):
            x = jnp.tanh(x @ w)
            if i < len(params) - 1:
                alpa_mini.mark_pipeline_boundary()
        return jnp.mean((x - b["y"]) ** 2)

    k = jax.random.split(jax.random.PRNGKey(0), layers + 2)
    params = [jax.random.normal(k[i], (width, width)) * scale for i in range(layers)]
    data = {
        "x": jax.random.normal(k[-2], (batch, width)),
        "y": jax.random.normal(k[-1], (batch, width)),
    }
    return loss, params, data


def main() -> None:
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    loss, params, data = marked_mlp(256, 4, 128)
    opt = sgd(0.1)
    rows = []
    for stages, layout in ((1, "data"), (1, "zero2"), (1, "zero3"), (2, "data")):
        for B in (1, 4, 16):
            method = PipeshardParallel(
                num_micro_batches=B,
                layer_option=ManualLayerOption(),
                stage_option=UniformStageOption(stages, (1, 8 // stages)),
                default_auto_sharding_option=ShardParallel(layout=layout),
                fuse_programs=False,  # a program per task, so the table can split by role
            )
            step = alpa_mini.parallelize(
                make_train_step(loss, opt, alpa_mini.value_and_grad), method=method
            )
            args = (params, opt.init(params), data)
            step(*args)
            c = step.get_executable(*args).collectives()
            cells = []
            for role in ("backward", "sync"):
                per = c.per_step(role)
                cells.append(
                    ", ".join(
                        f"{k} {n} x, {b / 2**20:.2f} MiB" for k, (n, b) in sorted(per.items())
                    )
                    or "none"
                )
            total = sum(
                b for k, (_, b) in c.per_step().items() if k in ("all-reduce", "reduce-scatter")
            )
            rows.append(
                f"| {stages} | {layout} | {B} | {cells[0]} | {cells[1]} | {total / 2**20:.3f} |"
            )
    text = "\n".join(
        [
            "## Gradient bytes per step against the micro-batch count",
            "",
            f"Command: `python -m benchmarks.grad_sync` ({datetime.date.today().isoformat()}). "
            "A 4-layer tanh MLP (width 256, batch 128, SGD) on `cpu-1x8`: one stage of 8 "
            "devices or two of 4, B micro-batches, a program per task (`fuse_programs=False`; "
            "fused, the totals are the same). Each program's collectives are parsed from "
            "its compiled HLO (`PipeshardExecutable.collectives()`) and weighed by its runs per "
            "step. Gradients: 4 x 256 KiB = 1 MiB. Before issue 20 every backward reduced every "
            "gradient, so these bytes grew B-fold.",
            "",
            "| stages | layout | B | backward (per step) | sync (per step) "
            "| all-reduce + reduce-scatter MiB/step |",
            "|---:|---|---:|---|---|---:|",
            *rows,
        ]
    )
    print(text)
    update_section("grad-sync", text)


if __name__ == "__main__":
    main()
