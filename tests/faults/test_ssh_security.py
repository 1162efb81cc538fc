"""Scenarios 3-4: refused keys and host keys, as a user sees them through the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import orch, run_ids, sshd_lines, write_fault_cluster

pytestmark = pytest.mark.lab


@pytest.fixture(scope="module")
def sec(fx_lab):
    """3 hosts; host 2 does not accept the lab's key."""
    return fx_lab("s", 3, refuse_key=[2])


def _controller(lab) -> str:
    return lab.subnet.rsplit(".", 1)[0] + ".1"


def _auth_failures(lab, i: int) -> int:
    """Failed public-key logins on host i coming from this machine (not from the other hosts' mesh check)."""
    ctl = _controller(lab)
    return sum(1 for ln in sshd_lines(lab, i) if "Failed publickey" in ln and f"from {ctl} " in ln)


def _out(res) -> str:
    return res.stdout.decode(errors="replace") + res.stderr.decode(errors="replace")


def test_auth_refused_is_one_clear_message_never_retried(sec, tmp_path):
    """Scenario 3. A host that refuses the key gives ONE message naming user@host and the key
    that was tried, with what to do (ssh-copy-id); the login is tried once (never retried,
    retries: 3 notwithstanding), in `orch check` (exit 1), `orch up` (exit 3, nothing started)
    and `orch up --skip-checks` (exit 3, nothing started)."""
    h2 = sec.host(2)
    key = str(sec.key_path)
    write_fault_cluster(sec, tmp_path, ssh={"retries": 3, "connect_timeout": 2}, checks={"versions": ["python"]})
    want = f"password-free SSH to root@{h2.address} failed: key {key} was refused"
    for args, rc in ((["check"], 1), (["up", "-q"], 3), (["up", "-q", "--skip-checks"], 3)):
        before = _auth_failures(sec, 2)
        res = orch(*args, cwd=tmp_path, check_rc=rc)
        out = _out(res)
        assert out.count(want) == 1, (args, out)
        assert "ssh-copy-id" in out, out
        assert _auth_failures(sec, 2) - before == 1, f"{args}: the refused login was retried"
        if args[0] == "up":
            assert "nothing was started" in out, out
    # no run got as far as a run record: every host is reached (and the workdir claimed)
    # before a run is recorded or anything is written
    assert run_ids(tmp_path) == []


def _other_key(lab, victim: int, donor: int) -> str:
    """A known_hosts line claiming host `victim` has host `donor`'s key (as if victim's key changed)."""
    lines = Path(lab.known_hosts_path).read_text().splitlines()
    donor_key = next(ln for ln in lines if ln.split()[0].split(",")[0] == lab.host(donor).address).split(None, 1)[1]
    return f"{lab.host(victim).address} {donor_key}\n"


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_changed_host_key_is_refused_under_every_policy(sec, tmp_path, policy):
    """Scenario 4 (changed key). A host whose key differs from known_hosts is refused under
    strict AND accept-new, with a warning that this could be an attack and how to clear the
    old key if the change is expected; known_hosts is left untouched; `orch up` starts nothing."""
    kh = tmp_path / "known_hosts"
    forged = _other_key(sec, 1, 3)
    good = [ln + "\n" for ln in Path(sec.known_hosts_path).read_text().splitlines()
            if ln.split()[0].split(",")[0] == sec.host(3).address]
    kh.write_text(forged + "".join(good))
    write_fault_cluster(sec, tmp_path, hosts=1, inventory={"defaults": {
        **_defaults(sec), "known_hosts": str(kh)}}, ssh={"host_key_policy": policy},
        checks={"versions": ["python"]})
    before = kh.read_text()
    for args, rc in ((["check"], 1), (["up", "-q"], 3), (["up", "-q", "--skip-checks"], 3)):
        out = _out(orch(*args, cwd=tmp_path, check_rc=rc))
        assert "HOST KEY CHANGED" in out and "man-in-the-middle" in out, out
        assert "ssh-keygen -R" in out, out
        assert kh.read_text() == before
    assert run_ids(tmp_path) == []  # nothing recorded, nothing started


