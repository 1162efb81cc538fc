"""clock: the host's clock against this machine's, from the times the probe starts and ends at
(its frame: in every probe) and when it was sent and came back; Ascend: clocks or a launch
spread that could outlast HCCL_CONNECT_TIMEOUT."""

from __future__ import annotations

from typing import Sequence

from .. import probes
from ..probes import ProbeError, Section
from ..model import Cluster, Host
from .base import Check, CheckResult, Probe, register, result, section
from ..hccl import hccl_connect_timeout

CLOCK = Probe("clock", lambda plan, host: [("clock0", "date +%s.%N"), ("clock1", "date +%s.%N")], place="frame")


def clock_skew(first: Section, last: Section, t_send: float, t_recv: float) -> tuple[float, float]:
    """(the host's clock minus this machine's, what the round trip cannot tell apart), in seconds."""
    r0, r1 = probes.parse_clock(first.body), probes.parse_clock(last.body)
    return (r0 + r1) / 2 - (t_send + t_recv) / 2, max(0.0, ((t_recv - t_send) - (r1 - r0)) / 2)


def judge_clock(host: Host, first: Section, last: Section, t_send: float, t_recv: float,
                limit: float) -> CheckResult:
    """Skew = host's midpoint - controller's midpoint; only beyond what the round trip can explain."""
    if not t_send or not t_recv:
        return result("clock", host, "error", "no send/receive times to compare the clock with")
    skew, slack = clock_skew(first, last, t_send, t_recv)
    if abs(skew) - slack > limit:
        way = "ahead of" if skew > 0 else "behind"
        return result("clock", host, "warn", f"clock is {abs(skew):.1f}s {way} this machine's (more than "
                                             f"checks.clock_skew {limit:g}s): timeouts and log times will "
                                             "disagree; run NTP (chrony/systemd-timesyncd)")
    return result("clock", host, "pass", f"within {max(abs(skew), slack):.2f}s of this machine's")


def judge_hccl_timeout(cluster: Cluster, skews: Sequence[float], sent: Sequence[float]) -> list[CheckResult]:
    """Ascend: HCCL gives ranks HCCL_CONNECT_TIMEOUT to find each other. Hosts whose clocks, or
    whose probes (sent once each host was reached: how staggered a launch is) are already half of
    that apart will start their ranks further apart than that some day: warn before EI0006
    ("Getting socket times out")."""
    if cluster.job.platform != "ascend" or max(len(skews), len(sent)) < 2:
        return []

    limit = hccl_connect_timeout(cluster, len(cluster.hosts))
    skew = max(skews) - min(skews) if skews else 0.0
    spread = max(sent) - min(sent) if sent else 0.0
    if max(skew, spread) < limit / 2:
        return []
    return [CheckResult("clock", None, "warn", f"the hosts' clocks are {skew:.0f}s apart and reaching them all "
                        f"took {spread:.0f}s, while HCCL_CONNECT_TIMEOUT is {limit}s: ranks that start further apart "
                        "than that fail with EI0006; raise job.hccl.connect_timeout (at most 7200) and run NTP")]


def _judge(plan, run) -> list[CheckResult]:
    s = run.sections
    return [judge_clock(run.host, section(s, "clock0"), section(s, "clock1"), run.t_send, run.t_recv,
                        plan.cluster.checks.clock_skew)]


def _across(plan, runs) -> list[CheckResult]:
    if plan.cluster.job.platform != "ascend":
        return []
    skews = []
    for r in runs:
        c0, c1 = r.sections.get("clock0"), r.sections.get("clock1")
        if c0 is not None and c1 is not None and r.t_send and r.t_recv:
            try:
                skews.append(clock_skew(c0, c1, r.t_send, r.t_recv)[0])
            except ProbeError:
                pass
    return judge_hccl_timeout(plan.cluster, skews, [r.t_send for r in runs if r.t_send])


register(Check("clock", probes=(CLOCK,), judge=_judge, across=_across))
