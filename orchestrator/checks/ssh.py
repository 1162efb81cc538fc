"""ssh: the host is reached as the inventory says (its connection is opened once, for the probe).
A host that cannot be reached fails here; run.judge_host turns its other checks into errors."""

from __future__ import annotations

from .base import Check, result, register


def judge_ssh(plan, run) -> list:
    host = run.host
    return [result("ssh", host, "pass", f"{host.route} ({'local' if host.connection == 'local' else 'ssh'},"
                                        f" {run.connect_time:.2f}s to connect)")]


register(Check("ssh", judge=judge_ssh))
