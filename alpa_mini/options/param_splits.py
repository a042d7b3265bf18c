"""Hand-written parameter layouts (Megatron-LM's tensor parallelism, DeepSpeed's expert
parallelism) for ``ShardParallel(tensor_splits=...)``: which dimension of each parameter is
split over the logical mesh's last axis.

A stage's ILP sees its inputs only by shape and role (a pipeline stage's op graph names them
``in0, in1, ...``), so the table is keyed on shape. It is built from the parameters' identity
by whoever knows the model (``benchmarks.baselines`` reads the key paths of
``models/gpt.py``'s layout) and checked here once: two parameters of one shape with different
splits cannot be told apart at a stage, so such a table is refused, naming both. A parameter
stacked along a leading layer axis (a scanned model) may reach a stage as a piece of some of
its rows, so a stacked entry also matches its shape with 1 to all of those rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

__all__ = ["ParamSplit", "ParamSplits"]


@dataclass(frozen=True)
class ParamSplit:
    """One parameter: its shape, the dimension split over the mesh's last axis (None:
    replicated) and whether ``shape[0]`` is a stacked layer axis. ``name`` (its key path)
    is for messages only."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    stacked: bool = False

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
            raise ConfigError(f"ParamSplit.shape: {self.shape!r} of {self.name} is not a shape")
        object.__setattr__(self, "shape", shape)
        d = self.dim
        bad = isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < len(shape)
        if d is not None and bad:
            raise ConfigError(
                f"ParamSplit.dim: {self.dim!r} of {self.name} is invalid; expected None or a "
                f"dimension of its shape {shape} (0 to {len(shape) - 1})"
            )
        if self.stacked and (not shape or self.dim == 0):
            raise ConfigError(
                f"ParamSplit.stacked: {self.name} {shape} cannot be stacked with dim "
                f"{self.dim!r}; a stacked parameter needs a leading layer axis it does not split"
            )

    def matches(self, shape: tuple[int, ...]) -> bool:
        """Whether a stage input of ``shape`` is (a row piece of) this parameter."""
        if not self.stacked:
            return shape == self.shape
        return (
            len(shape) == len(self.shape)
            and shape[1:] == self.shape[1:]
            and 1 <= shape[0] <= self.shape[0]
        )

    def overlaps(self, other: ParamSplit) -> bool:
        """Whether some stage input shape matches both entries."""
        if self.stacked and other.stacked:
            return len(self.shape) == len(other.shape) and self.shape[1:] == other.shape[1:]
        if other.stacked:
            return other.matches(self.shape)
        return self.matches(other.shape)


@dataclass(frozen=True)
class ParamSplits:
    """A shape-keyed table of ``ParamSplit``s; parameters of one shape share a split."""

    entries: tuple[ParamSplit, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.entries, tuple | list) or not all(
            isinstance(e, ParamSplit) for e in self.entries
        ):
            raise ConfigError("ParamSplits.entries: expected a tuple of ParamSplit")
        kept: dict[tuple[tuple[int, ...], int | None, bool], ParamSplit] = {}
        for e in self.entries:  # one per (shape, dim, stacked): the first name tells it
            kept.setdefault((e.shape, e.dim, e.stacked), e)
        distinct = tuple(kept.values())
        for i, a in enumerate(distinct):
            for b in distinct[i + 1 :]:
                if a.dim != b.dim and a.overlaps(b):
                    raise ConfigError(
                        f"ParamSplits.entries: {a.name} {a.shape} (split dim {a.dim}) and "
                        f"{b.name} {b.shape} (split dim {b.dim}) can have the same shape at "
                        "a stage, which sees only shapes; give them one split"
                    )
        object.__setattr__(self, "entries", distinct)

    def find(self, shape: tuple[int, ...]) -> ParamSplit | None:
        """The entry a parameter of ``shape`` is (a row piece of), or None."""
        shape = tuple(shape)
        return next((e for e in self.entries if e.matches(shape)), None)

    def dim(self, shape: tuple[int, ...]) -> int | None:
        """The dimension split for a parameter of ``shape`` (None: replicated); a shape the
        table does not know is a ``ConfigError`` listing the shapes it does."""
        entry = self.find(shape)
        if entry is None:
            known = ", ".join(f"{e.shape}" for e in self.entries[:12])
            raise ConfigError(
                f"tensor_splits: no parameter of shape {tuple(shape)} in the table (its "
                f"shapes: {known}{' ...' if len(self.entries) > 12 else ''})"
            )
        return entry.dim

    def indivisible(self, ways: int) -> list[str]:
        """Entries whose split dimension ``ways`` devices cannot split evenly, described."""
        return [
            f"{e.name} {e.shape} dim {e.dim}"
            for e in self.entries
            if e.dim is not None and e.shape[e.dim] % ways
        ]
