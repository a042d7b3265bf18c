"""Seconds to compile six small GPT train steps (Adam, batch split over a 2 x 4 mesh of CPU
devices), for choosing the suite's XLA flags (``tests/conftest.py: TEST_XLA_FLAGS``).

    XLA_FLAGS="..." .venv/bin/python tests/helpers/compile_speed.py
"""

import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from alpa_mini.models import (  # noqa: E402
    GPTConfig,
    adam,
    gpt_loss,
    init_gpt,
    make_gpt_batch,
    make_train_step,
)


def main() -> None:
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
    t0 = time.perf_counter()
    for i in range(6):  # six widths: six distinct programs, none served from a cache
        cfg = GPTConfig(vocab_size=64, seq_len=16, hidden=32 + 8 * i, num_heads=4, num_layers=2)
        opt = adam(1e-2)
        step = make_train_step(lambda p, b, cfg=cfg: gpt_loss(p, b, cfg), opt)
        params = init_gpt(cfg, jax.random.PRNGKey(0))
        batch = jax.device_put(
            make_gpt_batch(cfg, jax.random.PRNGKey(1), 8), NamedSharding(mesh, P("x"))
        )
        jax.jit(step).lower(params, opt.init(params), batch).compile()
    print(f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
