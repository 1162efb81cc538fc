"""orchestrator.rankplan (pure) and the `orch plan` command."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.devices import hccn_ips, parse_hccn
from orchestrator.errors import PlanError
from orchestrator.rankplan import (
    RULE_A3_MULTI, RULE_A3_NPU, RULE_MULTI, RULE_NETWORK, RULE_SINGLE, device_ips_for, make_plan,
    server_key,
)
from orchestrator.spec import Checks, Cluster, Host, Job

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
SEED000_IPS = {0: "192.168.100.101", 1: "192.168.101.101", 2: "192.168.102.101", 3: "192.168.103.101",
               4: "192.168.100.100", 5: "192.168.101.100", 6: "192.168.102.100", 7: "192.168.103.100"}


def host(address: str, devices=range(8), name: str | None = None, **kw) -> Host:
    devices = tuple(devices)
    return Host(name=name or address, address=address, user="train", slots=len(devices), devices=devices, **kw)


def cluster(*hosts: Host, launcher="mpirun", platform="cpu", skip=(), **job) -> Cluster:
    return Cluster(name="t", path=Path("/tmp/cluster.yaml"), hosts=tuple(hosts),
                   job=Job(workdir="/data/job", command=("python", "net.py"), launcher=launcher,
                           platform=platform, **job),
                   checks=Checks(skip=tuple(skip)))


def ascend(*hosts: Host, **kw) -> Cluster:
    return cluster(*hosts, launcher="ranktable", platform="ascend", **kw)


# --------------------------------------------------------------------------- order and layout


def test_hosts_sorted_numerically_ipv4_then_ipv6_then_dns_names():
    hosts = [host(a, range(1)) for a in ("node2", "10.0.0.10", "fe80::1", "10.0.0.2", "node10", "::1", "9.1.1.1")]
    plan = make_plan(cluster(*hosts))
    assert [h.address for h in plan.hosts] == ["9.1.1.1", "10.0.0.2", "10.0.0.10", "::1", "fe80::1",
                                                "node10", "node2"]
    assert plan.launch_host.address == "9.1.1.1"


def test_order_is_stable_for_equal_addresses():
    hosts = [host("127.0.0.1", range(2), name=n, connection="local") for n in ("b", "a", "c")]
    plan = make_plan(cluster(*hosts))
    assert [h.name for h in plan.hosts] == ["b", "a", "c"]


def test_ranks_contiguous_per_host_with_physical_device_ids():
    plan = make_plan(cluster(host("10.0.0.2", [4, 5, 6, 7]), host("10.0.0.1", [2, 3])))
    assert [(r.rank, r.host, r.local_rank, r.device_id) for r in plan.ranks] == [
        (0, "10.0.0.1", 0, 2), (1, "10.0.0.1", 1, 3),
        (2, "10.0.0.2", 0, 4), (3, "10.0.0.2", 1, 5), (4, "10.0.0.2", 2, 6), (5, "10.0.0.2", 3, 7)]
    assert plan.size == 6
    assert [r.rank for r in plan.by_host("10.0.0.2")] == [2, 3, 4, 5]
    assert plan.node_rank("10.0.0.2") == 1
    assert plan.host("10.0.0.1").devices == (2, 3)
    with pytest.raises(KeyError):
        plan.by_host("nope")


def test_plan_to_dict_lists_every_rank():
    plan = make_plan(cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(2))))
    d = plan.to_dict()
    assert d["size"] == 4 and d["launch_host"] == "10.0.0.1"
    assert d["ranks"][3] == {"rank": 3, "host": "10.0.0.2", "address": "10.0.0.2", "local_rank": 1, "device_id": 1}
    assert d["hosts"][1]["first_rank"] == 2


def test_no_hosts_is_a_plan_error():
    with pytest.raises(PlanError, match="no hosts"):
        make_plan(cluster())


def test_duplicate_device_and_slot_mismatch_refused():
    bad = Host(name="a", address="10.0.0.1", user="u", slots=3, devices=(1, 1, 2))
    short = Host(name="b", address="10.0.0.2", user="u", slots=8)  # devices default (0,)
    with pytest.raises(PlanError) as exc:
        make_plan(cluster(bad, short))
    assert "repeat an id" in str(exc.value) and "1 devices for 8 slots" in str(exc.value)


# --------------------------------------------------------------------------- Ascend device rules


@pytest.mark.parametrize("devices", [[0], [5], [1, 2], [0, 1], [6, 7], [0, 1, 2, 3], [4, 5, 6, 7], range(8)])
def test_ascend_single_host_allowed(devices):
    plan = make_plan(ascend(host("10.0.0.1", devices)))
    assert plan.size == len(list(devices)) and plan.warnings == ()


def test_ascend_cross_network_pair_refused_with_rule_text():
    with pytest.raises(PlanError) as exc:
        make_plan(ascend(host("10.0.0.1", [0, 4])))
    assert RULE_NETWORK in str(exc.value) and "{0,4}" in str(exc.value)
    assert exc.value.exit_code == 2


def test_ascend_four_devices_across_networks_refused():
    with pytest.raises(PlanError, match=r"\{2,3,4,5\}"):
        make_plan(ascend(host("10.0.0.1", [2, 3, 4, 5])))


@pytest.mark.parametrize("devices", [[0, 1, 2], range(6)])
def test_ascend_single_host_count_refused(devices):
    with pytest.raises(PlanError) as exc:
        make_plan(ascend(host("10.0.0.1", devices)))
    assert RULE_SINGLE in str(exc.value)


def test_ascend_multi_host_needs_8_per_host():
    with pytest.raises(PlanError) as exc:
        make_plan(ascend(host("10.0.0.1", range(4)), host("10.0.0.2", range(4))))
    assert RULE_MULTI in str(exc.value) and "10.0.0.[1-2]: 4" in str(exc.value)
    make_plan(ascend(host("10.0.0.1"), host("10.0.0.2")))  # 8 x 2 is fine


def test_ascend_device_ids_0_to_7_and_all_violations_in_one_message():
    with pytest.raises(PlanError) as exc:
        make_plan(ascend(host("10.0.0.1", range(8)), host("10.0.0.2", [1, 2, 3, 9])))
    msg = str(exc.value)
    assert "device ids are 0..7; host 10.0.0.2 lists [9]" in msg
    assert RULE_MULTI in msg and msg.count("\n  - ") == 2
    assert "checks.skip" in msg  # the hint says how to opt out


def test_skip_device_rules_gives_a_warning_not_an_error():
    plan = make_plan(ascend(host("10.0.0.1", [0, 4]), skip=["device-rules"]))
    assert plan.size == 2
    assert len(plan.warnings) == 1 and "device-rules is skipped" in plan.warnings[0]
    assert RULE_NETWORK in plan.warnings[0]


def test_device_rules_only_on_ascend():
    plan = make_plan(cluster(host("10.0.0.1", [0, 4, 5]), platform="gpu", launcher="ranktable"))
    assert plan.size == 3 and not plan.warnings


# --------------------------------------------------------------------------- launcher rules


def test_msrun_needs_same_slots_everywhere():
    with pytest.raises(PlanError, match="msrun rule"):
        make_plan(cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(4)), launcher="msrun"))
    assert make_plan(cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(2)), launcher="msrun")).size == 4


def test_mpirun_device_selection_must_match_on_every_host():
    with pytest.raises(PlanError, match="CUDA_VISIBLE_DEVICES"):
        make_plan(cluster(host("10.0.0.1", [2, 3]), host("10.0.0.2", [0, 1]), platform="gpu"))
    assert make_plan(cluster(host("10.0.0.1", [2, 3]), host("10.0.0.2", [2, 3]), platform="gpu")).size == 4
    assert make_plan(cluster(host("10.0.0.1", [2, 3]), host("10.0.0.2", [0, 1]), platform="cpu")).size == 4


def test_mpirun_host_env_must_be_uniform():
    a = host("10.0.0.1", range(1), env={"NCCL_SOCKET_IFNAME": "eth1", "X": "1"})
    b = host("10.0.0.2", range(1), env={"X": "1"})
    with pytest.raises(PlanError) as exc:
        make_plan(cluster(a, b))
    assert "NCCL_SOCKET_IFNAME differs" in str(exc.value) and "X differs" not in str(exc.value)
    assert make_plan(cluster(a, b, launcher="msrun")).size == 2  # one launch per host: fine


def test_ranktable_server_ids_unique():
    a = host("127.0.0.1", range(1), name="a", connection="local")
    b = host("127.0.0.1", range(1), name="b", connection="local")
    with pytest.raises(PlanError, match="share address 127.0.0.1"):
        make_plan(cluster(a, b, launcher="ranktable"))


# --------------------------------------------------------------------------- hccn.conf and device IPs


def hccn_ips_of(text: str) -> dict[int, str]:
    return hccn_ips(parse_hccn(text))


def test_parse_hccn_conf_fixture():
    assert hccn_ips_of((GOLDEN / "hccn.conf").read_text()) == SEED000_IPS


def test_parse_hccn_conf_tolerates_mess():
    text = ("# device NICs\r\n\r\naddress_0 = 192.168.100.101\r\nnetmask_0=255.255.255.0\r\n"
            "address_1=10.1.1.1\naddress_1=192.168.101.101   # fixed\n  address_2=not-an-ip\n"
            "garbage line\naddress_x=1.2.3.4\nmyaddress_3=1.1.1.1\naddress_3=\naddress_4=fd00::4\n")
    assert hccn_ips_of(text) == {0: "192.168.100.101", 1: "192.168.101.101", 4: "fd00::4"}
    assert hccn_ips_of("") == {}


def test_device_ips_inventory_first_then_probed():
    a = host("10.0.0.1", range(2), device_ips={0: "192.168.0.10"})
    plan = make_plan(cluster(a, launcher="ranktable"))
    ips = device_ips_for(plan, {"10.0.0.1": {0: "192.168.9.9", 1: "192.168.0.11"}})
    assert ips == {"10.0.0.1": {0: "192.168.0.10", 1: "192.168.0.11"}}


def test_device_ips_missing_names_host_device_and_fix():
    plan = make_plan(cluster(host("10.0.0.1", range(2)), host("10.0.0.2", range(2)), launcher="ranktable"))
    with pytest.raises(PlanError) as exc:
        device_ips_for(plan, {"10.0.0.1": {0: "192.168.0.1"}})
    msg = str(exc.value)
    assert "host 10.0.0.1 devices [1]" in msg and "not in its /etc/hccn.conf" in msg
    assert "host 10.0.0.2 devices [0, 1]" in msg and "--probe" in msg
    assert "device_ips" in msg and "address_<device id>=IP" in msg


def test_device_ips_bad_value():
    plan = make_plan(cluster(host("10.0.0.1", range(1), device_ips={0: "eth0"}), launcher="ranktable"))
    with pytest.raises(PlanError, match="'eth0' is not an IP address"):
        device_ips_for(plan, {})


# --------------------------------------------------------------------------- properties


addresses = st.one_of(
    st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str),
    st.from_regex(r"\A[a-z][a-z0-9-]{0,8}(\.[a-z]{2,4})?\Z"))


@st.composite
def clusters(draw, launcher="ranktable"):
    addrs = draw(st.lists(addresses, min_size=1, max_size=12, unique=True))
    hosts = []
    for i, a in enumerate(addrs):
        devs = draw(st.lists(st.integers(0, 15), min_size=1, max_size=8, unique=True))
        hosts.append(host(a, devs, name=f"h{i}"))
    return cluster(*hosts, launcher=launcher)


@settings(max_examples=60, deadline=None)
@given(clusters())
def test_every_rank_once_and_hccl_order(c):
    plan = make_plan(c)
    assert [r.rank for r in plan.ranks] == list(range(sum(h.slots for h in c.hosts)))
    assert len({(r.host, r.device_id) for r in plan.ranks}) == plan.size
    assert sorted(h.name for h in plan.hosts) == sorted(h.name for h in c.hosts)
    keys = [server_key(h.address) for h in plan.hosts]
    assert keys == sorted(keys)
    # contiguous per host, local ranks 0..slots-1 on the host's devices in order
    seen: list[str] = []
    for h in plan.hosts:
        rs = plan.by_host(h.name)
        assert [r.local_rank for r in rs] == list(range(h.slots))
        assert tuple(r.device_id for r in rs) == h.devices
        seen += [r.host for r in rs]
    assert seen == [r.host for r in plan.ranks]
    assert make_plan(c) == plan  # deterministic


@settings(max_examples=30, deadline=None)
@given(clusters(), st.randoms(use_true_random=False))
def test_plan_independent_of_inventory_order(c, rnd):
    hosts = list(c.hosts)
    rnd.shuffle(hosts)
    shuffled = Cluster(name=c.name, path=c.path, hosts=tuple(hosts), job=c.job)
    assert make_plan(shuffled).ranks == make_plan(c).ranks


# --------------------------------------------------------------------------- `orch plan`


def _cli():
    from orchestrator.cli import cli

    return cli


def write_cluster(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "cluster.yaml"
    p.write_text(textwrap.dedent(body))
    return p


MPIRUN_2x2 = """
    inventory:
      defaults: {user: train, slots: 2}
      hosts:
        - address: 10.0.0.[1-2]
    job:
      workdir: /data/job
      command: python net.py --lr 0.1
      env: {DATA_PATH: ./MNIST_Data/train/, HF_TOKEN: hunter2}
