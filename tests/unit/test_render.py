"""orchestrator.render: golden files (tests/golden/README.md says which seed each reproduces),
argv/env builders, and properties of the rank tables.

ORCH_UPDATE_GOLDEN=1 rewrites the golden files that are orch's own renderings (never the
verbatim seed copies); check the diff by hand against the seeds before committing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.errors import PlanError
from orchestrator.devices import hccn_ips, parse_hccn
from orchestrator.rankplan import device_ips_for, make_plan, server_key
from orchestrator.launchers.base import node_env
from orchestrator.launchers.mpirun import hostfile, mpirun_argv, mpirun_secrets
from orchestrator.launchers.msrun import msrun_argv, msrun_script
from orchestrator.launchers.ranktable import (
    rank_env, rank_table, rank_table_filename, rank_table_legacy, rank_table_v1,
)
from orchestrator.launchers.show import launch_commands, plan_files
from orchestrator.sh import MASK
from orchestrator.spec import Cluster, Host, Job

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
UPDATE = os.environ.get("ORCH_UPDATE_GOLDEN") == "1"
SEED000_IPS = {0: "192.168.100.101", 1: "192.168.101.101", 2: "192.168.102.101", 3: "192.168.103.101",
               4: "192.168.100.100", 5: "192.168.101.100", 6: "192.168.102.100", 7: "192.168.103.100"}


def host(address: str, devices=range(8), name: str | None = None, user: str = "train", **kw) -> Host:
    devices = tuple(devices)
    return Host(name=name or address, address=address, user=user, slots=len(devices), devices=devices, **kw)


def cluster(*hosts: Host, launcher="mpirun", platform="cpu", command=("python", "net.py"), **job) -> Cluster:
    return Cluster(name="t", path=Path("/tmp/cluster.yaml"), hosts=tuple(hosts),
                   job=Job(workdir="/data/job", command=tuple(command), launcher=launcher, platform=platform,
                           **job))


def golden(name: str, text: str) -> None:
    """Compare with tests/golden/<name> (or rewrite it under ORCH_UPDATE_GOLDEN=1)."""
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"rendering differs from {path}"


def seed(name: str) -> str:
    return (GOLDEN / name).read_text()


# --------------------------------------------------------------------------- rank tables vs the seeds


def test_seed000_eight_devices_exactly():
    """Seed 000 (hccl_tools.py --device_num "[0,8)"), device IPs read from a hccn.conf."""
    h = host("127.0.0.1")
    c = cluster(h, launcher="ranktable", platform="ascend")
    plan = make_plan(c)
    ips = device_ips_for(plan, {"127.0.0.1": hccn_ips(parse_hccn(seed("hccn.conf")))})
    text = rank_table_v1(plan, ips)
    expected = seed("seed000_hccl_8p_01234567_127.0.0.1.json")
    assert json.loads(text) == json.loads(expected)
    assert text == expected
    assert rank_table(c, plan, ips) == text
    assert rank_table_filename(plan) == "hccl_8p_01234567_127.0.0.1.json"


def test_seed000_four_devices_4_to_7_exactly():
    """Seed 000 (hccl_tools.py --device_num "[4,8)"): device_id 4..7 keep their ids, rank_id 0..3."""
    h = host("127.0.0.1", [4, 5, 6, 7], device_ips={d: SEED000_IPS[d] for d in range(4, 8)})
    plan = make_plan(cluster(h, launcher="ranktable", platform="ascend"))
    text = rank_table_v1(plan, device_ips_for(plan, {}))
    expected = seed("seed000_hccl_4p_4567_127.0.0.1.json")
    assert json.loads(text) == json.loads(expected)
    assert text == expected
    assert rank_table_filename(plan) == "hccl_4p_4567_127.0.0.1.json"


def _two_by_eight():
    # listed out of order on purpose: 10.0.0.2 < 10.0.0.10 numerically (not as strings)
    b = host("10.0.0.10", device_ips={d: ip.rsplit(".", 1)[0] + f".{int(ip.rsplit('.', 1)[1]) + 2}"
                                      for d, ip in SEED000_IPS.items()})
    a = host("10.0.0.2", device_ips=SEED000_IPS)
    c = cluster(b, a, launcher="ranktable", platform="ascend")
    plan = make_plan(c)
    return c, plan, device_ips_for(plan, {})


def test_two_servers_sixteen_ranks():
    c, plan, ips = _two_by_eight()
    text = rank_table_v1(plan, ips)
    golden("rank_table_2x8.json", text)
    t = json.loads(text)
    assert t["server_count"] == "2"
    assert [s["server_id"] for s in t["server_list"]] == ["10.0.0.2", "10.0.0.10"]
    assert [d["rank_id"] for s in t["server_list"] for d in s["device"]] == [str(i) for i in range(16)]
    assert t["server_list"][1]["device"][0] == {"device_id": "0", "device_ip": "192.168.100.103", "rank_id": "8"}


def test_seed001_legacy_two_devices():
    """Seed 001 (MindSpore 0.2 rank_table.json): the same values; layout json.dumps(indent=4)."""
    h = host("10.155.111.140", [0, 1], device_ips={0: "192.1.27.6", 1: "192.2.27.6"})
    c = cluster(h, launcher="ranktable", platform="ascend", rank_table_version="legacy")
    plan = make_plan(c)
    text = rank_table_legacy(plan, device_ips_for(plan, {}))
    assert json.loads(text) == json.loads(seed("seed001_rank_table.json"))
    golden("rank_table_legacy_2p.json", text)
    assert rank_table(c, plan, device_ips_for(plan, {})) == text


def test_legacy_two_servers():
    c, plan, ips = _two_by_eight()
    t = json.loads(rank_table_legacy(plan, ips))
    g = t["group_list"][0]
    assert (g["device_num"], g["server_num"], g["instance_count"]) == ("16", "2", "16")
    assert [i["rank_id"] for i in g["instance_list"]] == [str(i) for i in range(16)]
    assert [i["server_id"] for i in g["instance_list"]] == ["10.0.0.2"] * 8 + ["10.0.0.10"] * 8
    assert t["para_plane_nic_name"] == [f"eth{i}" for i in range(8)] and t["para_plane_nic_num"] == "8"


def test_rank_table_without_ip_refuses():
    plan = make_plan(cluster(host("10.0.0.1", range(2)), launcher="ranktable"))
    with pytest.raises(PlanError, match=r"no device IP for devices \[1\]"):
        rank_table_v1(plan, {"10.0.0.1": {0: "192.168.0.1"}})


# --------------------------------------------------------------------------- hostfiles


def test_hostfile_seed002_two_hosts():
    """Seed 002: `DEVICE1 slots=8` / `DEVICE2 slots=8`."""
    plan = make_plan(cluster(host("DEVICE2"), host("DEVICE1")))
    text = hostfile(plan)
    golden("hostfile_seed002_2x8", text)
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == ["DEVICE1 slots=8", "DEVICE2 slots=8"]


def test_hostfile_seed004_two_hosts():
    """Seed 004 lists `DEVICE1 slots=8` then `192.168.0.1 slots=8`; orch's one host order puts
    IP addresses before DNS names, so the same two lines come out IP first."""
    plan = make_plan(cluster(host("DEVICE1"), host("192.168.0.1")))
    text = hostfile(plan)
    golden("hostfile_seed004_2x8", text)
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == ["192.168.0.1 slots=8",
                                                                          "DEVICE1 slots=8"]


# --------------------------------------------------------------------------- ranktable env


def test_rank_env_seed000_four_devices():
    h = host("127.0.0.1", [4, 5, 6, 7], env={"B": "host", "RANK_ID": "user"})
    c = cluster(h, launcher="ranktable", platform="ascend", env={"A": "job", "B": "job"})
    plan = make_plan(c)
    envs = [rank_env(c, plan, r, "/data/job/rank_table.json") for r in plan.ranks]
    assert [(e["DEVICE_ID"], e["RANK_ID"]) for e in envs] == [("4", "0"), ("5", "1"), ("6", "2"), ("7", "3")]
    assert envs[0] == {"A": "job", "B": "host", "RANK_ID": "0", "DEVICE_ID": "4", "RANK_SIZE": "4",
                       "DEVICE_NUM": "4", "RANK_TABLE_FILE": "/data/job/rank_table.json"}
    assert rank_env(c, plan, 2, "/t.json")["DEVICE_ID"] == "6"


def test_rank_env_legacy_sets_mindspore_hccl_config_path():
    c = cluster(host("10.0.0.1", [0, 1]), launcher="ranktable", platform="ascend", rank_table_version="legacy")
    plan = make_plan(c)
    env = rank_env(c, plan, plan.ranks[1], "/w/rank_table.json")
    assert env["MINDSPORE_HCCL_CONFIG_PATH"] == env["RANK_TABLE_FILE"] == "/w/rank_table.json"
    assert env["DEVICE_NUM"] == "2" and env["RANK_SIZE"] == "2"


# --------------------------------------------------------------------------- mpirun


def test_mpirun_argv_basic():
    c = cluster(host("10.0.0.1", range(8)), host("10.0.0.2", range(8)), env={"DATA_PATH": "./MNIST_Data/train/"},
                mpirun_args=("-mca", "pml", "ob1"))
    plan = make_plan(c)
    assert mpirun_argv(c, plan, hostfile_path="/data/job/hostfile", root=False) == [
        "mpirun", "-n", "16", "--hostfile", "/data/job/hostfile", "--wdir", "/data/job",
        "--output-filename", "/data/job/log_output", "--merge-stderr-to-stdout", "--bind-to", "none",
        "-x", "DATA_PATH=./MNIST_Data/train/", "-mca", "pml", "ob1", "python", "net.py"]
    assert mpirun_secrets(c, plan) == {}


def test_mpirun_ssh_settings_follow_the_inventory():
    """mpirun's own ssh to the other hosts gets their port and user (plm_rsh_args); nothing when
    they are ssh's defaults on the launch host; above 64 hosts no tree spawn."""
    import dataclasses

    def with_ssh(h, **kw):
        return dataclasses.replace(h, **kw)

    hosts = [with_ssh(host(f"10.0.0.{i}", range(1)), port=2222, user="train") for i in (1, 2, 3)]
    c = cluster(*hosts)
    argv = mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False)
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 2222"   # same user as the launch host: no -l
    hosts[1:] = [with_ssh(h, user="other") for h in hosts[1:]]
    hosts[0] = with_ssh(hosts[0], user="train")
    c = cluster(*hosts)
    argv = mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False)
    assert argv[argv.index("plm_rsh_args") + 1] == "-p 2222 -l other"
    assert "plm_rsh_no_tree_spawn" not in argv
    c = cluster(*[host(f"10.0.{i // 250}.{i % 250 + 1}", range(1)) for i in range(65)])
    argv = mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False)
    assert "plm_rsh_args" not in argv
    assert argv[argv.index("plm_rsh_no_tree_spawn") + 1] == "1"
    # the user's own choice wins
    c = cluster(*hosts, mpirun_args=("--bind-to", "core", "-mca", "plm_rsh_args", "-F /x"))
    argv = mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False)
    assert argv.count("--bind-to") == 1 and argv.count("plm_rsh_args") == 1


