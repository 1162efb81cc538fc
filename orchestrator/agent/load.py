"""A host's load while the run goes on, sampled by its supervisor every INTERVAL seconds: the
CPU and memory of the run's processes (from /proc: every process carrying the run's id, as
`orch down` finds them), the host's memory and load average, and where the tools exist, each
accelerator's use (`nvidia-smi --query-gpu`, `npu-smi info`).

The tools are started without waiting (their output goes to a file in the run directory, read
at the next sample once they have ended; `timeout` bounds them), so a slow npu-smi never holds
up the supervisor's loop; the supervisor's reap() collects them as any child. No thread: the
supervisor forks its ranks, and a fork beside a running thread can deadlock the child.

`parse_gpu_csv` and `parse_npu_smi` are pure and tested against captured outputs
(tests/fixtures/health, tests/fixtures/npu-smi); `parse_load` checks what a member sent.
"""

from __future__ import annotations

import os

from .layout import TYPE_CHECKING, compiled, which

if TYPE_CHECKING:
    from typing import Any, Callable

INTERVAL = 5.0
FIRST_AFTER = 1.0   # the first sample, this long after the host's processes were started (Sampler.begin)
SMI_TIMEOUT = 10
MAX_DEVICES = 64
GPU_QUERY = "index,utilization.gpu,memory.used,memory.total"

try:
    HZ = os.sysconf("SC_CLK_TCK")
    PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    HZ, PAGE = 100, 4096


def proc_usage(pid):
    """(CPU seconds so far, resident bytes) of one process, or None when it is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as fh:
            f = fh.read().rsplit(b")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / float(HZ), int(f[21]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


def host_memory():
    """(used %, total MiB) from /proc/meminfo (MemTotal - MemAvailable), or (None, None)."""
    try:
        with open("/proc/meminfo") as fh:
            info = dict((ln.split(":")[0], ln.split()[1]) for ln in fh if ":" in ln and len(ln.split()) > 1)
        total, avail = int(info["MemTotal"]), int(info["MemAvailable"])
        return round(100.0 * (total - avail) / total, 1), round(total / 1024.0)
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None, None


def loadavg():
    try:
        with open("/proc/loadavg") as fh:
            return float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _num(word):
    m = compiled(r"\s*([-+]?\d+(?:\.\d+)?)").match(word)
    return float(m.group(1)) if m else None


def parse_gpu_csv(text):
    """`nvidia-smi --query-gpu=...  --format=csv` (with its header; fields in any order, units in
    the header as `utilization.gpu [%]` and in the values as `9 %`) -> [{id, util, mem_mib,
    mem_total_mib}]; [] for anything else."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return []
    head = [h.strip().split(" [")[0] for h in lines[0].split(",")]
    if "index" not in head:
        return []
    out = []
    for ln in lines[1:MAX_DEVICES + 1]:
        row = dict(zip(head, (v.strip() for v in ln.split(","))))
        if len(row) != len(head) or not row.get("index", "").isdigit():
            continue
        out.append({"id": row["index"], "util": _num(row.get("utilization.gpu", "")),
                    "mem_mib": _num(row.get("memory.used", "")), "mem_total_mib": _num(row.get("memory.total", ""))})
    return out


_CELLS = r"^\|(.*)\|(.*)\|(.*)\|\s*$"


def parse_npu_smi(text):
    """`npu-smi info` -> [{id: "NPU.chip", util: AICore %, mem_mib, mem_total_mib (HBM, else the
    chip's memory)}]. Each device is two table rows: `| NPU Name | Health | Power Temp Hugepages |`
    then `| Chip [Phy-ID] | Bus-Id | AICore(%) Memory-Usage(MB) HBM-Usage(MB) |`; the process
    table below them is not read."""
    out = []
    npu = None
    for ln in text.splitlines():
        if "Process id" in ln:
            break
        m = compiled(_CELLS).match(ln.strip())
        if not m:
            continue
        first, second, third = (c.strip() for c in m.groups())
        words = first.split()
        if not words or not words[0].isdigit():
            continue
        if second and not compiled(r"^[0-9A-Fa-f]{4}:").match(second):   # the NPU row: its id and health
            npu = words[0]
            continue
        if npu is None:
            continue
        pairs = compiled(r"(\d+(?:\.\d+)?)\s*/\s*(\d+(?:\.\d+)?)").findall(third)
        used_total = next((p for p in reversed(pairs) if float(p[1]) > 0), pairs[-1] if pairs else (None, None))
        out.append({"id": "%s.%s" % (npu, words[0]), "util": _num(third),
                    "mem_mib": float(used_total[0]) if used_total[0] is not None else None,
                    "mem_total_mib": float(used_total[1]) if used_total[1] is not None else None})
        if len(out) >= MAX_DEVICES:
            break
    return out


SMI = (("nvidia-smi", ["--query-gpu=" + GPU_QUERY, "--format=csv"], parse_gpu_csv),
       ("npu-smi", ["info"], parse_npu_smi))