"""


def test_cli_plan_prints_table_and_writes_files(tmp_path):
    f = write_cluster(tmp_path, MPIRUN_2x2)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "4 ranks on 2 hosts" in res.output and "10.0.0.2" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["commands.json", "hostfile", "plan.json"]
    assert (out / "hostfile").read_text().splitlines()[1:] == ["10.0.0.1 slots=2", "10.0.0.2 slots=2"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["size"] == 4 and plan["launcher"] == "mpirun" and plan["platform"] == "cpu"
    assert plan["ranks"][2] == {"rank": 2, "host": "10.0.0.2", "address": "10.0.0.2", "local_rank": 0,
                                "device_id": 0}
    cmds = json.loads((out / "commands.json").read_text())
    (launch,) = cmds["hosts"]["10.0.0.1"]
    assert cmds["hosts"]["10.0.0.2"] == []
    assert launch["argv"][:3] == ["mpirun", "-n", "4"] and launch["argv"][-4:] == ["python", "net.py", "--lr", "0.1"]
    assert "hunter2" not in (out / "commands.json").read_text()
    # a secret never rides on mpirun (its -x sends values in clear to every host's daemon): each
    # host's supervisor gives it to the ranks
    assert launch["env"] == {} and not any("HF_TOKEN" in a for a in launch["argv"])
    assert cmds["secret_env"] == {"HF_TOKEN": "***"}


def test_cli_plan_json(tmp_path):
    f = write_cluster(tmp_path, MPIRUN_2x2)
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--json", "--hosts", "10.0.0.2"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["size"] == 2 and [h["name"] for h in doc["hosts"]] == ["10.0.0.2"]


def test_cli_impossible_plan_exits_2(tmp_path):
    f = write_cluster(tmp_path, """
        inventory:
          hosts:
            - {address: 10.0.0.1, devices: [0, 4]}
        job: {launcher: ranktable, platform: ascend, workdir: /w, command: python net.py}
    """)
    res = CliRunner().invoke(_cli(), ["plan", str(f)])
    assert res.exit_code == 2
    assert "impossible plan" in res.output and "{0,4}" in res.output


def test_cli_bad_file_exits_2(tmp_path):
    f = write_cluster(tmp_path, "inventory: {hosts: [{address: a}]}\njob: {workdir: /w, comand: x}\n")
    res = CliRunner().invoke(_cli(), ["plan", str(f)])
    assert res.exit_code == 2 and "comand" in res.output


def test_cli_skip_device_rules_warns(tmp_path):
    f = write_cluster(tmp_path, """
        inventory:
          hosts:
            - {address: 10.0.0.1, devices: [0, 4], device_ips: {0: 192.168.100.101, 4: 192.168.100.100}}
        job: {launcher: ranktable, platform: ascend, workdir: /w, command: python net.py}
        checks: {skip: [device-rules]}
    """)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "WARNING: device-rules is skipped" in res.stderr
    table = json.loads((out / "rank_table.json").read_text())
    assert [d["device_id"] for d in table["server_list"][0]["device"]] == ["0", "4"]


def test_cli_ranktable_without_device_ips_says_probe(tmp_path):
    f = write_cluster(tmp_path, """
        inventory:
          defaults: {slots: 8}
          hosts: [{address: 10.0.0.1}]
        job: {launcher: ranktable, platform: ascend, workdir: /w, command: python net.py}
    """)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "rank_table.json not rendered" in res.stderr and "--probe" in res.stderr
    assert not (out / "rank_table.json").exists() and (out / "commands.json").exists()


def test_cli_ranktable_off_ascend_shows_no_rank_table(tmp_path):
    """platform cpu/gpu: `orch up` writes no rank table, so `orch plan` shows none and warns of none."""
    f = write_cluster(tmp_path, """
        inventory: {hosts: [{address: 10.0.0.1, slots: 2, device_ips: {0: 192.168.1.1, 1: 192.168.1.2}},
                            {address: 10.0.0.2, slots: 2}]}
        job: {launcher: ranktable, platform: cpu, workdir: /w, command: python net.py}
    """)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "rank_table" not in res.stderr and sorted(p.name for p in out.iterdir()) == ["commands.json", "plan.json"]


def test_cli_probe_reads_hccn_conf_through_the_transport(tmp_path, monkeypatch):
    import orchestrator.devices

    monkeypatch.setattr(orchestrator.devices, "HCCN_CONF", str(GOLDEN / "hccn.conf"))
    f = write_cluster(tmp_path, """
        inventory:
          hosts: [{address: 127.0.0.1, connection: local, slots: 8}]
        job: {launcher: ranktable, platform: ascend, workdir: /w, command: python net.py}
    """)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--probe", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "rank_table.json").read_text() == (GOLDEN / "seed000_hccl_8p_01234567_127.0.0.1.json").read_text()


def test_cli_probe_failure_exits_2(tmp_path, monkeypatch):
    import orchestrator.devices

    monkeypatch.setattr(orchestrator.devices, "HCCN_CONF", str(tmp_path / "missing.conf"))
    f = write_cluster(tmp_path, """
        inventory:
          hosts: [{address: 127.0.0.1, connection: local, slots: 8}]
        job: {launcher: ranktable, platform: ascend, workdir: /w, command: python net.py}
    """)
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--probe"])
    assert res.exit_code == 2 and "could not read" in res.output


def test_cli_large_plan_is_folded(tmp_path):
    f = write_cluster(tmp_path, """
        inventory:
          defaults: {slots: 8}
          hosts: [{address: "node[001-300]"}, {address: "10.0.0.1", slots: 4}]
        job: {workdir: /w, command: python net.py, launcher: msrun}
    """)
    res = CliRunner().invoke(_cli(), ["plan", str(f)])
    assert res.exit_code == 2 and "msrun rule" in res.output  # 4 vs 8 slots
    f.write_text(f.read_text().replace("launcher: msrun", "launcher: mpirun"))
    res = CliRunner().invoke(_cli(), ["plan", str(f)])
    assert res.exit_code == 0, res.output
    assert "2404 ranks on 301 hosts" in res.output
    assert "node[001-300]" in res.output and "4-2403" in res.output
    assert len(res.output.splitlines()) < 20


# --------------------------------------------------------------------------- Atlas A3 (rank table 1.2)


def a3(*hosts: Host, **kw) -> Cluster:
    return ascend(*hosts, rank_table_version="1.2", **kw)


@pytest.mark.parametrize("devices", [[0], [7], [15], [0, 1], [14, 15], [0, 1, 2, 3], [2, 3, 8, 9, 12, 13],
                                     range(8), range(10), range(16)])
def test_a3_single_host_allowed(devices):
    plan = make_plan(a3(host("10.0.0.1", devices)))
    assert plan.size == len(list(devices)) and plan.warnings == ()


def test_a3_16_devices_pass_for_1_2_and_fail_for_1_0():
    """A 16-die A3 server: the 0-3/4-7 networks and the 8-device limit of rank table 1.0 do not apply."""
    assert make_plan(a3(host("10.0.0.1", range(16)))).size == 16
    assert make_plan(a3(host("10.0.0.1", range(16)), host("10.0.0.2", range(16)))).size == 32
    with pytest.raises(PlanError, match=r"device ids are 0\.\.7"):
        make_plan(ascend(host("10.0.0.1", range(16))))
    with pytest.raises(PlanError, match=r"device ids are 0\.\.7"):
        make_plan(ascend(host("10.0.0.1", range(16)), host("10.0.0.2", range(16))))


def test_a3_pair_across_the_old_networks_is_fine():
    """{0,4} breaks the 910 rule; on A3 it is two halves of NPUs 0 and 2, refused for that reason only."""
    with pytest.raises(PlanError) as exc:
        make_plan(a3(host("10.0.0.1", [0, 4])))
    msg = str(exc.value)
    assert RULE_A3_NPU in msg and "[0, 4] without [1, 5]" in msg and RULE_NETWORK not in msg
    assert make_plan(a3(host("10.0.0.1", [0, 1, 4, 5]))).size == 4


@pytest.mark.parametrize("devices", [[0, 1, 2], range(15), [0, 2]])
def test_a3_single_host_refused(devices):
    with pytest.raises(PlanError) as exc:
        make_plan(a3(host("10.0.0.1", devices)))
    assert "Ascend rule (Atlas A3)" in str(exc.value) and "checks.skip" in str(exc.value)


def test_a3_ids_0_to_15():
    with pytest.raises(PlanError, match=r"device ids are 0\.\.15 \(8 NPUs of two dies\); host 10.0.0.1 lists \[16, 17\]"):
        make_plan(a3(host("10.0.0.1", [14, 15, 16, 17])))


def test_a3_multi_host_same_even_count():
    assert make_plan(a3(host("10.0.0.1", range(8)), host("10.0.0.2", range(8, 16)))).size == 16
    with pytest.raises(PlanError) as exc:
        make_plan(a3(host("10.0.0.1", range(16)), host("10.0.0.2", range(8))))
    assert RULE_A3_MULTI in str(exc.value) and "10.0.0.1: 16; 10.0.0.2: 8" in str(exc.value)
    with pytest.raises(PlanError, match="same even number"):
        make_plan(a3(host("10.0.0.1", [0]), host("10.0.0.2", [0])))


def test_a3_rules_skippable_like_the_others():
    plan = make_plan(a3(host("10.0.0.1", [0, 2, 4]), skip=["device-rules"]))
    assert plan.size == 3 and "device-rules is skipped" in plan.warnings[0]


def test_a3_hosts_grouped_by_super_pod_from_the_inventory():
    hosts = [host(f"10.0.0.{i}", range(2), super_pod_id=p) for i, p in ((1, 5), (2, 0), (3, 5), (4, 0))]
    assert [h.address for h in make_plan(a3(*hosts)).hosts] == ["10.0.0.2", "10.0.0.4", "10.0.0.1", "10.0.0.3"]
    # a host without super_pod_id: address order (the pods are read later, on the hosts)
    hosts[0] = host("10.0.0.1", range(2))
    assert [h.address for h in make_plan(a3(*hosts)).hosts] == ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]


A3_CLUSTER = """
    inventory:
      defaults: {slots: 16, connection: local, super_pod_id: 0}
      hosts:
        - address: 127.0.0.1
          device_ips: {0: 10.0.2.41, 1: 10.0.3.41, 2: 10.0.2.42, 3: 10.0.3.42, 4: 10.0.2.43, 5: 10.0.3.43,
                       6: 10.0.2.44, 7: 10.0.3.44, 8: 10.0.2.45, 9: 10.0.3.45, 10: 10.0.2.46, 11: 10.0.3.46,
                       12: 10.0.2.47, 13: 10.0.3.47, 14: 10.0.2.48, 15: 10.0.3.48}
          super_device_ids: {0: 113246208}
    job: {launcher: ranktable, platform: ascend, workdir: /w, command: python train.py,
          rank_table: {version: 1.2}}
