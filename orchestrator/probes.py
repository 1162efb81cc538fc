"""The probe of `orch check`: ONE POSIX sh script per host, and pure parsers of what it prints.

`assemble(host, ...)` builds the script from the sections' commands (each check
in checks/ says which it needs, checks/runner.py which go to a host), each wrapped
in a section::

    @@orch:begin NAME
    <stdout and stderr of the section's commands>
    @@orch:end NAME <exit status>

`split_sections(text)` turns the output back into {NAME: Section}; a section
that never ended (the probe was killed) has rc None. The parse_* functions below
turn one section's text into data and raise `ProbeError` (never anything else)
on output they do not understand, with a message that quotes it. Judging
(pass/warn/fail) is not done here: see checks/.

The probe runs over the same non-interactive SSH session mpirun's own ssh will
get, so `command -v` sees the PATH the launcher will see. Commands that can hang
(df on a dead NFS mount, nvidia-smi on a wedged driver) run under `timeout`
when it exists. A Python distribution's version costs one python start for all of them;
check reach one more (a listener on the launch host, a connection test on the others). The
slowest sections start right after `clock0` in the background and print in their place, so they
overlap the others instead of following them: the launch host's ssh test to every other host
(`mesh`), another host's TCP test to the launch host (`reach`).
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping, Sequence, TypedDict

from . import devices
from .devices import HccnDevice
from .logins import SHARE_DIR
from .transport.base import PROBE_END
from .model import Cluster, Host
from .interpreters import is_python
from .supervisor import parse_python

MARK = "@@orch:"
# A background section's output that starts with GIVEN_BEGIN carries whole sections first, up to
# GIVEN_END (checks/reach.py GIVEN_PY: its python3 prints them for the sh): split_sections takes
# them out as sections of their own.
GIVEN_BEGIN, GIVEN_END = MARK + "given", MARK + "given-end"
# set (non-empty) by a lead section's body where it starts the program that gives sections
GIVEN_VAR = "_g"
GIVEN_BY = "reach"   # the one section whose program gives sections (checks/reach.py SECTION)
NOT_INSTALLED = "orch:not-installed"
# Python distributions whose versions come from one importlib.metadata call.
DIST_TOOLS = ("mindspore", "torch")
NCCL_DISTS = ("nvidia-nccl-cu12", "nvidia-nccl-cu11")
# Tool environment the launch applies to ranks: the probe applies the same for tool lookups.
TOOL_ENV = ("PATH", "PYTHONPATH", "PYTHONHOME", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX")
HASH_LIMIT = 256 << 20  # sync files larger than this are compared by size only
MAX_COMPARED_FILES = 1000
SECTION_TIMEOUT = 20  # seconds, for each command that may hang
ASCEND_TOOLKIT = "/usr/local/Ascend/ascend-toolkit/latest"


class ProbeError(ValueError):
    """A section's output could not be understood. The message quotes it."""


@dataclass(frozen=True)
class Section:
    name: str
    body: str
    rc: int | None  # None: the section started but never ended

    @property
    def finished(self) -> bool:
        return self.rc is not None


@dataclass(frozen=True)
class SyncFile:
    """One file `orch up` will copy: its path relative to workdir, size and sha256 here (`orch
    check`), or size and modification time (`orch up`'s probe, which compares them with the host's
    sync listing as sync does, and hashes nothing)."""

    rel: str
    size: int
    sha256: str | None  # None when larger than HASH_LIMIT (compared by size), or when listed
    mtime_ns: int | None = None  # `orch up`: compared with the host's listing


@dataclass(frozen=True)
class MeshTarget:
    """A host another one must reach with ssh as mpirun does: its address in the cluster and the
    ssh options mpirun is given (logins.ssh_args)."""
    name: str
    address: str
    ssh_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReachTarget:
    """Where a host's probe tests that it reaches the launch host by TCP (check `reach`): the port
    the launch host's probe listens on and the addresses to try, in order (the one the run will
    use first). port 0: not tested, `untested` says why (`status`: warn or error). `until`: the
    controller's time.monotonic() after which the listener may be gone (a later probe is not tested)."""
    port: int = 0
    addresses: tuple[str, ...] = ()
    until: float = 0.0
    untested: str = ""
    status: Literal["warn", "error"] = "error"


