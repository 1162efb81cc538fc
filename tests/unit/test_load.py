"""A host's load (orchestrator/agent/load.py): the tools' parsers against captured outputs, the
/proc sampling of the run's processes, and the wire."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.agent import load, protocol
from orchestrator.agent.procs import run_pids

FIX = Path(__file__).resolve().parents[1] / "fixtures"


def test_nvidia_smi_query_csv_captures():
    h100 = load.parse_gpu_csv((FIX / "health" / "nvidia-smi-query-gpu-h100.csv").read_text())
    assert h100 == [{"id": "0", "util": 0.0, "mem_mib": 0.0, "mem_total_mib": 81559.0}]
    rtx = load.parse_gpu_csv((FIX / "health" / "nvidia-smi-query-gpu-rtx2080.csv").read_text())
    assert rtx == [{"id": "0", "util": 0.0, "mem_mib": 214.0, "mem_total_mib": 8192.0}]
    mig = load.parse_gpu_csv((FIX / "health" / "nvidia-smi-query-gpu-h100-mig.csv").read_text())
    assert [d["id"] for d in mig] == ["0"]
    # the query the sampler runs: only its four fields
    assert load.parse_gpu_csv("index, utilization.gpu [%], memory.used [MiB], memory.total [MiB]\n"
                              "0, 97 %, 70000 MiB, 81559 MiB\n1, 3 %, 1 MiB, 81559 MiB\n") == [
        {"id": "0", "util": 97.0, "mem_mib": 70000.0, "mem_total_mib": 81559.0},
        {"id": "1", "util": 3.0, "mem_mib": 1.0, "mem_total_mib": 81559.0}]


@pytest.mark.parametrize("text", ["", "nvidia-smi: command not found\n",
                                  "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
                                  "index\nx\n", "\x00\xff,,,\n" * 3])
def test_nvidia_smi_anything_else_is_no_device(text):
    assert load.parse_gpu_csv(text) == []


def test_npu_smi_info_captures():
    b3 = load.parse_npu_smi((FIX / "checks" / "npu-smi-info-910b.txt").read_text())
    assert [d["id"] for d in b3] == [f"{i}.0" for i in range(8)]
    assert b3[0] == {"id": "0.0", "util": 0.0, "mem_mib": 3378.0, "mem_total_mib": 65536.0}
    b1 = load.parse_npu_smi((FIX / "health" / "npu-smi-info-910b1.txt").read_text())
    assert [d["id"] for d in b1] == ["0.0", "1.0", "7.0"] and b1[2]["mem_mib"] == 4174.0   # the page elides 2-6
    a3 = load.parse_npu_smi((FIX / "npu-smi" / "info-a3.txt").read_text())
    assert a3[:2] == [{"id": "0.0", "util": 0.0, "mem_mib": 3376.0, "mem_total_mib": 65536.0},
                      {"id": "0.1", "util": 0.0, "mem_mib": 3376.0, "mem_total_mib": 65536.0}]
    assert len(a3) == 16
    warn = load.parse_npu_smi((FIX / "health" / "npu-smi-info-warning.txt").read_text())
    assert warn and all(d["mem_total_mib"] for d in warn)


def test_the_run_processes_cpu_and_memory_from_proc(tmp_path):
    run_id = f"LOADTEST-{os.getpid()}-{time.monotonic_ns()}"   # another run of this suite on the machine has its own
    env = dict(os.environ, ORCH_RUN_ID=run_id)
    # it says when it runs: just after its exec its resident memory is the loader's (0-0.4 MiB: 40 tries,
    # and 0.4 in a loaded CI run), not an interpreter's
    busy = subprocess.Popen([sys.executable, "-c", "import time\nprint(flush=True)\nt=time.time()\n"
                                                   "while time.time()-t<30: pass"], env=env, stdout=subprocess.PIPE)
    try:
        assert busy.stdout is not None and busy.stdout.readline() == b"\n"
        s = load.Sampler(run_id, str(tmp_path), run_pids)
        s.tools = []
        s.begin(1000.0 - load.FIRST_AFTER)
        assert s.tick(1000.0) and s.sample["procs"] == 1 and s.sample["cpu"] is None
        assert s.sample["mem_mib"] > 1 and 0 < s.sample["host_mem_pct"] < 100
        assert not s.tick(1000.5)    # not due yet (the second sample comes a second after the first)
        before = load.proc_usage(busy.pid)[0]
        while load.proc_usage(busy.pid)[0] - before < 0.2:
            time.sleep(0.05)
        assert s.tick(1000.0 + load.INTERVAL)
        assert s.sample["cpu"] > 0 and s.sample["procs"] == 1
    finally:
        busy.kill()
        busy.wait()


def test_no_sample_before_the_hosts_processes_start_the_first_a_second_after(tmp_path):
    """A sample reads every process's environment: none while the supervisors join and start
    their ranks (Local.start calls begin), the first FIRST_AFTER seconds after, the second a second
    after it, then every INTERVAL; a restart's begin brings nothing forward."""
    scans = []
    s = load.Sampler("NO-SUCH-RUN", str(tmp_path), lambda run_id: scans.append(run_id) or [])
    s.tools = []
    assert not s.tick(1000.0) and not s.tick(5000.0) and scans == [] and s.sample is None
    s.begin(5000.0)
    assert not s.tick(5000.0 + load.FIRST_AFTER / 2) and scans == []
    first = 5000.0 + load.FIRST_AFTER
    assert s.tick(first) and len(scans) == 1
    s.begin(first + 0.5)
    assert not s.tick(first + 0.5)
    assert s.tick(first + 1.0) and len(scans) == 2
    assert not s.tick(first + 1.0 + load.INTERVAL / 2)
    assert s.tick(first + 1.0 + load.INTERVAL) and len(scans) == 3


