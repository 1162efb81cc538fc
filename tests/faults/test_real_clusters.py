"""A cluster as real ones are: three hosts reachable only through a bastion, sshd on port 2222,
an ordinary user (`train`), named only by aliases in an ssh_config with ProxyJump."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support import budget, orch, run_ids, runs_dir, timed

pytestmark = pytest.mark.lab

PORT, USER, UID = 2222, "train", 4300
PRINT = 'echo "$(hostname) $(id -un) rank=${RANK:-$OMPI_COMM_WORLD_RANK} if=$NCCL_SOCKET_IFNAME,$GLOO_SOCKET_IFNAME"'


@pytest.fixture(scope="module")
def rc(fx_lab):
    return fx_lab("j", 3, bastion=True, ssh_port=PORT, user=USER)


def _write(rc, tmp_path: Path, *, ssh_config: Path | None = None, name: str = "cluster.yaml",
           inventory=None, **job) -> Path:
    """A cluster.yaml naming the hosts only by their aliases in `ssh_config` (the lab's)."""
    doc = {
        "inventory": inventory or {"defaults": {"slots": 2}, "hosts": [{"address": f"{rc.name}-h[1-3]"}]},
        "ssh": {"config_file": str(ssh_config or rc.ssh_config_path), "connect_timeout": 5, "retries": 2},
        "job": {"workdir": "/data/rc", "command": ["sh", "-c", PRINT], **job},
    }
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _bastion_logins(rc) -> int:
    try:
        return rc.bastion_sshd_log.read_text(errors="replace").count("Accepted publickey")
    except FileNotFoundError:
        return 0


def _latest(tmp_path: Path) -> dict:
    return json.loads((runs_dir(tmp_path) / run_ids(tmp_path)[-1] / "run.json").read_text())


def test_the_controller_cannot_reach_the_hosts_directly(rc):
    """The topology is what it claims: only the bastion is reachable from here."""
    import socket

    for i in (1, 2, 3):
        with pytest.raises(OSError):
            socket.create_connection((rc.host(i).address, PORT), timeout=1).close()
    socket.create_connection((rc.bastion.address, PORT), timeout=5).close()


def test_check_through_the_bastion_by_alias(rc, tmp_path):
    """`orch check` on aliases only ssh_config knows: every check passes (mesh included, with
    mpirun's own `ssh -p 2222`), each host's route is shown, and the bastion saw ONE login."""
    _write(rc, tmp_path, launcher="mpirun")
    before = _bastion_logins(rc)
    res = orch("check", cwd=tmp_path, check_rc=0)
    out = res.stdout.decode()
    for i in (1, 2, 3):
        assert f"route {rc.name}-h{i}: {USER}@{rc.host(i).address}:{PORT} via {USER}@{rc.bastion.address}:{PORT}" \
            in out, out
    assert _bastion_logins(rc) - before == 1
    doc = json.loads(orch("check", "--json", cwd=tmp_path, check_rc=0).stdout)
    mesh = [r for r in doc["results"] if r["check"] == "mesh"]
    assert [r["status"] for r in mesh] == ["pass"], mesh


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_up_and_logs_as_an_ordinary_user_through_the_bastion(rc, tmp_path, launcher):
    """`orch up` and `orch logs --rank N` by alias through the bastion: every rank runs as
    `train` on its host, with `job.interface: auto` exported (the lab's eth0); mpirun gets the
    port (plm_rsh_args) and the mesh test's connections to share, and no --allow-run-as-root; the
    workdir and logs belong to train."""
    workdir = f"/data/rc-{launcher}"
    _write(rc, tmp_path, launcher=launcher, workdir=workdir, interface="auto")
    before = _bastion_logins(rc)
    orch("up", "-q", cwd=tmp_path, check_rc=0, timeout=120)
    assert _bastion_logins(rc) - before == 1, "one connection to the bastion per invocation"
    for rank in range(6):
        out = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode()
        host = rc.host(1 + rank // 2).name
        assert out == f"{host} {USER} rank={rank} if=eth0,eth0\n", (rank, out)
    rec = _latest(tmp_path)
    if launcher == "mpirun":
        [cmd] = [c["command"] for cs in rec["commands"].values() for c in cs]
        # the port, and the connection the preflight's mesh test opened, in train's own directory
        assert "--allow-run-as-root" not in cmd and f"plm_rsh_args '-p {PORT} -o ControlPath=/tmp/orch-ssh-{UID}/" in cmd, cmd
        assert "--bind-to none" in cmd and "btl_tcp_if_include eth0" in cmd, cmd
    for i in (1, 2, 3):
        owners = rc.exec(i, ["sh", "-c", f"stat -c %u {workdir} {workdir}/.orch/*/a1 {workdir}/log_output/"]).stdout
        assert set(owners.split()) == {str(UID)}, owners


def test_proxy_command(rc, tmp_path):
    """ssh_config's ProxyCommand (here OpenSSH's own `ssh -W %h:%p` through the bastion), with
    tokens expanded to the host's real address and port."""
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host {rc.name}-h*\n    ProxyCommand ssh -F {rc.ssh_config_path} -W %h:%p {rc.name}-bastion\n\n"
                   + rc.ssh_config_path.read_text().replace(f"    ProxyJump {rc.name}-bastion\n", ""))
    _write(rc, tmp_path, ssh_config=cfg, launcher="ranktable")
    out = orch("check", cwd=tmp_path, check_rc=0).stdout.decode()
    assert f"route {rc.name}-h2: {USER}@{rc.host(2).address}:{PORT} via ProxyCommand ssh -F {rc.ssh_config_path} " \
           f"-W {rc.host(2).address}:{PORT} {rc.name}-bastion" in out, out


def test_inventory_jump_without_ssh_config(rc, tmp_path):
    """The lab's own inventory says `jump:` in its defaults (no ssh_config read at all)."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"inventory": str(rc.inventory_path), "ssh": {"config_file": "none"},
                                    "job": {"workdir": "/data/rc-inv", "command": ["sh", "-c", PRINT],
                                            "launcher": "ranktable"}}))
    orch("up", "-q", cwd=tmp_path, check_rc=0, timeout=120)
    assert orch("logs", "--rank", 3, cwd=tmp_path, check_rc=0).stdout.decode().startswith(f"{rc.host(2).name} {USER}")


def test_msrun_trains_mindspore_as_train_through_the_bastion(rc, tmp_path):
    """The MindSpore playbook (msrun, 3 hosts x 2 workers) by alias through the bastion, as
    user train: every rank trains and ends with the same weights."""
    venv = Path(os.environ.get("ORCH_TRAIN_VENV", "/opt/orch-venvs/train"))
    if not (venv / "bin" / "msrun").exists():
        pytest.fail(f"msrun not in {venv}/bin: run `bash scripts/install-e2e-deps.sh` (scripts/test.sh does)")
    src = Path(__file__).resolve().parents[2] / "playbooks" / "mindspore-msrun"
    job = yaml.safe_load((src / "cluster.yaml").read_text())["job"]
    job["sync"] = [str(src / s) for s in job["sync"]]
    job["env"]["EPOCHS"] = "1"
    job["workdir"] = "/data/rc-msrun"
    _write(rc, tmp_path, **job)
    orch("up", "-q", cwd=tmp_path, timeout=400, check_rc=0)
    sums = set()
    for rank in range(6):
        out = orch("logs", "--rank", rank, cwd=tmp_path, check_rc=0).stdout.decode()
        m = re.search(rf"^rank {rank}/6 on (\S+): weights checksum ([0-9a-f]{{16}})$", out, re.M)
        assert m and m.group(1) == rc.host(1 + rank // 2).name, out[-2000:]
        sums.add(m.group(2))
    assert len(sums) == 1


def _keygen(path: Path, passphrase: str = "") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", str(path)], check=True,
                   capture_output=True)
    return path


def test_a_key_the_bastion_refuses_names_the_bastion(rc, tmp_path):
    """The bastion refuses the key ssh_config gives it: every host fails naming the bastion (the
    hop that failed), and the bastion is asked once, not once per host."""
    other = _keygen(tmp_path / "other_key")
    text = rc.ssh_config_path.read_text()
    head, sep, rest = text.partition(f"Host {rc.name}-bastion\n")
    block, sep2, tail = rest.partition("\n\n")
    block = re.sub(r"IdentityFile \S+", f"IdentityFile {other}", block)
    cfg = tmp_path / "ssh_config"
    cfg.write_text(head + sep + block + sep2 + tail)
    _write(rc, tmp_path, ssh_config=cfg)
    log_before = rc.bastion_sshd_log.read_text(errors="replace")
    res = orch("check", "--json", cwd=tmp_path, check_rc=1)
    doc = json.loads(res.stdout)
    ssh = {r["host"]: r for r in doc["results"] if r["check"] == "ssh"}
    assert set(ssh) == {f"{rc.name}-h{i}" for i in (1, 2, 3)}
    for r in ssh.values():
        assert r["status"] == "fail"
        assert f"jump host {USER}@{rc.bastion.address}:{PORT}" in r["message"] and "refused" in r["message"], r
    log = rc.bastion_sshd_log.read_text(errors="replace")[len(log_before):]
    assert log.count("Connection from ") == 1, log  # one try, for all three hosts


def test_an_encrypted_key_without_agent_fails_clearly_and_fast(rc, tmp_path):
    """identity_file protected by a passphrase, no agent: one clear error per host, no prompt,
    no wait for time-outs: no slower than a check that logs in with the lab's own key."""
    key = _keygen(tmp_path / "enc_key", passphrase="secret words")
    inv = yaml.safe_load(rc.inventory_path.read_text())
    _write(rc, tmp_path, inventory=inv)
    _, healthy = timed(orch, "check", "--json", cwd=tmp_path, env={"SSH_AUTH_SOCK": ""})  # the lab's own key
    inv["defaults"]["identity_file"] = str(key)
    _write(rc, tmp_path, inventory=inv)
    res, took = timed(orch, "check", "--json", cwd=tmp_path, check_rc=1, env={"SSH_AUTH_SOCK": ""})
    ssh = [r for r in json.loads(res.stdout)["results"] if r["check"] == "ssh"]
    assert ssh and all("protected by a passphrase and orch never prompts" in r["message"] for r in ssh), ssh
    assert took < budget(healthy, 0), f"{took:.1f}s, {healthy:.1f}s with the lab's key"


def test_a_missing_interface_fails_check_on_that_host(rc, tmp_path):
    """job.interface names a NIC only host 1 has: check fails hosts 2 and 3 (not 1); up refuses
    to start anything, even with --skip-checks; once it is down on host 1, host 1 fails too."""
    rc.exec(1, ["sh", "-c", "ip link add orchx0 type veth peer name orchx1 && ip addr add 10.99.0.1/24 dev orchx0 "
                            "&& ip link set orchx1 up && ip link set orchx0 up"])
    try:
        _write(rc, tmp_path, interface="orchx0", launcher="ranktable")
        doc = json.loads(orch("check", "--json", cwd=tmp_path, check_rc=1).stdout)
        nic = {(r["host"], r["status"]) for r in doc["results"] if r["check"] == "nic" and "orchx0" in r["message"]}
        assert nic == {(f"{rc.name}-h1", "pass"), (f"{rc.name}-h2", "fail"), (f"{rc.name}-h3", "fail")}, doc
        res = orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=3)  # 3: nothing was started
        err = res.stderr.decode()
        assert "nothing was started" in err and f"{rc.name}-h2: job.interface orchx0" in err, err
        rc.exec(1, ["ip", "link", "set", "orchx0", "down"])
        doc = json.loads(orch("check", "--json", cwd=tmp_path, check_rc=1).stdout)
        assert [r["status"] for r in doc["results"] if r["check"] == "nic" and r["host"] == f"{rc.name}-h1"
                and "orchx0" in r["message"]] == ["fail"], doc
    finally:
        rc.exec(1, ["ip", "link", "del", "orchx0"])


