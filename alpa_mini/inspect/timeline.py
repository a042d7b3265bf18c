"""Pipeline timelines: simulated tasks as trace events, bubble fractions, Gantt charts.

``simulated_events`` turns a ``Simulation`` into the same ``TraceEvent``s that
``runtime.trace.measured_events`` makes of a measured step: one track per mesh (the stage
index), forward and backward tasks named "F<micro-batch>" / "B<micro-batch>", the optimiser
"update". ``write_timeline`` writes both a Chrome trace (Perfetto) and a PNG Gantt chart.
matplotlib is imported only when a chart is drawn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime.chrome_trace import TraceEvent, write_chrome_trace

if TYPE_CHECKING:
    from ..pipeline.plan import PipeshardPlan
    from ..pipeline.simulate import Simulation
    from ..runtime.local import InstructionTiming

__all__ = [
    "bubble_fraction",
    "mesh_track_names",
    "plot_timeline",
    "simulated_events",
    "write_measured_trace",
    "write_timeline",
]

CATEGORY_COLORS = {
    "fwd": "#4c72b0",
    "bwd": "#dd8452",
    "update": "#55a868",
    "transfer": "#c44e52",
    "accumulate": "#8172b3",
    "input": "#937860",
    "free": "#bbbbbb",
}
_OTHER_COLOR = "#8c8c8c"


def simulated_events(sim: Simulation) -> list[TraceEvent]:
    """One event per simulated task, on its stage's track: "F3"/"B3" (category fwd/bwd,
    args micro_batch) or "update"."""
    events = []
    for s in sim.spans:
        if s.kind == "update":
            name, args = "update", {"stage": s.stage}
        else:
            name = f"{'F' if s.kind == 'fwd' else 'B'}{s.micro_batch}"
            args = {"stage": s.stage, "micro_batch": s.micro_batch}
        events.append(TraceEvent(s.stage, name, s.start, s.end, s.kind, args))
    return events


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (overlaps on one track count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def bubble_fraction(events: Sequence[TraceEvent], num_tracks: int) -> float:
    """1 - busy / (num_tracks x makespan): the share of the tracks' time spent idle between
    the first event's start and the last one's end. A track is busy while any of its events
    runs; tracks without events are idle throughout."""
    if isinstance(num_tracks, bool) or not isinstance(num_tracks, int) or num_tracks < 1:
        raise ValueError(f"num_tracks: {num_tracks!r} is invalid; expected an integer >= 1")
    if not events:
        return 0.0
    makespan = max(e.end for e in events) - min(e.start for e in events)
    if makespan <= 0:
        return 0.0
    per_track: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        per_track.setdefault(e.track, []).append((e.start, e.end))
    if len(per_track) > num_tracks:
        raise ValueError(
            f"num_tracks: {num_tracks} is fewer than the {len(per_track)} tracks with events"
        )
    busy = sum(_busy(iv) for iv in per_track.values())
    return 1.0 - busy / (num_tracks * makespan)


def mesh_track_names(plan: PipeshardPlan) -> dict[int, str]:
    """Track names of a plan's meshes, e.g. "mesh 0 (stage 0, devices 0-3)"."""
    names = {}
    for k, st in enumerate(plan.stages):
        devs = sorted(st.devices)
        if len(devs) == 1:
            where = f"device {devs[0]}"
        elif devs == list(range(devs[0], devs[-1] + 1)):
            where = f"devices {devs[0]}-{devs[-1]}"
        else:
            where = "devices " + ",".join(map(str, devs))
        names[k] = f"mesh {k} (stage {k}, {where})"
    return names


