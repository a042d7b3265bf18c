"""Train a small GPT with PipeshardParallel, locally or on a Ray cluster.

    python examples/train_gpt.py                          # one process, 8 simulated CPU devices
    python examples/train_gpt.py --cluster ray            # embedded Ray: 2 host workers x 4
    python examples/train_gpt.py --cluster ray --address auto   # a running Ray cluster
    python examples/train_gpt.py --cluster ray --stage-hosts 2  # one stage over both hosts

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", choices=["local", "ray"], default="local")
    parser.add_argument("--address", default=None, help="Ray address (default: start one)")
    parser.add_argument("--hosts", type=int, default=2, help="Ray CPU mode: simulated hosts")
    parser.add_argument("--devices", type=int, default=4, help="CPU devices per host")
    parser.add_argument("--stage-hosts", type=int, default=1, help="hosts per stage mesh")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args(argv)
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
    losses = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
        print(f"step {i} loss {losses[-1]:.6f} ({time.perf_counter() - t0:.3f} s)", flush=True)
    alpa_mini.shutdown()
    fell = losses[-1] < losses[0]
    print("loss decreased" if fell else "loss did NOT decrease", flush=True)
    return 0 if fell else 1


if __name__ == "__main__":
    sys.exit(main())
