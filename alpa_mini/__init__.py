"""alpa_mini: two-level auto-parallel planning for JAX."""

__all__: list[str] = []
