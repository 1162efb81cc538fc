"""orch: launch distributed deep-learning training across many machines over SSH.

As a library (docs/api.md), from the top of the package:

    import orchestrator as orch
    cluster = orch.load("cluster.yaml"); orch.check(cluster); orch.plan(cluster)
    result = orch.up(cluster); orch.status(result.run.id); orch.logs(result.run.id, rank=3)
    orch.down(result.run.id)

and the types they return or raise (`UpResult`, `RunView`, `Report`, `RankPlan`, `Cluster`,
`LogStream`, `Events`; `OrchError` and its kinds). No module of the package has one of these
names. They are imported on first use, so `orch status` pays for nothing it does not use."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it (imported when the name is first used)
_EXPORTS = {
    **dict.fromkeys(("load", "check", "plan", "up", "status", "down", "logs", "progress",
                     "Events", "UpResult", "LogStream"), "api"),
    "RunView": "runstate", "Report": "checks", "RankPlan": "rankplan", "Cluster": "model",
    **dict.fromkeys(("OrchError", "UsageError", "SpecError", "PlanError", "HostError", "ConnectError", "AuthError",
                     "HostKeyError", "RemoteTimeout", "PreflightFailed", "LogsIncomplete", "Interrupted"), "errors"),
}
__all__ = ["__version__", "api", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name == "api":
        return importlib.import_module(".api", __name__)
    if name in _EXPORTS:
        return getattr(importlib.import_module("." + _EXPORTS[name], __name__), name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