@dataclass(frozen=True)
class Listen:
    """What the launch host's `reach` section printed: its port (None: no listener, `error` says
    why), its global IPv4 addresses, job.interface there (when set)."""
    port: int | None
    addresses: tuple[str, ...]
    interface: IfAddr | None
    error: str = ""


@dataclass(frozen=True)
class Reach:
    """What another host's `reach` section printed: each address tried -> "ok" or why not, in the
    order tried; or why it was not tested (`untested`, with the `status` to give it)."""
    tried: tuple[tuple[str, str], ...] = ()
    untested: str = ""
    status: Literal["warn", "error"] = "error"


# --------------------------------------------------------------------------- building the probe


def interpreter(cluster: Cluster) -> str:
    """The python the ranks run: the command's executable if it is a python, else python3."""
    exe = cluster.job.command[0] if cluster.job.command else "python3"
    return exe if is_python(exe) else "python3"


def tool_env(cluster: Cluster, host: Host) -> dict[str, str]:
    """The part of job.env (and the host's env) that changes where tools are found."""
    merged = {**cluster.job.env, **host.env}
    return {k: merged[k] for k in TOOL_ENV if k in merged}


def section_script(name: str, body: str) -> str:
    """One section of the probe: its commands between the begin and end markers."""
    # a subshell: a section's `cd`, variables or `exit` never leak into the next one
    return f"_b {name}\n(\n{body.rstrip()}\n)\n_e {name} $?"


def interface_script(interface: str, launch_address: str) -> str:
    """Prints `ifc NAME ADDR/PREFIX` for job.interface on this host: the named interface, or
    (`auto`) the one its route to the launch host leaves by (for the launch host itself: the one
    carrying its address); `-` for what is missing. Parsed by parse_interface."""
    q = shlex.quote
    if interface == "auto":
        find = (f"t={q(launch_address)}\n"
                "case $t in *[!0-9.]*) t=$(getent ahostsv4 \"$t\" 2>/dev/null | awk '{print $1; exit}') ;; esac\n"
                "i=$(ip -4 route get \"${t:-0.0.0.0}\" 2>/dev/null | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p' | head -n 1)\n"
                "[ \"$i\" = lo ] && i=$(ip -o -4 addr show 2>/dev/null | awk -v a=\"$t\" "
                "'{split($4, p, \"/\"); if (p[1] == a) {print $2; exit}}')\n")
    else:
        find = f"i={q(interface)}\n"
    # `up`: a link that is down has no usable address (NCCL/HCCL would wait on it)
    return (find + "a=$(ip -o -4 addr show dev \"${i:--}\" up 2>/dev/null | awk '{print $4; exit}')\n"
            "echo \"ifc ${i:--} ${a:--}\"")


def interface_problem(want: str, got: IfAddr | None) -> str | None:
    """Why job.interface (`want`) cannot carry a host's traffic, as parse_interface found it
    there; None: it can."""
    if got is None:
        return (f"interface {want}: no route to the launch host's address was found (or no `ip` command)"
                if want == "auto" else f"interface {want}: no `ip` command to look it up")
    if not got.address:
        return (f"interface {got.ifname} {'(auto) ' if want == 'auto' else ''}does not exist on this host, is "
                "down or has no IPv4 address; NCCL/HCCL/Gloo and MPI would find no network there: fix "
                "job.interface (ip -o -4 addr lists them)")
    return None


def interface_network(got: IfAddr) -> str | None:
    """The IPv4 network an interface address sits in (10.0.0.0/24), when its prefix is known."""
    if not got.address or got.prefixlen is None:
        return None
    return str(ipaddress.ip_network(f"{got.address}/{got.prefixlen}", strict=False))


