"""The OpenSSH client config: what an inventory address resolves to, and who wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.errors import SpecError
from orchestrator.runs import Run
from orchestrator.spec import Host, load_cluster
from orchestrator.transport.sshconfig import Hop, SshConfig, SshConfigError, expand, parse_hops

CONFIG = """\
Host bastion
  HostName 203.0.113.5
  User admin
  Port 2200
  IdentityFile {keys}/bastion_key

Host gpu-*
  HostName %h.cluster.internal
  User train
  Port 2222
  IdentityFile {keys}/missing_key
  IdentityFile {keys}/id_%r
  ProxyJump bastion
  ServerAliveInterval 7
  ConnectTimeout 4
  UserKnownHostsFile {keys}/known_%h

Host viaproxy
  HostName 10.9.9.9
  ProxyCommand nc -X connect %h %p %r %%

Include {keys}/more.conf
"""


def _cluster(tmp_path: Path, hosts: str, ssh: str = "config_file: ssh_config", extra_inventory: str = "") -> Path:
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    for name in ("bastion_key", "id_train", "id_ops", "inv_key"):
        (keys / name).write_text("not a real key\n")
    (keys / "more.conf").write_text("Host included\n  HostName 10.7.7.7\n  Port 2022\n")
    (tmp_path / "ssh_config").write_text(CONFIG.format(keys=keys))
    p = tmp_path / "cluster.yaml"
    p.write_text(f"inventory:\n  defaults: {{slots: 1{extra_inventory}}}\n  hosts:\n"
                 + textwrap.indent(textwrap.dedent(hosts), "    ")
                 + f"ssh: {{{ssh}}}\njob: {{workdir: /data/job, command: [\"true\"]}}\n")
    return p


def test_alias_resolves_through_ssh_config(tmp_path):
    c = load_cluster(_cluster(tmp_path, "- {address: gpu-3}\n"))
    h = c.hosts[0]
    keys = tmp_path / "keys"
    assert (h.name, h.address, h.hostname, h.user, h.port) == ("gpu-3", "gpu-3", "gpu-3.cluster.internal", "train",
                                                               2222)
    assert h.identity_file == str(keys / "id_train")   # the first IdentityFile that exists, %r expanded
    assert h.known_hosts == str(keys / "known_gpu-3.cluster.internal")
    assert (h.keepalive, h.connect_timeout) == (7.0, 4.0)
    assert h.cluster_address == "gpu-3.cluster.internal"
    [j] = h.jump
    assert (j.hostname, j.user, j.port, j.identity_file) == ("203.0.113.5", "admin", 2200, str(keys / "bastion_key"))
    assert h.route == "train@gpu-3.cluster.internal:2222 via admin@203.0.113.5:2200"


def test_cluster_yaml_wins_over_ssh_config(tmp_path):
    keys = tmp_path / "keys"
    c = load_cluster(_cluster(tmp_path, f"- {{address: gpu-3, user: ops, port: 22, identity_file: {keys}/inv_key, "
                                        "jump: 'root@10.0.0.1:2201'}\n",
                              ssh="config_file: ssh_config, connect_timeout: 9"))
    h = c.hosts[0]
    assert (h.user, h.port, h.identity_file) == ("ops", 22, str(keys / "inv_key"))
    assert h.hostname == "gpu-3.cluster.internal"     # what cluster.yaml does not say still comes from ssh_config
    assert h.connect_timeout is None                   # ssh.connect_timeout is set: ssh_config's 4 s does not apply
    [j] = h.jump
    assert (j.address, j.user, j.port) == ("10.0.0.1", "root", 2201)
    assert j.identity_file == str(keys / "inv_key")    # a hop without a key of its own uses the host's


def test_proxy_command_tokens_use_the_final_values(tmp_path):
    c = load_cluster(_cluster(tmp_path, "- {address: viaproxy, user: u1, port: 2022}\n"))
    assert c.hosts[0].proxy_command == "nc -X connect 10.9.9.9 2022 u1 %"
    assert c.hosts[0].route.endswith("via ProxyCommand nc -X connect 10.9.9.9 2022 u1 %")


def test_include_and_chains(tmp_path):
    c = load_cluster(_cluster(tmp_path, "- {address: included}\n- {address: 10.0.0.5, jump: [a@h1, 'h2:2', bastion]}\n"))
    inc, chained = c.hosts
    assert (inc.hostname, inc.port) == ("10.7.7.7", 2022)
    local = chained.jump[1].user  # no user given: the local login name, as ssh -J does
    assert [j.target for j in chained.jump] == ["a@h1", f"{local}@h2:2", "admin@203.0.113.5:2200"]
    assert local and local not in ("a", "admin")


def test_config_file_none_and_missing_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))   # no ~/.ssh/config there: nothing is read
    c = load_cluster(_cluster(tmp_path, "- {address: gpu-3}\n", ssh="retries: 1"))
    assert (c.hosts[0].hostname, c.hosts[0].port, c.hosts[0].jump, c.ssh.config_file) == (None, 22, (), None)
    c = load_cluster(_cluster(tmp_path, "- {address: gpu-3}\n", ssh="config_file: none"))
    assert c.hosts[0].hostname is None
    with pytest.raises(SpecError, match=r"cluster.yaml:\d+: ssh.config_file: ssh config file .*nope does not exist"):
        load_cluster(_cluster(tmp_path, "- {address: gpu-3}\n", ssh="config_file: nope"))


def test_bad_jump_is_located(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_cluster(_cluster(tmp_path, "- {address: 10.0.0.5, jump: 'a@b:99999'}\n"))
    assert "cluster.yaml:" in str(exc.value) and "hosts[0].jump" in str(exc.value)
    assert "port must be between 1 and 65535" in str(exc.value)


def test_run_record_keeps_the_route(tmp_path):
    """run.json round-trips a host losslessly, jump hosts included (status/down reach it the same way)."""
    h = load_cluster(_cluster(tmp_path, "- {address: gpu-3, mpi_address: 192.168.1.3}\n")).hosts[0]
    assert Host.from_dict(h.to_dict()) == h
    assert Run(tmp_path, "x", {"hosts": [h.to_dict()]}).hosts() == (h,)
    # Atlas A3 keys too, through JSON (whose keys are strings)
    a3 = load_cluster(_cluster(tmp_path, "- {address: a3-1, slots: 2, super_device_ids: {0: 37748736, 1: 37814273},"
                                         " super_pod_id: 0}\n")).hosts[0]
    assert (a3.super_device_ids, a3.super_pod_id) == ({0: 37748736, 1: 37814273}, 0)
    assert Host.from_dict(json.loads(json.dumps(a3.to_dict()))) == a3
    assert Run(tmp_path, "y", {"hosts": [a3.to_dict()]}).hosts() == (a3,)


def test_parse_hops_and_tokens():
    assert parse_hops("u@b:22, c ,ssh://x@[::1]:7", "w") == (Hop("b", "u", 22), Hop("c"), Hop("::1", "x", 7))
    assert parse_hops("none", "w") == ()
    for bad in ("a b", "u@", "h:0", ""):
        with pytest.raises(SshConfigError):
            parse_hops(bad, "w")
    assert expand("%h:%p:%r:%n:%%:%x", alias="a", hostname="h", port=2, user="u") == "h:2:u:a:%:%x"


def test_unparsable_config_names_the_file(tmp_path):
    p = tmp_path / "cfg"
    p.write_text("Host a\n  =broken\n")
    with pytest.raises(SshConfigError, match=str(p)):
        SshConfig(str(p), p.read_text())


def test_slurm_login_node_resolves_through_ssh_config(tmp_path):
    """inventory.slurm.login may be an alias too (a login node behind a bastion is the usual case);
    the nodes' port from defaults does not apply to it."""
    p = _cluster(tmp_path, "- {address: x}\n")
    p.write_text(p.read_text().replace("  defaults: {slots: 1}\n  hosts:\n    - {address: x}\n",
                                       "  defaults: {slots: 1, port: 2200}\n  slurm: {nodes: 2, login: gpu-login}\n"))
    s = load_cluster(p).slurm
    assert s.template.port == 2200
    lh = s.login_host
    assert (lh.hostname, lh.user, lh.port) == ("gpu-login.cluster.internal", "train", 2222)
    assert [j.hostname for j in lh.jump] == ["203.0.113.5"]


