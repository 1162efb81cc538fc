"""Scenario 9: fuzzed input never gives a traceback.

cluster.yaml / inventory structure and values -> a valid model (which plans, renders and
records without a crash) or a SpecError whose every problem has a location; host output
handed to any parser (probe sections, /etc/hccn.conf, poll and status replies, checksum
listings) -> a value or the parser's documented error, never anything else; rank tables
rendered from fuzzed plans are valid JSON that list each rank once.

Short in CI; a long run is `ORCH_FUZZ_EXAMPLES=10000 pytest tests/faults/test_fuzz.py`.
(Pure code: no lab needed, so these run everywhere.)
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import os
import shutil
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from orchestrator import devices, prepare, probes, rankplan, runlogs, runs, sh, supervisor, sync
from orchestrator.launchers import ranktable, show
from orchestrator.errors import OrchError, PlanError, SpecError, UsageError
from orchestrator.hostsets import fold
from orchestrator.spec import load_cluster

EXAMPLES = int(os.environ.get("ORCH_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "checks"
SECRET_PREFIX = "S3cr3t-fz-"

# ------------------------------------------------------------------ building blocks

TRICKY = ["", " ", "\n", "\t", "~", "*", "@g", "a[", "n[1-3]", "n[01-16/2]", "10.0.0.[1-4]", "n[1-99999999]",
          "a,b", "a&b", "a!b", "$(touch /tmp/fz)", "`id`", "it's", '"q"', "\\", "..", "/abs", "../up", "x" * 300,
          "²", "٣", "1e309", "nan", "-0", "0x10", "0o7", "1_000", "true", "null", "[]", "{}", "ünï", "\x85",
          "\u2028"]
text = st.one_of(st.text(max_size=24), st.sampled_from(TRICKY))
number = st.one_of(st.integers(-5, 70000), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1, 2, 8, 65535, 65536, 2 ** 63, -2 ** 63]))
scalar = st.one_of(st.none(), st.booleans(), number, text)
anything = st.recursive(scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(text, inner, max_size=3)), max_leaves=8)


def maybe(strategy):
    """Mostly the right shape, sometimes anything at all."""
    return st.one_of(strategy, strategy, strategy, anything)


env_name = st.one_of(st.sampled_from(["PATH", "HF_TOKEN", "DB_PASSWORD", "AWS_KEY", "MY_CRED", "X", "_A1"]),
                     st.from_regex(r"[A-Z_][A-Z0-9_]{0,8}", fullmatch=True), text)
env = st.dictionaries(env_name, st.one_of(text, number, st.booleans(), st.none(), anything), max_size=4)
address = st.one_of(st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.[1-3]", "node[01-04]", "h1", "::1",
                                     "10.0.0.[1-99999999]", "n[1-2],m[1-2]"]), text)
host = st.fixed_dictionaries(
    {"address": maybe(address)},
    optional={"name": maybe(text), "slots": maybe(st.integers(-1, 9)), "port": maybe(number),
              "devices": maybe(st.lists(st.integers(-1, 9), max_size=9)),
              "device_ips": maybe(st.dictionaries(st.integers(-1, 9), st.sampled_from(
                  ["192.168.1.1", "10.0.0.300", "fe80::1", "x"]), max_size=4)),
              "env": maybe(env), "user": maybe(text), "connection": maybe(st.sampled_from(["ssh", "local", "x"])),
              "identity_file": maybe(text), "known_hosts": maybe(text), "bogus": anything})
inventory = st.fixed_dictionaries(
    {"hosts": maybe(st.lists(host, max_size=4))},
    optional={"defaults": maybe(host.map(lambda h: {k: v for k, v in h.items() if k not in ("address", "name")})),
              "groups": maybe(st.dictionaries(text, st.lists(st.one_of(address, text), max_size=3), max_size=2))})
job = st.fixed_dictionaries(
    {"workdir": maybe(st.one_of(st.sampled_from(["/data/x", "/data/a b", "rel", "/d/$(x)", "/d/\"q\""]), text)),
     "command": maybe(st.one_of(text, st.lists(text, max_size=4)))},
    optional={"launcher": maybe(st.sampled_from(["mpirun", "ranktable", "msrun", "x"])),
              "platform": maybe(st.sampled_from(["ascend", "gpu", "cpu", "tpu"])),
              "env": maybe(env), "secret_env": maybe(st.lists(env_name, max_size=3)),
              "sync": maybe(st.lists(text, max_size=2)), "log_dir": maybe(text), "timeout": maybe(number),
              "on_failure": maybe(st.sampled_from(["stop", "continue", "x"])),
              "mpirun_args": maybe(st.lists(text, max_size=3)),
              "rank_table": maybe(st.fixed_dictionaries({}, optional={"version": st.sampled_from(
                  ["1.0", "legacy", "2", 1.0])})),
              "master_port": maybe(number), "comand": anything})
cluster_doc = st.fixed_dictionaries(
    {"inventory": maybe(inventory), "job": maybe(job)},
    optional={"name": maybe(text),
              "ssh": maybe(st.fixed_dictionaries({}, optional={
                  "connect_timeout": maybe(number), "command_timeout": maybe(number), "fanout": maybe(number),
                  "retries": maybe(number), "host_key_policy": maybe(st.sampled_from(["strict", "accept-new", "x"]))})),
              "checks": maybe(st.fixed_dictionaries({}, optional={
                  "versions": maybe(st.lists(st.sampled_from(["python", "openmpi", "x"]), max_size=2)),
                  "skip": maybe(st.lists(st.sampled_from(["disk", "mesh", "x"]), max_size=2))}))})


def _dump(doc) -> str:
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


_WORK = Path(tempfile.mkdtemp(prefix="orch-fuzz-"))  # hypothesis examples cannot take tmp_path
atexit.register(shutil.rmtree, _WORK, True)


def _outcome(text: str, name: str = "cluster.yaml"):
    """load_cluster on `text`: a Cluster, or a SpecError whose every problem is located."""
    path = _WORK / name
    path.write_text(text, encoding="utf-8")
    try:
        return load_cluster(path)
    except SpecError as exc:
        assert exc.problems, exc
        for loc, msg in exc.problems:
            assert loc.file and (loc.line is not None or loc.field), (loc, msg)
        return None
    except OrchError as exc:
        raise AssertionError(f"{type(exc).__name__} instead of a located SpecError: {exc}") from None


def _exercise(cluster) -> None:
    """A valid model must plan, render and be recorded without a crash (PlanError is fine)."""
    try:
        rp = rankplan.make_plan(cluster)
    except PlanError:
        return
    try:
        files = show.plan_files(cluster, rp, device_ips=None, root=False)
    except PlanError:
        return
    json.loads(files["plan.json"])
    json.loads(files["commands.json"])
    for pattern in ("h1", "n[1-2]", "@g", "*", "bogus", cluster.hosts[0].name):
        try:
            cluster.select(pattern)
        except UsageError:
            pass
    fold(h.name for h in cluster.hosts)


# ------------------------------------------------------------------ cluster files


@FUZZ
@given(doc=cluster_doc)
def test_fuzz_cluster_structure(doc):
    """Fuzzed cluster.yaml (inline inventory) -> located SpecError or a model that plans and renders."""
    cluster = _outcome(_dump(doc))
    if cluster is not None:
        _exercise(cluster)


@FUZZ
@given(doc=cluster_doc, inv=maybe(inventory))
def test_fuzz_inventory_file(doc, inv):
    """Fuzzed inventory given as a separate file: problems located in that file, never a traceback."""
    (_WORK / "inv.yaml").write_text(_dump(inv), encoding="utf-8")
    doc = dict(doc, inventory="inv.yaml")
    cluster = _outcome(_dump(doc))
    if cluster is not None:
        _exercise(cluster)


@FUZZ
@given(doc=cluster_doc, cuts=st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(
    ["", ":", " ", "\n", "- ", "[", "{", "'", '"', "\t", "&a ", "*a", "!!python/object:os.system ", "<<: "])),
    max_size=4))
def test_fuzz_cluster_text(doc, cuts):
    """Fuzzed YAML text (a dumped document with characters cut and inserted): never a traceback."""
    text = _dump(doc)
    for pos, ins in cuts:
        pos %= len(text) + 1
        text = text[:pos] + ins + text[pos + 1:]
    cluster = _outcome(text)
    if cluster is not None:
        _exercise(cluster)


secret_value = st.text(min_size=1, max_size=20).map(lambda t: SECRET_PREFIX + t)


@FUZZ
@given(values=st.dictionaries(st.sampled_from(["HF_TOKEN", "DB_PASSWORD", "AWS_KEY", "MY_CRED", "A_SECRET"]),
                              st.one_of(secret_value, st.integers(10 ** 9, 10 ** 12)), min_size=1),
       plain=st.dictionaries(st.from_regex(r"P[A-Z]{0,5}", fullmatch=True), text, max_size=2),
       style=st.sampled_from([None, "'", '"', "|"]))
# found by this test: a block scalar secret ending in NEXT LINE (or PARAGRAPH SEPARATOR) before another key
@example(values={"HF_TOKEN": SECRET_PREFIX + "\x85"}, plain={"P": "x"}, style="|")
@example(values={"HF_TOKEN": SECRET_PREFIX + "\u2029", "AWS_KEY": 10 ** 9}, plain={}, style="|")
def test_fuzz_secret_masking(values, plain, style):
    """Whatever secret env values hold and however YAML spells them, the recorded cluster_text
    holds none of them and stays valid YAML (secrets replaced by ***, everything else kept)."""
    doc = {"inventory": {"hosts": [{"address": "10.0.0.1", "env": {"MY_CRED": SECRET_PREFIX + "host"}}]},
           "job": {"workdir": "/data/x", "command": "true", "secret_env": ["MY_CRED"],
                   "env": {**values, **plain}}}
    text = yaml.dump(doc, sort_keys=False, allow_unicode=True, default_style=style, Dumper=yaml.SafeDumper)
    cluster = _outcome(text)
    if cluster is None:
        return
    job = cluster.job
    masked = runs.mask_values(runs.mask_yaml(text, job), runs.secret_values(cluster))
    back, before = yaml.safe_load(masked), yaml.safe_load(text)  # (PyYAML does not round-trip everything)
    for k, v in values.items():
        assert back["job"]["env"][k] == runs.MASK
        if len(str(v)) >= sh.MIN_MASKED:
            assert str(v) not in masked
    assert back["inventory"]["hosts"][0]["env"]["MY_CRED"] == runs.MASK
    for k, v in plain.items():
        if not any(str(s) in str(v) for s in values.values()):
            assert back["job"]["env"][k] == before["job"]["env"][k]


# ------------------------------------------------------------------ host output


def _fixture_texts() -> list[str]:
    return [p.read_text(errors="replace") for p in sorted(FIXTURES.iterdir()) if p.is_file()]


FIXTURE_TEXTS = _fixture_texts() if FIXTURES.is_dir() else [""]
TOKENS = ["rc", "alive", "log", "pid", "rank.3.rc", "rank.x.rc", "mpirun.rc", "0", "-1", "137", "²", "٣", "１",
          "99999999999999999999", "1.5", "-", "/d/log_output/1/rank.2/stdout", "/d/worker_07.log", "@@orch:begin",
          "@@orch:end", "address_0=192.168.1.1", "address_٣=1.2.3.4", "address_99999999999999999=1.1.1.1",
          "netmask_0=255.0.0.0", "=", " ", "\t", "\r", "\x00", "ünï", "version=", "NCCL_MAJOR", "inet", "Filesystem",
          "a" * 64, "0" * 64]
line = st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=8)), max_size=6).map(" ".join)
structured = st.lists(line, max_size=12).map("\n".join)


@st.composite
def host_output(draw):
    """Arbitrary text, token soup, or a real captured output with lines cut, repeated and garbled."""
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(st.text(max_size=400))
    if kind == 1:
        return draw(structured)
    lines = draw(st.sampled_from(FIXTURE_TEXTS)).splitlines()
    for _ in range(draw(st.integers(0, 4))):
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        op = draw(st.integers(0, 3))
        if op == 0:
            del lines[i]
        elif op == 1:
            lines.insert(i, draw(line))
        elif op == 2:
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        else:
            lines.insert(i, lines[i])
    return "\n".join(lines)


PROBE_PARSERS = [
    probes.parse_python_version, probes.parse_openmpi_version, probes.parse_cann_version,
    probes.parse_cuda_driver_version, probes.parse_ip_addrs, probes.parse_df, probes.parse_listening_ports,
    probes.parse_hccn, probes.parse_nvidia_smi_l, probes.parse_npu_smi, probes.parse_stale, probes.parse_clock,
    probes.parse_workdir, probes.parse_sha256sum, probes.parse_mesh, probes.parse_path,
    lambda t: probes.parse_dists(t, ["torch", "mindspore"]), probes.parse_nccl_version, probes.split_sections,
]


@FUZZ
@given(text=host_output())
def test_fuzz_probe_parsers(text):
    """Every probe parser, on any output: a value or ProbeError (its documented error), nothing else."""
    failures = []
    for parse in PROBE_PARSERS:
        try:
            parse(text)
        except probes.ProbeError:
            pass
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            failures.append(f"{getattr(parse, '__name__', parse)}: {type(exc).__name__}: {exc}")
    assert not failures, failures


@FUZZ
@given(text=host_output())
def test_fuzz_hccn_conf(text):
    """/etc/hccn.conf of any content -> {device id: IP address}, only valid ones kept."""
    out = devices.hccn_ips(devices.parse_hccn(text))
    for dev, ip in out.items():
        assert isinstance(dev, int) and dev >= 0
        ipaddress.ip_address(ip)


@FUZZ
@given(text=host_output())
def test_fuzz_lifecycle_replies(text):
    """Supervisor replies, event streams, log-gathering streams and checksum listings of any
    content parse (garbage is ignored, or an OrchError for a gathering stream: never a crash)."""
    with tempfile.TemporaryDirectory() as here:
        run = type("R", (), {"dir": Path(here), "local_log": lambda self, r, a=1: Path(here) / f"{a}" / f"{r}"})()
        sink = runlogs._Gathered(run, Path(here) / "launcher.log")
        try:
            sink.write(text.encode("utf-8", "surrogateescape"))
        except OrchError:
            pass
        finally:
            sink.close(False)
    assert isinstance(supervisor.parse_json_line(text), dict)
    assert isinstance(prepare.parse_prepare(text), dict)
    got = []
    stream = supervisor.EventStream(got.append, lambda r, a, d: got.append((r, a, d)))
    data = text.encode("utf-8", "surrogateescape")
    for i in range(0, len(data), 7):
        stream.write(data[i:i + 7])
    assert all(isinstance(g, (dict, tuple)) for g in got)
    rules = sync.parse_patterns(text.splitlines())  # an ignore file of any content
    assert all(isinstance(sync.excluded(rules, p, d), bool) for p in ("a", "b c/d", "d\ne") for d in (True, False))


# ------------------------------------------------------------------ rank tables


@FUZZ
@given(hosts=st.lists(st.tuples(st.integers(1, 8), st.booleans()), min_size=1, max_size=6),
       version=st.sampled_from(["1.0", "legacy"]), data=st.data())
def test_fuzz_rank_tables(hosts, version, data):
    """Rank tables rendered for fuzzed plans are JSON listing every rank exactly once, on the
    device and server the plan says."""
    inv = []
    for i, (slots, partial) in enumerate(hosts):
        devices = data.draw(st.lists(st.integers(0, 15), min_size=slots, max_size=slots, unique=True)) \
            if partial else list(range(slots))
        inv.append({"address": f"10.0.{i // 250}.{i % 250 + 1}", "slots": slots, "devices": devices,
                    "device_ips": {d: f"192.168.{d}.{i + 1}" for d in devices}})
    doc = {"inventory": {"hosts": inv}, "job": {"workdir": "/d", "command": "true", "launcher": "ranktable",
                                                "platform": data.draw(st.sampled_from(["ascend", "cpu"])),
                                                "rank_table": {"version": version}}}
    cluster = _outcome(_dump(doc))
    assert cluster is not None
    try:
        rp = rankplan.make_plan(cluster)
        table = json.loads(ranktable.rank_table(cluster, rp, rankplan.device_ips_for(rp, {})))
    except PlanError:
        return  # an Ascend device rule refused the layout: a located, explained error
    if version == "1.0":
        entries = [(d["rank_id"], d["device_id"], s["server_id"]) for s in table["server_list"] for d in s["device"]]
    else:
        entries = [(x["rank_id"], x["devices"][0]["device_id"], x["server_id"])
                   for x in table["group_list"][0]["instance_list"]]
    assert sorted(int(r) for r, _, _ in entries) == list(range(rp.size))
    for r, dev, server in entries:
        rank = rp.ranks[int(r)]
        assert (int(dev), server) == (rank.device_id, rank.address)
