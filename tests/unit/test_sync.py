"""Code sync (orchestrator/sync.py): what is synced, and the receiver, run for real through the
local transport (the same script the hosts run over ssh)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from orchestrator import sync
from orchestrator.errors import HostError, SpecError
from orchestrator.fanout import fan_out
from orchestrator.model import SshSettings
from orchestrator.spec import Host, load_cluster
from orchestrator.transport.local import LocalTransport


class Counting(LocalTransport):
    def __init__(self):
        super().__init__(Host(name="here", address="localhost", user="u", connection="local"), 60)
        self.runs = 0

    def run(self, *a, **k):
        self.runs += 1
        return super().run(*a, **k)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def rels(entries) -> list[str]:
    return [e.rel for e in entries if e.kind != "dir"]


def test_excludes_default_orchignore_job_and_negation(tmp_path):
    tree(tmp_path / "p", {"a.py": "", "x.pyc": "", "__pycache__/a.pyc": "", ".git/HEAD": "", "sub/.git/x": "",
                          "data/big.ckpt": "", "data/keep.ckpt": "", "logs/out.log": "", "sub/b.py": "",
                          ".orchignore": "# checkpoints\n*.ckpt\n!keep.ckpt\n/logs/\n"})
    got = rels(sync.manifest(tmp_path, ("p",), "c.yaml", exclude=("sub/b.py",)))
    assert got == ["p/.orchignore", "p/a.py", "p/data/keep.ckpt"]


def test_every_directory_is_made_before_any_file_parents_first(tmp_path):
    """The host makes the whole tree before it writes a file (interleaving directories and files
    cost ext4's inode allocation 3x the kernel time at 8 hosts on the lab): the manifest, and so
    every stream, has the directories first, parents before children, then files and links."""
    tree(tmp_path / "p", {"a.py": "", "b/x.py": "", "b/c/y.py": "", "d/z.py": ""})
    os.symlink("a.py", tmp_path / "p" / "l.py")
    got = sync.manifest(tmp_path, ("p",), "c.yaml")
    kinds = [e.kind for e in got]
    assert kinds == sorted(kinds, key=lambda k: k != "dir"), [(e.rel, e.kind) for e in got]
    assert [e.rel for e in got if e.kind == "dir"] == ["p", "p/b", "p/b/c", "p/d"]
    frames = sync._Frames([(e, "send") for e in got]).read()
    heads = [json.loads(line) for line in frames.split(b"\n") if line.startswith(b"{")]
    assert [h["kind"] for h in heads][:4] == ["dir"] * 4 and "dir" not in [h["kind"] for h in heads][4:]


def test_gitignore_is_read_when_there_is_no_orchignore(tmp_path):
    tree(tmp_path / "p", {"a.py": "", "out/x": "", ".gitignore": "out/\n"})
    assert rels(sync.manifest(tmp_path, ("p",), "c.yaml")) == ["p/.gitignore", "p/a.py"]


def test_links_inside_kept_links_outside_loops_and_escaping_paths_refused(tmp_path):
    p = tree(tmp_path / "p", {"a.py": "", "d/x": ""})
    os.symlink("a.py", p / "l.py")
    os.symlink("d", p / "dl")
    os.symlink("gone", p / "dangling")
    got = {e.rel: (e.kind, e.target) for e in sync.manifest(tmp_path, ("p",), "c.yaml")}
    assert got["p/l.py"] == ("link", "a.py") and got["p/dl"] == ("link", "d") and got["p/dangling"][0] == "link"
    os.symlink("/etc/passwd", p / "evil")
    os.symlink("../../outside", p / "d" / "up")
    os.symlink("loop2", p / "loop1")
    os.symlink("loop1", p / "loop2")
    with pytest.raises(SpecError) as exc:
        sync.manifest(tmp_path, ("p",), "c.yaml")
    text = str(exc.value)
    assert "evil is a link to /etc/passwd, outside the synced directory" in text
    assert "up is a link to ../../outside, outside" in text and "loop1 is a symbolic link loop" in text
    assert "c.yaml: job.sync[0]" in text
    with pytest.raises(SpecError, match="leaves the cluster file's directory"):
        sync.manifest(tmp_path / "p", ("../../etc/passwd",), "c.yaml")


def test_one_listing_and_one_stream_whatever_the_number_of_files(tmp_path):
    src = tree(tmp_path / "src", {f"pkg/m{i}.py": f"x = {i}\n" for i in range(500)})
    (src / "pkg" / "run.sh").write_text("echo hi\n")
    os.chmod(src / "pkg" / "run.sh", 0o777)
    os.symlink("m1.py", src / "pkg" / "link.py")
    work = tmp_path / "work"
    entries = sync.manifest(src, ("pkg",), "c.yaml")
    t = Counting()
    rep = sync.sync_host(t, str(work), entries, {"hostfile": b"h1 slots=2\n"})
    assert t.runs == 2 and len(rep.copied) == 502 and rep.unchanged == ()
    assert (work / "pkg" / "m7.py").read_text() == "x = 7\n" and (work / "hostfile").read_bytes() == b"h1 slots=2\n"
    assert os.readlink(work / "pkg" / "link.py") == "m1.py"
    assert stat.S_IMODE((work / "pkg" / "run.sh").stat().st_mode) == 0o755  # no group/other write
    t.runs = 0
    rep = sync.sync_host(t, str(work), entries, {"hostfile": b"h1 slots=2\n"})
    assert t.runs == 1 and rep.copied == () and len(rep.unchanged) == 502
    # a permission-only change is a change; so is new content of the same size
    os.chmod(src / "pkg" / "run.sh", 0o644)
    (src / "pkg" / "m3.py").write_text("x = 9\n")
    os.utime(src / "pkg" / "m3.py", ns=(1, 1))
    rep = sync.sync_host(t, str(work), sync.manifest(src, ("pkg",), "c.yaml"), {"hostfile": b"h2 slots=2\n"})
    assert sorted(rep.copied) == ["pkg/m3.py", "pkg/run.sh"] and (work / "hostfile").read_bytes() == b"h2 slots=2\n"
    assert stat.S_IMODE((work / "pkg" / "run.sh").stat().st_mode) == 0o644
    assert (work / "pkg" / "m3.py").read_text() == "x = 9\n"


def test_an_interrupted_stream_leaves_no_partial_file_under_a_real_name(tmp_path):
    src = tree(tmp_path / "src", {"big.bin": "A" * 100_000})
    work = tmp_path / "work"
    (work).mkdir()
    (work / "big.bin").write_text("old")
    entries = sync.manifest(src, ("big.bin",), "c.yaml")
    frames = sync._Frames([(entries[0], "send")]).read(50_000)  # the stream cut halfway
    res = Counting().run(sync._receiver_argv("recv", str(work)), stdin=frames)
    assert res.exit_code == 43 and "interrupted" in res.err
    assert (work / "big.bin").read_text() == "old" and os.listdir(work) == ["big.bin"]


def test_nothing_is_written_through_a_link_planted_in_workdir(tmp_path):
    src = tree(tmp_path / "src", {"pkg/a.py": "new"})
    work = tmp_path / "work"
    work.mkdir()
    victim = tmp_path / "victim"
    victim.mkdir()
    os.symlink(victim, work / "pkg")  # another user made workdir/pkg point elsewhere
    with pytest.raises(HostError, match="is a symbolic link, not a directory orch made"):
        sync.sync_host(Counting(), str(work), sync.manifest(src, ("pkg",), "c.yaml"))
    assert os.listdir(victim) == []
    os.unlink(work / "pkg")
    os.symlink(tmp_path / "target.py", work / "b.py")  # a planted file link is replaced, never followed
    (src / "b.py").write_text("mine")
    sync.sync_host(Counting(), str(work), sync.manifest(src, ("b.py",), "c.yaml"))
    assert not (work / "b.py").is_symlink() and not (tmp_path / "target.py").exists()


@pytest.mark.parametrize("kind", ["file", "link"])
@pytest.mark.parametrize("full", [False, True])
def test_a_directory_where_a_file_goes_is_named_and_kept(tmp_path, kind, full):
    """The receiver renames over what is there in one call (no stat of each name first): where a
    directory stands, rename's EISDIR is said as the directory it is, nothing replaced or left."""
    src = tmp_path / "src"
    src.mkdir()
    if kind == "file":
        (src / "a.py").write_text("new")
    else:
        (src / "b.py").write_text("b")
        os.symlink("b.py", src / "a.py")
    work = tmp_path / "work"
    (work / "a.py").mkdir(parents=True)
    if full:
        (work / "a.py" / "keep").write_text("mine")
    with pytest.raises(HostError, match=r"work/a\.py is a directory on this host; remove it"):
        sync.sync_host(Counting(), str(work), sync.manifest(src, (".",), "c.yaml"))
    assert [n for n in os.listdir(work) if n != "b.py"] == ["a.py"] and os.listdir(work / "a.py") == (["keep"] if full else [])


def test_sync_dot_lands_at_the_top_of_workdir(tmp_path):
    src = tree(tmp_path / "proj", {"train.py": "x", "vendor/lib.py": "y"})
    entries = sync.manifest(src, (".",), "c.yaml")
    assert rels(entries) == ["train.py", "vendor/lib.py"]
    work = tmp_path / "work"
    sync.sync_host(Counting(), str(work), entries)
    assert (work / "train.py").read_text() == "x" and (work / "vendor" / "lib.py").read_text() == "y"


def test_a_read_only_directory_still_takes_its_files_for_a_non_root_user(tmp_path):
    """Directory modes are set after the files: a 0555 directory would refuse them otherwise
    (root is never refused, so the receiver runs as another uid here)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        if os.environ.get("CI"):
            pytest.fail("CI is set but this test needs root and setpriv (util-linux) to act as another uid")
        pytest.skip("needs root and setpriv to run the receiver as another uid")
    src = tree(tmp_path / "proj", {"vendor/lib.py": "y"})
    os.chmod(src / "vendor", 0o555)
    base = Path(tempfile.mkdtemp(prefix="orch-sync-"))  # pytest's tmp_path is root's alone (0700)
    try:
        os.chmod(base, 0o755)
        work = base / "work"
        work.mkdir()
        os.chown(work, 4242, 4242)
        frames = sync._Frames([(e, "send") for e in sync.manifest(src, ("vendor",), "c.yaml")]).read()
        res = subprocess.run(["setpriv", "--reuid=4242", "--regid=4242", "--clear-groups", sys.executable, "-c",
                              sync.RECEIVER, "recv", str(work)], input=frames, capture_output=True)
        assert res.returncode == 0, res.stderr
        assert (work / "vendor" / "lib.py").read_text() == "y"
        assert stat.S_IMODE((work / "vendor").stat().st_mode) == 0o555
    finally:
        shutil.rmtree(base)


def test_a_link_that_leaves_the_tree_through_another_link_is_refused(tmp_path):
    p = tree(tmp_path / "p", {"a.py": ""})
    os.symlink(".", p / "b")
    os.symlink("b/..", p / "a")  # reads as inside, resolves to p's parent
    with pytest.raises(SpecError, match="a is a link to b/.., outside the synced directory"):
        sync.manifest(tmp_path, ("p",), "c.yaml")


def _counting_sha256(monkeypatch) -> list[int]:
    """sync's sha256, counted: the length of each thing it hashes."""
    import types

    hashed: list[int] = []
    real = hashlib.sha256
    monkeypatch.setattr(sync, "hashlib", types.SimpleNamespace(sha256=lambda data: hashed.append(len(data)) or real(data)))
    return hashed


def test_a_rendered_file_every_host_gets_is_made_and_hashed_once(monkeypatch):
    """rendered's `made`: a file already made (the same name and bytes, another bytes object or
    not) is that entry again, not hashed again."""
    hashed = _counting_sha256(monkeypatch)
    table, other = b"{}" * 1000, b"h1 slots=8\n"
    made: dict = {}
    a = sync.rendered({"rank_table.json": table}, made)
    b = sync.rendered({"rank_table.json": bytes(bytearray(table)), "hostfile": other}, made)
    assert b[1] is a[0] and [e.rel for e in b] == ["hostfile", "rank_table.json"]
    assert sorted(hashed) == [len(other), len(table)]
    assert sync.rendered({"rank_table.json": table})[0] == a[0]   # without `made`: made anew, the same


def _fan_out_case(tmp_path, monkeypatch, hosts):
    """A workdir holding pkg/ and a rank table, its listing, a pool of local transports for
    `hosts`, and a fan that notes the hosts it gets; every host's rank table its own bytes object."""
    src = tree(tmp_path / "src", {"pkg/a.py": "a\n", "pkg/b.py": "b\n"})
    work = tmp_path / "wd"
    entries = sync.manifest(src, ("pkg",), "c.yaml")
    table = b"{}" * 1000
    sync.sync_host(Counting(), str(work), entries, {"rank_table.json": table})
    listing = _probe_listing(work, sync.listing_request(entries, ("rank_table.json",)))
    transports = {h.name: LocalTransport(h, 60) for h in hosts}
    pool = type("Pool", (), {"__getitem__": lambda self, h: transports[h.name]})()
    fanned: list[str] = []

    def fan(hs, fn):
        fanned.extend(h.name for h in hs)
        return fan_out(hs, fn)

    extras = {h.name: {"rank_table.json": bytes(bytearray(table))} for h in hosts}
    older = dict(listing, **{"pkg/b.py": listing["pkg/b.py"][:2] + [1] + listing["pkg/b.py"][3:]})
    return work, entries, extras, pool, fan, fanned, listing, older


def test_only_hosts_with_something_to_do_get_a_thread_of_the_fan_out(tmp_path, monkeypatch):
    """What a host lacks by up's listing is known here: a host gets a thread of the fan-out only
    for a round trip (its listing does not cover it, or something goes to it). At 128 hosts with
    nothing changed, 128 threads took their turns at the GIL behind the supervisors' starts for
    up to 0.6 s, on the head's start's path. Every host still has its report; the rank table
    every host gets is hashed once (hashlib lets go of the GIL for each)."""
    hosts = [Host(name=f"h{i}", address="localhost", user="u", connection="local") for i in range(4)]
    work, entries, extras, pool, fan, fanned, listing, older = _fan_out_case(tmp_path, monkeypatch, hosts)
    hashed = _counting_sha256(monkeypatch)
    # h0 (the launch host) and h1 have it all, h2 lists an older pkg/b.py, h3 was not listed
    got = sync.sync_hosts(pool, hosts, hosts[0], str(work), entries, extras, via="controller", ssh=SshSettings(),
                          fan=fan, listed={"h0": listing, "h1": listing, "h2": older})
    assert not got.failed, got.failed
    assert sorted(fanned) == ["h2", "h3"]
    assert hashed.count(2000) == 1
    both = ("pkg/a.py", "pkg/b.py")
    assert {n: (o.value.copied, o.value.unchanged) for n, o in got.items()} == {
        "h0": ((), both), "h1": ((), both), "h2": (("pkg/b.py",), ("pkg/a.py",)), "h3": ((), both)}


def test_through_the_launch_host_only_a_round_trip_takes_a_thread(tmp_path, monkeypatch):
    """job.sync_via: launch-host: a host the listing covers needs no thread (asked: those it does
    not; near: those sent to from here with something to send); the relay gets what the others
    lack, the launch host's own part empty when it lacks nothing; nothing lacked: no relay."""
    hosts = [_ssh_host(f"h{i}") for i in range(4)]
    work, entries, extras, pool, fan, fanned, listing, older = _fan_out_case(tmp_path, monkeypatch, hosts)
    relays = []

    def relay(t, workdir, own, todos, ssh, hop, share=None):
        relays.append((t.host.name, [(e.rel, w) for e, w in own],
                       {n: [(e.rel, w) for e, w in todo] for n, (_, todo) in todos.items()}))
        return {"targets": {n: {"rc": 0} for n in todos}}

    monkeypatch.setattr(sync, "_relay", relay)
    # h0 (the launch host) and h2 have it all, h1 lists an older pkg/b.py, h3 was not listed
    got = sync.sync_hosts(pool, hosts, hosts[0], str(work), entries, extras, via="launch-host", ssh=SshSettings(),
                          fan=fan, listed={"h0": listing, "h1": older, "h2": listing})
    assert not got.failed, got.failed
    assert fanned == ["h3"] and relays == [("h0", [], {"h1": [("pkg/b.py", "send")]})]
    both = ("pkg/a.py", "pkg/b.py")
    assert {n: (o.value.copied, o.value.unchanged) for n, o in got.items()} == {
        "h0": ((), both), "h1": (("pkg/b.py",), ("pkg/a.py",)), "h2": ((), both), "h3": ((), both)}
    fanned.clear()
    got = sync.sync_hosts(pool, hosts, hosts[0], str(work), entries, extras, via="launch-host", ssh=SshSettings(),
                          fan=fan, listed={h.name: listing for h in hosts})
    assert not got.failed and fanned == [] and len(relays) == 1


# --------------------------------------------------------------------------- through the launch host


def _ssh_host(name: str, **kw) -> Host:
    return Host(name=name, address=f"{name}.example", user="train", connection="ssh", **kw)


def _relay(tmp_path, src_files, targets, *, corrupt=None, timeout=60.0, through=False, open_files=None,
           same=False):
    """cmd_relay run here (the launch host's workdir `launch`) for `targets` {name: argv prefix},
    each into its own directory. The launch host is brought up to date first, or (`through`) gets
    its own stream in the same request, passed on as it arrives; `same`: every target lacks just
    what the launch host lacks (its own stream, a rank table too), so it gets that stream as it
    came ("raw"); `open_files`: the relay's limit of open files (ulimit -n). (answer, request, workdirs)."""
    src = tree(tmp_path / "src", src_files)
    os.symlink("a.py", src / "pkg" / "l.py")
    entries = sync.manifest(src, ("pkg",), "c.yaml")
    lw = tmp_path / "launch"
    own = [(e, "send") for e in entries] if through else []
    if same:  # and a hostfile only the launch host lacks, which the controller sends last
        own = [(e, "send") for e in sync.rendered({"hostfile": b"h0 slots=1\n"}) + entries +
               sync.rendered({"rank_table.json": b'{"n": 2}'})]
    elif not through:
        sync.sync_host(Counting(), str(lw), entries)
    if corrupt:
        p = lw / corrupt
        st = p.stat()
        p.write_bytes(b"Z" * st.st_size)  # same size and mtime: the quick check is fooled
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    todos = {}
    for n in targets:
        items = entries + sync.rendered({"rank_table.json": b'{"n": 2}', f"only-{n}": n.encode()})
        todos[n] = (_ssh_host(n), list(own[1:]) if same else [(e, "send") for e in items])
    res, req = _run_relay(tmp_path, own, todos, targets, timeout=timeout, open_files=open_files)
    assert res.ok, res.err
    assert [t["raw"] for t in req["targets"]] == [same] * len(targets)
    return json.loads(res.out), req, {n: tmp_path / f"w-{n}" for n in targets}


def _run_relay(tmp_path, own, todos, argvs, *, timeout=60.0, open_files=None, run_timeout=None):
    """cmd_relay run here (the launch host's workdir `launch`) as `orch up` asks it (sync._relay:
    `own` ordered by raw_order, then relay_request), each target into w-NAME by its argv prefix
    `argvs[NAME]`; `open_files`: the relay's limit of open files (ulimit -n); `run_timeout`: the
    run's own limit. (its Result, the request)."""
    own, raw = sync.raw_order(own, todos)
    req = sync.relay_request(_ssh_host("h0"), str(tmp_path / "launch"), todos, connect_timeout=3, timeout=timeout,
                             own=own, raw=raw)
    for t in req["targets"]:
        t.update(argv=argvs[t["name"]], workdir=str(tmp_path / f"w-{t['name']}"))
    req["ssh_options"] = []
    argv = sync._receiver_argv("relay", str(tmp_path / "launch"))
    if open_files:
        argv = ["sh", "-c", f'ulimit -n {open_files} && exec "$@"', "sh", *argv]
    return Counting().run(argv, stdin=sync._Frames(own, json.dumps(req).encode() + b"\n"), timeout=run_timeout), req


def test_relay_request_names_each_entry_once_and_reaches_hosts_as_mpirun_does():
    a = Host(name="a", address="10.0.0.1", user="train", connection="ssh")
    b = Host(name="b", address="10.0.0.2", user="other", port=2222, mpi_address="192.168.0.2", connection="ssh")
    c = Host(name="c", address="10.0.0.3", user="train", connection="ssh")
    same = sync.rendered({"rank_table.json": b"{}"})
    file = sync.Entry("x.py", "file", 0o644, 3, 5, data=None, sha256="ab" * 32)
    req = sync.relay_request(a, "/data/w", {"b": (b, [(file, "send"), (same[0], "send")]),
                                            "c": (c, [(file, "chmod"), (same[0], "send")])},
                             connect_timeout=4.2, timeout=99)
    assert len(req["entries"]) == 2 and len(req["blobs"]) == 1
    tb, tc = req["targets"]
    assert tb["argv"] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=4", "-p", "2222", "-l", "other",
                          "192.168.0.2"]
    assert tc["argv"][-1] == "10.0.0.3" and "-l" not in tc["argv"]
    assert tb["items"] == [[0, "send"], [1, "send"]] and tc["items"] == [[0, "chmod"], [1, "send"]]
    assert req["entries"][0][5] == "ab" * 32 and tb["workdir"] == "/data/w" and req["timeout"] == 99
    # the launch host's mesh test left its connections open (probes.mesh_shared): the relay's ssh shares them
    shared = sync.relay_request(a, "/data/w", {"c": (c, [(file, "send")])}, connect_timeout=4.2, timeout=99,
                                share="/tmp/orch-ssh-1000/ab12cd34-%C")
    assert shared["targets"][0]["argv"] == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=4", "-o",
                                            "ControlPath=/tmp/orch-ssh-1000/ab12cd34-%C", "10.0.0.3"]


