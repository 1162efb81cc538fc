"""known_hosts lookups (transport/ssh.py): the keys a host gets are the ones paramiko's own
HostKeys.load + lookup gives it (plain and |1| hashed names, several names on a line, the first
key of each type winning), found through an index instead of a scan of every line per host."""

from __future__ import annotations

import threading

import paramiko
import pytest
from paramiko.hostkeys import HostKeys

from orchestrator.transport import ssh


@pytest.fixture(scope="module")
def keys():
    return [paramiko.ECDSAKey.generate(bits=b) for b in (256, 256, 384, 521)]


def line(names: str, key) -> str:
    return f"{names} {key.get_name()} {key.get_base64()}\n"


def loaded(path: str, host_id: str) -> dict:
    client = paramiko.SSHClient()
    ssh._load_host_keys(client, path, host_id)
    got = client.get_host_keys().lookup(host_id)
    return {} if got is None else {k: got[k].get_base64() for k in got.keys()}


def paramikos(path: str, host_id: str) -> dict:
    hk = HostKeys()
    hk.load(path)
    got = hk.lookup(host_id)
    return {} if got is None else {k: got[k].get_base64() for k in got.keys()}


def test_same_keys_as_paramiko(tmp_path, keys):
    a, b, c, d = keys
    f = tmp_path / "known_hosts"
    f.write_text(
        "# a comment\n\n"
        + line("10.0.0.1,node1", a)
        + line("10.0.0.2", b)
        + line(HostKeys.hash_host("10.0.0.3"), c)
        + line("10.0.0.1", b)                     # the same type again: the first one wins
        + line("[10.0.0.1]:2222", d)
        + line(HostKeys.hash_host("10.0.0.1"), d)  # hashed, another type: added
        + line("node1,10.0.0.9,node1", c)
        + "".join(line(f"10.1.{i // 250}.{i % 250}", a) for i in range(300)))
    for host_id in ("10.0.0.1", "node1", "10.0.0.2", "10.0.0.3", "[10.0.0.1]:2222", "10.0.0.9", "10.1.0.7",
                    "10.0.0.4", "|1|x"):
        assert loaded(str(f), host_id) == paramikos(str(f), host_id), host_id
    assert len(loaded(str(f), "10.0.0.1")) == 2


def test_a_changed_file_is_read_again(tmp_path, keys):
    a, b, _, _ = keys
    f = tmp_path / "known_hosts"
    f.write_text(line("h1", a))
    assert loaded(str(f), "h2") == {}
    f.write_text(line("h1", a) + line("h2", b) + "# longer\n")
    assert loaded(str(f), "h2") == {b.get_name(): b.get_base64()}


def test_parsed_once_however_many_threads_ask(tmp_path, keys, monkeypatch):
    f = tmp_path / "known_hosts"
    f.write_text("".join(line(f"10.2.0.{i}", keys[0]) for i in range(50)))
    calls = []
    real = ssh.HostKeyEntry.from_line

    def counting(text, lineno=None):
        calls.append(lineno)
        return real(text, lineno)

    monkeypatch.setattr(ssh.HostKeyEntry, "from_line", staticmethod(counting))
    start = threading.Barrier(16)

    found = []

    def one(i):  # an assert here would only be printed by its thread: the main thread checks
        start.wait()
        found.append(bool(loaded(str(f), f"10.2.0.{i}")))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert found == [True] * 16 and len(calls) == 50
