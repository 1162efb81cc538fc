"""Pure: RankPlan + Cluster -> the texts and argv lists a launch needs.

Nothing here touches a host or builds a shell string: commands are argv lists
and environments are dicts; the transport quotes them (shlex.quote) when it
runs them. Same input -> same bytes (golden-file tested against the seeds).

- `hostfile`                  OpenMPI hostfile, hosts in plan order (mpirun).
- `rank_table_v1`             HCCL rank table 1.0 (seed 000), json.dumps(indent=4) like the
                              seed's hccl_tools.py output, plus a final newline.
- `rank_table_legacy`         MindSpore 0.x group_list table (seed 001), same JSON layout.
- `rank_table_v12`            HCCL rank table 1.2 (Atlas A3 SuperPoD): super_device_id per device,
                              super_pod_list; key order of the HCCL user guide's example.
- `rank_env`                  one rank's environment for the ranktable launcher.
- `mpirun_argv`/`mpirun_secrets`  the one mpirun command (run on the launch host), and the
                              secret values its ranks get from their hosts' supervisors.
- `msrun_argv`/`node_env`     one msrun (or torchrun: `torchrun_argv`) command per host.
- `hccl_env`                  HCCL's timeouts for an Ascend job.

Secret environment variables (Job.is_secret: listed in job.secret_env or named
*_TOKEN/*_KEY/*_SECRET/*PASSWORD*) never appear in an argv, and with mpirun never on Open
MPI's wire either (`-x NAME` would send the value in clear to every host's daemon): each
host's supervisor gets them in its configuration (on stdin) and `agent.py rank` hands them to
the rank from a file only the user can read (`mpirun_secrets`; docs/supervision.md). Their
values are sh.Secret (model.Cluster makes them so): what `orch plan` shows and run records
hold masks them (sh.shown), what runs has them.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any, Mapping

from .agent import tables
from .errors import PlanError
from .plan import Rank, RankPlan, visible_devices_var
from .model import Cluster, Host

HOSTFILE = "hostfile"
RANK_TABLE = "rank_table.json"
MSRUN_CLUSTER_TIME_OUT = 600
_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?$")


def is_python(executable: str) -> bool:
    """Is this command's executable a Python interpreter (python, python3, /usr/bin/python3.11)?
    The one rule for it: msrun drops it (it runs `python script` itself), orch check asks it
    for the versions of the job's Python packages."""
    return bool(_PYTHON.match(posixpath.basename(executable)))


# --------------------------------------------------------------------------- paths on the hosts


def hostfile_path(cluster: Cluster) -> str:
    return posixpath.join(cluster.job.workdir, HOSTFILE)


def rank_table_path(cluster: Cluster) -> str:
    return posixpath.join(cluster.job.workdir, RANK_TABLE)


def log_dir_path(cluster: Cluster) -> str:
    return posixpath.join(cluster.job.workdir, cluster.job.log_dir)


# --------------------------------------------------------------------------- files


def servers(plan: RankPlan, device_ips: Mapping[str, Mapping[int, str]] | None = None) -> list[tables.Server]:
    """The plan's hosts as the launch files' renderer takes them (agent.tables), in plan order;
    with `device_ips`, every device must have one (else a PlanError naming the host)."""
    return [tables.server(h.name, h.cluster_address, h.slots, [(r.rank, r.device_id) for r in plan.by_host(h.name)],
                          _ips(device_ips, h) if device_ips is not None else {}, h.super_device_ids, h.super_pod_id)
            for h in plan.hosts]


def hostfile(plan: RankPlan, by_name: bool = False) -> str:
    """OpenMPI hostfile: `ADDRESS slots=N`, one host a line, in plan order (rank 0 on the first).
    `by_name`: host names instead (in a Slurm allocation, OpenMPI accepts only its node names)."""
    return tables.hostfile(servers(plan), by_name)


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
    from .devices import super_pod_problems

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


def _ips(device_ips: Mapping[str, Mapping[int, str]], h: Host) -> Mapping[int, str]:
    ips = device_ips.get(h.name, {})
    missing = [d for d in h.devices if d not in ips]
    if missing:
        raise PlanError(f"host {h.name}: no device IP for devices {missing}",
                        hint="get them with plan.device_ips_for (inventory device_ips or /etc/hccn.conf)")
    return ips


# --------------------------------------------------------------------------- environments


def host_env(cluster: Cluster, host: Host) -> dict[str, str]:
    """job.env overlaid with the host's env (the host wins)."""
    return {**cluster.job.env, **host.env}


def rank_env(cluster: Cluster, plan: RankPlan, rank: Rank | int, rank_table_path: str) -> dict[str, str]:
    """The ranktable launcher's environment for one rank (seeds 000/001): job.env, the host's
    env, then DEVICE_ID, RANK_ID, RANK_SIZE, DEVICE_NUM, RANK_TABLE_FILE (and for the legacy
    table MINDSPORE_HCCL_CONFIG_PATH), which win over anything the user set."""
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


