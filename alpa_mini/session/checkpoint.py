"""Checkpoints of step inputs and outputs, on orbax-checkpoint.

A checkpoint step is the directory ``<ckpt_dir>/<step>``: ``manifest.json`` (the saved
pytree's key paths, shapes, dtypes, and where each array's parts are; a PRNG key is saved as
its data, with its implementation under ``prng``) and one orbax PyTree
checkpoint per writer. The driver writes the arrays it holds (``driver/``), each shard from
its device (arrays spread over several stage meshes included); every Ray host worker writes
the values it holds (``host_<h>/``), so nothing gathers on the driver. All of it is written
under a temporary name and renamed when complete: a crash mid-save leaves the previous steps
readable. ``restore_checkpoint`` lays each array out for a target: arrays or
``jax.ShapeDtypeStruct``s with shardings, or ``step.input_layouts(*args)`` of a parallelized
step (on Ray: read by the workers that use it, in their layouts), whatever plan, mesh shape
or number of hosts saved it. On a multi-node cluster ``ckpt_dir`` must be a directory every
node sees at the same path.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._validate import check_int, positive_int
from ..errors import ConfigError
from ..graph.tracing import is_prng_key
from ..runtime.checkpoint_io import Part, PartWriter, Read, parts_of, read_values

__all__ = ["restore_checkpoint", "save_checkpoint", "wait_for_checkpoints"]

MANIFEST = "manifest.json"
FORMAT = "alpa_mini.checkpoint"
VERSION = 1

#: The driver's writer (one write in flight at a time) and each directory's commit thread.
_WRITER = PartWriter()
_PENDING: dict[str, _Commit] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class SavedLeaf:
    """One array of a saved pytree: its key path (``(kind, key)`` pairs, kind ``"key"``,
    ``"index"`` or ``"attr"``), shape, dtype, and the parts that hold it."""

    path: tuple[tuple[str, Any], ...]
    shape: tuple[int, ...]
    dtype: str
    parts: tuple[Part, ...]
    #: For a PRNG key array: its implementation (``jax.random.key_impl``); the array saved
    #: is the key's data (``jax.random.key_data``), whose shape ends in the impl's own dims.
    prng: str | None = None


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int,
    *,
    keep: int | None = 3,
    wait: bool = False,
) -> None:
    """Save the pytree ``target`` as checkpoint ``step`` of ``ckpt_dir`` (created if
    needed), in the background once the arrays are copied off their devices
    (``wait=True`` or ``wait_for_checkpoints()`` blocks until it is on disk); keep the newest
    ``keep`` checkpoints (None: all). Steps must increase. One process saves into a
    directory at a time (a save clears what a crashed save left there)."""
    step = check_int("step", step, low=0)
    if keep is not None:
        positive_int("keep", keep)
    path = _directory(ckpt_dir, create=True)
    _finish(path)  # one save in flight per directory, so steps stay ordered
    latest = max(_steps(path), default=None)
    if latest is not None and step <= latest:
        raise ConfigError(
            f"step: {step} is invalid; {path} already holds step {latest}, and steps must "
            f"increase (restore it, or save as step {latest + 1} or later)"
        )
    flat = jax.tree_util.tree_flatten_with_path(target)[0]
    if not flat:
        raise ConfigError("target: holds no arrays to save")
    for stale in path.glob(".*.partial-*"):  # left by a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path / f".{step}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        leaves, remote = _write(tmp, flat)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit = _Commit(path, tmp, step, leaves, remote, keep)
    with _LOCK:
        _PENDING[str(path)] = commit
    commit.start()
    if wait:
        _finish(path)


def wait_for_checkpoints() -> None:
    """Block until every save started in this process is on disk; raises what a
    background save failed with."""
    for key in list(_PENDING):
        _finish(Path(key))


def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str], step: int | None = None, target: Any = None
) -> Any:
    """Checkpoint ``step`` of ``ckpt_dir`` (None: the latest) laid out like ``target``: a
    pytree of the saved structure whose leaves are arrays or ``jax.ShapeDtypeStruct``s (their
    shardings are used; none: the default device), or ``step.input_layouts(*args)`` of a
    parallelized step. ``target=None`` returns the saved tree on the default device."""
    path = _directory(ckpt_dir, create=False)
    _finish(path)
    steps = _steps(path)
    if not steps:
        raise ConfigError(f"ckpt_dir: {path} holds no complete checkpoint")
    if step is None:
        step = steps[-1]
    elif check_int("step", step, low=0) not in steps:
        raise ConfigError(f"step: {step} is not saved in {path}; saved steps: {steps}")
    step_dir = path / str(step)
    saved = _read_manifest(step_dir)
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        values = read_values(step_dir, [Read(s.parts, s.shape, s.dtype, device) for s in saved])
        values = [
            v if s.prng is None else _wrap_key(s, v) for s, v in zip(saved, values, strict=True)
        ]
        return _rebuild([s.path for s in saved], values)
    return _restore_into(step_dir, step, saved, target)


# ------------------------------------------------------------------------------ saving
def _write(tmp: Path, flat: list[tuple[Any, Any]]) -> tuple[list[SavedLeaf], Any]:
    """Start writing every leaf (driver arrays here, Ray values on their workers); returns
    the leaves' records and the workers still writing."""
    from ..pipeline.ray_driver import RemoteArray

    tree: dict[str, Any] = {}
    driver_parts: dict[int, list[Part]] = {}
    remote = []
    kinds: list[tuple[tuple[int, ...], str]] = []  # each leaf's shape and dtype name
    prngs: dict[int, str] = {}  # leaf -> PRNG impl, for key arrays (saved as their data)
    for i, (key_path, leaf) in enumerate(flat):
        if isinstance(leaf, RemoteArray):
            remote.append((i, leaf))
            kinds.append((leaf.shape, leaf.dtype.name))
            continue
        if is_prng_key(leaf):
            prngs[i] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
        value = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        kinds.append((tuple(int(n) for n in value.shape), np.dtype(value.dtype).name))
        if value.dtype.kind not in "biufc" and not jax.numpy.issubdtype(value.dtype, np.number):
            raise ConfigError(
                f"target{jax.tree_util.keystr(key_path)}: {type(leaf).__name__} of dtype "
                f"{value.dtype} is not an array of numbers; checkpoints hold arrays"
            )
        arrays, parts = parts_of("driver", str(i), value)
        tree.update(arrays)
        driver_parts[i] = parts
    pending = None
    remote_parts: dict[int, list[Part]] = {}
    if remote:
        from ..pipeline.ray_checkpoint import save_remote

        remote_parts, pending = save_remote(tmp, remote)
    if tree:
        _WRITER.write(tmp / "driver", tree)
    records = [
        SavedLeaf(
            _path_record(key_path),
            shape,
            dtype,
            tuple(driver_parts.get(i) or remote_parts.get(i, [])),
            prngs.get(i),
        )
        for i, ((key_path, _), (shape, dtype)) in enumerate(zip(flat, kinds, strict=True))
    ]
    return records, pending


