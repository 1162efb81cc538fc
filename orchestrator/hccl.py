"""HCCL's timeouts for an Ascend job (pure): how long ranks wait for each other to connect,
grown with the cluster unless the cluster file says (job.hccl)."""

from __future__ import annotations

from .model import Cluster

HCCL_CONNECT_DEFAULT = 120   # HCCL's own default and minimum (seconds)
HCCL_CONNECT_PER_HOST = 4    # ranks start further apart as hosts grow (one fan-out, one sync...)


def hccl_connect_timeout(cluster: Cluster, hosts: int) -> int:
    """job.hccl.connect_timeout, else HCCL's 120 s grown with the cluster (4 s a host, at most 7200)."""
    if cluster.job.hccl_connect_timeout is not None:
        return cluster.job.hccl_connect_timeout
    return min(7200, max(HCCL_CONNECT_DEFAULT, HCCL_CONNECT_PER_HOST * hosts))


def hccl_env(cluster: Cluster, hosts: int) -> dict[str, str]:
    """HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT for an Ascend job of `hosts` hosts (values in
    job.env win: the launcher lays them over these)."""
    if cluster.job.platform != "ascend":
        return {}
    env = {"HCCL_CONNECT_TIMEOUT": str(hccl_connect_timeout(cluster, hosts))}
    if cluster.job.hccl_exec_timeout is not None:
        env["HCCL_EXEC_TIMEOUT"] = str(cluster.job.hccl_exec_timeout)
    return env
