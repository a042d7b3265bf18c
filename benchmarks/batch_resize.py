"""What a new batch size costs: the plan reused (only the batch rows changed) against planning
from scratch, for ShardParallel (mesh search) and PipeshardParallel on GPT-small.

Per method and repetition, alternating which goes first: a step that already ran at batch N
is asked for batch 2N (``get_executable``: trace, check that the plan's layouts divide the
new shapes, lower), against a fresh step planned at 2N. Compilation happens on the first call
in both cases and is not timed. Run: ``python -m benchmarks.batch_resize``.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)

import alpa_mini  # noqa: E402
from alpa_mini import (  # noqa: E402
    AutoLayerOption,
    ClusterSpec,
    PipeshardParallel,
    ShardParallel,
    UniformStageOption,
)
from alpa_mini.models import (  # noqa: E402
    GPT_SMALL,
    adam,
    gpt_loss,
    init_gpt,
    make_gpt_batch,
    make_train_step,
)

from ._report import update_section  # noqa: E402

BATCH = 16
REPEATS = 3


def _methods() -> dict[str, Any]:
    return {
        "ShardParallel() (mesh search)": ShardParallel(),
        "PipeshardParallel (2 stages, B = 2)": PipeshardParallel(
            num_micro_batches=2,
            layer_option=AutoLayerOption(2),
            stage_option=UniformStageOption(2),
        ),
    }


def _timed(step: Any, *args: Any) -> float:
    t0 = time.perf_counter()
    step.get_executable(*args)
    return time.perf_counter() - t0


def main() -> None:
    alpa_mini.init(cluster=ClusterSpec.named("cpu-1x8"))
    config = dataclasses.replace(GPT_SMALL, pipeline_marks=False)
    params = init_gpt(config, jax.random.PRNGKey(0))
    opt = adam(1e-3)
    state = opt.init(params)
    small = make_gpt_batch(config, jax.random.PRNGKey(1), BATCH)
    large = make_gpt_batch(config, jax.random.PRNGKey(2), 2 * BATCH)

    def loss(p: Any, b: Any) -> Any:
        return gpt_loss(p, b, config)

    rows = []
    for name, method in _methods().items():
        reuse, fresh = [], []
        for rep in range(REPEATS):
            order = ("reuse", "fresh") if rep % 2 == 0 else ("fresh", "reuse")
            for kind in order:
                step = alpa_mini.parallelize(
                    make_train_step(loss, opt, alpa_mini.value_and_grad), method=method
                )
                if kind == "reuse":
                    step.get_executable(params, state, small)
                    reuse.append(_timed(step, params, state, large))
                else:
                    fresh.append(_timed(step, params, state, large))
        r, f = statistics.median(reuse), statistics.median(fresh)
        rows.append(f"| {name} | {f:.2f} | {r:.2f} | {r / f:.3f} |")
        print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## Re-plan cost on a batch-size change",
            "",
            f"Command: `python -m benchmarks.batch_resize` ({datetime.date.today().isoformat()}). "
            f"GPT-small (4 layers, hidden 256, Adam) on `cpu-1x8`: a step that ran at batch "
            f"{BATCH} asked for batch {2 * BATCH} (the plan reused: trace, check that its layouts "
            f"divide the new shapes, lower) against a fresh step planned at {2 * BATCH}; medians "
            f"of {REPEATS}, alternating which goes first. Compilation (on the first call) is "
            "not timed.",
            "",
            "| method | planned from scratch s | plan reused s | reused / scratch |",
            "|---|---:|---:|---:|",
            *rows,
        ]
    )
    print(text)
    update_section("batch-resize", text)


if __name__ == "__main__":
    main()
