"""Execution of pipeshard programs (local and Ray). Never imports the planner."""
