"""Checks for a machine with one GPU: the demo, the cost-model calibration and the step-time
comparisons, each on the single device. ``benchmarks/gpu_checks.sh`` runs every step (one
process each) and collects the logs; one step alone:

    python -m benchmarks.gpu_checks env --json OUT/gpu-h100.json
    python -m benchmarks.gpu_checks demo --steps 5 --json OUT/gpu-h100.json
    python -m benchmarks.gpu_checks profile --repeats 7 --profile OUT/gpu-profile.json ...
    python -m benchmarks.gpu_checks calibration --profile OUT/gpu-profile.json ...
    python -m benchmarks.gpu_checks steps --steps 20 --json OUT/gpu-h100.json

Every step merges its results into the ``--json`` file under its own key (they run one after
another) and exits 1 when a check fails, 0 otherwise.

- *demo*: what ``alpa-mini demo --cluster local --devices 1`` and ``alpa-mini demo --method
  shard --devices 1`` run (``alpa_mini.cli.demo``): plan, train a few steps, compare with
  serial ``jax.jit``. On a GPU, ``cluster="local"`` describes the live device
  (``ClusterSpec.detect()``: an H100 gets ``dgx-h100``'s figures).
- *profile*: ``alpa_mini.cluster.profile_devices`` on the local devices (one GPU: compute
  only, no collectives), saved as the profile database; beside it a matmul sweep per dtype
  at sizes that fill the GPU (random inputs; relative error against float64 on the host)
  and the bandwidth of a large elementwise pass (read + write counted).
- *calibration*: ``benchmarks.calibration.measure_child`` for each test model on the
  one-device layout (one stage, submesh 1x1): predicted against measured stage time, with
  the nominal figures and with the profile attached.
- *steps*: ``benchmarks.shard_parallel.step_time_table`` (ours against ``jax.jit`` with the
  plan's shardings, alternating, paired ratio) on mesh (1,), and
  ``benchmarks.runtime_parity.parity_row`` (one pipeshard stage against the same-shardings
  jit, pairs of flipping order) on one device.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The one-device calibration layout: (stages, submesh (hosts, devices), logical mesh).
ONE_DEVICE_LAYOUT = (1, (1, 1), (1,))
#: (label, dtype name, precision) of the matmul sweep; None is JAX's default precision.
MATMUL_DTYPES: tuple[tuple[str, str, str | None], ...] = (
    ("float32 (default precision)", "float32", None),
    ("float32 (HIGHEST)", "float32", "highest"),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
)


# ================================================================ helpers
def _merge(path: Path | None, key: str, value: Any) -> None:
    """Store ``value`` under ``key`` in the JSON file at ``path`` (created if missing)."""
    if path is None:
        return
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _guarded(name: str, fn: Callable[[], Any], errors: list[dict[str, str]]) -> Any:
    """``fn()``, or None with the error recorded (one failing item must not stop a step)."""
    try:
        return fn()
    except Exception as err:  # reported in the JSON and the log, the step goes on
        traceback.print_exc()
        errors.append({"item": name, "error": f"{type(err).__name__}: {err}"})
        print(f"FAILED {name}: {type(err).__name__}: {err}", flush=True)
        return None


def _devices_record() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    stats: dict[str, Any] = {}
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # CPU devices may not report
        stats = {}
    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "bytes_limit": stats.get("bytes_limit"),
        "host": platform.node(),
        "machine": platform.machine(),
    }


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# ================================================================ env
def env_step(opts: argparse.Namespace) -> int:
    import alpa_mini

    cluster = alpa_mini.init(cluster="local", num_cpu_devices=1)
    record = _devices_record()
    record["cluster"] = {
        "name": cluster.name,
        "num_devices": cluster.num_devices,
        "device": cluster.device.name,
        "memory_bytes": cluster.device.memory_bytes,
    }
    record["packages"] = {
        d: _version(d) for d in ("numpy", "highspy", "pulp", "jax-cuda13-plugin", "flax", "optax")
    }
    print(json.dumps(record, indent=1, default=str), flush=True)
    _merge(opts.json, "env", record)
    return 0


# ================================================================ demo
def demo_step(opts: argparse.Namespace) -> int:
    from alpa_mini.cli.demo import run_demo, run_pipeshard_demo

    errors: list[dict[str, str]] = []
    results: dict[str, Any] = {}
    if "pipeshard" in opts.methods:
        print("== alpa-mini demo --cluster local --devices 1", flush=True)
        results["pipeshard"] = _guarded(
            "pipeshard",
            lambda: run_pipeshard_demo(
                num_devices=1,
                steps=opts.steps,
                num_micro_batches=opts.micro_batches,
                cluster_name="local",
            ),
            errors,
        )
    if "shard" in opts.methods:
        print("== alpa-mini demo --method shard --devices 1", flush=True)
        results["shard"] = _guarded(
            "shard", lambda: run_demo(num_devices=1, steps=opts.steps), errors
        )
    results["errors"] = errors
    results["matmul_precision"] = _matmul_precision()
    key = "demo" if results["matmul_precision"] in (None, "default") else "demo_highest"
    _merge(opts.json, key, results)
    ok = not errors and all(r and r["ok"] for k, r in results.items() if k in opts.methods)
    return 0 if ok else 1


def _matmul_precision() -> str | None:
    import jax

    value = jax.config.jax_default_matmul_precision
    return None if value is None else str(value)


# ================================================================ profile
def _timed_median(fn: Callable[[], Any], repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean seconds of ``inner`` back-to-back calls (queued
    asynchronously, one wait at the end), after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def matmul_sweep(sizes: Sequence[int], repeats: int, inner: int) -> list[dict[str, Any]]:
    """TFLOP/s of an n x n x n matmul per dtype and size (random normal inputs), and the
    relative error of the smallest size against a float64 product on the host."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = []
    for label, dtype_name, precision in MATMUL_DTYPES:
        dtype = jnp.dtype(dtype_name)
        fn = jax.jit(lambda a, b, p=precision: jnp.matmul(a, b, precision=p))
        for n in sizes:
            ka, kb = jax.random.split(jax.random.PRNGKey(n))
            a = jax.random.normal(ka, (n, n), jnp.float32).astype(dtype)
            b = jax.random.normal(kb, (n, n), jnp.float32).astype(dtype)
            seconds = _timed_median(lambda f=fn, a=a, b=b: f(a, b), repeats, inner)
            row = {
                "dtype": label,
                "n": n,
                "seconds": seconds,
                "tflops": 2.0 * n**3 / seconds / 1e12,
            }
            if n == min(sizes):
                ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
                got = np.asarray(fn(a, b), np.float64)
                row["rel_error_vs_f64"] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            rows.append(row)
            print("MATMUL", json.dumps(row), flush=True)
            del a, b
    return rows