def test_hosts_that_lack_what_the_launch_host_lacks_get_its_stream_as_it_came(monkeypatch):
    """raw_order: what most hosts lack, when the launch host lacks it all too, comes first in the
    launch host's stream, what only it lacks after; those hosts get that part as it came (raw):
    the request lists nothing for them, and files only they want are not followed one by one
    (incoming). Not raw: a host that lacks anything else, or more than RAW_MOST bytes."""
    a, b, c, d = _ssh_host("a"), _ssh_host("b"), _ssh_host("c"), _ssh_host("d")
    hostfile = sync.rendered({"hostfile": b"a slots=1\n"})[0]
    x = sync.Entry("x.py", "file", 0o644, 3, 5, sha256="ab" * 32)
    y = sync.Entry("y.py", "file", 0o644, 4, 6, sha256="cd" * 32)
    own = [(hostfile, "send"), (x, "send"), (y, "send")]
    todos = {"b": (b, [(x, "send"), (y, "send")]), "c": (c, [(x, "send"), (y, "chmod")]),
             "d": (d, [(x, "send"), (y, "send")])}
    ordered, raw = sync.raw_order(own, todos)
    assert ordered == [(x, "send"), (y, "send"), (hostfile, "send")] and raw == 2
    req = sync.relay_request(a, "/w", todos, connect_timeout=3, timeout=9, own=ordered, raw=raw)
    tb, tc, td = req["targets"]
    assert tb["raw"] and td["raw"] and tb["items"] == td["items"] == [] and req["raw"] == 2
    assert not tc["raw"] and tc["items"] == [[0, "send"], [1, "chmod"]]
    assert [e[0] for e in req["entries"]] == ["x.py", "y.py"] and req["incoming"] == ["x.py"]
    # y is sent to c as a chmod only: the launch host's copy of y is not followed for it
    assert sync.raw_order(own, {"b": (b, [(x, "send"), (y, "send")]), "c": (c, [(x, "chmod")])}) == (ordered, 2)
    assert sync.raw_order(own, {"b": (b, [(x, "chmod")])}) == (own, 0)   # the launch host lacks no chmod of x
    # the most hosts' todo, not the first met
    assert sync.raw_order(own, {"b": (b, [(y, "send")]), "c": (c, [(x, "send"), (y, "send")]),
                                "d": (d, [(x, "send"), (y, "send")])}) == (ordered, 2)
    # the most hosts' todo that the launch host lacks all of: not the commonest when it lacks less
    assert sync.raw_order(own, {"b": (b, [(x, "chmod")]), "c": (c, [(x, "chmod")]),
                                "d": (d, [(y, "send")])}) == ([(y, "send"), (hostfile, "send"), (x, "send")], 1)
    assert sync.raw_order([], {"b": (b, [(x, "send")])}) == ([], 0)
    assert sync.raw_order(own, {"b": (b, [])}) == (own, 0)
    monkeypatch.setattr(sync, "RAW_MOST", 6)
    assert sync.raw_order(own, todos) == (own, 0)
    monkeypatch.setattr(sync, "RAW_MOST", 7)
    assert sync.raw_order(own, todos)[1] == 2


