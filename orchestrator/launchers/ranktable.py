"""The ranktable launcher (pure; seeds 000/001): every rank is a process of its host's
supervisor, with DEVICE_ID, RANK_ID, RANK_SIZE, DEVICE_NUM and, on Ascend, RANK_TABLE_FILE, the
HCCL rank table every host gets:

- `rank_table_v1`      HCCL rank table 1.0 (seed 000), json.dumps(indent=4) like the seed's
                       hccl_tools.py output, plus a final newline;
- `rank_table_legacy`  MindSpore 0.x group_list table (seed 001), same JSON layout;
- `rank_table_v12`     HCCL rank table 1.2 (Atlas A3 SuperPoD): super_device_id per device,
                       super_pod_list; key order of the HCCL user guide's example.

The texts themselves come from `agent.tables`, the code the run's head renders them with when a
spare takes a host's place (one renderer: byte-identical)."""

from __future__ import annotations

import posixpath
from typing import Any, Mapping

from ..agent import tables
from ..devices import super_pod_problems
from ..errors import PlanError
from ..model import Cluster
from ..rankplan import Rank, RankPlan
from .base import Context, Launcher, Proc, host_env, servers

RANK_TABLE = "rank_table.json"


def rank_table_path(cluster: Cluster) -> str:
    return posixpath.join(cluster.job.workdir, RANK_TABLE)


def rank_table_v1(plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]]) -> str:
    """HCCL rank table version 1.0 (seed 000 / hccl_tools.py): every value a string."""
    return tables.rank_table_v1(servers(plan, device_ips))


def rank_table_legacy(plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]], aarch64: bool = False) -> str:
    """MindSpore 0.x rank table (seed 001): one group, one instance per rank. board_id is 0x002f
    on aarch64 (Kunpeng) hosts, as MindSpore's generator writes it there.

    The constants are seed 001's (board_id 0x0000, chip_info 910, deploy_mode lab, para-plane
    NICs on the device); para_plane_nic_name lists eth<device id> for every device id used."""
    return tables.rank_table_legacy(servers(plan, device_ips), aarch64)


def rank_table_v12(plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]]) -> str:
    """HCCL rank table version 1.2 (Atlas A3 SuperPoD), keys in the order of the HCCL user guide's
    example: status, version, server_count, server_list (server_id, host_ip, device: device_id,
    super_device_id, device_ip, rank_id), super_pod_list (super_pod_id, server_list: server_id).
    Every value a string. host_ip is the host's cluster address, left out when that is a DNS name
    (HCCL takes an IP there and the key is optional). The plan's hosts must carry their
    super_device_ids and super_pod_id (devices.super_devices_for): an empty or missing one is a
    PlanError, never a table HCCL's RanktableCheck would refuse."""
    problems = super_pod_problems(plan.hosts)
    if problems:
        raise PlanError("rank table 1.2 (Atlas A3) cannot be written:\n" + "\n".join(f"  - {p}" for p in problems),
                        hint="get them with devices.super_devices_for (inventory super_device_ids/super_pod_id "
                             "or npu-smi info -t spod-info on the hosts)")
    return tables.rank_table_v12(servers(plan, device_ips))


def rank_table(cluster: Cluster, plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]],
               aarch64: bool = False) -> str:
    """The rank table in the version the job asks for (job.rank_table.version); `aarch64`: the
    hosts are (the legacy table's board_id says so)."""
    if cluster.job.rank_table_version == "legacy":
        return rank_table_legacy(plan, device_ips, aarch64)
    if cluster.job.rank_table_version == "1.2":
        return rank_table_v12(plan, device_ips)
    return rank_table_v1(plan, device_ips)


def rank_table_filename(plan: RankPlan) -> str:
    """hccl_tools.py's name for the table: hccl_<n>p_<device ids joined>_<server ip>.json
    (device ids: every id used, ascending; server: the launch host)."""
    ids = "".join(str(d) for d in sorted({d for h in plan.hosts for d in h.devices}))
    return f"hccl_{plan.size}p_{ids}_{plan.launch_host.cluster_address}.json"


def rank_env(cluster: Cluster, plan: RankPlan, rank: Rank | int, rank_table_path: str) -> dict[str, str]:
    """One rank's environment (seeds 000/001): job.env, the host's env, then DEVICE_ID, RANK_ID,
    RANK_SIZE, DEVICE_NUM, RANK_TABLE_FILE (and for the legacy table MINDSPORE_HCCL_CONFIG_PATH),
    which win over anything the user set."""
    r = plan.ranks[rank] if isinstance(rank, int) else rank
    host = plan.host(r.host)
    env = host_env(cluster, host)
    env.update({
        "DEVICE_ID": str(r.device_id),
        "RANK_ID": str(r.rank),
        "RANK_SIZE": str(plan.size),
        "DEVICE_NUM": str(len(host.devices)),
        "RANK_TABLE_FILE": rank_table_path,
    })
    if cluster.job.rank_table_version == "legacy":
        env["MINDSPORE_HCCL_CONFIG_PATH"] = rank_table_path
    return env


class Ranktable(Launcher):
    name = "ranktable"

    def procs(self, ctx: Context) -> dict[str, list[Proc]]:
        cluster, plan, job = ctx.cluster, ctx.plan, ctx.cluster.job
        table = rank_table_path(cluster)
        out: dict[str, list[Proc]] = {}
        for r in plan.by_host(ctx.only) if ctx.only else plan.ranks:
            env = {**ctx.host_added[r.host], **rank_env(cluster, plan, r, table)}
            if job.platform != "ascend":  # no rank table off Ascend
                env.pop("RANK_TABLE_FILE", None)
            # torch/gloo-style names too, so one script runs under any launcher
            env.setdefault("MASTER_ADDR", ctx.master)
            env.setdefault("MASTER_PORT", str(job.master_port))
            env.update({"RANK": str(r.rank), "WORLD_SIZE": str(plan.size), "LOCAL_RANK": str(r.local_rank)})
            env.update(ctx.stall_env)
            out.setdefault(r.host, []).append(Proc(f"rank.{r.rank}", tuple(job.command), env, job.workdir,
                                                   f"1/rank.{r.rank}/stdout", rank=r.rank, env_log=True))
        return out

    def files(self, ctx: Context) -> dict[str, dict[str, bytes]]:
        if not self.needs_device_ips(ctx.cluster) or ctx.only:
            return {}
        data = rank_table(ctx.cluster, ctx.plan, ctx.device_ips or {}, ctx.aarch64).encode()
        return {h.name: {RANK_TABLE: data} for h in ctx.plan.all_hosts}

    def launch_files(self, cluster: Cluster) -> dict[str, object]:
        if not self.needs_device_ips(cluster):
            return {}
        return {"rank_table": RANK_TABLE, "version": cluster.job.rank_table_version}

    def plan_document(self, cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
        return {"rank_table": {"path": rank_table_path(cluster), "version": cluster.job.rank_table_version,
                               "hccl_tools_name": rank_table_filename(plan)}}

    def plan_files(self, cluster: Cluster, plan: RankPlan,
                   device_ips: Mapping[str, Mapping[int, str]] | None) -> dict[str, str]:
        return {} if device_ips is None else {RANK_TABLE: rank_table(cluster, plan, device_ips)}

    def needs_device_ips(self, cluster: Cluster) -> bool:
        return cluster.job.platform == "ascend"
