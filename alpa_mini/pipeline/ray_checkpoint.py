"""Checkpoints of values that live on Ray host workers: every worker writes the values it
holds into the step's directory and reads back the ones its stages need, so parameters
never travel through the driver (``alpa_mini.session.checkpoint`` drives both)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.checkpoint_io import Part, read_region
from .ray_driver import RemoteArray, RemoteSlot, StackedRemoteArray, await_workers

__all__ = ["finish_remote", "restore_remote", "save_remote"]


def save_remote(
    directory: Path, leaves: Sequence[tuple[int, RemoteArray]]
) -> tuple[dict[int, list[Part]], Any]:
    """Have each worker write its share of ``leaves`` (``(leaf, handle)``) under
    ``directory/host_<h>``; returns once they are copied off the devices, with each leaf's
    parts and the session whose workers still write (``finish_remote``)."""
    session = leaves[0][1].session
    items: dict[int, list[tuple[str, str, tuple[int, ...]]]] = {}
    for leaf, x in leaves:
        if x.session is not session or not session.workers:
            raise RuntimeError(
                f"target: leaf {leaf} lives on Ray workers of a session that has ended "
                "(alpa_mini.shutdown() removed them); save before shutting down"
            )
        pieces = x.parts if isinstance(x, StackedRemoteArray) else (x,)
        starts = x.starts if isinstance(x, StackedRemoteArray) else (0,)
        for j, (piece, row) in enumerate(zip(pieces, starts, strict=False)):
            offset = (row,) if piece.shape else ()
            writers = piece.keys if piece.devices else piece.keys[:1]  # copies: one writes
            for host, rkey in writers:
                items.setdefault(host, []).append((f"{leaf}.{j}", rkey, offset))
    refs = {
        h: session.workers[h].save_parts.remote(str(directory / f"host_{h}"), mine)
        for h, mine in sorted(items.items())
    }
    written = await_workers(session, refs, "a checkpoint save")
    parts: dict[int, list[Part]] = {}
    for host_parts in written:
        for part in host_parts:
            parts.setdefault(int(part.name.split(".", 1)[0]), []).append(part)
    return parts, (session, sorted(items))


def finish_remote(pending: Any) -> None:
    """Block until the workers of ``save_remote`` have their parts on disk."""
    session, hosts = pending
    refs = {h: session.workers[h].finish_saves.remote() for h in hosts}
    await_workers(session, refs, "a checkpoint write")


def restore_remote(
    step_dir: Path, wanted: Sequence[tuple[RemoteSlot, Sequence[Part], str]]
) -> list[Any]:
    """Each ``(slot, parts, dtype)`` read on the workers that read that argument, in their
    layouts: a ``RemoteArray`` (a ``StackedRemoteArray`` of the step's row pieces)."""
    session = wanted[0][0].executable.session
    requests: dict[int, list[tuple[Any, ...]]] = {}
    plans = []  # per wanted leaf: (name, shape, hosts, devices, local value) per step input
    for slot, parts, dtype in wanted:
        ex = slot.executable
        pieces = []
        for name, a, b in ex.step_inputs(slot.leaf):
            region = None if a is None else [(a, b), *((0, n) for n in slot.shape[1:])]
            shape = slot.shape if a is None else (b - a, *slot.shape[1:])
            hosts = [h for h, need in enumerate(ex.needs) if name in need]
            local = None if hosts else read_region(step_dir, parts, slot.shape, dtype, None, region)
            key_of, devices = _where(ex, name)
            for h in hosts:
                key = ex.keys[h] if key_of else None
                requests.setdefault(h, []).append(
                    (key, name, (list(parts), slot.shape, dtype, region))
                )
            pieces.append((shape, hosts, devices, local))
        plans.append(pieces)
    refs = {
        h: session.workers[h].restore_parts.remote(str(step_dir), mine)
        for h, mine in sorted(requests.items())
    }
    got = dict(zip(refs, await_workers(session, refs, "a checkpoint restore"), strict=True))
    taken = {h: iter(values) for h, values in got.items()}
    out = []
    for (_, _, dtype), pieces in zip(wanted, plans, strict=True):
        handles = [
            local
            if not hosts
            else RemoteArray(
                session,
                tuple((h, next(taken[h])[0]) for h in hosts),
                shape,
                np.dtype(dtype),
                devices,
            )
            for shape, hosts, devices, local in pieces
        ]
        if len(handles) == 1:
            out.append(handles[0])
        elif all(isinstance(x, RemoteArray) for x in handles):
            out.append(StackedRemoteArray(handles))
        else:
            out.append(np.concatenate([np.asarray(x) for x in handles]))
    return out


def _where(ex: Any, name: str) -> tuple[bool, tuple[int, ...]]:
    """How a restored step input is kept: whether each worker lays it out as its first
    ``Put`` there does (else it stays on the host, for the ``Put``s to lay out), and the
    devices of the one mesh spanning hosts it is sharded over (none: held whole)."""
    per_host = ex.session.cluster.devices_per_host
    meshes = ex.arg_devices.get(name, set())
    spanning = [ds for ds in meshes if len({d // per_host for d in ds}) > 1]
    if not spanning:
        return True, ()
    if len(meshes) == 1:
        return True, spanning[0]
    return False, ()  # read by a spanning mesh and others: a host copy each
