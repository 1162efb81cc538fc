"""The lab's pure parts (orchestrator/lab/: model, render, access, versions, slurm): the text of a
host's files, the inventory and ssh configs, --vary parsing and shims. No lab, no root."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from orchestrator.errors import LabError
from orchestrator.lab import access, render, slurm, versions
from orchestrator.lab.model import (USER_ID, HostPlan, LabHost, subnet_octet, validate_name, validate_port,
                                    validate_user)

H1 = LabHost(1, "t1-h1", "198.18.7.11", "olab-t1-1", "olt1-1")
H2 = LabHost(2, "t1-h2", "198.18.7.12", "olab-t1-2", "olt1-2")
BASTION = LabHost(0, "t1-bastion", "198.18.9.10", "olab-t1-0", "olt1-0")


# --------------------------------------------------------------------------- model


def test_names_ports_and_users_are_checked():
    assert validate_name("t1") == "t1"
    for bad in ("", "T1", "toolongname", "a-b", 3):
        with pytest.raises(LabError, match="bad lab name"):
            validate_name(bad)
    assert validate_port(2222) == 2222
    for bad in (0, 65536, True, "22"):
        with pytest.raises(LabError, match="bad ssh port"):
            validate_port(bad)
    assert validate_user("train") == "train"
    for bad in ("Train", "1x", "a b", ""):
        with pytest.raises(LabError, match="bad lab user name"):
            validate_user(bad)


def test_subnet_octet_is_stable_and_in_range():
    octets = {subnet_octet(f"l{i}") for i in range(500)}
    assert octets <= set(range(1, 251)) and len(octets) > 100
    assert subnet_octet("t1") == subnet_octet("t1") != subnet_octet("t1b")


# --------------------------------------------------------------------------- render: a host's files


def test_hccn_conf_one_address_per_device_and_host():
    text = render.hccn_conf(3, devices=2)
    assert text == ("address_0=192.168.100.13\nnetmask_0=255.255.255.0\n"
                    "address_1=192.168.101.13\nnetmask_1=255.255.255.0\n")
    assert render.hccn_conf(1).count("address_") == 8


def test_etc_hosts_adds_every_host_and_the_bastion_back_address():
    text = render.etc_hosts("127.0.0.1 localhost\n\n", "t1", [H1, H2])
    assert text == "127.0.0.1 localhost\n# orch lab t1\n198.18.7.11 t1-h1\n198.18.7.12 t1-h2\n"
    assert render.etc_hosts("", "t1", [H1], ("198.18.7.10", "t1-bastion")).endswith(
        "198.18.7.11 t1-h1\n198.18.7.10 t1-bastion\n")


def test_bashrc_returns_early_for_non_interactive_shells(tmp_path):
    text = render.bashrc("SEEN=machine\n")
    assert text.splitlines()[-1] == "SEEN=machine"
    (tmp_path / "bashrc").write_text(text)
    for flags, seen in (([], ""), (["-i"], "machine")):
        res = subprocess.run(["bash", "--norc", *flags, "-c", f'. {tmp_path / "bashrc"}; echo "seen=$SEEN"'],
                             capture_output=True, text=True, timeout=10)
        assert res.stdout.splitlines()[-1] == f"seen={seen}", (flags, res.stdout, res.stderr)


def test_host_path_env_is_the_shims_then_a_real_hosts_standard_path():
    """No directory of the controller's python (its venv, pyenv) on a host's PATH."""
    std = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    assert render.host_path_env(False, False) == f"PATH=/opt/orch-lab/bin:{std}\n"
    assert render.host_path_env(True, True).splitlines() == [
        f"PATH=/opt/orch-lab/bin:{std}", "PYTHONPATH=/opt/orch-lab/site", "LD_LIBRARY_PATH=/opt/orch-lab/lib"]
    assert render.path_dirs() == ["/opt/orch-lab/bin", *std.split(":")]


def test_sshd_config_listens_on_the_host_address_and_port():
    lines = render.sshd_config(H1, Path("/lab/h1"), 2222, "10:30:100").splitlines()
    for line in ("ListenAddress 198.18.7.11", "Port 2222", "HostKey /lab/h1/ssh_host_ed25519_key",
                 "PidFile /lab/h1/sshd.pid", "PermitRootLogin prohibit-password", "PasswordAuthentication no",
                 "PermitUserEnvironment yes", "MaxStartups 10:30:100", "LogLevel VERBOSE"):
        assert line in lines
    assert "Port 22" in render.sshd_config(H1, Path("/x")).splitlines()
    both = render.sshd_config(H1, Path("/x"), also=["198.18.9.11"]).splitlines()  # a dual-homed head
    assert [ln for ln in both if ln.startswith("ListenAddress")] == ["ListenAddress 198.18.7.11",
                                                                      "ListenAddress 198.18.9.11"]


def test_passwd_and_group_get_the_lab_user_and_refuse_a_clash():
    base = "root:x:0:0:root:/root:/bin/bash\n"
    assert render.passwd_with_user(base, "train", "/home/train", "/bin/bash") == (
        base + f"train:*:{USER_ID}:{USER_ID}:orch lab user:/home/train:/bin/bash\n")
    assert render.group_with_user("root:x:0:\n", "train") == f"root:x:0:\ntrain:x:{USER_ID}:\n"
    with pytest.raises(LabError, match="already has 'root'"):
        render.passwd_with_user(base, "root", "/home/root", "/bin/sh")
    with pytest.raises(LabError, match=f"already has 'other' \\(gid {USER_ID}\\)"):
        render.group_with_user(f"other:x:{USER_ID}:\n", "train")


def test_init_script_is_a_python_pid1_that_reaps():
    text = render.init_script("/usr/bin/python3")
    assert text.startswith("#!/usr/bin/python3 -IS\n")
    assert "os.waitpid(-1, os.WNOHANG)" in text
    compile(text, "orch-lab-init", "exec")


def _setup(tmp: Path, **kw) -> tuple[str, HostPlan]:
    p = HostPlan(H1, tmp / "h 1", **{k: kw.pop(k) for k in ("versions", "back_address") if k in kw})
    return render.setup_script(p, state_dir=tmp, init_path=tmp / "orch-lab-init", **kw), p


def test_setup_script_mounts_the_host_and_execs_the_init():
    text, p = _setup(Path("/lab"))
    lines = text.splitlines()
    assert lines[0] == "set -e" and lines[-2:] == ["echo ready", "exec /lab/orch-lab-init </dev/null"]
    assert "ip addr add 198.18.7.11/24 dev eth0" in lines
    assert "echo t1-h1 > /proc/sys/kernel/hostname" in lines
    for target in ("/data", "/etc/hccn.conf", "/etc/hosts", "/opt/orch-lab", "/root/.ssh", "/tmp"):
        assert any(line.startswith("mount --bind ") and line.endswith(" " + target) for line in lines), target
    assert f"mount --bind {shlex.quote(str(p.dir / 'data'))} /data" in lines  # a path with a space, quoted
    # root lab: no user, no bastion NIC, nothing hidden
    assert "/etc/passwd" not in text and "eth1" not in text and "orch-lab-hide" not in text
    assert all(shlex.split(line) for line in lines if not line.startswith("#"))


def test_setup_script_user_bastion_and_hidden_tools():
    text, _ = _setup(Path("/lab"), user="train", back_address="198.18.9.10")
    assert "mount --bind /lab/passwd /etc/passwd" in text and "mkdir -p /home/train" in text
    assert "ip addr add 198.18.9.10/24 dev eth1" in text and "echo 0 > /proc/sys/net/ipv4/ip_forward" in text
    hide = {"/usr/bin": ["mpirun", "orted"], "/root/.pyenv/bin": ["mpicc"]}
    text, _ = _setup(Path("/lab"), versions={"openmpi": "none"}, hide_exes=hide,
                     hide_dists=[Path("/root/site/torch-2.0.dist-info")])
    lines = text.splitlines()
    assert "rm -f /usr/bin/mpirun /usr/bin/orted" in lines and "rm -f /root/.pyenv/bin/mpicc" in lines
    assert sum("orch-lab-hide" in line for line in lines) == 1  # /root is an overlay already
    assert "rm -rf /root/site/torch-2.0.dist-info" in lines
    text, _ = _setup(Path("/lab"), versions={"openmpi": "4.0.3"}, hide_exes=hide)
    assert "rm -f" not in text  # only openmpi=none hides


# --------------------------------------------------------------------------- access: reaching the lab


def test_yaml_str_quotes_only_what_would_not_read_back():
    for value in ("root", "train", "/a/b.c", "yes", "on", "null", "1", "a b", "x:y", "~"):
        assert yaml.safe_load(f"k: {access.yaml_str(value)}") == {"k": value}, value
    assert access.yaml_str("train") == "train" and access.yaml_str("yes") == '"yes"'


def test_inventory_yaml_reads_back_with_jump_user_and_port():
    text = access.inventory_yaml("t1", "198.18.7.0/24", [H1, H2], Path("/lab/id_ed25519"), Path("/lab/known_hosts"),
                                 user="yes", port=2222, jump="yes@198.18.9.10:2222")
    inv = yaml.safe_load(text)
    assert inv["defaults"] == {"user": "yes", "port": 2222, "identity_file": "/lab/id_ed25519",
                               "known_hosts": "/lab/known_hosts", "slots": 2, "jump": "yes@198.18.9.10:2222"}
    assert inv["hosts"] == [{"address": "198.18.7.11", "name": "t1-h1"}, {"address": "198.18.7.12", "name": "t1-h2"}]
    plain = yaml.safe_load(access.inventory_yaml("t1", "s", [H1], Path("/k"), Path("/kh")))
    assert plain["defaults"]["user"] == "root" and plain["defaults"]["port"] == 22 and "jump" not in plain["defaults"]


def test_inventory_of_a_dual_homed_head_jumps_to_host_1_for_the_others_only():
    """Host 1 by the address this machine reaches it by, no jump, no mpi_address; the others
    through it."""
    head = LabHost(1, "t1-h1", "198.18.9.11", "olab-t1-1", "olt1-1")
    text = access.inventory_yaml("t1", "198.18.7.0/24", [head, H2], Path("/k"), Path("/kh"), user="train",
                                 port=2222, jump="train@198.18.9.11:2222", head_jump=True)
    inv = yaml.safe_load(text)
    assert "jump" not in inv["defaults"] and inv["defaults"]["user"] == "train"
    assert inv["hosts"] == [{"address": "198.18.9.11", "name": "t1-h1"},
                            {"address": "198.18.7.12", "name": "t1-h2", "jump": "train@198.18.9.11:2222"}]
    assert "mpi_address" not in text.split("defaults:")[1]
    assert "198.18.9.0/24" in text  # the header says which network host 1 is listed on


def test_known_hosts_bracket_a_port_other_than_22():
    entries = [(["198.18.7.11", "t1-h1"], "ssh-ed25519 AAAA")]
    assert access.known_hosts_text(entries, 22) == "198.18.7.11,t1-h1 ssh-ed25519 AAAA\n"
    assert access.known_hosts_text(entries, 2222) == "[198.18.7.11]:2222,[t1-h1]:2222 ssh-ed25519 AAAA\n"
    assert access.known_hosts_text(entries, 2222, both=True) == (
        "[198.18.7.11]:2222,[t1-h1]:2222,198.18.7.11,t1-h1 ssh-ed25519 AAAA\n")


def test_ssh_client_config_names_every_host_with_proxyjump_behind_a_bastion():
    text = access.ssh_client_config("t1", [H1, H2], BASTION, user="train", port=2222, key=Path("/my lab/key"),
                                    known_hosts=Path("/lab/kh"), state_dir=Path("/lab"))
    blocks = text.split("\n\n")
    assert blocks[1].splitlines()[:2] == ["Host t1-bastion", "    HostName 198.18.9.10"]
    assert "ProxyJump" not in blocks[1]
    for block, h in zip(blocks[2:], (H1, H2)):
        assert f"Host {h.name}\n    HostName {h.address}\n    User train\n    Port 2222\n" in block
        assert '    IdentityFile "/my lab/key"' in block and block.rstrip().endswith("ProxyJump t1-bastion")
    assert "ProxyJump" not in access.ssh_client_config("t1", [H1], None, user="root", port=22, key=Path("/k"),
                                                       known_hosts=Path("/kh"), state_dir=Path("/lab"))


def test_ssh_client_config_of_a_dual_homed_head_jumps_through_host_1():
    text = access.ssh_client_config("t1", [H1, H2], None, user="root", port=22, key=Path("/k"),
                                    known_hosts=Path("/kh"), state_dir=Path("/lab"), head_jump=True)
    blocks = text.split("\n\n")
    assert blocks[1].startswith("Host t1-h1\n") and "ProxyJump" not in blocks[1]
    assert blocks[2].startswith("Host t1-h2\n") and blocks[2].rstrip().endswith("ProxyJump t1-h1")


def test_network_of_a_dual_homed_head_gives_host_1_two_nics_the_others_one():
    from orchestrator.lab import network

    head = LabHost(1, "t1-h1", "198.18.9.11", "olab-t1-1", "olt1-1")
    jump = {"index": 1, "netns": "olab-t1-1", "veth": "olt1-1", "back_veth": "olt1-1b", "bridge": "ol-bh-t1",
            "subnet": "198.18.7.0/24"}
    lines = network.up_batch("ol-br-t1", 9, [head, H2], jump, v6=True)
    assert "addr add 198.18.9.1/24 dev ol-br-t1" in lines and "route add unreachable 198.18.7.0/24" in lines
    assert lines.count("netns add olab-t1-1") == 1 and "netns add olab-t1-2" in lines
    assert "link set olt1-1 master ol-br-t1 up" in lines and "link set olt1-1b master ol-bh-t1 up" in lines
    assert "link add olt1-1b type veth peer name eth1 netns olab-t1-1" in lines
    assert "link set olt1-2 master ol-bh-t1 up" in lines and not any("olt1-2 master ol-br" in x for x in lines)
    # this machine has no IPv6 link-local address on the hosts' network either
    assert {"link set ol-bh-t1 addrgenmode none", "link set olt1-1b addrgenmode none",
            "link set olt1-2 addrgenmode none"} <= set(lines)


def test_ssh_argv_goes_through_the_bastion_as_the_same_user():
    argv = access.ssh_argv("198.18.7.11", key=Path("/lab/key"), known_hosts=Path("/lab/kh"), port=2222,
                           user="train", command="hostname", connect_timeout=3)
    assert argv[:3] == ["ssh", "-F", "/dev/null"] and argv[-2:] == ["train@198.18.7.11", "hostname"]
    assert "-p" in argv and argv[argv.index("-p") + 1] == "2222" and "ConnectTimeout=3" in argv
    assert not any(a.startswith("ProxyCommand=") for a in argv)
    argv = access.ssh_argv("198.18.7.11", key=Path("/lab/key"), known_hosts=Path("/lab/kh"), port=22,
                           bastion="198.18.9.10")
    proxy = [a for a in argv if a.startswith("ProxyCommand=")]
    assert len(proxy) == 1 and argv[-1] == "root@198.18.7.11"
    jump = shlex.split(proxy[0].split("=", 1)[1])
    assert jump[-3:] == ["-W", "[%h]:%p", "root@198.18.9.10"]


# --------------------------------------------------------------------------- versions (--vary)


def test_parse_vary_lists_and_mappings():
    assert versions.parse_vary(["2:openmpi=4.0.3", "*:MindSpore=2.10.0", " 1 : nccl = 2.18.1 "]) == {
        2: {"openmpi": "4.0.3"}, "*": {"mindspore": "2.10.0"}, 1: {"nccl": "2.18.1"}}
    assert versions.parse_vary({"all": {"torch": 2.1}, "3": {"python": "3.8.10"}}) == {
        "*": {"torch": "2.1"}, 3: {"python": "3.8.10"}}
    assert versions.parse_vary(None) == {} and versions.parse_vary([]) == {}
    for bad, match in ((["openmpi=4.0.3"], "I:TOOL=VERSION"), (["1:python=none"], "python=none"),
                       (["1:x=4 0"], "bad --vary value"), ({"one": {"x": "1"}}, "host index"),
                       ({1: {"-x": "1"}}, "bad tool name"), ({1: {"x": "!"}}, "bad version")):
        with pytest.raises(LabError, match=match):
            versions.parse_vary(bad)


def test_a_hosts_own_versions_win_over_every_hosts():
    vary = {"*": {"openmpi": "4.1.5", "torch": "2.1"}, 2: {"openmpi": "none"}}
    assert versions.host_versions(vary, 2) == {"openmpi": "none", "torch": "2.1"}
    assert versions.host_versions(vary, 1) == {"openmpi": "4.1.5", "torch": "2.1"}
    assert versions.host_versions({}, 1) == {}


def _run_shim(tmp_path: Path, text: str, *args: str) -> str:
    shim = tmp_path / "shim"
    shim.write_text(text)
    return subprocess.run(["bash", str(shim), *args], capture_output=True, text=True, timeout=10).stdout


def test_shims_report_the_version_and_run_the_real_tool(tmp_path):
    real = tmp_path / "real tool"
    real.write_text('#!/bin/sh\necho "mpirun (Open MPI) 4.1.2"\necho "args: $*"\n')
    real.chmod(0o755)
    assert _run_shim(tmp_path, versions.python_shim("3.7.1", str(real)), "--version") == "Python 3.7.1\n"
    assert _run_shim(tmp_path, versions.python_shim("3.7.1", str(real)), "-c", "x") == (
        "mpirun (Open MPI) 4.1.2\nargs: -c x\n")
    assert _run_shim(tmp_path, versions.mpirun_shim(str(real), "4.1.2", "4.0.3"), "--version") == (
        "mpirun (Open MPI) 4.0.3\nargs: --version\n")
    assert _run_shim(tmp_path, versions.ompi_info_shim(str(real), "4.1.2", "5.0.0"), "-a") == (
        "mpirun (Open MPI) 5.0.0\nargs: -a\n")


def test_dist_metadata_names_the_distribution():
    assert versions.dist_metadata("torch", "2.1.0").splitlines()[1:3] == ["Name: torch", "Version: 2.1.0"]
    assert versions.dist_key("Foo.Bar-baz") == "Foo_Bar_baz"


# --------------------------------------------------------------------------- slurm


def test_slurm_conf_one_node_per_host_and_a_port_per_lab():
    text = slurm.slurm_conf("t1", 7, "198.18.7.1", [H1, H2], Path("/lab/slurm"), "box")
    lines = text.splitlines()
    assert "SlurmctldHost=box(198.18.7.1)" in lines and f"SlurmctldPort={slurm.CTLD_PORT_BASE + 7}" in lines
    assert "AuthInfo=socket=/lab/slurm/munge.sock" in lines
    assert [x for x in lines if x.startswith("NodeName=")] == [
        f"NodeName=t1-h1 NodeAddr=198.18.7.11 CPUs={slurm.NODE_CPUS} State=UNKNOWN",
        f"NodeName=t1-h2 NodeAddr=198.18.7.12 CPUs={slurm.NODE_CPUS} State=UNKNOWN"]
    assert lines[-1] == f"PartitionName={slurm.PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP"


def test_slurm_inventory_reads_back():
    inv = yaml.safe_load(slurm.inventory_yaml("t1", 2, Path("/lab/slurm/slurm.conf"), Path("/lab/key"),
                                              Path("/lab/kh"), 2))
    assert inv["slurm"] == {"nodes": 2, "partition": slurm.PARTITION, "conf": "/lab/slurm/slurm.conf"}
    assert inv["defaults"] == {"user": "root", "identity_file": "/lab/key", "known_hosts": "/lab/kh", "slots": 2}


def test_hosts_run_the_system_python3_never_the_controllers(tmp_path, monkeypatch):
    """The hosts' python3 is the first on a real host's standard PATH (render.SBIN_PATH), whatever
    python runs orch (a venv, pyenv) and whatever PATH orch runs with; none there is an error
    naming the package."""
    import os
    import shutil
    import sys

    from orchestrator.lab import system

    expect = shutil.which("python3", path=render.SBIN_PATH)
    if expect is None:
        pytest.skip("this machine has no system python3")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python3").symlink_to(os.path.realpath(sys.executable))
    monkeypatch.setattr(sys, "executable", str(venv / "python3"))
    monkeypatch.setenv("PATH", f"{venv}:{os.environ.get('PATH', '')}")
    assert system.host_python() == expect
    assert os.path.dirname(expect) in render.SBIN_PATH.split(":")

    monkeypatch.setattr(system, "SBIN_PATH", str(tmp_path / "nothing-here"))
    with pytest.raises(LabError) as e:
        system.host_python()
    assert "system python3" in e.value.message and "apt-get install python3" in e.value.hint


def test_lab_files_are_written_atomically_at_their_mode(tmp_path, monkeypatch):
    """A lab's private key is never, even for a moment, at the umask's mode under its name: it
    is written to a random 0600 temporary file, given its mode, then renamed."""
    import os

    from orchestrator.lab.system import write

    seen: list[tuple[str, int]] = []  # every file there, and its mode, whenever a mode is set
    chmod = os.chmod

    def spy(path, mode, *a, **kw):
        seen.extend((p.name, p.stat().st_mode & 0o777) for p in tmp_path.iterdir())
        return chmod(path, mode, *a, **kw)

    monkeypatch.setattr(os, "chmod", spy)
    old = os.umask(0)
    try:
        key = tmp_path / "id_ed25519"
        write(key, "secret\n", 0o600)
        write(key, "secret again\n", 0o600)
    finally:
        os.umask(old)
    assert key.read_text() == "secret again\n" and key.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["id_ed25519"]
    assert seen and all(mode == 0o600 for _, mode in seen), seen