def test_relayed_only_through_an_ssh_launch_host_to_ssh_hosts():
    a, b = _ssh_host("a"), _ssh_host("b")
    here = Host(name="l", address="localhost", user="u", connection="local")
    assert sync.relayed([a, b, here], a, "launch-host") == [b]
    assert sync.relayed([a, b], a, "controller") == []
    assert sync.relayed([here, a, b], here, "launch-host") == []


WAYS = {"from-its-copy": {}, "as-it-arrives": {"through": True}, "its-own-stream": {"same": True}}


@pytest.mark.parametrize("way", WAYS)
def test_the_relay_passes_the_tree_on_identical_and_checked(tmp_path, way):
    files = {"pkg/a.py": "a" * 5000, "pkg/sub/b.bin": os.urandom(1_500_000).hex()}  # every block differs
    os.chmod(tree(tmp_path / "src", {"pkg/run.sh": "#!/bin/sh\n"}) / "pkg" / "run.sh", 0o750)
    answer, _, dirs = _relay(tmp_path, files, {"h1": ["sh", "-c"], "h2": ["sh", "-c"]}, **WAYS[way])
    assert answer["written"] == {"from-its-copy": 0, "as-it-arrives": 6, "its-own-stream": 8}[way]
    assert (tmp_path / "launch" / "hostfile").exists() == (way == "its-own-stream")
    assert answer["bad"] == {}
    assert set(answer["targets"]) == {"h1", "h2"} and all(r["rc"] == 0 for r in answer["targets"].values())
    for n, w in dirs.items():
        for rel, text in files.items():
            assert (w / rel).read_text() == text
            assert (w / rel).stat().st_mtime_ns == (tmp_path / "src" / rel).stat().st_mtime_ns
        assert stat.S_IMODE((w / "pkg" / "run.sh").stat().st_mode) == 0o750
        assert os.readlink(w / "pkg" / "l.py") == "a.py"
        assert (w / "rank_table.json").read_bytes() == b'{"n": 2}'
        assert (w / f"only-{n}").exists() != (way == "its-own-stream") and not (w / "hostfile").exists()
        assert not list(w.rglob(".orch-sync-partial.*"))
    assert (tmp_path / "launch" / "pkg" / "sub" / "b.bin").read_text() == files["pkg/sub/b.bin"]
    assert sync.relay_errors(_ssh_host("h0"), {n: (_ssh_host(n), []) for n in dirs}, answer, "/w", 60) == {}