def test_mpirun_refuses_hosts_with_different_ssh_ports():
    import dataclasses

    from orchestrator.errors import PlanError
    hosts = [host("10.0.0.1", range(1)), dataclasses.replace(host("10.0.0.2", range(1)), port=2222),
             host("10.0.0.3", range(1))]
    with pytest.raises(PlanError, match="one ssh port and user"):
        make_plan(cluster(*hosts))


def test_mpirun_interface_one_name_or_networks():
    from orchestrator.launchers.mpirun import mpirun_interface
    assert mpirun_interface({"a": ("eth1", "10.0.0.0/24"), "b": ("eth1", "10.0.0.0/24")}) == (
        "eth1", {"NCCL_SOCKET_IFNAME": "eth1", "HCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1"})
    assert mpirun_interface({"a": ("eth1", "10.0.0.0/24"), "b": ("ens5", "10.0.0.0/24")}) == (
        "10.0.0.0/24", {"NCCL_SOCKET_IFNAME": "ens5,eth1", "HCCL_SOCKET_IFNAME": "ens5,eth1"})


def test_mpirun_argv_root_interface_continue_and_secrets():
    c = cluster(host("10.0.0.1", range(2), env={"NCCL_DEBUG": "INFO"}), env={"HF_TOKEN": "s3cret", "X": "a b"},
                secret_env=("MY_PASS_PHRASE",), on_failure="continue", mpirun_args=("--bind-to", "none"))
    c = Cluster(name=c.name, path=c.path, hosts=c.hosts,
                job=Job(**{**c.job.__dict__, "env": {**c.job.env, "MY_PASS_PHRASE": "p"}}))
    plan = make_plan(c)
    argv = mpirun_argv(c, plan, hostfile_path="/h", root=True, interface="eth1")
    assert argv[10:] == [
        "--allow-run-as-root", "-mca", "orte_abort_on_non_zero_status", "0",
        "-mca", "btl_tcp_if_include", "eth1", "-mca", "oob_tcp_if_include", "eth1",
        "-x", "X=a b", "-x", "NCCL_DEBUG=INFO",
        "--bind-to", "none", "python", "net.py"]
    # secrets: not even by name (Open MPI would send the values in clear to every host's daemon);
    # the supervisors give them to the ranks
    assert not any("s3cret" in a or a.endswith("=p") or a in ("HF_TOKEN", "MY_PASS_PHRASE") for a in argv)
    assert mpirun_secrets(c, plan) == {"HF_TOKEN": "s3cret", "MY_PASS_PHRASE": "p"}