def _defaults(lab) -> dict:
    import yaml

    return yaml.safe_load(Path(lab.inventory_path).read_text())["defaults"]


def test_unknown_host_key_strict_refuses_accept_new_records(sec, tmp_path):
    """Scenario 4 (unknown key). Under strict an unknown host is refused, showing the key's
    fingerprint and how to accept it (ssh-keyscan, or accept-new); nothing is written.
    Under accept-new it is recorded in known_hosts (the host's real key) and then verified
    under strict too."""
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    inv = {"defaults": {**_defaults(sec), "known_hosts": str(kh)}}
    write_fault_cluster(sec, tmp_path, inventory=inv, hosts=1, checks={"versions": ["python"]})
    out = _out(orch("check", cwd=tmp_path, check_rc=1))
    assert re.search(r"SHA256:[A-Za-z0-9+/]{20,}", out), out
    assert "not in" in out and "ssh-keyscan" in out and "accept-new" in out, out
    assert kh.read_text() == ""
    write_fault_cluster(sec, tmp_path, inventory=inv, hosts=1, checks={"versions": ["python"]},
                        ssh={"host_key_policy": "accept-new"})
    orch("check", cwd=tmp_path, check_rc=0)
    recorded = kh.read_text().split()
    h1 = sec.host(1)
    real = next(ln.split()[1:3] for ln in Path(sec.known_hosts_path).read_text().splitlines()
                if ln.split()[0].split(",")[0] == h1.address)
    assert recorded[0] == h1.address and recorded[1:3] == real
    write_fault_cluster(sec, tmp_path, inventory=inv, hosts=1, checks={"versions": ["python"]})
    orch("check", cwd=tmp_path, check_rc=0)


def test_a_malformed_known_hosts_line_is_skipped_with_one_warning(sec, tmp_path):
    """A known_hosts line whose key is not base64 (a bad paste): OpenSSH skips it, so does orch,
    saying once which file and line; every host is still verified against the other lines."""
    kh = tmp_path / "known_hosts"
    kh.write_text("# hosts\nbroken.example ssh-ed25519 AAAA!!not-base64!!\n" + Path(sec.known_hosts_path).read_text())
    inv = {"defaults": {**_defaults(sec), "known_hosts": str(kh)},
           "hosts": [{"address": sec.host(i).address, "name": sec.host(i).name} for i in (1, 3)]}  # 2 refuses the key
    write_fault_cluster(sec, tmp_path, inventory=inv, checks={"versions": ["python"]})
    res = orch("check", cwd=tmp_path, check_rc=0)
    err = res.stderr.decode()
    assert err.count(f"{kh}:2: skipped a known_hosts line") == 1, err
    assert "Traceback" not in err and "probe failed" not in _out(res)


def test_a_missing_key_is_named_and_never_retried(sec, tmp_path):
    """An identity_file that does not exist is one located error, with no connection at all;
    no key anywhere (no identity_file, no agent, no ~/.ssh/id_*) says "no usable key" and
    tries once, never blaming the server."""
    inv = {"defaults": {**_defaults(sec), "identity_file": str(tmp_path / "nope" / "id_ed25519")},
           "hosts": [{"address": sec.host(1).address, "name": sec.host(1).name}]}
    write_fault_cluster(sec, tmp_path, inventory=inv, checks={"versions": ["python"]})
    before = len(sshd_lines(sec, 1))
    out = _out(orch("check", cwd=tmp_path, check_rc=1))
    assert f"no usable key: identity_file {tmp_path / 'nope' / 'id_ed25519'} does not exist" in out, out
    assert not any("Connection from" in ln for ln in sshd_lines(sec, 1)[before:])
    home = tmp_path / "home"
    home.mkdir()
    defaults = {k: v for k, v in _defaults(sec).items() if k != "identity_file"}
    write_fault_cluster(sec, tmp_path, inventory={**inv, "defaults": defaults}, checks={"versions": ["python"]})
    before = len(sshd_lines(sec, 1))
    out = _out(orch("check", cwd=tmp_path, check_rc=1, env={"HOME": str(home), "SSH_AUTH_SOCK": ""}))
    assert "no usable key for" in out and "MaxStartups" not in out, out
    assert sum("Connection from" in ln for ln in sshd_lines(sec, 1)[before:]) <= 1