def plot_timeline(
    events: Sequence[TraceEvent],
    path: str | Path | None = None,
    *,
    ax: Any = None,
    title: str = "",
    track_names: Mapping[int, str] | None = None,
) -> Any:
    """Draw the events as a Gantt chart (one row per track, mesh 0 on top, colours by
    category, the micro-batch number inside bars wide enough for it, the bubble fraction in
    the title); save a PNG to ``path`` when given. Returns the matplotlib Axes."""
    if ax is None:
        if path is not None:
            # A bare Agg figure: no pyplot state, no display needed.
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure

            rows = len(set(track_names or ()) | {e.track for e in events}) or 1
            fig = Figure(figsize=(12, 1.2 + 0.55 * rows), dpi=100)
            FigureCanvasAgg(fig)
            ax = fig.add_subplot()
        else:
            import matplotlib.pyplot as plt

            _, ax = plt.subplots(figsize=(12, 3))
    from matplotlib.patches import Patch

    names = dict(track_names or {})
    tracks = sorted(set(names) | {e.track for e in events})
    row = {t: i for i, t in enumerate(tracks)}
    t0 = min((e.start for e in events), default=0.0)
    span = max((e.end for e in events), default=0.0) - t0
    # Milliseconds read best for both simulated plans and measured CPU steps.
    scale = 1e3
    by_category: dict[str, list[TraceEvent]] = {}
    for e in events:
        by_category.setdefault(e.category, []).append(e)
    for category, evs in by_category.items():
        ax.barh(
            [row[e.track] for e in evs],
            [(e.end - e.start) * scale for e in evs],
            left=[(e.start - t0) * scale for e in evs],
            height=0.8,
            color=CATEGORY_COLORS.get(category, _OTHER_COLOR),
            edgecolor="white",
            linewidth=0.3,
        )
    if span > 0:
        ax.set_xlim(0, span * scale)
    ax.set_yticks(range(len(tracks)))
    ax.set_yticklabels([names.get(t, f"track {t}") for t in tracks])
    ax.set_ylim(len(tracks) - 0.5, -0.5)  # mesh 0 on top
    ax.set_xlabel("time (ms)")
    bubble = bubble_fraction(events, max(len(tracks), 1))
    ax.set_title(f"{title} (bubble {bubble:.1%})" if title else f"bubble {bubble:.1%}")
    present = [c for c in CATEGORY_COLORS if c in by_category]
    present += sorted(c for c in by_category if c not in CATEGORY_COLORS)
    ax.legend(
        handles=[
            Patch(color=CATEGORY_COLORS.get(c, _OTHER_COLOR), label=c or "?") for c in present
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    if path is not None:
        ax.figure.tight_layout()
    if span > 0:  # after the layout, which sets the bars' width in pixels
        px_per_second = ax.bbox.width / span
        char_px = 0.6 * 7 * ax.figure.dpi / 72  # ~width of one 7-point digit
        for e in events:
            m = e.args.get("micro_batch")
            if m is None or m < 0:
                continue
            label = str(m)
            if (e.end - e.start) * px_per_second >= len(label) * char_px + 4:
                ax.text(
                    (e.start - t0 + (e.end - e.start) / 2) * scale,
                    row[e.track],
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        ax.figure.savefig(path, format="png")
    return ax


def write_timeline(
    path: str | Path,
    events: Sequence[TraceEvent],
    track_names: Mapping[int, str],
    *,
    title: str = "",
    process_name: str = "alpa_mini",
    png: bool = True,
) -> tuple[Path, Path | None]:
    """Write the Chrome trace to ``path`` and, with ``png``, its Gantt chart beside it (same
    stem, .png); return both paths (None for a PNG not drawn)."""
    path = Path(path)
    image = path.with_suffix(".png")
    if png and image == path:
        raise ValueError(f"path: {path} is where the PNG goes; name the trace file .json")
    write_chrome_trace(path, events, track_names, process_name=process_name)
    if not png:
        return path, None
    plot_timeline(events, image, title=title, track_names=track_names)
    return path, image


def write_measured_trace(
    path: str | Path,
    timings: Sequence[InstructionTiming],
    plan: PipeshardPlan,
    fun_name: str,
    *,
    how: str,
    png: bool = True,
) -> tuple[Path, Path | None]:
    """A runtime's measured instruction intervals as a Chrome trace (and PNG), one track per
    mesh named like ``PipeshardPlan.timeline``'s; ``how`` says how they were measured (it
    ends the chart's title)."""
    from ..runtime.chrome_trace import measured_events

    events = measured_events(timings)
    step = max(t.end for t in timings) - min(t.start for t in timings) if timings else 0.0
    title = (
        f"measured {fun_name}: {plan.schedule}, {plan.num_stages} stages, "
        f"B={plan.num_micro_batches}, {step * 1e3:.3f} ms ({how})"
    )
    return write_timeline(
        path,
        events,
        mesh_track_names(plan),
        title=title,
        process_name=f"alpa_mini measured ({fun_name})",
        png=png,
    )
