"""Lowering a ``PipeshardPlan``: per-stage forward/backward/apply programs and the
instruction stream that runs them in schedule order."""
