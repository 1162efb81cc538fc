"""cluster.yaml / inventory parsing and validation."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.errors import OrchError, SpecError, UsageError
from orchestrator.spec import load_cluster

GOOD = """\
name: mnist
inventory:
  defaults: {user: train, slots: 2}
  hosts:
    - address: 10.0.0.[11-12]
    - address: 10.0.0.20
      name: node5
      slots: 4
      devices: [4, 5, 6, 7]
      device_ips: {4: 192.168.100.100}
      env: {NCCL_SOCKET_IFNAME: eth1}
  groups: {rack1: [node5, 10.0.0.11]}
job:
  workdir: /data/mnist
  command: python net.py --lr 0.1
  env: {DATA_PATH: ./MNIST_Data/train/, N: 3}
  sync: [net.py]
"""


def write(tmp_path: Path, text: str, name: str = "cluster.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def problems(tmp_path: Path, text: str) -> list[tuple[int | None, str | None, str]]:
    with pytest.raises(SpecError) as ei:
        load_cluster(write(tmp_path, text))
    return [(loc.line, loc.field, msg) for loc, msg in ei.value.problems]


def test_good_file_expands_ranges_and_merges_defaults(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    assert c.name == "mnist"
    assert [h.name for h in c.hosts] == ["10.0.0.11", "10.0.0.12", "node5"]
    h1, _, n5 = c.hosts
    assert (h1.user, h1.slots, h1.devices, h1.port, h1.connection) == ("train", 2, (0, 1), 22, "ssh")
    assert (n5.slots, n5.devices, dict(n5.device_ips)) == (4, (4, 5, 6, 7), {4: "192.168.100.100"})
    assert dict(n5.env) == {"NCCL_SOCKET_IFNAME": "eth1"}
    assert c.job.command == ("python", "net.py", "--lr", "0.1")
    assert dict(c.job.env) == {"DATA_PATH": "./MNIST_Data/train/", "N": "3"}
    assert c.groups["rack1"] == ("node5", "10.0.0.11")
    assert c.ssh.host_key_policy == "strict" and c.ssh.fanout == 64
    assert c.job.launcher == "mpirun" and c.job.log_dir == "log_output"


def test_name_defaults_to_file_stem(tmp_path):
    c = load_cluster(write(tmp_path, GOOD.replace("name: mnist\n", ""), "mnist-2x8.yaml"))
    assert c.name == "mnist-2x8"


def test_typo_under_job_names_key_and_line(tmp_path):
    text = GOOD.replace("  command: python net.py --lr 0.1\n", "  comand: python net.py\n")
    probs = problems(tmp_path, text)
    typo = [p for p in probs if "comand" in p[2]]
    assert typo == [(15, "job.comand", "unknown key 'comand' (did you mean 'command'?)")]
    assert any(p[1] == "job.command" and "missing" in p[2] for p in probs)


def test_every_problem_is_reported_at_once(tmp_path):
    text = """\
    inventory:
      hosts:
        - address: a
          slot: 2
    ssh: {fanout: 0}
    job:
      workdir: /w
      command: x
      platform: tpu
    """
    probs = problems(tmp_path, text)
    fields = {p[1] for p in probs}
    assert {"inventory.hosts[0].slot", "ssh.fanout", "job.platform"} <= fields
    assert all(p[0] is not None for p in probs)


def test_semantic_errors_have_lines(tmp_path):
    text = """\
    inventory:
      hosts:
        - address: node[1-2]
        - address: node2
        - address: x
          slots: 2
          devices: [0, 1, 2]
    job:
      workdir: relative/dir
      command: python net.py
    """
    probs = problems(tmp_path, text)
    msgs = " | ".join(p[2] for p in probs)
    assert "duplicate host 'node2'" in msgs
    assert any(p[0] == 7 and "slots is 2" in p[2] for p in probs)
    assert any(p[0] == 9 and p[1] == "job.workdir" and "absolute" in p[2] for p in probs)


def test_inventory_file_relative_to_cluster_file(tmp_path):
    (tmp_path / "inv").mkdir()
    write(tmp_path / "inv", """\
    defaults: {identity_file: keys/id, known_hosts: kh}
    hosts:
      - {address: "h[1-3]", name: "n[1-3]"}
    """, "lab.yaml")
    c = load_cluster(write(tmp_path, "inventory: inv/lab.yaml\njob: {workdir: /w, command: [a, 'b c']}\n"))
    assert [h.name for h in c.hosts] == ["n1", "n2", "n3"]
    assert [h.address for h in c.hosts] == ["h1", "h2", "h3"]
    assert c.hosts[0].identity_file == str(tmp_path / "inv" / "keys" / "id")
    assert c.hosts[0].known_hosts == str(tmp_path / "inv" / "kh")
    assert c.job.command == ("a", "b c")


def test_errors_in_inventory_file_point_into_it(tmp_path):
    write(tmp_path, "hosts:\n  - address: a\n    prot: 22\n", "inv.yaml")
    probs = problems(tmp_path, "inventory: inv.yaml\njob: {workdir: /w, command: x}\n")
    assert probs == [(3, "hosts[0].prot", "unknown key 'prot' (did you mean 'port'?)")]


@pytest.mark.parametrize("inline", [True, False])
def test_unknown_inventory_key_lists_the_inventorys_own_keys(tmp_path, inline):
    """Not the top level's (name, inventory, ssh, job, checks): the inventory's, whatever it holds."""
    from orchestrator.spec import RawInventory

    inv = "bogus: 1\nhosts:\n  - address: a\n"
    if inline:
        text = "inventory:\n" + "".join("  " + line + "\n" for line in inv.splitlines()) + "job: {workdir: /w, command: x}\n"
    else:
        write(tmp_path, inv, "inv.yaml")
        text = "inventory: inv.yaml\njob: {workdir: /w, command: x}\n"
    (line, field, msg), = problems(tmp_path, text)
    assert (line, field) == (2 if inline else 1, "inventory.bogus" if inline else "bogus")
    assert msg == f"unknown key 'bogus'; allowed: {', '.join(RawInventory.model_fields)}"
    assert "job" not in msg


def test_unknown_key_in_inventory_defaults_and_slurm(tmp_path):
    write(tmp_path, "defaults: {usr: x, zzz: 1}\nslurm: {nodes: 2, qqq: 1}\n", "inv.yaml")
    msgs = [p[2] for p in problems(tmp_path, "inventory: inv.yaml\njob: {workdir: /w, command: x}\n")]
    assert "unknown key 'usr' (did you mean 'user'?)" in msgs
    assert any(m.startswith("unknown key 'zzz'; allowed: user, port,") and ", address," not in m for m in msgs), msgs
    assert any(m.startswith("unknown key 'qqq'; allowed: nodes, partition") for m in msgs), msgs


def test_missing_inventory_file(tmp_path):
    probs = problems(tmp_path, "inventory: nope.yaml\njob: {workdir: /w, command: x}\n")
    assert probs[0][0] == 1 and "does not exist" in probs[0][2]


def test_every_problem_at_once_a_wrong_value_does_not_hide_the_jobs_own_checks(tmp_path):
    """A value of the wrong type (timeout: 5m) is said with what the job's own checks find in the
    rest (a relative workdir); a missing inventory file with the job's problems; a wrong
    launcher names the value and the likely one (the job's checks, which depend on it, wait)."""
    probs = problems(tmp_path, "inventory: {hosts: [{address: a}]}\njob:\n  workdir: tmp/x\n  timeout: 5m\n"
                               "  command: x\n")
    assert [(line, field) for line, field, _ in probs] == [(4, "job.timeout"), (3, "job.workdir")], probs
    assert "must be an absolute path" in probs[1][2]
    probs = problems(tmp_path, "inventory: nope.yaml\njob: {workdir: rel, command: x}\n")
    assert [(line, field) for line, field, _ in probs] == [(1, "inventory"), (2, "job.workdir")], probs
    probs = problems(tmp_path, "inventory: {hosts: [{address: a}]}\njob: {workdir: rel, command: x, "
                               "launcher: ranktabel}\n")
    assert probs == [(2, "job.launcher", "'ranktabel': input should be 'mpirun', 'ranktable', 'msrun' or "
                                          "'torchrun' (did you mean 'ranktable'?)")], probs


def test_a_missing_inventory_named_with_i_is_said_of_the_option_not_the_files_line(tmp_path):
    import re

    with pytest.raises(SpecError, match="^" + re.escape(f"the inventory given (-i/--inventory, ORCH_INVENTORY): "
                                                        f"inventory file {tmp_path / 'nope.yaml'} does not exist")):
        load_cluster(write(tmp_path, GOOD), inventory=tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=re.escape("(-i/--inventory, ORCH_INVENTORY): cannot read inventory file")):
        load_cluster(write(tmp_path, GOOD), inventory=tmp_path)   # a directory


def test_missing_cluster_file(tmp_path):
    import re

    with pytest.raises(SpecError, match="^" + re.escape(f"{tmp_path / 'absent.yaml'}: no such cluster file\n  hint: "
                                                        "is the path right?")):
        load_cluster(tmp_path / "absent.yaml")


def test_yaml_syntax_error_has_line(tmp_path):
    probs = problems(tmp_path, "inventory:\n  hosts: [a\njob: {}\n")
    assert probs[0][0] is not None and "YAML syntax error" in probs[0][2]


def test_a_tab_in_the_indentation_says_use_spaces(tmp_path):
    with pytest.raises(SpecError) as ei:
        load_cluster(write(tmp_path, "inventory:\n  hosts: [a]\njob:\n\tworkdir: /w\n"))
    assert ei.value.problems[0][0].line == 4
    assert "spaces, never tabs" in ei.value.hint
    with pytest.raises(SpecError) as ei:  # no tab: the hint says nothing of tabs
        load_cluster(write(tmp_path, "inventory:\n  hosts: [a\njob: {}\n"))
    assert "tab" not in ei.value.hint


def test_duplicate_yaml_key_is_an_error(tmp_path):
    probs = problems(tmp_path, GOOD + "job:\n  workdir: /x\n  command: y\n")
    assert probs[0][0] == 18 and "duplicate key 'job'" in probs[0][2]


def test_bad_shell_quoting_in_command(tmp_path):
    probs = problems(tmp_path, GOOD.replace("python net.py --lr 0.1", "python 'net.py"))
    assert any(p[1] == "job.command" and "quote" in p[2] for p in probs)


def test_env_bool_must_be_quoted(tmp_path):
    probs = problems(tmp_path, GOOD.replace("N: 3", "N: yes"))
    assert any(p[1] == "job.env" and "quote it" in p[2] for p in probs)


def test_name_range_must_match_address_range(tmp_path):
    probs = problems(tmp_path, GOOD.replace("- address: 10.0.0.[11-12]", "- {address: '10.0.0.[11-12]', name: 'n[1-3]'}"))
    assert any("3 names" in p[2] for p in probs)


def test_select_hosts_by_name_range_group(tmp_path):
    c = load_cluster(write(tmp_path, GOOD))
    assert [h.name for h in c.select("rack1").hosts] == ["10.0.0.11", "node5"]
    assert [h.name for h in c.select("10.0.0.[11-12]").hosts] == ["10.0.0.11", "10.0.0.12"]
    assert c.select(None) is c
    with pytest.raises(UsageError, match="no host or group named bogus"):
        c.select("node5,bogus")


# ---------------------------------------------------------------- fuzz: never a traceback

KEYS = ["name", "inventory", "job", "ssh", "checks", "hosts", "defaults", "address", "slots", "devices",
        "workdir", "command", "env", "launcher", "platform", "port", "fanout", "comand", "sync", "groups"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["/data/x", "node[1-3]", "a[", "mpirun", "8"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=6)),
                                                 inner, max_size=5)), max_leaves=25)


