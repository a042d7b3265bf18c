"""Shared test helpers: Hypothesis problem strategies, parallel-method cases, Ray heads, and
the child process that the benchmark-runner tests start."""