@pytest.mark.parametrize("platform,var", [("gpu", "CUDA_VISIBLE_DEVICES"), ("ascend", "ASCEND_RT_VISIBLE_DEVICES")])
def test_mpirun_visible_devices(platform, var):
    c = cluster(host("10.0.0.1", [4, 5, 6, 7]), platform=platform)
    argv = mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False)
    assert argv[argv.index(f"{var}=4,5,6,7") - 1] == "-x"
    c = cluster(host("10.0.0.1", [0, 1, 2, 3]), platform=platform)
    assert not any("VISIBLE" in a for a in mpirun_argv(c, make_plan(c), hostfile_path="/h", root=False))


# --------------------------------------------------------------------------- msrun


def test_msrun_argv_per_host():
    c = cluster(host("10.0.0.2", range(4)), host("10.0.0.1", range(4)), launcher="msrun",
                command=("python3", "net.py", "--epochs", "2"), master_port=9000)
    plan = make_plan(c)
    assert msrun_argv(c, plan, "10.0.0.2") == [
        "msrun", "--worker_num=8", "--local_worker_num=4", "--master_addr=10.0.0.1", "--master_port=9000",
        "--node_rank=1", "--log_dir=/data/job/log_output", "--join=True", "--cluster_time_out=600",
        "--tail_worker_log=8",
        "net.py", "--epochs", "2"]
    assert "--node_rank=0" in msrun_argv(c, plan, "10.0.0.1")


