"""orch check --deep (health.py): the probe sections, their parsers against real tool output, the judge.

Fixtures in tests/fixtures/health/ are copied from public documentation and issue threads
(SOURCES.md says where each comes from). Cases no public output shows (an NPU in Alarm, a
device that answers no ping, a GPU with ECC errors) are made in the tests below from a real
fixture with one value changed, and say so.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from orchestrator import checks, health, probes
from orchestrator.checks import ProbeRun
from orchestrator.health import DeviceNet, Ping, PingResult
from orchestrator.probes import NOT_INSTALLED, ProbeError, Section
from orchestrator.spec import Checks, Cluster, Host, Job, SshSettings

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "health"
CHECKS_FIX = FIX.parent / "checks"


def fx(name: str) -> str:
    return (FIX / name).read_text()


def sec(name: str, body: str, rc: int | None = 0) -> Section:
    return Section(name, body, rc)


def ascend_cluster(n: int = 2, devices=(0, 1), peer_ips=None) -> Cluster:
    hs = [Host(name=f"n{i}", address=f"10.0.0.{i}", user="u", slots=len(devices), devices=tuple(devices))
          for i in range(1, n + 1)]
    if peer_ips:
        hs[1] = replace(hs[1], device_ips=peer_ips)
    return Cluster(name="t", path=Path("/nonexistent/c.yaml"), hosts=tuple(hs),
                   job=Job(workdir="/data/job", command=("python3", "train.py"), launcher="msrun", platform="ascend"),
                   ssh=SshSettings(connect_timeout=2, retries=2, command_timeout=30), checks=Checks())


def gpu_cluster(devices=(0,)) -> Cluster:
    h = Host(name="g1", address="10.0.0.1", user="u", slots=len(devices), devices=tuple(devices))
    return Cluster(name="t", path=Path("/nonexistent/c.yaml"), hosts=(h,),
                   job=Job(workdir="/data/job", command=("python3", "train.py"), platform="gpu"),
                   ssh=SshSettings(connect_timeout=2, retries=2, command_timeout=30), checks=Checks())


def hccn_output(per_device: dict) -> str:
    """A health:hccn section as the probe prints it, each command's output a fixture's text.
    per_device: {device: (link text, net health text, (address, source, ping text) | None)}."""
    out = []
    for d, (link, net, ping) in per_device.items():
        out += [f"orch:run {d} link", link, "orch:rc 0", f"orch:run {d} net_health", net, "orch:rc 0"]
        if ping is None:
            out.append(f"orch:ping {d} - none")
        else:
            addr, src, text = ping
            out += [f"orch:ping {d} {addr} {src}", text, "orch:rc 0"]
    return "\n".join(out) + "\n"


HEALTHY = (fx("hccn-link-up.txt"), fx("hccn-net-health-success.txt"), ("29.1.137.205", "peer", fx("hccn-ping-ok.txt")))


# --------------------------------------------------------------------------- parsers against every fixture


@pytest.mark.parametrize("name, want", [("hccn-link-up.txt", "UP"), ("hccn-link-down.txt", "DOWN")])
def test_link(name, want):
    assert health.parse_link(fx(name)) == want


@pytest.mark.parametrize("name, want", [
    ("hccn-net-health-success.txt", "Success"), ("hccn-net-health-init.txt", "Init"),
    ("hccn-net-health-fault.txt", "Fault"), ("hccn-net-health-socket-failed.txt", "Socket failed")])
def test_net_health(name, want):
    assert health.parse_net_health(fx(name)) == want


@pytest.mark.parametrize("name, want", [
    ("hccn-ping-ok.txt", PingResult(3, 3, 0.0)),
    ("hccn-ping-ok-prompt.txt", PingResult(3, 3, 0.0)),  # shell prompts around it, a `time-` typo inside
    ("hccn-ping-loss.txt", PingResult(3, 2, 33.33))])
def test_ping(name, want):
    got = health.parse_ping(fx(name))
    assert got == want and got.ok == (want.received == want.sent)


def test_ping_without_summary_counts_the_lines():
    # the loss fixture cut before its summary line: the lines still tell
    text = fx("hccn-ping-loss.txt").rsplit("\n3 packets", 1)[0]
    assert health.parse_ping(text) == PingResult(3, 2, 33.33)


@pytest.mark.parametrize("parse, tool", [(health.parse_link, "-link -g"), (health.parse_net_health, "-net_health -g"),
                                         (health.parse_ping, "-ping -g")])
def test_hccn_garbage_names_the_tool_and_quotes_it(parse, tool):
    with pytest.raises(ProbeError, match=rf"hccn_tool {tool}.*'hccn_tool is busy, please try again'"):
        parse("hccn_tool is busy, please try again\n")


def test_npu_smi_health_fixtures():
    assert probes.parse_npu_smi(fx("npu-smi-info-910b1.txt")) == {0: "OK", 1: "OK", 7: "OK"}
    assert probes.parse_npu_smi(fx("npu-smi-info-warning.txt")) == {0: "Warning", 7: "OK"}


@pytest.mark.parametrize("name, want", [
    ("nvidia-smi-query-gpu-h100.csv", ("NVIDIA H100 80GB HBM3", "00000000:00:09.0", "Enabled", 0, None, False, False)),
    ("nvidia-smi-query-gpu-h100-mig.csv", ("NVIDIA H100 80GB HBM3", "00000000:00:09.0", "Enabled", 0, None, None,
                                           None)),
    ("nvidia-smi-query-gpu-rtx2080.csv", ("NVIDIA GeForce RTX 2080 SUPER", "00000000:0C:00.0", None, None, None, None,
                                          None))])
def test_gpu_query_any_field_order(name, want):
    """The fixtures are nvidia-smi's CSV for ~300 fields (the probe asks for 8): the header decides."""
    g = health.parse_gpu_query(fx(name))
    assert list(g) == [0]
    assert (g[0].name, g[0].bus_id, g[0].ecc_mode, g[0].uncorrected, g[0].retired_pending, g[0].remap_pending,
            g[0].remap_failure) == want


