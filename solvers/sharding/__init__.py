"""The intra-operator sharding ILP: the problem (IOPDDL format), simplification, the MIP model
and its backends, region MIPs (LNS) and heuristics, and ``solve_sharding`` tying them up."""

from .problem import Evaluation, ShardingProblem, evaluate, load_iopddl, save_iopddl
from .solve import ShardingSolution, solve_sharding

__all__ = [
    "Evaluation",
    "ShardingProblem",
    "ShardingSolution",
    "evaluate",
    "load_iopddl",
    "save_iopddl",
    "solve_sharding",
]