@pytest.mark.parametrize("command,script", [
    (["net.py", "a"], ["net.py", "a"]), (["python", "net.py"], ["net.py"]),
    (["/usr/bin/python3.11", "x/net.py", "-v"], ["x/net.py", "-v"]), (["pythonic.py"], ["pythonic.py"])])
def test_msrun_strips_the_interpreter(command, script):
    assert msrun_script(command) == script


@pytest.mark.parametrize("command", [["python"], ["python", "-u"]])
def test_msrun_refuses_a_command_without_script(command):
    with pytest.raises(PlanError, match="msrun"):
        msrun_script(command)


@pytest.mark.parametrize("command,script", [(["python3", "-u", "net.py"], ["-u", "net.py"]),
                                            (["python3", "-m", "train", "x"], ["-m", "train", "x"])])
def test_msrun_keeps_interpreter_options(command, script):
    """msrun passes them through, and orch's worker wrapper hands them to the interpreter."""
    from orchestrator.launchers.msrun import msrun_task
    assert msrun_script(command) == script
    assert msrun_task(command)[3:] == ["python3", *script]


def test_node_env_per_host_devices_and_env():
    c = cluster(host("10.0.0.1", [4, 5], env={"NCCL_SOCKET_IFNAME": "eth1"}), host("10.0.0.2", [0, 1]),
                launcher="msrun", platform="gpu", env={"A": "1"})
    plan = make_plan(c)
    assert node_env(c, plan, "10.0.0.1") == {"A": "1", "NCCL_SOCKET_IFNAME": "eth1", "CUDA_VISIBLE_DEVICES": "4,5"}
    assert node_env(c, plan, "10.0.0.2") == {"A": "1"}