def _check_outcome(path: Path) -> None:
    try:
        load_cluster(path)
    except SpecError as exc:
        assert exc.problems and all(loc.file for loc, _ in exc.problems)
    except OrchError as exc:  # pragma: no cover - any other orch error must still locate itself
        raise AssertionError(f"unexpected {type(exc).__name__}: {exc}") from exc


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=values)
def test_fuzz_structure(tmp_path, doc):
    p = tmp_path / "fuzz.yaml"
    p.write_text(yaml.safe_dump(doc))
    _check_outcome(p)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mutated_good_file(tmp_path, data):
    text = GOOD
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(text)))
        op = data.draw(st.sampled_from(["del", "ins", "dup"]))
        if op == "del":
            text = text[:i] + text[i + 1:]
        elif op == "ins":
            text = text[:i] + data.draw(st.sampled_from([":", " ", "\n", "-", "[", "'", "\t", "x", "{"])) + text[i:]
        else:
            j = data.draw(st.integers(i, min(len(text), i + 40)))
            text = text[:j] + text[i:j] + text[j:]
    p = tmp_path / "mut.yaml"
    p.write_text(text)
    _check_outcome(p)


@pytest.mark.parametrize("workdir, refused", [
    ("/", True), ("/etc", True), ("/proc", True), ("/proc/self", True), ("/usr/lib/x", True), ("/tmp", True),
    ("/etc/", True), ("/var/log", True), ("/data/job", False), ("/var/tmp/job", False), ("/tmp/job", False),
    ("/usr/local/job", False), ("/home/me/job", False),
])
def test_a_system_directory_is_never_a_workdir(tmp_path, workdir, refused):
    path = write(tmp_path, f"inventory: {{hosts: [{{address: h1}}]}}\njob: {{workdir: {workdir!r}, command: x}}\n")
    if not refused:
        assert load_cluster(path).job.workdir == workdir
        return
    with pytest.raises(SpecError) as exc:
        load_cluster(path)
    assert "cluster.yaml:2: job.workdir: workdir" in str(exc.value) and "is a system directory" in str(exc.value)


BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9) if i else ', '.join(['x'] * 9)}]\n" for i in range(9))


@pytest.mark.parametrize("text, line, needle", [
    (BOMB + "inventory: {hosts: [{address: h1}]}\njob: {workdir: /d, command: x}\n", None,
     "expands to more than 200000 values"),
    ("inventory: {hosts: [{address: h1}]}\njob: {workdir: /d, command: x}\n\0\n", 3, "a NUL byte"),
    ('inventory: {hosts: [{address: "h\\0x"}]}\njob: {workdir: /d, command: x}\n', 1, "a NUL character"),
    ("inventory: {hosts: [{address: h1}]}\njob: {workdir: /d, command: \"a\x01\"}\n", 2, "YAML error"),
    ("inventory: {hosts: [{address: h1, slots: 99999999999}]}\njob: {workdir: /d, command: x}\n", 1,
     "more than 1024 ranks on one host"),
    ("x: &a [*a]\ninventory: {hosts: [{address: h1}]}\njob: {workdir: /d, command: x}\n", None,
     "an alias contains itself"),
    ("x: " + "[" * 3000 + "]" * 3000 + "\ninventory: {hosts: [{address: h1}]}\njob: {workdir: /d, command: x}\n",
     None, "nests too deep"),
])
def test_hostile_input_is_bounded_and_located(tmp_path, text, line, needle):
    """Alias bombs, NUL bytes, control characters and absurd counts: exit 2 with a location,
    quickly and in little memory, never a crash."""
    with pytest.raises(SpecError) as exc:
        load_cluster(write(tmp_path, text))
    (loc, msg), *_ = exc.value.problems
    assert needle in msg and loc.file.endswith("cluster.yaml"), msg
    if line is not None:
        assert loc.line == line