class _Commit(threading.Thread):
    """Waits for every writer of a step, then writes its manifest and renames it into
    place (the commit), and removes steps past ``keep``."""

    def __init__(
        self,
        path: Path,
        tmp: Path,
        step: int,
        leaves: list[SavedLeaf],
        remote: Any,
        keep: int | None,
    ) -> None:
        super().__init__(name=f"alpa-mini-checkpoint-{step}", daemon=True)
        self.path, self.tmp, self.step = path, tmp, step
        self.leaves, self.remote, self.keep = leaves, remote, keep
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _WRITER.wait()
            if self.remote is not None:
                from ..pipeline.ray_checkpoint import finish_remote

                finish_remote(self.remote)
            manifest = self.tmp / MANIFEST
            with open(manifest, "w") as f:
                json.dump(_manifest(self.step, self.leaves), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(self.tmp, self.path / str(self.step))
            _sync_directory(self.path)
            if self.keep is not None:
                for old in _steps(self.path)[: -self.keep]:
                    shutil.rmtree(self.path / str(old), ignore_errors=True)
        except BaseException as err:  # reported by the next wait, save or restore
            self.error = err
            shutil.rmtree(self.tmp, ignore_errors=True)


def _finish(path: Path) -> None:
    """Wait for the save in flight to ``path`` (if any) and raise what it failed with."""
    with _LOCK:
        commit = _PENDING.pop(str(path), None)
    if commit is None:
        return
    commit.join()
    if commit.error is not None:
        raise RuntimeError(
            f"saving checkpoint step {commit.step} to {path} failed: {commit.error}"
        ) from commit.error


def _sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _path_record(key_path: Any) -> tuple[tuple[str, Any], ...]:
    out = []
    for k in key_path:
        if isinstance(k, jax.tree_util.SequenceKey):
            out.append(("index", int(k.idx)))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(("attr", k.name))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(("index", int(k.key)))
        else:
            key = getattr(k, "key", k)
            out.append(("key", key if isinstance(key, str | int) else str(key)))
    return tuple(out)


def _manifest(step: int, leaves: list[SavedLeaf]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "leaves": [
            {
                "path": [list(p) for p in s.path],
                "shape": list(s.shape),
                "dtype": s.dtype,
                **({} if s.prng is None else {"prng": s.prng}),
                "parts": [
                    {
                        "writer": p.writer,
                        "name": p.name,
                        "start": list(p.start),
                        "stop": list(p.stop),
                    }
                    for p in s.parts
                ],
            }
            for s in leaves
        ],
    }


# ----------------------------------------------------------------------------- restoring
def _directory(ckpt_dir: Any, *, create: bool) -> Path:
    if not isinstance(ckpt_dir, str | os.PathLike):
        raise ConfigError(f"ckpt_dir: {ckpt_dir!r} is invalid; expected a directory path")
    path = Path(ckpt_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"ckpt_dir: {path} is a file, not a directory")
    if not create and not path.exists():
        raise ConfigError(f"ckpt_dir: {path} does not exist")
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


def _steps(path: Path) -> list[int]:
    """The committed steps of ``path`` (directories named by their step that hold a
    manifest), ascending."""
    return sorted(
        int(d.name) for d in path.iterdir() if d.name.isdigit() and (d / MANIFEST).is_file()
    )


def _read_manifest(step_dir: Path) -> list[SavedLeaf]:
    """The manifest of ``step_dir``, checked field by field (a file we did not write, or
    one edited since, is refused naming what is wrong)."""
    file = step_dir / MANIFEST
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{file}: unreadable checkpoint manifest ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"{file}: format: not an alpa_mini checkpoint manifest")
    if data.get("version") != VERSION:
        raise ConfigError(
            f"{file}: version: {data.get('version')!r} is not supported; expected {VERSION}"
        )
    leaves = data.get("leaves")
    if not isinstance(leaves, list) or not leaves:
        raise ConfigError(f"{file}: leaves: expected a non-empty list, got {leaves!r:.80}")
    return [_saved_leaf(file, i, entry) for i, entry in enumerate(leaves)]