@pytest.mark.parametrize("way", WAYS)
def test_the_relay_passes_on_more_files_than_it_may_hold_open(tmp_path, way):
    """A launch host whose limit of open files (ulimit -n: 1024 is common) is below the number of
    files it passes on: each is held open only while it arrives and is passed on."""
    files = {f"pkg/m{i}.py": f"m{i}\n" * 50 for i in range(300)}
    answer, _, dirs = _relay(tmp_path, files, {"h1": ["sh", "-c"], "h2": ["sh", "-c"]}, **WAYS[way],
                             open_files=64)
    assert answer["bad"] == {} and all(r["rc"] == 0 for r in answer["targets"].values()), answer
    for w in dirs.values():
        assert {p.name: p.read_text() for p in (w / "pkg").glob("m*.py")} == \
            {rel.split("/")[1]: text for rel, text in files.items()}


def test_hosts_that_get_the_stream_as_it_came_and_hosts_that_get_it_file_by_file_in_one_relay(tmp_path):
    """One host lacks what the launch host lacks but its big file, another that and a file of its
    own, a third dies early: each gets what it lacks (the first two), the third's end is told,
    and the launch host keeps (spools) only the part of its stream the first one gets."""
    tree(tmp_path / "src", {"pkg/a.py": "a" * 5000, "pkg/b.py": "b" * 7000})
    (tmp_path / "src" / "big.bin").write_bytes(os.urandom(600_000))
    entries = sync.manifest(tmp_path / "src", ("pkg", "big.bin"), "c.yaml")
    big = [e for e in entries if e.rel == "big.bin"]
    lack = [(e, "send") for e in entries if e.rel != "big.bin"]
    own = [(e, "send") for e in entries]
    todos = {"raw": (_ssh_host("raw"), lack), "dies": (_ssh_host("dies"), list(lack)),
             "odd": (_ssh_host("odd"), lack + [(e, "send") for e in sync.rendered({"only-odd": b"odd"})])}
    res, req = _run_relay(tmp_path, own, todos, {
        "raw": ["sh", "-c"], "odd": ["sh", "-c"],
        "dies": ["sh", "-c", "head -c 100 >/dev/null; echo gone >&2; exit 3 # $0"]})
    assert res.ok, res.err
    answer = json.loads(res.out)
    assert [t["raw"] for t in req["targets"]] == [True, True, False] and big
    got = answer["targets"]
    assert got["raw"]["rc"] == 0 and got["odd"]["rc"] == 0 and got["dies"]["rc"] == 3, got
    for n in ("raw", "odd"):
        w = tmp_path / f"w-{n}"
        assert (w / "pkg" / "a.py").read_text() == "a" * 5000 and (w / "pkg" / "b.py").read_text() == "b" * 7000
        assert not (w / "big.bin").exists() and (w / "only-odd").exists() == (n == "odd")
    assert (tmp_path / "launch" / "big.bin").read_bytes() == (tmp_path / "src" / "big.bin").read_bytes()
    errs = sync.relay_errors(_ssh_host("h0"), todos, answer, "/w", 60)
    assert set(errs) == {"dies"} and "gone" in str(errs["dies"])
    # the spool: the frames of what the raw hosts lack, not the big file after them
    kept = len(sync._Frames(lack).read()) - len(sync._header(kind="end"))
    assert answer["spooled"] == kept < 600_000