def test_device_ips_may_list_every_device_of_the_host(tmp_path):
    """/etc/hccn.conf lists all 8 devices; copying it into device_ips is fine for a job on 4-7."""
    c = load_cluster(write(tmp_path, """\
        inventory:
          hosts:
            - address: 10.0.0.1
              devices: [4, 5, 6, 7]
              device_ips: {0: 192.168.100.1, 1: 192.168.101.1, 2: 192.168.102.1, 3: 192.168.103.1,
                           4: 192.168.100.2, 5: 192.168.101.2, 6: 192.168.102.2, 7: 192.168.103.2}
        job: {workdir: /data/j, command: x, launcher: ranktable, platform: ascend, rank_dirs: true,
              hccl: {connect_timeout: 600, exec_timeout: 900}}
        """))
    from orchestrator.rankplan import device_ips_for, make_plan
    assert device_ips_for(make_plan(c), {})["10.0.0.1"] == {4: "192.168.100.2", 5: "192.168.101.2",
                                                             6: "192.168.102.2", 7: "192.168.103.2"}
    assert (c.job.rank_dirs, c.job.hccl_connect_timeout, c.job.hccl_exec_timeout) == (True, 600, 900)


def test_hccl_timeouts_are_bounded(tmp_path):
    got = problems(tmp_path, """\
        inventory: {hosts: [{address: 10.0.0.1}]}
        job: {workdir: /data/j, command: x, hccl: {connect_timeout: 60, exec_timeout: 0, retries: 3}}
        """)
    msgs = " | ".join(m for _, _, m in got)
    assert "120 to 7200" in msgs and "1 to 17340" in msgs and "unknown key 'retries'" in msgs, got


