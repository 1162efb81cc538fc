"""Sections a host's reach test (its python3) prints for the probe's sh (checks/reach.py GIVEN_PY):
the same text as the sh's commands, taken out of the reach section when the output is split, and
run by the sh where the python3 did not print them."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace

import pytest

from orchestrator import probes
from orchestrator.checks import reach
from orchestrator.checks.clock import CLOCK
from orchestrator.checks.devices import ASCEND
from orchestrator.checks.stale import STALE
from orchestrator.checks.user import USER
from orchestrator.checks.versions import VERSIONS
from orchestrator.devices import HCCN_CONF
from orchestrator.prepare import prepare_script

from .test_reach import cluster, host, plan_of

FUNCS = ("_b() { printf '%sbegin %s\\n' '@@orch:' \"$1\"; }\n"
         "_e() { printf '\\n%send %s %s\\n' '@@orch:' \"$1\" \"$2\"; }\n")


def commands(platform: str = "ascend") -> dict[str, str]:
    """{section: the sh's commands} of the sections the python3 can give, as the checks write them."""
    c = cluster([host(1), host(2)], platform=platform)
    plan = plan_of(c)
    out = {n: b for p in (CLOCK, USER, STALE, ASCEND, VERSIONS) for n, b in p.shell(plan, c.hosts[1])
           if n in reach.PYTHON_DOES}
    out["prepare"] = prepare_script(c, read=("arch",))
    return out


def by_sh(cmds: dict[str, str], hccn: str) -> dict[str, probes.Section]:
    script = FUNCS + "\n".join(probes.section_script(n, b.replace(HCCN_CONF, hccn)) for n, b in cmds.items())
    out = subprocess.run(["sh", "-c", script], capture_output=True, timeout=60).stdout
    return probes.split_sections(out.decode("utf-8", "replace"))


def run_given(names, program: str = "", prelude: str = "", **env: str) -> subprocess.CompletedProcess:
    """GIVEN_PY (or `program`) for the sections `names`, after `prelude`, with `env` beside the
    names, by the python3 on PATH, as on a host: the one the sh's `python3 --version` finds."""
    env = {**os.environ, reach.GIVEN_ENV: " ".join(names), reach.SELF_ENV: "1", **env}
    return subprocess.run([shutil.which("python3") or sys.executable, "-S", "-c", prelude + (program or reach.GIVEN_PY)],
                          capture_output=True, env=env, timeout=60)


def given_sections(out: str) -> dict[str, probes.Section]:
    """The program's output as the probe's reach section carries it, split."""
    return probes.split_sections(f"@@orch:begin reach\n{out}\n@@orch:end reach 0\n")


def given_out(got: subprocess.CompletedProcess) -> dict[str, probes.Section]:
    """run_given's output, split (given_sections)."""
    return given_sections(got.stdout.decode())


def by_python(names, hccn: str, self_pid: str = "4242") -> tuple[dict[str, probes.Section], str]:
    got = run_given(names, reach.GIVEN_PY.replace(HCCN_CONF, hccn) + "print('rest')\n", **{reach.SELF_ENV: self_pid})
    assert got.returncode == 0, got.stderr
    out = got.stdout.decode("utf-8", "replace")
    return given_sections(out), out


@pytest.fixture
def stale_process():
    """A process of a run, as an earlier run's would be: both ways must find it."""
    run = f"given-{uuid.uuid4().hex[:8]}"
    p = subprocess.Popen(["sleep", "60"], env={**os.environ, "ORCH_RUN_ID": run})
    yield run, p.pid
    p.kill()
    p.wait()


@pytest.mark.parametrize("conf", [None, b"address_0=10.0.0.1\nnetmask_0=255.255.255.0\n", b"address_0=10.0.0.1",
                                  b"\xff\xfe odd bytes\n\n"])
def test_the_python3_prints_each_section_as_the_sh_does(tmp_path, conf, stale_process):
    hccn = str(tmp_path / "hccn.conf")
    if conf is not None:
        (tmp_path / "hccn.conf").write_bytes(conf)
    cmds = commands()
    assert set(cmds) == set(reach.PYTHON_DOES) - {"workdir", "df", "nic"}   # those: their own tests below
    t0 = time.time()
    sh_out = by_sh(cmds, hccn)
    py_out, text = by_python(cmds, hccn)
    t1 = time.time()
    for name in ("user", "hccn", "prepare", "ver:python"):
        assert (py_out[name].body, py_out[name].rc) == (sh_out[name].body, sh_out[name].rc), name
    # the clock: a time as `date +%s.%N` prints it, taken while it ran
    got = [probes.parse_clock(out["clock0"].body) for out in (sh_out, py_out)]
    assert all(t0 - 0.01 <= t <= t1 + 0.01 for t in got), (got, t0, t1)
    assert len(py_out["clock0"].body.strip().split(".")[1]) == 9 and py_out["clock0"].rc == 0
    run, pid = stale_process
    assert probes.parse_stale(py_out["stale"].body)[run] == [pid] == probes.parse_stale(sh_out["stale"].body)[run]
    assert py_out["stale"].rc == sh_out["stale"].rc == 0
    assert py_out["stale"].body.startswith("self=4242\n")   # the probe's shell, as the sh's `echo self=$$`
    assert py_out["reach"].body == "rest\n"                  # what the program prints after them is its own
    assert text.startswith(probes.GIVEN_BEGIN + "\n")


def test_the_commands_the_python3_stands_for_are_the_checks_own():
    # GIVEN_PY does these commands' work: a check that changes one must change GIVEN_PY too
    # (the test above compares their output on this machine)
    assert commands() == {"clock0": "date +%s.%N", "user": "id -un",
                          "hccn": f"if [ -f {HCCN_CONF} ]; then cat {HCCN_CONF}; else echo orch:not-installed; fi",
                          "stale": "echo self=$$\nLC_ALL=C grep -a -s -z -H -o '^ORCH_RUN_ID=[ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                   "abcdefghijklmnopqrstuvwxyz0123456789._-]*' /proc/[0-9]*/environ | tr '\\0' '\\n'\ntrue",
                          "prepare": "echo arch $(uname -m)\n",
                          "ver:python": "if command -v python3 >/dev/null 2>&1; then $T python3 --version 2>&1; "
                                        "else echo orch:not-installed; fi"}


