"""Scenario 12: logs are never lost or altered, however big, binary or long-lined, and the
controller streams them (bounded memory) instead of holding them."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support import ORCH, leftovers, orch, run_record, runs_dir, wait_until, write_fault_cluster

pytestmark = pytest.mark.lab

MB = 1 << 20
BIG_MB = int(os.environ.get("ORCH_FAULT_LOG_MB", "200"))
RSS_LIMIT_MB = 150  # far below the log's size: the controller must stream, not buffer

# Rank 0 writes: a line, one 1 MB line, BIG_MB of random binary (every byte value, NULs, CRs,
# invalid UTF-8), a last line without a newline. Deterministic, so the test computes it too.
GEN = """\
import random, sys, time
def blocks(mb):
    yield b"start\\n"
    yield b"L" * (1 << 20) + b"\\n"
    rnd = random.Random(7)
    for i in range(mb):
        yield rnd.randbytes(1 << 20)
    yield b"\\nend without newline"
"""
RANK_PY = GEN + """
import os
if os.environ.get("RANK_ID") == "0":
    out = sys.stdout.buffer
    half = int(os.environ["BIG_MB"]) // 2
    for i, b in enumerate(blocks(int(os.environ["BIG_MB"]))):
        out.write(b)
        out.flush()
        if i % 8 == 0:
            time.sleep(0.02)
        if i == half and os.environ.get("GATE"):  # wait (bounded) until the test saw the copy grow
            for _ in range(2400):
                if os.path.exists("seen-growing"):
                    break
                time.sleep(0.05)
else:
    print("small rank", os.environ.get("RANK_ID"))
"""


def _expected(mb: int) -> tuple[str, int, bytes]:
    ns: dict = {}
    exec(GEN, ns)
    h, n, last = hashlib.sha256(), 0, b""
    for b in ns["blocks"](mb):
        h.update(b)
        n += len(b)
        last = (last + b)[-4 * MB:]
    return h.hexdigest(), n, last


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(MB), b""):
            h.update(block)
    return h.hexdigest()


def measured(args, cwd: Path, out: Path, timeout: float = 300) -> tuple[int, float]:
    """Run `orch ARGS` with stdout to `out`; return (exit code, its peak RSS in MB). A fresh
    python measures it, so RUSAGE_CHILDREN holds that one orch process and nothing else."""
    probe = ("import resource, subprocess, sys\n"
             "rc = subprocess.call(sys.argv[2:], stdout=open(sys.argv[1], 'wb'))\n"
             "print(rc, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", probe, str(out), *ORCH, *map(str, args)], cwd=cwd,
                         capture_output=True, timeout=timeout, text=True)
    rc, kb = res.stdout.split()
    return int(rc), int(kb) / 1024


@pytest.fixture(scope="module")
def llab(fx_lab):
    return fx_lab("g", 1)


@pytest.fixture(scope="module")
def expected():
    return _expected(BIG_MB)


def test_huge_binary_log_is_gathered_byte_exact_incrementally_in_bounded_memory(llab, tmp_path, expected):
    """Scenario 12. 200 MB of binary output with a 1 MB line from one rank reaches the
    controller byte-exact (sha256 equal): in the gathered log, in what `orch up` streams to
    stdout while the job runs (the log grows on the controller before the job ends), and in
    `orch logs --rank 0`; `--tail 2` gives exactly the last two lines. Each of these orch
    processes peaks far below the log's size (< 150 MB RSS): logs are streamed, never held."""
    digest, size, last = expected
    write_fault_cluster(llab, tmp_path, workdir="/data/fx-biglog", launcher="ranktable", command="python3 rank.py",
                        sync=["rank.py"], env={"BIG_MB": str(BIG_MB), "GATE": "1"})
    (tmp_path / "rank.py").write_text(RANK_PY)
    llab.exec(1, ["rm", "-f", "/data/fx-biglog/seen-growing"])
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:  # the controller's copy, sampled while the job runs
        # Synchronised on a marker, not on time: rank 0 stops halfway until this has seen the
        # controller's copy of its log grow, so a loaded machine cannot race past it.
        while not done.is_set():
            for p in runs_dir(tmp_path).glob("*/logs/rank.0/stdout") if runs_dir(tmp_path).is_dir() else []:
                seen.append(p.stat().st_size)
                if 0 < seen[-1] < size:
                    llab.exec(1, ["touch", "/data/fx-biglog/seen-growing"])
                    return
            time.sleep(0.05)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        rc, rss = measured(["up", "--skip-checks"], tmp_path, tmp_path / "up.out")
    finally:
        done.set()
        t.join(5)
    took = time.monotonic() - t0
    print(f"orch up: {size / MB:.0f} MB in {took:.1f}s, peak RSS {rss:.0f} MB")
    assert rc == 0
    rec = run_record(tmp_path)
    gathered = runs_dir(tmp_path) / rec["id"] / "logs" / "rank.0" / "stdout"
    assert gathered.stat().st_size == size and _sha(gathered) == digest
    assert _sha(tmp_path / "up.out") == digest, "what orch up streamed differs from the rank's bytes"
    assert any(0 < s < size for s in seen), "the log was not gathered while the job ran"
    assert rss < RSS_LIMIT_MB, f"orch up peaked at {rss:.0f} MB for a {size / MB:.0f} MB log"

    rc, rss = measured(["logs", "--rank", "0"], tmp_path, tmp_path / "logs.out")
    print(f"orch logs --rank 0: peak RSS {rss:.0f} MB")
    assert rc == 0 and _sha(tmp_path / "logs.out") == digest
    assert rss < RSS_LIMIT_MB, f"orch logs --rank 0 peaked at {rss:.0f} MB"
    rc, rss = measured(["logs", "--rank", "0", "--tail", "2"], tmp_path, tmp_path / "tail.out")
    assert rc == 0 and rss < RSS_LIMIT_MB
    cut = last.rfind(b"\n", 0, last.rfind(b"\n"))  # lines end at \n, as for tail(1); the last has none
    want = last[cut + 1:]
    assert (tmp_path / "tail.out").read_bytes() == want
    rc, rss = measured(["logs"], tmp_path, tmp_path / "all.out")
    print(f"orch logs (every rank, prefixed): peak RSS {rss:.0f} MB")
    assert rc == 0 and rss < RSS_LIMIT_MB
    assert b"[rank 1] small rank 1\n" in (tmp_path / "all.out").read_bytes()
    assert leftovers(rec["id"]) == []


