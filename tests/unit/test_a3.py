"""Atlas A3 (SuperPoD), rank table 1.2: npu-smi parsers (tests/fixtures/npu-smi/, sources in
its README), super device ids from the inventory and the hosts, the 1.2 table (golden file
tests/golden/rank_table_1.2_2x16.json, rewritten under ORCH_UPDATE_GOLDEN=1 like test_render's)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from orchestrator import devices
from orchestrator.devices import (
    SpodInfo, a3_card_chip, card_chip, needs_probe, parse_npu_mapping, parse_spod_info, parse_spod_sections,
    read_spod, spod_script, super_devices_for,
)
from orchestrator.errors import PlanError
from orchestrator.launchers.show import launch_commands
from orchestrator.rankplan import device_ips_for, make_plan
from orchestrator.launchers.ranktable import rank_table, rank_table_v12
from orchestrator.spec import Cluster, Host, Job
from orchestrator.transport.base import Result

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures" / "npu-smi"
GOLDEN = ROOT / "golden"
UPDATE = os.environ.get("ORCH_UPDATE_GOLDEN") == "1"

# Server 10.0.0.1: the values of a published A3 rank table (Huawei MindCluster's log-collection
# guide, docs/zh/faultdiag/ascend-faultdiag/05_usage/02_log_collection.md in github.com/Ascend/mind-cluster:
# one 16-die server, super pod "1"). Server 10.0.0.2: the same layout one server further
# (SDID = server index << 22 | (NPU * 4 + die) << 16 | device id; device IPs the next eight).
SDIDS_1 = [113246208, 113311745, 113508354, 113573891, 113770500, 113836037, 114032646, 114098183,
           114294792, 114360329, 114556938, 114622475, 114819084, 114884621, 115081230, 115146767]
SDIDS_2 = [(28 << 22) | ((d // 2 * 4 + d % 2) << 16) | d for d in range(16)]
IPS_1 = {d: f"10.0.{2 + d % 2}.{41 + d // 2}" for d in range(16)}
IPS_2 = {d: f"10.0.{2 + d % 2}.{49 + d // 2}" for d in range(16)}


def a3(address: str, devices=range(16), **kw) -> Host:
    devices = tuple(devices)
    return Host(name=kw.pop("name", address), address=address, user="train", slots=len(devices),
                devices=devices, **kw)


def cluster(*hosts: Host, launcher="ranktable", version="1.2", **job) -> Cluster:
    return Cluster(name="t", path=Path("/tmp/cluster.yaml"), hosts=tuple(hosts),
                   job=Job(workdir="/data/job", command=("python", "train.py"), launcher=launcher,
                           platform="ascend", rank_table_version=version, **job))


def fx(name: str) -> str:
    return (FIX / name).read_text()


def golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"rendering differs from {path}"


def two_servers(**kw) -> Cluster:
    """2 x 16 in super pod 1, listed out of order in the inventory."""
    return cluster(a3("10.0.0.2", device_ips=IPS_2, super_device_ids=dict(enumerate(SDIDS_2)), super_pod_id=1),
                   a3("10.0.0.1", device_ips=IPS_1, super_device_ids=dict(enumerate(SDIDS_1)), super_pod_id=1),
                   **kw)


# --------------------------------------------------------------------------- npu-smi parsers


def test_spod_info_as_npu_smi_prints_it():
    info = parse_spod_info(fx("spod-info-a3.txt"))
    assert (info.sdid, info.super_pod_size, info.super_pod_id, info.server_index) == (16777216, 384, 0, 4)


def test_spod_info_as_the_documentation_shows_it():
    assert parse_spod_info(fx("spod-info-a3-doc.txt")) == replace(parse_spod_info(fx("spod-info-a3.txt")),
                                                                  output=fx("spod-info-a3-doc.txt"))


@pytest.mark.parametrize("text", [fx("spod-info-unsupported.txt"), "", "sh: 1: npu-smi: not found\n",
                                  "\tSDID                           : \n\tSuper Pod ID : abc\n",
                                  "\tSDID : 99999999999\n"])
def test_spod_info_without_a_usable_sdid(text):
    info = parse_spod_info(text)
    assert info.sdid is None and info.output == text


def test_spod_info_zero_is_a_value_not_a_gap():
    """Super Pod ID 0 (and SDID 0) are real values, not missing ones."""
    info = parse_spod_info("\tSDID                           : 0\n\tSuper Pod ID                   : 0\n")
    assert (info.sdid, info.super_pod_id) == (0, 0)


def test_npu_mapping_a3():
    m = parse_npu_mapping(fx("info-m-a3.txt"))
    assert len(m) == 16 and m[0] == (0, 0) and m[1] == (0, 1) and m[15] == (7, 1)
    assert all(m[d] == a3_card_chip(d) for d in range(16))


def test_npu_mapping_is_read_not_assumed():
    """A host whose NPU ids do not start at 0 (a container given NPUs 8 and 9): -m decides."""
    text = ("\tNPU ID   Chip ID   Chip Logic ID   Chip Phy-ID   Chip Name\n"
            "\t8        0         0               4             Ascend910\n"
            "\t8        1         1               5             Ascend910\n"
            "\t8        2         -               -             Mcu\n")
    m = parse_npu_mapping(text)
    assert m == {4: (8, 0), 5: (8, 1)}
    assert card_chip(5, m) == (8, 1) and card_chip(6, m) == a3_card_chip(6) == (3, 0)


@pytest.mark.parametrize("text", [fx("info-m-910b.txt"), "", "npu-smi: command not found"])
def test_npu_mapping_without_physical_ids(text):
    assert parse_npu_mapping(text) == {}


def test_device_ids_folded():
    assert devices.device_ids([3]) == "device 3"
    assert devices.device_ids(list(range(16))) == "devices 0-15"
    assert devices.device_ids([5, 0, 2, 6, 7]) == "devices 0,2,5-7"


def test_spod_script_quotes_and_sections_round_trip():
    script = spod_script([(0, 0, 0), (3, 1, 1)])
    assert "npu-smi info -t spod-info -i 0 -c 0" in script and "npu-smi info -t spod-info -i 1 -c 1" in script
    out = f"{devices.SECTION} 0\n{fx('spod-info-a3.txt')}{devices.SECTION} 3\n{fx('spod-info-unsupported.txt')}"
    got = parse_spod_sections(out)
    assert got[0].sdid == 16777216 and got[3].sdid is None
    assert spod_script([]) == "true"


class FakeNpuSmi:
    """A transport whose host answers npu-smi like an A3 server (SDID = 1000 + device)."""

    def __init__(self, mapping: str | None = None, pod: int = 7):
        self.mapping = fx("info-m-a3.txt") if mapping is None else mapping
        self.pod = pod
        self.commands: list = []

    def run(self, command, **kw) -> Result:
        self.commands.append(command)
        if isinstance(command, list):
            return Result("h", " ".join(command), 0, self.mapping.encode(), b"", 0.0)
        out = []
        for part in command.split("; "):
            if part.startswith("echo"):
                out.append(part.split(" ", 1)[1].strip("'"))
            elif part.startswith("npu-smi"):
                a = part.split()
                card, chip = int(a[a.index("-i") + 1]), int(a[a.index("-c") + 1])
                d = card * 2 + chip
                out.append(f"\t{'SDID':<30} : {1000 + d}\n\t{'Super Pod Size':<30} : 48\n"
                           f"\t{'Super Pod ID':<30} : {self.pod}\n\t{'Server Index':<30} : 0")
        return Result("h", command, 0, "\n".join(out).encode(), b"", 0.0)


def test_read_spod_asks_only_for_what_the_inventory_lacks():
    t = FakeNpuSmi()
    h = a3("10.0.0.1", super_device_ids={d: 1000 + d for d in range(14)})
    got = read_spod(t, h)
    assert sorted(got) == [14, 15] and got[15].sdid == 1015 and got[15].super_pod_id == 7
    assert got[15].query == "npu-smi info -t spod-info -i 7 -c 1"
    assert t.commands[0] == ["npu-smi", "info", "-m"]
    assert "-i 0 " not in t.commands[1]


def test_read_spod_falls_back_to_two_dies_per_npu():
    t = FakeNpuSmi(mapping="npu-smi: command not found")
    got = read_spod(t, a3("10.0.0.1", devices=[2, 3]))
    assert got[3].query == "npu-smi info -t spod-info -i 1 -c 1" and got[3].sdid == 1003


def test_read_spod_for_the_pod_only():
    t = FakeNpuSmi()
    h = a3("10.0.0.1", super_device_ids={d: 1000 + d for d in range(16)})
    assert needs_probe(h) and not needs_probe(replace(h, super_pod_id=0))
    assert sorted(read_spod(t, h)) == [0]


# --------------------------------------------------------------------------- resolving


def test_inventory_first_then_the_host():
    c = cluster(a3("10.0.0.1", super_device_ids={0: 5}, super_pod_id=2))
    plan = make_plan(c)
    probed = {"10.0.0.1": read_spod(FakeNpuSmi(), plan.hosts[0])}
    h = super_devices_for(plan, probed).hosts[0]
    assert h.super_device_ids[0] == 5 and h.super_device_ids[1] == 1001 and h.super_pod_id == 2


def test_pod_from_the_host():
    plan = make_plan(cluster(a3("10.0.0.1")))
    h = super_devices_for(plan, {"10.0.0.1": read_spod(FakeNpuSmi(pod=0), plan.hosts[0])}).hosts[0]
    assert h.super_pod_id == 0 and h.super_device_ids == {d: 1000 + d for d in range(16)}


def test_missing_without_probe_names_host_and_device():
    plan = make_plan(cluster(a3("10.0.0.1", devices=[0, 1], super_device_ids={0: 5}, super_pod_id=0)))
    with pytest.raises(PlanError) as exc:
        super_devices_for(plan, {})
    msg = str(exc.value)
    assert "host 10.0.0.1 device 1: no super_device_id" in msg and "--probe" in msg
    assert "device 0" not in msg


def test_empty_sdid_from_the_host_is_an_error_not_an_empty_string():
    plan = make_plan(cluster(a3("10.0.0.1", devices=[0, 1], super_pod_id=0)))
    probed = {"10.0.0.1": {0: parse_spod_info(fx("spod-info-a3.txt")),
                           1: replace(parse_spod_info("\tSDID                           : \n"),
                                      query="npu-smi info -t spod-info -i 0 -c 1")}}
    with pytest.raises(PlanError) as exc:
        super_devices_for(plan, probed)
    assert "host 10.0.0.1 device 1" in str(exc.value) and "npu-smi info -t spod-info -i 0 -c 1" in str(exc.value)
    assert "device 0" not in str(exc.value)


def test_dies_that_disagree_on_the_pod():
    plan = make_plan(cluster(a3("10.0.0.1", devices=[0, 1])))
    probed = {"10.0.0.1": {0: SpodInfo(1, 0), 1: SpodInfo(2, 1)}}
    with pytest.raises(PlanError, match="different Super Pod IDs"):
        super_devices_for(plan, probed)


def test_same_sdid_twice_in_a_pod():
    c = cluster(a3("10.0.0.1", devices=[0, 1], super_device_ids={0: 9, 1: 10}, super_pod_id=0),
                a3("10.0.0.2", devices=[0, 1], super_device_ids={0: 9, 1: 11}, super_pod_id=0))
    with pytest.raises(PlanError, match="super_device_id 9 is also host 10.0.0.1 device 0's"):
        super_devices_for(make_plan(c), {})
    # in different super pods the same id is fine
    c2 = cluster(*[replace(h, super_pod_id=i) for i, h in enumerate(c.hosts)])
    super_devices_for(make_plan(c2), {})


def test_pods_from_the_inventory_order_the_hosts():
    """HCCL lists one super pod's servers after another's: the inventory's super_pod_id groups them."""
    hosts = [a3(f"10.0.0.{i}", devices=[0, 1], super_device_ids={0: 2 * i, 1: 2 * i + 1}, super_pod_id=i % 2)
             for i in range(1, 5)]
    plan = make_plan(cluster(*hosts))
    assert [h.address for h in plan.hosts] == ["10.0.0.2", "10.0.0.4", "10.0.0.1", "10.0.0.3"]
    table = json.loads(rank_table_v12(super_devices_for(plan, {}), {h.name: {0: "1.1.1.1", 1: "1.1.1.2"}
                                                                     for h in hosts}))
    assert [p["super_pod_id"] for p in table["super_pod_list"]] == ["0", "1"]
    assert table["super_pod_list"][1]["server_list"] == [{"server_id": "10.0.0.1"}, {"server_id": "10.0.0.3"}]