def test_a_tool_is_read_at_the_next_sample_without_waiting_for_it(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "nvidia-smi"
    tool.write_text("#!/bin/sh\nprintf 'index, utilization.gpu [%%], memory.used [MiB], memory.total [MiB]\\n"
                    "0, 55 %%, 100 MiB, 200 MiB\\n'\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    s = load.Sampler("NO-SUCH-RUN", str(tmp_path), run_pids)
    assert [t[0] for t in s.tools] == ["nvidia-smi"]
    s.begin(0.0)
    s.tick(1000.0)
    assert "acc" not in s.sample      # started, not waited for
    pid = s.pending["nvidia-smi"][0]
    while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] != "Z":
        time.sleep(0.02)              # ended (a zombie until the sampler reaps it)
    s.tick(1000.0 + load.INTERVAL)
    assert not os.path.exists(f"/proc/{pid}")     # reaped: no zombie left behind
    assert s.sample["acc"] == [{"id": "0", "util": 55.0, "mem_mib": 100.0, "mem_total_mib": 200.0}]
    assert s.sample["acc_util"] == 55.0
    os.waitpid(s.pending["nvidia-smi"][0], 0)
    def cannot(*a, **k):              # no `timeout` on the host, say: said once, not tried again
        raise FileNotFoundError(2, "No such file or directory", "timeout")
    import subprocess   # the sampler imports it where it starts a tool
    monkeypatch.setattr(subprocess, "Popen", cannot)
    notes = []
    s.note = notes.append
    s.tick(1000.0 + 2 * load.INTERVAL)
    s.tick(1000.0 + 3 * load.INTERVAL)
    assert s.tools == [] and len(notes) <= 1


def test_a_load_sample_is_checked_on_the_wire():
    rep = {"host": "h1", "attempt": 1, "ranks": [], "procs": [], "out": 1.0, "stopping": None, "live": True,
           "load": {"t": 1.0, "cpu": 99.5, "mem_mib": 10.0, "acc": [{"id": "0.1", "util": 5, "mem_mib": None}]}}
    got = protocol.parse_report(rep)["load"]
    assert got["cpu"] == 99.5 and got["acc"] == [{"id": "0.1", "util": 5, "mem_mib": None, "mem_total_mib": None}]
    for bad in ([], {"cpu": "1"}, {"acc": [{"id": 1}]}, {"acc": [{"id": "x"}] * 65}, {"mem_mib": float("nan")}):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_report(dict(rep, load=bad))
    doc: dict = {}
    load.merge(doc, "h1", got)
    assert doc["load"]["h1"]["cpu"] == 99.5


def test_the_heads_history_is_bounded_and_ends_with_a_last_line(tmp_path, monkeypatch):
    from orchestrator.agent import history
    h = history.History(str(tmp_path), 4)
    doc = {"attempt": 1, "progress": {"0": {"total": 5, "loss": 1.0, "rate": 2.0}}, "load": {"h1": {"cpu": 50.0}}}
    assert h.maybe(doc, 100.0) and not h.maybe(doc, 101.0) and h.maybe(doc, 100.0 + h.every)
    assert h.maybe(doc, 112.0, final=True) and not h.maybe(doc, 500.0) and not h.maybe(doc, 501.0, final=True)
    lines = [json.loads(x) for x in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [x["t"] for x in lines] == [100.0, 110.0, 112.0] and lines[0]["p"] == {"0": [5, 1.0, 2.0]}
    monkeypatch.setattr(history, "LIMIT", 100)
    small = history.History(str(tmp_path / "x"), 4)
    (tmp_path / "x").mkdir()
    every = small.every
    assert small.maybe(doc, 1000.0) and small.every == every         # under the limit
    small.limit = 10
    assert small.maybe(doc, 2000.0) and small.every == 2 * every     # past it: half as often
    (tmp_path / "x" / "history.jsonl").unlink()
    (tmp_path / "x").rmdir()
    assert not small.maybe(doc, 9000.0)                              # cannot write: no exception
