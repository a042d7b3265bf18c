"""Placement of the chosen stages on the cluster's devices, and the check that a set of
submeshes fits the hosts.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cluster.spec import ClusterSpec
from ..errors import ConfigError

__all__ = ["assign_devices"]


def assign_devices(
    submeshes: Sequence[tuple[int, int]], cluster: ClusterSpec
) -> list[tuple[int, ...]]:
    """Flat device indices of each stage's submesh: whole hosts for (h, M) submeshes, a
    contiguous run inside one host otherwise; larger submeshes are placed first."""
    per = cluster.devices_per_host
    free = [per] * cluster.num_hosts  # free devices at the end of each host
    out: list[tuple[int, ...] | None] = [None] * len(submeshes)
    for s in sorted(range(len(submeshes)), key=lambda s: -submeshes[s][0] * submeshes[s][1]):
        h, d = submeshes[s]
        if h > 1 or d == per:
            hosts = [i for i in range(cluster.num_hosts) if free[i] == per][:h]
            if len(hosts) < h or d != per:
                raise ConfigError(
                    f"stage {s}: submesh {submeshes[s]} does not fit the cluster's free hosts"
                )
            out[s] = tuple(i * per + k for i in hosts for k in range(per))
            for i in hosts:
                free[i] = 0
        else:
            host = next((i for i in range(cluster.num_hosts) if free[i] >= d), None)
            if host is None:
                raise ConfigError(f"stage {s}: submesh {submeshes[s]} does not fit any host")
            first = host * per + (per - free[host])
            out[s] = tuple(range(first, first + d))
            free[host] -= d
    return [o for o in out if o is not None]


def _check_devices(subs: Sequence[tuple[int, int]], cluster: ClusterSpec) -> None:
    used = sum(h * d for h, d in subs)
    if used > cluster.num_devices:
        raise ConfigError(
            f"stage_option: the stages need {used} devices but cluster {cluster.name} has "
            f"{cluster.num_devices}"
        )