def test_pods_from_the_hosts_that_interleave():
    hosts = [a3(f"10.0.0.{i}", devices=[0, 1], super_device_ids={0: 2 * i, 1: 2 * i + 1}) for i in range(1, 4)]
    plan = make_plan(cluster(*hosts))
    probed = {f"10.0.0.{i}": {0: SpodInfo(2 * i, i % 2)} for i in range(1, 4)}
    with pytest.raises(PlanError) as exc:
        super_devices_for(plan, probed)
    assert "super pod 1: its servers are not listed together" in str(exc.value)
    assert "super_pod_id in the inventory" in str(exc.value)


# --------------------------------------------------------------------------- the 1.2 table


def test_golden_2x16():
    c = two_servers()
    plan = super_devices_for(make_plan(c), {})
    text = rank_table(c, plan, device_ips_for(plan, {}))
    golden("rank_table_1.2_2x16.json", text)
    t = json.loads(text)
    assert list(t) == ["status", "version", "server_count", "server_list", "super_pod_list"]
    assert (t["status"], t["version"], t["server_count"]) == ("completed", "1.2", "2")
    s0 = t["server_list"][0]
    assert list(s0) == ["server_id", "host_ip", "device"] and s0["server_id"] == s0["host_ip"] == "10.0.0.1"
    assert list(s0["device"][0]) == ["device_id", "super_device_id", "device_ip", "rank_id"]
    assert [d["rank_id"] for s in t["server_list"] for d in s["device"]] == [str(r) for r in range(32)]
    assert s0["device"][1] == {"device_id": "1", "super_device_id": "113311745", "device_ip": "10.0.3.41",
                               "rank_id": "1"}
    assert t["super_pod_list"] == [{"super_pod_id": "1", "server_list": [{"server_id": "10.0.0.1"},
                                                                          {"server_id": "10.0.0.2"}]}]
    assert all(isinstance(v, str) for s in t["server_list"] for d in s["device"] for v in d.values())


