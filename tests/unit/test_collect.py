"""job.collect / orch collect (orchestrator/collect.py): paths, the stream's checks."""

from __future__ import annotations

import hashlib
import json

import pytest

from orchestrator import collect
from tests.unit.test_spec import problems


def frames(rel: str, data: bytes, sha: str | None = None, changed=False) -> bytes:
    return (b"J " + json.dumps({"file": rel, "size": len(data), "mtime_ns": 5}).encode() + b"\n"
            + b"B %d\n" % len(data) + data
            + b"J " + json.dumps({"end": rel, "sha256": sha or hashlib.sha256(data).hexdigest(),
                                  "changed": changed}).encode() + b"\n")


def test_a_file_is_put_in_place_only_when_its_hash_matches(tmp_path):
    book: dict = {}
    sink = collect._Sink(tmp_path / "h1", book, 0o644)
    stream = frames("ck/a.bin", b"x" * 3000) + frames("b.bin", b"yy", sha="0" * 64) + b'J {"same": "c"}\n'
    for i in range(0, len(stream), 7):          # in any pieces
        sink.write(stream[i:i + 7])
    assert (tmp_path / "h1" / "ck" / "a.bin").read_bytes() == b"x" * 3000
    assert not (tmp_path / "h1" / "b.bin").exists() and not list((tmp_path / "h1").glob(".*tmp"))
    assert sink.got.fetched == ["ck/a.bin"] and sink.got.same == 1 and "do not match" in sink.got.problems[0]
    assert book == {"ck/a.bin": [3000, 5, hashlib.sha256(b"x" * 3000).hexdigest()]}


def test_a_host_cannot_write_outside_its_directory(tmp_path):
    sink = collect._Sink(tmp_path / "h1", {}, 0o644)
    sink.write(frames("../../evil", b"x") + frames("/etc/x", b"y"))
    assert sink.got.fetched == [] and len(sink.got.problems) == 2
    assert not (tmp_path / "evil").exists() and list(tmp_path.rglob("*")) == []


def test_a_broken_stream_leaves_no_partial_file(tmp_path):
    sink = collect._Sink(tmp_path / "h1", {}, 0o644)
    sink.write(frames("a.bin", b"z" * 100)[:-40])
    sink.drop()
    assert [p for p in (tmp_path / "h1").rglob("*") if p.is_file()] == []


def test_a_file_changed_while_read_is_kept_but_fetched_again(tmp_path):
    book = {"a.bin": [1, 1, "old"]}
    sink = collect._Sink(tmp_path / "h1", book, 0o644)
    sink.write(frames("a.bin", b"new", changed=True))
    assert (tmp_path / "h1" / "a.bin").read_bytes() == b"new" and "a.bin" not in book


@pytest.mark.parametrize("path", ["", "../x", "/abs/x", "a/../../b", "a\nb"])
def test_bad_collect_paths(path):
    assert collect.path_problem(path)


def test_collect_paths_in_the_cluster_file_have_lines(tmp_path):
    probs = problems(tmp_path, """\
    inventory: {hosts: [{address: node1}]}
    job:
      workdir: /data/x
      command: python t.py
      collect: [checkpoints/*.ckpt, ../secrets]
    """)
    assert [(line, field) for line, field, _ in probs] == [(5, "job.collect[1]")], probs


def test_host_names_that_are_not_plain_get_a_directory_of_their_own():
    assert collect.host_dir("node01", 0) == "node01"
    assert collect.host_dir("../x", 3) == "node3" and collect.host_dir("..", 1) == "node1"
