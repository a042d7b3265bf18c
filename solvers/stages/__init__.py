"""The inter-operator stage DP: the cost-table problem, its bounds, the memory-aware DP and
the search over the bottleneck stage time."""

from .search import Stage, StageProblem, StageSolution, solve_stages, submesh_shapes

__all__ = ["Stage", "StageProblem", "StageSolution", "solve_stages", "submesh_shapes"]
