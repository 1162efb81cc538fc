"""What every lab test suite (integration, faults, e2e) and the benchmarks share: run the real
CLI as a user would, write cluster files over a lab, read run records, find a run's processes,
wait for a condition, and time a faulty run against a healthy one."""

from __future__ import annotations

import json
import shutil
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from orchestrator import sh
from orchestrator.runs import by_start
from orchestrator.launchers import RUN_VAR
from orchestrator.spec import Cluster, load_cluster

REPO = Path(__file__).resolve().parents[1]
ORCH = [sys.executable, "-m", "orchestrator.cli"]

# ------------------------------------------------------------------ the CLI


def listing_answer(records) -> str:
    """What the sync receiver's `list` answers for these records ([kind, size, mtime_ns, mode,
    extra] or None), written here by hand: the tests' own reading of its format."""
    lines = [f"orch:list {len(records)}"]
    for r in records:
        if r is None:
            lines.append("-")
        else:
            extra = r[4] if r[4] is not None else "-"
            if r[0] == "link" and r[4] is not None:
                extra = r[4].encode("utf-8", "surrogateescape").hex()
            lines.append(f"{r[0]} {r[1]} {r[2]} {r[3]} {extra}")
    return "\n".join(lines) + "\n"


def orch(*args, cwd: Path | None = None, timeout: float = 180, check_rc: int | None = None,
         env: dict | None = None, text: bool = False) -> subprocess.CompletedProcess:
    """Run `orch ARGS` as a user would (a fresh process, in `cwd`); with `check_rc`, assert its
    exit code (showing the ends of its output when it differs)."""
    res = subprocess.run([*ORCH, *map(str, args)], cwd=cwd, capture_output=True, timeout=timeout, text=text,
                         env={**os.environ, **(env or {})})
    if check_rc is not None:
        out, err = (res.stdout, res.stderr) if text else (res.stdout.decode(errors="replace"),
                                                            res.stderr.decode(errors="replace"))
        assert res.returncode == check_rc, (res.returncode, out[-3000:], err[-3000:])
    return res


def spawn_orch(*args, cwd, **kw) -> subprocess.Popen:
    return subprocess.Popen([*ORCH, *map(str, args)], cwd=cwd, stdout=kw.pop("stdout", subprocess.PIPE),
                            stderr=kw.pop("stderr", subprocess.PIPE), **kw)


# ------------------------------------------------------------------ run records


def runs_dir(cwd: Path) -> Path:
    return Path(cwd) / ".orch" / "runs"


def run_ids(cwd: Path) -> list[str]:
    """The runs of `cwd` with a record (a run still being made has none yet), oldest first, as orch
    orders them (by start: two runs in one second have ids that sort by their random part)."""
    return by_start(runs_dir(cwd))


def run_record(cwd: Path, run_id: str | None = None) -> dict:
    """The record of run `run_id` of `cwd`, by default of its latest run."""
    chosen = run_id if run_id is not None else run_ids(cwd)[-1]
    return json.loads((runs_dir(cwd) / chosen / "run.json").read_text())


def running(cwd: Path) -> bool:
    """The latest run of `cwd` has started its processes."""
    try:
        rec = run_record(cwd)
        return rec.get("state") == "running" and bool(rec.get("procs"))
    except (IndexError, OSError, ValueError):
        return False


# ------------------------------------------------------------------ cluster files over a lab

SSH = {"connect_timeout": 5, "command_timeout": 60, "retries": 2}
FAULT_SSH = {"connect_timeout": 2, "command_timeout": 20, "retries": 2}  # the fault suite waits its faults out


