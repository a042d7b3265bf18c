"""Cluster descriptions: ``ClusterSpec`` (hardware) and ``LogicalMesh`` (what the ILP shards over).

A ``ClusterSpec`` says what the planner may assume: hosts x devices, each device's peak
FLOP/s per dtype, memory and HBM bandwidth, and the intra-host and inter-host links. It loads
from ``configs/clusters/*.yaml`` with errors that name the field. A ``LogicalMesh`` reshapes a
physical submesh into N-D axes and gives each axis the (alpha, beta) of the slowest link
it crosses, which is what the alpha-beta collective costs need.

The bundled configs ship inside the package as ``alpa_mini.cluster_configs`` (the folder
``configs/clusters``): ``ClusterSpec.named("dgx-h100")`` / ``ClusterSpec.load(name_or_path)``
load them and ``available_clusters()`` lists them. ``ClusterSpec.detect()`` describes the live
JAX devices (JAX is imported only there, so importing this module stays light).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .._validate import positive_int
from ..errors import ConfigError, ProfileError
from .profile_db import ProfileDB

__all__ = [
    "ClusterSpec",
    "DeviceKind",
    "Link",
    "LogicalMesh",
    "available_clusters",
]

logger = logging.getLogger(__name__)

_CONFIG_PACKAGE = "alpa_mini.cluster_configs"
# Source checkout without an install: the configs folder next to the package.
_SOURCE_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "clusters"


def _number(where: str, value: Any, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{where}: {value!r} is invalid; expected a finite number {bound}")
    return float(value)


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


#: The largest clusters the planner is built for (the stage DP keeps a table per submesh
#: shape, one per host count): Megatron-LM's largest published run used 3072 GPUs.
MAX_HOSTS = 4096
MAX_DEVICES_PER_HOST = 1024


@dataclass(frozen=True)
class ClusterSpec:
    """Hosts x devices of one device kind, joined by an intra-host and an inter-host link."""

    name: str
    num_hosts: int
    devices_per_host: int
    device: DeviceKind
    intra_host: Link
    inter_host: Link
    profile: ProfileDB | None = None  # measured figures that replace the nominal ones

    def __post_init__(self) -> None:
        positive_int("num_hosts", self.num_hosts, high=MAX_HOSTS)
        positive_int("devices_per_host", self.devices_per_host, high=MAX_DEVICES_PER_HOST)

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host

    def with_hosts(self, num_hosts: int) -> ClusterSpec:
        """The same hardware with another host count (configs describe a host type)."""
        return dataclasses.replace(
            self, num_hosts=positive_int("num_hosts", num_hosts, high=MAX_HOSTS)
        )

    def with_profile(self, profile: ProfileDB | None) -> ClusterSpec:
        """The same cluster priced with measured figures (``alpa_mini.profile_devices``):
        compute by the profile's per-device throughput for a mesh's size, and collectives by
        its fits where it measured that kind and group size (else by the links)."""
        if profile is not None and not isinstance(profile, ProfileDB):
            raise ConfigError(f"profile: expected a ProfileDB or None, got {profile!r}")
        return dataclasses.replace(self, profile=profile)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, data: Any) -> ClusterSpec:
        fields = {"name", "num_hosts", "devices_per_host", "device", "intra_host", "inter_host"}
        profile = None
        if isinstance(data, dict) and "profile" in data:
            data = dict(data)
            raw = data.pop("profile")
            try:
                profile = None if raw is None else ProfileDB.from_dict(raw, "cluster.profile")
            except ProfileError as err:
                raise ConfigError(str(err)) from None
        data = _mapping("cluster", data, fields)
        return cls(
            name=str(data["name"]),
            num_hosts=positive_int("cluster.num_hosts", data["num_hosts"], high=MAX_HOSTS),
            devices_per_host=positive_int(
                "cluster.devices_per_host", data["devices_per_host"], high=MAX_DEVICES_PER_HOST
            ),
            device=DeviceKind.from_dict(data["device"], "cluster.device"),
            intra_host=Link.from_dict(data["intra_host"], "cluster.intra_host"),
            inter_host=Link.from_dict(data["inter_host"], "cluster.inter_host"),
            profile=profile,
        )

    @classmethod
    def from_yaml(cls, path: str | Path, *, num_hosts: int | None = None) -> ClusterSpec:
        """Load a cluster YAML; ``num_hosts`` overrides the file's host count."""
        path = Path(path)
        return cls._from_yaml_text(path.read_text(), str(path), num_hosts)

    @classmethod
    def _from_yaml_text(cls, text: str, where: str, num_hosts: int | None) -> ClusterSpec:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"{where}: not valid YAML ({err})") from None
        try:
            spec = cls.from_dict(data)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
        return spec if num_hosts is None else spec.with_hosts(num_hosts)

    @classmethod
    def named(cls, name: str, *, num_hosts: int | None = None) -> ClusterSpec:
        """A bundled cluster by name (see ``available_clusters()``), e.g. ``"dgx-h100"``.

        ``num_hosts`` overrides the file's host count. An unknown name raises ``ConfigError``
        listing the bundled names.
        """
        files = _bundled_files()
        if not isinstance(name, str) or name not in files:
            raise ConfigError(
                f"cluster {name!r}: unknown cluster name; bundled clusters: "
                f"{', '.join(sorted(files))} (or give the path of a cluster YAML)"
            )
        return cls._from_yaml_text(files[name].read_text(), f"{name} (bundled)", num_hosts)

    @classmethod
    def load(
        cls, name_or_path: str | os.PathLike[str], *, num_hosts: int | None = None
    ) -> ClusterSpec:
        """A bundled cluster name (``"cpu-2x4"``, ``"dgx-h100"``, ...) or a cluster YAML path.

        A bundled name wins over a same-named file in the working directory. A string is read
        as a path when it ends in ``.yaml``/``.yml``, contains a path separator, or names an
        existing file; anything else must be a bundled name.
        """
        if isinstance(name_or_path, str) and name_or_path in _bundled_files():
            return cls.named(name_or_path, num_hosts=num_hosts)
        if isinstance(name_or_path, os.PathLike) or (
            isinstance(name_or_path, str) and _looks_like_path(name_or_path)
        ):
            path = Path(name_or_path)
            if not path.is_file():
                raise ConfigError(f"{path}: no such cluster file")
            return cls.from_yaml(path, num_hosts=num_hosts)
        return cls.named(name_or_path, num_hosts=num_hosts)  # raises, listing the names

    @classmethod
    def detect(cls, devices: Sequence[Any] | None = None) -> ClusterSpec:
        """Describe live JAX devices (default: ``jax.devices()``) as a ``ClusterSpec``.

        Hosts are the distinct ``process_index`` values; every process must hold the same
        number of devices. The figures come from the bundled configs:

        - CPU devices: ``cpu-1x8``'s device and intra-host link; with several processes the
          inter-host link is ``cpu-2x4``'s (gloo over loopback TCP).
        - GPUs, matched on ``device_kind``: "H100" -> ``dgx-h100``; "H200" -> ``dgx-h100``
          (same Hopper compute; the H100's HBM bandwidth is an underestimate); "A100" ->
          ``dgx-a100``; "V100" -> ``p3.16xlarge``. Device and both links come from that file.
        - Anything else is planned with the conservative default, the weakest bundled GPU
          host (``p3.16xlarge``: V100 FLOP/s and HBM bandwidth, NVLink inside a host, 25 Gb/s
          between hosts); a warning names the unknown kind.

        For non-CPU devices the memory is the smallest ``memory_stats()["bytes_limit"]``
        (what XLA's allocator may use) when the devices report it, else the file's figure.
        The device name is the live ``device_kind``. Only this method imports JAX.
        """
        if devices is None:
            import jax

            devices = jax.devices()
        devices = list(devices)
        if not devices:
            raise ConfigError("detect: no devices to describe")
        per_process = Counter(d.process_index for d in devices)
        counts = set(per_process.values())
        if len(counts) != 1:
            raise ConfigError(
                f"detect: uneven devices per process (process_index: count) "
                f"{dict(sorted(per_process.items()))}; a ClusterSpec needs the same number "
                "of devices on every host"
            )
        kinds = sorted({(str(d.platform), str(d.device_kind)) for d in devices})
        if len(kinds) != 1:
            raise ConfigError(
                f"detect: mixed device kinds {kinds}; a ClusterSpec has one device kind"
            )
        platform, device_kind = kinds[0]
        num_hosts, per_host = len(per_process), counts.pop()

        label = _match_device_kind(platform, device_kind)
        if label is None:
            logger.warning(
                "ClusterSpec.detect: unknown device kind %r (platform %r); planning with the "
                "conservative default figures of %s (V100 FLOP/s, memory and links). Pass a "
                "cluster YAML for accurate plans.",
                device_kind,
                platform,
                _DEFAULT_CLUSTER,
            )
        base = cls.named(label or _DEFAULT_CLUSTER)
        inter = base.inter_host
        if label == "cpu-1x8" and num_hosts > 1:
            inter = cls.named("cpu-2x4").inter_host
        memory = base.device.memory_bytes
        if label != "cpu-1x8":
            memory = _bytes_limit(devices) or memory
        device = dataclasses.replace(base.device, name=device_kind, memory_bytes=memory)
        return cls(
            name=f"detected-{label or 'unknown'}-{num_hosts}x{per_host}",
            num_hosts=num_hosts,
            devices_per_host=per_host,
            device=device,
            intra_host=base.intra_host,
            inter_host=inter,
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(dataclasses.replace(self, profile=None))
        del out["profile"]
        if self.profile is not None:
            out["profile"] = self.profile.to_dict()
        return out

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


# ---------------------------------------------------------------------- bundled configs
# detect(): device_kind substring -> bundled config whose figures describe it (first match).
_GPU_KINDS = (
    ("H100", "dgx-h100"),
    ("H200", "dgx-h100"),
    ("A100", "dgx-a100"),
    ("V100", "p3.16xlarge"),
)
# detect(): figures for device kinds not listed above: the weakest bundled GPU host.
_DEFAULT_CLUSTER = "p3.16xlarge"


def _bundled_files() -> dict[str, Any]:
    """Bundled cluster name -> its YAML."""
    return bundled_yaml_files(_CONFIG_PACKAGE, _SOURCE_CONFIGS)


def bundled_yaml_files(package: str, source_dir: Path) -> dict[str, Any]:
    """Name -> YAML file (an ``importlib.resources`` Traversable or Path) of a bundled
    config package, or of its ``configs/`` folder in a source tree never installed."""
    try:
        root: Any = importlib.resources.files(package)
    except ModuleNotFoundError:
        root = source_dir
    return {
        entry.name.removesuffix(".yaml"): entry
        for entry in root.iterdir()
        if entry.name.endswith(".yaml") and entry.is_file()
    }


def available_clusters() -> list[str]:
    """Names of the bundled cluster configs, for ``ClusterSpec.named`` / ``ClusterSpec.load``."""
    return sorted(_bundled_files())


def _looks_like_path(text: str) -> bool:
    seps = {"/", os.sep, *([os.altsep] if os.altsep else [])}
    return (
        text.endswith((".yaml", ".yml")) or any(sep in text for sep in seps) or Path(text).is_file()
    )


def _match_device_kind(platform: str, device_kind: str) -> str | None:
    """The bundled config whose figures describe this device, or None if unknown."""
    if platform == "cpu":
        return "cpu-1x8"
    kind = device_kind.upper()
    return next((config for token, config in _GPU_KINDS if token in kind), None)


def _bytes_limit(devices: Sequence[Any]) -> float | None:
    """The smallest allocator limit the (addressable) devices report, if any do."""
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # not addressable from this process, or not supported
            continue
        limit = (stats or {}).get("bytes_limit")
        if isinstance(limit, int | float) and not isinstance(limit, bool) and limit > 0:
            limits.append(float(limit))
    return min(limits) if limits else None


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