def _visible_devices(cluster: Cluster, host: Host) -> dict[str, str]:
    """{CUDA_/ASCEND_RT_VISIBLE_DEVICES: ids} when the host uses devices other than 0..slots-1."""
    if cluster.job.platform not in ("gpu", "ascend") or host.devices == tuple(range(len(host.devices))):
        return {}
    return {visible_devices_var(cluster.job.platform): ",".join(map(str, host.devices))}


# --------------------------------------------------------------------------- mpirun


def _mpirun_exports(cluster: Cluster, plan: RankPlan) -> dict[str, str]:
    # make_plan guarantees host env and device selection are the same on every host.
    h = plan.launch_host
    return {**host_env(cluster, h), **_visible_devices(cluster, h)}


TREE_SPAWN_HOSTS = 64  # above this many hosts mpirun's daemons would ssh to each other (tree spawn)


def ssh_args(source: Host, target: Host) -> list[str]:
    """What `ssh` on `source` needs, beyond the address, to log in to `target` as orch does: its
    port and user when they are not ssh's defaults there. mpirun gets exactly these
    (plm_rsh_args), and `orch check`'s mesh test uses them too."""
    out = []
    if target.port != 22:
        out += ["-p", str(target.port)]
    if target.user != source.user:
        out += ["-l", target.user]
    return out


def mpirun_ssh_args(plan: RankPlan) -> list[str]:
    """mpirun's one set of ssh options for every other host (make_plan checks they agree)."""
    head = plan.launch_host
    others = [h for h in plan.hosts if h.name != head.name and h.connection == "ssh"]
    return ssh_args(head, others[0]) if others else []


def interface_env(name: str) -> dict[str, str]:
    """The variables that pin NCCL, HCCL and Gloo traffic to a NIC (job.interface)."""
    return {"NCCL_SOCKET_IFNAME": name, "HCCL_SOCKET_IFNAME": name, "GLOO_SOCKET_IFNAME": name}


def mpirun_interface(chosen: Mapping[str, tuple[str, str | None]]) -> tuple[str, dict[str, str]]:
    """{host: (interface, its IPv4 network or None)} -> (mpirun's btl/oob_tcp_if_include value,
    the variables exported to every rank). One name when every host agrees; otherwise the
    networks (OpenMPI takes CIDRs) and the names as NCCL/HCCL prefix lists (Gloo takes one name:
    left to each host's default)."""
    names = sorted({n for n, _ in chosen.values()})
    if len(names) == 1:
        return names[0], interface_env(names[0])
    nets = sorted({net for _, net in chosen.values() if net})
    joined = ",".join(names)
    return ",".join(nets) or joined, {"NCCL_SOCKET_IFNAME": joined, "HCCL_SOCKET_IFNAME": joined}


def is_root(*, uid: int | None = None, user: str | None = None) -> bool:
    """The one rule for "the launch user is root" (mpirun then needs --allow-run-as-root): uid 0
    when the host said (`id -u`, up's prepare), else the login name (`id -un` in orch check; the
    inventory's user for `orch plan`, which touches no host)."""
    return uid == 0 if uid is not None else user == "root"


def mpirun_argv(cluster: Cluster, plan: RankPlan, *, hostfile_path: str, root: bool,
                interface: str | None = None, output_dir: str | None = None,
                pass_env: tuple[str, ...] = (), command: list[str] | None = None,
                tag: tuple[str, str] | None = None) -> list[str]:
    """The one mpirun command, run on the plan's launch host from any directory.

    Ranks start in workdir (--wdir) and write workdir/log_dir/1/rank.N/stdout. Environment:
    `-x NAME=VALUE` for job.env + host env (the same on every host) and the device selection;
    secrets not at all: their values reach the ranks through the supervisors (mpirun_secrets)."""
    job = cluster.job
    argv = ["mpirun", "-n", str(plan.size), "--hostfile", hostfile_path, "--wdir", job.workdir,
            "--output-filename", output_dir or log_dir_path(cluster), "--merge-stderr-to-stdout"]
    if root:
        argv.append("--allow-run-as-root")
    user_args = " ".join(job.mpirun_args)
    if "bind-to" not in user_args:  # one rank per device, each free to use every core (as horovodrun)
        argv += ["--bind-to", "none"]
    if job.on_failure == "continue":
        argv += ["-mca", "orte_abort_on_non_zero_status", "0"]
    rsh = mpirun_ssh_args(plan)
    if rsh and "plm_rsh_args" not in user_args:  # mpirun's own ssh to the other hosts: the inventory's port/user
        argv += ["-mca", "plm_rsh_args", " ".join(rsh)]
    if len(plan.hosts) > TREE_SPAWN_HOSTS and "tree_spawn" not in user_args:
        argv += ["-mca", "plm_rsh_no_tree_spawn", "1"]  # every ssh from the launch host, as `orch check` tests
    if interface:
        argv += ["-mca", "btl_tcp_if_include", interface, "-mca", "oob_tcp_if_include", interface]
    for name, value in _mpirun_exports(cluster, plan).items():
        if not job.is_secret(name):
            argv += ["-x", f"{name}={value}"]
    for name in pass_env:
        argv += ["-x", name]
    if tag is not None and not any(a == "--prefix" or "orte_launch_agent" in a for a in job.mpirun_args):
        # OpenMPI's daemon on every other host carries the tag (NAME=VALUE) in its environment too,
        # so `orch down` and the stale check find it like every other process of the run
        argv += ["-mca", "orte_launch_agent", f"env {tag[0]}={tag[1]} orted"]
    argv += list(job.mpirun_args)
    argv += list(job.command) if command is None else list(command)
    return argv


