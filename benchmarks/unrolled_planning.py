"""ShardParallel planning time and memory, unrolled layers against a scanned stack.

GPT-2 1.3B (24 layers, batch 8, on 8 devices of ``dgx-a100``) and a 24-layer hidden-128 GPT
(batch 16, on ``cpu-1x8``), each planned with the mesh search from abstract shapes, in a fresh
process per plan (peak RSS is the child's). Repetitions alternate the order of the two forms.
Run: ``python -m benchmarks.unrolled_planning``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import resource
import statistics
import subprocess
import sys
import time

from ._report import update_section

MODELS = {
    "GPT-2 1.3B": ("dgx-a100", 8),
    "GPT 24x128": ("cpu-1x8", 16),
}
REPEATS = 2


def _config(model: str, scan: bool):
    from alpa_mini.models import GPT2_1_3B, GPTConfig

    if model == "GPT-2 1.3B":
        return dataclasses.replace(GPT2_1_3B, scan_layers=scan)
    return GPTConfig(
        vocab_size=1024, seq_len=128, hidden=128, num_heads=4, num_layers=24, scan_layers=scan
    )


def child(model: str, scan: bool) -> None:
    """Plan once and print one JSON line: seconds, peak RSS, prediction, tied groups."""
    import jax

    import alpa_mini
    from alpa_mini.models import (
        adam,
        gpt_abstract_batch,
        gpt_abstract_params,
        gpt_loss,
        make_train_step,
    )

    cluster, batch = MODELS[model]
    alpa_mini.init(cluster=cluster, num_cpu_devices=8)
    config = _config(model, scan)
    opt = adam(1e-4)
    params = gpt_abstract_params(config)
    args = (params, jax.eval_shape(opt.init, params), gpt_abstract_batch(config, batch))

    def loss(p, b):
        return gpt_loss(p, b, config)

    t0 = time.perf_counter()
    plan = alpa_mini.plan(make_train_step(loss, opt), *args, method=alpa_mini.ShardParallel())
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    print(json.dumps({
        "seconds": seconds, "rss_gib": rss, "predicted": plan.predicted_time,
        "mesh": list(plan.mesh_shape), "tied": plan.solver.get("tied"),
    }))  # fmt: skip


def _run(model: str, scan: bool) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.unrolled_planning", "--child", model]
    cmd += ["--scan"] if scan else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    rows = []
    for model in MODELS:
        runs: dict[bool, list[dict]] = {False: [], True: []}
        for rep in range(REPEATS):
            for scan in (True, False) if rep % 2 == 0 else (False, True):
                runs[scan].append(_run(model, scan))
        for scan in (True, False):
            r = runs[scan]
            tied = r[-1]["tied"]
            rows.append(
                f"| {model} | {'scanned' if scan else 'unrolled'} "
                f"| {statistics.median(x['seconds'] for x in r):.1f} "
                f"| {max(x['rss_gib'] for x in r):.2f} | {r[-1]['predicted'] * 1e3:.1f} "
                f"| {tuple(r[-1]['mesh'])} | {'–' if not tied else f'{tied[1]} of {tied[0]}'} |"
            )
            print(rows[-1], flush=True)
    text = "\n".join(
        [
            "## ShardParallel planning: unrolled layers against a scanned stack",
            "",
            f"Command: `python -m benchmarks.unrolled_planning` "
            f"({datetime.date.today().isoformat()}). Mesh search from abstract shapes, one "
            f"fresh process per plan, {REPEATS} runs per form alternating the order (median "
            "seconds, largest peak RSS). GPT-2 1.3B: batch 8 on 8 devices of `dgx-a100`; GPT "
            "24x128: 24 layers of hidden 128, batch 16 on `cpu-1x8`; Adam. *Tied*: ILP nodes "
            "solved as groups of alike nodes (`solvers.sharding.tie`), of all nodes, on the "
            "chosen mesh. The two forms are different programs (a scan body against 24 copies "
            "of it), so their predictions differ a little.",
            "",
            "| model | form | planning s | peak RSS GiB | predicted ms | mesh | tied |",
            "|---|---|---:|---:|---:|---|---|",
            *rows,
        ]
    )
    print(text)
    update_section("unrolled-planning", text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--child", choices=list(MODELS), help=argparse.SUPPRESS)
    parser.add_argument("--scan", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.scan)
    else:
        main()
