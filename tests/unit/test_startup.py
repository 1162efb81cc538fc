"""What the controller loads before its first connection (start-up time): what it does not need
until later is loaded when it is needed, and works the same then."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from orchestrator.errors import TransientNetworkError
from orchestrator.model import Host
from orchestrator.transport.ssh import SshTransport
from tests.support import REPO


class _Client:
    def get_transport(self):
        return object()


def test_a_connection_made_at_the_first_try_loads_no_tenacity():
    """tenacity (~5 ms of import) is loaded for a retry, not for a connection that needs none."""
    code = ("import sys\n"
            "from orchestrator.model import Host\n"
            "from orchestrator.transport.ssh import SshTransport\n"
            "t = SshTransport(Host(name='h', address='192.0.2.1', user='u'), connect_timeout=1, retries=3)\n"
            "class Client:\n"
            "    def get_transport(self): return object()\n"
            "t._open = lambda timeout: Client()\n"
            "t._connect(3)\n"
            "print('tenacity' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False"], out.stderr


@pytest.mark.parametrize("fails, tries, waits", [(0, 1, []), (1, 2, [0.2]), (2, 3, [0.2, 0.4]), (3, 3, [0.2, 0.4])])
def test_connect_retries_as_before_the_first_try_moved_out_of_tenacity(monkeypatch, fails, tries, waits):
    """Transient errors: ssh.retries tries in all, tenacity's waits between them (0.2 s, then
    doubling), the last error raised; the first try counts as one of them."""
    t = SshTransport(Host(name="h", address="192.0.2.1", user="u"), connect_timeout=1, retries=3)
    opened: list[float] = []
    slept: list[float] = []

    def open_(timeout):
        opened.append(timeout)
        if len(opened) <= fails:
            raise TransientNetworkError("h", f"try {len(opened)}: No route to host")
        return _Client()
    monkeypatch.setattr(t, "_open", open_)
    monkeypatch.setattr("tenacity.nap.time.sleep", slept.append)
    if fails >= tries:
        with pytest.raises(TransientNetworkError, match=f"try {tries}: No route"):
            t._connect(3)
    else:
        t._connect(3)
        assert t._transport is not None
    assert len(opened) == tries and slept == pytest.approx(waits)


def test_one_attempt_is_one_try_with_no_wait(monkeypatch):
    t = SshTransport(Host(name="h", address="192.0.2.1", user="u"), connect_timeout=1, retries=3)
    opened: list[float] = []

    def unreachable(timeout):
        opened.append(timeout)
        raise TransientNetworkError("h", "No route to host")
    monkeypatch.setattr(t, "_open", unreachable)
    with pytest.raises(TransientNetworkError):
        t._connect(1)
    assert len(opened) == 1


def _local_cluster(tmp_path):
    """A one-host cluster file on this machine (connection: local) in tmp_path."""
    (tmp_path / "cluster.yaml").write_text(f"""
inventory:
  hosts: [{{address: 127.0.0.1, name: me, connection: local}}]
job: {{workdir: {tmp_path / 'wd'}, command: [sh, -c, 'echo hi'], launcher: ranktable}}
checks: {{min_free_gib: 0.001}}
""")


def _program_says(code: str, argv: list[str], cwd) -> str:
    """Run `code` (a driver around cli.main()) as a program with `argv`; it must succeed; the last
    line of its output (what its atexit handler printed)."""
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, (argv, out.stderr)
    return out.stdout.splitlines()[-1]


def test_the_program_loads_without_the_cyclic_gc_then_freezes_what_it_loaded(tmp_path):
    """`orch check` and `orch up` as the program (main()): no collection while the modules and the
    cluster file load (cli._loading), what they made frozen (gc.freeze), the GC on again after."""
    _local_cluster(tmp_path)
    code = ("import atexit, gc, sys\n"
            "from orchestrator import cli, spec\n"
            "real, seen = spec.load_cluster, []\n"
            "def load_cluster(*a, **k):\n"
            "    seen.append(gc.isenabled())\n"
            "    return real(*a, **k)\n"
            "spec.load_cluster = load_cluster\n"
            "atexit.register(lambda: print('gc', seen, gc.isenabled(), gc.get_freeze_count() > 0))\n"
            "sys.argv = ['orch'] + sys.argv[1:]\n"
            "cli.main()\n")
    for argv in (["check", "--json"], ["up", "-q", "--skip-checks"]):
        assert _program_says(code, argv, tmp_path) == "gc [False] True True", argv


def test_up_and_plan_of_a_listed_inventory_do_not_load_the_slurm_client(tmp_path):
    """orchestrator.slurm (and the agent's cli it reads) is for a Slurm inventory: `orch up` and
    `orch plan` of listed hosts never import it (~6 ms of orch up's start)."""
    _local_cluster(tmp_path)
    code = ("import atexit, sys\n"
            "from orchestrator import cli\n"
            "atexit.register(lambda: print('slurm', 'orchestrator.slurm' in sys.modules))\n"
            "sys.argv = ['orch'] + sys.argv[1:]\n"
            "cli.main()\n")
    for argv in (["up", "-q"], ["plan"]):
        assert _program_says(code, argv, tmp_path) == "slurm False", argv