# --------------------------------------------------------------------------- every host's commands


def test_launch_commands_ranktable_redacts_secrets():
    c = cluster(host("10.0.0.2", range(2)), host("10.0.0.1", range(2)), launcher="ranktable",
                env={"API_KEY": "k", "LR": "0.1"})
    plan = make_plan(c)
    cmds = launch_commands(c, plan, root=False)
    assert list(cmds) == ["10.0.0.1", "10.0.0.2"]
    rec = cmds["10.0.0.2"][1]
    assert rec["rank"] == 3 and rec["argv"] == ["python", "net.py"] and rec["cwd"] == "/data/job"
    assert rec["env"]["API_KEY"] == MASK and rec["env"]["LR"] == "0.1" and rec["env"]["DEVICE_ID"] == "1"
    assert rec["stdout"] == "/data/job/.orch/<run-id>/a1/1/rank.3/stdout"
    assert launch_commands(c, plan, root=False, redact=False)["10.0.0.2"][1]["env"]["API_KEY"] == "k"


def test_launch_commands_msrun_and_mpirun_shapes_are_what_up_runs():
    c = cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(2)), launcher="msrun")
    cmds = launch_commands(c, make_plan(c), root=False)
    assert [len(v) for v in cmds.values()] == [1, 1] and cmds["10.0.0.2"][0]["argv"][0] == "msrun"
    assert "--log_dir=/data/job/.orch/<run-id>/a1" in cmds["10.0.0.2"][0]["argv"]
    c = cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(2)))
    cmds = launch_commands(c, make_plan(c), root=True)
    argv = cmds["10.0.0.1"][0]["argv"]
    assert cmds["10.0.0.2"] == [] and "--allow-run-as-root" in argv
    assert argv[-7:-2] == ["python3", "-S", "/data/job/.orch/<run-id>/agent.py", "rank", "--"]  # the rank wrapper


def test_plan_files_per_launcher():
    c, plan, ips = _two_by_eight()
    files = plan_files(c, plan, device_ips=ips, root=False)
    assert sorted(files) == ["commands.json", "plan.json", "rank_table.json"]
    assert files["rank_table.json"] == seed("rank_table_2x8.json")
    doc = json.loads(files["plan.json"])
    assert doc["rank_table"] == {"path": "/data/job/rank_table.json", "version": "1.0",
                                 "hccl_tools_name": "hccl_16p_01234567_10.0.0.2.json"}
    assert "rank_table.json" not in plan_files(c, plan, device_ips=None, root=False)


# --------------------------------------------------------------------------- properties


addresses = st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str),
                      st.from_regex(r"\A[a-z][a-z0-9-]{0,8}\Z"))


@st.composite
def ranktable_cases(draw):
    addrs = draw(st.lists(addresses, min_size=1, max_size=10, unique=True))
    hosts = []
    for i, a in enumerate(addrs):
        devs = draw(st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True))
        ips = {d: f"192.168.{i}.{d}" for d in devs}
        hosts.append(host(a, devs, name=f"h{i}", device_ips=ips))
    return cluster(*hosts, launcher="ranktable")


@settings(max_examples=60, deadline=None)
@given(ranktable_cases())
def test_rank_table_hccl_order_and_determinism(c):
    plan = make_plan(c)
    ips = device_ips_for(plan, {})
    text = rank_table_v1(plan, ips)
    t = json.loads(text)
    servers = t["server_list"]
    assert t["server_count"] == str(len(c.hosts)) == str(len(servers))
    keys = [server_key(s["server_id"]) for s in servers]
    assert keys == sorted(keys) and len(set(s["server_id"] for s in servers)) == len(servers)
    ranks = [int(d["rank_id"]) for s in servers for d in s["device"]]
    assert ranks == list(range(plan.size))  # 0..N-1, contiguous per server in server order
    by_addr = {h.address: h for h in c.hosts}
    for s in servers:
        h = by_addr[s["server_id"]]
        assert [int(d["device_id"]) for d in s["device"]] == list(h.devices)
        assert all(d["device_ip"] == h.device_ips[int(d["device_id"])] for d in s["device"])
    # every value is a string
    assert all(isinstance(v, str) for s in servers for d in s["device"] for v in d.values())
    # deterministic: same input, same bytes, also from a freshly built plan
    assert rank_table_v1(make_plan(c), ips) == text
    assert rank_table_legacy(plan, ips) == rank_table_legacy(make_plan(c), ips)
    assert hostfile(plan) == hostfile(make_plan(c))
    legacy = json.loads(rank_table_legacy(plan, ips))["group_list"][0]["instance_list"]
    assert [int(i["rank_id"]) for i in legacy] == ranks


