"""Cluster YAMLs load and validate; logical-mesh axes get the link each one crosses."""

from __future__ import annotations

import importlib.resources
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from alpa_mini.cluster.spec import ClusterSpec, LogicalMesh, available_clusters
from alpa_mini.errors import ConfigError

CLUSTERS = Path(__file__).resolve().parents[2] / "configs" / "clusters"


@pytest.mark.parametrize("path", sorted(CLUSTERS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_cluster_config_loads_and_round_trips(path: Path) -> None:
    spec = ClusterSpec.from_yaml(path)
    assert spec.name == path.stem
    assert ClusterSpec.from_json(spec.to_json()) == spec
    assert spec.num_devices == spec.num_hosts * spec.devices_per_host
    # Links inside a host are never slower than links between hosts.
    assert spec.intra_host.bandwidth >= spec.inter_host.bandwidth


def test_all_agreed_clusters_exist() -> None:
    names = {p.stem for p in CLUSTERS.glob("*.yaml")}
    assert {"cpu-1x8", "cpu-2x4", "p3.16xlarge", "dgx-a100", "dgx-h100"} <= names


def test_host_count_is_a_parameter() -> None:
    spec = ClusterSpec.from_yaml(CLUSTERS / "dgx-h100.yaml", num_hosts=16)
    assert (spec.num_hosts, spec.num_devices) == (16, 128)
    with pytest.raises(ConfigError, match="num_hosts: 0 is invalid"):
        spec.with_hosts(0)


def test_axes_get_the_link_they_cross() -> None:
    spec = ClusterSpec.from_yaml(CLUSTERS / "cpu-2x4.yaml")
    mesh = spec.logical_mesh((2, 4))
    assert mesh.crosses_hosts == (True, False)
    assert mesh.betas == (1 / spec.inter_host.bandwidth, 1 / spec.intra_host.bandwidth)
    assert mesh.alphas == (spec.inter_host.latency, spec.intra_host.latency)
    # (4, 2): the size-4 axis has stride 2 and spans 8 devices, so it leaves the host.
    assert spec.logical_mesh((4, 2)).crosses_hosts == (True, False)
    assert spec.logical_mesh((8,)).crosses_hosts == (True,)
    one_host = spec.logical_mesh((2, 2), submesh=(1, 4))
    assert one_host.crosses_hosts == (False, False)
    assert spec.logical_mesh((1, 8)).crosses_hosts == (False, True)  # size-1 axes cross nothing
    assert isinstance(mesh, LogicalMesh) and mesh.num_devices == 8


def test_mesh_shape_errors_name_the_problem() -> None:
    spec = ClusterSpec.from_yaml(CLUSTERS / "cpu-2x4.yaml")
    with pytest.raises(ConfigError, match=r"shape: \(3, 3\).*8 devices"):
        spec.logical_mesh((3, 3))
    with pytest.raises(ConfigError, match=r"submesh: \(2, 2\) spans hosts"):
        spec.logical_mesh((4,), submesh=(2, 2))
    with pytest.raises(ConfigError, match=r"submesh: \(3, 4\) does not fit"):
        spec.logical_mesh((12,), submesh=(3, 4))


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.pop("inter_host"), r"cluster\.inter_host: missing field"),
        (
            lambda d: d["intra_host"].__setitem__("bandwidth", -1),
            r"cluster\.intra_host\.bandwidth: -1",
        ),
        (
            lambda d: d["device"].__setitem__("memory_bytes", "lots"),
            r"memory_bytes: expected a number",
        ),
        (
            lambda d: d.__setitem__("devices_per_host", 0),
            r"cluster\.devices_per_host: 0 is invalid",
        ),
        (lambda d: d.__setitem__("gpus", 8), r"cluster\.gpus: unknown field"),
        (lambda d: d["device"].__setitem__("peak_flops", {}), r"peak_flops: expected a non-empty"),
    ],
)
def test_bad_cluster_files_name_the_field(tmp_path: Path, edit, match: str) -> None:
    data = yaml.safe_load((CLUSTERS / "cpu-2x4.yaml").read_text())
    edit(data)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=match):
        ClusterSpec.from_yaml(bad)


# ---------------------------------------------------------------------- bundled configs
BUNDLED = {"cpu-1x8", "cpu-2x4", "p3.16xlarge", "dgx-a100", "dgx-h100"}


def test_bundled_names_are_the_config_files() -> None:
    assert available_clusters() == sorted(p.stem for p in CLUSTERS.glob("*.yaml"))
    assert set(available_clusters()) >= BUNDLED


@pytest.mark.parametrize("name", sorted(BUNDLED))
def test_named_and_load_match_the_file(name: str) -> None:
    from_file = ClusterSpec.from_yaml(CLUSTERS / f"{name}.yaml", num_hosts=3)
    assert ClusterSpec.named(name, num_hosts=3) == from_file
    assert ClusterSpec.load(name, num_hosts=3) == from_file
    assert ClusterSpec.load(CLUSTERS / f"{name}.yaml") == ClusterSpec.from_yaml(
        CLUSTERS / f"{name}.yaml"
    )
    assert ClusterSpec.load(str(CLUSTERS / f"{name}.yaml"), num_hosts=3) == from_file


def test_unknown_name_lists_the_bundled_names(tmp_path: Path) -> None:
    for call in (ClusterSpec.named, ClusterSpec.load):
        with pytest.raises(ConfigError) as err:
            call("dgx-b200")
        assert "'dgx-b200': unknown cluster name" in str(err.value)
        assert all(name in str(err.value) for name in BUNDLED)
    with pytest.raises(ConfigError, match="unknown cluster name"):
        ClusterSpec.named(str(CLUSTERS / "cpu-1x8.yaml"))  # named() takes names only
    with pytest.raises(ConfigError, match="no such cluster file"):
        ClusterSpec.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="no such cluster file"):
        ClusterSpec.load("missing.yml")


