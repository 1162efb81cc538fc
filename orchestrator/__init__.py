"""orch: launch distributed deep-learning training across many machines over SSH."""

__version__ = "0.1.0"