def _saved_leaf(file: Path, i: int, entry: Any) -> SavedLeaf:
    where = f"{file}: leaves[{i}]"

    def ints(value: Any, field: str, low: int = 0) -> tuple[int, ...]:
        ok = isinstance(value, list) and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= low for n in value
        )
        if not ok:
            raise ConfigError(
                f"{where}.{field}: {value!r:.80} is invalid; expected integers >= {low}"
            )
        return tuple(value)

    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: {entry!r:.80} is invalid; expected an object")
    path = entry.get("path")
    if not isinstance(path, list) or not all(
        isinstance(k, list) and len(k) == 2 and k[0] in ("key", "index", "attr") for k in path
    ):
        raise ConfigError(f"{where}.path: {path!r:.80} is invalid; expected [kind, key] pairs")
    shape = ints(entry.get("shape"), "shape")
    try:
        dtype = np.dtype(jax.numpy.dtype(entry.get("dtype"))).name
    except TypeError:
        raise ConfigError(f"{where}.dtype: {entry.get('dtype')!r} is not a dtype") from None
    parts = entry.get("parts")
    if not isinstance(parts, list) or not parts:
        raise ConfigError(f"{where}.parts: expected a non-empty list, got {parts!r:.80}")
    found = []
    covered = 0
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not all(
            isinstance(part.get(k), str) and part.get(k) for k in ("writer", "name")
        ):
            raise ConfigError(f"{where}.parts[{j}]: {part!r:.80} is invalid")
        if "/" in part["writer"] or part["writer"].startswith("."):
            raise ConfigError(f"{where}.parts[{j}].writer: {part['writer']!r} is not a writer")
        start, stop = (
            ints(part.get("start"), f"parts[{j}].start"),
            ints(part.get("stop"), f"parts[{j}].stop"),
        )
        if (
            len(start) != len(shape)
            or len(stop) != len(shape)
            or any(
                not a < b <= n and not (a == b == 0)
                for a, b, n in zip(start, stop, shape, strict=True)
            )
        ):
            raise ConfigError(
                f"{where}.parts[{j}]: region {list(start)}..{list(stop)} is not inside shape "
                f"{list(shape)}"
            )
        covered += math.prod(b - a for a, b in zip(start, stop, strict=True))
        found.append(Part(part["writer"], part["name"], start, stop))
    if covered != math.prod(shape):
        raise ConfigError(
            f"{where}.parts: cover {covered} values of an array of {math.prod(shape)}"
        )
    prng = entry.get("prng")
    if prng is not None and (not isinstance(prng, str) or not shape or dtype != "uint32"):
        raise ConfigError(
            f"{where}.prng: {prng!r:.80} is invalid; expected a PRNG implementation's name on "
            "a uint32 array of key data"
        )
    return SavedLeaf(tuple((k, v) for k, v in path), shape, dtype, tuple(found), prng)


