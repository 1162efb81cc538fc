"""The library's names at the top of the package: `import orchestrator as orch; orch.plan(...)`."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import orchestrator


def test_every_exported_name_resolves_and_no_module_shadows_one():
    modules = {m.name for m in pkgutil.iter_modules(orchestrator.__path__)}
    exported = set(orchestrator.__all__) - {"__version__", "api"}
    assert not modules & exported, f"modules named like an API name: {modules & exported}"
    for m in sorted(modules):   # every module imported: none becomes an attribute hiding a function
        if m not in ("cli_lab",):
            importlib.import_module(f"orchestrator.{m}")
    api = importlib.import_module("orchestrator.api")
    for name in ("load", "check", "plan", "up", "status", "down", "logs"):
        assert getattr(orchestrator, name) is getattr(api, name) and callable(getattr(orchestrator, name))
    for name in exported:
        assert getattr(orchestrator, name) is not None


def test_the_api_is_imported_only_when_used():
    code = "import sys, orchestrator; assert 'orchestrator.api' not in sys.modules; orchestrator.plan; " \
           "assert 'orchestrator.api' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_from_the_top(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("inventory: {hosts: [{address: 10.0.0.1, slots: 2}, {address: 10.0.0.2, "
                                     "slots: 2}]}\njob: {workdir: /w, launcher: mpirun, command: [hostname]}\n")
    monkeypatch.delenv("ORCH_INVENTORY", raising=False)
    rp = orchestrator.plan(orchestrator.load(tmp_path / "c.yaml"))
    assert isinstance(rp, orchestrator.RankPlan) and rp.size == 4


def test_load_takes_orch_inventory_like_the_cli(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text("inventory: {hosts: [{address: 10.0.0.1, slots: 2}]}\n"
                                     "job: {workdir: /w, launcher: mpirun, command: [hostname]}\n")
    (tmp_path / "inv.yaml").write_text("hosts: [{address: 10.0.0.7, slots: 1}, {address: 10.0.0.8, slots: 1}]\n")
    monkeypatch.setenv("ORCH_INVENTORY", str(tmp_path / "inv.yaml"))
    assert [h.address for h in orchestrator.load(tmp_path / "c.yaml").hosts] == ["10.0.0.7", "10.0.0.8"]
    monkeypatch.delenv("ORCH_INVENTORY")
    assert [h.address for h in orchestrator.load(tmp_path / "c.yaml").hosts] == ["10.0.0.1"]


def test_a_cluster_without_slurm_does_not_load_the_slurm_client(tmp_path):
    """slurm_nodes passes a listed inventory through without importing orchestrator.slurm (~30 ms
    of every `orch check`'s start)."""
    (tmp_path / "c.yaml").write_text("inventory: {hosts: [{address: 198.18.0.1}]}\njob: {workdir: /w, command: x}\n")
    code = ("import sys\n"
            "from orchestrator import api\n"
            f"c = api.load({str(tmp_path / 'c.yaml')!r})\n"
            "with api.slurm_nodes(c) as got:\n"
            "    assert got is c\n"
            "print('orchestrator.slurm' in sys.modules)\n")
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.strip() == "False", out.stderr
