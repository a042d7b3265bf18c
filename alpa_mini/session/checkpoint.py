"""Checkpoints of step inputs and outputs, on orbax-checkpoint.

``save_checkpoint`` writes a pytree in the background: each array's shards straight from the
devices that hold them (arrays spread over several stage meshes, or sharded along a stack's
layer axis, included), into a temporary directory that orbax renames when it is complete, so
a crash mid-save leaves the previous checkpoint readable; it keeps the last ``keep``.
``restore_checkpoint`` lays the values out for a target: arrays or ``jax.ShapeDtypeStruct``s
with shardings, for example ``step.input_layouts(*args)`` of a parallelized step, whose plan
may differ from the one that saved (another mesh shape, other stages).
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from .._validate import check_int, positive_int
from ..errors import ConfigError

__all__ = ["restore_checkpoint", "save_checkpoint", "wait_for_checkpoints"]

_MANAGERS: dict[tuple[str, int | None], Any] = {}


def save_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    target: Any,
    step: int,
    *,
    keep: int | None = 3,
    wait: bool = False,
) -> None:
    """Save the pytree ``target`` as checkpoint ``step`` of ``ckpt_dir`` (created if
    needed), in the background (``wait=True`` or ``wait_for_checkpoints()`` blocks until it
    is on disk); keep the newest ``keep`` checkpoints (None: all). Steps must increase."""
    import orbax.checkpoint as ocp

    step = check_int("step", step, low=0)
    if keep is not None:
        positive_int("keep", keep)
    path = _directory(ckpt_dir, create=True)
    manager = _manager(path, keep)
    manager.wait_until_finished()  # one save in flight per directory, so steps stay ordered
    latest = manager.latest_step()
    if latest is not None and step <= latest:
        raise ConfigError(
            f"step: {step} is invalid; {path} already holds step {latest}, and steps must "
            f"increase (restore it, or save as step {latest + 1} or later)"
        )
    tree = jax.tree.map(_savable, target)
    if not jax.tree.leaves(tree):
        raise ConfigError("target: holds no arrays to save")
    manager.save(step, args=ocp.args.StandardSave(tree))
    if wait:
        manager.wait_until_finished()


def wait_for_checkpoints() -> None:
    """Block until every save started in this process is on disk."""
    for manager in list(_MANAGERS.values()):
        manager.wait_until_finished()


def restore_checkpoint(
    ckpt_dir: str | os.PathLike[str], step: int | None = None, target: Any = None
) -> Any:
    """Checkpoint ``step`` of ``ckpt_dir`` (None: the latest) laid out like ``target``: a
    pytree of the saved structure whose leaves are arrays or ``jax.ShapeDtypeStruct``s (their
    shardings are used; none: the default device). ``target=None`` returns the saved tree
    on the default device."""
    import orbax.checkpoint as ocp

    path = _directory(ckpt_dir, create=False)
    wait_for_checkpoints()
    manager = _manager(path, None)
    manager.reload()
    steps = sorted(manager.all_steps())
    if not steps:
        raise ConfigError(f"ckpt_dir: {path} holds no complete checkpoint")
    if step is None:
        step = steps[-1]
    elif check_int("step", step, low=0) not in steps:
        raise ConfigError(f"step: {step} is not saved in {path}; saved steps: {steps}")
    saved = manager.item_metadata(step)
    abstract = _abstract_target(saved, target, step)
    return manager.restore(step, args=ocp.args.StandardRestore(abstract))


def _directory(ckpt_dir: Any, *, create: bool) -> Path:
    if not isinstance(ckpt_dir, str | os.PathLike):
        raise ConfigError(f"ckpt_dir: {ckpt_dir!r} is invalid; expected a directory path")
    path = Path(ckpt_dir).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"ckpt_dir: {path} is a file, not a directory")
    if not create and not path.exists():
        raise ConfigError(f"ckpt_dir: {path} does not exist")
    return path


def _manager(path: Path, keep: int | None) -> Any:
    """One orbax manager per (directory, keep), reused so that its saves stay ordered."""
    import orbax.checkpoint as ocp

    key = (str(path), keep)
    if key not in _MANAGERS:
        for (other, _), manager in list(_MANAGERS.items()):
            if other == str(path):
                manager.wait_until_finished()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True, create=True
        )
        _MANAGERS[key] = ocp.CheckpointManager(
            path, options=options, item_handlers=ocp.StandardCheckpointHandler()
        )
    return _MANAGERS[key]


def _savable(x: Any) -> Any:
    """A leaf orbax can write: device arrays as they are (each shard from its device);
    host values and Ray handles as numpy arrays."""
    if isinstance(x, jax.Array):
        return x
    return np.asarray(x)


def _abstract_target(saved: Any, target: Any, step: int) -> Any:
    """The restore target as ``jax.ShapeDtypeStruct``s, checked leaf by leaf against what
    step ``step`` saved."""
    saved_leaves = jax.tree.leaves(saved, is_leaf=_is_array_metadata)
    if target is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=device),
            saved,
            is_leaf=_is_array_metadata,
        )
    paths = jax.tree_util.tree_flatten_with_path(target)[0]
    if len(paths) != len(saved_leaves):
        raise ConfigError(
            f"target: has {len(paths)} leaves; checkpoint step {step} holds {len(saved_leaves)} "
            "(pass a pytree of the saved structure)"
        )
    abstract = []
    for p, leaf in paths:
        name = f"target{jax.tree_util.keystr(p)}"
        meta = _saved_at(saved, p, name, step)
        shape = tuple(np.shape(leaf)) if not hasattr(leaf, "shape") else tuple(leaf.shape)
        if shape != tuple(meta.shape):
            raise ConfigError(
                f"{name}: shape {shape}, but checkpoint step {step} saved {tuple(meta.shape)}"
            )
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        dtype = getattr(leaf, "dtype", None) or np.result_type(leaf)
        abstract.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
    return jax.tree.unflatten(jax.tree.structure(target), abstract)


def _saved_at(saved: Any, path: Any, name: str, step: int) -> Any:
    """The saved metadata at a target leaf's key path (orbax keeps containers as dicts and
    lists, so attribute, dict and sequence keys all index them)."""
    node = getattr(saved, "tree", saved)  # orbax wraps the saved tree in a metadata node
    for key in path:
        k = getattr(key, "key", getattr(key, "name", getattr(key, "idx", None)))
        try:
            if isinstance(node, dict):
                node = node[k] if k in node else node[str(k)]
            else:
                node = node[int(k)]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ConfigError(
                f"{name}: not in checkpoint step {step} (its tree has other keys here)"
            ) from None
    if not _is_array_metadata(node):
        raise ConfigError(f"{name}: checkpoint step {step} holds a subtree here, not an array")
    return node


def _is_array_metadata(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, dict | list)


@atexit.register
def _finish_saves() -> None:
    """Saves in flight complete before the interpreter exits (they run in threads)."""
    for manager in list(_MANAGERS.values()):
        try:
            manager.wait_until_finished()
            manager.close()
        except Exception:  # at exit there is no caller left to report to
            pass
    _MANAGERS.clear()