def test_gpu_query_missing_and_garbage():
    assert health.parse_gpu_query(NOT_INSTALLED + "\n") is None
    with pytest.raises(ProbeError, match=r"nvidia-smi --query-gpu.*couldn't communicate with the NVIDIA driver"):
        health.parse_gpu_query((CHECKS_FIX / "nvidia-smi-failed.txt").read_text())
    with pytest.raises(ProbeError, match="listed no GPU"):
        health.parse_gpu_query("index, name, pci.bus_id\n")


@pytest.mark.parametrize("name, want", [
    ("xid-dmesg-bumblebee-677.txt", [(32, "0000:01:00", 24128.828315), (32, "0000:01:00", 24128.828608),
                                     (31, "0000:01:00", 24128.834365)]),
    ("xid-dmesg-ctime-gpud-46.txt", [(13, "0000:cb:00", None)] * 3 + [(109, "0000:cb:00", None)]),
    ("xid-journal-ogkm-1150.txt", [(45, b, None) for b in ("0000:dc:00", "0000:ed:00", "0000:ba:00", "0000:97:00",
                                                           "0000:dc:00", "0000:ba:00", "0000:ed:00")]),
    ("xid-kmsg-gpud-870.txt", [(79, "0000:04:00", None)]),
    ("xid-kernlog-bumblebee-329.txt", [(16, "0000:01:00", None)] * 8 + [(8, "0000:01:00", None)])])
def test_xid_lines_in_every_log_format(name, want):
    log = health.parse_xid_log(fx(name))
    assert log.readable and [(e.xid, e.pci, e.at) for e in log.events] == want


def test_bus_ids_of_nvidia_smi_and_xid_lines_match():
    assert health.bus_key("00000000:3B:00.0") == health.bus_key("0000:3b:00") == (0, 0x3b, 0)
    assert health.bus_key("garbage") is None


def test_hccn_section_missing_and_garbage():
    assert health.parse_hccn_section(NOT_INSTALLED + "\n") is None
    with pytest.raises(ProbeError, match="hccn_tool probe printed nothing usable"):
        health.parse_hccn_section("Segmentation fault (core dumped)\n")


