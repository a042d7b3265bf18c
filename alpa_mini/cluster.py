"""Cluster descriptions: ``ClusterSpec`` (hardware) and ``LogicalMesh`` (what the ILP shards over).

A ``ClusterSpec`` says what the planner may assume: hosts x devices, each device's peak
FLOP/s per dtype, memory and HBM bandwidth, and the intra-host and inter-host links. It loads
from ``configs/clusters/*.yaml`` with errors that name the field. A ``LogicalMesh`` reshapes a
physical submesh into N-D axes and gives each axis the (alpha, beta) of the slowest link
it crosses, which is what the alpha-beta collective costs need.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ClusterSpec", "ConfigError", "DeviceKind", "Link", "LogicalMesh"]


class ConfigError(ValueError):
    """A cluster (or other) config is malformed; the message names the field and value."""


def _number(where: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{where}: {value!r} is invalid; expected a finite number {bound}")
    return float(value)


def _count(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {value!r} is invalid; expected an integer >= 1")
    return int(value)


def _mapping(where: str, value: Any, keys: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise ConfigError(
            f"{where}.{unknown[0]}: unknown field; valid fields: {', '.join(sorted(keys))}"
        )
    missing = sorted(keys - set(value))
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: missing field")
    return value


@dataclass(frozen=True)
class Link:
    """A network link: bandwidth in bytes/s and latency in seconds (alpha-beta model)."""

    bandwidth: float
    latency: float

    @property
    def alpha(self) -> float:
        return self.latency

    @property
    def beta(self) -> float:
        """Seconds per byte."""
        return 1.0 / self.bandwidth

    @classmethod
    def from_dict(cls, data: Any, where: str) -> Link:
        data = _mapping(where, data, {"bandwidth", "latency"})
        return cls(
            _number(f"{where}.bandwidth", data["bandwidth"]),
            _number(f"{where}.latency", data["latency"], positive=False),
        )


@dataclass(frozen=True)
class DeviceKind:
    """One accelerator type: peak FLOP/s per dtype name, memory and HBM bandwidth (bytes)."""

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float
    memory_bandwidth: float

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; an unlisted dtype falls back to float32's figure."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if "float32" in self.peak_flops:
            return self.peak_flops["float32"]
        raise ConfigError(
            f"device.peak_flops: no entry for {dtype!r} (and no float32 fallback); "
            f"listed: {', '.join(sorted(self.peak_flops))}"
        )

    @classmethod
    def from_dict(cls, data: Any, where: str) -> DeviceKind:
        data = _mapping(where, data, {"name", "peak_flops", "memory_bytes", "memory_bandwidth"})
        flops = data["peak_flops"]
        if not isinstance(flops, dict) or not flops:
            raise ConfigError(f"{where}.peak_flops: expected a non-empty mapping dtype -> FLOP/s")
        return cls(
            name=str(data["name"]),
            peak_flops={str(k): _number(f"{where}.peak_flops.{k}", v) for k, v in flops.items()},
            memory_bytes=_number(f"{where}.memory_bytes", data["memory_bytes"]),
            memory_bandwidth=_number(f"{where}.memory_bandwidth", data["memory_bandwidth"]),
        )


@dataclass(frozen=True)
class ClusterSpec:
    """Hosts x devices of one device kind, joined by an intra-host and an inter-host link."""

    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceKind
    intra_host: Link
    inter_host: Link

    def __post_init__(self) -> None:
        _count("num_hosts", self.num_hosts)
        _count("devices_per_host", self.devices_per_host)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def with_hosts(self, num_hosts: int) -> ClusterSpec:
        """The same hardware with another host count (configs describe a host type)."""
        return dataclasses.replace(self, num_hosts=_count("num_hosts", num_hosts))

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, data: Any) -> ClusterSpec:
        fields = {"name", "num_hosts", "devices_per_host", "device", "intra_host", "inter_host"}
        data = _mapping("cluster", data, fields)
        return cls(
            name=str(data["name"]),
            num_hosts=_count("cluster.num_hosts", data["num_hosts"]),
            devices_per_host=_count("cluster.devices_per_host", data["devices_per_host"]),
            device=DeviceKind.from_dict(data["device"], "cluster.device"),
            intra_host=Link.from_dict(data["intra_host"], "cluster.intra_host"),
            inter_host=Link.from_dict(data["inter_host"], "cluster.inter_host"),
        )

    @classmethod
    def from_yaml(cls, path: str | Path, *, num_hosts: int | None = None) -> ClusterSpec:
        """Load a cluster YAML; ``num_hosts`` overrides the file's host count."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({err})") from None
        try:
            spec = cls.from_dict(data)
        except ConfigError as err:
            raise ConfigError(f"{path}: {err}") from None
        return spec if num_hosts is None else spec.with_hosts(num_hosts)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> ClusterSpec:
        return cls.from_dict(json.loads(text))

    # ------------------------------------------------------------------ meshes
    def logical_mesh(
        self, shape: tuple[int, ...], submesh: tuple[int, int] | None = None
    ) -> LogicalMesh:
        """A logical mesh of ``shape`` over a (hosts, devices) submesh (default: all)."""
        return LogicalMesh.over(self, submesh or (self.num_hosts, self.devices_per_host), shape)


@dataclass(frozen=True)
class LogicalMesh:
    """An N-D view of a physical (hosts, devices) submesh with per-axis alpha-beta costs.

    Devices are laid out host-major: flat device d sits on host d // devices_per_host. An
    axis crosses hosts when stepping along it changes the host, i.e. when the product of the
    axis sizes from it to the last axis exceeds the devices per host of the submesh.
    """

    shape: tuple[int, ...]
    submesh: tuple[int, int]
    alphas: tuple[float, ...]
    betas: tuple[float, ...]
    crosses_hosts: tuple[bool, ...]

    @classmethod
    def over(
        cls, cluster: ClusterSpec, submesh: tuple[int, int], shape: tuple[int, ...]
    ) -> LogicalMesh:
        hosts, devices = submesh
        if not (1 <= hosts <= cluster.num_hosts and 1 <= devices <= cluster.devices_per_host):
            raise ConfigError(
                f"submesh: {submesh} does not fit the cluster's "
                f"({cluster.num_hosts}, {cluster.devices_per_host})"
            )
        if hosts > 1 and devices != cluster.devices_per_host:
            raise ConfigError(
                f"submesh: {submesh} spans hosts but uses part of each; multi-host submeshes "
                f"take whole hosts ({cluster.devices_per_host} devices)"
            )
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 1 for s in shape) or math.prod(shape) != hosts * devices:
            raise ConfigError(
                f"shape: {shape} must be positive sizes whose product is the submesh's "
                f"{hosts * devices} devices"
            )
        crosses = []
        inner = 1  # devices spanned by the axes after this one
        for size in reversed(shape):
            crosses.append(size > 1 and inner * size > devices)
            inner *= size
        crosses.reverse()
        alphas = tuple((cluster.inter_host if c else cluster.intra_host).alpha for c in crosses)
        betas = tuple((cluster.inter_host if c else cluster.intra_host).beta for c in crosses)
        return cls(shape, (hosts, devices), alphas, betas, tuple(crosses))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)
