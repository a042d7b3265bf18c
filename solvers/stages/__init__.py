"""The inter-operator stage DP (DESIGN 5.2): the cost-table problem (``problem``), its prepared
tables (``tables``), bounds and the relaxed DP (``bounds``), the memory-aware inner DP
(``dp``) and the search over the bottleneck stage time (``search``)."""

from .problem import Stage, StageProblem, StageSolution, stage_objective, submesh_shapes
from .search import solve_stages

__all__ = [
    "Stage",
    "StageProblem",
    "StageSolution",
    "solve_stages",
    "stage_objective",
    "submesh_shapes",
]