# --------------------------------------------------------------------------- the probe sections, run


def _fake(bin_dir: Path, name: str, script: str) -> None:
    p = bin_dir / name
    p.write_text("#!/bin/sh\n" + script)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def _run(body: str, bin_dir: Path) -> str:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "T": ""}
    return subprocess.run(["sh", "-c", body], capture_output=True, text=True, env=env, timeout=60).stdout


def test_hccn_section_text_is_pinned_and_parses(tmp_path):
    """Device 0 pings the next host's device 0 (its device_ips in the inventory); device 1 has no
    address there, so the host's own /etc/hccn.conf netdetect_1 (else gateway_1) is used."""
    c = ascend_cluster(peer_ips={0: "29.1.137.205"})
    assert health.ping_targets(c, c.hosts[0]) == (c.hosts[1], {0: "29.1.137.205"})
    (name, body), = health.sections(c, c.hosts[0])
    assert name == "health:hccn"
    assert body == (
        "H=$(command -v hccn_tool 2>/dev/null) || H=/usr/local/Ascend/driver/tools/hccn_tool\n"
        "[ -x \"$H\" ] || { echo orch:not-installed; exit 0; }\n"
        "P=; command -v timeout >/dev/null 2>&1 && P='timeout 10'\n"
        "t0=$(date +%s)\n"
        "echo 'orch:run 0 link'; $T \"$H\" -i 0 -link -g 2>&1; printf '\\norch:rc %s\\n' \"$?\"\n"
        "echo 'orch:run 0 net_health'; $T \"$H\" -i 0 -net_health -g 2>&1; printf '\\norch:rc %s\\n' \"$?\"\n"
        "a=29.1.137.205; s=peer\n"
        "if [ -z \"$a\" ]; then echo 'orch:ping 0 - none'\n"
        "elif [ $(($(date +%s) - t0)) -ge 60 ]; then echo \"orch:ping 0 $a $s\"; echo orch:skipped\n"
        "else echo \"orch:ping 0 $a $s\"; $P \"$H\" -i 0 -ping -g address \"$a\" 2>&1; "
        "printf '\\norch:rc %s\\n' \"$?\"; fi\n"
        "echo 'orch:run 1 link'; $T \"$H\" -i 1 -link -g 2>&1; printf '\\norch:rc %s\\n' \"$?\"\n"
        "echo 'orch:run 1 net_health'; $T \"$H\" -i 1 -net_health -g 2>&1; printf '\\norch:rc %s\\n' \"$?\"\n"
        "s=netdetect; a=$(sed -n 's/^[[:space:]]*netdetect_1[[:space:]]*=[[:space:]]*\\([^[:space:]#]*\\).*/\\1/p' "
        "/etc/hccn.conf 2>/dev/null | tail -n 1)\n"
        "[ -n \"$a\" ] || { s=gateway; a=$(sed -n 's/^[[:space:]]*gateway_1[[:space:]]*=[[:space:]]*"
        "\\([^[:space:]#]*\\).*/\\1/p' /etc/hccn.conf 2>/dev/null | tail -n 1); }\n"
        "if [ -z \"$a\" ]; then echo 'orch:ping 1 - none'\n"
        "elif [ $(($(date +%s) - t0)) -ge 60 ]; then echo \"orch:ping 1 $a $s\"; echo orch:skipped\n"
        "else echo \"orch:ping 1 $a $s\"; $P \"$H\" -i 1 -ping -g address \"$a\" 2>&1; "
        "printf '\\norch:rc %s\\n' \"$?\"; fi")
    assert subprocess.run(["sh", "-n"], input=body, text=True).returncode == 0
    # run it with an hccn_tool that answers with the fixtures (and an hccn.conf of its own)
    for f in ("hccn-link-up.txt", "hccn-net-health-init.txt", "hccn-ping-ok.txt", "hccn-netdetect.conf"):
        shutil.copy(FIX / f, tmp_path / f)
    _fake(tmp_path, "hccn_tool", f"case $3 in -link) cat {tmp_path}/hccn-link-up.txt ;; "
                                 f"-net_health) cat {tmp_path}/hccn-net-health-init.txt ;; "
                                 f"-ping) echo \"$@\" >> {tmp_path}/pings; cat {tmp_path}/hccn-ping-ok.txt ;; esac\n")
    out = _run(body.replace("/etc/hccn.conf", str(tmp_path / "hccn-netdetect.conf")), tmp_path)
    assert health.parse_hccn_section(out) == {
        0: DeviceNet(0, "UP", "Init", Ping("29.1.137.205", "peer", PingResult(3, 3, 0.0))),
        1: DeviceNet(1, "UP", "Init", None)}  # the fixture's hccn.conf has netdetect_0 and _7 only
    assert (tmp_path / "pings").read_text() == "-i 0 -ping -g address 29.1.137.205\n"
    # netdetect_7 of the same file: device 7 pings its detect address
    body7 = health.hccn_script([7], {}).replace("/etc/hccn.conf", str(tmp_path / "hccn-netdetect.conf"))
    got = health.parse_hccn_section(_run(body7, tmp_path))
    assert got[7].ping == Ping("29.1.0.1", "netdetect", PingResult(3, 3, 0.0))


