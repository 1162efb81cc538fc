"""orch: launch distributed deep-learning training across many machines over SSH.

As a library (docs/api.md): `orchestrator.api` has `load`, `check`, `plan`, `up`, `status`,
`down` and `logs`; the package itself exports those whose names are not also modules of it
(`load`, `check`, `up`, `status`, `down`, `Events`, `UpResult`: `orchestrator.plan` and
`orchestrator.logs` are modules). Imported on first use, so `orch status` pays for nothing."""

__version__ = "0.1.0"

_API = ("api", "load", "check", "up", "status", "down", "Events", "UpResult")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        import importlib

        api = importlib.import_module(".api", __name__)
        return api if name == "api" else getattr(api, name)
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