def test_host_keys_through_the_bastion(rc, tmp_path):
    """The same host-key policy on every hop: `strict` with an empty known_hosts refuses the
    bastion (named) and so every host behind it; `accept-new` records the bastion and the hosts
    in OpenSSH's `[host]:port` form, and the next `strict` run accepts them."""
    known = tmp_path / "known_hosts"
    known.write_text("")
    inv = yaml.safe_load(rc.inventory_path.read_text())
    inv["defaults"]["known_hosts"] = str(known)
    path = _write(rc, tmp_path, inventory=inv)
    doc = json.loads(orch("check", "--json", cwd=tmp_path, check_rc=1).stdout)
    ssh = [r for r in doc["results"] if r["check"] == "ssh"]
    assert len(ssh) == 3 and all(f"jump host {USER}@{rc.bastion.address}:{PORT}: host key of "
                                 f"[{rc.bastion.address}]:{PORT} is not in" in r["message"] for r in ssh), ssh
    doc = yaml.safe_load(path.read_text())
    doc["ssh"]["host_key_policy"] = "accept-new"
    path.write_text(yaml.safe_dump(doc))
    orch("check", cwd=tmp_path, check_rc=0)
    names = sorted(line.split()[0] for line in known.read_text().splitlines())
    assert names == sorted(f"[{a}]:{PORT}" for a in [rc.bastion.address] + [rc.host(i).address for i in (1, 2, 3)])
    doc["ssh"]["host_key_policy"] = "strict"
    path.write_text(yaml.safe_dump(doc))
    orch("check", cwd=tmp_path, check_rc=0)
