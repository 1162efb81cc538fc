"""torchrun (pure): one torchrun per host, static rendezvous at the launch host; each worker runs
under `agent.py rank`. torchrun restarts nothing itself (orch does, job.restarts)."""

from __future__ import annotations

from typing import Sequence

from ..agent.layout import RANK_OUTPUT_VAR
from ..model import Cluster
from ..rankplan import RankPlan
from .base import Context, PerHost, wrapped


def torchrun_argv(cluster: Cluster, plan: RankPlan, host_name: str, command: Sequence[str], *,
                  master_addr: str | None = None) -> list[str]:
    """One host's torchrun (static rendezvous at the launch host, at `master_addr`: default its
    cluster address): `command` is what each of its workers runs as is (`--no-python`:
    job.command names its interpreter)."""
    host = plan.host(host_name)
    return ["torchrun",
            f"--nnodes={len(plan.hosts)}",
            f"--nproc-per-node={host.slots}",
            f"--node-rank={plan.node_rank(host_name)}",
            f"--master-addr={master_addr or plan.launch_host.cluster_address}",
            f"--master-port={cluster.job.master_port}",
            "--max-restarts=0",
            "--no-python",
            *command]


class Torchrun(PerHost):
    name = "torchrun"
    program = "torchrun"
    tools = ("torch",)
    env = {RANK_OUTPUT_VAR: "1"}   # each worker's `agent.py rank` writes its output to its rank log itself

    def argv(self, ctx: Context, host: str) -> list[str]:
        return torchrun_argv(ctx.cluster, ctx.plan, host, wrapped(ctx.rdir, ctx.cluster.job.command),
                             master_addr=ctx.master)