def mpirun_secrets(cluster: Cluster, plan: RankPlan) -> dict[str, str]:
    """The secret values every rank of an mpirun job gets from its host's supervisor (`agent.py
    rank`), never through mpirun."""
    return {k: v for k, v in _mpirun_exports(cluster, plan).items() if cluster.job.is_secret(k)}


# --------------------------------------------------------------------------- msrun


def msrun_script(command: tuple[str, ...] | list[str]) -> list[str]:
    """job.command without its interpreter: msrun runs `python script args` itself.
    `net.py a`, `python net.py a`, `/usr/bin/python3 net.py a` -> ['net.py', 'a'];
    interpreter options stay (`python3 -u net.py` -> ['-u', 'net.py']): orch's worker wrapper
    (launchers.msrun_task) hands them to the interpreter."""
    cmd = list(command)
    if cmd and is_python(cmd[0]):
        cmd = cmd[1:]
        if not any(not a.startswith("-") for a in cmd):
            raise PlanError("msrun launcher: job.command names python but no script",
                            hint="command: python net.py [args]")
    return cmd


def msrun_argv(cluster: Cluster, plan: RankPlan, host_name: str, *, log_dir: str | None = None,
               master_addr: str | None = None) -> list[str]:
    """One host's msrun command (run in workdir). node_rank = the host's index in plan order;
    master = the plan's launch host, at `master_addr` (launchers.head_reach; default its cluster
    address)."""
    job = cluster.job
    host = plan.host(host_name)
    return ["msrun",
            f"--worker_num={plan.size}",
            f"--local_worker_num={host.slots}",
            f"--master_addr={master_addr or plan.launch_host.cluster_address}",
            f"--master_port={job.master_port}",
            f"--node_rank={plan.node_rank(host_name)}",
            f"--log_dir={log_dir or log_dir_path(cluster)}",
            "--join=True",
            f"--cluster_time_out={MSRUN_CLUSTER_TIME_OUT}",
            # no worker has this id: msrun copies no worker's output into its own log (by default
            # it tails every worker_N.log into it, a second copy of every rank's output)
            f"--tail_worker_log={plan.size}",
            *msrun_script(job.command)]


def node_env(cluster: Cluster, plan: RankPlan, host_name: str) -> dict[str, str]:
    """The environment of one host's launcher (msrun, torchrun): job.env, host env, device selection."""
    host = plan.host(host_name)
    return {**host_env(cluster, host), **_visible_devices(cluster, host)}


# --------------------------------------------------------------------------- torchrun


def torchrun_argv(cluster: Cluster, plan: RankPlan, host_name: str, command: list[str], *,
                  master_addr: str | None = None) -> list[str]:
    """One host's torchrun (static rendezvous at the launch host, at `master_addr`: default its
    cluster address): `command` is what each of its workers runs as is (`--no-python`:
    job.command names its interpreter). torchrun restarts nothing itself (orch does, job.restarts)."""
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


# --------------------------------------------------------------------------- HCCL


HCCL_CONNECT_DEFAULT = 120   # HCCL's own default and minimum (seconds)
HCCL_CONNECT_PER_HOST = 4    # ranks start further apart as hosts grow (one fan-out, one sync...)


def hccl_connect_timeout(cluster: Cluster, hosts: int) -> int:
    """job.hccl.connect_timeout, else HCCL's 120 s grown with the cluster (4 s a host, at most 7200)."""
    if cluster.job.hccl_connect_timeout is not None:
        return cluster.job.hccl_connect_timeout
    return min(7200, max(HCCL_CONNECT_DEFAULT, HCCL_CONNECT_PER_HOST * hosts))


def hccl_env(cluster: Cluster, plan: RankPlan) -> dict[str, str]:
    """HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT for an Ascend job (values in job.env win)."""
    if cluster.job.platform != "ascend":
        return {}
    env = {"HCCL_CONNECT_TIMEOUT": str(hccl_connect_timeout(cluster, len(plan.hosts)))}
    if cluster.job.hccl_exec_timeout is not None:
        env["HCCL_EXEC_TIMEOUT"] = str(cluster.job.hccl_exec_timeout)
    return env


# --------------------------------------------------------------------------- `orch plan --out`


def plan_document(cluster: Cluster, plan: RankPlan) -> dict[str, Any]:
    """plan.json: the cluster, the launcher, the hosts and every rank, in plan order."""
    doc = {"cluster": cluster.name, "file": str(cluster.path), **plan.to_dict()}
    if plan.launcher == "ranktable":
        doc["rank_table"] = {"path": rank_table_path(cluster), "version": cluster.job.rank_table_version,
                             "hccl_tools_name": rank_table_filename(plan)}
    if plan.launcher == "mpirun":
        doc["hostfile"] = hostfile_path(cluster)
    return doc
