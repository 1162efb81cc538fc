"""Progress as the hosts' supervisors read it (agent.py and its package, this machine's python3):
ranks print, the head's document carries each rank's figures. No lab: loopback only."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tests.integration.test_agent_local import config, rank_proc, start, state, wait

PY = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
TRAIN = ("import sys, time\n"
         "n = int(sys.argv[1])\n"
         "for s in range(1, n + 1):\n"
         "    print('epoch: 1, step: %d, loss is %.4f top1=%.2f' % (s, 1.0 / s, s / 100.0), flush=True)\n"
         "sys.stdout.buffer.write(bytes(range(256)) * 64 + b'\\n')\n"   # hostile bytes at the end
         "sys.stdout.flush()\n"
         "time.sleep(float(sys.argv[2]))\n")


def test_each_ranks_progress_reaches_the_heads_document(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cfg = config(tmp_path, [rank_proc(0, [PY, str(script), "30", "30"]), rank_proc(1, [PY, str(script), "12", "30"])],
                 [0, 1])
    cfg["metrics"] = {"top1": r"top1=([0-9.]+)"}
    p = start(tmp_path, cfg)
    try:
        def both():
            prog = state(cfg).get("progress") or {}
            return prog.get("0", {}).get("step") == 30 and prog.get("1", {}).get("step") == 12
        wait(both)
        prog = state(cfg)["progress"]
        # the figures match the logs, read here on their own
        for r in (0, 1):
            log = (Path(cfg["rundir"]) / "a1" / "1" / f"rank.{r}" / "stdout").read_bytes().decode("latin-1")
            last = re.findall(r"step: (\d+), loss is ([0-9.]+) top1=([0-9.]+)", log)[-1]
            got = prog[str(r)]
            assert (got["step"], got["loss"], got["values"]["top1"]) == (int(last[0]), float(last[1]), float(last[2]))
            assert got["total"] == got["records"] == int(last[0])
        # and the host's load: both ranks' processes, sampled every few seconds (the first a second
        # after they started; their CPU from the second, a second later)
        wait(lambda: ((state(cfg).get("load") or {}).get("h1") or {}).get("cpu") is not None)
        h1 = state(cfg)["load"]["h1"]
        assert h1["procs"] == 2 and h1["mem_mib"] > 1 and 0 < h1["host_mem_pct"] < 100
    finally:
        p.terminate()
        p.wait(timeout=30)


SLOW = ("import os, sys, time\n"
        "rank = int(os.environ['RANK_ID'])\n"
        "for s in range(1, 100000):\n"
        "    if rank == 3 and s > 5:\n"
        "        time.sleep(5)\n"             # a straggler: slow steps
        "    if rank == 2 and s > 30:\n"
        "        time.sleep(300)\n"           # stops printing
        "    print('epoch: 1, step: %d, loss is %.4f' % (s, 1.0 / s), flush=True)\n"
        "    time.sleep(0.05)\n")


def test_orch_top_marks_a_slow_rank_and_a_silent_one(tmp_path, monkeypatch):
    """4 local ranks: rank 3 slows down, rank 2 stops printing; `orch top --json` marks both, the
    others not; in a pipe `orch top` prints plain lines."""
    import json
    import subprocess
    import time

    from orchestrator import top

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(SLOW)
    (tmp_path / "cluster.yaml").write_text(
        "inventory: {hosts: [{address: 127.0.0.1, connection: local, slots: 4}]}\n"
        f"job: {{workdir: {tmp_path}/wd, launcher: ranktable, command: [{PY}, {tmp_path}/train.py]}}\n")
    orch = [sys.executable, "-m", "orchestrator.cli"]
    up = subprocess.run(orch + ["up", "--detach", "--skip-checks"], capture_output=True, text=True, timeout=120)
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        deadline = time.monotonic() + 90
        while True:
            got = subprocess.run(orch + ["top", "--json"], capture_output=True, text=True, timeout=60)
            assert got.returncode == 0, got.stderr
            doc = json.loads(got.stdout)
            marks = {r["rank"]: r["straggler"] for r in doc["ranks"]}
            # the silent rank's mark needs top.SILENT (30 s) of silence: judged below on these
            # figures with time running 5 times faster
            since = [r["since"] if r["since"] is not None else 99 for r in doc["ranks"]]
            if marks.get(3) and since[2] >= 6.5 and since[0] < 2 and since[1] < 2:
                break
            assert time.monotonic() < deadline, doc
            time.sleep(1)
        assert marks[0] is None and marks[1] is None and "lagging" in marks[3], marks
        assert doc["ranks"][2]["step"] == 30, doc["ranks"][2]
        plain = subprocess.run(orch + ["top"], capture_output=True, text=True, timeout=60)
        assert plain.returncode == 0 and "\x1b" not in plain.stdout
        assert plain.stdout.splitlines()[1].startswith("rank ") and "STRAGGLER" in plain.stdout
        # the silent rank: the same figures, time 5 times faster (silent 32 s+, the others under 10 s)
        from orchestrator.runstate import RunView
        v = RunView(state="running", ranks=[{"rank": r["rank"], "host": r["host"], "state": r["state"]}
                                            for r in doc["ranks"]],
                    progress={str(r["rank"]): {"total": 100, "out": time.time() - 5 * r["since"]}
                              for r in doc["ranks"]})
        assert "no output" in top.stragglers(v.ranks, v.progress, time.time())[2]
    finally:
        subprocess.run(orch + ["down"], capture_output=True, timeout=120)
