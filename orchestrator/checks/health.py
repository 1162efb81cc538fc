"""health (orch check --deep): the devices' own health (npu-smi, hccn_tool link and ping;
nvidia-smi ECC and XID errors), from the sections and judge of orchestrator/health.py. Its
sections follow the devices check's in the probe (they share hccn.conf and npu-smi).
orchestrator/health.py is loaded only by a check that runs it (--deep): ~12 ms of every other
`orch check`'s start."""

from __future__ import annotations

from dataclasses import astuple

from .base import Check, CheckResult, Probe, ProbeRun, register, result
from .devices import ASCEND


def _sections(plan, host) -> list[tuple[str, str]]:
    from .. import health  # lazy: --deep only (see above)

    return health.sections(plan.cluster, host)


def _judge(plan, run: ProbeRun) -> list[CheckResult]:
    from .. import health  # lazy: --deep only (see above)

    return [result("health", run.host, *astuple(health.judge(plan.cluster, run.host, run.sections or {})))]


HEALTH = Probe("health", _sections)

register(Check("health", applies=lambda plan, host: plan.cluster.job.platform in ("ascend", "gpu"),
               probes=(ASCEND, HEALTH), probe_after="devices", judge=_judge))