def test_include_inside_a_host_block_keeps_the_block(tmp_path):
    """What follows an Include inside `Host a` still belongs to `Host a` (as in OpenSSH)."""
    (tmp_path / "inc.conf").write_text("Host other\n  Port 2000\n")
    (tmp_path / "cfg").write_text(f"Host a\n  Include {tmp_path}/inc.conf\n  HostName 5.5.5.5\n")
    cfg = SshConfig.load(str(tmp_path / "cfg"))
    assert cfg.lookup("a").hostname == "5.5.5.5" and cfg.lookup("other").port == 2000


def test_bad_values_from_the_config_are_located(tmp_path):
    p = _cluster(tmp_path, "- {address: gpu-3}\n")
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gpu-3\n  Port 70000\n")
    with pytest.raises(SpecError, match=r"ssh_config: Port 70000 \(for host gpu-3\) is not between 1 and 65535"):
        load_cluster(p)
    cfg.write_text("Host gpu-3\n  User -oProxyCommand=x\n")
    with pytest.raises(SpecError, match="is not a login name"):
        load_cluster(p)
    cfg.write_text("Match exec \"test %h = x\"\n  Port 2\n")
    with pytest.raises(SpecError, match="cannot look up"):  # never a traceback
        load_cluster(p)


def test_mpi_address_is_one_hosts(tmp_path):
    with pytest.raises(SpecError, match="defaults.mpi_address: mpi_address is one host's address"):
        load_cluster(_cluster(tmp_path, "- {address: gpu-3}\n", extra_inventory=", mpi_address: 10.1.1.1"))
    with pytest.raises(SpecError, match=r"hosts\[0\].mpi_address: .* gives 2 hosts"):
        load_cluster(_cluster(tmp_path, "- {address: 'n[1-2]', mpi_address: 10.1.1.1}\n"))
    with pytest.raises(SpecError, match="is not a host name or IP address"):
        load_cluster(_cluster(tmp_path, "- {address: n1, mpi_address: -oProxyCommand=id}\n"))