def test_a_program_cut_off_while_giving_leaves_its_sections_cut_off():
    out = (f"@@orch:begin reach\n{probes.GIVEN_BEGIN}\n@@orch:begin user\nroot\n\n@@orch:end user 0\n"
           "@@orch:begin stale\nself=1\n\n@@orch:end reach 137\n")
    got = probes.split_sections(out)
    assert got["user"].rc == 0 and got["user"].body == "root\n"
    assert got["stale"].rc is None   # judged "cut off", not missing
    assert got["reach"].rc == 137 and got["reach"].body == ""


def test_a_sections_own_text_is_not_taken_for_given_sections():
    # only the lead's section (GIVEN_BY) carries them: a file's content cannot, in its place
    out = ("@@orch:begin hccn\nx\n@@orch:begin user\nroot\n\n@@orch:end user 0\n\n@@orch:end hccn 0\n")
    assert set(probes.split_sections(out)) == {"hccn"}
    out = (f"@@orch:begin hccn\n{probes.GIVEN_BEGIN}\n@@orch:begin user\nroot\n\n@@orch:end user 0\n"
           f"{probes.GIVEN_END}\n\n@@orch:end hccn 0\n")
    assert set(probes.split_sections(out)) == {"hccn"}


def test_python3s_own_warning_before_the_given_sections_leaves_them_given():
    """python3 may print a warning of its own first (its stderr is the section's: PYTHONWARNINGS
    it cannot read, say), then exit 0: the sh trusts the status and does not run them; the
    sections are still taken out, and the warning stays in the lead's own section."""
    given = ("user",)
    printed = (f"printf '%s\\n' 'Invalid -W option ignored' '{probes.GIVEN_BEGIN}' '@@orch:begin user' "
               f"from-python '' '@@orch:end user 0' '{probes.GIVEN_END}' tested")
    got = run_probe(printed, given)
    assert got["user"].body == "from-python\n" and got["user"].rc == 0
    assert got[reach.SECTION].body == "Invalid -W option ignored\ntested\n"


