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
    finally:
        p.terminate()
        p.wait(timeout=30)