def test_slurm_nodes_go_through_the_defaults_jump_host(tmp_path):
    from orchestrator.slurm import hosts_of
    p = _cluster(tmp_path, "- {address: x}\n")
    p.write_text(p.read_text().replace("  defaults: {slots: 1}\n  hosts:\n    - {address: x}\n",
                                       "  defaults: {slots: 1, jump: bastion}\n  slurm: {nodes: 2}\n"))
    s = load_cluster(p).slurm
    [node] = hosts_of(s, ("node1",), {})
    assert [j.hostname for j in node.jump] == ["203.0.113.5"]


def test_type_errors_name_the_field_without_pydantic_tags(tmp_path):
    p = _cluster(tmp_path, "- {address: x}\n")
    p.write_text(p.read_text().replace('command: ["true"]', "command: 5"))
    with pytest.raises(SpecError) as exc:
        load_cluster(p)
    assert "job.command:" in str(exc.value) and "job.command.str" not in str(exc.value)


def test_paramiko_comes_without_invoke_unless_a_config_has_match_exec():
    """paramiko imports invoke only to run `Match exec` commands: half its import time, at the
    start of every command that connects. It is loaded when a config has a Match exec."""
    code = ("import sys\n"
            "import orchestrator.transport.ssh\n"
            "print('invoke' in sys.modules)\n"
            "from orchestrator.transport.sshconfig import SshConfig\n"
            "SshConfig('/c', 'Host a\\n  Port 2\\n')\n"
            "print('invoke' in sys.modules)\n"
            "SshConfig('/c', 'Match exec \"true\"\\n  Port 2\\n')\n"
            "import paramiko.config\n"
            "print('invoke' in sys.modules, paramiko.config.invoke is sys.modules.get('invoke'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}).stdout
    assert out.split("\n") == ["False", "False", "True True", ""]
