"""Spare hosts on the controller's side: the inventory keys, the plan that keeps spares apart and
swaps one in, what each spare's supervisor is given, and the launch files the head renders on the
cluster (the same bytes orch renders here). The head's decisions: tests/unit/test_head.py."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from orchestrator import launchers, supervisor
from orchestrator.launchers import ranktable
from orchestrator.agent import protocol, tables
from orchestrator.errors import PlanError, SpecError
from orchestrator.rankplan import current_hosts, make_plan, ranks_by_host, replaced
from orchestrator.spec import load_cluster
from tests.unit.test_plan import SEED000_IPS, ascend, cluster, host


def _load(tmp_path: Path, inventory: str, **job) -> object:
    extra = "".join(f"  {k}: {v}\n" for k, v in job.items())
    (tmp_path / "cluster.yaml").write_text(
        "inventory:\n" + textwrap.indent(textwrap.dedent(inventory), "  ")
        + "job:\n  workdir: /data/w\n  command: python net.py\n" + extra)
    return load_cluster(tmp_path / "cluster.yaml")


# --------------------------------------------------------------------------- the inventory

def test_spares_n_takes_the_last_hosts_and_spare_true_marks_one(tmp_path):
    c = _load(tmp_path, """
        hosts:
          - {address: "10.0.0.[1-4]"}
          - {address: 10.0.0.9, spare: true}
        spares: 1
    """)
    assert [(h.name, h.spare) for h in c.hosts] == [("10.0.0.1", False), ("10.0.0.2", False), ("10.0.0.3", False),
                                                  ("10.0.0.4", False), ("10.0.0.9", True)]
    c = _load(tmp_path, """
        hosts:
          - {address: "10.0.0.[1-4]"}
        spares: 2
    """)
    assert [h.spare for h in c.hosts] == [False, False, True, True]


@pytest.mark.parametrize("inventory, words", [
    ("hosts: [{address: 10.0.0.1}]\nspares: 1\n", ["spares: 1", "at least one must run ranks", "cluster.yaml:3:"]),
    ("hosts: [{address: 10.0.0.1, spare: true}]\n", ["every host is a spare", "cluster.yaml:2:"]),
    ("hosts: [{address: 10.0.0.1}]\nspares: -1\n", ["spares must be 0 or more", "cluster.yaml:3:"]),
    ("slurm: {nodes: 2}\nspares: 1\n", ["a Slurm inventory lists none", "slurm.spares: N", "cluster.yaml:3:"]),
])
def test_bad_spares_are_one_clear_error_with_file_and_line(tmp_path, inventory, words):
    with pytest.raises(SpecError) as exc:
        _load(tmp_path, inventory)
    text = str(exc.value)
    assert all(w in text for w in words), text


# --------------------------------------------------------------------------- the plan

def test_spares_get_no_ranks_and_are_checked_synced_and_supervised_like_the_others():
    c = cluster(host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.3", spare=True))
    p = make_plan(c)
    assert [h.name for h in p.hosts] == ["10.0.0.1", "10.0.0.2"] and p.size == 16
    assert [h.name for h in p.spares] == ["10.0.0.3"] and [h.name for h in p.all_hosts][-1] == "10.0.0.3"
    assert p.to_dict()["spares"] == [{"name": "10.0.0.3", "address": "10.0.0.3", "devices": list(range(8))}]


def test_a_spare_takes_the_lost_hosts_place_ranks_and_devices():
    c = cluster(host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.3"), host("10.0.0.9", spare=True))
    p = replaced(make_plan(c), {"10.0.0.2": "10.0.0.9"})
    assert [h.name for h in p.hosts] == ["10.0.0.1", "10.0.0.9", "10.0.0.3"] and p.spares == ()
    assert [(r.rank, r.host, r.address, r.device_id) for r in p.by_host("10.0.0.9")] == \
        [(8 + d, "10.0.0.9", "10.0.0.9", d) for d in range(8)]
    assert [r.rank for r in p.ranks] == list(range(24))


def test_a_spare_must_fit_a_host_it_could_replace():
    c = cluster(host("10.0.0.1"), host("10.0.0.2"), host("10.0.0.9", devices=range(4), spare=True))
    with pytest.raises(PlanError) as exc:
        make_plan(c)
    assert "spare 10.0.0.9: devices [0, 1, 2, 3] match no host that runs ranks" in str(exc.value)
    with pytest.raises(PlanError) as exc:
        make_plan(cluster(host("10.0.0.1"), host("10.0.0.9", spare=True)))
    assert "no host it could replace" in str(exc.value) and "launch host 10.0.0.1" in str(exc.value)


def test_which_host_ran_which_rank_after_chained_replacements():
    c = cluster(host("10.0.0.1", devices=(0,)), host("10.0.0.2", devices=(0,)),
                host("s1", devices=(0,), spare=True), host("s2", devices=(0,), spare=True))
    p = make_plan(c)
    chain = [{"host": "10.0.0.2", "by": "s1"}, {"host": "s1", "by": "s2"}]
    assert ranks_by_host(p, chain) == {"10.0.0.1": [0], "10.0.0.2": [1], "s1": [1], "s2": [1]}
    assert current_hosts(p, chain) == {0: "10.0.0.1", 1: "s2"}


# --------------------------------------------------------------------------- on the cluster

def _ips(c):
    return {h.name: SEED000_IPS if h.name != "10.0.0.9" else {d: f"10.9.0.{d}" for d in range(8)} for h in c.hosts}


@pytest.mark.parametrize("version", ["1.0", "1.2", "legacy"])
def test_the_heads_rank_table_for_a_new_host_set_is_byte_for_byte_orchs(version):
    def kw(i):
        return {"super_device_ids": {d: 100 * i + d for d in range(8)}, "super_pod_id": 0} if version == "1.2" else {}

    c = ascend(host("10.0.0.1", **kw(1)), host("10.0.0.2", **kw(2)), host("10.0.0.9", spare=True, **kw(9)),
               rank_table_version=version)
    p = make_plan(c)
    launch = launchers.build(c, p, "RID", root={}, device_ips=_ips(c), aarch64=True)
    cfg = supervisor.configs(c, p, "RID", launch)["10.0.0.1"]
    spare = {s["name"]: s for s in cfg["spare_servers"]}["10.0.0.9"]
    servers = [cfg["servers"][0], dict(spare, ranks=cfg["servers"][1]["ranks"])]
    servers = json.loads(json.dumps(servers))   # as the head has them: JSON, device ids as strings
    got = tables.render(cfg["tables"], servers)
    want = ranktable.rank_table(c, replaced(p, {"10.0.0.2": "10.0.0.9"}), _ips(c), aarch64=True)
    assert got == {"rank_table.json": want}


def test_a_spares_processes_in_a_hosts_place_are_what_orch_renders_for_that_host_set():
    c = cluster(host("10.0.0.1", devices=(0, 1)), host("10.0.0.2", devices=(0, 1), env={"H": "2"}),
                host("10.0.0.9", devices=(0, 1), spare=True, env={"H": "9"}), launcher="msrun")
    p = make_plan(c)
    cfgs = supervisor.configs(c, p, "RID", launchers.build(c, p, "RID", root={}))
    spare = cfgs["10.0.0.9"]
    assert spare["role"] == "member" and spare["ranks"] == [] and spare["procs"] == []
    swapped = replaced(p, {"10.0.0.2": "10.0.0.9"})
    want = launchers.build(c, swapped, "RID", root={}).procs["10.0.0.9"]
    assert spare["slot_procs"] == {"10.0.0.2": {"ranks": [{"rank": 2, "device": 0}, {"rank": 3, "device": 1}],
                                                "procs": [x.to_config() for x in want]}}
    (proc,) = spare["slot_procs"]["10.0.0.2"]["procs"]
    assert "--node_rank=1" in proc["argv"] and proc["env"]["H"] == "9"
    head = cfgs["10.0.0.1"]
    assert head["spares"] == ["10.0.0.9"] and head["spare_fits"] == {"10.0.0.9": ["10.0.0.2"]}
    assert head["tables"] == {} and "slot_procs" not in head


def _packed(obj) -> str:
    import base64
    import zlib

    return base64.b64encode(zlib.compress(json.dumps(obj).encode())).decode()


@pytest.mark.parametrize("files", [_packed({"../x": "a"}), _packed({"a/b": "a"}), _packed({"": "a"}), _packed({"x": 1}),
                                   _packed([1]), _packed({str(i): "" for i in range(5)}), "not base64!", "eJw=",
                                   # a zip bomb: 200 MB of zeros in a few hundred KiB
                                   _packed({"hostfile": "0" * (200 << 20)})])
def test_a_start_message_carries_only_plain_file_names_and_text_and_inflates_bounded(files):
    m = {"t": "start", "attempt": 2, "head_address": "10.0.0.1", "files": files}
    with pytest.raises(protocol.ProtocolError):
        protocol.parse(protocol.TO_MEMBER, m)
    packed = protocol.pack_files({"hostfile": "x"})
    ok = protocol.parse(protocol.TO_MEMBER, protocol.start(2, "10.0.0.1", "h2", packed, "h2->s1"))[1]
    assert ok == {"attempt": 2, "head_address": "10.0.0.1", "slot": "h2", "files": {"hostfile": "x"},
                  "replaced": "h2->s1"}


def test_a_1024_host_rank_table_fits_in_one_start_message():
    servers = [tables.server(f"h{i}", f"10.{i // 250}.{i % 250}.1", 8, [(i * 8 + d, d) for d in range(8)],
                             {d: f"10.{100 + i // 250}.{i % 250}.{d}" for d in range(8)}) for i in range(1024)]
    text = tables.rank_table_v1(servers)
    packed = protocol.pack_files({"rank_table.json": text})
    assert len(text) > protocol.LINE and len(packed) < protocol.FILES_MAX
    assert protocol.unpack_files(packed) == {"rank_table.json": text}


def test_a_launch_file_that_cannot_be_written_fails_the_hosts_processes_saying_why(tmp_path):
    from orchestrator.agent.procs import Local

    wd = tmp_path / "wd"
    wd.mkdir()
    cfg = {"run_id": "R", "rundir": str(tmp_path / "r"), "host": "s1", "launcher": "ranktable", "workdir": str(wd),
           "launch_files": ["rank_table.json"], "log_link": str(wd / "log_output"),
           "ranks": [{"rank": 0, "device": 0}],
           "procs": [{"key": "rank.0", "argv": ["true"], "env": {}, "cwd": str(wd), "log": "1/rank.0/stdout",
                      "rank": 0}]}
    (tmp_path / "r").mkdir()
    (wd / "rank_table.json").mkdir()   # in the way of the rename, even for root
    local = Local(cfg, lambda text: None)
    local.start(2, "127.0.0.1", files={"rank_table.json": "{}"})
    (rank,) = local.report()["ranks"]
    assert rank["state"] == "failed" and rank["exit_code"] == 126
    log = (tmp_path / "r" / "a2" / "1" / "rank.0" / "stdout").read_text()
    assert "cannot write" in log and "rank_table.json" in log


def test_a_member_writes_only_the_launch_files_of_its_run(tmp_path):
    from orchestrator.agent.procs import Local

    notes = []
    cfg = {"run_id": "R", "rundir": str(tmp_path / "r"), "host": "s1", "launcher": "mpirun", "workdir": str(tmp_path),
           "launch_files": ["hostfile"], "ranks": [], "procs": [], "log_link": str(tmp_path / "log_output")}
    local = Local(cfg, notes.append)
    local.write_launch_file("hostfile", "h slots=1\n")
    local.write_launch_file("authorized_keys", "evil\n")
    assert (tmp_path / "hostfile").read_text() == "h slots=1\n" and not (tmp_path / "authorized_keys").exists()
    assert oct((tmp_path / "hostfile").stat().st_mode & 0o077) == "0o0" and "not a launch file" in notes[0]


# --------------------------------------------------------------------------- Slurm

def test_slurm_spares_are_nodes_asked_for_up_front_and_a_failed_node_ends_nothing(tmp_path):
    from orchestrator import slurm
    from orchestrator.agent.cli import step_argv

    c = _load(tmp_path, """
        slurm: {nodes: 2, spares: 1}
    """, launcher="ranktable")
    argv = slurm.sbatch_argv(c.slurm, "orch-t", "/data/w")
    assert "--nodes=3" in argv and "--no-kill" in argv
    hosts = slurm.hosts_of(c.slurm, ("n1", "n2", "n3"), {})
    assert [(h.name, h.spare) for h in hosts] == [("n1", False), ("n2", False), ("n3", True)]
    p = make_plan(slurm.placeholder(c))
    assert [h.name for h in p.hosts] == ["node1", "node2"] and [h.name for h in p.spares] == ["node3"]
    go = json.loads(supervisor.go_text(c, p, "RID").splitlines()[1])
    assert go["members"] == ["node2", "node3"] and go["no_kill"] is True
    assert "--no-kill" in step_argv(["node2", "node3"], "python3", "/r", no_kill=True)
    assert "--no-kill" not in slurm.sbatch_argv(_load(tmp_path, "slurm: {nodes: 2}\n").slurm, "orch-t", "/data/w")


def test_logs_hosts_names_a_spare_by_the_ranks_it_ran(tmp_path):
    from orchestrator.errors import UsageError
    from orchestrator.runlogs import select_ranks
    from orchestrator.runs import create_run

    c = cluster(host("10.0.0.1", devices=(0, 1)), host("10.0.0.2", devices=(0, 1)),
                host("10.0.0.9", devices=(0, 1), spare=True))
    run = create_run(c, make_plan(c).to_dict(), cwd=tmp_path)
    with pytest.raises(UsageError):
        select_ranks(run, None, "10.0.0.9")          # nothing replaced: the spare ran no rank
    run.data["replaced"] = [{"attempt": 2, "host": "10.0.0.2", "by": "10.0.0.9", "why": "lost"}]
    assert select_ranks(run, None, "10.0.0.9") == [2, 3]
    assert select_ranks(run, None, "10.0.0.2") == [2, 3] and select_ranks(run, 3, "10.0.0.9") == [3]