def test_golden_matches_the_published_example_shape():
    """Same keys at every level as the HCCL user guide's SuperPoD example (without its optional ports)."""
    t = json.loads((GOLDEN / "rank_table_1.2_2x16.json").read_text())
    published = {"status": "completed", "version": "1.2", "server_count": "4",
                 "server_list": [{"server_id": "node_0", "host_ip": "172.16.0.100",
                                  "device": [{"device_id": "0", "super_device_id": "0", "device_ip": "192.168.1.6",
                                              "rank_id": "0"}]}],
                 "super_pod_list": [{"super_pod_id": "0", "server_list": [{"server_id": "node_0"}]}]}
    assert list(t) == list(published)
    assert list(t["server_list"][0]) == list(published["server_list"][0])
    assert list(t["server_list"][0]["device"][0]) == list(published["server_list"][0]["device"][0])
    assert list(t["super_pod_list"][0]) == list(published["super_pod_list"][0])


def test_dns_names_leave_host_ip_out():
    c = cluster(a3("node01", devices=[0, 1], device_ips={0: "1.1.1.1", 1: "1.1.1.2"}, super_device_ids={0: 1, 1: 2},
                   super_pod_id=0))
    plan = make_plan(c)
    server = json.loads(rank_table_v12(plan, device_ips_for(plan, {})))["server_list"][0]
    assert server["server_id"] == "node01" and "host_ip" not in server


