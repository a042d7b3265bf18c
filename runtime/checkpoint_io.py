"""Reading and writing the array parts of a checkpoint step, on the driver and on the Ray
host workers alike (``alpa_mini.session.checkpoint`` owns the manifest and the commit).

Each writer (the driver; each host worker) writes its parts as one orbax PyTree checkpoint,
a flat ``{name: array}`` dict under ``<step dir>/<writer>``: a device array with every shard
written from the device holding it, so values never gather anywhere to be saved. A ``Part``
names where one region of a saved array lives. Reading lays a region out for a sharding: a
whole part straight through orbax (only the shards the sharding needs are read), anything
else assembled from the parts it overlaps.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .pieces import Pieces, own_pieces, place

__all__ = ["Part", "PartWriter", "Read", "parts_of", "read_region", "read_values", "writer_name"]

NPY = "-npy"  # the suffix of a writer directory of .npy files


@dataclass(frozen=True)
class Part:
    """The region ``[start, stop)`` of a saved array, stored as ``name`` by ``writer``."""

    writer: str
    name: str
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))


def writer_name(base: str) -> str:
    """The directory a writer of this process writes into: ``base``, or ``base-npy`` in a
    ``jax.distributed`` group, where orbax writes host-local values only from process 0
    (its numpy handler) or not at all (its array handler), so each part is a ``.npy``."""
    return base + NPY if _in_group() else base


def parts_of(
    writer: str, name: str, value: Any, offset: Sequence[int] = ()
) -> tuple[dict[str, Any], list[Part]]:
    """What ``writer`` saves of ``value``: the arrays to write and the parts they are.
    A value this process holds whole is one part (written shard by shard from its devices);
    one sharded over several processes' devices is the distinct shards this process holds
    first. ``offset`` shifts the regions (a row piece of a larger saved array)."""
    import numpy as np

    shape = tuple(value.shape)
    shift = tuple(offset) + (0,) * (len(shape) - len(offset))
    if getattr(value, "is_fully_addressable", True):
        stop = tuple(a + n for a, n in zip(shift, shape, strict=True))
        if writer.endswith(NPY):  # a host copy now: the step after may reuse the buffer
            value = np.array(value, copy=True)
        return {name: value}, [Part(writer, name, shift, stop)]
    tree, parts = {}, []
    for j, (index, data) in enumerate(own_pieces(value).parts):
        piece = f"{name}.{j}"
        bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
        tree[piece] = data
        parts.append(
            Part(
                writer,
                piece,
                tuple(a + lo for a, (lo, _) in zip(shift, bounds, strict=True)),
                tuple(a + hi for a, (_, hi) in zip(shift, bounds, strict=True)),
            )
        )
    return tree, parts


class PartWriter:
    """One process's writer: ``write`` returns once the arrays are copied off their
    devices and writes in the background (orbax; ``.npy`` files into a ``-npy`` directory);
    ``wait`` blocks until that is on disk and raises what the write failed with."""

    def __init__(self) -> None:
        self._checkpointer: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def write(self, directory: str | Path, tree: dict[str, Any]) -> None:
        import orbax.checkpoint as ocp

        self.wait()  # one write in flight at a time
        directory = Path(directory)
        if directory.name.endswith(NPY):
            self._thread = threading.Thread(target=self._write_npy, args=(directory, tree))
            self._thread.start()
            return
        if self._checkpointer is None:
            self._checkpointer = ocp.AsyncCheckpointer(
                ocp.PyTreeCheckpointHandler(multiprocessing_options=_alone()),
                multiprocessing_options=_alone(),
            )
        self._checkpointer.save(directory, args=ocp.args.PyTreeSave(tree))

    def _write_npy(self, directory: Path, tree: dict[str, Any]) -> None:
        import numpy as np

        try:
            directory.mkdir(parents=True, exist_ok=True)
            for name, value in tree.items():
                with open(directory / f"{name}.npy", "wb") as f:
                    np.save(f, value)
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException as err:  # raised by wait()
            self._error = err

    def wait(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.wait_until_finished()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self.wait()
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None


@dataclass(frozen=True)
class Read:
    """One value to read: ``region`` (``(start, stop)`` per axis; None: all of ``shape``)
    of a saved array made of ``parts``, laid out as ``sharding`` (None: a numpy array)."""

    parts: tuple[Part, ...]
    shape: tuple[int, ...]
    dtype: Any
    sharding: Any = None
    region: tuple[tuple[int, int], ...] | None = None

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [(0, n) for n in self.shape] if self.region is None else list(self.region)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of the value read (the region's)."""
        return tuple(b - a for a, b in self.bounds)

    def whole_part(self) -> Part | None:
        """The orbax part that is exactly this region, read straight into a sharding of
        this process's devices; None where the region must be assembled."""
        if self.sharding is None or not self.sharding.is_fully_addressable:
            return None
        for p in self.parts:
            if list(zip(p.start, p.stop, strict=True)) == self.bounds:
                return None if p.writer.endswith(NPY) else p
        return None