def test_huge_log_followed_after_detach_is_byte_exact_in_bounded_memory(llab, tmp_path, expected):
    """Scenario 12 (reattached). `orch up --detach`, then `orch logs -f --rank 0` follows the
    200 MB rank to its end: byte-exact, with the follower's RSS far below the log's size."""
    digest, size, _ = expected
    write_fault_cluster(llab, tmp_path, workdir="/data/fx-biglog-f", launcher="ranktable", command="python3 rank.py",
                        sync=["rank.py"], env={"BIG_MB": str(BIG_MB)})
    (tmp_path / "rank.py").write_text(RANK_PY)
    run_id = orch("up", "--detach", "--skip-checks", cwd=tmp_path, check_rc=0).stdout.decode().strip()
    rc, rss = measured(["logs", "-f", "--rank", "0", "--run", run_id], tmp_path, tmp_path / "follow.out")
    print(f"orch logs -f --rank 0: peak RSS {rss:.0f} MB")
    assert rc == 0
    assert _sha(tmp_path / "follow.out") == digest
    assert rss < RSS_LIMIT_MB, f"orch logs -f peaked at {rss:.0f} MB"
    assert wait_until(lambda: leftovers(run_id) == [], 30)


def test_a_full_controller_disk_is_said_and_a_later_logs_fetches_the_rest(fx_lab, tmp_path):
    """This machine's disk full while a run's logs (4 x 1 MB) come back: the job's success is
    reported with exit 5 and the hosts named, never exit 0 with no logs; `orch logs --rank 1`
    says the same (exit 5); once there is space it fetches the missing bytes, byte-exact. With
    no room even for run.json: the same exit 5 naming the file, never a crash."""
    lab = fx_lab("y", 2)
    cluster = write_fault_cluster(lab, tmp_path, workdir="/data/fx-fulldisk", launcher="ranktable",
                                  command=["python3", "-c", "import sys; sys.stdout.write('x' * 1000000)"])
    ctl = tmp_path / "ctl"
    ctl.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "orch-test-full", str(ctl)], check=True)
    try:
        err = orch("up", "-q", "--skip-checks", cluster, cwd=ctl, check_rc=5).stderr.decode()
        assert "succeeded" in err and "logs here are incomplete" in err and "No space left" in err, err
        assert "Traceback" not in err and "internal error" not in err
        err = orch("logs", "--rank", 1, cwd=ctl, check_rc=5).stderr.decode()
        assert "incomplete: the logs of" in err and lab.host(1).name in err, err
        subprocess.run(["mount", "-o", "remount,size=20m", str(ctl)], check=True)
        assert orch("logs", "--rank", 1, cwd=ctl, check_rc=0).stdout == b"x" * 1000000
        assert orch("logs", "--rank", 3, cwd=ctl, check_rc=0).stdout == b"x" * 1000000
        subprocess.run(["rm", "-rf", str(ctl / ".orch")], check=True)
        subprocess.run(["mount", "-o", "remount,size=8k", str(ctl)], check=True)
        err = orch("up", "-q", "--skip-checks", cluster, cwd=ctl, check_rc=5).stderr.decode()
        assert "cannot write" in err and "No space left" in err and "internal error" not in err, err
    finally:
        subprocess.run(["umount", "-l", str(ctl)], check=False)
