"""``ProfileDB``: measured compute and collective figures that replace a cluster's nominal ones.

The analytic cost model (``cost_model.py``) prices work with a roofline over the device's peak
FLOP/s and memory bandwidth, and collectives with one alpha-beta pair per link. A profile
database holds what micro-benchmarks measured instead (``alpa_mini.cluster.microbench``):

- per number of devices running at once, the FLOP/s of a matmul and the bytes/s of an
  elementwise op *per device*. Simulated CPU devices share the host's cores, so a device
  computes slower when more of its mesh computes with it; on a GPU the entries agree;
- per collective kind and group size, an alpha-beta fit of the measured times against the
  cost model's own byte factors (all-reduce ``2(n-1)/n B``, all-gather and reduce-scatter
  ``(n-1)/n B``, all-to-all ``(n-1)/(2n) B``), so that the model's formulas reproduce the
  measurements.

``ClusterSpec.with_profile(db)`` attaches one; plans made on that cluster are priced with it.
It is plain data: JSON round-trips it, and every bad field is named when loading.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._validate import positive_int
from ..errors import ProfileError

__all__ = [
    "COLLECTIVE_KINDS",
    "CollectiveFit",
    "ComputeFit",
    "ProfileDB",
    "byte_factor",
    "fit_alpha_beta",
    "op_class",
]

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


#: Op classes with their own measured rate; every other op is priced at the matmul rate and
#: the elementwise bandwidth (a roofline). Flops of elementwise ops and reductions are their
#: element counts (``tracing.equation_flops``), so these rates are elements per second.
OP_CLASSES = {
    "transcendental": frozenset(
        """
        exp exp2 expm1 log log1p tanh logistic erf erfc erf_inv sin cos tan sinh cosh asin
        acos atan atan2 asinh acosh atanh sqrt rsqrt cbrt pow lgamma digamma igamma igammac
        """.split()  # noqa: SIM905
    ),
    "reduction": frozenset(
        """
        reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin
        cumsum cumprod cummax cummin cumlogsumexp
        """.split()  # noqa: SIM905
    ),
}


def op_class(primitive: str) -> str:
    """The class whose measured rate prices ``primitive`` ("" for the roofline)."""
    for name, members in OP_CLASSES.items():
        if primitive in members:
            return name
    return ""


def byte_factor(kind: str, n: int) -> float:
    """Bytes on the slowest link per buffer byte, as the cost model counts them (DESIGN 5.4)."""
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all-gather", "reduce-scatter"):  # B: the gathered result / the full input
        return (n - 1) / n
    if kind == "all-to-all":
        return (n - 1) / (2.0 * n)
    raise ProfileError(f"kind: {kind!r} is not one of {', '.join(COLLECTIVE_KINDS)}")


def fit_alpha_beta(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """``t = alpha + beta x`` fitted for relative error (least squares weighted by 1/t^2, so
    the small sizes that decide alpha count as much as the large ones that decide beta), both
    clipped at zero (a negative latency or per-byte time is noise, not physics); needs two
    distinct ``xs`` and positive ``ts``."""
    if len(xs) != len(ts) or len(set(xs)) < 2 or min(ts) <= 0:
        raise ValueError(
            "fit_alpha_beta: needs at least two distinct x values, one positive t each"
        )
    w = [1.0 / t**2 for t in ts]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, xs, strict=True)) / sw
    mt = sum(wi * t for wi, t in zip(w, ts, strict=True)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs, strict=True))
    sxt = sum(wi * (x - mx) * (t - mt) for wi, x, t in zip(w, xs, ts, strict=True))
    beta = sxt / sxx
    if beta <= 0:  # flat: all latency
        return max(mt, 0.0), 0.0
    alpha = mt - beta * mx
    if alpha < 0:  # refit through the origin
        num = sum(wi * x * t for wi, x, t in zip(w, xs, ts, strict=True))
        beta = num / sum(wi * x * x for wi, x in zip(w, xs, strict=True))
        alpha = 0.0
    return alpha, beta


@dataclass(frozen=True)
class ComputeFit:
    """Per-device throughput while ``busy_devices`` devices compute together."""

    busy_devices: int
    matmul_flops: float  # FLOP/s per device (float32 matmul)
    memory_bandwidth: float  # bytes/s per device (elementwise read + write)
    launch_overhead: float = 0.0  # seconds to start one program on these devices
    kernel_overhead: float = 0.0  # seconds per kernel beyond its roofline time (matmul fit)
    rates: tuple[tuple[str, float], ...] = ()  # (op class, elements/s per device)

    def rate_for(self, primitive: str) -> float:
        """Work per second of ``primitive``: its class's measured rate, else the matmul's."""
        name = op_class(primitive)
        return next((r for c, r in self.rates if c == name), self.matmul_flops)


@dataclass(frozen=True)
class CollectiveFit:
    """``seconds = alpha + beta * byte_factor(kind, group_size) * bytes`` for one group size."""

    kind: str
    group_size: int
    alpha: float  # seconds
    beta: float  # seconds per byte

    def seconds(self, nbytes: float) -> float:
        return self.alpha + self.beta * byte_factor(self.kind, self.group_size) * nbytes


@dataclass(frozen=True)
class ProfileDB:
    """Measured figures for one device kind (see the module docstring)."""

    device: str
    compute: tuple[ComputeFit, ...]
    collectives: tuple[CollectiveFit, ...] = ()
    machine: str = ""  # where and how it was measured, for the reader

    def __post_init__(self) -> None:
        if not self.compute:
            raise ProfileError("profile.compute: needs at least one entry")
        busy = [c.busy_devices for c in self.compute]
        if len(set(busy)) != len(busy):
            raise ProfileError(f"profile.compute: busy_devices repeat: {busy}")
        keys = [(c.kind, c.group_size) for c in self.collectives]
        if len(set(keys)) != len(keys):
            raise ProfileError(f"profile.collectives: (kind, group_size) repeat: {keys}")

    def compute_for(self, busy_devices: int) -> ComputeFit:
        """The entry for ``busy_devices``; else the nearest measured count (ties: the larger,
        the slower and so the safer guess on shared cores)."""
        return min(
            self.compute,
            key=lambda c: (abs(c.busy_devices - busy_devices), -c.busy_devices),
        )

    def collective(self, kind: str, group_size: int) -> CollectiveFit | None:
        """The fit for ``kind`` over ``group_size`` devices, if that was measured."""
        for c in self.collectives:
            if c.kind == kind and c.group_size == group_size:
                return c
        return None

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "machine": self.machine,
            "compute": [
                {
                    "busy_devices": c.busy_devices,
                    "matmul_flops": c.matmul_flops,
                    "memory_bandwidth": c.memory_bandwidth,
                    "launch_overhead": c.launch_overhead,
                    "kernel_overhead": c.kernel_overhead,
                    "rates": dict(c.rates),
                }
                for c in self.compute
            ],
            "collectives": [
                {"kind": c.kind, "group_size": c.group_size, "alpha": c.alpha, "beta": c.beta}
                for c in self.collectives
            ],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> ProfileDB:
        data = _fields(where, data, {"device", "compute"}, {"collectives", "machine"})
        if not isinstance(data["device"], str) or not data["device"]:
            raise ProfileError(f"{where}.device: {data['device']!r} is not a device name")
        compute = []
        for i, c in enumerate(_list(f"{where}.compute", data["compute"])):
            at = f"{where}.compute[{i}]"
            optional = {"launch_overhead", "kernel_overhead", "rates"}
            c = _fields(at, c, {"busy_devices", "matmul_flops", "memory_bandwidth"}, optional)
            rates = c.get("rates", {})
            if not isinstance(rates, dict):
                raise ProfileError(f"{at}.rates: expected a mapping op class -> rate")
            bad = sorted(set(rates) - set(OP_CLASSES))
            if bad:
                raise ProfileError(
                    f"{at}.rates.{bad[0]}: unknown op class; valid: {', '.join(OP_CLASSES)}"
                )
            compute.append(
                ComputeFit(
                    positive_int(f"{at}.busy_devices", c["busy_devices"], ProfileError),
                    _positive(f"{at}.matmul_flops", c["matmul_flops"]),
                    _positive(f"{at}.memory_bandwidth", c["memory_bandwidth"]),
                    _positive(f"{at}.launch_overhead", c.get("launch_overhead", 0.0), zero=True),
                    _positive(f"{at}.kernel_overhead", c.get("kernel_overhead", 0.0), zero=True),
                    tuple((k, _positive(f"{at}.rates.{k}", v)) for k, v in sorted(rates.items())),
                )
            )
        collectives = []
        for i, c in enumerate(_list(f"{where}.collectives", data.get("collectives", []))):
            at = f"{where}.collectives[{i}]"
            c = _fields(at, c, {"kind", "group_size", "alpha", "beta"}, set())
            if c["kind"] not in COLLECTIVE_KINDS:
                raise ProfileError(
                    f"{at}.kind: {c['kind']!r} is not one of {', '.join(COLLECTIVE_KINDS)}"
                )
            size = positive_int(f"{at}.group_size", c["group_size"], ProfileError)
            if size < 2:
                raise ProfileError(f"{at}.group_size: {size} is invalid; expected >= 2")
            collectives.append(
                CollectiveFit(
                    c["kind"],
                    size,
                    _positive(f"{at}.alpha", c["alpha"], zero=True),
                    _positive(f"{at}.beta", c["beta"], zero=True),
                )
            )
        machine = data.get("machine", "")
        if not isinstance(machine, str):
            raise ProfileError(f"{where}.machine: {machine!r} is not a string")
        try:
            return cls(data["device"], tuple(compute), tuple(collectives), machine)
        except ProfileError as err:
            raise ProfileError(f"{where}: {err}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str = "profile") -> ProfileDB:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProfileError(f"{where}: not valid JSON ({err})") from None
        return cls.from_dict(data, where)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ProfileDB:
        path = Path(path)
        if not path.is_file():
            raise ProfileError(f"{path}: no such profile file")
        return cls.from_json(path.read_text(), str(path))


def _fields(where: str, value: Any, required: set[str], optional: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProfileError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - required - optional)
    if unknown:
        valid = ", ".join(sorted(required | optional))
        raise ProfileError(f"{where}.{unknown[0]}: unknown field; valid fields: {valid}")
    missing = sorted(required - set(value))
    if missing:
        raise ProfileError(f"{where}.{missing[0]}: missing field")
    return value


def _list(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def _positive(where: str, value: Any, *, zero: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise ProfileError(f"{where}: {value!r} is invalid; expected a finite number {bound}")
    return float(value)
