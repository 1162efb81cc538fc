"""health (orch check --deep): the devices' own health (npu-smi, hccn_tool link and ping;
nvidia-smi ECC and XID errors), from the sections and judge of orchestrator/health.py. Its
sections follow the devices check's in the probe (they share hccn.conf and npu-smi)."""

from __future__ import annotations

from dataclasses import astuple

from .. import health
from .base import Check, Probe, register, result
from .devices import ASCEND

HEALTH = Probe("health", lambda plan, host: health.sections(plan.cluster, host))

register(Check("health", applies=lambda plan, host: plan.cluster.job.platform in ("ascend", "gpu"),
               probes=(ASCEND, HEALTH), probe_after="devices",
               judge=lambda plan, run: [result("health", run.host,
                                               *astuple(health.judge(plan.cluster, run.host, run.sections or {})))]))
