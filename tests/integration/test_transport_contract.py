"""One contract, every transport: local (subprocess) and ssh (a real sshd on a lab host).

The same test bodies run against both; a difference in behaviour is a bug.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid

import pytest

from orchestrator.errors import RemoteTimeout
from orchestrator.spec import Host, SshSettings
from orchestrator.transport import make_transport

from tests.support import budget, lab_cluster, timed

HOSTILE = ["it's", 'a "q"', "$(touch /tmp/orch-pwned-%s)", "`touch /tmp/orch-pwned-%s`", "; echo x |& \\",
           "new\nline", "spaces  and\ttabs", "ünïcødé ✓", "*", "~", "-n", ""]


@pytest.fixture(params=["local", "ssh"])
def transport(request, tmp_path):
    if request.param == "local":
        t = make_transport(Host(name="local", address="127.0.0.1", user="root", connection="local"),
                           SshSettings(command_timeout=30))
        base = str(tmp_path)
    else:
        cluster = lab_cluster(request.getfixturevalue("lab"), tmp_path)
        t = make_transport(cluster.hosts[0], SshSettings(connect_timeout=5, command_timeout=30, retries=2))
        base = f"/data/contract-{uuid.uuid4().hex[:8]}"
    t.base = base
    yield t
    try:
        t.run(["rm", "-rf", base], timeout=30)
    finally:
        t.close()


def test_exit_code_stdout_stderr(transport):
    r = transport.run("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    assert r.host == transport.host.name and r.duration >= 0
    assert transport.run(["true"]).ok


def test_argv_and_env_values_arrive_byte_for_byte(transport):
    tag = uuid.uuid4().hex[:8]
    args = [a % tag if "%s" in a else a for a in HOSTILE]
    r = transport.run(["python3", "-c", "import sys,os; sys.stdout.write('\\0'.join(sys.argv[1:]) + '\\1' + os.environ['V'])"]
                      + args, env={"V": args[2] + args[5]})
    assert r.ok, r.err
    got_args, got_env = r.stdout.decode().split("\1")
    assert got_args.split("\0") == args
    assert got_env == args[2] + args[5]
    assert not transport.run(["sh", "-c", f"ls /tmp/orch-pwned-{tag}*"]).ok, "a hostile string was executed"


def test_cwd_is_quoted(transport):
    d = transport.base + "/dir with 'quote' $(x)"
    transport.run(["mkdir", "-p", d]).check()
    assert transport.run("pwd", cwd=d).out.strip() == d
    assert transport.run("pwd", cwd=transport.base + "/missing").exit_code == 125


def test_timeout_raises(transport):
    _, healthy = timed(transport.run, "sleep 0", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RemoteTimeout):
        transport.run("sleep 20", timeout=0.5)
    assert time.monotonic() - t0 < budget(healthy, 0.5)
    assert transport.run(["echo", "still usable"]).out == "still usable\n"


def test_put_get_binary_round_trip_and_mode(transport, tmp_path):
    data = bytes(range(256)) * 4099 + b"\r\n\x00tail"
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    os.chmod(src, 0o750)
    remote = transport.base + "/sub dir/file.bin"
    transport.put(src, remote)
    assert transport.run(["stat", "-c", "%a", remote]).out.strip() == "750"
    assert transport.run(["sha256sum", remote]).out.split()[0] == hashlib.sha256(data).hexdigest()
    assert transport.run(["sh", "-c", 'ls -a "$1" | grep -c orch-put', "-", transport.base + "/sub dir"]).out.strip() == "0"
    transport.put(b"small\x00", transport.base + "/b.bin", mode=0o600)
    assert transport.run(["stat", "-c", "%a", transport.base + "/b.bin"]).out.strip() == "600"

    dst = tmp_path / "out" / "copy.bin"
    assert transport.get(remote, dst) == len(data)
    assert dst.read_bytes() == data
    # incremental: only the new bytes move
    transport.run(["sh", "-c", 'printf "more\\377" >> "$1"', "-", remote]).check()
    assert transport.get(remote, dst, offset=len(data)) == 5
    assert dst.read_bytes() == data + b"more\xff"


def test_get_missing_file_fails_and_leaves_nothing(transport, tmp_path):
    with pytest.raises(Exception, match="reading"):
        transport.get(transport.base + "/nope", tmp_path / "x")
    assert not (tmp_path / "x").exists()
