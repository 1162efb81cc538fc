"""orch check: the probe script, its parsers and the judges, against captured real output.

Fixtures in tests/fixtures/checks/: captured on a real machine (mpirun 4.1.4, ompi_info,
ip, df, ss, /proc/net/tcp, python3 --version) and from real lab hosts (probe-*.txt: the
whole probe output of `orch check` on a host of `orch lab`); faithful samples for what
the machine lacks (mpirun 4.0.3, MPICH, hccn.conf, nvidia-smi, npu-smi, CANN, NCCL).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import checks, probes
from orchestrator.checks import CheckResult, ProbeRun, Report
from orchestrator.errors import AuthError, RemoteTimeout
from orchestrator.probes import ProbeError, Section, SyncFile
from orchestrator.spec import Checks, Cluster, Host, Job, SshSettings
from orchestrator.transport.base import BOOTSTRAP
from orchestrator.transport.base import Transport
from tests.support import listing_answer

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "checks"


def fx(name: str) -> str:
    return (FIX / name).read_text()


def host(i: int, prefix: str = "lab-h", net: str = "198.18.14", **kw) -> Host:
    return Host(name=f"{prefix}{i}", address=f"{net}.{10 + i}", user="root", **kw)


def cluster(tmp_path: Path | None = None, n: int = 4, hosts=None, checks_=None, **job) -> Cluster:
    base = {"workdir": "/data/job", "command": ("python3", "train.py")}
    base.update(job)
    path = (tmp_path or Path("/nonexistent")) / "cluster.yaml"
    return Cluster(name="t", path=path, hosts=tuple(hosts or [host(i) for i in range(1, n + 1)]),
                   job=Job(**base), ssh=SshSettings(connect_timeout=2, retries=2, command_timeout=30),
                   checks=checks_ or Checks())


def sec(name: str, body: str, rc: int | None = 0) -> Section:
    return Section(name, body, rc)


# --------------------------------------------------------------------------- versions parsers


@pytest.mark.parametrize("name, want", [
    ("mpirun-version-4.1.4.txt", "4.1.4"),
    ("mpirun-version-4.0.3.txt", "4.0.3"),
    ("ompi_info-4.1.4.txt", "4.1.4"),
    ("ompi_info--version-4.1.4.txt", "4.1.4"),
    ("mpirun-version-mpich-4.0.2.txt", "MPICH 4.0.2"),
])
def test_openmpi_version(name, want):
    assert probes.parse_openmpi_version(fx(name)) == want


@pytest.mark.parametrize("text", ["", "garbage-segfault.txt"])
def test_openmpi_version_garbage_is_a_clear_error(text):
    text = fx(text) if text else text
    with pytest.raises(ProbeError, match="mpirun --version"):
        probes.parse_openmpi_version(text)


def test_not_installed_is_a_state_not_an_error():
    for parse in (probes.parse_openmpi_version, probes.parse_python_version, probes.parse_cann_version,
                  probes.parse_cuda_driver_version, probes.parse_nccl_version):
        assert parse(probes.NOT_INSTALLED + "\n") is None
    assert probes.parse_dists(probes.NOT_INSTALLED, ["mindspore"]) == {"mindspore": None}


def test_python_version():
    assert probes.parse_python_version(fx("python3-version.txt")) == "3.11.7"
    assert probes.parse_python_version(fx("python2-version.txt")) == "2.7.18"
    with pytest.raises(ProbeError, match="python --version"):
        probes.parse_python_version("pyenv: python3: command not found")


def test_dists_from_real_probe_and_garbage():
    s = probes.split_sections(fx("probe-ascend-h2.txt"))
    assert probes.parse_dists(s["ver:dists"].body, ["mindspore", "torch"]) == {"mindspore": "2.2.14", "torch": None}
    with pytest.raises(ProbeError, match="did not report torch"):
        probes.parse_dists("Traceback (most recent call last):\nSyntaxError", ["torch"])
    with pytest.raises(ProbeError):
        probes.parse_dists("", ["torch"])


def test_nccl_version_sources():
    assert probes.parse_nccl_version(fx("nccl-ldconfig-readlink.txt")) == "2.18.3"
    assert probes.parse_nccl_version(fx("nccl-h-defines.txt")) == "2.21.5"
    lab = probes.split_sections(fx("probe-ascend-h4.txt"))["ver:nccl"].body  # real: lab host with nccl=2.18.3
    assert probes.parse_nccl_version(lab) == "2.18.3"
    # only the soname: the major version is all there is
    assert probes.parse_nccl_version(fx("ldconfig-p-nccl.txt")) == "2"
    assert probes.parse_nccl_version(probes.NOT_INSTALLED, {"nvidia-nccl-cu12": "2.20.5"}) == "2.20.5"
    with pytest.raises(ProbeError, match="NCCL"):
        probes.parse_nccl_version("what")


def test_cann_and_cuda_driver():
    assert probes.parse_cann_version(fx("ascend_toolkit_install.info")) == "7.0.0"
    assert probes.parse_cann_version("runtime_running_version=[7.0.0.5.242:7.0.0]\n") == "7.0.0"
    with pytest.raises(ProbeError, match="CANN"):
        probes.parse_cann_version("package_name=Ascend-cann-toolkit\n")
    assert probes.parse_cuda_driver_version(fx("proc-driver-nvidia-version.txt")) == "535.104.05"
    assert probes.parse_cuda_driver_version(fx("nvidia-smi-driver_version.txt")) == "535.104.05"
    with pytest.raises(ProbeError, match="NVIDIA driver"):
        probes.parse_cuda_driver_version(fx("nvidia-smi-failed.txt"))


# --------------------------------------------------------------------------- other parsers


def test_ip_addrs_all_three_formats_agree():
    j = probes.parse_ip_addrs(fx("ip-j-addr.json"))
    o = probes.parse_ip_addrs(fx("ip-o-addr.txt"))
    i = probes.parse_ip_addrs(fx("hostname-I.txt"))
    assert {(a.ifname, a.address, a.prefixlen) for a in j} == {(a.ifname, a.address, a.prefixlen) for a in o}
    assert ("eth0", "192.0.2.2", 24) in {(a.ifname, a.address, a.prefixlen) for a in o}
    assert {a.address for a in i} <= {a.address for a in o}
    assert all(a.ifname is None for a in i)
    for bad in ("", "   \n", "ip: command not found\nhostname: invalid option -- 'I'", "[{\"broken"):
        with pytest.raises(ProbeError):
            probes.parse_ip_addrs(bad)


def test_df():
    d = probes.parse_df(fx("df-Pk.txt"))
    assert d.mount == "/" and d.avail_kib == 83703892 and d.filesystem == "/dev/vda"
    spaced = "Filesystem 1024-blocks Used Available Capacity Mounted on\nmy disk 100 10 90 10% /mnt/a b\n"
    assert probes.parse_df(spaced) == probes.DiskFree("my disk", "/mnt/a b", 90, 100)
    for bad in ("", "df: /x: No such file or directory\n", "Filesystem ...\ngarbage\n"):
        with pytest.raises(ProbeError, match="df -Pk"):
            probes.parse_df(bad)


def test_listening_ports_proc_and_ss():
    assert 2024 in probes.parse_listening_ports(fx("proc-net-tcp.txt"))
    assert probes.parse_listening_ports(fx("ss-ltn.txt")) == {2024}
    lab = probes.split_sections(fx("probe-ascend-h1.txt"))["ports"].body  # real: something on 8118, sshd on 22
    ports = probes.parse_listening_ports(lab)
    assert 8118 in ports and 22 in ports and 0xBA70 not in ports  # an ESTABLISHED peer port is not listening
    for bad in ("", "garbage"):
        with pytest.raises(ProbeError):
            probes.parse_listening_ports(bad)


def test_hccn():
    conf = probes.parse_hccn(fx("hccn-910-8dev.conf"))
    assert sorted(conf) == list(range(8))
    assert conf[4] == probes.HccnDevice("192.168.100.102", "255.255.255.0")
    part = probes.parse_hccn(fx("hccn-partial-0-3.conf"))
    assert sorted(part) == [0, 1, 2, 3]
    assert probes.parse_hccn(fx("hccn-garbage.conf")) == {}
    assert probes.parse_hccn(probes.NOT_INSTALLED) is None


def test_gpus_and_npus():
    gpus = probes.parse_nvidia_smi_l(fx("nvidia-smi-L-a100x8.txt"))
    assert sorted(gpus) == list(range(8)) and gpus[0] == "NVIDIA A100-SXM4-80GB"
    assert sorted(probes.parse_nvidia_smi_l(fx("nvidia-smi-L-mig.txt"))) == [0, 1]
    with pytest.raises(ProbeError, match="no GPU"):
        probes.parse_nvidia_smi_l(fx("nvidia-smi-failed.txt"))
    npus = probes.parse_npu_smi(fx("npu-smi-info-910b.txt"))
    assert sorted(npus) == list(range(8)) and npus[0] == "OK" and npus[5] == "Warning"
    with pytest.raises(ProbeError, match="no NPU"):
        probes.parse_npu_smi("dcmi module initialize failed. ret is -8005\n")


def test_stale_excludes_the_probe_itself():
    body = probes.split_sections(fx("probe-ascend-h1.txt"))["stale"].body
    assert probes.parse_stale(body) == {"20250101-120000-ab12": [24524]}
    assert probes.parse_stale("self=5\n/proc/5/environ:ORCH_RUN_ID=x\n") == {}
    assert probes.parse_stale("") == {}


def test_clock_workdir_sha_mesh_path():
    assert probes.parse_clock("1795319782.823866973\n") == pytest.approx(1795319782.823866973)
    assert probes.parse_clock("1700000000.%N") == 1700000000.0  # a date without %N
    with pytest.raises(ProbeError):
        probes.parse_clock("Tue Jan 1")
    w = probes.parse_workdir("existed=no\nmkdir=mkdir: cannot create directory '/x': Permission denied\n")
    assert w.mkdir_error and not w.writable
    with pytest.raises(ProbeError):
        probes.parse_workdir("")
    h = "a" * 64
    assert probes.parse_sha256sum(f"{h}  net.py\n\\{h}  a\\nb\nsize 12 big.bin\n") == {
        "net.py": h, "a\nb": h, "big.bin": "size:12"}
    mesh = probes.parse_mesh(probes.split_sections(fx("probe-mpi-h1.txt"))["mesh"].body)
    assert mesh["chk-h2"] == (0, "") and mesh["chk-h4"][0] == 255 and "Connection refused" in mesh["chk-h4"][1]
    assert probes.parse_mesh(probes.NOT_INSTALLED) is None
    p = probes.parse_path(probes.split_sections(fx("probe-mpi-h1.txt"))["path"].body)
    assert p["tools"] == {"orted": "/usr/bin/orted", "mpirun": "/usr/bin/mpirun",
                          "python3": "/root/.pyenv/versions/3.11.7/bin/python3"}
    with pytest.raises(ProbeError):
        probes.parse_path("")


# --------------------------------------------------------------------------- sections


def test_sections_round_trip():
    parts = [sec("a", "x\ny"), sec("b", ""), sec("c", "ends with newline\n", 3), sec("d", "@@orch: not a marker")]
    got = probes.split_sections(probes.join_sections(parts))
    assert list(got.values()) == parts


def test_sections_banner_and_truncation():
    text = "Welcome to host\n" + probes.join_sections([sec("a", "1")]) + "@@orch:begin b\npartial"
    got = probes.split_sections(text)
    assert got["a"] == sec("a", "1") and got["b"] == sec("b", "partial", None)
    assert probes.split_sections("") == {} and probes.split_sections("garbage\n") == {}


def test_real_probe_output_has_every_section():
    s = probes.split_sections(fx("probe-ascend-h1.txt"))
    assert {"clock0", "user", "ver:python", "ver:dists", "ver:openmpi", "path", "nic", "hccn", "npu",
            "workdir", "df", "files", "ports", "stale", "mesh", "clock1"} <= set(s)
    assert all(x.finished for x in s.values())


# --------------------------------------------------------------------------- the probe script


def test_probe_script_is_pure_valid_sh_and_runs(tmp_path):
    c = cluster(tmp_path, workdir=str(tmp_path / "wd"), sync=("net.py",))
    (tmp_path / "net.py").write_text("print(1)\n")
    plan = checks.make_check_plan(c)
    a, b = checks.probe_script(plan, c.hosts[0]), checks.probe_script(plan, c.hosts[0])
    assert a == b
    assert subprocess.run(["sh", "-n"], input=a, text=True).returncode == 0
    # run as the transport runs it (BOOTSTRAP reads the whole script first): fed to `sh` itself, the
    # script's own `exec </dev/null` cut off whatever sh had not read yet (a flaky syntax error)
    out = subprocess.run(["sh", "-c", BOOTSTRAP], input=a, capture_output=True, text=True, timeout=60).stdout
    s = probes.split_sections(out)
    assert all(x.finished for x in s.values()), out
    assert probes.parse_workdir(s["workdir"].body).writable


def _counting(tmp_path: Path, tools: tuple[str, ...]) -> tuple[dict, Path]:
    """An environment whose PATH runs `tools` through wrappers that note each start in a log."""
    bin_, log = tmp_path / "counting-bin", tmp_path / "spawned"
    bin_.mkdir()
    for tool in tools:
        real = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        (bin_ / tool).write_text(f"#!/bin/sh\necho {tool} >> {log}\nexec {real} \"$@\"\n")
        (bin_ / tool).chmod(0o755)
    return {"PATH": f"{bin_}:/usr/bin:/bin"}, log


@pytest.mark.parametrize("link", [False, True])
def test_workdir_section_for_real_reads_every_parents_mode_with_one_stat(tmp_path, link):
    """The workdir's and each parent's mode and owner (of the real path, a link followed), in that
    order, read by one `stat` (not a stat and a dirname per directory: processes on every host)."""
    import os

    from orchestrator.checks.workdir import WORKDIR

    real = tmp_path / "a b" / "wd"
    real.mkdir(parents=True)
    (tmp_path / "a b").chmod(0o750)
    wd = real
    if link:
        wd = tmp_path / "link"
        wd.symlink_to(real)
    c = cluster(tmp_path, workdir=str(wd))
    plan = checks.make_check_plan(c)
    (name, body), = WORKDIR.shell(plan, c.hosts[0])
    env, log = _counting(tmp_path, ("stat", "dirname"))
    out = subprocess.run(["sh", "-c", body], capture_output=True, text=True, env=env, timeout=30).stdout
    w = probes.parse_workdir(out)
    want = [real, *real.parents]
    assert [p for _, _, p in w.perms] == [str(p) for p in want]
    assert [(m, u) for m, u, _ in w.perms] == [(os.stat(p).st_mode & 0o7777, os.stat(p).st_uid) for p in want]
    assert w.writable and w.existed and log.read_text().split() == ["stat"]


def test_probe_script_sections_follow_checks_and_roles(tmp_path):
    c = cluster(tmp_path, launcher="msrun", platform="ascend")
    plan = checks.make_check_plan(c)
    first, other = checks.probe_script(plan, c.hosts[0]), checks.probe_script(plan, c.hosts[1])
    assert "_b ports" in first and "_b ports" not in other  # master_port: launch host only
    assert "_b hccn" in first and "_b gpus" not in first
    assert "_b mesh" not in first  # msrun: no ssh between hosts, unless --full-mesh
    assert "_b mesh" in checks.probe_script(checks.make_check_plan(c, full_mesh=True), c.hosts[1])
    # ... or the launch host passes the code on (job.sync_via: launch-host): from it alone
    relay = checks.make_check_plan(cluster(tmp_path, launcher="msrun", platform="ascend", sync_via="launch-host"))
    assert relay.mesh_from == {c.hosts[0].name} and "_b mesh" in checks.probe_script(relay, c.hosts[0])
    from orchestrator.checks import mesh

    assert mesh.needed_by(relay) == mesh.SYNC_RELAY and mesh.needed_by(checks.make_check_plan(c)) == "--full-mesh"
    assert mesh.needed_by(checks.make_check_plan(cluster(tmp_path, launcher="mpirun"))) == "mpirun"
    skipped = replace(c, checks=Checks(skip=("disk", "stale", "versions")))
    s = checks.probe_script(checks.make_check_plan(skipped), c.hosts[0])
    assert "_b df" not in s and "_b stale" not in s and "ver:" not in s


def test_mesh_runs_from_the_launch_host_in_plan_order(tmp_path):
    """The mesh test runs the ssh that mpirun will run: the same address (mpi_address, else
    ssh_config's HostName, else address) and the same options (plm_rsh_args)."""
    hs = [Host(name="b", address="10.0.0.10", user="u", port=2222), Host(name="a", address="10.0.0.9", user="u"),
          Host(name="c", address="node-c", hostname="10.0.0.11", user="v", port=2222),
          Host(name="d", address="10.0.0.12", mpi_address="192.168.0.12", user="u", port=2222)]
    c = cluster(tmp_path, hosts=hs)
    plan = checks.make_check_plan(c)
    assert plan.launch.name == "a" and plan.mesh_from == {"a"}
    s = checks.probe_script(plan, c.host("a"))
    assert "ssh -o BatchMode=yes -o ConnectTimeout=2 -p 2222 10.0.0.10 true" in s
    assert "ssh -o BatchMode=yes -o ConnectTimeout=2 -p 2222 -l v 10.0.0.11 true" in s
    assert "ssh -o BatchMode=yes -o ConnectTimeout=2 -p 2222 192.168.0.12 true" in s
    assert "_b mesh" not in checks.probe_script(plan, c.host("b"))
    assert checks.make_check_plan(c, full_mesh=True).mesh_from == {"a", "b", "c", "d"}


def test_mesh_section_for_real_spends_processes_only_on_an_ssh_that_said_something(tmp_path):
    """The mesh section with a stand-in ssh: each target's line is `NAME\tRC\tWORDS`, its words
    one line of at most 300 characters; an ssh that said nothing (the usual case) costs no
    `tr`/`cut` (processes on the launch host, 31 of them at 32 hosts)."""
    from orchestrator.checks.mesh import mesh_body
    from orchestrator.probes import MeshTarget

    env, log = _counting(tmp_path, ("tr", "cut"))
    bin_ = Path(env["PATH"].split(":")[0])
    (bin_ / "ssh").write_text("#!/bin/sh\n[ \"$1\" = -G ] && exit 0\nfor a; do t=$a; done\n"
                              "for a; do [ \"$a\" = true ] && break; t=$a; done\n"
                              "case $t in bad) printf 'Permission denied\\t(publickey).\\nsecond line%0400d\\n' 0 >&2;"
                              " exit 255;; esac\nexit 0\n")
    (bin_ / "ssh").chmod(0o755)
    body = mesh_body([MeshTarget("h2", "good"), MeshTarget("h3", "bad"), MeshTarget("h4", "good")], 2, 30)
    out = subprocess.run(["sh", "-c", body], capture_output=True, text=True, env=env, timeout=60).stdout
    got = probes.parse_mesh(out)
    words = "Permission denied (publickey). second line" + "0" * 400
    assert got == {"h2": (0, ""), "h3": (255, words[:300].strip()), "h4": (0, "")}
    assert sorted(out.splitlines()) == ["h2\t0\t", f"h3\t255\t{words[:300]}", "h4\t0\t"]
    assert sorted(log.read_text().split()) == ["cut", "tr"]   # for h3 only


def test_probe_quotes_hostile_values(tmp_path):
    c = cluster(tmp_path, workdir="/data/it's; rm -rf /", env={"PATH": "/opt/$(reboot)/bin"},
                command=("python3", "x.py"))
    s = checks.probe_script(checks.make_check_plan(c), c.hosts[0])
    assert "W='/data/it'\"'\"'s; rm -rf /'" in s
    assert "export PATH='/opt/$(reboot)/bin'" in s
    assert subprocess.run(["sh", "-n"], input=s, text=True).returncode == 0


def test_path_applies_job_env_path_and_mpirun_prefix(tmp_path):
    c = cluster(tmp_path, env={"PATH": "/opt/mpi/bin:/usr/bin"}, mpirun_args=("--prefix", "/opt/mpi"))
    assert checks.launch_tools(c) == [("mpirun", "job"), ("orted", "/opt/mpi/bin/orted"), ("python3", "job")]
    s = checks.probe_script(checks.make_check_plan(c), c.hosts[0])
    assert "export PATH=/opt/mpi/bin:/usr/bin" in s and "[ -x /opt/mpi/bin/orted ]" in s


# --------------------------------------------------------------------------- judging one host (real output)


def run_of(c: Cluster, h: Host, name: str, t_send: float | None = None) -> ProbeRun:
    s = probes.split_sections(fx(name))
    r0 = probes.parse_clock(s["clock0"].body)
    t = r0 if t_send is None else t_send
    return ProbeRun(h, s, t_send=t, t_recv=t + 0.8, connect_time=0.1, addresses=checks.resolve_address(h.address))


def by_check(results):
    out = {}
    for r in results:
        out.setdefault(r.check, []).append(r)
    return out


def test_judge_real_lab_probe_ascend_msrun(tmp_path):
    (tmp_path / "train.py").write_text('print("train")\n')
    hs = [Host(name=f"chk-h{i}", address=f"198.18.14.{10 + i}", user="root", slots=8, devices=tuple(range(8)))
          for i in range(1, 5)]
    c = cluster(tmp_path, hosts=hs, launcher="msrun", platform="ascend", sync=("train.py",),
                checks_=Checks(versions=("python", "openmpi", "mindspore")))
    plan = checks.make_check_plan(c)
    r = by_check(checks.judge_host(plan, run_of(c, hs[0], "probe-ascend-h1.txt")))
    assert r["ssh"][0].status == "pass"
    assert r["user"][0].status == "warn" and "root" in r["user"][0].message
    assert r["nic"][0].status == "pass" and r["nic"][0].message == "198.18.14.11 on eth0"
    assert r["path"][0].status == "fail" and "msrun not found" in r["path"][0].message  # lab has no msrun
    assert r["devices"][0].status == "pass" and "npu-smi not found" in r["devices"][0].message
    assert r["workdir"][0].status == "pass" and r["disk"][0].status == "pass"
    assert r["ports"][0].status == "fail" and "8118" in r["ports"][0].message
    assert r["stale"][0].status == "warn" and "orch down --run 20250101-120000-ab12" in r["stale"][0].message
    assert r["files"][0].status == "pass" and "not synced yet" in r["files"][0].message
    assert r["clock"][0].status == "pass"
    h2 = by_check(checks.judge_host(plan, run_of(c, hs[1], "probe-ascend-h2.txt")))
    assert h2["files"][0].status == "warn" and "stale code" in h2["files"][0].message and "train.py" in \
        h2["files"][0].message
    h3 = by_check(checks.judge_host(plan, run_of(c, hs[2], "probe-ascend-h3.txt")))
    assert h3["files"][0].status == "pass" and "1 file(s) up to date" in h3["files"][0].message
    assert "ports" not in h3


def test_versions_across_real_lab_probes(tmp_path):
    hs = [Host(name=f"chk-h{i}", address=f"198.18.14.{10 + i}", user="root") for i in range(1, 5)]
    c = cluster(tmp_path, hosts=hs, checks_=Checks(versions=("python", "openmpi", "mindspore", "nccl")))
    plan = checks.make_check_plan(c)
    runs = [run_of(c, h, f"probe-ascend-h{i}.txt") for i, h in enumerate(hs, 1)]
    res = checks.judge_across(plan, runs)
    msgs = {r.message.split(":")[0]: r for r in res if r.check == "versions"}
    assert msgs["python"].message == "python: 3.11.7 on chk-h[1-2,4]; 3.10.12 on chk-h3"
    assert msgs["openmpi"].message == "openmpi: 4.1.4 on chk-h[1-2,4]; 4.0.3 on chk-h3"
    assert msgs["mindspore"].message == "mindspore: 2.10.0 on chk-h[1,3-4]; 2.2.14 on chk-h2"
    assert msgs["nccl"].message == "nccl: 2.18.3 on chk-h4; not installed on chk-h[1-3]"  # versions first
    assert all(r.host is None and r.status == "fail" for r in msgs.values())
    # cells: every host's versions cell shows the cluster-wide failure
    rep = Report(res, tuple(h.name for h in hs))
    assert all(rep.cells()[h.name]["versions"] == "fail" for h in hs)


def test_missing_section_is_an_error_not_a_crash(tmp_path):
    c = cluster(tmp_path)
    plan = checks.make_check_plan(c)
    s = dict(probes.split_sections(fx("probe-mpi-h1.txt")))
    del s["df"]
    s["nic"] = Section("nic", "2: eth0 inet", None)  # cut off
    s["user"] = Section("user", "", 1)
    run = ProbeRun(c.hosts[0], s, t_send=1.0, t_recv=1.1)
    r = by_check(checks.judge_host(plan, run))
    assert r["disk"][0].status == "error" and "no 'df' section" in r["disk"][0].message
    assert r["nic"][0].status == "error" and "cut off" in r["nic"][0].message
    assert r["user"][0].status == "error"
    assert r["workdir"][0].status == "pass"  # the rest still judged


def test_garbage_sections_give_errors(tmp_path):
    c = cluster(tmp_path, sync=())
    plan = checks.make_check_plan(c)
    names = ["clock0", "user", "ver:python", "ver:openmpi", "path", "nic", "workdir", "df", "stale", "mesh",
             "clock1"]
    for body in ("", "garbage \x00\xff", "@@orch:"):
        run = ProbeRun(c.hosts[0], {n: Section(n, body, 0) for n in names}, t_send=1.0, t_recv=1.1)
        res = checks.judge_host(plan, run)
        assert {r.status for r in res} <= {"pass", "warn", "fail", "error"}
        r = by_check(res)
        assert r["disk"][0].status == "error" and r["clock"][0].status == "error"
        assert r["versions"][0].status == "error"


def test_unreachable_host_fails_ssh_and_errors_the_rest(tmp_path):
    c = cluster(tmp_path)
    plan = checks.make_check_plan(c)
    err = AuthError("lab-h1", "password-free SSH to root@198.18.14.11 failed: key k was refused",
                    hint="run `ssh-copy-id ...`")
    res = checks.judge_host(plan, ProbeRun(c.hosts[0], None, err, "connect"))
    r = by_check(res)
    assert r["ssh"][0].status == "fail"
    assert r["ssh"][0].message == ("password-free SSH to root@198.18.14.11 failed: key k was refused; "
                                   "run `ssh-copy-id ...`")
    from orchestrator.errors import TransientNetworkError
    refused = TransientNetworkError("lab-h1", "connection to 198.18.14.11:22 refused")
    res = checks.judge_host(plan, ProbeRun(c.hosts[0], None, refused, "connect"))
    assert by_check(res)["ssh"][0].message == "root@198.18.14.11: connection to 198.18.14.11:22 refused"
    assert all(x.status == "error" for k, v in r.items() if k != "ssh" for x in v)
    assert "mesh" in r and "versions" in r
    res = checks.judge_host(plan, ProbeRun(c.hosts[1], None, RemoteTimeout("lab-h2", "timed out"), "probe"))
    assert by_check(res)["ssh"][0].message.startswith("connected to root@198.18.14.12 but the probe failed")


# --------------------------------------------------------------------------- pure cross-host judges


def test_versions_mismatch_message_and_normalisation():
    per = {"lab-h1": {"mindspore": "2.10.0"}, "lab-h2": {"mindspore": "2.10"}, "lab-h3": {"mindspore": "2.2.14"},
           "lab-h4": {"mindspore": "2.10.0"}}
    (r,) = checks.judge_versions(per, ["mindspore"], [])
    assert r == CheckResult("versions", None, "fail", "mindspore: 2.10.0 on lab-h[1-2,4]; 2.2.14 on lab-h3")
    assert r.hosts == ("lab-h1", "lab-h2", "lab-h3", "lab-h4")


def test_versions_installed_on_some_missing_everywhere_and_pass():
    per = {f"h{i}": {"openmpi": "4.1.4", "python": "3.11.7", "torch": None, "mindspore": None} for i in range(1, 4)}
    per["h3"] = {**per["h3"], "openmpi": None}
    res = checks.judge_versions(per, ["python", "openmpi", "torch", "mindspore"], ["python", "openmpi", "mindspore"],
                                "msrun")
    by = {r.message.split(":")[0]: r for r in res}
    assert by["openmpi"].message == "openmpi: 4.1.4 on h[1-2]; not installed on h3"
    assert by["torch"].status == "warn"
    assert by["mindspore"].status == "fail" and "not installed on any host (h[1-3])" in by["mindspore"].message
    assert by["python 3.11.7 on h[1-3]"].status == "pass"


def test_versions_other_mpi_is_not_openmpi():
    res = checks.judge_versions({"a": {"openmpi": "MPICH 4.0.2"}}, ["openmpi"], ["openmpi"], "mpirun")
    assert res[0].status == "fail" and "not Open MPI" in res[0].message


def test_users_and_nic_names():
    assert checks.judge_users({"a": "root", "b": "root"}, "mpirun") == []
    (r,) = checks.judge_users({"a": "train", "b": "train", "c": "root"}, "mpirun")
    assert r.status == "fail" and "train on a-b" not in r.message and "train on" in r.message and "root on c" in \
        r.message
    IfA = probes.IfAddr
    res = checks.judge_nic_names({"h1": IfA("eth0", "10.0.0.1", 24), "h2": IfA("eth0", "10.0.0.2", 24),
                                  "h3": IfA("ens3", "10.0.1.3", 24)})
    assert res[0].status == "warn" and res[0].host is None
    assert "eth0 on h[1-2]; ens3 on h3" in res[0].message
    assert "btl_tcp_if_include, 10.0.0.0/24,10.0.1.0/24" in res[0].message
    assert checks.judge_nic_names({"h1": IfA("eth0", "10.0.0.1", 24), "h2": IfA(None, "10.0.0.2", None)}) == []


def test_nic_address_not_on_host_and_local(tmp_path):
    s = sec("nic", fx("ip-o-addr.txt"))
    r, a = checks.judge_nic(host(1), s, None)
    assert r.status == "fail" and "eth0 192.0.2.2" in r.message and a is None
    r, a = checks.judge_nic(Host(name="x", address="192.0.2.2", user="u"), s, None)
    assert r.status == "pass" and a.ifname == "eth0"
    r, _ = checks.judge_nic(Host(name="l", address="127.0.0.1", user="u", connection="local"), sec("nic", ""), None)
    assert r.status == "pass"
    r, _ = checks.judge_nic(Host(name="d", address="node1.example", user="u"), s, {"192.0.2.2"})
    assert r.status == "pass"


def test_devices_ascend(tmp_path):
    h = Host(name="n1", address="10.0.0.1", user="u", slots=8, devices=tuple(range(8)))
    c = cluster(tmp_path, hosts=[h], platform="ascend")
    ok = checks.judge_devices(c, h, {"hccn": sec("hccn", fx("hccn-910-8dev.conf")),
                                     "npu": sec("npu", fx("npu-smi-info-910b.txt"))})
    assert ok.status == "warn" and "5 (Warning)" in ok.message
    part = checks.judge_devices(c, h, {"hccn": sec("hccn", fx("hccn-partial-0-3.conf")),
                                       "npu": sec("npu", probes.NOT_INSTALLED)})
    assert part.status == "fail" and "[4, 5, 6, 7]" in part.message and "hccn_tool" in part.message
    given = replace(h, device_ips={d: f"10.9.{d}.1" for d in range(4, 8)})
    assert checks.judge_devices(c, given, {"hccn": sec("hccn", fx("hccn-partial-0-3.conf"))}).status == "pass"
    none = checks.judge_devices(c, h, {"hccn": sec("hccn", probes.NOT_INSTALLED)})
    assert none.status == "fail" and "does not exist" in none.message
    missing_npu = checks.judge_devices(c, replace(h, slots=1, devices=(9,)),
                                       {"hccn": sec("hccn", "address_9=1.2.3.4\n"),
                                        "npu": sec("npu", fx("npu-smi-info-910b.txt"))})
    assert missing_npu.status == "fail" and "[9] do not exist" in missing_npu.message


def test_device_ips_unique_and_one_subnet_per_index(tmp_path):
    hs = [Host(name=f"n{i}", address=f"10.0.0.{i}", user="u", slots=2, devices=(0, 1)) for i in (1, 2, 3)]
    c = cluster(tmp_path, hosts=hs, platform="ascend")
    D = probes.HccnDevice
    good = {"n1": {0: D("192.168.100.1", "255.255.255.0"), 1: D("192.168.101.1", "255.255.255.0")},
            "n2": {0: D("192.168.100.2", "255.255.255.0"), 1: D("192.168.101.2", "255.255.255.0")},
            "n3": {0: D("192.168.100.3", "255.255.255.0"), 1: D("192.168.101.3", "255.255.255.0")}}
    assert checks.judge_device_ips(c, good) == []
    bad = {**good, "n3": {0: D("192.168.100.1", "255.255.255.0"), 1: D("192.168.201.3", "255.255.255.0")}}
    res = checks.judge_device_ips(c, bad)
    assert any("192.168.100.1 on n1 device 0, n3 device 0" in r.message for r in res)
    sub = [r for r in res if "different subnets" in r.message]
    assert sub and "192.168.101.0/24 on n[1-2]; 192.168.201.0/24 on n3" in sub[0].message


def test_devices_gpu(tmp_path):
    h = Host(name="g1", address="10.0.0.1", user="u", slots=4, devices=(4, 5, 6, 7))
    c = cluster(tmp_path, hosts=[h], platform="gpu")
    assert checks.judge_devices(c, h, {"gpus": sec("gpus", fx("nvidia-smi-L-a100x8.txt"))}).status == "pass"
    r = checks.judge_devices(c, h, {"gpus": sec("gpus", fx("nvidia-smi-L-mig.txt"))})
    assert r.status == "fail" and "[4, 5, 6, 7] do not exist" in r.message
    r = checks.judge_devices(c, h, {"gpus": sec("gpus", fx("nvidia-smi-failed.txt"), 9)})
    assert r.status == "fail" and "couldn't communicate" in r.message
    r = checks.judge_devices(c, h, {"gpus": sec("gpus", probes.NOT_INSTALLED)})
    assert r.status == "fail" and "nvidia-smi not found" in r.message


def test_disk_workdir_clock_mesh_path_judges(tmp_path):
    c = cluster(tmp_path, checks_=Checks(min_free_gib=100))
    h = c.hosts[0]
    r = checks.judge_disk(c, h, sec("df", fx("df-Pk.txt")))
    assert r.status == "fail" and "79.8 GiB free on /" in r.message and "min_free_gib is 100" in r.message
    assert checks.judge_disk(c, h, sec("df", "df: /data: Input/output error", 1)).status == "error"
    r = checks.judge_workdir(c, h, sec("workdir", "existed=yes\nwrite=sh: 1: cannot create /data/job/.x: "
                                                   "Read-only file system\n"))
    assert r.status == "fail" and "Read-only" in r.message
    # clock: 7 s ahead with a 0.2 s round trip -> warn; within the round trip's slack -> pass
    c0, c1 = sec("clock0", "1007.0"), sec("clock1", "1007.1")
    assert checks.judge_clock(h, c0, c1, 999.95, 1000.15, 5).status == "warn"
    assert checks.judge_clock(h, c0, c1, 1006.95, 1007.15, 5).status == "pass"
    assert checks.judge_clock(h, sec("clock0", "1000"), sec("clock1", "1000"), 990, 1010, 5).status == "pass"
    targets = [probes.MeshTarget(f"chk-h{i}", f"198.18.14.{10 + i}") for i in (2, 3, 4)]
    m = checks.judge_mesh(h, probes.split_sections(fx("probe-mpi-h1.txt"))["mesh"], targets, 2)
    assert m.status == "fail" and "to 1 of 3 host(s): chk-h4: ssh: connect to host 198.18.14.14 port 22: " \
                                  "Connection refused" in m.message
    m = checks.judge_mesh(h, sec("mesh", "chk-h2\t255\tPermission denied (publickey).\n"), targets[:1], 2)
    assert "ssh-copy-id" in m.message
    m = checks.judge_mesh(h, sec("mesh", ""), targets[:1], 2)
    assert m.status == "fail" and "no answer" in m.message
    m = checks.judge_mesh(h, sec("mesh", "chk-h2\t124\t\n"), targets[:1], 2, 120)
    assert "connected but no answer within 96s" in m.message
    # the words name what needs the ssh: the sync relay, not mpirun, when only it does
    relay = "the sync relay (job.sync_via: launch-host)"
    m = checks.judge_mesh(h, sec("mesh", "chk-h2\t255\tPermission denied (publickey).\n"), targets[:1], 2, 120, relay)
    assert "as the sync relay (job.sync_via: launch-host) does" in m.message and "mpirun" not in m.message
    assert "job.sync_via: controller" in m.message
    assert "mpirun" not in checks.judge_mesh(h, sec("mesh", "chk-h2\t0\t\n"), targets[:1], 2, 120, relay).message


def test_path_judge_missing_tools(tmp_path):
    c = cluster(tmp_path)
    h = c.hosts[0]
    body = "PATH=/usr/bin:/bin\nplain\torted\t\nJOBPATH=/usr/bin:/bin\njob\tmpirun\t\njob\tpython3\t/usr/bin/python3\n"
    r = checks.judge_path(c, h, sec("path", body))
    assert r.status == "fail"
    assert r.message.startswith("mpirun, orted not found on the non-interactive ssh PATH=/usr/bin:/bin")
    assert "--prefix" in r.message and "job.env" in r.message
    c2 = cluster(tmp_path, env={"PATH": "/opt/x/bin"}, mpirun_args=("--prefix=/opt/mpi",))
    body = "PATH=/usr/bin\nfixed\torted\t\nJOBPATH=/opt/x/bin\njob\tmpirun\t/opt/x/bin/mpirun\njob\tpython3\t\n"
    r = checks.judge_path(c2, h, sec("path", body))
    assert "python3 not found on job.env PATH=/opt/x/bin" in r.message
    assert "/opt/mpi/bin/orted is not an executable on this host (from mpirun --prefix /opt/mpi)" in r.message
    assert "install-e2e-deps" not in r.message


def test_path_judge_points_at_the_playbooks_venv_script_when_job_env_uses_it(tmp_path):
    c = cluster(tmp_path, env={"PATH": "/opt/orch-venvs/train/bin:/usr/bin:/bin"})
    body = "PATH=/usr/bin\nJOBPATH=/opt/orch-venvs/train/bin:/usr/bin:/bin\njob\tmpirun\t/usr/bin/mpirun\njob\tpython\t\n"
    r = checks.judge_path(c, c.hosts[0], sec("path", body))
    assert r.status == "fail" and "python3 not found on job.env PATH=/opt/orch-venvs/train/bin" in r.message
    assert "`bash scripts/install-e2e-deps.sh`" in r.message, r.message


@pytest.mark.parametrize("line, want", [
    ("supervisor\t3.11\n", None),
    ("supervisor\t3.8\n", None),
    ("supervisor\t3.6\n", "python3 is 3.6; the run's supervisor needs >= 3.8"),
    ("supervisor\t\n", "no python3 on the non-interactive ssh PATH (the run's supervisor needs python3 >= 3.8)"),
])
def test_path_judge_needs_python3_for_the_supervisor(tmp_path, line, want):
    """The run's supervisor (agent.py) runs on each host's python3 from the non-interactive ssh
    PATH: orch check says so before `orch up` would refuse the host."""
    c = cluster(tmp_path, launcher="ranktable", platform="ascend")
    body = "PATH=/usr/bin:/bin\n" + line + "JOBPATH=/usr/bin:/bin\njob\tpython3\t/usr/bin/python3\n"
    r = checks.judge_path(c, c.hosts[0], sec("path", body))
    if want is None:
        assert r.status == "pass" and "(supervisor)" in r.message, r
    else:
        assert r.status == "fail" and want in r.message, r
    assert probes.parse_path(body)["supervisor"] == line.split("\t")[1].strip()


def test_files_judge_and_manifest(tmp_path):
    (tmp_path / "net.py").write_text("x")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text("y")
    c = cluster(tmp_path, sync=("net.py", "pkg", "nope.py"))
    files, missing, aside = checks.sync_manifest(c)
    assert [f.rel for f in files] == ["net.py", "pkg/m.py"] and aside == []
    assert len(missing) == 1 and "'nope.py' does not exist" in missing[0]
    plan = checks.make_check_plan(c)
    (r,) = [x for x in checks.judge_cluster_local(plan) if x.check == "files"]
    assert r.status == "fail" and "nope.py" in r.message
    man = [SyncFile("a.py", 1, "1" * 64), SyncFile("b.py", 1, "2" * 64), SyncFile("big", 9, None)]
    h = c.hosts[0]
    assert checks.judge_files(h, sec("files", "orch:no-workdir"), man).status == "pass"
    r = checks.judge_files(h, sec("files", f"{'1' * 64}  a.py\n{'3' * 64}  b.py\nsize 9 big\n"), man)
    assert r.status == "warn" and "stale code on the host: b.py differ" in r.message
    r = checks.judge_files(h, sec("files", f"{'1' * 64}  a.py\nsize 9 big\n"), man)
    assert r.status == "pass" and "2 file(s) up to date, 1 not there yet" in r.message


@pytest.mark.parametrize("launcher, name", [("mpirun", "hostfile"), ("ranktable", "rank_table.json")])
def test_a_synced_file_where_orch_writes_its_own_is_left_out_with_a_warning(tmp_path, launcher, name):
    """`orch check`: a synced `.` holding a file of the name orch renders for the launch (mpirun's
    hostfile, the Ascend rank table) is not compared or synced (orch's own goes there), and the
    files check warns, naming it; nothing else synced is left out. Other launchers render neither."""
    (tmp_path / name).write_text("mine\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / name).write_text("not at the top\n")
    c = cluster(tmp_path, sync=(".",), launcher=launcher, platform="ascend")
    files, missing, aside = checks.sync_manifest(c)
    assert [f.rel for f in files] == [f"pkg/{name}"] and not missing and [e.rel for e in aside] == [name]
    plan = checks.make_check_plan(c)
    (r,) = [x for x in checks.judge_cluster_local(plan) if x.check == "files"]
    assert (r.status, r.host) == ("warn", None)
    assert r.message == (f"job.sync: {name} not synced: orch writes the launch's own file of that name in "
                         f"job.workdir (to keep this quiet: rename yours, or leave it out of job.sync, or add /{name} "
                         "to job.sync_exclude)")
    files, _, aside = checks.sync_manifest(cluster(tmp_path, sync=(".",), launcher="torchrun"))
    assert name in [f.rel for f in files] and aside == []


def test_up_files_judged_from_the_sync_listing_nothing_hashed(tmp_path):
    """`orch up`'s probe compares the files with the host's sync listing (size and mtime, as sync
    decides what to send): no sha256sum section, nothing hashed here; a listing that did not come
    back whole is a warning, never a failure (sync lists the host again)."""
    import os

    from orchestrator import sync

    (tmp_path / "pkg").mkdir()
    for n in ("a.py", "b.py", "c.py"):
        (tmp_path / "pkg" / n).write_text(n)
    c = cluster(tmp_path, sync=("pkg",))
    entries = sync.job_manifest(c)
    plan = checks.make_check_plan(c, prepare=True, entries=entries)
    assert all(f.sha256 is None and f.mtime_ns for f in plan.manifest)
    script = checks.probe_script(plan, c.hosts[0])
    assert "sha256sum" not in script and "wc -c" not in script and "synclist" in script
    st = {n: os.stat(tmp_path / "pkg" / n) for n in ("a.py", "b.py")}
    have = {"pkg/a.py": ["file", st["a.py"].st_size, st["a.py"].st_mtime_ns, 0o644, None],
            "pkg/b.py": ["file", st["b.py"].st_size, st["b.py"].st_mtime_ns + 1, 0o644, None]}
    body = listing_answer([have.get(rel) for rel, _ in plan.listing])
    h = c.hosts[0]

    def listed(body, rc=0):
        return checks.runner.listed(plan, h, {"synclist": sec("synclist", body, rc)})

    r = checks.files.judge_listed(h, listed(body), plan)
    assert r.status == "warn" and "stale code on the host: pkg/b.py differ from this machine's (size or " \
        "modification time)" in r.message, r
    del have["pkg/b.py"]
    r = checks.files.judge_listed(h, listed(listing_answer([have.get(rel) for rel, _ in plan.listing])), plan)
    assert r.status == "pass" and "1 file(s) up to date, 2 not there yet" in r.message, r
    r = checks.files.judge_listed(h, listed(listing_answer([None for _ in plan.listing])), plan)
    assert r.status == "pass" and "not synced yet: orch up copies 3 file(s)" in r.message, r
    for garbled in (listed(body.rsplit("\n", 2)[0]), listed("orch:list 0\n"), listed(body, rc=1),
                    checks.runner.listed(plan, h, {})):
        r = checks.files.judge_listed(h, garbled, plan)
        assert r.status == "warn" and "did not come back whole" in r.message, (garbled, r)
    # `orch check` (no prepare) still hashes
    assert "sha256sum" in checks.probe_script(checks.make_check_plan(c), h)


# --------------------------------------------------------------------------- run_checks with a fake transport


class FakeTransport(Transport):
    """Runs nothing: answers the probe with canned output; fails when no probe came."""

    def __init__(self, h: Host, output: str = "", connect_error=None):
        super().__init__(h, 30)
        self.output, self.connect_error = output, connect_error
        self.scripts: list[str] = []
        self.connects = 0

    def connect(self):
        self.connects += 1
        if self.connect_error:
            raise self.connect_error

    def _exec(self, script, *, stdin, sink, timeout):
        self.scripts.append(script)
        return 0, self.output.encode(), b""


class FakePool:
    def __init__(self, transports):
        self.t = {t.host.name: t for t in transports}

    def __getitem__(self, h):
        return self.t[h.name if isinstance(h, Host) else h]


def test_run_checks_one_probe_per_host_and_json_shape(tmp_path):
    hs = [Host(name=f"chk-h{i}", address=f"198.18.14.{10 + i}", user="root") for i in (1, 2, 3)]
    c = cluster(tmp_path, hosts=hs, command=("python3", "train.py"))
    ts = [FakeTransport(hs[0], fx("probe-mpi-h1.txt")), FakeTransport(hs[1], fx("probe-ascend-h2.txt")),
          FakeTransport(hs[2], connect_error=AuthError("chk-h3", "password-free SSH to root@198.18.14.13 failed"))]
    seen = []
    rep = checks.run_checks(c, FakePool(ts), on_result=seen.append)
    assert [len(t.scripts) for t in ts] == [1, 1, 0] and [t.connects for t in ts] == [1, 1, 1]
    assert sorted(seen, key=id) == sorted(rep.results, key=id)
    assert not rep.ok
    d = json.loads(rep.to_json())
    assert set(d) == {"ok", "results"} and d["ok"] is False
    for r in d["results"]:
        assert set(r) == {"check", "host", "status", "message"}
        assert r["status"] in ("pass", "warn", "fail", "error") and isinstance(r["message"], str)
    by = {(r.check, r.host): r for r in rep.results}
    assert by[("ssh", "chk-h3")].status == "fail" and by[("user", "chk-h3")].status == "error"
    assert by[("ssh", "chk-h1")].status == "pass" and by[("nic", "chk-h1")].status == "pass"
    assert by[("nic", "chk-h2")].status == "pass"
    problems = rep.problems()
    assert problems[0].status == "fail"
    errs = [p for p in problems if p.status == "error"]
    assert len(errs) == 1 and errs[0].hosts == "chk-h3" and "user" in errs[0].check.split(",")


class SlowConnect(FakeTransport):
    """Takes `delay` to connect; notes when each connect started."""

    def __init__(self, h: Host, started: dict, delay: float = 0.0):
        super().__init__(h, fx("probe-mpi-h1.txt"))
        self.started, self.delay = started, delay

    def connect(self):
        self.started[self.host.name] = time.monotonic()
        time.sleep(self.delay)


@pytest.mark.parametrize("skip, waits", [((), True), (("mesh",), False)])
def test_the_others_wait_for_the_launch_host_only_when_it_tests_the_mesh(tmp_path, skip, waits):
    hs = [Host(name=f"hs-h{i}", address=f"198.18.15.{10 + i}", user="root") for i in (1, 2, 3)]
    c = cluster(tmp_path, hosts=hs, checks_=Checks(skip=skip))
    started: dict[str, float] = {}
    ts = [SlowConnect(hs[0], started, delay=0.4)] + [SlowConnect(h, started) for h in hs[1:]]
    checks.run_checks(c, FakePool(ts))
    lag = min(started["hs-h2"], started["hs-h3"]) - started["hs-h1"]
    assert (lag >= 0.35) if waits else (lag < 0.3), lag


class FirstOutputLate(FakeTransport):
    """The launch host: connects at once, its probe's first output comes back `delay` later, the
    rest once every other host has connected (or after 5 s)."""

    def __init__(self, h: Host, events: dict, others: threading.Event, delay: float):
        super().__init__(h, fx("probe-mpi-h1.txt"))
        self.events, self.others, self.delay = events, others, delay

    def _exec(self, script, *, stdin, sink, timeout):
        self.scripts.append(script)
        time.sleep(self.delay)
        head, rest = self.output.encode().split(b"\n", 1)
        self.events["first output"] = time.monotonic()
        sink.write(head + b"\n")
        self.events["others came"] = self.others.wait(5)
        sink.write(rest)
        return 0, b"", b""


class NotesConnect(FakeTransport):
    def __init__(self, h: Host, events: dict, all_in: threading.Event, n: int):
        super().__init__(h, fx("probe-mpi-h1.txt"))
        self.events, self.all_in, self.n = events, all_in, n

    def connect(self):
        self.events.setdefault("others", []).append(time.monotonic())
        if len(self.events["others"]) == self.n:
            self.all_in.set()


def test_the_others_start_once_the_launch_hosts_probe_runs_not_when_it_connected(tmp_path):
    """The mesh source's probe is the longest: the others connect once its first output is back
    (its probe runs on the host), not as soon as its connection is up (their handshakes would
    delay its start); and without waiting for its end."""
    hs = [Host(name=f"fo-h{i}", address=f"198.18.16.{10 + i}", user="root") for i in (1, 2, 3)]
    c = cluster(tmp_path, hosts=hs, checks_=Checks(skip=("reach",)))
    events: dict = {}
    all_in = threading.Event()
    ts = [FirstOutputLate(hs[0], events, all_in, delay=0.3)] + [NotesConnect(h, events, all_in, 2) for h in hs[1:]]
    rep = checks.run_checks(c, FakePool(ts))
    assert min(events["others"]) >= events["first output"]
    assert events["others came"]   # ... while the launch host's probe still ran
    mine = [r for r in rep.results if r.host == "fo-h1"]   # its whole output read, from both writes
    assert {r.check for r in mine} >= {"ssh", "mesh", "clock"} and not [r for r in mine if r.status == "error"]


def test_report_folding():
    rs = [CheckResult("disk", f"n{i:02d}", "fail", "only 0.1 GiB free on /data") for i in range(1, 17)]
    rs += [CheckResult("disk", "n17", "pass", "9 GiB free"), CheckResult("user", "n01", "warn", "root")]
    rep = Report(rs, tuple(f"n{i:02d}" for i in range(1, 18)))
    p = rep.problems()
    assert p[0] == checks.Problem("fail", "disk", "n[01-16]", "only 0.1 GiB free on /data")
    assert p[1].status == "warn" and not rep.ok
    assert rep.cells()["n17"] == {"disk": "pass"} and rep.checks == ["user", "disk"]
    assert Report([CheckResult("user", "a", "warn", "root")]).ok


# --------------------------------------------------------------------------- the CLI (connection: local)


def _local_cluster_file(tmp_path: Path, extra: str = "") -> Path:
    (tmp_path / "net.py").write_text("print(1)\n")
    f = tmp_path / "cluster.yaml"
    f.write_text(f"""
inventory:
  defaults: {{connection: local}}
  hosts: [{{address: 127.0.0.1, name: me}}]
job: {{workdir: {tmp_path / 'wd'}, command: python3 net.py, sync: [net.py]}}
checks: {{versions: [python], min_free_gib: 0.001{extra}}}
""")
    return f


def test_cli_check_json_exit_codes(tmp_path):
    from orchestrator.cli import cli

    f = _local_cluster_file(tmp_path)
    res = CliRunner().invoke(cli, ["check", str(f), "--json"])
    d = json.loads(res.stdout)  # exactly one JSON object, nothing else
    assert res.exit_code == (0 if d["ok"] else 1), res.output
    assert {r["check"] for r in d["results"]} >= {"ssh", "user", "versions", "path", "workdir", "disk"}
    status = {r["check"]: r["status"] for r in d["results"]}
    healthy = ("ssh", "workdir", "disk", "files")  # what holds on any machine the tests run on
    assert {c: status[c] for c in healthy} == dict.fromkeys(healthy, "pass"), res.output
    (tmp_path / "b").mkdir()
    bad = _local_cluster_file(tmp_path / "b", ", min_free_gib: 1000000")
    assert CliRunner().invoke(cli, ["check", str(bad), "--json"]).exit_code == 2  # duplicate key: bad file
    big = tmp_path / "big.yaml"
    big.write_text(f.read_text().replace("min_free_gib: 0.001", "min_free_gib: 100000000"))
    res = CliRunner().invoke(cli, ["check", str(big)])
    assert res.exit_code == 1 and "FAIL  disk me: only" in res.stdout
    assert CliRunner().invoke(cli, ["check", str(tmp_path / "missing.yaml")]).exit_code == 2
    res = CliRunner().invoke(cli, ["check", str(f), "--print-probe", "me"])
    assert res.exit_code == 0 and res.stdout.startswith("# orch check probe for me")
    assert CliRunner().invoke(cli, ["check", str(f), "--print-probe", "nobody"]).exit_code == 2


@pytest.mark.parametrize("as_json", [True, False])
def test_the_orch_program_ends_check_at_once_with_its_whole_output_and_exit_code(tmp_path, as_json):
    """`orch check` as a program (main(): it skips the interpreter's teardown once its report is
    out) writes its whole report into a pipe and exits with the report's code."""
    import os
    import sys

    f = _local_cluster_file(tmp_path)
    big = tmp_path / "big.yaml"   # a check that fails: exit code 1
    big.write_text(f.read_text().replace("min_free_gib: 0.001", "min_free_gib: 100000000"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for path, code in ((f, None), (big, 1)):
        out = subprocess.run([sys.executable, "-m", "orchestrator.cli", "check", str(path)] + (["--json"] if as_json
                             else []), capture_output=True, text=True, env=env, timeout=120)
        if as_json:
            d = json.loads(out.stdout)   # the whole object, flushed before the process ended
            assert out.returncode == (code if code is not None else 0 if d["ok"] else 1), out.stderr
        else:
            assert out.returncode == (code if code is not None else out.returncode)
            assert " host(s), " in out.stdout.splitlines()[-1], out.stdout   # the report's last line
        if code == 1:
            assert out.returncode == 1


def test_hccl_connect_timeout_warning(tmp_path):
    """Ascend: clocks or launch spread at half of HCCL_CONNECT_TIMEOUT (120 s here) warn; cpu never."""
    from dataclasses import replace as _replace
    c = cluster(tmp_path)
    asc = _replace(c, job=_replace(c.job, platform="ascend"))
    assert checks.judge_hccl_timeout(asc, [0.0, 1.0], [100.0, 101.0]) == []
    [w] = checks.judge_hccl_timeout(asc, [0.0, 70.0], [100.0, 101.0])
    assert w.status == "warn" and "70s apart" in w.message and "HCCL_CONNECT_TIMEOUT is 120s" in w.message
    assert checks.judge_hccl_timeout(asc, [0.0, 1.0], [100.0, 170.0])[0].status == "warn"
    big = _replace(asc, job=_replace(asc.job, hccl_connect_timeout=600))
    assert checks.judge_hccl_timeout(big, [0.0, 70.0], [100.0, 170.0]) == []
    assert checks.judge_hccl_timeout(c, [0.0, 700.0], [0.0, 700.0]) == []


@pytest.mark.parametrize("tmpdir, want", [(None, ("hi from the background", 0)),
                                          ("/nonexistent-orch-tmp", ("mktemp could not create", 125))])
def test_the_background_section_needs_a_private_temp_file(tmp_path, tmpdir, want):
    """The probe's background section (mesh) keeps its output in a file mktemp made; when mktemp
    fails the section says so (exit 125) instead of writing to a name another user could plant."""
    import os

    script = probes.assemble("h", [], [("mesh", "echo hi from the background")], [("x", "echo x")], [])
    assert "/tmp/.orch" not in script
    env = {**os.environ, **({"TMPDIR": tmpdir} if tmpdir else {})}
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env=env, timeout=30, cwd=tmp_path).stdout
    mesh = probes.split_sections(out)["mesh"]
    assert want[0] in mesh.body and mesh.rc == want[1], out


@pytest.mark.parametrize("found", ["none", "ours", "loose", "link", "other-owner"])
def test_mesh_keeps_its_connections_open_for_mpirun_only_in_the_users_private_directory(tmp_path, monkeypatch,
                                                                                        found):
    """`orch up` of an mpirun job: the launch host's mesh test makes its ssh connections masters
    (ControlPath, for mpirun's ssh to share) only in the user's own 0700 directory, made here or
    made before by the same user; one with other modes, a link, or another user's: no master, no
    SHARED line (a socket there would let someone else log in as this user)."""
    import os

    from orchestrator.checks import mesh
    from orchestrator.probes import MeshTarget

    monkeypatch.setattr(mesh, "SHARE_DIR", str(tmp_path / "share-{uid}"))
    d = tmp_path / f"share-{os.getuid()}"
    if found in ("ours", "loose", "other-owner"):
        d.mkdir(mode=0o700 if found != "loose" else 0o755)
        d.chmod(0o700 if found != "loose" else 0o755)
    elif found == "link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        d.symlink_to(tmp_path / "elsewhere")
    if found == "other-owner":
        if os.geteuid() != 0:   # only root can give it away; the other cases still run
            found = "ours"
        else:
            os.chown(d, 65534, 65534)
    bin_, log = tmp_path / "bin", tmp_path / "ssh-args"
    bin_.mkdir()
    (bin_ / "ssh").write_text(f"#!/bin/sh\n[ \"$1\" = -G ] && exit 0\necho \"$*\" >> {log}\nexit 0\n")
    (bin_ / "ssh").chmod(0o755)
    body = mesh.mesh_body([MeshTarget("h2", "10.0.0.2"), MeshTarget("h3", "10.0.0.3")], 2, 30, share="ab12cd34-%C")
    out = subprocess.run(["sh", "-c", body], capture_output=True, text=True, timeout=60,
                         env={"PATH": f"{bin_}:/usr/bin:/bin"}).stdout
    shared = found in ("none", "ours")
    path = f"{d}/ab12cd34-%C"
    said = [ln for ln in out.splitlines() if ln.startswith(probes.SHARED)]
    assert said == ([f"{probes.SHARED} {path}"] if shared else [])
    assert probes.parse_mesh(out) == {"h2": (0, ""), "h3": (0, "")}   # the SHARED line is no target's
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    for call in calls:
        assert (f"-o ControlMaster=auto -o ControlPersist=30 -o ControlPath={path}" in call) is shared
    if found == "none":
        assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    # without `share` (orch check, other launchers) nothing of it
    plain = mesh.mesh_body([MeshTarget("h2", "10.0.0.2")], 2, 30)
    assert "Control" not in plain and mesh.SHARE_DIR.format(uid="") not in plain


def test_only_ups_mpirun_probe_on_the_launch_host_shares_its_mesh_connections(tmp_path):
    """The ControlPath: one per `orch up` (its own token), on the launch host's mesh test only,
    when up tests the mesh (mpirun, the sync relay); `orch check` and a job without it: none."""
    from orchestrator import prepare

    c = cluster(tmp_path, launcher="mpirun")
    up, again = checks.make_check_plan(c, prepare=True, entries=[]), checks.make_check_plan(c, prepare=True, entries=[])
    assert len(up.share) == 11 and up.share.endswith("-%C") and up.share != again.share
    head, member = up.launch, next(h for h in up.hosts if h.name != up.launch.name)
    assert f"-o ControlPath=$D/{up.share}" in checks.probe_script(up, head)
    assert "ControlPath" not in checks.probe_script(up, member)
    assert checks.make_check_plan(c).share == ""   # orch check
    assert checks.make_check_plan(cluster(tmp_path, launcher="msrun", platform="ascend"), prepare=True,
                                  entries=[]).share == ""   # no mesh test ...
    relay = checks.make_check_plan(cluster(tmp_path, launcher="msrun", platform="ascend", sync_via="launch-host"),
                                   prepare=True, entries=[])
    assert relay.share and f"ControlPath=$D/{relay.share}" in checks.probe_script(relay, relay.launch)  # ... the relay's
    # the fact: from the launch host's mesh section, when it says SHARED
    base = {name: Section(name, "existed=yes\nwrite=ok\nuid=0\n" if name == "workdir" else "", 0)
            for name in set(prepare.sources(up).values())}
    path = f"/tmp/orch-ssh-1000/{up.share}"
    said = prepare.facts(up, {**base, "mesh": Section("mesh", f"{probes.SHARED} {path}\nh2\t0\t\n", 0)})
    assert said is not None and said["share"] == path
    # nothing said, or a path that is not this run's socket in such a directory: nothing shared
    for body in ("h2\t0\t\n", f"{probes.SHARED} /tmp/x/{up.share}\n", f"{probes.SHARED} {path} -o X=y\n",
                 f"{probes.SHARED} /tmp/orch-ssh-1000/{again.share}\n", f"{probes.SHARED}\n"):
        quiet = prepare.facts(up, {**base, "mesh": Section("mesh", body, 0)})
        assert quiet is not None and quiet["share"] is None, body
    silent = prepare.facts(up, base)   # no mesh section at all
    assert silent is not None and silent["share"] is None


def test_mpirun_shares_the_launch_hosts_connections_named_by_prepare(tmp_path):
    """mpirun's ssh gets the ControlPath (plm_rsh_args) only when prepare found one."""
    from orchestrator import launchers
    from orchestrator.rankplan import make_plan

    c = cluster(tmp_path, launcher="mpirun")
    rp = make_plan(c)

    def argv(share):
        launch = launchers.build(c, rp, "r1", root={h.name: False for h in rp.all_hosts}, share=share)
        return list(launch.procs[rp.launch_host.name][0].argv)

    with_share = argv("/tmp/orch-ssh-1000/ab12cd34-%C")
    i = with_share.index("plm_rsh_args")
    assert with_share[i + 1] == "-o ControlPath=/tmp/orch-ssh-1000/ab12cd34-%C"
    assert "plm_rsh_args" not in argv(None)