def run_probe(program: str, given: tuple[str, ...], ran: bool = True) -> dict[str, probes.Section]:
    """The probe with a lead section `reach` whose `program` gives `given`; `ran`: its body says
    the program ran (GIVEN_VAR), as the reach test's does where python3 is there."""
    body = [("user", "echo from-sh"), ("path", "echo path")]
    lead = f"{probes.GIVEN_VAR}=1\n{program}" if ran else program
    script = probes.assemble("h", [("clock0", "echo 1")], [], body, [("clock1", "echo 2")],
                             given=given, lead=[("reach", lead)])
    out = subprocess.run(["sh", "-c", script], capture_output=True, timeout=60).stdout.decode()
    return probes.split_sections(out)


def test_the_sh_runs_a_given_section_where_the_program_did_not_print_it():
    given = ("user",)
    printed = (f"printf '%s\\n' '{probes.GIVEN_BEGIN}' '@@orch:begin user' from-python '' '@@orch:end user 0' "
               f"'{probes.GIVEN_END}' tested")
    got = run_probe(printed, given)
    assert got["user"].body == "from-python\n" and got["reach"].body == "tested\n" and got["path"].rc == 0
    # no python3 (the body never started it); it failed (its status, even after it printed some)
    for program, ran in (("echo orch:not-installed", False), ("sh -c 'exit 3'", True), (printed + "; false", True)):
        got = run_probe(program, given, ran)
        assert got["user"].body == "from-sh\n" and got["user"].rc == 0, program
        assert got["reach"].rc == (3 if "exit 3" in program else 1 if "false" in program else 0)
    # a frame's section given too: the sh's clock where the program did not give it
    got = probes.split_sections(subprocess.run(["sh", "-c", probes.assemble(
        "h", [("clock0", "echo 1")], [], [], [("clock1", "echo 2")], given=("clock0", "clock1"),
        lead=[("reach", "false")])], capture_output=True, timeout=60).stdout.decode())
    assert (got["clock0"].body, got["clock1"].body, got["reach"].rc) == ("1\n", "2\n", 1)
    assert "from-sh" in probes.assemble("h", [], [], [("user", "echo from-sh")], [],
                                        lead=[("reach", "true")])   # nothing given


@pytest.mark.parametrize("platform", ["ascend", "gpu"])
def test_given_applies_where_the_test_runs_python3(platform):
    c = cluster([host(1), host(2)], platform=platform)
    assert reach.given(plan_of(c), c.hosts[1]) == ()   # no listener known yet: no test, no python3
    with_port = plan_of(c, reach=probes.ReachTarget(port=1, addresses=("127.0.0.1",)))
    assert set(reach.given(with_port, c.hosts[1])) == {"clock0", "user", "stale", "ver:python", "workdir", "df", "nic"} | (
        {"hccn"} if platform == "ascend" else set())
    assert reach.given(with_port, c.hosts[0]) == ()   # the launch host runs the listener
    assert set(reach.given(plan_of(c, reach=with_port.reach, checks=tuple(x for x in with_port.checks if x != "user")),
                           c.hosts[1])) \
        == {"clock0", "stale", "ver:python", "workdir", "df", "nic"} | ({"hccn"} if platform == "ascend" else set())
    other = cluster([host(1), host(2)], platform=platform, env={"PATH": "/opt/py/bin:/usr/bin"})   # tools elsewhere
    assert "ver:python" not in reach.given(plan_of(other, reach=with_port.reach), other.hosts[1])


def workdir_case(root, case: str) -> str:
    """A workdir under `root` in one of the states the section tells apart."""
    top = root / "top"
    top.mkdir(mode=0o755)
    if case == "exists":
        (top / "w").mkdir()
        return str(top / "w")
    if case == "missing":
        return str(top / "new" / "w")
    if case in ("under-a-file", "parent-not-a-dir"):
        (top / "f").write_text("x")
        return str(top / "f" / "w") if case == "under-a-file" else str(top / "f" / "a" / "b")
    if case == "link":
        (top / "real").mkdir(mode=0o700)
        (top / "ln").symlink_to(top / "real")
        return str(top / "ln")
    if case == "link-to-a-file":   # readlink -f fails: the parents as named, a link's own mode
        (top / "f").write_text("x")
        (top / "ln").symlink_to(top / "f")
        return str(top / "ln" / "w")
    if case == "dot-dot":   # mkdir -p: ok where the path, once walked, exists
        (top / "w").mkdir()
        return str(top / "x" / ".." / "w")
    if case == "not-ascii":
        return str(top / "données")
    if case == "group-writable":
        (top / "g").mkdir()
        os.chmod(top / "g", 0o775)
        return str(top / "g")
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["exists", "missing", "under-a-file", "parent-not-a-dir", "link", "link-to-a-file",
                                  "dot-dot", "not-ascii", "group-writable"])