def test_hccn_section_without_hccn_tool(tmp_path):
    body = health.hccn_script([0], {}).replace(health.HCCN_TOOL, str(tmp_path / "nowhere"))
    assert health.parse_hccn_section(_run(body, tmp_path)) is None


def test_hccn_section_spent_budget_skips_pings(tmp_path):
    _fake(tmp_path, "hccn_tool", "echo 'link status: UP'\n")
    body = health.hccn_script([0], {0: "10.9.0.1"}).replace("t0=$(date +%s)", "t0=0")
    assert health.parse_hccn_section(_run(body, tmp_path))[0].ping == Ping("10.9.0.1", "peer", None, skipped=True)


def test_gpu_section_falls_back_for_old_drivers(tmp_path):
    """A driver without the remapped_rows fields says so; the probe asks again without them."""
    shutil.copy(FIX / "nvidia-smi-query-gpu-h100.csv", tmp_path / "q.csv")
    _fake(tmp_path, "nvidia-smi", "case $1 in *remapped_rows*) echo 'Field \"remapped_rows.pending\" is not a valid "
                                  f"field to query.'; exit 2 ;; esac\ncat {tmp_path}/q.csv\n")
    out = _run(health.gpu_script(), tmp_path)
    assert "not a valid field" not in out
    assert health.parse_gpu_query(out)[0].uncorrected == 0
    assert health.parse_gpu_query(_run(health.gpu_script(), tmp_path / "empty")) is None  # no nvidia-smi


