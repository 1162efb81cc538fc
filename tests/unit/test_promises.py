"""README's "What orch promises", the part that holds without a lab: one test (or a few) per
promise, each through a stable entry point (the CLI through click's runner, spec.load_cluster,
hostsets, the agent package, the transport) so it outlives code moving between modules.

Each test here was seen failing on a deliberately broken copy of the code (the 4 MB limit set to
1 TB, the expansion limit removed, exit codes above 128 called signals, ...); the promises that
need real hosts are held by tests/faults (README names them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from click.testing import CliRunner

from orchestrator import cli as climod
from orchestrator.errors import SpecError
from orchestrator.spec import load_cluster

LOCAL = "inventory:\n  hosts: [{address: 'n[1-2]', connection: local, slots: 2}]\n"
JOB = "job: {workdir: /data/j, command: 'python x.py'}\n"


def orch(*args: str):
    """`orch ARGS` in this process (click's runner): (exit code, everything it printed)."""
    res = CliRunner().invoke(climod.cli, list(args))
    return res.exit_code, res.output


def cluster_file(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text, newline="")
    return p


def refused(tmp_path: Path, text: str, line: int | None) -> str:
    """`orch plan` of a cluster file that must be refused: exit 2, one located error, no
    traceback. Returns the output."""
    f = cluster_file(tmp_path, text)
    rc, out = orch("plan", str(f))
    assert rc == 2, out
    assert "Traceback" not in out, out
    assert f"{f}:{line}:" in out if line is not None else f"{f}:" in out, out
    return out


# --------------------------------------------------------------------------- Bounded input
# Cluster files over 4 MB, YAML alias bombs (over 200k values), NUL bytes, control characters and
# `slots` above 1024 are exit 2 with file and line, at once.

def test_a_cluster_file_over_4_mb_is_refused_unread(tmp_path):
    text = LOCAL + JOB
    text += "#" * ((4 << 20) + 1 - len(text))  # one byte over
    out = refused(tmp_path, text, None)
    assert "orch reads at most 4 MB" in out, out


def _values(n: int) -> str:
    """A file whose YAML holds about n values, through aliases (`&a [x, x, ...]`, `*a` repeated)."""
    per = 1000
    return ("x: &a [" + ", ".join(["v"] * per) + "]\n"
            "y: [" + ", ".join(["*a"] * (n // per)) + "]\n")


def test_an_alias_bomb_over_200k_values_is_refused_with_its_line(tmp_path):
    out = refused(tmp_path, _values(201_000) + LOCAL + JOB, 1)  # the aliased values
    assert "expands to more than 200000 values" in out, out


def test_200k_values_less_a_little_are_read(tmp_path):
    with pytest.raises(SpecError) as exc:  # read whole: only what the file means is wrong
        load_cluster(cluster_file(tmp_path, _values(190_000) + LOCAL + JOB))
    assert "unknown key 'x'" in str(exc.value)


@pytest.mark.parametrize("text, line, needle", [
    (LOCAL + JOB + "\0\n", 4, "a NUL byte"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\\0b\"}\n", 3, "a NUL character"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x01b\"}\n", 3, "YAML error"),
    (LOCAL + "job: {workdir: /data/j, command: \"a\x1bb\"}\n", 3, "YAML error"),
])
def test_nul_bytes_and_control_characters_are_refused_with_their_line(tmp_path, text, line, needle):
    out = refused(tmp_path, text, line)
    assert needle in out, out


def test_slots_above_1024_are_refused_with_their_line(tmp_path):
    text = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1025}\n" + JOB
    out = refused(tmp_path, text, 3)
    assert "more than 1024 ranks on one host" in out, out
    ok = "inventory:\n  hosts:\n    - {address: n1, connection: local, slots: 1024}\n" + JOB
    assert load_cluster(cluster_file(tmp_path, ok)).hosts[0].slots == 1024


# --------------------------------------------------------------------------- No hangs
# An `n[1-99999999]` typo is an error, not an hour of expansion. (The limit is 100000 names; a
# pattern one over it is refused before anything is built, wherever a pattern is read.)

OVER = "m[1-100001]"
EXPANSION_PLACES = {
    "address": f"inventory:\n  hosts:\n    - {{address: '{OVER}', connection: local}}\n" + JOB,
    "name": f"inventory:\n  hosts:\n    - {{address: '10.0.0.[1-2]', name: '{OVER}', connection: local}}\n" + JOB,
    "group": f"{LOCAL}  groups: {{g: ['{OVER}']}}\n" + JOB,
}


@pytest.mark.parametrize("where", sorted(EXPANSION_PLACES))
def test_a_host_range_over_100000_names_is_an_error_with_its_line(tmp_path, where):
    out = refused(tmp_path, EXPANSION_PLACES[where], 3)
    assert f"it expands to 100001 names; at most 100000 are allowed: \"{OVER}\"" in out, out


def test_a_host_range_over_100000_names_in_hosts_option_is_an_error(tmp_path):
    rc, out = orch("plan", str(cluster_file(tmp_path, LOCAL + JOB)), "--hosts", "n1,n[1-400]-[1-300]")
    assert rc == 2 and "it expands to 120001 names; at most 100000 are allowed" in out, out


def test_a_host_range_is_counted_without_being_expanded():
    """What makes the README's `n[1-99999999]` an error at once: its size is counted, never built."""
    from orchestrator import hostsets
    assert hostsets.range_size("n[1-99999999]") == 99999999
    assert hostsets.range_size("n[1-10/2],m[1-3]-[1-4]") == 5 + 12


# --------------------------------------------------------------------------- What failed is said
# ... exit codes above 128 are called signals only when they are.

def test_an_exit_code_above_128_is_an_exit_code_and_a_signal_is_a_signal():
    from orchestrator.agent.states import describe
    assert describe(137) == "exit code 137" and describe(255, None) == "exit code 255"
    assert describe(None, 9) == "killed by signal 9 (SIGKILL)"
    assert describe(None, 15) == "killed by signal 15 (SIGTERM)"


@pytest.mark.parametrize("script, code, sig", [("exit 137", 137, None), ("exit 143", 143, None),
                                               ("kill -KILL $$", None, 9)])
def test_the_supervisor_records_what_waitpid_says(tmp_path, script, code, sig):
    """A rank's end as the host's supervisor records it: a shell's `exit 137` stays exit code 137;
    only a process a signal killed has a signal."""
    import subprocess
    import time

    from orchestrator.agent.procs import Local
    local = Local({"run_id": "r", "rundir": str(tmp_path), "host": "h", "launcher": "ranktable"}, lambda t: None)
    proc = subprocess.Popen(["sh", "-c", script])
    proc.returncode = 0   # reaped by Local, as the supervisor's children are
    rec = {"key": "rank.0", "rank": 0, "pid": proc.pid, "exit_code": None, "signal": None, "start": 0, "end": None}
    local.children[proc.pid] = rec
    for _ in range(3000):   # until waitpid has it (the loop, not a timed assert: 30 s at most)
        local.reap()
        if rec["end"] is not None:
            break
        time.sleep(0.01)
    assert (rec["exit_code"], rec["signal"]) == (code, sig)


@pytest.mark.parametrize("code, sig, how", [(137, None, "exit code 137"), (None, 9, "killed by signal 9 (SIGKILL)")])
def test_the_runs_message_calls_a_signal_a_signal_only_when_it_is_one(code, sig, how):
    """What `orch up` and `orch status` print for a failed rank: the head's first failure."""
    from orchestrator.agent import head as H
    from tests.unit.test_head import T0, rep, running
    head = running()
    H.decide(head, [rep(head, "b", {3: ("failed", code, sig, T0 + 5)})], T0 + 6)
    assert head.doc["first_failure"]["how"] == how
    assert f"rank 3 on b (device 1) failed: {how}" in head.doc["message"]
    assert ("signal" in head.doc["message"]) == (sig is not None)


# --------------------------------------------------------------------------- Secrets kept
# Secret env values (`job.secret_env`, `*_TOKEN`, `*_KEY`, `*_SECRET`, `*PASSWORD*`) reach ... nothing
# else: not run records, printed output, plan files, errors. (The ranks' environment and the
# hosts' command lines need hosts: tests/faults/test_secrets.py.)

SECRETS = {"HF_TOKEN": "S3cr3t-token-1", "AWS_KEY": "S3cr3t-key-22", "APP_SECRET": "S3cr3t-secret-333",
           "DB_PASSWORD_FILE": "S3cr3t-pw-4444", "my_passwd": "S3cr3t-pw-55555", "PLAIN_NAME": "S3cr3t-chosen-6"}


def _secret_cluster(launcher: str) -> str:
    env = ", ".join(f"{k}: {v}" for k, v in SECRETS.items())
    return (f"inventory:\n  hosts:\n    - {{address: 'n[1-2]', connection: local, slots: 2, "
            f"env: {{HOST_TOKEN: S3cr3t-host-77}}}}\n"
            f"job:\n  workdir: /data/j\n  launcher: {launcher}\n  secret_env: [PLAIN_NAME]\n"
            f"  command: python x.py --token S3cr3t-token-1 --pw=S3cr3t-pw-4444\n"
            f"  env: {{{env}, SEEN: visible-value}}\n")


@pytest.mark.parametrize("launcher", ["mpirun", "ranktable"])
def test_secret_values_reach_no_plan_file_and_no_output(tmp_path, launcher):
    f = cluster_file(tmp_path, _secret_cluster(launcher))
    out_dir = tmp_path / "out"
    rc1, printed = orch("plan", str(f), "--out", str(out_dir))
    rc2, as_json = orch("plan", str(f), "--json")
    assert (rc1, rc2) == (0, 0), printed + as_json
    written = {p.name: p.read_text() for p in out_dir.iterdir()}
    assert {"plan.json", "commands.json"} <= set(written), sorted(written)
    everything = printed + as_json + "".join(written.values())
    assert "S3cr3t" not in everything
    assert "visible-value" in "".join(written.values())   # plain values are shown: the search looked in the right place
    for name in [*SECRETS, "HOST_TOKEN"]:
        assert name in everything, name


def test_a_run_record_holds_no_secret_value(tmp_path):
    """What `orch up` records here (runs.create_run: the cluster file's text, the model, the
    plan) has every secret value masked, and is readable by this user alone."""
    from orchestrator import runs
    f = cluster_file(tmp_path, _secret_cluster("mpirun"))
    run = runs.create_run(load_cluster(f), {}, cwd=tmp_path)
    record = (run.dir / "run.json").read_text()
    assert "S3cr3t" not in record
    assert "visible-value" in record and runs.MASK in json.loads(record)["cluster_text"]
    assert (run.dir / "run.json").stat().st_mode & 0o077 == 0


def test_a_bad_secret_value_is_an_error_that_does_not_quote_it(tmp_path):
    out = refused(tmp_path, LOCAL + "job: {workdir: /data/j, command: x, env: {HF_TOKEN: [S3cr3t-token-1]}}\n", 3)
    assert "HF_TOKEN" in out and "S3cr3t" not in out, out


# --------------------------------------------------------------------------- A full disk here is said
# ... a run.json that cannot be written is a located error, never a crash. (Logs that could not
# be brought back need a run: tests/faults/test_logs.py.)

def test_a_run_record_that_cannot_be_written_is_a_located_error(tmp_path):
    from orchestrator import runs
    from orchestrator.errors import LocalWriteError
    run = runs.create_run(load_cluster(cluster_file(tmp_path, LOCAL + JOB)), {}, cwd=tmp_path)
    (run.dir / "run.json").unlink()
    (run.dir / "run.json").mkdir()      # what a full or read-only disk does to a write, as root too
    with pytest.raises(LocalWriteError) as exc:
        run.save()
    assert f"cannot write {run.dir / 'run.json'}: Is a directory" in str(exc.value) and exc.value.exit_code == 5


def test_a_run_directory_that_cannot_be_made_is_a_located_error(tmp_path):
    from orchestrator import runs
    from orchestrator.errors import LocalWriteError
    (tmp_path / ".orch").write_text("")  # in the way of .orch/runs
    with pytest.raises(LocalWriteError) as exc:
        runs.create_run(load_cluster(cluster_file(tmp_path, LOCAL + JOB)), {}, cwd=tmp_path)
    assert str(tmp_path / ".orch" / "runs") in str(exc.value) and "Not a directory" in str(exc.value)


# --------------------------------------------------------------------------- No neighbour can slip code in
# `orch check` fails a workdir, or any parent, writable by group or others (root's sticky dirs such as
# /tmp excepted) or owned by another user, with the fix; system directories are refused as workdir
# (tests/unit/test_spec.py::test_a_system_directory_is_never_a_workdir).

def _workdir_check(tmp_path: Path, workdir: Path) -> dict:
    """`orch check --json` of a cluster of this machine (connection: local): the workdir result."""
    f = cluster_file(tmp_path, "inventory:\n  hosts: [{address: n1, connection: local}]\n"
                               f"job: {{workdir: '{workdir}', command: 'true'}}\n")
    rc, out = orch("check", str(f), "--json")
    (res,) = [r for r in json.loads(out)["results"] if r["check"] == "workdir"]
    assert rc in (0, 1) and (rc == 1 or res["status"] != "fail"), out
    return res


@pytest.mark.parametrize("mode, who", [(0o777, "group and others"), (0o775, "its group"), (0o757, "others"),
                                       (0o1777, None), (0o755, None)])
def test_a_workdir_under_a_directory_others_can_write_fails_the_check_with_the_fix(tmp_path, mode, who):
    """A parent (here, the directory above the workdir) others could write to: a neighbour could
    swap what the ranks run. A sticky directory of root's (as /tmp) is fine."""
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(mode)
    if mode & 0o1000 and __import__("os").getuid() != 0:
        who = "group and others"   # sticky, but not root's
    res = _workdir_check(tmp_path, parent / "job")
    if who is None:
        assert res["status"] == "pass", res
        return
    assert res["status"] == "fail", res
    assert f"{parent} is writable by {who} (mode {mode & 0o777:o}); fix: chmod go-w {parent}" in res["message"], res


@pytest.mark.skipif(__import__("os").getuid() != 0, reason="giving a directory to another user needs root")
@pytest.mark.parametrize("sticky", [False, True])
def test_a_workdir_owned_by_another_user_fails_the_check(tmp_path, sticky):
    import os
    wd = tmp_path / "job"
    wd.mkdir(mode=0o1755 if sticky else 0o755)
    os.chown(wd, 54321, 54321)
    res = _workdir_check(tmp_path, wd)
    assert res["status"] == "fail" and f"{wd} is owned by uid 54321" in res["message"], res


# --------------------------------------------------------------------------- No injection
# ... for mpirun a workdir or log_dir holding `$`, a backtick, `"`, `\` or `!` is refused up front
# (exit 2, with the line). (That every value reaches the rank byte-for-byte needs hosts:
# tests/faults/test_hostile.py; the quoting itself: tests/unit/test_sh.py.)

@pytest.mark.parametrize("char", ["$", "`", '"', "\\", "!"])
@pytest.mark.parametrize("key", ["workdir", "log_dir"])
def test_mpirun_refuses_a_workdir_or_log_dir_its_remote_shell_would_expand(tmp_path, key, char):
    value = f"/data/a{char}b" if key == "workdir" else f"logs/a{char}b"
    quoted = json.dumps(value)   # a YAML double-quoted scalar
    job = {"workdir": '"/data/j"', "log_dir": '"logs"', key: quoted}
    text = LOCAL + "job:\n  command: x\n" + "".join(f"  {k}: {v}\n" for k, v in job.items())
    line = 5 + list(job).index(key)   # after LOCAL (2 lines), `job:` and `command:`
    out = refused(tmp_path, text, line)
    assert f"job.{key}: {key} {value!r} contains {char}" in out, out
    ranktable = text.replace("job:\n", "job:\n  launcher: ranktable\n")
    assert getattr(load_cluster(cluster_file(tmp_path, ranktable)).job, key) == value


HOSTILE = ["it's", 'a "b"', "$(touch pwned)", "`touch pwned`", "a;b&c|d",
           "back\\slash", "new\nline", "ünï\u2028code", "$HOME", "!x", "", " lead and trail "]


def test_a_command_argv_env_and_workdir_reach_the_shell_byte_for_byte_and_run_nothing(tmp_path):
    """What every transport runs on a host (transport.build_script: env exports, cd, the argv),
    run here by sh: each hostile word arrives as itself."""
    import subprocess

    from orchestrator.transport import build_script
    wd = tmp_path / "it's $(x) `y`"
    wd.mkdir()
    script = build_script(["sh", "-c", 'printf "%s\\0" "$PWD" "$V" "$@"', "sh", *HOSTILE],
                          env={"V": HOSTILE[2] + HOSTILE[6]}, cwd=str(wd))
    out = subprocess.run(["sh"], input=script.encode(), capture_output=True, timeout=30, cwd=tmp_path).stdout
    assert out.split(b"\0")[:-1] == [str(wd).encode(), (HOSTILE[2] + HOSTILE[6]).encode(),
                                     *[w.encode() for w in HOSTILE]]
    assert not (tmp_path / "pwned").exists() and not (wd / "pwned").exists()   # ran nothing


# --------------------------------------------------------------------------- SSH: no hangs, own words, host keys
# An unreachable host costs at most `connect_timeout x retries`; a malformed known_hosts line is
# skipped with one warning naming file and line; a missing key is "no usable key", never retried
# or blamed on the server; a refused key is one message (user@host, the key) and one attempt; a
# changed host key is refused under every policy; an unknown one is refused under `strict` with
# its fingerprint, recorded under `accept-new`. Against an SSH server in this process, on loopback.
# (An encrypted key used from ssh-agent: tests/faults/test_ssh_security.py.)

class SshServer:
    """A paramiko SSH server on 127.0.0.1 that takes `allowed` (a key) for any user, or, `silent`,
    accepts TCP connections and never says a word. Counts connections and key offers."""

    def __init__(self, allowed=None, silent: bool = False):
        import socket
        import threading

        import paramiko
        self.host_key = paramiko.ECDSAKey.generate()
        self.allowed, self.silent = allowed, silent
        self.connections, self.offers = 0, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import paramiko
        server = self

        class Iface(paramiko.ServerInterface):
            def get_allowed_auths(self, username):
                return "publickey"

            def check_auth_publickey(self, username, key):
                server.offers += 1
                ok = server.allowed is not None and key.get_base64() == server.allowed.get_base64()
                return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.silent:
                self.held.append(conn)
                continue
            t = paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            self.held.append(t)
            try:
                t.start_server(server=Iface())
            except (paramiko.SSHException, EOFError, OSError):
                pass

    def close(self):
        self.sock.close()
        for x in self.held:
            x.close()


@pytest.fixture
def ssh_server():
    made = []

    def make(**kw):
        made.append(SshServer(**kw))
        return made[-1]
    yield make
    for s in made:
        s.close()


def _key_file(tmp_path: Path, name: str):
    import paramiko
    key = paramiko.ECDSAKey.generate()
    key.write_private_key_file(str(tmp_path / name))
    return key, tmp_path / name


def _transport(tmp_path: Path, server: SshServer, identity: Path | None, *, policy: str = "strict",
               connect_timeout: float = 5, retries: int = 3, known: str | None = None):
    from orchestrator.transport import make_transport
    kh = tmp_path / "known_hosts"
    if known is not None:
        kh.write_text(known)
    ident = f", identity_file: '{identity}'" if identity else ""
    f = cluster_file(tmp_path, f"inventory:\n  hosts: [{{address: 127.0.0.1, port: {server.port}, user: trainer, "
                               f"known_hosts: '{kh}'{ident}}}]\n"
                               f"ssh: {{connect_timeout: {connect_timeout}, retries: {retries}, "
                               f"host_key_policy: {policy}, config_file: none}}\n" + JOB)
    c = load_cluster(f)
    return make_transport(c.hosts[0], c.ssh)


def _known_line(server: SshServer, key=None) -> str:
    key = key or server.host_key
    return f"[127.0.0.1]:{server.port} {key.get_name()} {key.get_base64()}\n"


@pytest.mark.parametrize("retries, said", [(1, "SSH handshake with 127.0.0.1:{port} failed"),
                                           (3, "could not connect to trainer@127.0.0.1:{port} within 0.9s")])
def test_a_host_that_never_answers_costs_connect_timeout_times_retries(tmp_path, ssh_server, retries, said):
    """Each attempt waits at most connect_timeout, at most `retries` attempts are made, and all of
    them end within connect_timeout x retries (the pauses between attempts included): counted
    as the connections a server that never answers saw, and read from what orch says."""
    from orchestrator.errors import TransientNetworkError
    srv = ssh_server(silent=True)
    t = _transport(tmp_path, srv, None, connect_timeout=0.3, retries=retries, known="")
    with pytest.raises(TransientNetworkError) as exc:
        t.connect()
    assert 1 <= srv.connections <= retries, srv.connections
    assert said.format(port=srv.port) in str(exc.value), str(exc.value)


def test_a_missing_identity_file_is_no_usable_key_without_a_connection(tmp_path, ssh_server):
    from orchestrator.errors import AuthError
    srv = ssh_server()
    t = _transport(tmp_path, srv, tmp_path / "no-such-key", known=_known_line(srv))
    with pytest.raises(AuthError) as exc:
        t.connect()
    assert f"no usable key: identity_file {tmp_path / 'no-such-key'} does not exist" in str(exc.value)
    assert srv.connections == 0


def test_no_key_at_all_is_no_usable_key_tried_once_and_not_the_servers_fault(tmp_path, ssh_server, monkeypatch):
    from orchestrator.errors import AuthError
    monkeypatch.setenv("HOME", str(tmp_path))         # no ~/.ssh/id_*
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # no agent
    srv = ssh_server()
    t = _transport(tmp_path, srv, None, known=_known_line(srv))
    with pytest.raises(AuthError) as exc:
        t.connect()
    assert "no usable key for trainer@127.0.0.1" in str(exc.value), str(exc.value)
    assert "refused" not in str(exc.value) and srv.connections == 1 and srv.offers == 0


def test_a_refused_key_is_one_message_and_one_attempt(tmp_path, ssh_server):
    from orchestrator.errors import AuthError
    _, ident = _key_file(tmp_path, "id_ecdsa")
    srv = ssh_server(allowed=_key_file(tmp_path, "other")[0])
    t = _transport(tmp_path, srv, ident, known=_known_line(srv))
    with pytest.raises(AuthError) as exc:
        t.connect()
    assert f"password-free SSH to trainer@127.0.0.1 failed: key {ident} was refused" in str(exc.value)
    assert (srv.connections, srv.offers) == (1, 1)
    with pytest.raises(AuthError):   # and not tried again by the next step of the same command
        t.connect()
    assert srv.connections == 1


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_a_changed_host_key_is_refused_under_every_policy(tmp_path, ssh_server, policy):
    import paramiko

    from orchestrator.errors import HostKeyError
    key, ident = _key_file(tmp_path, "id_ecdsa")
    srv = ssh_server(allowed=key)
    t = _transport(tmp_path, srv, ident, policy=policy, known=_known_line(srv, paramiko.ECDSAKey.generate()))
    with pytest.raises(HostKeyError) as exc:
        t.connect()
    assert f"HOST KEY CHANGED for [127.0.0.1]:{srv.port}" in str(exc.value) and srv.offers == 0


def test_an_unknown_host_key_is_refused_under_strict_with_its_fingerprint(tmp_path, ssh_server):
    from orchestrator.errors import HostKeyError
    key, ident = _key_file(tmp_path, "id_ecdsa")
    srv = ssh_server(allowed=key)
    t = _transport(tmp_path, srv, ident, known="")
    with pytest.raises(HostKeyError) as exc:
        t.connect()
    assert srv.host_key.fingerprint in str(exc.value) and srv.offers == 0
    assert (tmp_path / "known_hosts").read_text() == ""


def test_an_unknown_host_key_is_recorded_under_accept_new(tmp_path, ssh_server):
    key, ident = _key_file(tmp_path, "id_ecdsa")
    srv = ssh_server(allowed=key)
    t = _transport(tmp_path, srv, ident, policy="accept-new", known="")
    t.connect()
    t.close()
    assert (tmp_path / "known_hosts").read_text() == _known_line(srv)


def test_a_malformed_known_hosts_line_is_skipped_with_one_warning_naming_file_and_line(tmp_path, ssh_server, capsys):
    key, ident = _key_file(tmp_path, "id_ecdsa")
    srv = ssh_server(allowed=key)
    known = "# a comment\n[127.0.0.1]:1 ssh-ed25519 not-base64!!\n" + _known_line(srv)
    for _ in range(2):   # two connections, one warning
        t = _transport(tmp_path, srv, ident, known=known)
        t.connect()
        t.close()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and f"{tmp_path / 'known_hosts'}:2: skipped a known_hosts line" in err, err


# --------------------------------------------------------------------------- No one else drives a run
# The supervisors authenticate each other by HMAC challenge-response (the token never crosses the
# network; the head proves itself first) and seal every message after it; `[]`, 100k `[`, bytes that
# are not UTF-8, forged frames close only their own connection. Here the protocol's part, byte by
# byte; the running head (idle and 1 MB connections, memory, another user, the wildcard address):
# tests/integration/test_head_server.py, tests/faults/test_supervisor_attacks.py.

@pytest.mark.parametrize("line", [b"[]", b"[" * 100_000, b"\xff\xfe{}", b'{"t": 1}', b"", b"x" * 70])
def test_a_line_that_is_not_a_message_is_a_protocol_error(line):
    from orchestrator.agent import protocol as P
    with pytest.raises(P.ProtocolError):
        P.decode(line, P.LINE)


def test_no_peer_makes_a_supervisor_hold_more_than_a_line():
    from orchestrator.agent import protocol as P
    lines = P.Lines(1000)
    assert lines.feed(b"a" * 600 + b"\nb") == [b"a" * 600]
    with pytest.raises(P.ProtocolError):
        lines.feed(b"b" * 1000)          # no newline yet, and already over
    with pytest.raises(P.ProtocolError):
        P.decode(b'{"t": "x", "pad": "' + b"x" * P.LINE + b'"}', P.LINE)


def test_the_proofs_and_keys_need_the_token_and_differ_by_side():
    """What crosses the network is nonces and HMACs of them; the head's proof is not the
    member's, and each direction seals with its own key."""
    from orchestrator.agent import protocol as P
    tok, nc, ns = "ab" * 16, P.new_nonce(), P.new_nonce()
    server, client = P.server_proof(tok, "r1", nc, ns), P.client_proof(tok, "r1", "member", "h2", nc, ns)
    assert tok not in server + client and server != client
    assert server != P.server_proof("cd" * 16, "r1", nc, ns) and server != P.server_proof(tok, "r1", nc, P.new_nonce())
    c2s, s2c = P.session_keys(tok, nc, ns)
    assert c2s != s2c and tok.encode() not in c2s + s2c


# RFC 4231's HMAC-SHA256 test cases 1, 2, 6 (a key longer than the block), 7
RFC4231 = [(b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
           (b"Jefe", b"what do ya want for nothing?",
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"),
           (b"\xaa" * 131, b"Test Using Larger Than Block-Size Key - Hash Key First",
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"),
           (b"\xaa" * 131, b"This is a test using a larger than block-size key and a larger than block-size data. "
                           b"The key needs to be hashed before being used by the HMAC algorithm.",
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2")]


@pytest.mark.parametrize("key, msg, mac", RFC4231)
def test_the_supervisors_hmac_is_rfc_4231s(key, msg, mac):
    """The MACs are HMAC-SHA256 on CPython's own sha256 (hashlib and hmac load OpenSSL: ~2.8 ms of
    every supervisor's start): the RFC's vectors, and hmac's answer for any key and message."""
    from orchestrator.agent import protocol as P
    assert P.hmac_sha256(key, msg).hex() == mac


@settings(max_examples=300)
@given(key=st.binary(max_size=200), msg=st.binary(max_size=300))
def test_the_supervisors_hmac_is_hmacs_for_any_key_and_message(key, msg):
    import hashlib
    import hmac

    from orchestrator.agent import protocol as P
    assert P.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()
    assert P.compare_digest(b"ab", b"ab") and not P.compare_digest(b"ab", b"ac")


def test_a_forged_tampered_replayed_or_reordered_frame_is_refused():
    from orchestrator.agent import protocol as P
    c2s, s2c = P.session_keys("ab" * 16, P.new_nonce(), P.new_nonce())
    tx = P.Sealer(c2s)
    first, second = tx.seal(P.stop("a")), tx.seal(P.stop("b"))
    for bad in (second, first.replace(b'"a"', b'"z"'), P.Sealer(s2c).seal(P.stop("a")), b"0" * 64 + first[64:]):
        with pytest.raises(P.ProtocolError):
            P.Sealer(c2s).open(bad.rstrip(b"\n"), P.LINE)
    rx = P.Sealer(c2s)
    assert rx.open(first.rstrip(b"\n"), P.LINE)["reason"] == "a"
    with pytest.raises(P.ProtocolError):
        rx.open(first.rstrip(b"\n"), P.LINE)    # the same frame again


# --------------------------------------------------------------------------- No hangs: a lost host
# A host lost mid-job is detected by the run's supervisor within max(10 s, 2 x connect_timeout).
# The window the supervisors are given, from the cluster file; what the head does with it:
# tests/unit/test_head.py::test_a_silent_member_is_lost_after_lost_after_seconds_not_before; the
# link cut on real hosts: tests/faults/test_network.py.

@pytest.mark.parametrize("connect_timeout, window", [(1, 10), (5, 10), (6, 12), (30, 60)])
def test_a_lost_host_is_noticed_within_max_10_s_and_twice_connect_timeout(tmp_path, connect_timeout, window):
    from orchestrator import supervisor
    c = load_cluster(cluster_file(tmp_path, LOCAL + f"ssh: {{connect_timeout: {connect_timeout}}}\n" + JOB))
    assert supervisor.lost_after(c) == window


# --------------------------------------------------------------------------- What failed is said in its own words
# A failed mpirun's report quotes its last words (ssh's `Connection refused`, OpenMPI's summary,
# `Argument list too long`). What OpenMPI 4.1.4 really printed: tests/unit/test_words.py; the
# report beside its log path, from a real mpirun: tests/faults/test_lifecycle.py.

def test_a_launchers_last_words_are_its_own_error_not_its_preamble_or_advice():
    from orchestrator.agent.words import launcher_words
    rule = "-" * 74
    text = "\n".join([
        "sh: 1: exec: /usr/bin/ssh: Argument list too long",
        rule,
        "The launcher was started with 4096 hosts on its command line.",   # says nothing went wrong
        "",
        "ORTE was unable to reliably start one or more daemons.",
        "",
        "Please check that the ssh command works from this machine.",       # advice
        rule])
    got = [ln.strip() for ln in launcher_words(text).splitlines()]
    assert got == ["sh: 1: exec: /usr/bin/ssh: Argument list too long",
                   "ORTE was unable to reliably start one or more daemons."], got


# --------------------------------------------------------------------------- No orphans: one run per workdir
# A second `orch up` into a live run's workdir is refused (`--force` stops the first): on each host,
# the run's supervisor holds the workdir's lock for the run's life. The refusal as the user sees it,
# and --force: tests/faults/test_supervision.py::test_second_run_in_a_live_workdir_is_refused_force_stops_the_first_logs_intact.

def test_a_live_runs_workdir_lock_refuses_a_second_run_and_names_the_first(tmp_path):
    """Run A's supervisor (another process, as on the host) holds the lock; run B is refused,
    told A's id; once A is over, B takes it."""
    import os
    import subprocess
    import sys

    from orchestrator.agent.cli import lock_workdir
    holder_a = subprocess.Popen(
        [sys.executable, "-c", "import sys; from orchestrator.agent.cli import lock_workdir; "
         "print(lock_workdir(sys.argv[1], 'RUN-A')[1], flush=True); sys.stdin.read()", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    try:
        assert holder_a.stdout.readline().strip() == "None"     # A holds it
        assert lock_workdir(str(tmp_path), "RUN-B") == (None, "RUN-A")
        assert (tmp_path / ".orch" / "lock").stat().st_mode & 0o777 == 0o600
    finally:
        holder_a.stdin.close()
        holder_a.wait(30)
    fd, holder = lock_workdir(str(tmp_path), "RUN-B")
    os.close(fd)
    assert holder is None


# --------------------------------------------------------------------------- No orphans / own words, as the user sees it
# A rank killed by SIGKILL (the OOM killer) is reported as `killed by signal 9` and everything else
# is stopped; exit codes above 128 are called signals only when they are. One `orch up` on this
# machine (connection: local, the ranktable launcher: every piece but ssh and mpirun); with mpirun
# on lab hosts: tests/faults/test_lifecycle.py::test_rank_killed_by_sigkill_is_reported_as_signal_9.

@pytest.mark.parametrize("rank0, how", [("kill -KILL $$", "killed by signal 9 (SIGKILL)"),
                                        ("exit 137", "exit code 137")])
def test_a_failed_rank_is_named_in_its_own_words_and_the_others_are_stopped(tmp_path, rank0, how):
    import subprocess
    import sys
    script = f'if [ "$RANK_ID" = 0 ]; then {rank0}; fi; sleep 60'
    (tmp_path / "cluster.yaml").write_text(
        "inventory:\n  hosts: [{name: here, address: 127.0.0.1, connection: local, slots: 2}]\n"
        f"job:\n  workdir: {tmp_path / 'wd'}\n  launcher: ranktable\n  command: [sh, -c, {json.dumps(script)}]\n")

    def orch_here(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
    up = orch_here("up", "--json", "--skip-checks")
    assert up.returncode == 1, (up.stdout, up.stderr)
    doc = json.loads(up.stdout)
    assert doc["first_failure"]["rank"] == 0 and doc["first_failure"]["how"] == how, doc
    assert f"rank 0 on here (device 0) failed: {how}" in doc["message"], doc
    assert ("signal" in doc["message"]) == ("signal" in how), doc
    status = json.loads(orch_here("status", "--json").stdout)
    (rank1,) = [r for r in status["ranks"] if r["rank"] == 1]
    assert rank1["state"] == "stopped", status     # the other rank did not run on