"""


def test_cli_a3_without_super_device_ids_says_probe(tmp_path):
    f = write_cluster(tmp_path, A3_CLUSTER)
    out = tmp_path / "out"
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "rank_table.json not rendered" in res.stderr and "host 127.0.0.1 devices 1-15: no super_device_id" \
        in res.stderr and "npu-smi" in res.stderr
    assert "device 0:" not in res.stderr
    assert not (out / "rank_table.json").exists() and (out / "commands.json").exists()


def test_cli_a3_probe_reads_npu_smi_through_the_transport(tmp_path, monkeypatch):
    """--probe runs `npu-smi info -m` and spod-info on the host (here a stand-in npu-smi on PATH)."""
    import os

    fixtures = Path(__file__).resolve().parent.parent / "fixtures" / "npu-smi"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "npu-smi"
    fake.write_text(f"""#!/bin/sh
[ "$2" = "-m" ] && exec cat {fixtures / 'info-m-a3.txt'}
d=$(($5 * 2 + $7))
printf '\\t%-30s : %u\\n' SDID $((113246208 + d)) 'Super Pod Size' 48 'Super Pod ID' 3 'Server Index' 27
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    f = write_cluster(tmp_path, A3_CLUSTER)
    out = tmp_path / "out"
    import orchestrator.transport

    pools = []
    real_init = orchestrator.transport.Pool.__init__
    monkeypatch.setattr(orchestrator.transport.Pool, "__init__",
                        lambda self, *a, **k: (pools.append(self), real_init(self, *a, **k))[1])
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--probe", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert len(pools) == 1   # hccn.conf and npu-smi read over the same connections
    table = json.loads((out / "rank_table.json").read_text())
    devs = table["server_list"][0]["device"]
    assert [d["super_device_id"] for d in devs] == [str(113246208 + d) for d in range(16)]
    assert table["super_pod_list"] == [{"super_pod_id": "0", "server_list": [{"server_id": "127.0.0.1"}]}]
    fake.write_text("#!/bin/sh\necho 'This device does not support querying spod-info.'\n")
    res = CliRunner().invoke(_cli(), ["plan", str(f), "--probe"])
    assert res.exit_code == 2 and "host 127.0.0.1 devices 1-15: no super_device_id" in res.output
    assert "`npu-smi info -t spod-info -i 0 -c 1` (and the same for the other 14) printed no SDID" in res.output
    assert "does not support" in res.output


def test_hccn_conf_has_one_parser_for_check_and_rank_table():
    """orch check (probes.parse_hccn: addresses and netmasks as written) and the rank table
    (hccn_ips of parse_hccn: the IP addresses) read hccn.conf with the one parser of devices.py."""
    from orchestrator import devices, probes

    text = (GOLDEN / "hccn.conf").read_text() + "address_9=not-an-ip\nnetmask_9=255.255.255.0\n"
    conf = probes.parse_hccn(text)
    assert conf == devices.parse_hccn(text) and conf[9] == devices.HccnDevice("not-an-ip", "255.255.255.0")
    assert hccn_ips_of(text) == devices.hccn_ips(conf) == SEED000_IPS
    assert probes.parse_hccn(probes.NOT_INSTALLED) is None