def read_values(step_dir: str | Path, reads: Sequence[Read]) -> list[Any]:
    """Every read's value: whole parts in one orbax restore per writer (each reads only
    the shards its sharding needs), the rest assembled from the parts they overlap."""
    out: list[Any] = [None] * len(reads)
    direct: dict[str, list[tuple[int, Part]]] = {}
    for i, r in enumerate(reads):
        part = r.whole_part()
        if part is None:
            out[i] = _assemble(step_dir, r)
        else:
            direct.setdefault(part.writer, []).append((i, part))
    for writer, wanted in direct.items():
        got = _restore(step_dir, writer, [(p, reads[i]) for i, p in wanted])
        for (i, _), value in zip(wanted, got, strict=True):
            out[i] = value
    return out


def read_region(
    step_dir: str | Path,
    parts: Sequence[Part],
    shape: Sequence[int],
    dtype: Any,
    sharding: Any = None,
    region: Sequence[tuple[int, int]] | None = None,
) -> Any:
    """One value (see ``Read``)."""
    bounds = None if region is None else tuple(tuple(r) for r in region)
    return read_values(step_dir, [Read(tuple(parts), tuple(shape), dtype, sharding, bounds)])[0]


def _assemble(step_dir: str | Path, r: Read) -> Any:
    import numpy as np

    region, want = r.bounds, r.out_shape
    needed = [p for p in r.parts if _overlaps(p, region)]
    data = _read_numpy(step_dir, needed, r.dtype)
    pieces = Pieces(
        want,
        np.dtype(r.dtype),
        tuple(_cropped(p, d, region) for p, d in zip(needed, data, strict=True)),
    )
    if r.sharding is None:
        return pieces.region(tuple(slice(0, n) for n in want))
    return place(pieces, r.sharding)


def _cropped(part: Part, data: Any, region: Sequence[tuple[int, int]]) -> tuple[Any, Any]:
    """The overlap of ``part`` with ``region``: its index relative to the region, its data."""
    cut = [
        (max(a, lo), min(b, hi))
        for a, b, (lo, hi) in zip(part.start, part.stop, region, strict=True)
    ]
    src = tuple(slice(x - a, y - a) for (x, y), a in zip(cut, part.start, strict=True))
    dst = tuple(slice(x - lo, y - lo) for (x, y), (lo, _) in zip(cut, region, strict=True))
    return dst, data[src]


def _overlaps(part: Part, region: Sequence[tuple[int, int]]) -> bool:
    return all(
        max(a, lo) < min(b, hi) or lo == hi
        for a, b, (lo, hi) in zip(part.start, part.stop, region, strict=True)
    )


def _restore(step_dir: str | Path, writer: str, wanted: list[tuple[Part, Read]]) -> list[Any]:
    """Whole parts of one writer read by orbax straight into their shardings."""
    import jax
    import orbax.checkpoint as ocp

    item = {p.name: jax.ShapeDtypeStruct(r.shape, r.dtype, sharding=r.sharding) for p, r in wanted}
    restore = {
        p.name: ocp.ArrayRestoreArgs(sharding=r.sharding, global_shape=r.out_shape, dtype=r.dtype)
        for p, r in wanted
    }
    got = _checkpointer().restore(
        Path(step_dir) / writer,
        args=ocp.args.PyTreeRestore(item=item, restore_args=restore, partial_restore=True),
    )
    return [got[p.name] for p, _ in wanted]


def _read_numpy(step_dir: str | Path, parts: Iterable[Part], dtype: Any) -> list[Any]:
    """The parts' arrays on the host, one orbax read per writer."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    parts = list(parts)
    by_writer: dict[str, list[Part]] = {}
    for p in parts:
        by_writer.setdefault(p.writer, []).append(p)
    found: dict[tuple[str, str], Any] = {}
    for writer, mine in by_writer.items():
        if writer.endswith(NPY):
            for p in mine:
                found[(writer, p.name)] = _load_npy(Path(step_dir) / writer / f"{p.name}.npy", p)
            continue
        want = {p.name: jax.ShapeDtypeStruct(p.shape, dtype) for p in mine}
        restore = {p.name: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype) for p in mine}
        got = _checkpointer().restore(
            Path(step_dir) / writer,
            args=ocp.args.PyTreeRestore(item=want, restore_args=restore, partial_restore=True),
        )
        found.update({(writer, name): np.asarray(v) for name, v in got.items()})
    return [found[(p.writer, p.name)] for p in parts]


def _load_npy(file: Path, part: Part) -> Any:
    import numpy as np

    value = np.load(file, allow_pickle=False)
    if tuple(value.shape) != part.shape:
        raise ValueError(f"{file}: shape {value.shape}, but the manifest says {part.shape}")
    return value


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(multiprocessing_options=_alone()),
        multiprocessing_options=_alone(),
    )


def _in_group() -> bool:
    """Whether this process is one of a ``jax.distributed`` group."""
    import jax

    return jax.process_count() > 1


def _alone() -> Any:
    """Orbax options for a process that reads and writes on its own, also inside a
    ``jax.distributed`` group (no barriers with processes that are not saving)."""
    import jax
    import orbax.checkpoint as ocp

    me = jax.process_index()
    return ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
