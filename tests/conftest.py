"""Fixtures for every test directory that uses the simulated cluster (orchestrator/lab/).

`lab`: a session-wide 3-host lab (name ``t<pid>``), torn down at the end.
`dual_homed_lab`: a session-wide 3-host lab made with --dual-homed-head (name ``d<pid>``): host 1
is the only host this machine reaches and the others' jump host (see the fixture).
`lab_factory(letter, n, vary=..., refuse_key=..., slurm=..., **topology)`: more labs (name
``<letter><pid>``), each torn down at the end of the session (or earlier by the test);
`topology` is Lab.up's ssh_port, user, bastion, dual_homed_head (``fx_lab`` in tests/faults
passes them on too).

These skip only where this machine cannot make a lab (not root, not Linux, no network
namespaces), saying why; with ``CI`` set in the environment they fail instead.

Hypothesis: with ``CI`` set the "ci" profile is loaded (the same examples on every run, so a red
build is a change in the code, never a new seed); elsewhere the default profile draws new examples
each run. An input that found a bug is pinned with ``@example`` on its test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=100, deadline=None, database=None,
                          print_blob=True)
# Loaded before any test module is imported: their settings(...) start from it. (Hypothesis itself
# would load its own "ci" profile when CI is set at all, even empty.)
settings.load_profile("ci" if os.environ.get("CI") else "default")


def pytest_configure(config) -> None:
    """Tests never read the user's real ~/.ssh (config, keys, known_hosts): HOME is a fresh empty
    directory for the whole session, for orch and everything it starts. Packages installed with
    `pip install --user` stay visible (PYTHONUSERBASE keeps the real one)."""
    import site
    import tempfile

    if os.environ.get("ORCH_TEST_HOME"):  # already done (a pytest started by a test)
        return
    os.environ.setdefault("PYTHONUSERBASE", site.getuserbase())
    home = tempfile.mkdtemp(prefix="orch-test-home-")
    os.environ["HOME"] = os.environ["ORCH_TEST_HOME"] = home
    config._orch_test_home = home


def pytest_unconfigure(config) -> None:
    home = getattr(config, "_orch_test_home", None)
    if home:
        shutil.rmtree(home, ignore_errors=True)


def _lab_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"the lab needs Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, a bridge, bind mounts)"
    unshare = shutil.which("unshare", path=os.environ.get("PATH", "") + ":/usr/bin:/bin")
    ip = shutil.which("ip", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if not unshare or not ip:
        return "ip netns impossible here: `ip` (iproute2) or `unshare` (util-linux) is missing"
    res = subprocess.run([unshare, "--net", ip, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1"],
                         capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        return f"ip netns impossible here: a network namespace with a veth pair failed: {res.stderr.strip()}"
    return None


def _require_lab() -> None:
    why = _lab_unavailable()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but the lab cannot run: {why}")
    pytest.skip(why)


def _require_slurm() -> None:
    """Slurm labs need Debian's slurm-wlm and munge (scripts/test.sh installs them as root)."""
    from orchestrator.lab import slurm, which

    missing = sorted({pkg for tool, pkg in slurm.TOOLS.items() if which(tool) is None})
    if not missing:
        return
    why = f"a Slurm lab needs {', '.join(missing)} (apt-get install slurm-wlm munge)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {why}")
    pytest.skip(why)


def _name(letter: str) -> str:
    return f"{letter}{os.getpid() % 10_000_000}"


@pytest.fixture(scope="session")
def lab_factory():
    """Make labs: ``lab_factory("v", 4, vary=["2:openmpi=4.0.3"], refuse_key=[4])`` -> Lab."""
    _require_lab()
    from orchestrator.lab import Lab

    made: list[Lab] = []

    def make(letter: str, n: int, vary=None, refuse_key=(), name: str | None = None, slurm: bool = False,
             **topology) -> Lab:
        """`topology`: Lab.up's ssh_port, user, bastion, dual_homed_head."""
        if slurm:
            _require_slurm()
        lab = Lab(name or _name(letter))
        made.append(lab)
        return lab.up(n, vary=vary, refuse_key=refuse_key, slurm=slurm, **topology)

    make.name = _name  # type: ignore[attr-defined]  # a helper hung on the fixture's function
    yield make
    errors = []
    for lab in reversed(made):
        try:
            lab.down()
        except Exception as exc:  # noqa: BLE001 - tear down every lab, report all failures
            errors.append(f"{lab.name}: {exc}")
    if errors:
        pytest.fail("lab teardown failed: " + "; ".join(errors))


@pytest.fixture(scope="session")
def lab(lab_factory):
    """A running 3-host lab shared by the whole session."""
    return lab_factory("t", 3)


@pytest.fixture(scope="session")
def dual_homed_lab(lab_factory):
    """A running 3-host lab made with --dual-homed-head, shared by the whole session (tests that
    need another size, --user or --ssh-port: ``lab_factory(letter, n, dual_homed_head=True, ...)``).

    Network A (``lab.subnet``, this machine's bridge): this machine and host 1 only, at
    ``lab.host(1).address`` (what the inventory lists, with no jump and no mpi_address).
    Network B (``lab.hosts_subnet``, no address of this machine): host 1 again at
    ``lab.peer_address(1)`` and hosts 2..3 at ``lab.host(i).address``, which this machine
    reaches only through host 1 (inventory ``jump``, ssh_config ProxyJump, ``lab.ssh(i, ...)``).
    ``tests.support.connect_from(lab, i, address, port)`` tells who reaches what."""
    return lab_factory("d", 3, dual_homed_head=True)
