"""orch check's checks as objects: the registry, each check's pinned probe sections, the rank
plan the caller made, and up reading hccn.conf once.

Each registered check's shell for two fixed clusters is pinned in
tests/fixtures/checks/sections/<check>.sh (a section two checks share, with the first), so an
accidental change in the probe shows up here.
After a deliberate change, regenerate them with

    ORCH_REGEN_SECTIONS=1 python3 -m pytest tests/unit/test_check_registry.py

and read the diff.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import checks, probes
from orchestrator.checks import base, names
from orchestrator.checks.runner import PREPARE
from orchestrator.errors import PlanError
from orchestrator.probes import SyncFile
from orchestrator.spec import Checks, Cluster, Host, Job, SshSettings
from orchestrator.supervisor import agent_home_name

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "checks"
SECTIONS = FIX / "sections"
REGEN = os.environ.get("ORCH_REGEN_SECTIONS") == "1"


def fixed_clusters() -> dict[str, Cluster]:
    """Two clusters that give every check something to probe (paths fixed: nothing from tmp)."""
    def hosts(user: str):
        return tuple(Host(name=f"n{i}", address=f"10.9.0.{i}", user=user, port=22 + (i == 2), slots=8,
                          devices=tuple(range(8))) for i in (1, 2, 3))

    common = dict(workdir="/data/it's job", sync=(), env={"PATH": "/opt/tools/bin:/usr/bin", "SECRET_X": "s"})
    ssh = SshSettings(connect_timeout=3, retries=2, command_timeout=40)
    return {
        "ascend-msrun": Cluster(name="a", path=Path("/nonexistent/cluster.yaml"), hosts=hosts("train"), ssh=ssh,
                                job=Job(launcher="msrun", platform="ascend", interface="auto",
                                        command=("python3", "-u", "train.py"), **common),
                                checks=Checks(versions=("python", "openmpi", "mindspore", "torch", "cann", "nccl",
                                                        "cuda-driver"))),
        "gpu-mpirun": Cluster(name="g", path=Path("/nonexistent/cluster.yaml"), hosts=hosts("root"), ssh=ssh,
                              job=Job(launcher="mpirun", platform="gpu", interface="eth1",
                                      mpirun_args=("--prefix", "/opt/ompi"), command=("/usr/bin/python3.11", "t.py"),
                                      **common)),
    }


def rendered(check: base.Check) -> str:
    """The check's own shell (a probe shared with an earlier check is pinned with that one) on the
    launch host and another host of each fixed cluster; a text already shown is named, not repeated."""
    earlier = {p.key for c in base.registered()[:base.registered().index(check)] for p in c.probes}
    own = replace(check, probes=tuple(p for p in check.probes if p.key not in earlier))
    out, seen = [], {}
    for label, c in fixed_clusters().items():
        plan = checks.make_check_plan(c, full_mesh=True, deep=True)
        plan = replace(plan, manifest=(SyncFile("train.py", 12, "ab" * 32), SyncFile("data/big bin", 1 << 30, None)),
                       reach_token="a" * 32 + "b" * 32,  # random per check; the launch host's listener as relayed:
                       reach=probes.ReachTarget(43121, ("10.9.0.1", "192.168.7.1"), 0.0))
        for h in (plan.launch, plan.hosts[1]):
            where = f"{h.name} of {label}"
            # the agent package's directory (reach's code cache) pinned as a placeholder, as in prepare.sh
            text = checks.check_script(plan, h, own).replace(agent_home_name(), "agent-HASH")
            out.append(f"# {check.name} on {where}" + (f": as on {seen[text]}\n" if text in seen else "\n" + text))
            seen.setdefault(text, where)
    return "\n".join(out)


def test_every_name_is_one_registered_check_and_spec_takes_them_from_the_registry():
    from orchestrator import spec

    got = base.registered()
    assert [c.name for c in got] == list(names.KNOWN_CHECKS) == list(spec.KNOWN_CHECKS)
    assert spec.KNOWN_CHECKS is names.KNOWN_CHECKS
    assert all(isinstance(c, base.Check) for c in got)
    assert all(c.judge or c.across or c.local for c in got), "a check that judges nothing"
    with pytest.raises(ValueError, match="registered twice"):
        base.register(got[0])
    with pytest.raises(ValueError, match="not in names.KNOWN_CHECKS"):
        base.register(base.Check("no-such-check"))


def test_spec_does_not_import_the_checks_probes_or_paramiko():
    code = ("import sys, orchestrator.spec\n"
            "bad = [m for m in ('orchestrator.probes', 'orchestrator.checks.base', 'paramiko') if m in sys.modules]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}).stdout
    assert out.strip() == "[]"


def test_the_device_health_module_loads_only_with_deep():
    """orchestrator/health.py (~12 ms) is loaded by `orch check --deep`, not by every check's start."""
    code = ("import sys\n"
            "from orchestrator.checks.base import registered\n"
            "registered()\n"
            "print('orchestrator.health' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", names.KNOWN_CHECKS)
def test_check_sections_are_pinned(name):
    """The shell each check puts into the probe, for two fixed clusters (launch host and another),
    is the pinned text; and the whole probe is valid sh."""
    text = rendered(base.check(name))
    pinned = SECTIONS / f"{name}.sh"
    if REGEN:
        SECTIONS.mkdir(parents=True, exist_ok=True)
        pinned.write_text(text)
    assert pinned.exists(), f"no pinned sections for {name}: run with ORCH_REGEN_SECTIONS=1"
    assert text == pinned.read_text(), f"the probe's shell of check {name} changed (ORCH_REGEN_SECTIONS=1 pins it)"
    assert subprocess.run(["sh", "-n"], input=text, text=True).returncode == 0


