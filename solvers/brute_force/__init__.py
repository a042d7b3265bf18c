"""Exhaustive reference solvers, for tests only."""
