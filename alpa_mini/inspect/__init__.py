"""Looking inside plans and runs: alternatives and explanations of ILP choices, collectives
in compiled HLO, schedules and their simulation, timelines (simulated and measured) and
Chrome traces."""

from .._lazy import lazy_exports

_LAZY = {
    "Alternative": "..shard.plan",
    "Explanation": "..shard.explain",
    "CollectiveReport": "..shard.executable",
    "Schedule": "..pipeline.schedules",
    "make_schedule": "..pipeline.schedules",
    "Simulation": "..pipeline.simulate",
    "StageTiming": "..pipeline.simulate",
    "simulate": "..pipeline.simulate",
    "simulate_plan": "..pipeline.simulate",
    "TraceEvent": "..runtime.chrome_trace",
    "measured_events": "..runtime.chrome_trace",
    "write_chrome_trace": "..runtime.chrome_trace",
    "bubble_fraction": "timeline",
    "plot_timeline": "timeline",
    "simulated_events": "timeline",
    "write_timeline": "timeline",
    "parse_collectives": "hlo_collectives",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