def write_cluster(lab, tmp_path: Path, *, name: str = "cluster.yaml", ssh: dict | None = None,
                  base_ssh: dict = SSH, checks: dict | None = None, inventory: dict | None = None,
                  defaults: dict | None = None, hosts: int | None = None, inline: bool = False,
                  workdir: str = "/data/job", **job) -> Path:
    """A cluster.yaml over the lab's hosts; `ssh` keys override `base_ssh`, `job` keys the job's.
    The lab's inventory is used by path, unless it is `inline`d or changed: `inventory` keys
    replace its own, `defaults` (host keys such as slots/devices) join its defaults, `hosts`
    keeps only the first N hosts."""
    inv: str | dict = str(lab.inventory_path)
    if inline or inventory or defaults or hosts:
        inv = yaml.safe_load(Path(lab.inventory_path).read_text())
        if defaults:
            inv["defaults"] = {**inv.get("defaults", {}), **defaults}
        if hosts:
            inv["hosts"] = inv["hosts"][:hosts]
        inv.update(inventory or {})
    doc = {
        "inventory": inv,
        "ssh": {**base_ssh, **(ssh or {})},
        "job": {"workdir": workdir, "command": "hostname", **job},
    }
    if checks is not None:
        doc["checks"] = checks
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return path


def write_fault_cluster(lab, tmp_path: Path, **kw) -> Path:
    """write_cluster with the fault suite's defaults: short ssh timeouts, the inventory inline,
    workdir /data/fx."""
    kw.setdefault("workdir", "/data/fx")
    return write_cluster(lab, tmp_path, base_ssh=FAULT_SSH, inline=True, **kw)


def lab_cluster(lab, tmp_path: Path, **kw) -> Cluster:
    return load_cluster(write_cluster(lab, tmp_path, **kw))


# ------------------------------------------------------------------ processes and hosts


def util_linux_setpriv() -> str:
    """This machine's setpriv (util-linux >= 2.33: --pdeathsig), which the hosts' supervisors start
    processes through (orchestrator/agent/procs.py); scripts/test.sh's machines have it."""
    path = shutil.which("setpriv", path="/usr/bin:/bin")
    assert path, "util-linux's setpriv is missing on this machine"
    return path


def old_setpriv(directory: Path) -> Path:
    """directory/setpriv as util-linux < 2.33 has it (CentOS 7, Ubuntu 18.04): no --pdeathsig,
    it stops at the option, exit 1."""
    directory.mkdir(exist_ok=True)
    path = directory / "setpriv"
    path.write_text("#!/bin/sh\necho \"setpriv: unrecognized option '$1'\" >&2\nexit 1\n")
    path.chmod(0o755)
    return path


def described(pids: list[str]) -> str:
    """What each of `pids` is (its state, parent and command line), for an assertion's message."""
    out = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            out.append(f"{pid}: gone")
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out.append(f"{pid} ({fields[0]}, parent {fields[1]}): {cmd.strip()[:300]}")
    return "; ".join(out)


def leftovers(run_id: str, comm: str | None = None) -> list[str]:
    """Live processes anywhere on this machine (so on every lab host) that belong to the run;
    with `comm`, only those whose command name is `comm` (say the ranks' `sleep`, leaving out
    the helpers a run starts and ends while it runs)."""
    needle = f"ORCH_RUN_ID={run_id}".encode()
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, state = stat.split("(", 1)[1].rsplit(")", 1)[0], stat.rsplit(")", 1)[1].split()[0]
        if needle in env and state != "Z" and comm in (None, name):
            out.append(pid)
    return out


def host_procs(lab, i: int, run_id: str) -> list[str]:
    """Processes of the run on lab host i (its own PID namespace)."""
    res = lab.exec(i, ["sh", "-c", f"{sh.env_holders(RUN_VAR, run_id)}; true"])
    return res.stdout.split()


def kill_run_on(lab, i: int, run_id: str) -> None:
    """kill -9 every process of the run on lab host i, its supervisor included (as a power cut
    would), until none is left; there must be some. One listed a moment ago may have ended by
    itself already (a start's parent once did), which is not a failure."""
    pids = [p.split("/")[2] for p in host_procs(lab, i, run_id)]   # /proc/PID/environ
    assert pids, f"no process of run {run_id} on host {i}"
    for _ in range(20):
        lab.exec(i, ["sh", "-c", 'kill -9 "$@" 2>/dev/null; true', "kill", *pids])
        pids = [p.split("/")[2] for p in host_procs(lab, i, run_id)]
        if not pids:
            return
    raise AssertionError(f"processes of run {run_id} still on host {i}: {pids}")


def remote_ls(lab, i: int, pattern: str) -> list[str]:
    """Paths matching a shell glob on lab host i (empty if none)."""
    res = lab.exec(i, ["sh", "-c", f"for f in {pattern}; do [ -e \"$f\" ] && echo \"$f\"; done; exit 0"])
    return res.stdout.split()