class Sampler:
    """This host's load, one sample every INTERVAL seconds (tick() from the supervisor's loop)."""

    def __init__(self, run_id, rundir, run_pids, note=None):
        self.run_id, self.rundir, self.run_pids, self.note = run_id, rundir, run_pids, note
        self.last = 0.0
        self.due = float("inf")  # no sample before the host's part of an attempt starts (begin)
        self.cpu = {}            # pid -> CPU seconds at the last sample
        self.sample = None
        self.tools = [(name, path, args, parse) for name, args, parse in SMI
                      for path in [which(name)] if path]
        self.pending = {}        # tool -> (pid, output file) started and not read yet
        self.devices = {}        # tool -> its last parsed devices

    def begin(self, now):
        """The host's part of an attempt has started: the first sample FIRST_AFTER seconds from now.
        Not before: a sample reads the environment of every process of the host (run_pids), and
        while the run's supervisors join and start their ranks, every host's CPU goes to that
        (at 128 lab hosts on 2 cores, one process table: 127 scans of ~1,000 processes each)."""
        self.due = min(self.due, now + FIRST_AFTER)

    def tick(self, now):
        """Take a sample when one is due. True when it did."""
        if now < self.due or now - self.last < INTERVAL:
            return False
        dt = now - self.last if self.last else None
        # the first CPU figure needs two samples: the second comes a second after the first
        self.last = now if dt is not None else now - INTERVAL + 1.0
        cpu, rss, seen = 0.0, 0, {}
        for pid in self.run_pids(self.run_id):
            u = proc_usage(pid)
            if u is None:
                continue
            seen[pid] = u[0]
            cpu += u[0] - self.cpu.get(pid, u[0] if dt is None else 0.0)
            rss += u[1]
        self.cpu = seen
        used, total = host_memory()
        s = {"t": now, "procs": len(seen), "cpu": round(100.0 * cpu / dt, 1) if dt else None,
             "mem_mib": round(rss / 1048576.0, 1), "host_mem_pct": used, "host_mem_mib": total,
             "loadavg": loadavg()}
        acc = self.accelerators()
        if acc:
            utils = [d["util"] for d in acc if d["util"] is not None]
            mems = [d["mem_mib"] for d in acc if d["mem_mib"] is not None]
            s.update(acc=acc, acc_util=round(sum(utils) / len(utils), 1) if utils else None,
                     acc_mem_mib=sum(mems) if mems else None)
        self.sample = s
        return True

    def accelerators(self):
        """The last finished reading of each tool; starts the next one."""
        for name, path, args, parse in self.tools:
            pid, out = self.pending.get(name, (None, None))
            if pid is not None:
                if not _ended(pid):
                    continue     # still running (bounded by timeout): read at a later sample
                try:
                    with open(out, "rb") as fh:
                        self.devices[name] = parse(fh.read(1 << 20).decode("utf-8", "replace"))
                except (OSError, ValueError, IndexError):
                    self.devices[name] = []
            out = os.path.join(self.rundir, "load.%s.out" % name)
            try:
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                try:
                    import subprocess   # here: only hosts with such a tool start one (procs.Local.start)
                    p = subprocess.Popen(["timeout", str(SMI_TIMEOUT), path] + args, stdin=subprocess.DEVNULL,
                                         stdout=fd, stderr=subprocess.DEVNULL, close_fds=True)
                    p.returncode = 0   # the supervisor's reap() collects it
                    self.pending[name] = (p.pid, out)
                finally:
                    os.close(fd)
            except OSError as exc:   # said once; the tool is not tried again
                self.pending.pop(name, None)
                self.tools = [t for t in self.tools if t[0] != name]
                if self.note:
                    self.note("cannot run %s: %s" % (name, exc))
        return [d for devs in self.devices.values() for d in devs][:MAX_DEVICES]


def _ended(pid):
    """Has our child `pid` ended? Reaped here (a supervisor with no child of its own, a member of an
    mpirun run, reaps nothing else), or already by the supervisor's reap()."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------- the head's side

_FIELDS = ("t", "procs", "cpu", "mem_mib", "host_mem_pct", "host_mem_mib", "loadavg", "acc_util", "acc_mem_mib")


def _n(v):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise ValueError("a number expected")
    return v


def parse_load(s: Any, error: Callable[[str], Exception]) -> dict[str, Any] | None:
    """A member's `load` sample, every field checked; None when it sent none."""
    if s is None:
        return None
    if not isinstance(s, dict):
        raise error("field 'load': an object expected")
    try:
        out = {k: _n(s.get(k)) for k in _FIELDS}
        acc = s.get("acc")
        if acc is not None:
            if not isinstance(acc, list) or len(acc) > MAX_DEVICES:
                raise ValueError("acc: a list of at most %d devices" % MAX_DEVICES)
            out["acc"] = []
            for d in acc:
                if not isinstance(d, dict) or not isinstance(d.get("id"), str) or len(d["id"]) > 16:
                    raise ValueError("acc: each device an object with an id")
                out["acc"].append({"id": d["id"], "util": _n(d.get("util")), "mem_mib": _n(d.get("mem_mib")),
                                   "mem_total_mib": _n(d.get("mem_total_mib"))})
    except ValueError as exc:
        raise error("field 'load': %s" % exc) from None
    return out


def merge(doc: dict[str, Any], host: str, sample: dict[str, Any] | None) -> None:
    """A host's load sample -> doc["load"][host]."""
    if sample is not None:
        doc.setdefault("load", {})[host] = sample
