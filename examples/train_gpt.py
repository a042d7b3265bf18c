"""Train a small GPT with PipeshardParallel, locally or on a Ray cluster.

    python examples/train_gpt.py                          # one process, 8 simulated CPU devices
    python examples/train_gpt.py --cluster ray            # embedded Ray: 2 host workers x 4
    python examples/train_gpt.py --cluster ray --address auto   # a running Ray cluster
    python examples/train_gpt.py --cluster ray --stage-hosts 2  # one stage over both hosts
    python examples/train_gpt.py --steps 20 --checkpoint-dir ckpt --checkpoint-every 5
        # saves steps 5, 10, ...; run again (with more --steps) to resume from the latest

By default every stage is one host (2 stages on 2 hosts); on Ray activations pass worker to
worker. ``--stage-hosts N`` gives each stage the devices of N hosts: on Ray the host workers
then form one ``jax.distributed`` group. It prints the loss per step and exits non-zero
unless the loss fell.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=["local", "ray"], default="local")
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument("--hosts", type=int, default=2, help="Ray CPU mode: simulated hosts")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per host")
    parser.add_argument("--stage-hosts", type=int, default=1, help="hosts per stage mesh")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument(
        "--checkpoint-dir", default=None, help="resume from its latest step; save into it"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, help="save every N steps (0: at the end)"
    )
    args = parser.parse_args(argv)
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every: {args.checkpoint_every} must be >= 0")
    if args.stage_hosts < 1 or args.hosts % args.stage_hosts:
        parser.error(
            f"--stage-hosts: {args.stage_hosts} must be >= 1 and divide --hosts {args.hosts}"
        )

    import alpa_mini

    if args.cluster == "ray":
        cluster = alpa_mini.init(
            cluster="ray", address=args.address, num_hosts=args.hosts,
            num_cpu_devices=args.devices, span_hosts=args.stage_hosts > 1,
        )  # fmt: skip
    else:  # the same layout simulated in this one process
        layout = dataclasses.replace(
            alpa_mini.ClusterSpec.named("cpu-2x4"),
            num_hosts=args.hosts,
            devices_per_host=args.devices,
        )
        cluster = alpa_mini.init(cluster=layout, num_cpu_devices=args.hosts * args.devices)
    import jax

    from alpa_mini.models import (
        GPTConfig,
        adam,
        gpt_loss,
        init_gpt,
        make_gpt_batch,
        make_train_step,
    )

    config = GPTConfig(
        vocab_size=256, seq_len=32, hidden=64, num_heads=4, num_layers=4, pipeline_marks=True
    )
    optimizer = adam(3e-3)

    def loss_fn(params, batch):
        return gpt_loss(params, batch, config)

    per_host = cluster.devices_per_host
    num_stages = cluster.num_hosts // args.stage_hosts
    method = alpa_mini.PipeshardParallel(
        num_micro_batches=args.micro_batches,
        stage_option=alpa_mini.UniformStageOption(num_stages, (args.stage_hosts, per_host)),
    )
    step = alpa_mini.parallelize(
        make_train_step(loss_fn, optimizer, alpa_mini.value_and_grad), method=method
    )
    params = init_gpt(config, jax.random.PRNGKey(0))
    state = optimizer.init(params)
    batch = make_gpt_batch(config, jax.random.PRNGKey(1), 16)
    print(
        f"train_gpt: {cluster.num_hosts} hosts x {per_host} devices ({args.cluster}), "
        f"{num_stages} stages of {args.stage_hosts} host(s), {args.micro_batches} micro-batches",
        flush=True,
    )
    first = 0
    ckpt = Path(args.checkpoint_dir) if args.checkpoint_dir else None
    if ckpt is not None and ckpt.is_dir() and any(d.name.isdigit() for d in ckpt.iterdir()):
        # Resume: the latest step, read where this run's plan reads it (any host count).
        layouts = step.input_layouts(params, state, batch)
        params, state = alpa_mini.restore_checkpoint(ckpt, target=layouts[:2])
        first = max(int(d.name) for d in ckpt.iterdir() if d.name.isdigit())
        print(f"resumed from {ckpt} at step {first}", flush=True)
    losses = []
    for i in range(first, args.steps):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
        print(f"step {i} loss {losses[-1]:.6f} ({time.perf_counter() - t0:.3f} s)", flush=True)
        every = args.checkpoint_every
        if ckpt is not None and (i + 1 == args.steps or (every and (i + 1) % every == 0)):
            last = i + 1 == args.steps  # the others are written in the background
            alpa_mini.save_checkpoint(ckpt, (params, state), step=i + 1, wait=last)
    alpa_mini.shutdown()
    if len(losses) < 2:
        print(f"nothing left to train: the checkpoint is at step {first}", flush=True)
        return 0
    fell = losses[-1] < losses[0]
    print("loss decreased" if fell else "loss did NOT decrease", flush=True)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