def connect_from(lab, i: int, address: str, port: int, timeout: float = 3) -> str:
    """From lab host i (inside its namespaces, with the hosts' system python3): "ok" if
    address:port accepts a TCP connection, else why not, e.g. "[Errno 101] Network is
    unreachable". For topologies: which host reaches which address (lab.peer_address(i) is
    the one the other hosts reach host i by)."""
    from orchestrator.lab.system import host_python

    code = ("import socket, sys\n"
            "try:\n"
            "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
            "    print('ok')\n"
            "except OSError as exc:\n"
            "    print(exc)\n")
    res = lab.exec(i, [host_python(), "-I", "-c", code, address, str(port), str(timeout)], timeout=timeout + 30)
    return res.stdout.strip() or res.stderr.strip()


def sshd_lines(lab, i: int) -> list[str]:
    try:
        return lab.sshd_log(i).read_text(errors="replace").splitlines()
    except OSError:
        return []


def wait_until(pred, timeout: float = 30.0, interval: float = 0.1) -> bool:
    """Poll `pred` until it is true or `timeout` seconds pass (asking once more after that);
    says which."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def up_then_kill_controller(cwd: Path, *, procs: int, args=(), timeout: float = 60) -> str:
    """`orch up ARGS` in `cwd`, SIGKILLed (laptop closed) once the run has started and at least
    `procs` of its processes run; returns the run id."""
    proc = spawn_orch("up", *args, cwd=cwd)
    try:
        assert wait_until(lambda: running(cwd), timeout), "the run did not start"
        run_id = run_record(cwd)["id"]
        assert wait_until(lambda: len(leftovers(run_id)) >= procs, timeout), leftovers(run_id)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        proc.kill()
    return run_id


# ------------------------------------------------------------------ time, against a healthy run


def timed(fn, *args, **kw):
    """(fn(*args, **kw), the seconds it took)."""
    t0 = time.monotonic()
    out = fn(*args, **kw)
    return out, time.monotonic() - t0


def budget(healthy: float, cost: float) -> float:
    """How long an operation with a fault may take: what the same operation took healthy, here
    and now, plus `cost`, what the fault costs by design (timeouts x attempts, grace periods),
    plus slack that grows with how slow this machine is right now (a loaded CI runner slows
    both runs alike). Waiting the fault out the long way (a job's sleep, TCP's own time-outs)
    still overruns it."""
    return healthy + cost + max(1.5, healthy)


def interrupted_big_sync(lab, tmp_path: Path, wd: str, watch: int, hosts: tuple[int, ...], **cluster) -> None:
    """`orch up` syncing a new 300 MB big.bin, interrupted (Ctrl-C) once host `watch` holds a
    partial temp file of it: exit 130, and every host of `hosts` keeps a complete big.bin (the old
    one or the new one, never a prefix under its name) and no temp file."""
    import hashlib

    old = os.urandom(4096)
    (tmp_path / "big.bin").write_bytes(old)
    write_fault_cluster(lab, tmp_path, workdir=wd, launcher="ranktable", sync=["big.bin"], command="true", **cluster)
    orch("up", "-q", "--skip-checks", cwd=tmp_path, check_rc=0)
    with open(tmp_path / "big.bin", "wb") as fh:
        for _ in range(300):
            fh.write(os.urandom(1 << 20))
    proc = spawn_orch("up", "-q", "--skip-checks", cwd=tmp_path)
    try:
        assert wait_until(lambda: remote_ls(lab, watch, f"{wd}/.orch-sync-partial.*") != [], timeout=60,
                          interval=0.02)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, proc.stderr.read().decode()
    finally:
        proc.kill()
    either = (hashlib.sha256(old).hexdigest(), hashlib.sha256((tmp_path / "big.bin").read_bytes()).hexdigest())
    for i in hosts:
        assert wait_until(lambda i=i: remote_ls(lab, i, f"{wd}/.orch-sync-partial.*") == [], timeout=30), i
        assert lab.exec(i, ["sh", "-c", f"sha256sum < {wd}/big.bin | cut -c1-64"]).stdout.strip() in either, i