def copy_bandwidth(mib: int, repeats: int, inner: int) -> dict[str, Any]:
    """GB/s of ``y = x * 1.5 + 1`` over a float32 array of ``mib`` MiB (bytes read + written)."""
    import jax
    import jax.numpy as jnp

    elems = mib * 2**20 // 4
    x = jax.random.normal(jax.random.PRNGKey(0), (elems,), jnp.float32)
    fn = jax.jit(lambda v: v * 1.5 + 1.0)
    seconds = _timed_median(lambda: fn(x), repeats, inner)
    row = {"mib": mib, "seconds": seconds, "gb_per_s": 2.0 * elems * 4 / seconds / 1e9}
    print("BANDWIDTH", json.dumps(row), flush=True)
    return row


def profile_step(opts: argparse.Namespace) -> int:
    from benchmarks.calibration import profile_child

    errors: list[dict[str, str]] = []
    t0 = time.perf_counter()
    prof = profile_child(opts.repeats, cluster="local", num_cpu_devices=1)
    print(f"profile_devices: {prof['seconds']:.1f} s", flush=True)
    print(json.dumps(prof["profile"], indent=1), flush=True)
    if opts.profile is not None:
        opts.profile.parent.mkdir(parents=True, exist_ok=True)
        opts.profile.write_text(json.dumps(prof["profile"], indent=1) + "\n")
    sweep = _guarded(
        "matmul sweep", lambda: matmul_sweep(opts.sizes, opts.repeats, opts.inner), errors
    )
    bandwidth = _guarded(
        "bandwidth", lambda: copy_bandwidth(opts.copy_mib, opts.repeats, opts.inner), errors
    )
    record = {
        "profile_devices": prof,
        "matmul": sweep,
        "bandwidth": bandwidth,
        "errors": errors,
        "seconds": time.perf_counter() - t0,
    }
    _merge(opts.json, "profile", record)
    return 1 if errors else 0


# ================================================================ calibration
def calibration_step(opts: argparse.Namespace) -> int:
    from benchmarks.calibration import MODELS, error_summary, measure_child

    unknown = [m for m in opts.models if m not in MODELS]
    if unknown:
        raise SystemExit(f"--models: {unknown[0]!r} is not one of {', '.join(MODELS)}")
    if opts.profile is None or not opts.profile.exists():
        raise SystemExit(f"--profile: {opts.profile} does not exist; run the profile step first")
    profile = json.loads(opts.profile.read_text())
    errors: list[dict[str, str]] = []
    points: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for name in opts.models:
        t0 = time.perf_counter()
        got = _guarded(
            name,
            lambda name=name: measure_child(
                name, profile, cluster="local", num_cpu_devices=1, layouts=(ONE_DEVICE_LAYOUT,)
            ),
            errors,
        )
        for p in got or []:
            p["error"] = abs(p["predicted"] - p["measured"]) / p["measured"]
            print("POINT", json.dumps(p), flush=True)
        points += got or []
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        # Saved after every model, so a step cut by its timeout keeps what it measured.
        summary = {which: error_summary(points, which) for which in ("profiled", "nominal")}
        record = {"points": points, "summary": summary, "errors": errors}
        _merge(opts.json, "calibration", record)
    print(json.dumps(summary, indent=1), flush=True)
    return 1 if errors else 0