def test_the_renderer_refuses_what_hccl_refuses():
    c = two_servers()
    plan = make_plan(c)
    ips = device_ips_for(plan, {})
    broken = replace(plan, hosts=(replace(plan.hosts[0], super_device_ids={**plan.hosts[0].super_device_ids, 3: ""}),
                                  plan.hosts[1]))
    with pytest.raises(PlanError, match=r"host 10.0.0.1 device 3: super_device_id '' is not"):
        rank_table_v12(broken, ips)
    no_pod = replace(plan, hosts=(replace(plan.hosts[0], super_pod_id=None), plan.hosts[1]))
    with pytest.raises(PlanError, match="host 10.0.0.1: no super_pod_id"):
        rank_table_v12(no_pod, ips)
    missing = replace(plan, hosts=(replace(plan.hosts[0], super_device_ids={}), plan.hosts[1]))
    with pytest.raises(PlanError, match="device 0: super_device_id None"):
        rank_table(c, missing, ips)


def test_1_0_is_unchanged_by_the_a3_keys():
    c = two_servers(version="1.0")
    with pytest.raises(PlanError, match="device ids are 0..7"):
        make_plan(c)


def test_plan_commands_for_1_2():
    """`orch plan` shows the ranktable launcher's commands for a 1.2 job like for a 1.0 one."""
    c = two_servers()
    plan = super_devices_for(make_plan(c), {})
    cmds = launch_commands(c, plan, root=False)
    assert [r["rank"] for h in plan.hosts for r in cmds[h.name]] == list(range(32))
    rank17 = cmds["10.0.0.2"][1]
    assert rank17["env"]["DEVICE_ID"] == "1" and rank17["env"]["RANK_ID"] == "17"