def test_up_probe_prepare_sections_are_pinned():
    """`orch up`'s probe reads prepare's facts too: the section `prepare` (what no check reads)
    and the path section reading the workdir's lock, pinned in prepare.sh, with every check and
    with the checks that read prepare's facts skipped (prepare then reads them itself). `orch
    check`'s probe has no prepare section."""
    out = []
    for label, c in fixed_clusters().items():
        for skip in ((), ("path", "workdir", "nic")):
            cl = replace(c, checks=replace(c.checks, skip=skip))
            assert "_b prepare" not in checks.probe_script(checks.make_check_plan(cl), cl.hosts[0])
            plan = checks.make_check_plan(cl, full_mesh=True, prepare=True)
            script = checks.probe_script(plan, plan.launch)
            path = checks.check_script(plan, plan.launch, base.check("path")) if "path" in plan.checks else ""
            own = "".join(probes.section_script(n, b) + "\n" for n, b in PREPARE.shell(plan, plan.launch))
            assert path.rstrip("\n") in script and own.rstrip("\n") in script
            out.append(f"# up's prepare on {plan.launch.name} of {label}, skip {list(skip)}\n{path}{own}")
    # the agent package's directory is named by its content's hash: pinned as a placeholder, so
    # that a change to the agent does not read as a change to the probe
    text = "\n".join(out).replace(agent_home_name(), "agent-HASH")
    pinned = SECTIONS / "prepare.sh"
    if REGEN:
        pinned.write_text(text)
    assert text == pinned.read_text(), "up's prepare sections changed (ORCH_REGEN_SECTIONS=1 pins them)"
    assert subprocess.run(["sh", "-n"], input=text, text=True).returncode == 0


def test_pinned_sections_are_the_probes():
    """The probe script is made of exactly the checks' pinned sections (plus its frame)."""
    for c in fixed_clusters().values():
        plan = checks.make_check_plan(c, full_mesh=True, deep=True)
        script = checks.probe_script(plan, plan.launch)
        for check in base.registered():
            for part in checks.check_script(plan, plan.launch, check).split("\n_b ")[1:]:
                name = part.split("\n", 1)[0]
                if name != "mesh":  # started in the background, printed in its place
                    assert "_b " + part.rstrip("\n") in script, name


# --------------------------------------------------------------------------- the rank plan the caller made


def cpu_cluster(n=3, **job):
    hs = tuple(Host(name=f"h{i}", address=f"10.9.1.{i}", user="u") for i in range(1, n + 1))
    return Cluster(name="t", path=Path("/nonexistent/cluster.yaml"), hosts=hs,
                   job=Job(workdir="/w", command=("python3", "t.py"), **job))


def test_check_plan_takes_the_callers_rank_plan(monkeypatch):
    from orchestrator import rankplan as planning

    c = cpu_cluster()
    rp = planning.make_plan(c)
    monkeypatch.setattr(planning, "make_plan", lambda cluster: pytest.fail("planned again"))
    cp = checks.make_check_plan(c, rp)
    assert cp.rank_plan is rp and cp.hosts == rp.hosts and cp.launch == rp.launch_host
    (r,) = checks.judge_cluster_local(cp)
    assert r.check == "device-rules" and r.status == "pass" and r.message.startswith("3 ranks on 3 host(s)")
    bad = checks.make_check_plan(c, PlanError("impossible plan: x"))
    (r,) = checks.judge_cluster_local(bad)
    assert r.status == "fail" and r.message == "impossible plan: x"
    assert [h.name for h in bad.hosts] == ["h1", "h2", "h3"]


# --------------------------------------------------------------------------- hccn.conf once per `up`


class CountingTransport:
    def __init__(self, host, out):
        self.host, self.out, self.runs = host, out, []

    def run(self, argv, **kw):
        from orchestrator.transport.base import Result

        self.runs.append(argv)
        return Result(self.host.name, str(argv), 0, self.out.encode(), b"", 0.0)


class Pool:
    def __init__(self, cluster, transports):
        self.cluster, self.t = cluster, transports

    def __getitem__(self, h):
        return self.t[h.name]


def test_up_reads_hccn_conf_once_per_host():
    """What the check's probe read from /etc/hccn.conf is what the rank table gets: read_device_ips
    asks only the hosts the probe did not read it on."""
    from orchestrator import prepare
    from orchestrator.rankplan import make_plan

    c = cpu_cluster(2, launcher="ranktable", platform="ascend")
    c = replace(c, hosts=tuple(replace(h, slots=8, devices=tuple(range(8))) for h in c.hosts))
    rp = make_plan(c)
    sections = probes.split_sections((FIX / "probe-ascend-h1.txt").read_text())
    run = base.ProbeRun(rp.hosts[0], sections)
    from orchestrator.checks.devices import hccn_confs

    known = hccn_confs([run])
    assert set(known) == {rp.hosts[0].name} and len(known[rp.hosts[0].name]) == 8
    conf2 = "".join(f"address_{d}=192.168.{d}.2\nnetmask_{d}=255.255.255.0\n" for d in range(8))
    ts = {h.name: CountingTransport(h, conf2) for h in rp.hosts}
    ips = prepare.read_device_ips(rp, Pool(c, ts), known)
    assert ts[rp.hosts[0].name].runs == [] and len(ts[rp.hosts[1].name].runs) == 1
    assert ips[rp.hosts[0].name] == {d: dev.address for d, dev in known[rp.hosts[0].name].items()}
    assert ips[rp.hosts[1].name][3] == "192.168.3.2"
    prepare.read_device_ips(rp, Pool(c, ts))  # nothing known (--skip-checks): every host is read
    assert len(ts[rp.hosts[0].name].runs) == 1 and len(ts[rp.hosts[1].name].runs) == 2
