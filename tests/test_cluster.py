"""Cluster YAMLs load and validate; logical-mesh axes get the link each one crosses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from alpa_mini.cluster import ClusterSpec, ConfigError, LogicalMesh

CLUSTERS = Path(__file__).resolve().parents[1] / "configs" / "clusters"


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