def parse_interface(text: str) -> IfAddr | None:
    """interface_script's output -> the interface and its IPv4 address (address '' when it has
    none); None when no interface was found (no route, or no `ip`)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "ifc":
            if parts[1] == "-":
                return None
            addr, _, plen = parts[2].partition("/")
            return IfAddr(parts[1], "" if addr == "-" else addr, int(plen) if plen.isdigit() else None)
    return None


def _background_start(body: str, i: int = 0, keep: bool = True) -> str:
    """Start a section in the background, right away: the slowest ones (mesh: a connection to
    every other host; reach: a connection to the launch host) then run while the other sections
    do. Its output waits in a temporary file (mktemp's: no name another user could plant; removed
    when the probe's shell exits) for the section's turn. Without one (mktemp failed: /tmp full
    or read-only), the section says so. `i`: the how-manieth background section (its variables);
    not `keep`: descriptors 3 to 5 and 7 closed for it (assemble's `hold`: another section's)."""
    mo, mp = _background_vars(i)
    files = " ".join(f'"${_background_vars(k)[0]}"' for k in range(i + 1))
    return (f"if {mo}=$(mktemp 2>/dev/null); then\ntrap 'rm -f {files}' EXIT\n"
            f"(\n{body}\n) {'' if keep else '3<&- 4>&- 5>&- 7>&- '}> \"${mo}\" 2>&1 &\n{mp}=$!\nfi")


def _background_vars(i: int) -> tuple[str, str]:
    return ("_mo", "_mp") if i == 0 else (f"_mo{i}", f"_mp{i}")


def _background_section(name: str, i: int = 0) -> str:
    """A background section printed in its place."""
    mo, mp = _background_vars(i)
    return (f"_b {name}\nif [ -n \"${mo}\" ]; then wait \"${mp}\"; _mr=$?; cat \"${mo}\"; rm -f \"${mo}\"\n"
            f"else echo 'orch: not run: mktemp could not create a temporary file on this host'; _mr=125; fi\n"
            f"_e {name} $_mr")


def _lead_section(name: str, body: str, gives: bool) -> str:
    """A section run first, in the foreground, in the probe's own shell (no subshell: its body
    must not `exit` or `cd`): a program that may hold the session (assemble's `hold`) and may print
    other sections for the sh (`gives`: assemble's `given`, GIVEN_BEGIN first). No temporary file,
    no `cat`: its output goes out as it comes. Where it gives, its body sets GIVEN_VAR as it starts
    that program, and a status other than 0 says it may have printed only some (GIVEN_VAR emptied)."""
    if not gives:
        return f"_b {name}\n{body.rstrip()}\n_e {name} $?"
    return f"_b {name}\n{GIVEN_VAR}=\n{body.rstrip()}\n_mr=$?; [ \"$_mr\" = 0 ] || {GIVEN_VAR}=\n_e {name} $_mr"


def _given_fallback(given: Sequence[tuple[str, str]]) -> str:
    """The sections a lead section's program gives, run by the sh where it did not give them."""
    return f"if [ -z \"${GIVEN_VAR}\" ]; then\n" + "\n".join(section_script(n, b) for n, b in given) + "\nfi"


def assemble(host_name: str, first: Sequence[tuple[str, str]], background: Sequence[tuple[str, str]],
             body: Sequence[tuple[str, str]], last: Sequence[tuple[str, str]], hold: str = "",
             given: Iterable[str] = (), lead: Sequence[tuple[str, str]] = ()) -> str:
    """The one probe script of a host from its sections' (name, commands): `first`, then
    `background` started (all at once), `lead` run, `body` in order, `background` printed, `last`.
    `hold`: the lead section that holds the session (checks/reach.py HOLD_PY) gets its stdin,
    stdout and stderr as descriptors 3, 4 and 5, and 7, the write end of a pipe to a `cat` that
    the session's shell waits for; no other section gets them. The session, and its stdin, stay
    open while anything holds 7 (sshd closes a session's stdin once its shell has ended); the
    script's output goes to the session as ever (through `cat` it cost 3-7 ms more a probe) and ends
    with PROBE_END (transport.base: all of it, the session still open).
    `given`: names of `body`'s or the frame's sections that the program of the lead section
    GIVEN_BY (split_sections reads them there alone) prints (GIVEN_BEGIN); the sh runs them after the
    lead sections only where it did not.
    Pure: same inputs, same script (checks/runner.py says which sections)."""
    assert not hold or any(n == hold for n, _ in lead), "the section that holds is a lead section"
    names = set(given) if any(n == GIVEN_BY for n, _ in lead) else set()
    handed = [s for s in (*first, *body, *last) if s[0] in names]
    first, body, last = ([s for s in x if s[0] not in names] for x in (first, body, last))
    parts = [
        "# orch check probe for " + host_name.replace("\n", " "),
        *(["exec 3<&0 5>&2 6>&1", "{", "exec 7>&1 1>&6 4>&6 6>&-"] if hold else []),
        "exec 2>&1 </dev/null",
        "_b() { printf '%sbegin %s\\n' '" + MARK + "' \"$1\"; }",
        "_e() { printf '\\n%send %s %s\\n' '" + MARK + "' \"$1\" \"$2\"; }",
        f"T=; command -v timeout >/dev/null 2>&1 && T='timeout {SECTION_TIMEOUT}'",
    ]
    parts += [section_script(n, b) for n, b in first]
    parts += [_background_start(b, i, keep=not hold) for i, (n, b) in enumerate(background)]
    for n, b in lead:   # the hold's descriptors for the section that holds alone (a group's redirections)
        b = b if n == hold or not hold else f"{{\n{b.rstrip()}\n}} 3<&- 4>&- 5>&- 7>&-"
        parts.append(_lead_section(n, b, n == GIVEN_BY and bool(handed)))
    if hold:
        parts.append("exec 3<&- 4>&- 5>&- 7>&-")
    if handed:
        parts.append(_given_fallback(handed))
    parts += [section_script(n, b) for n, b in body]
    parts += [_background_section(n, i) for i, (n, _) in enumerate(background)]
    parts += [section_script(n, b) for n, b in last]
    if hold:
        parts += [f"printf '%s\\n' '{PROBE_END.decode().strip()}'", "} | cat"]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------- splitting the output

_SECTION_RE = re.compile(r"^@@orch:begin (\S+)\n", re.M)


def split_sections(text: str) -> dict[str, Section]:
    """Probe output -> {name: Section}. Output outside sections (login banners) is ignored."""
    out: dict[str, Section] = {}
    pos = 0
    while True:
        m = _SECTION_RE.search(text, pos)
        if not m:
            return out
        name = m.group(1)
        end_re = re.compile(r"\n" + re.escape(MARK) + r"end " + re.escape(name) + r" (-?\d+)\n?")
        e = end_re.search(text, m.end() - 1)
        if e is None:
            # never ended: keep what came, up to the next section (if any)
            nxt = _SECTION_RE.search(text, m.end())
            body = text[m.end():nxt.start() if nxt else len(text)]
            out[name] = Section(name, body.rstrip("\n"), None)
            pos = nxt.start() if nxt else len(text)
            continue
        body = text[m.end():e.start() + 1][:-1]
        # sections the lead program printed for the sh: its first block, at a line's start (a
        # warning of python3's own, on its stderr, may come first); in that section alone
        k = ("\n" + body).find("\n" + GIVEN_BEGIN + "\n") if name == GIVEN_BY else -1
        if k >= 0:
            inner, cut, rest = body[k + len(GIVEN_BEGIN) + 1:].partition("\n" + GIVEN_END + "\n")
            if not cut and inner.endswith("\n" + GIVEN_END):   # nothing of its own after them
                inner, rest = inner[:-len(GIVEN_END) - 1], ""
            body = body[:k] + rest
            for s in split_sections(inner + "\n").values():
                out.setdefault(s.name, s)
        out[name] = Section(name, body, int(e.group(1)))
        pos = e.end()


def join_sections(sections: Iterable[Section]) -> str:
    """The inverse of split_sections (for tests and fixtures)."""
    parts = []
    for s in sections:
        parts.append(f"{MARK}begin {s.name}\n{s.body}\n" + (f"{MARK}end {s.name} {s.rc}\n" if s.rc is not None
                                                            else ""))
    return "".join(parts)


# --------------------------------------------------------------------------- parsers (pure)


def quote_output(text: str, n: int = 120) -> str:
    """Command output for an error message: one line, shortened, quoted."""
    t = " ".join(text.strip().split())
    if not t:
        return "no output"
    return repr(t if len(t) <= n else t[:n] + "...")


def _not_installed(text: str) -> bool:
    return text.strip() == NOT_INSTALLED or text.strip().endswith(NOT_INSTALLED)


def parse_python_version(text: str) -> str | None:
    """`python3 --version` -> '3.11.7'; None if no python."""
    if _not_installed(text):
        return None
    m = re.search(r"^Python (\d+\.\d+(?:\.\d+)?\S*)\s*$", text, re.M)
    if not m:
        raise ProbeError(f"unexpected output from `python --version`: {quote_output(text)}")
    return m.group(1)


def parse_openmpi_version(text: str) -> str | None:
    """`mpirun --version` or `ompi_info [--version]` -> '4.1.4'; None if neither exists.
    Another MPI's mpirun gives its name and version ('MPICH 4.0.2', 'Intel MPI 2021.6')."""
    if _not_installed(text):
        return None
    for pat in (r"\(Open MPI\)\s+(\S+)", r"^\s*Open MPI:\s*(\S+)", r"^Open MPI v(\S+)",
                r"\(OpenRTE\)\s+(\S+)"):
        m = re.search(pat, text, re.M)
        if m:
            return m.group(1)
    m = re.search(r"HYDRA build details:.*?Version:\s*(\S+)", text, re.S)
    if m:
        return f"MPICH {m.group(1)}"
    m = re.search(r"Intel\(R\) MPI Library.*?Version\s+(\S+?),?\s", text)
    if m:
        return f"Intel MPI {m.group(1)}"
    if re.search(r"not found|No such file", text):
        return None
    raise ProbeError(f"unexpected output from `mpirun --version`: {quote_output(text)}")


def parse_dists(text: str, wanted: Iterable[str]) -> dict[str, str | None]:
    """`python -c 'importlib.metadata...' d1 d2` lines `NAME VERSION|-` -> {name: version|None}.
    No python: every dist is not installed."""
    wanted = list(wanted)
    if _not_installed(text):
        return {d: None for d in wanted}
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in wanted:
            found[parts[0]] = None if parts[1] == "-" else parts[1]
    missing = [d for d in wanted if d not in found]
    if missing:
        raise ProbeError(f"python did not report {', '.join(missing)}: {quote_output(text, 200)}")
    return found


def parse_nccl_version(text: str, dists: Mapping[str, str | None] | None = None) -> str | None:
    """ldconfig -p / readlink lines naming libnccl.so.X.Y.Z, or nccl.h NCCL_MAJOR/MINOR/PATCH,
    or a pip nvidia-nccl-cuXX distribution -> '2.18.3'."""
    versions = sorted(set(re.findall(r"libnccl\.so\.(\d+\.\d+\.\d+)", text)))
    if versions:
        return versions[-1] if len(versions) == 1 else ",".join(versions)
    parts = dict(re.findall(r"^#define NCCL_(MAJOR|MINOR|PATCH)\s+(\d+)", text, re.M))
    if len(parts) == 3:
        return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    for d in NCCL_DISTS:
        if dists and dists.get(d):
            return dists[d]
    if _not_installed(text):
        return None
    m = re.search(r"libnccl\.so\.(\d+(?:\.\d+)?)\b", text)
    if m:  # only the soname (libnccl.so.2): the major version is all we can tell
        return m.group(1)
    raise ProbeError(f"cannot tell the NCCL version from: {quote_output(text)}")


def parse_cann_version(text: str) -> str | None:
    """ascend_toolkit_install.info (`version=7.0.0`) or version.cfg -> '7.0.0'."""
    if _not_installed(text):
        return None
    m = re.search(r"^\s*version\s*=\s*[\"']?([0-9][^\s\"']*)", text, re.M)
    if m:
        return m.group(1)
    m = re.search(r"running_version\s*=\s*\[[^:\]]*:([^\]]+)\]", text)
    if m:
        return m.group(1).strip()
    raise ProbeError(f"no version= line in the CANN install info: {quote_output(text)}")


def parse_cuda_driver_version(text: str) -> str | None:
    """/proc/driver/nvidia/version or `nvidia-smi --query-gpu=driver_version` -> '535.104.05'."""
    if _not_installed(text):
        return None
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    if m:
        return m.group(1)
    lines = {ln.strip() for ln in text.splitlines() if re.fullmatch(r"\d+\.\d+(\.\d+)?", ln.strip())}
    if len(lines) == 1:
        return lines.pop()
    if len(lines) > 1:
        return ",".join(sorted(lines))
    raise ProbeError(f"cannot tell the NVIDIA driver version from: {quote_output(text)}")


@dataclass(frozen=True)
class IfAddr:
    ifname: str | None  # None when only `hostname -I` was available
    address: str
    prefixlen: int | None


_IP_O = re.compile(r"^\d+:\s+(\S+?)(?:@\S+)?\s+inet6?\s+([0-9A-Fa-f.:]+)(?:/(\d+))?")


def parse_ip_addrs(text: str) -> list[IfAddr]:
    """`ip -o addr`, `ip -j addr` or `hostname -I` -> the host's addresses."""
    t = text.strip()
    if not t:
        raise ProbeError("`ip addr` and `hostname -I` printed nothing")
    if t.startswith("["):
        try:
            data = json.loads(t)
            out = [IfAddr(link.get("ifname"), a["local"], a.get("prefixlen"))
                   for link in data for a in link.get("addr_info", []) if "local" in a]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ProbeError(f"cannot read `ip -j addr` output ({exc}): {quote_output(t)}") from None
        return out
    out = []
    for line in t.splitlines():
        m = _IP_O.match(line)
        if m:
            out.append(IfAddr(m.group(1), m.group(2), int(m.group(3)) if m.group(3) else None))
    if out:
        return out
    words = t.split()
    try:
        return [IfAddr(None, str(ipaddress.ip_address(w.split("%")[0])), None) for w in words]
    except ValueError:
        raise ProbeError(f"cannot read the host's addresses from: {quote_output(t)}") from None


@dataclass(frozen=True)
class DiskFree:
    filesystem: str
    mount: str
    avail_kib: int
    total_kib: int


_DF = re.compile(r"^(.*?)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+%|-)\s+(/.*)$")


def parse_df(text: str) -> DiskFree:
    """`df -Pk DIR` -> the filesystem holding DIR (POSIX format; names may contain spaces)."""
    rows = [ln for ln in text.splitlines() if ln.strip()]
    if not rows or not rows[0].startswith("Filesystem"):
        raise ProbeError(f"unexpected `df -Pk` output: {quote_output(text)}")
    joined = " ".join(r.strip() for r in rows[1:])  # a long name can wrap onto two lines
    m = _DF.match(joined)
    if not m:
        raise ProbeError(f"unexpected `df -Pk` output: {quote_output(text)}")
    return DiskFree(m.group(1), m.group(6), int(m.group(4)), int(m.group(2)))


def parse_listening_ports(text: str) -> set[int]:
    """/proc/net/tcp{,6} (state 0A) or `ss -ltn` -> the TCP ports something listens on."""
    ports: set[int] = set()
    recognised = False
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and re.fullmatch(r"\d+:", parts[0]) and ":" in parts[1]:
            recognised = True
            if parts[3] == "0A":
                try:
                    ports.add(int(parts[1].rsplit(":", 1)[1], 16))
                except ValueError:
                    continue
        elif parts and parts[0] in ("sl", "State", "Netid"):
            recognised = True
        elif len(parts) >= 4 and parts[0] == "LISTEN":
            recognised = True
            try:
                ports.add(int(parts[3].rsplit(":", 1)[1]))
            except (ValueError, IndexError):
                continue
    if not recognised:
        raise ProbeError(f"cannot read listening ports from: {quote_output(text)}")
    return ports


def parse_hccn(text: str) -> dict[int, HccnDevice] | None:
    """The hccn section (/etc/hccn.conf) -> devices.parse_hccn; None if the file does not exist."""
    if _not_installed(text):
        return None
    return devices.parse_hccn(text)


def parse_nvidia_smi_l(text: str) -> dict[int, str] | None:
    """`nvidia-smi -L` -> {index: 'NVIDIA A100-SXM4-80GB'}; None if nvidia-smi is missing."""
    if _not_installed(text):
        return None
    gpus = {int(m.group(1)): m.group(2).strip()
            for m in re.finditer(r"^GPU (\d+): (.*?)(?: \(UUID: [^)]*\))?\s*$", text, re.M)}
    if not gpus:
        raise ProbeError(f"nvidia-smi -L listed no GPU: {quote_output(text)}")
    return gpus


def parse_npu_smi(text: str) -> dict[int, str] | None:
    """`npu-smi info` -> {device id: health ('OK', 'Warning'...)}; None if npu-smi is missing.
    A device is an NPU's id, or on Atlas A3 a die's Chip Phy-ID (devices.parse_npu_smi_dies)."""
    if _not_installed(text):
        return None
    npus = devices.parse_npu_smi_dies(text)
    if not npus:
        npus = {}
        for line in text.splitlines():
            if "Process id" in line or "Process name" in line:
                break
            m = devices.NPU_ROW.match(line)
            if m:
                npus[int(m.group(1))] = m.group(2)
    if not npus:
        raise ProbeError(f"npu-smi info listed no NPU: {quote_output(text)}")
    return npus


def parse_stale(text: str) -> dict[str, list[int]]:
    """`grep ORCH_RUN_ID= /proc/*/environ` lines -> {run id: [pids]} (the probe itself excluded)."""
    me = re.search(r"^self=(\d+)$", text, re.M)
    self_pid = int(me.group(1)) if me else None
    runs: dict[str, list[int]] = {}
    for m in re.finditer(r"^/proc/(\d+)/environ:ORCH_RUN_ID=(.*)$", text, re.M):
        pid = int(m.group(1))
        if pid == self_pid or not m.group(2):
            continue
        runs.setdefault(m.group(2), []).append(pid)
    return runs


def parse_clock(text: str) -> float:
    """`date +%s.%N` -> seconds (a `date` without %N gives whole seconds)."""
    t = text.strip()
    m = re.fullmatch(r"(\d+)(?:\.(\d+))?(?:\S*)", t)
    if not m:
        raise ProbeError(f"unexpected `date +%s.%N` output: {quote_output(t)}")
    frac = m.group(2) or ""
    return float(f"{m.group(1)}.{frac}") if frac else float(m.group(1))


@dataclass(frozen=True)
class Workdir:
    existed: bool
    mkdir_error: str | None
    write_error: str | None
    writable: bool
    uid: int | None = None
    perms: tuple[tuple[int, int, str], ...] = ()  # (mode, owner uid, path): the workdir, then each parent


def parse_workdir(text: str) -> Workdir:
    kv: dict[str, str] = {}
    perms = []
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            if k in ("existed", "mkdir", "write", "uid"):
                kv[k] = v
            elif k == "perm":
                parts = v.split(" ", 2)
                if len(parts) == 3 and all(c in "01234567" for c in parts[0]) and parts[0] and parts[1].isdigit():
                    perms.append((int(parts[0], 8), int(parts[1]), parts[2]))
    if "existed" not in kv:
        raise ProbeError(f"unexpected workdir probe output: {quote_output(text)}")
    mk = kv.get("mkdir")
    wr = kv.get("write")
    return Workdir(existed=kv["existed"] == "yes", mkdir_error=None if mk in (None, "ok") else (mk or "failed"),
                   write_error=None if wr in (None, "ok") else (wr or "failed"), writable=wr == "ok",
                   uid=int(kv["uid"]) if kv.get("uid", "").isdigit() else None, perms=tuple(perms))


def parse_sha256sum(text: str) -> dict[str, str]:
    """`sha256sum` lines (and our `size N path` lines) -> {path: 'sha256'|'size:N'}."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^(\\?)([0-9a-f]{64}) [ *](.*)$", line)
        if m:
            name = m.group(3)
            if m.group(1):  # GNU escapes \ and newline in names, marking the line with a leading \
                name = name.replace("\\n", "\n").replace("\\\\", "\\")
            out[name] = m.group(2)
            continue
        m = re.match(r"^size (\d+) (.*)$", line)
        if m:
            out[m.group(2)] = f"size:{m.group(1)}"
    return out


SHARED = "orch:share"  # the mesh section's line `orch:share PATH`: its connections stay open on PATH


def mesh_shared(text: str, name: str) -> str | None:
    """The ControlPath the mesh test kept its connections open on (its SHARED line), if it is the
    launch user's directory's (logins.SHARE_DIR) socket `name` (logins.share_name); else None."""
    want = re.compile(re.escape(SHARE_DIR).replace(re.escape("{uid}"), r"\d+") + "/" + re.escape(name))
    for line in text.splitlines():
        kind, _, path = line.partition(" ")
        if kind == SHARED and want.fullmatch(path):
            return path
    return None


def parse_mesh(text: str) -> dict[str, tuple[int, str]] | None:
    """Mesh lines `TARGET\\tRC\\tSTDERR` -> {target: (exit code, error)}; None if no ssh client."""
    if _not_installed(text):
        return None
    out: dict[str, tuple[int, str]] = {}
    for line in text.splitlines():
        parts = line.split("\t", 2)
        if len(parts) >= 2 and re.fullmatch(r"-?\d+", parts[1]):
            out[parts[0]] = (int(parts[1]), parts[2].strip() if len(parts) > 2 else "")
    return out


def parse_listen(text: str) -> Listen:
    """The launch host's reach section (`addr A` lines, `ifc ...`, then `listen PORT` or
    `nolisten WHY`) -> Listen."""
    addrs, port, error = [], None, ""
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        rest = rest.strip()
        if kind == "addr" and rest and " " not in rest:
            addrs.append(rest)
        elif kind == "listen":
            if not (rest.isdigit() and 0 < int(rest) < 65536):
                raise ProbeError(f"the reach test's listener printed no port: {quote_output(rest)}")
            port = int(rest)
        elif kind == "nolisten":
            error = rest or "it printed nothing"
    if port is None and not error:
        raise ProbeError(f"unexpected reach listener output: {quote_output(text)}")
    return Listen(port, tuple(dict.fromkeys(addrs)), parse_interface(text), error)


def parse_reach(text: str) -> Reach | None:
    """Another host's reach section (`to ADDR ok|WHY` lines, or `untested STATUS WHY`) -> Reach;
    None when the host has no python3 to test with."""
    if _not_installed(text):
        return None
    tried = []
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "untested":
            status, _, why = rest.partition(" ")
            return Reach(untested=why.strip() or "not tested", status="warn" if status == "warn" else "error")
        addr, _, res = rest.strip().partition(" ")
        if kind == "to" and addr:
            tried.append((addr, res.strip() or "no result"))
    if not tried:
        raise ProbeError(f"unexpected reach test output: {quote_output(text)}")
    return Reach(tuple(tried))


class PathInfo(TypedDict):
    PATH: str
    JOBPATH: str | None
    tools: dict[str, str | None]
    supervisor: str | None


def parse_path(text: str) -> PathInfo:
    """The path section -> {'PATH': str, 'JOBPATH': str|None, 'tools': {label: path|None},
    'supervisor': python3's major.minor there, "" if none, None if the section did not say}."""
    path = re.search(r"^PATH=(.*)$", text, re.M)
    jobpath = re.search(r"^JOBPATH=(.*)$", text, re.M)

    tools: dict[str, str | None] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) == 3 and parts[0] in ("plain", "job", "fixed"):
            tools[parts[1]] = parts[2] or None
    if path is None:
        raise ProbeError(f"unexpected path probe output: {quote_output(text)}")
    return {"PATH": path.group(1), "JOBPATH": jobpath.group(1) if jobpath else None, "tools": tools,
            "supervisor": parse_python(text)}
