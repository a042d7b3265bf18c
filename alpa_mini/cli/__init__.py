"""The ``alpa-mini`` command: plan, solve, demo, bench, notebooks. Nothing imports it."""

from .main import main

__all__ = ["main"]