def test_the_launch_hosts_copy_is_checked_before_it_is_passed_on(tmp_path):
    """A launch-host file that is not what the controller listed (same size and mtime) is
    reported, and nothing is passed on."""
    answer, _, dirs = _relay(tmp_path, {"pkg/a.py": "a" * 5000}, {"h1": ["sh", "-c"]}, corrupt="pkg/a.py")
    assert answer["bad"] == {"pkg/a.py": "its sha256 is not the controller's (5000 bytes here, 5000 sent)"}
    assert answer["targets"] == {}
    assert not dirs["h1"].exists()


def test_damage_on_the_way_and_a_failing_hop_name_the_hop(tmp_path):
    """Bytes changed between the launch host and a host: that host's receiver refuses them
    (checked against the controller's sha256), keeps nothing, and the error names the hop; an
    ssh that cannot log in names it and what to do; a stuck host is stopped at the deadline."""
    answer, req, dirs = _relay(tmp_path, {"pkg/a.py": "q" * 5000}, {
        "bad": ["sh", "-c", 'tr q x | sh -c "$0"'],  # the remote command is $0; no q in the frames' headers
        "noauth": ["sh", "-c", "echo 'Permission denied (publickey).' >&2; exit 255"],
        "good": ["sh", "-c"]}, timeout=60)
    todos = {n: (_ssh_host(n), []) for n in dirs}
    errs = sync.relay_errors(_ssh_host("h0"), todos, answer, str(tmp_path / "w-bad"), 60)
    assert set(errs) == {"bad", "noauth"}
    assert str(errs["bad"]).startswith(f"bad: sync h0 -> bad (job.sync_via: launch-host): cannot write "
                                       f"{tmp_path}/w-bad/pkg/a.py: sha256 mismatch")
    assert not (dirs["bad"] / "pkg" / "a.py").exists() and not list(dirs["bad"].rglob(".orch-sync-partial.*"))
    assert "ssh from h0 failed: Permission denied (publickey)." in str(errs["noauth"])
    assert "job.sync_via: controller" in str(errs["noauth"])
    assert (dirs["good"] / "pkg" / "a.py").read_text() == "q" * 5000