# --------------------------------------------------------------------------- orch check on an A3 server


def test_npu_smi_info_a3_is_read_per_die():
    """`npu-smi info` on A3 lists NPUs 0..7, each with two dies (Chip, Phy-ID): devices are the dies."""
    from orchestrator.devices import parse_npu_smi_dies

    dies = parse_npu_smi_dies(fx("info-a3.txt"))
    assert sorted(dies) == list(range(16)) and dies[13] == "Warning" and dies[12] == "OK"
    assert parse_npu_smi_dies((ROOT / "fixtures" / "checks" / "npu-smi-info-910b.txt").read_text()) is None
    from orchestrator.probes import parse_npu_smi

    assert parse_npu_smi(fx("info-a3.txt")) == dies  # the one reader checks and health use


def test_devices_check_sees_16_dies():
    from orchestrator import checks
    from orchestrator.probes import Section

    h = a3("10.0.0.1")
    hccn = "".join(f"address_{d}={IPS_1[d]}\nnetmask_{d}=255.255.255.0\n" for d in range(16))
    res = checks.judge_devices(cluster(h), h, {"hccn": Section("hccn", hccn, 0),
                                                "npu": Section("npu", fx("info-a3.txt"), 0)})
    assert res.status == "warn" and "13 (Warning)" in res.message and "do not exist" not in res.message
    ghost = replace(h, devices=(15, 16), slots=2)
    res = checks.judge_devices(cluster(ghost), ghost, {"hccn": Section("hccn", hccn + "address_16=1.2.3.4\n", 0),
                                                        "npu": Section("npu", fx("info-a3.txt"), 0)})
    assert res.status == "fail" and "[16] do not exist" in res.message