def test_configs_ship_as_package_data() -> None:
    """The YAMLs are package data of ``alpa_mini.cluster_configs``, not read from the repo."""
    root = importlib.resources.files("alpa_mini.cluster_configs")
    shipped = {e.name for e in root.iterdir() if e.name.endswith(".yaml")}
    assert shipped == {p.name for p in CLUSTERS.glob("*.yaml")}
    setuptools = tomllib.loads((CLUSTERS.parents[1] / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    assert "alpa_mini.cluster_configs" in setuptools["packages"]
    assert setuptools["package-dir"]["alpa_mini.cluster_configs"] == "configs/clusters"
    assert "*.yaml" in setuptools["package-data"]["alpa_mini.cluster_configs"]


def test_cluster_module_does_not_import_jax() -> None:
    # Cluster descriptions and profile databases load in a fresh interpreter without JAX.
    script = (
        "import sys\n"
        "from alpa_mini.cluster.spec import ClusterSpec\n"
        "from alpa_mini.cluster.profile_db import ProfileDB\n"
        "assert ClusterSpec.named('cpu-2x4').num_devices == 8\n"
        "assert 'jax' not in sys.modules, 'cluster.py or profile_db.py imported jax'\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------- detect
def fake_devices(kind: str, hosts: int, per_host: int, *, platform="gpu", limit=None) -> list:
    """Stand-ins with the attributes detect() reads from a jax Device."""

    def stats():
        if limit == "raise":
            raise RuntimeError("memory_stats unsupported")
        return None if limit is None else {"bytes_limit": limit, "bytes_in_use": 0}

    return [
        SimpleNamespace(process_index=h, platform=platform, device_kind=kind, memory_stats=stats)
        for h in range(hosts)
        for _ in range(per_host)
    ]


def test_detect_the_live_cpu_devices() -> None:
    spec = ClusterSpec.detect()  # the test session's 8 CPU devices (conftest.py)
    ref = ClusterSpec.named("cpu-1x8")
    assert (spec.num_hosts, spec.devices_per_host, spec.num_devices) == (1, 8, 8)
    assert (spec.device, spec.intra_host, spec.inter_host) == (
        ref.device,
        ref.intra_host,
        ref.inter_host,
    )
    assert ClusterSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    ("kind", "config"),
    [
        ("NVIDIA H100 80GB HBM3", "dgx-h100"),
        ("NVIDIA H200", "dgx-h100"),
        ("NVIDIA A100-SXM4-80GB", "dgx-a100"),
        ("NVIDIA A100-SXM4-40GB", "dgx-a100"),
        ("Tesla V100-SXM2-16GB", "p3.16xlarge"),
    ],
)
def test_detect_matches_gpu_kinds_to_the_bundled_figures(kind: str, config: str) -> None:
    ref = ClusterSpec.named(config)
    spec = ClusterSpec.detect(fake_devices(kind, 2, 4, limit=60 * 2**30))
    assert (spec.num_hosts, spec.devices_per_host) == (2, 4)
    assert spec.name == f"detected-{config}-2x4"
    assert spec.device.name == kind
    assert spec.device.peak_flops == ref.device.peak_flops
    assert spec.device.memory_bandwidth == ref.device.memory_bandwidth
    assert spec.device.memory_bytes == 60 * 2**30  # the allocator limit, not the file's
    assert (spec.intra_host, spec.inter_host) == (ref.intra_host, ref.inter_host)


@pytest.mark.parametrize("limit", [None, "raise"])
def test_detect_without_memory_stats_uses_the_file(limit) -> None:
    spec = ClusterSpec.detect(fake_devices("Tesla V100-SXM2-16GB", 1, 8, limit=limit))
    assert spec.device.memory_bytes == ClusterSpec.named("p3.16xlarge").device.memory_bytes


def test_detect_unknown_kind_warns_and_uses_the_conservative_default(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="alpa_mini.cluster.spec"):
        spec = ClusterSpec.detect(fake_devices("NVIDIA GeForce RTX 4090", 1, 2, limit=2**34))
    assert "unknown device kind 'NVIDIA GeForce RTX 4090'" in caplog.text
    ref = ClusterSpec.named("p3.16xlarge")
    assert spec.name == "detected-unknown-1x2"
    assert spec.device.peak_flops == ref.device.peak_flops and spec.device.memory_bytes == 2**34
    assert (spec.intra_host, spec.inter_host) == (ref.intra_host, ref.inter_host)


def test_detect_multi_process_cpu_uses_the_loopback_link() -> None:
    spec = ClusterSpec.detect(fake_devices("cpu", 2, 4, platform="cpu", limit=2**40))
    assert spec.inter_host == ClusterSpec.named("cpu-2x4").inter_host
    assert spec.device == ClusterSpec.named("cpu-1x8").device  # CPU memory stays nominal


def test_detect_rejects_what_a_cluster_spec_cannot_describe() -> None:
    uneven = fake_devices("NVIDIA H100 80GB HBM3", 1, 4)
    uneven += [SimpleNamespace(**{**vars(uneven[0]), "process_index": 1})]
    with pytest.raises(ConfigError, match=r"uneven devices per process .*\{0: 4, 1: 1\}"):
        ClusterSpec.detect(uneven)
    mixed = fake_devices("NVIDIA H100 80GB HBM3", 1, 2) + fake_devices("Tesla V100", 1, 2)
    with pytest.raises(ConfigError, match="mixed device kinds"):
        ClusterSpec.detect(mixed)
    with pytest.raises(ConfigError, match="no devices"):
        ClusterSpec.detect([])
