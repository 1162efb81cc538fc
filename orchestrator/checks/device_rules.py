"""device-rules: the plan's rules (Ascend device sets, msrun slots, mpirun env): rankplan.make_plan
accepts the cluster. Needs no host: judged on the rank plan the check was given."""

from __future__ import annotations

from ..errors import PlanError
from ..rankplan import RankPlan
from .base import Check, CheckResult, register


def judge_device_rules(rank_plan: RankPlan | PlanError) -> list[CheckResult]:
    """The rank plan, or the PlanError making it gave -> the check's one cluster-wide result."""
    if isinstance(rank_plan, PlanError):
        return [CheckResult("device-rules", None, "fail", str(rank_plan))]
    return [CheckResult("device-rules", None, "pass", f"{len(rank_plan.ranks)} ranks on {len(rank_plan.hosts)} "
                        "host(s) follow the launcher's and platform's device rules")]


register(Check("device-rules", local=lambda plan: judge_device_rules(plan.rank_plan)))