# ================================================================ steps
def _table_rows(markdown: str) -> list[dict[str, str]]:
    """The rows of a one-table markdown string as dicts keyed by the header cells."""
    lines = [ln for ln in markdown.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(header, (c.strip() for c in ln.strip("|").split("|")), strict=True))
        for ln in lines[2:]
    ]


def steps_step(opts: argparse.Namespace) -> int:
    # runtime_parity sets jax_num_cpu_devices=8 on import (its CPU mode); init below sets 1
    # again before any backend starts. Neither touches the GPU backend.
    import alpa_mini
    from benchmarks import runtime_parity

    alpa_mini.init(cluster="local", num_cpu_devices=1)
    from benchmarks.shard_parallel import step_time_table, step_workloads

    errors: list[dict[str, str]] = []
    record: dict[str, Any] = {"steps": opts.steps}
    if "shard" in opts.sections:
        wanted = set(opts.shard_models)
        workloads = [w for w in step_workloads() if w.name in wanted]
        table = _guarded(
            "shard step time", lambda: step_time_table(workloads, opts.steps, 2, (1,)), errors
        )
        if table:
            print(table, flush=True)
            record["shard_parallel"] = {"markdown": table, "rows": _table_rows(table)}
        _merge(opts.json, "steps", {**record, "errors": errors})
    if "parity" in opts.sections:
        rows = []
        for model in opts.parity_models:
            for B in opts.micro_batches:
                row = _guarded(
                    f"parity {model} B={B}",
                    lambda m=model, b=B: runtime_parity.parity_row(m, b, opts.steps, 1),
                    errors,
                )
                if row:
                    row["ratio"] = row["pipe_ms"] / row["jit_ms"]
                    print("PARITY", json.dumps(row), flush=True)
                    rows.append(row)
                record["runtime_parity"] = rows
                _merge(opts.json, "steps", {**record, "errors": errors})
    record["errors"] = errors
    _merge(opts.json, "steps", record)
    return 1 if errors else 0


# ================================================================ main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="merge results into this file")
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("env", help="python, jax and the devices")
    demo = sub.add_parser("demo", help="the pipeshard and shard demos on one device")
    demo.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    demo.add_argument("--micro-batches", type=int, default=4, help="pipeshard B (default 4)")
    demo.add_argument("--methods", type=_names, default=("pipeshard", "shard"))
    prof = sub.add_parser("profile", help="profile_devices, a matmul sweep per dtype, bandwidth")
    prof.add_argument("--repeats", type=int, default=7, help="timed repeats (default 7)")
    prof.add_argument("--inner", type=int, default=10, help="calls per timed repeat (sweep)")
    prof.add_argument("--sizes", type=_ints, default=(1024, 4096, 8192), help="matmul n list")
    prof.add_argument("--copy-mib", type=int, default=1024, help="elementwise array MiB")
    prof.add_argument("--profile", type=Path, default=None, help="write the ProfileDB here")
    cal = sub.add_parser("calibration", help="predicted vs measured stage time, one device")
    cal.add_argument("--profile", type=Path, required=True, help="the profile step's ProfileDB")
    cal.add_argument(
        "--models",
        type=_names,
        default=("mlp-small", "gpt-tiny", "gpt-small", "moe-small", "wresnet-small"),
    )
    steps = sub.add_parser("steps", help="ours vs jax.jit step time on one device")
    steps.add_argument("--steps", type=int, default=20, help="timed steps per side (default 20)")
    steps.add_argument("--sections", type=_names, default=("shard", "parity"))
    steps.add_argument("--shard-models", type=_names, default=("GPT_SMALL", "MLP"))
    steps.add_argument("--parity-models", type=_names, default=("mlp-6x1024", "gpt-4x128"))
    steps.add_argument("--micro-batches", type=_ints, default=(1, 8), help="parity B list")
    opts = parser.parse_args(argv)
    handlers = {
        "env": env_step,
        "demo": demo_step,
        "profile": profile_step,
        "calibration": calibration_step,
        "steps": steps_step,
    }
    return handlers[opts.step](opts)


if __name__ == "__main__":
    raise SystemExit(main())