def test_a_wrong_key_file_is_never_blamed_on_the_server(sec, tmp_path):
    """identity_file at the .pub file, or at a file that is no key at all: the message names the
    file and says what it is, never "is it an SSH server? is it overloaded (MaxStartups)?" (the
    server answered; the key is this side's)."""
    import shutil

    pub = tmp_path / "id.pub"
    shutil.copy(str(sec.key_path) + ".pub", pub)
    junk = tmp_path / "id_junk"
    junk.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----\n")
    for path, want in ((pub, f"identity_file {pub} is a public key"),
                       (junk, f"failed after the server answered, while using key {junk}")):
        inv = {"defaults": {**_defaults(sec), "identity_file": str(path)},
               "hosts": [{"address": sec.host(1).address, "name": sec.host(1).name}]}
        write_fault_cluster(sec, tmp_path, inventory=inv, checks={"versions": ["python"]})
        out = _out(orch("check", cwd=tmp_path, check_rc=1))
        assert want in out and "MaxStartups" not in out and "SSH server" not in out, out


def test_an_encrypted_identity_file_is_taken_from_the_agent_or_refused_clearly(sec, tmp_path):
    """identity_file protected by a passphrase: with no agent holding it, one clear error (orch
    never prompts); once ssh-agent holds it, the agent's copy is used, as `ssh -i` does."""
    import os
    import subprocess

    key = tmp_path / "id_enc"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "s3cret-pw", "-C", "orch-test", "-f", str(key)],
                   check=True)
    pub = key.with_suffix(".pub").read_text().strip()
    auth = "/root/.ssh/authorized_keys"
    sec.exec(1, ["sh", "-c", f"echo {pub!r} >> {auth}"], check=True)
    agent = None
    try:
        inv = {"defaults": {**_defaults(sec), "identity_file": str(key)},
               "hosts": [{"address": sec.host(1).address, "name": sec.host(1).name}]}
        write_fault_cluster(sec, tmp_path, inventory=inv, checks={"versions": ["python"]})
        out = _out(orch("check", cwd=tmp_path, check_rc=1, env={"SSH_AUTH_SOCK": ""}))
        assert "protected by a passphrase and orch never prompts" in out, out
        res = subprocess.run(["ssh-agent", "-s"], capture_output=True, text=True, check=True)
        env = dict(re.findall(r"(SSH_AUTH_SOCK|SSH_AGENT_PID)=([^;]+);", res.stdout))
        agent = int(env["SSH_AGENT_PID"])
        askpass = tmp_path / "askpass.sh"
        askpass.write_text("#!/bin/sh\necho s3cret-pw\n")
        askpass.chmod(0o700)
        subprocess.run(["ssh-add", str(key)], check=True, capture_output=True, stdin=subprocess.DEVNULL,
                       env={**os.environ, **env, "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force",
                            "DISPLAY": ":0"})
        orch("check", cwd=tmp_path, check_rc=0, env={"SSH_AUTH_SOCK": env["SSH_AUTH_SOCK"]})
    finally:
        if agent:
            os.kill(agent, 15)
        sec.exec(1, ["sh", "-c", f"grep -vF 'orch-test' {auth} > {auth}.new; cat {auth}.new > {auth}; rm {auth}.new"])