def test_the_cluster_address_goes_everywhere_ranks_meet():
    """mpi_address (else ssh_config's HostName, else address): hostfile, rank table server_id,
    msrun's --master_addr, torchrun's --master-addr, the rank table's file name."""
    import dataclasses

    from orchestrator.launchers.ranktable import rank_table_filename
    from orchestrator.launchers.torchrun import torchrun_argv
    a = dataclasses.replace(host("node-a", range(8)), hostname="10.0.0.1", mpi_address="192.168.0.1")
    b = dataclasses.replace(host("node-b", range(8)), hostname="10.0.0.2")
    c = cluster(a, b)
    plan = make_plan(c)
    assert hostfile(plan).splitlines()[1:] == ["10.0.0.2 slots=8", "192.168.0.1 slots=8"]  # sorted by it
    c = cluster(a, b, launcher="ranktable", platform="ascend")
    plan = make_plan(c)
    table = json.loads(rank_table(c, plan, {h.name: {d: f"1.1.1.{d}" for d in range(8)} for h in plan.hosts}))
    assert [s["server_id"] for s in table["server_list"]] == ["10.0.0.2", "192.168.0.1"]
    assert rank_table_filename(plan).endswith("_10.0.0.2.json")
    c = cluster(a, b, launcher="msrun")
    assert "--master_addr=10.0.0.2" in msrun_argv(c, make_plan(c), "node-a")
    c = cluster(a, b, launcher="torchrun")
    assert "--master-addr=10.0.0.2" in torchrun_argv(c, make_plan(c), "node-a", ["x"])


def test_legacy_board_id_follows_the_hosts_arch():
    """MindSpore's generator writes board_id 0x002f on aarch64 (Kunpeng) hosts, 0x0000 elsewhere."""
    from orchestrator.prepare import parse_prepare
    c = cluster(host("10.0.0.1", [0, 1]), launcher="ranktable", platform="ascend", rank_table_version="legacy")
    plan = make_plan(c)
    ips = {"10.0.0.1": {0: "192.168.1.1", 1: "192.168.1.2"}}
    assert json.loads(rank_table(c, plan, ips))["board_id"] == "0x0000"
    assert json.loads(rank_table(c, plan, ips, aarch64=True))["board_id"] == "0x002f"
    assert parse_prepare("uid 0\narch aarch64\npy 3.11\n")["arch"] == "aarch64"


@pytest.mark.parametrize("exe, want", [("python", True), ("python3", True), ("/usr/bin/python3.11", True),
                                       ("/opt/py/bin/python3.12.1", True), ("pythonic.py", False),
                                       ("python3.", False), ("ipython", False), ("net.py", False)])
def test_is_python_is_one_rule_for_msrun_and_check(tmp_path, want, exe):
    """One rule decides "the command starts with a Python interpreter": msrun drops it, orch
    check's probe asks it for the job's package versions."""
    from orchestrator.probes import interpreter
    from orchestrator.interpreters import is_python
    from orchestrator.spec import Cluster, Job

    assert is_python(exe) is want
    assert (msrun_script([exe, "net.py"]) == ["net.py"]) is want
    c = Cluster(name="t", path=tmp_path / "c.yaml", hosts=(), job=Job(workdir="/w", command=(exe, "net.py")))
    assert interpreter(c) == (exe if want else "python3")


def test_is_root_one_rule():
    from orchestrator.logins import is_root

    assert is_root(uid=0) and not is_root(uid=1000) and not is_root(uid=1000, user="root")
    assert is_root(user="root") and not is_root(user="train") and not is_root()