def _rebuild(paths: list[tuple[tuple[str, Any], ...]], values: list[Any]) -> Any:
    """The saved tree from its key paths: dicts for keys and attributes, lists for
    sequences."""
    if len(paths) == 1 and not paths[0]:
        return values[0]
    root: dict[Any, Any] = {}
    kinds: dict[int, str] = {}  # id of a container -> the kind of its keys
    for path, value in zip(paths, values, strict=True):
        node = root
        for depth, (kind, key) in enumerate(path):
            kinds[id(node)] = kind
            if depth == len(path) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, {})

    def build(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        items = {k: build(v) for k, v in node.items()}
        if kinds.get(id(node)) == "index":
            return [items[k] for k in sorted(items)]
        return items

    return build(root)


def _restore_into(step_dir: Path, step: int, saved: list[SavedLeaf], target: Any) -> Any:
    """Each target leaf read from its saved leaf (matched by key path), laid out as the
    target says; leaves for Ray workers are read there."""
    from ..pipeline.ray_driver import RemoteSlot

    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    if len(flat) != len(saved):
        raise ConfigError(
            f"target: has {len(flat)} leaves; checkpoint step {step} holds {len(saved)} "
            "(pass a pytree of the saved structure)"
        )
    by_path = {tuple(str(k) for _, k in s.path): s for s in saved}
    values: list[Any] = [None] * len(flat)
    remote, local = [], []
    keys: dict[int, tuple[SavedLeaf, Any]] = {}  # PRNG key leaves: their record and sharding
    for i, (key_path, leaf) in enumerate(flat):
        name = f"target{jax.tree_util.keystr(key_path)}"
        record = by_path.get(tuple(str(k) for _, k in _path_record(key_path)))
        if record is None:
            raise ConfigError(f"{name}: not in checkpoint step {step} (its tree has other keys)")
        if is_prng_key(leaf) != (record.prng is not None):
            saved_as = "a PRNG key" if record.prng else f"a {record.dtype} array"
            raise ConfigError(f"{name}: {leaf.dtype}, but checkpoint step {step} saved {saved_as}")
        shape = tuple(getattr(leaf, "shape", np.shape(leaf)))
        if shape != record.shape[: len(shape) if record.prng else None]:
            raise ConfigError(
                f"{name}: shape {shape}, but checkpoint step {step} saved {record.shape}"
            )
        dtype = getattr(leaf, "dtype", None) or np.result_type(leaf)
        if isinstance(leaf, RemoteSlot):
            remote.append((i, (leaf, record.parts, np.dtype(dtype).name)))
            continue
        sharding = getattr(leaf, "sharding", None)
        if record.prng:  # its data read whole, then wrapped and put where the target is
            keys[i] = (record, sharding)
            sharding, dtype = None, record.dtype
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        local.append((i, Read(record.parts, record.shape, dtype, sharding)))
    for (i, _), value in zip(local, read_values(step_dir, [r for _, r in local]), strict=True):
        if i in keys:
            record, sharding = keys[i]
            value = _wrap_key(record, value, sharding)
        values[i] = value
    if remote:
        from ..pipeline.ray_checkpoint import restore_remote

        for (i, _), value in zip(
            remote, restore_remote(step_dir, [w for _, w in remote]), strict=True
        ):
            values[i] = value
    return jax.tree_util.tree_unflatten(treedef, values)


def _wrap_key(record: SavedLeaf, data: Any, sharding: Any = None) -> Any:
    """The PRNG key array whose data was saved as ``record``, on ``sharding`` if given."""
    try:
        key = jax.random.wrap_key_data(data, impl=record.prng)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"prng: {record.prng!r} cannot wrap the saved data ({err})") from None
    return key if sharding is None else jax.device_put(key, sharding)


@atexit.register
def _finish_saves() -> None:
    """Saves in flight complete before the interpreter exits (they run in threads)."""
    for key in list(_PENDING):
        with contextlib.suppress(Exception):  # at exit there is no caller left to report to
            _finish(Path(key))
    with contextlib.suppress(Exception):
        _WRITER.close()