def test_a3_keys_per_host_and_in_defaults(tmp_path):
    """super_device_ids / super_pod_id (rank table 1.2): a host's own win over defaults; an unquoted
    `version: 1.2` is the string "1.2"."""
    c = load_cluster(write(tmp_path, """\
        inventory:
          defaults: {slots: 16, super_pod_id: 2}
          hosts:
            - address: 10.0.0.1
              super_device_ids: {0: 37748736, 1: "37814273"}
            - {address: 10.0.0.2, super_pod_id: 0}
        job: {workdir: /data/j, command: x, launcher: ranktable, platform: ascend, rank_table: {version: 1.2}}
        """))
    h1, h2 = c.hosts
    assert (h1.super_device_ids, h1.super_pod_id) == ({0: 37748736, 1: 37814273}, 2)
    assert (h2.super_device_ids, h2.super_pod_id) == ({}, 0)
    assert c.job.rank_table_version == "1.2"


def test_a3_keys_are_checked_and_located(tmp_path):
    got = problems(tmp_path, """\
        inventory:
          hosts:
            - address: 10.0.0.1
              super_device_ids: {0: -1, 1: ""}
              super_pod_id: -3
        job: {workdir: /data/j, command: x, rank_table: {version: "1.3"}}
        """)
    by_field = {f: (line, m) for line, f, m in got}
    assert by_field["inventory.hosts[0].super_device_ids[1]"][0] == 4, got  # "" is no SDID
    assert "super_pod_id is a non-negative integer" in by_field["inventory.hosts[0].super_pod_id"][1]
    assert by_field["inventory.hosts[0].super_pod_id"][0] == 5
    assert "'1.0', '1.2' or 'legacy'" in by_field["job.rank_table.version"][1]
    assert len(got) == 3, got
    got = problems(tmp_path, """\
        inventory: {hosts: [{address: 10.0.0.1, super_device_ids: {0: -1}}]}
        job: {workdir: /data/j, command: x}
        """)
    assert got == [(1, "inventory.hosts[0].super_device_ids",
                    "super_device_ids: -1 (device 0) is not an SDID, an unsigned 32-bit integer as "
                    "`npu-smi info -t spod-info` prints it")], got


def test_ip_ranges_stay_valid_ips(tmp_path):
    got = problems(tmp_path, """\
        inventory: {hosts: [{address: "198.18.206.[11-1300]"}]}
        job: {workdir: /data/j, command: x}
        """)
    assert any("gives 1045 addresses that are not IPv4 addresses (e.g. 198.18.206.256)" in m for _, _, m in got), got


def test_sync_via_defaults_to_the_launch_host_where_hosts_ssh_to_each_other(tmp_path):
    """mpirun (hosts ssh to each other anyway): launch-host; other launchers and Slurm: controller;
    a value given wins; a wrong one names its line."""
    def via(job: str, inv: str = "{hosts: [{address: 10.0.0.1}]}") -> str:
        return load_cluster(write(tmp_path, f"inventory: {inv}\njob: {{workdir: /data/j, command: x, {job}}}\n")).job.sync_via
    assert via("launcher: mpirun") == "launch-host"
    assert via("launcher: torchrun") == "controller"
    assert via("launcher: msrun, sync_via: launch-host") == "launch-host"
    assert via("launcher: mpirun, sync_via: controller") == "controller"
    assert via("launcher: mpirun", "{slurm: {nodes: 2}}") == "controller"
    got = problems(tmp_path, """\
        inventory: {hosts: [{address: 10.0.0.1}]}
        job:
          workdir: /data/j
          command: x
          sync_via: head
        """)
    assert [(line, field) for line, field, _ in got] == [(5, "job.sync_via")], got
    assert "'controller' or 'launch-host'" in got[0][2], got