@pytest.mark.parametrize("way", WAYS)
def test_a_stuck_host_is_stopped_at_the_relays_deadline(tmp_path, way):
    # the stream more than a pipe holds: the relay's write to a host that reads nothing blocks
    answer, _, dirs = _relay(tmp_path, {"pkg/a.py": "a" * 300_000}, {"stuck": ["sh", "-c", "sleep 600 # $0"]},
                             timeout=0.5, **WAYS[way])
    assert answer["targets"]["stuck"]["expired"]
    errs = sync.relay_errors(_ssh_host("h0"), {"stuck": (_ssh_host("stuck"), [])}, answer, "/w", 0.5)
    assert "not done within 0.5s (stopped)" in str(errs["stuck"])


def test_a_launch_host_that_cannot_keep_its_own_stream_stops_passing_it_on_at_once(tmp_path):
    """The launch host's own copy fails there (a file where a directory goes), its stream whole:
    the hosts that get that stream as it came ("raw") are cut off at once, not at the relay's
    deadline (300 s here; the run is given 60), and keep nothing of what followed."""
    src = tree(tmp_path / "src", {"pkg/a.py": "a" * 5000, "pkg/sub/b.bin": "b" * 400_000})
    own = [(e, "send") for e in sync.manifest(src, ("pkg",), "c.yaml")]
    (tmp_path / "launch" / "pkg").mkdir(parents=True)
    (tmp_path / "launch" / "pkg" / "sub").write_text("in the way")
    res, req = _run_relay(tmp_path, own, {"h1": (_ssh_host("h1"), list(own))}, {"h1": ["sh", "-c"]},
                          timeout=300, run_timeout=60)
    assert req["targets"][0]["raw"]
    assert res.exit_code == 43 and "not a directory orch made" in res.err, (res.exit_code, res.err)
    assert not (tmp_path / "w-h1" / "pkg" / "sub").exists()
    assert not list((tmp_path / "w-h1").rglob(".orch-sync-partial.*"))


@pytest.mark.parametrize("raw", [False, True], ids=["file-by-file", "as-it-came"])
def test_a_damaged_stream_to_the_launch_host_is_passed_on_to_nobody(tmp_path, raw):
    """The launch host's own stream damaged on the way (one byte of a file it passes on as it
    arrives): the launch host refuses it (exit 43), and no host keeps the file."""
    src = tree(tmp_path / "src", {"pkg/b.bin": "b" * 3_000_000})
    entries = sync.manifest(src, ("pkg",), "c.yaml")
    own = [(e, "send") for e in entries]
    req = sync.relay_request(_ssh_host("h0"), str(tmp_path / "launch"), {"h1": (_ssh_host("h1"), own)},
                             connect_timeout=3, timeout=60, own=own, raw=len(own) if raw else 0)
    assert req["targets"][0]["raw"] == raw
    req["targets"][0].update(argv=["sh", "-c"], workdir=str(tmp_path / "w-h1"))
    req["ssh_options"] = []
    data = bytearray(sync._Frames(own, json.dumps(req).encode() + b"\n").read())
    at = data.index(b"b" * 1000) + 2_000_000
    data[at] = ord("c")
    res = Counting().run(sync._receiver_argv("relay", str(tmp_path / "launch")), stdin=bytes(data))
    assert res.exit_code == 43 and "sha256 mismatch" in res.err, (res.exit_code, res.err)
    for w in ("launch", "w-h1"):
        assert not (tmp_path / w / "pkg" / "b.bin").exists() and not list((tmp_path / w).rglob(".orch-sync-partial.*"))


# --------------------------------------------------------------------------- the listing in up's probe