def test_the_python3_reads_the_workdir_as_the_sh_does(tmp_path, case):
    from orchestrator.checks.workdir import WORKDIR

    c = cluster([host(1), host(2)])
    body = dict(WORKDIR.shell(plan_of(c), c.hosts[1]))["workdir"]
    assert body.startswith("W=/data/job\n")
    got = {}
    for way in ("sh", "python"):
        root = tmp_path / way
        root.mkdir()
        w = workdir_case(root, case)
        if way == "sh":
            out = subprocess.run(["sh", "-c", FUNCS + probes.section_script("workdir", f"W={shlex.quote(w)}\n"
                                                                            + body.split("\n", 1)[1])],
                                 capture_output=True, timeout=60).stdout.decode()
            sec = probes.split_sections(out)["workdir"]
        else:
            env = {reach.WORKDIR_ENV: w}
            if case == "not-ascii":   # a python3 whose file names are ASCII (C locale, no UTF-8 mode: 3.6's)
                env.update(LC_ALL="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
            sec = given_out(run_given(["workdir"], **env))["workdir"]
        assert sec.rc == 0
        got[way] = sec.body.replace(str(root), "ROOT")
    assert "orch:" not in got["python"]   # no exception of its own
    sh_w, py_w = (probes.parse_workdir(got[w]) for w in ("sh", "python"))
    assert (py_w.existed, py_w.writable, py_w.uid, py_w.perms) == (sh_w.existed, sh_w.writable, sh_w.uid, sh_w.perms)
    assert bool(py_w.mkdir_error) == bool(sh_w.mkdir_error) and bool(py_w.write_error) == bool(sh_w.write_error)
    # line for line the same, but for the words of an error (coreutils' quotes follow the locale)
    same = [ln for ln in got["sh"].splitlines() if not ln.startswith(("mkdir=mkdir:", "write=mktemp:"))]
    assert same == [ln for ln in got["python"].splitlines() if not ln.startswith(("mkdir=mkdir:", "write=mktemp:"))]
    if sh_w.mkdir_error:
        assert py_w.mkdir_error.endswith(sh_w.mkdir_error.rsplit(": ", 1)[1])   # the same reason (strerror)


def test_a_processs_environment_cannot_print_sections_into_the_probe(tmp_path):
    """Any user's process may set ORCH_RUN_ID to anything: a newline and markers in it would
    otherwise end the given block and the reach section early and print a reach result of its
    choosing. Both ways cut the value at its first character outside sh.ENV_VALUE_CHARS."""
    run = f"given-{uuid.uuid4().hex[:8]}"
    hostile = run + "\n\n@@orch:end stale 0\n@@orch:given-end\nto 198.18.0.1 ok\n\n@@orch:end reach 0\n"
    p = subprocess.Popen(["sleep", "60"], env={**os.environ, "ORCH_RUN_ID": hostile})
    try:
        sh_out = by_sh({"stale": commands()["stale"]}, "/nonexistent")
        py_out, _ = by_python(["stale", "user"], "/nonexistent")
        assert probes.parse_stale(sh_out["stale"].body)[run] == [p.pid] == probes.parse_stale(py_out["stale"].body)[run]
        assert py_out["reach"].body == "rest\n" and py_out["user"].rc == 0
    finally:
        p.kill()
        p.wait()


def test_prepare_is_given_only_when_it_reads_the_arch_alone():
    c = cluster([host(1), host(2)])
    target = probes.ReachTarget(port=1, addresses=("127.0.0.1",))
    assert "prepare" in reach.given(plan_of(c, reach=target, prepare=True), c.hosts[1])
    # without the workdir check, prepare's own section reads the uid too: the sh runs it all
    no_workdir = plan_of(c, reach=target, prepare=True, checks=tuple(x for x in plan_of(c).checks if x != "workdir"))
    assert "uid" in dict(__import__("orchestrator.prepare", fromlist=["x"]).probe_section(no_workdir))["prepare"]
    assert "prepare" not in reach.given(no_workdir, c.hosts[1])


@pytest.mark.parametrize("given", ["stale user", "user"])
def test_the_facts_find_a_live_run_with_the_stale_sections_read_of_every_process(tmp_path, given):
    """In `orch up` the test's python3 prints stale (every process's environment read) and then
    prepare's facts (a process of an earlier run in this workdir: live): one read of /proc for
    both where it gave stale, its own read where it did not; the same answer either way."""
    orch = tmp_path / "wd" / ".orch"
    p = subprocess.Popen(["sleep", "60"], env={**os.environ, "ORCH_RUN_DIR": f"{orch}/R9/", "ORCH_RUN_ID": "R9"})
    try:
        program = reach.connect_program(facts=True, listing=False, given_first=True)
        counting = ("import os\nreal=os.listdir\nn=[0]\n"
                    "def listdir(p='.'):\n n[0]+=p=='/proc'\n return real(p)\n"
                    "os.listdir=listdir\n"   # the program ends by os._exit: the count first
                    "quit=os._exit\nos._exit=lambda c:(print('proc read', n[0], flush=True),quit(c))\n"
                    f"exec(compile({program!r},'p','exec'))\n")
        env = {**os.environ, reach.GIVEN_ENV: given, reach.SELF_ENV: "1", reach.ENV_IN: "a", reach.ENV_OUT: "b",
               "ORCH_FACTS_LOCK": str(orch / "lock"), "ORCH_FACTS_HOME": str(orch / "agent-x")}
        out = subprocess.run([shutil.which("python3") or sys.executable, "-S", "-c", counting, "0", "1", "1"],
                             capture_output=True, env=env, timeout=60, text=True)
    finally:
        p.kill()
        p.wait()
    assert out.returncode == 0, out.stderr
    assert "\nlive R9\n" in out.stdout and out.stdout.endswith("proc read 1\n"), out.stdout[-400:]
    if "stale" in given:
        assert "/environ:ORCH_RUN_ID=R9\n" in out.stdout


@pytest.mark.parametrize("where", ["tmp", "missing", "root", "proc", "shm"])
def test_the_python3_gives_df_as_df_does(tmp_path, where):
    """df -Pk of the workdir's nearest directory: the same filesystem, mount point and size from
    the python3 (os.statvfs, /proc/self/mounts) as from df; the space free as of its own read."""
    from orchestrator.checks.disk import DF

    w = {"tmp": str(tmp_path), "missing": str(tmp_path / "no" / "such"), "root": "/", "proc": "/proc/self",
         "shm": "/dev/shm"}[where]
    if not os.path.isdir(w.rsplit("/no/", 1)[0]):
        pytest.skip(f"{w} is not on this machine")
    c = cluster([host(1), host(2)])
    c = replace(c, job=replace(c.job, workdir=w))
    body = dict(DF.shell(plan_of(c), c.hosts[1]))["df"]
    sh_out = by_sh({"df": body}, HCCN_CONF)["df"]
    got = run_given(["df"], **{reach.WORKDIR_ENV: w})
    assert got.returncode == 0, got.stderr
    py_out = given_out(got)["df"]
    a, b = probes.parse_df(py_out.body), probes.parse_df(sh_out.body)
    assert (a.filesystem, a.mount, a.total_kib, py_out.rc) == (b.filesystem, b.mount, b.total_kib, sh_out.rc)
    assert abs(a.avail_kib - b.avail_kib) <= max(a.total_kib // 100, 1024)   # a live filesystem
    assert py_out.body.splitlines()[0] == sh_out.body.splitlines()[0].rstrip() or \
        py_out.body.split()[:6] == sh_out.body.split()[:6]   # df's header, its words


@pytest.mark.parametrize("netlink", [True, False])
def test_the_python3_gives_nic_as_ip_does(netlink):
    """The host's addresses as `ip -o addr show` lists them (netlink's RTM_GETADDR, as ip asks):
    the same interfaces, addresses and prefixes, in ip's order; where netlink is refused (a
    sandbox), ip's own output, as the sh's section would print it."""
    from orchestrator.checks.nic import NIC

    c = cluster([host(1), host(2)])
    body = dict(NIC.shell(plan_of(c), c.hosts[1]))["nic"]
    assert shutil.which("ip"), "no `ip` here to compare with: iproute2 is one of the test dependencies"
    refuse = "" if netlink else ("import _socket\nreal=_socket.socket\n_socket.socket=lambda f,*a:"
                                 "(_ for _ in ()).throw(PermissionError(1,'refused')) if f==16 else real(f,*a)\n")
    for _ in range(5):   # the machine's interfaces may change meanwhile (labs made or removed): read again
        before = probes.parse_ip_addrs(by_sh({"nic": body}, HCCN_CONF)["nic"].body)
        got = run_given(["nic"], prelude=refuse)
        after = probes.parse_ip_addrs(by_sh({"nic": body}, HCCN_CONF)["nic"].body)
        if before == after:
            break
    assert got.returncode == 0, got.stderr
    sec = given_out(got)["nic"]

    def order(addrs):   # ip's own order varies with the kernel (its device walk)
        return sorted(addrs, key=lambda a: (a.ifname or "", a.address))

    assert sec.rc == 0 and order(probes.parse_ip_addrs(sec.body)) == order(before) == order(after)
    assert ("valid_lft" in sec.body) == (not netlink)   # ip's own words only where it ran ip


@pytest.mark.parametrize("prepare", [False, True])
def test_a_host_whose_test_runs_python3_runs_none_of_the_given_commands(tmp_path, prepare):
    """The real probe of a host whose reach test runs python3 (`orch check`'s, `orch up`'s), run
    here: each section the program gives comes once, from it; the sh runs none of those commands
    (no loopback listener: the test says the connection was refused, and exits 0)."""
    from orchestrator.checks import runner

    c = cluster([host(1), host(2)])
    c = replace(c, job=replace(c.job, workdir=str(tmp_path / "w")))
    plan = plan_of(c, reach=probes.ReachTarget(port=1, addresses=("127.0.0.1",)), **({"prepare": True} if prepare else {}))
    given = reach.given(plan, c.hosts[1])
    assert {"clock0", "user", "stale", "workdir", "df", "nic"} <= set(given)
    script = runner.probe_script(plan, c.hosts[1])
    out = subprocess.run(["sh", "-c", script], stdin=subprocess.DEVNULL, capture_output=True, timeout=60).stdout.decode()
    sections = probes.split_sections(out)
    assert sections[reach.SECTION].rc == 0 and "to 127.0.0.1 " in sections[reach.SECTION].body, out[-600:]
    block = out[out.index(probes.GIVEN_BEGIN):out.index(probes.GIVEN_END)]
    for name in given:
        assert out.count(f"@@orch:begin {name}\n") == 1 and f"@@orch:begin {name}\n" in block, name
        assert sections[name].rc is not None, name


def test_a_given_section_that_hangs_ends_the_program_and_the_sh_runs_them_all(tmp_path):
    """statvfs on a dead NFS mount never returns: the program's alarm (SECTION_TIMEOUT, 1 s here)
    ends it, a status other than 0, so the sh runs every given section itself, each under its own
    timeout (probes.assemble's fallback: test_the_sh_runs_a_given_section_where_...)."""
    prelude = ("import os,time,_signal\nos.statvfs=lambda p:time.sleep(3600)\n"   # past run_given's 60 s
               "real=_signal.alarm\n_signal.alarm=lambda n:real(1 if n else 0)\n")
    got = run_given(["user", "df"], reach.GIVEN_PY + "print('rest')\n", prelude, **{reach.WORKDIR_ENV: str(tmp_path)})
    assert got.returncode == -signal.SIGALRM   # the alarm's, not the test's time-out (TimeoutExpired)
    assert b"rest" not in got.stdout