def test_xid_section_dmesg_journalctl_or_unreadable(tmp_path):
    shutil.copy(FIX / "xid-dmesg-bumblebee-677.txt", tmp_path / "k.txt")
    _fake(tmp_path, "dmesg", f"echo '[    0.000000] Linux version 6.1'; cat {tmp_path}/k.txt\n")
    log = health.parse_xid_log(_run(health.xid_script(), tmp_path))
    assert log.readable and log.source == "dmesg" and [e.xid for e in log.events] == [32, 32, 31]
    assert log.uptime is not None  # /proc/uptime of this machine
    # dmesg_restrict: dmesg fails, journalctl (short-monotonic) answers
    _fake(tmp_path, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted' >&2; exit 1\n")
    _fake(tmp_path, "journalctl", f"cat {tmp_path}/k.txt\n")
    log = health.parse_xid_log(_run(health.xid_script(), tmp_path))
    assert log.readable and log.source == "journalctl" and len(log.events) == 3
    _fake(tmp_path, "journalctl", "exit 0\n")  # a user who sees no kernel messages at all
    assert not health.parse_xid_log(_run(health.xid_script(), tmp_path)).readable


# --------------------------------------------------------------------------- judging (pure)


def ascend_sections(npu: str, per_device: dict) -> dict[str, Section]:
    return {"npu": sec("npu", npu), "health:hccn": sec("health:hccn", hccn_output(per_device))}


def test_ascend_healthy():
    c = ascend_cluster()
    v = health.judge(c, c.hosts[0], ascend_sections(fx("npu-smi-info-910b1.txt"), {0: HEALTHY, 1: HEALTHY}))
    assert v.status == "pass", v
    assert v.message == ("NPU 0-1 health OK; links UP on devices 0-1; net health Success on devices 0-1; "
                         "devices 0-1 reach n2's devices (0% loss)")


def test_ascend_warning_npu_and_net_health_init():
    c = ascend_cluster(devices=(0,))
    init = (HEALTHY[0], fx("hccn-net-health-init.txt"), None)
    v = health.judge(c, c.hosts[0], ascend_sections(fx("npu-smi-info-warning.txt"), {0: init}))
    assert v.status == "warn"
    assert "NPU 0 health Warning" in v.message and "device 0: net health Init" in v.message


def test_ascend_alarm_and_critical_fail():
    c = ascend_cluster()
    # no public npu-smi output shows Alarm: the Warning fixture with its health word changed
    npu = fx("npu-smi-info-warning.txt").replace("| Warning            |", "| Alarm              |")
    v = health.judge(c, c.hosts[0], ascend_sections(npu, {0: HEALTHY, 1: HEALTHY}))
    assert v.status == "fail" and v.message.startswith("NPU 0 health Alarm; NPU 1 not listed by npu-smi info")


def test_ascend_link_down_net_fault_and_ping_failures():
    c = ascend_cluster(n=3, devices=(0, 1, 2, 3))
    down = (fx("hccn-link-down.txt"), fx("hccn-net-health-fault.txt"), None)
    lossy = (HEALTHY[0], HEALTHY[1], ("10.10.100.10", "peer", fx("hccn-ping-loss.txt")))
    # no public output shows a ping that lost everything: the loss fixture with its answers lost
    dead_text = "device 3 PING 29.1.0.1\nrecv time out seq=0\nrecv time out seq=1\nrecv time out seq=2\n" \
                "3 packets transmitted, 0 received, 100.00% packet loss\n"
    dead = (HEALTHY[0], fx("hccn-net-health-socket-failed.txt"), ("29.1.0.1", "netdetect", dead_text))
    v = health.judge(c, c.hosts[0], ascend_sections(fx("npu-smi-info-910b1.txt").replace("| 7 ", "| 2 "),
                                                    {0: HEALTHY, 1: down, 2: lossy, 3: dead}))
    assert v.status == "fail"
    assert "device 1: link DOWN" in v.message and "device 1: net health Fault" in v.message
    assert "device 3: net health Socket failed" in v.message
    assert "device 3 -> 29.1.0.1 (netdetect): unreachable (3 packets, all lost)" in v.message
    assert "device 2 -> 10.10.100.10 (device 2 of n2): 33.33% packet loss" in v.message
    assert "NPU 3 not listed by npu-smi info" in v.message
    # fails first, warnings after
    assert v.message.index("link DOWN") < v.message.index("packet loss")


def test_ascend_tools_missing_is_not_available():
    c = ascend_cluster()
    missing = {"npu": sec("npu", NOT_INSTALLED), "health:hccn": sec("health:hccn", NOT_INSTALLED)}
    v = health.judge(c, c.hosts[0], missing)
    assert v.status == "warn"
    assert v.message == ("npu-smi not found: NPU health not checked; hccn_tool not found: device links, network "
                         "health and pings not checked")


def test_ascend_garbage_and_cut_off_are_errors():
    c = ascend_cluster(devices=(0,))
    busy = ("hccn_tool is busy, please try again", HEALTHY[1], None)
    v = health.judge(c, c.hosts[0], ascend_sections(fx("npu-smi-info-910b1.txt"), {0: busy}))
    assert v.status == "error" and "hccn_tool -link -g" in v.message and "'hccn_tool is busy" in v.message
    v = health.judge(c, c.hosts[0], ascend_sections("dcmi module initialize failed. ret is -8005\n", {0: HEALTHY}))
    assert v.status == "error" and "npu-smi info" in v.message and "-8005" in v.message
    cut = {"npu": sec("npu", fx("npu-smi-info-910b1.txt")), "health:hccn": sec("health:hccn", "orch:run 0 link", None)}
    v = health.judge(c, c.hosts[0], cut)
    assert v.status == "error" and "cut off" in v.message


def test_ascend_unpinged_and_skipped():
    c = ascend_cluster(devices=(0, 1))
    text = hccn_output({0: (HEALTHY[0], HEALTHY[1], None)}) + hccn_output({1: (HEALTHY[0], HEALTHY[1], None)}).replace(
        "orch:ping 1 - none", "orch:ping 1 10.9.0.2 peer\norch:skipped")
    v = health.judge(c, c.hosts[0], {"npu": sec("npu", fx("npu-smi-info-910b1.txt")), "health:hccn": sec("h", text)})
    assert v.status == "warn" and "not pinged (the probe's 60s ping budget was spent)" in v.message
    v = health.judge(c, c.hosts[0], ascend_sections(fx("npu-smi-info-910b1.txt"), {0: HEALTHY[:2] + (None,),
                                                                                   1: HEALTHY}))
    assert v.status == "pass" and "device 0 not pinged: no address" in v.message


def gpu_sections(csv_text: str, xid_text: str) -> dict[str, Section]:
    return {"health:gpu": sec("health:gpu", csv_text), "health:xid": sec("health:xid", xid_text)}


def xid_body(lines: str, uptime: float, n: int = 1234) -> str:
    return f"uptime {uptime:.2f}\nsource dmesg\n{lines}orch:lines {n}\n"


def test_gpu_healthy():
    c = gpu_cluster()
    v = health.judge(c, c.hosts[0], gpu_sections(fx("nvidia-smi-query-gpu-h100.csv"), xid_body("", 5000)))
    assert v == health.Verdict("pass", "GPU 0: no uncorrectable ECC errors, no pending retirement/remap; no XID in "
                                       "the kernel log (dmesg) for 24h")
    v = health.judge(c, c.hosts[0], gpu_sections(fx("nvidia-smi-query-gpu-rtx2080.csv"), xid_body("", 5000, 0)))
    assert v.status == "pass" and "no ECC on these GPUs" in v.message and "kernel log not readable" in v.message


def test_gpu_ecc_errors_and_remap_fail():
    c = gpu_cluster()
    # no public CSV shows a sick GPU: the H100 capture with its counters changed
    text = fx("nvidia-smi-query-gpu-h100.csv")
    header, row = text.splitlines()
    cols = [h.strip() for h in header.split(",")]
    cells = [x.strip() for x in row.split(",")]
    cells[cols.index("ecc.errors.uncorrected.volatile.total")] = "2"
    cells[cols.index("remapped_rows.pending")] = "Yes"
    v = health.judge(c, c.hosts[0], gpu_sections(header + "\n" + ", ".join(cells) + "\n", xid_body("", 100)))
    assert v.status == "fail"
    assert v.message == ("GPU 0 (NVIDIA H100 80GB HBM3): 2 uncorrectable ECC error(s) since the driver loaded, rows "
                         "pending remap (reset the GPU)")
    cells[cols.index("ecc.errors.uncorrected.volatile.total")] = "0"
    cells[cols.index("remapped_rows.pending")] = "No"
    cells[cols.index("ecc.mode.current")] = "Disabled"
    v = health.judge(c, c.hosts[0], gpu_sections(header + "\n" + ", ".join(cells) + "\n", xid_body("", 100)))
    assert v.status == "warn" and "ECC disabled" in v.message


def test_gpu_xids_recent_severe_fail_others_warn_old_ignored():
    c = gpu_cluster()
    csv_text = fx("nvidia-smi-query-gpu-h100.csv")
    bumble = fx("xid-dmesg-bumblebee-677.txt")  # XID 32 and 31 at 24128 s after boot, on PCI 0000:01:00
    v = health.judge(c, c.hosts[0], gpu_sections(csv_text, xid_body(bumble, 24128.8 + 3600)))
    assert v.status == "warn"
    assert "XID 31 on PCI 0000:01:00 (1x, last 1.0h ago)" in v.message and "XID 32 on PCI 0000:01:00 (2x" in v.message
    old = health.judge(c, c.hosts[0], gpu_sections(csv_text, xid_body(bumble, 24128.8 + 2 * 86400)))
    assert old.status == "pass" and old.message.endswith("for 24h, 3 older")
    v = health.judge(c, c.hosts[0], gpu_sections(csv_text, xid_body(fx("xid-kmsg-gpud-870.txt"), 100)))
    assert v.status == "fail" and v.message.startswith("XID 79 on PCI 0000:04:00 (1x): ")
    assert "GPU has fallen off the bus" in v.message
    # an XID on a GPU nvidia-smi lists: named by index; on a GPU the job does not use: ignored
    mine = "[   90.000000] NVRM: Xid (PCI:0000:00:09): 48, pid=1, An uncorrectable double bit error\n"
    v = health.judge(c, c.hosts[0], gpu_sections(csv_text, xid_body(mine, 100)))
    assert v.status == "fail" and v.message.startswith("XID 48 on GPU 0 (1x, last 0.0h ago)")
    other = gpu_cluster(devices=(1,))
    two = csv_text.rstrip("\n") + "\n" + csv_text.splitlines()[1].replace(", 0, ", ", 1, ", 1).replace(
        "00000000:00:09.0", "00000000:00:0A.0") + "\n"
    assert sorted(health.parse_gpu_query(two)) == [0, 1]
    assert health.judge(other, other.hosts[0], gpu_sections(two, xid_body(mine, 100))).status == "pass"


def test_gpu_tool_missing_and_garbage():
    c = gpu_cluster()
    v = health.judge(c, c.hosts[0], gpu_sections(NOT_INSTALLED, xid_body("", 100, 0)))
    assert v.status == "warn" and v.message.startswith("nvidia-smi not found: GPU health (ECC, XID) not checked")
    failed = (CHECKS_FIX / "nvidia-smi-failed.txt").read_text()
    garbage = {"health:gpu": sec("health:gpu", failed, 9), "health:xid": sec("x", "orch:lines 0")}
    v = health.judge(c, c.hosts[0], garbage)
    assert v.status == "error" and "nvidia-smi --query-gpu" in v.message and "(exit 9)" in v.message


# --------------------------------------------------------------------------- wiring: plan, probe, judge_host, CLI


def test_health_only_with_deep_and_only_on_ascend_or_gpu():
    c = ascend_cluster()
    plain, deep = checks.make_check_plan(c), checks.make_check_plan(c, deep=True)
    assert "health" not in plain.checks and "health" in deep.checks
    assert "_b health:hccn" not in checks.probe_script(plain, c.hosts[0])
    assert "_b health:hccn" in checks.probe_script(deep, c.hosts[0])
    assert checks.applies(deep, "health", c.hosts[0]) and not checks.applies(plain, "health", c.hosts[0])
    # devices skipped: --deep still reads npu-smi (health needs it)
    nodev = replace(c, checks=Checks(skip=("devices",)))
    s = checks.probe_script(checks.make_check_plan(nodev, deep=True), c.hosts[0])
    assert "_b npu" in s and "_b health:hccn" in s
    assert "health" not in checks.make_check_plan(replace(c, checks=Checks(skip=("health",))), deep=True).checks
    g = gpu_cluster()
    s = checks.probe_script(checks.make_check_plan(g, deep=True), g.hosts[0])
    assert "_b health:gpu" in s and "_b health:xid" in s
    assert subprocess.run(["sh", "-n"], input=s, text=True).returncode == 0
    cpu = replace(g, job=replace(g.job, platform="cpu"))
    assert checks.probe_script(checks.make_check_plan(cpu, deep=True), g.hosts[0]) == \
        checks.probe_script(checks.make_check_plan(cpu), g.hosts[0])
    assert not checks.applies(checks.make_check_plan(cpu, deep=True), "health", g.hosts[0])


def test_judge_host_gives_one_health_result_per_host():
    c = ascend_cluster(peer_ips={0: "29.1.137.205", 1: "29.1.137.206"})
    plan = checks.make_check_plan(c, deep=True)
    s = {"clock0": sec("clock0", "1.0"), "clock1": sec("clock1", "1.1"), **ascend_sections(
        fx("npu-smi-info-910b1.txt"), {0: HEALTHY, 1: HEALTHY})}
    got = [r for r in checks.judge_host(plan, ProbeRun(c.hosts[0], s, t_send=1.0, t_recv=1.1)) if r.check == "health"]
    assert len(got) == 1 and got[0].status == "pass" and got[0].host == "n1"
    unreachable = checks.judge_host(plan, ProbeRun(c.hosts[1], None, stage="connect"))
    assert [r.status for r in unreachable if r.check == "health"] == ["error"]


def _local_cluster_file(tmp_path: Path, platform: str = "cpu") -> Path:
    f = tmp_path / "cluster.yaml"
    f.write_text(f"""
inventory:
  defaults: {{connection: local}}
  hosts: [{{address: 127.0.0.1, name: me}}]
job: {{workdir: {tmp_path / 'wd'}, command: python3 net.py, platform: {platform}}}
checks: {{versions: [python], min_free_gib: 0.001}}
""")
    return f


def test_cli_deep_on_a_cpu_cluster_adds_nothing(tmp_path):
    from orchestrator.cli import cli

    f = _local_cluster_file(tmp_path)
    plain = json.loads(CliRunner().invoke(cli, ["check", str(f), "--json"]).stdout)
    deep = json.loads(CliRunner().invoke(cli, ["check", str(f), "--json", "--deep"]).stdout)
    # clock and stale read this machine as it is at that moment (other runs' processes come and go)
    assert [(r["check"], r["status"]) for r in deep["results"] if r["check"] not in ("clock", "stale")] == \
        [(r["check"], r["status"]) for r in plain["results"] if r["check"] not in ("clock", "stale")]
    assert not any(r["check"] == "health" for r in deep["results"])
    p1 = CliRunner().invoke(cli, ["check", str(f), "--print-probe", "me"]).stdout
    assert CliRunner().invoke(cli, ["check", str(f), "--print-probe", "me", "--deep"]).stdout == p1


@pytest.mark.skipif(bool(shutil.which("npu-smi") or shutil.which("hccn_tool") or os.path.exists(health.HCCN_TOOL)),
                    reason="this machine has Ascend tools")
def test_cli_deep_on_ascend_without_the_tools_says_not_available(tmp_path):
    """This machine (connection: local) has neither npu-smi nor hccn_tool: a warn, never a traceback."""
    from orchestrator.cli import cli

    res = CliRunner().invoke(cli, ["check", str(_local_cluster_file(tmp_path, "ascend")), "--json", "--deep"])
    got = [r for r in json.loads(res.stdout)["results"] if r["check"] == "health"]
    assert got == [{"check": "health", "host": "me", "status": "warn", "message": (
        "npu-smi not found: NPU health not checked; hccn_tool not found: device links, network health and pings "
        "not checked")}]


def test_a3_health_reads_every_die():
    """Atlas A3: npu-smi lists two rows per die; devices 8-15 are dies too, not missing NPUs."""
    from pathlib import Path

    from orchestrator import health
    from orchestrator.probes import Section
    from orchestrator.spec import Cluster, Host, Job
    text = (Path(__file__).resolve().parents[1] / "fixtures" / "npu-smi" / "info-a3.txt").read_text()
    h = Host(name="a3", address="10.0.0.1", user="u", slots=16, devices=tuple(range(16)))
    c = Cluster(name="t", path=Path("/tmp/c.yaml"), hosts=(h,),
                job=Job(workdir="/w", command=("x",), launcher="ranktable", platform="ascend"))
    v = health.judge_ascend(c, h, {"npu": Section("npu", text, 0)})
    assert "not listed by npu-smi" not in v.message, v