def _probe_listing(work: Path, request) -> dict | None:
    """The probe section's shell run here, as the probe runs it (no `timeout`: T empty)."""
    out = subprocess.run(["sh", "-c", "T=\n" + sync.listing_script(str(work), request)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return sync.parse_listing(request, "login banner\n" + out.stdout)


def test_the_listing_runs_the_list_alone_not_the_whole_receiver(tmp_path):
    """Every host lists in every `orch up`: python compiles a `-c` program on each start, so the
    listing sends the receiver's `list` part alone (LISTER), and lists what RECEIVER lists."""
    assert "def cmd_recv" not in sync.LISTER and "def cmd_list" in sync.LISTER
    assert len(sync.LISTER) * 3 < len(sync.RECEIVER)
    assert sync.LISTER in sync.listing_script("/data/w", (("a", False),))
    (tmp_path / "a").write_text("x")
    (tmp_path / "h").write_text("hostfile\n")
    request = (("a", False), ("h", True), ("nothing", False))
    req = sync.list_input(request)
    said = [subprocess.run([sys.executable, "-S", "-c", prog, "list", str(tmp_path)], input=req, capture_output=True,
                           text=True, timeout=60).stdout for prog in (sync.LISTER, sync.RECEIVER)]
    assert said[0] == said[1] and sync.parse_listing(request, said[0])["h"][4] == \
        hashlib.sha256(b"hostfile\n").hexdigest()
    # its sha256 is CPython's own, not hashlib's (which loads OpenSSL: ~3 ms on every host), and it
    # imports no json (json's import is re's and its compiled patterns: ~7 ms on every host)
    (tmp_path / "lister.py").write_text(sync.LISTER)
    probe = (f"import sys\nsys.argv = ['-c', 'list', {str(tmp_path)!r}]\n"
             f"exec(compile(open({str(tmp_path / 'lister.py')!r}).read(), 'lister', 'exec'))\n"
             "print(sorted({'hashlib', 'json', 're'} & set(sys.modules)), file=sys.stderr)")
    got = subprocess.run([sys.executable, "-S", "-c", probe], input=req, capture_output=True, text=True, timeout=60)
    assert got.stderr == "[]\n" and got.stdout == said[0], got.stderr


def test_the_listing_carries_any_name_a_file_can_have(tmp_path):
    """The request and the answer are lines: a name with a newline, a space, a backslash, a
    non-UTF-8 byte, a name like the answer's header or the here-document's delimiter, and a link
    to such a name, all come back as what they are, through the probe's shell as through stdin."""
    names = ["plain.py", "with space.py", "new\nline.py", "back\\slash", "tab\tx", "caf\u00e9.py",
             os.fsdecode(b"latin1-\xe9.py"), "ORCH_LIST_END", "orch:list 1", "- x"]
    for n in names:
        (tmp_path / n).write_bytes(n.encode("utf-8", "surrogateescape"))
    (tmp_path / "sub").mkdir(mode=0o750)
    (tmp_path / "sub").chmod(0o750)
    os.symlink(names[2], tmp_path / "sub" / "ln")
    request = tuple((n, i % 2 == 1) for i, n in enumerate(names)) + (("sub", False), ("sub/ln", False),
                                                                      ("missing\nfile", True))
    got = _probe_listing(tmp_path, request)
    assert got is not None
    for i, n in enumerate(names):
        st = os.stat(tmp_path / n)
        want = hashlib.sha256(n.encode("utf-8", "surrogateescape")).hexdigest() if i % 2 == 1 else None
        assert got[n] == ["file", st.st_size, st.st_mtime_ns, stat.S_IMODE(st.st_mode), want], n
    assert got["sub"][:1] == ["dir"] and got["sub"][3] == 0o750
    assert got["sub/ln"][0] == "link" and got["sub/ln"][4] == names[2]
    assert got["missing\nfile"] is None
    res = Counting().run(sync._receiver_argv("list", str(tmp_path)),
                         stdin=sync.list_input(request).encode("utf-8", "surrogateescape"))
    assert sync.parse_listing(request, res.out) == got


def test_listing_request_lists_paths_by_stat_and_rendered_files_by_sha256_once():
    es = [sync.Entry("pkg", "dir", 0o755, 0, 0), sync.Entry("pkg/a.py", "file", 0o644, 3, 5)]
    assert sync.listing_request(es, ("rank_table.json", "hostfile", "hostfile")) == (
        ("pkg", False), ("pkg/a.py", False), ("hostfile", True), ("rank_table.json", True))


def test_set_aside_leaves_out_what_lands_where_orch_writes_its_own_file():
    """A synced path named like a file orch renders in the workdir (a hostfile, a rank table), and
    all under it when it is a directory, is not synced; the same name deeper down, or a name that
    only begins like it, is."""
    E = sync.Entry
    es = [E("hostfile", "dir", 0o755), E("pkg", "dir", 0o755), E("hostfile/a", "file"), E("hostfile.bak", "file"),
          E("pkg/hostfile", "file"), E("rank_table.json", "link", 0o777, target="x"), E("rank_table.jsonx", "file")]
    keep, out = sync.set_aside(es, ("hostfile", "rank_table.json"))
    assert [e.rel for e in keep] == ["pkg", "hostfile.bak", "pkg/hostfile", "rank_table.jsonx"]
    assert [e.rel for e in out] == ["hostfile", "rank_table.json"]   # (hostfile/a: under one)
    assert sync.set_aside_message(out) == (
        "job.sync: hostfile/, rank_table.json not synced: orch writes the launch's own files of those names in "
        "job.workdir (to keep this quiet: rename yours, or leave them out of job.sync, or add /hostfile, "
        "/rank_table.json to job.sync_exclude)")
    assert sync.set_aside(es, ()) == (es, []) and sync.set_aside_message([]) is None
    # a name deeper down (no launcher renders one today), and one path met twice (job.sync: [., hostfile])
    keep, out = sync.set_aside(es + [E("hostfile", "file")], ("pkg/hostfile",))
    assert [e.rel for e in out] == ["pkg/hostfile"]
    assert sync.set_aside_message(out).startswith("job.sync: pkg/hostfile not synced: ")
    assert sync.set_aside_message([E("hostfile", "file"), E("hostfile", "file")]).startswith(
        "job.sync: hostfile not synced: ")


def test_job_manifest_leaves_out_the_launchers_own_files(tmp_path):
    """What `orch up` syncs (job_manifest) is what set_aside keeps of job.sync for the cluster's
    launcher: with mpirun a top-level hostfile is left out (job_files says so), with torchrun
    (nothing rendered) it is synced."""
    (tmp_path / "hostfile").write_text("h slots=1\n")
    (tmp_path / "a.py").write_text("a\n")
    c = load_cluster(_write_cluster(tmp_path, "mpirun"))
    assert [e.rel for e in sync.job_manifest(c)] == ["a.py", "cluster.yaml"]
    assert [e.rel for e in sync.job_files(c)[1]] == ["hostfile"]
    c = load_cluster(_write_cluster(tmp_path, "torchrun"))
    assert [e.rel for e in sync.job_manifest(c)] == ["a.py", "cluster.yaml", "hostfile"]
    assert sync.job_files(c)[1] == []


def _write_cluster(d, launcher):
    p = d / "cluster.yaml"
    p.write_text("inventory: {hosts: [{address: 127.0.0.1, connection: local}]}\n"
                 f"job: {{workdir: /tmp/nowhere, launcher: {launcher}, sync: [.], command: [\"true\"]}}\n")
    return p


def test_parse_listing_takes_only_a_whole_answer():
    req = (("a", False), ("b", True), ("l", False))
    whole = "orch:list 3\n-\nfile 1 2 420 ab\nlink 3 4 511 2e2e2f78\n"
    assert sync.parse_listing(req, "motd orch:list\n" + whole) == {
        "a": None, "b": ["file", 1, 2, 420, "ab"], "l": ["link", 3, 4, 511, "../x"]}
    assert sync.parse_listing(req, "orch:list 3\n-\nfile 1 2 420 ab\n") is None   # cut short
    assert sync.parse_listing(req, "orch:list 2\n-\nfile 1 2 420 ab\n") is None   # another request's
    assert sync.parse_listing(req, "orch:list 3\n-\nfile 1\nfile 1 2 420 -\n") is None   # not a record
    assert sync.parse_listing(req, "orch:list 3\n-\nfile 1 2 420 ab\nlink 3 4 511 zz\n") is None
    assert sync.parse_listing(req, "orch:list 3\n-\nfile 1 2 420 ab\nfifo 3 4 511 -\n") is None
    assert sync.parse_listing(req, "orch:list 3\n-\nfile 1 2 4") is None          # cut off mid-line
    assert sync.parse_listing(req, whole[:-3]) is None            # cut in its last field (still five)
    assert sync.parse_listing(req, "python3: not found\n") is None
    assert sync.parse_listing((), "orch:list 0\n") == {}


def test_the_probes_listing_spares_syncs_own_round_trip_and_a_stale_one_never_writes_a_wrong_file(tmp_path):
    src = tree(tmp_path / "src", {"pkg/a.py": "a = 1\n", "pkg/b.py": "b = 1\n"})
    work = tmp_path / "work"
    entries = sync.manifest(src, ("pkg",), "c.yaml")
    req = sync.listing_request(entries, ("hostfile",))
    # nothing there yet: all missing, and the probe made nothing
    listed = _probe_listing(work, req)
    assert listed == {rel: None for rel, _ in req} and not work.exists()
    t = Counting()
    rep = sync.sync_host(t, str(work), entries, {"hostfile": b"h1\n"}, listed=listed)
    assert t.runs == 1 and sorted(rep.copied) == ["pkg/a.py", "pkg/b.py"]  # the stream only
    # up to date: no round trip at all
    listed = _probe_listing(work, req)
    t.runs = 0
    rep = sync.sync_host(t, str(work), entries, {"hostfile": b"h1\n"}, listed=listed)
    assert t.runs == 0 and rep.copied == () and (work / "hostfile").read_bytes() == b"h1\n"
    # a rendered file is compared by content
    rep = sync.sync_host(t, str(work), entries, {"hostfile": b"h2\n"}, listed=listed)
    assert t.runs == 1 and (work / "hostfile").read_bytes() == b"h2\n"
    # edited here between the probe and the sync (same size): sent, by the sync's own manifest
    (src / "pkg" / "a.py").write_text("a = 2\n")
    os.utime(src / "pkg" / "a.py", ns=(10**9, 10**9))
    t.runs = 0
    rep = sync.sync_host(t, str(work), sync.manifest(src, ("pkg",), "c.yaml"), {"hostfile": b"h2\n"}, listed=listed)
    assert t.runs == 1 and rep.copied == ("pkg/a.py",) and (work / "pkg" / "a.py").read_text() == "a = 2\n"
    # a path added since the probe: the host is asked in a round trip of its own
    (src / "pkg" / "c.py").write_text("c = 1\n")
    t.runs = 0
    rep = sync.sync_host(t, str(work), sync.manifest(src, ("pkg",), "c.yaml"), {"hostfile": b"h2\n"}, listed=listed)
    assert t.runs == 2 and rep.copied == ("pkg/c.py",) and (work / "pkg" / "c.py").read_text() == "c = 1\n"


def test_a_listing_that_says_the_host_has_the_file_when_it_does_not_costs_a_resend_not_a_wrong_file(tmp_path):
    # the host's copy changed after the probe listed it: what the listing says about it is stale;
    # a file that is sent is checked by sha256 there, and the next sync (asked again) mends it
    src = tree(tmp_path / "src", {"a.py": "a = 1\n"})
    work = tmp_path / "work"
    entries = sync.manifest(src, ("a.py",), "c.yaml")
    t = Counting()
    sync.sync_host(t, str(work), entries)
    listed = _probe_listing(work, sync.listing_request(entries))
    (work / "a.py").unlink()
    (src / "a.py").write_text("a = 3\n")
    rep = sync.sync_host(t, str(work), sync.manifest(src, ("a.py",), "c.yaml"), listed=listed)
    assert rep.copied == ("a.py",) and (work / "a.py").read_text() == "a = 3\n"


@pytest.mark.parametrize("answer", ['[["file", 1, 2]]', '[5]', '[null, null]', 'not json', '{"a": 1}'])
def test_a_garbled_listing_from_the_round_trip_is_an_error_naming_the_host_never_a_traceback(tmp_path, answer):
    """The listing round trip's answer is read as the probe's is (parse_listing): a record that is
    not the receiver's five fields, a wrong count or no JSON is one HostError naming the host."""
    from orchestrator.transport.base import Result

    class Garbled(Counting):
        def run(self, *a, **k):
            return Result(self.host.name, "list", 0, answer.encode(), b"", 0.0)

    entries = sync.manifest(tree(tmp_path / "src", {"a.py": "x"}), ("a.py",), str(tmp_path / "c.yaml"))
    with pytest.raises(HostError, match="here.*unreadable answer from the sync receiver"):
        sync.sync_host(Garbled(), str(tmp_path / "wd"), entries)
