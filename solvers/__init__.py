"""Pure planning algorithms: sharding ILP, stage DP, layer clustering.

This package imports only numpy, pulp and highspy: never jax, ray or the rest of alpa_mini.
"""
