"""The supervisor's event loop: the head's listeners and connections, a member's link to the
head, this host's processes, all on one thread with epoll (Poller: no descriptor limit of 1024).

A connection that breaks the protocol (protocol.py), that has not authenticated within
HANDSHAKE_TIMEOUT, that sends a line longer than its limit, or whose handling raises anything
at all (RecursionError and MemoryError included) is closed and logged; the run goes on.
Before authentication at most MAX_PENDING connections plus one per host of the run are kept
(more are closed at once, as OpenSSH's MaxStartups; a member retries), and at most
MAX_WATCHERS watchers.
"""

from __future__ import annotations

import errno
import math
import os
import select
import stat
import time

try:   # CPython's C module: `socket` (and `selectors`, `re`) import enum, ~3.3 ms of CPU on every
    import _socket as socket  # start of a supervisor and every agent call (states.py says more)
except ImportError:   # pragma: no cover - another Python
    import socket  # type: ignore[no-redef]  # the same names as _socket's

from . import jsonc, protocol as proto
from .layout import TYPE_CHECKING, INFO, STATE, WAKE, attempt_dir, read_json, signal, write_atomic
from .procs import Local
from .states import RankState, RunState

if TYPE_CHECKING:
    from typing import Any

# What the head alone uses (the run's document, its deltas for watchers, its history): imported by
# head_modules() when this supervisor is the head. A member's start does without them: its import
# of the package 20.6 -> 19.5 ms of CPU (python3 -S, bytecode cached, medians of 60 alternating
# runs), 127 members at once at 128 hosts.
heads: Any = None    # orch_agent.head
deltas: Any = None   # orch_agent.delta
History: Any = None  # orch_agent.history.History


def head_modules():
    global heads, deltas, History
    if heads is None:
        # lazy: the head's alone (above)
        from . import delta, head
        from .history import History as history  # lazy: the head's alone
        heads, deltas, History = head, delta, history

TICK = 0.1         # the loop's turn while ranks' output grows or a stop is under way
IDLE_TICK = 1.0    # otherwise; woken at once by a message, a signal (a child's end: SIGCHLD) or a wrapped
                   # rank's start or end (rank.wake): 64 idle supervisors at 10 Hz took a tenth of a 2-core lab
HEARTBEAT = 1.0
FRESH_EVERY = 5.0  # the head rewrites state.json at least this often while nothing changes: `orch status`
                   # takes a document older than 15 s for a dead head's. Every heartbeat, it cost the head of
                   # an idle 128 x 8 run 3.6 ms of CPU (a 318 KB document) and its disk a writeback
PUBLISH_GAP = 0.2  # seconds at least between two publishes of the head's document (state.json, the watchers'
                   # deltas); the run's end at once. Each member's report changed it: at 32 x 8 the head wrote
                   # its 92 KB document 135-160 times in a 5-s run, half its CPU (at 128 x 8 four times the
                   # reports, each four times the bytes)
END_GATHER = 0.05  # seconds a member's report of ranks that ended well (others still running here) waits for
                   # more such ends: a host's 8 ranks of a 128 x 8 run ended 10-25 ms apart, each end its own
                   # report (1,016 for the head to check and merge in ~1.3 s); anything else goes out at once
MAX_PENDING = 64
MAX_WATCHERS = 64
OUT_LIMIT = 64 << 20     # bytes queued for a peer that reads nothing: then it is dropped
CONNECT_TIMEOUT = 3.0
NOTES_PER_MINUTE = 20
PER_SOURCE = 16          # unauthenticated connections kept from one address

now = time.time


def note(host, text):
    try:
        os.write(2, ("orch-agent %s: %s\n" % (host, text)).encode("utf-8", "replace"))
    except OSError:
        pass


# --------------------------------------------------------------------------- addresses

def local_addresses():
    """This host's IPv4 addresses but loopback's, from the kernel's routing tables
    (/proc/net/fib_trie: `|-- A` followed by `/32 host LOCAL`), in the order first seen."""
    out: list[str] = []
    try:
        with open("/proc/net/fib_trie") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return out
    for prev, line in zip(lines, lines[1:]):
        if "/32 host LOCAL" in line and "|--" in prev:
            addr = prev.split("|--", 1)[1].strip()
            if not addr.startswith("127.") and addr not in out:
                out.append(addr)
    return out


LOOPBACK = ("127.0.0.1", "localhost")


LISTEN_TRIES = 8   # ports tried: the one the kernel gives 127.0.0.1 may be taken on another address


def listen(addresses, pinned, backlog=256, first_port=0):
    """Listening sockets on one port, never on the wildcard address: on 127.0.0.1 (local clients),
    on each of `addresses` (the controller's, in preference order) that is this host's, and on the
    host's other addresses unless pinned, or when none of `addresses` is this host's (a NAT's or a
    name the hosts resolve elsewhere: the address still reaches us from outside). Returns
    (sockets, port, advertised addresses: `addresses` first, then the others listened on).
    The port is the one the kernel gives 127.0.0.1 (`first_port` first, when given); where it is
    in use on another address (a connection of this host's from that address and port), another
    port, up to LISTEN_TRIES. OSError when only loopback could be bound and the hosts are elsewhere."""
    port = first_port
    for _ in range(LISTEN_TRIES - 1):
        got = _listen_on(port, addresses, pinned, backlog, last=False)
        if got is not None:
            return got
        port = 0
    return _listen_on(port, addresses, pinned, backlog, last=True)


def _listen_on(port, addresses, pinned, backlog, last):
    """listen()'s try on `port` (0: the kernel's for 127.0.0.1). None, nothing left open, when
    not `last` and the port is another's on an address (EADDRINUSE)."""
    socks, busy = [], []

    def bind(addr, port):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((addr, port))
            s.listen(backlog)
            s.setblocking(False)
        except OSError as exc:
            s.close()
            if exc.errno == errno.EADDRINUSE:
                busy.append(addr)
            return None
        socks.append(s)
        return s.getsockname()[1]

    port = bind("127.0.0.1", port)
    given = [a for a in addresses if a not in LOOPBACK]
    if port is not None:
        bound = [a for a in given if bind(a, port)]
        if not pinned or (given and not bound):
            bound += [a for a in local_addresses() if a not in given and bind(a, port)]
        if (bound or not given) and not (busy and not last):
            return socks, port, (given + [a for a in bound if a not in given]) or ["127.0.0.1"]
    for s in socks:
        s.close()
    if busy and not last:
        return None   # another port
    if port is None:
        raise OSError("cannot listen on 127.0.0.1")
    raise OSError("cannot listen on %s, nor on any other address of this host" % ", ".join(given))


# --------------------------------------------------------------------------- connections

class Conn:
    """One TCP peer: the handshake's plain lines first, then sealed frames."""

    def __init__(self, sock, limit=proto.PREAUTH_LINE):
        self.sock = sock
        self.sel = None           # the selector it is registered with (unregistered before closing)
        self.lines = proto.Lines(limit)
        self.out = bytearray()
        self.closed = False
        self.authed = False
        self.role = None
        self.host = None
        self.stage = "hello"
        self.nc = self.ns = None
        self.rx = self.tx = None
        self.born = self.last = now()
        try:
            self.peer_ip, port = sock.getpeername()[:2]
            self.peer = "%s:%s" % (self.peer_ip, port)
            self.local_addr = sock.getsockname()[0]
        except OSError:
            self.peer, self.peer_ip, self.local_addr = "?", None, None
        sock.setblocking(False)

    def fileno(self):
        return self.sock.fileno()

    def authenticated(self, rx_key, tx_key, limit):
        self.rx, self.tx = proto.Sealer(rx_key), proto.Sealer(tx_key)
        self.authed = True
        self.lines.limit = limit

    def send(self, m):
        if self.closed:
            return
        self.out += self.tx.seal(m) if self.tx is not None else proto.encode(m) + b"\n"
        self.flush()

    def flush(self):
        while self.out and not self.closed:
            try:
                n = self.sock.send(self.out)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.close()
                return
            del self.out[:n]
        if len(self.out) > OUT_LIMIT:
            self.close()

    def recv_lines(self):
        """New complete lines; [] and closed on EOF or error. ProtocolError for an over-long line."""
        try:
            data = self.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return self.lines.feed(b"")   # what came complete before the end still counts
        self.last = now()
        return self.lines.feed(data)

    def message(self, line, limit):
        return self.rx.open(line, limit) if self.rx is not None else proto.decode(line, proto.PREAUTH_LINE)

    def register(self, sel):
        sel.register(self, self)
        self.sel = sel

    def close(self):
        if not self.closed:
            self.closed = True
            if self.sel is not None:   # before the descriptor can be reused by the next accept
                try:
                    self.sel.unregister(self)
                except (KeyError, ValueError, OSError):
                    pass
                self.sel = None
            try:
                self.sock.close()
            except OSError:
                pass


def connect(address, port, timeout):
    """socket.create_connection((address, port), timeout) with TCP_NODELAY: each address the
    name gives, in order, until one answers; OSError (the last one's) when none does."""
    err: OSError | None = None
    for family, sockaddr in addresses_of(address, int(port)):
        s = socket.socket(family, socket.SOCK_STREAM)
        try:
            s.settimeout(timeout)
            s.connect(sockaddr)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError as exc:
            err = exc
            s.close()
    raise err or OSError(errno.EHOSTUNREACH, "%s: no address" % address)


def addresses_of(address, port):
    """[(family, sockaddr)] to connect to: an IPv4 or IPv6 address as it is; a name through
    getaddrinfo, given as bytes when ASCII (a str host goes through the idna codec first, which
    imports re and unicodedata: ~1 ms of every member's start)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, address)
        except (OSError, ValueError):
            continue
        return [(family, (address, port) if family == socket.AF_INET else (address, port, 0, 0))]
    host = address.encode("ascii") if address.isascii() else address
    return [(f, sa) for f, _, _, _, sa in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)]


def accept(listener):
    """listener.accept() of socket.socket, on the C module's socket: (the new socket, its peer's
    address); BlockingIOError when none is waiting."""
    fd, addr = listener._accept()
    try:
        return socket.socket(listener.family, socket.SOCK_STREAM, 0, fd), addr
    except BaseException:
        os.close(fd)
        raise


class Key:
    """A registered descriptor (selectors.SelectorKey's fields that the loop reads)."""
    __slots__ = ("fileobj", "fd", "data")

    def __init__(self, fileobj, fd, data):
        self.fileobj, self.fd, self.data = fileobj, fd, data


class Poller:
    """selectors.DefaultSelector for reading alone (register, unregister, select; KeyError and
    ValueError where it raises them, for descriptors and objects with fileno()), on select.epoll,
    or select.poll where there is none; `selectors` imports collections
    and, through its namedtuple, more (its import ~0.5 ms of every start). Any number of
    descriptors (no select() limit of 1024)."""

    def __init__(self):
        self.epoll = hasattr(select, "epoll")
        self.impl: Any = select.epoll() if self.epoll else select.poll()
        self.keys: dict[int, Key] = {}

    def fd_of(self, fileobj):
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        if fd < 0:   # closed: found by the object (as selectors does)
            for key in self.keys.values():
                if key.fileobj is fileobj:
                    return key.fd
            raise ValueError("Invalid file descriptor: %d" % fd)
        return fd

    def register(self, fileobj, data):
        fd = self.fd_of(fileobj)
        if fd in self.keys:
            raise KeyError("%r (fd %d) is already registered" % (fileobj, fd))
        self.impl.register(fd, select.EPOLLIN if self.epoll else select.POLLIN)
        self.keys[fd] = Key(fileobj, fd, data)

    def unregister(self, fileobj):
        key = self.keys.pop(self.fd_of(fileobj))
        try:
            self.impl.unregister(key.fd)
        except (OSError, KeyError):   # closed already: the kernel forgot it
            pass
        return key

    def select(self, timeout=None):
        """[(key, events)] of the descriptors ready within `timeout` seconds (None: no limit),
        rounded up to the millisecond as selectors does (no busy wait on a sub-millisecond rest)."""
        if timeout is None:
            ms = -1
        elif timeout <= 0:
            ms = 0
        else:
            ms = math.ceil(timeout * 1e3)
        if self.epoll:
            ready = self.impl.poll(ms / 1e3 if ms >= 0 else -1, max(len(self.keys), 1))
        else:
            ready = self.impl.poll(ms if ms >= 0 else None)
        return [(self.keys[fd], ev) for fd, ev in ready if fd in self.keys]

    def close(self):
        if self.epoll:
            self.impl.close()
        self.keys.clear()


def _read_line(sock, buf, deadline, limit):
    while b"\n" not in buf:
        left = deadline - now()
        if left <= 0:
            raise proto.ProtocolError("the head did not answer in time")
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except socket.timeout:
            raise proto.ProtocolError("the head did not answer in time") from None
        if not data:
            raise proto.ProtocolError("the head closed the connection")
        buf += data
        if b"\n" not in buf and len(buf) > limit:
            raise proto.ProtocolError("an over-long line during the handshake")
    if buf.index(b"\n") > limit:
        raise proto.ProtocolError("an over-long line during the handshake")
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def client_handshake(sock, token, run, role, host, limit, timeout=proto.HANDSHAKE_TIMEOUT):
    """The client's side of the handshake (blocking, bounded by `timeout`). The head's proof is
    checked before this side proves anything. Returns the authenticated Conn (non-blocking).
    Raises ProtocolError (a wrong head, refused) or OSError."""
    deadline = now() + timeout
    nc = proto.new_nonce()
    sock.sendall(proto.encode(proto.hello(role, host, run, nc)) + b"\n")
    buf = bytearray()
    ch = proto.parse_challenge(proto.decode(_read_line(sock, buf, deadline, proto.PREAUTH_LINE), proto.PREAUTH_LINE))
    if not proto.compare_digest(ch["proof"], proto.server_proof(token, run, nc, ch["nonce"])):
        raise proto.ProtocolError("the process on the head's port could not prove it is the run's head")
    sock.sendall(proto.encode(proto.auth(proto.client_proof(token, run, role, host, nc, ch["nonce"]))) + b"\n")
    proto.parse_welcome(proto.decode(_read_line(sock, buf, deadline, proto.PREAUTH_LINE), proto.PREAUTH_LINE))
    c2s, s2c = proto.session_keys(token, nc, ch["nonce"])
    sock.settimeout(None)
    conn = Conn(sock, limit)
    conn.authenticated(s2c, c2s, limit)
    if buf:
        conn.lines.buf += buf
    return conn


def open_client(addresses, port, token, run, role, host, limit, timeout=CONNECT_TIMEOUT):
    """Connect and authenticate to the head on the first of `addresses` that answers.
    Returns (Conn, address). Raises OSError or ProtocolError (the last one met)."""
    err: Exception | None = None
    for addr in addresses:
        try:
            sock = connect(addr, port, timeout)
        except OSError as exc:
            err = exc
            continue
        try:
            return client_handshake(sock, token, run, role, host, limit), addr
        except (OSError, proto.ProtocolError) as exc:
            sock.close()
            err = exc
    raise err or OSError(errno.EHOSTUNREACH, "no address to try")


# --------------------------------------------------------------------------- the supervisor


_ENDED = ("end", "exit_code", "state")


def good_ends_only(before, after):
    """Is all that differs between two (member state, report) pairs ranks (and their processes)
    that exited 0, by themselves (no stop under way), while another rank still runs here (and
    the output's figures, which move with them)? Those reports may wait to be gathered
    (END_GATHER); a failure, a stop, the last rank's end or anything else may not."""
    if before is None or before[0] != after[0]:
        return False
    a, b = before[1], after[1]
    if a.keys() != b.keys() or any(
            a[k] != b[k] for k in a if k not in ("ranks", "procs", "out", "progress")):
        return False
    for old, new in zip(a["ranks"] + a["procs"], b["ranks"] + b["procs"]):
        if old != new and not (old.get("end") is None and new.get("exit_code") == 0 and not new.get("signal")
                               and new.get("state", RankState.EXITED) == RankState.EXITED
                               and {k: v for k, v in old.items() if k not in _ENDED}
                               == {k: v for k, v in new.items() if k not in _ENDED}):
            return False
    return (len(a["ranks"]), len(a["procs"])) == (len(b["ranks"]), len(b["procs"])) and a["ranks"] != b["ranks"] \
        and any(r.get("state") == RankState.RUNNING for r in b["ranks"])   # an end, and a rank still running

class Supervisor:
    """This host's supervisor of the run: the head (cfg role "head") or a member."""

    def __init__(self, cfg, listeners=(), lock_fd=None, advertised=()):
        self.cfg = cfg
        self.host = cfg["host"]
        self.rundir = cfg["rundir"]
        self.is_head = cfg["role"] == "head"
        self.token = cfg["token"]
        self.run_id = cfg["run_id"]
        self.grace = float(cfg.get("grace", 5))
        self.lost_after = float(cfg.get("lost_after", 10))
        self.local = Local(cfg, lambda text: note(self.host, text))
        self.lock_fd = lock_fd
        self.sel = Poller()
        self.listeners = list(listeners)
        for s in self.listeners:
            self.sel.register(s, "listen")
        self.conns = []
        self.done = False
        self.stop_request = None
        self.last_beat = 0.0
        self.events = []
        self.notes = [0.0, 0, 0]       # drop_note(): [window start, lines this window, lines not logged]
        self.paused_until = 0.0        # listeners not polled until then (out of descriptors)
        self.member_hosts = set()      # hosts whose member has authenticated (a second join is refused)
        self.head = None
        self.head_conn = None
        self.head_used = None
        self.member_state = RunState.RUNNING
        self.exiting = False
        self.wake_fds = []             # open_wake(): [signals' read end, its write end, the FIFO, its writer]
        self.polled = 0.0              # when local.poll() last ran
        self.published_at = None      # the head: when it last published its document (time.monotonic)
        self.publish_due = None        # ... when a change held back (PUBLISH_GAP) is to go out
        self.published_end = False     # ... and whether it has published the run's end
        self.saved_at = 0.0            # the head: when it last wrote its document (time.monotonic) ...
        self.saved_merged = -1         # ... and how many reports it had merged then (head.merged)
        self.sent = None               # (state, report) this host last sent (the head: merged as its own)
        self.gather_until = None       # a member: when its report of ranks that ended well goes out (END_GATHER;
                                       # time.monotonic)
        if self.is_head:
            cfg = dict(cfg, head_addresses=list(advertised) or cfg.get("head_addresses") or [])
            head_modules()
            self.head = heads.Head(cfg, now())
            self.published = deltas.Publisher(self.head.doc)   # what the watchers have: deltas follow
            self.history = History(self.rundir, len(cfg["all_ranks"]), lambda text: note(self.host, text))
        self.local.write_secrets()
        self.save()

    # ---- documents
    def document(self, report=None):
        if self.head is not None:   # the head's (is_head)
            return self.head.doc
        return {"v": proto.STATE_VERSION, "orch": self.cfg.get("orch_version"), "run": self.run_id,
                "host": self.host, "role": "member", **(report or self.local.report()), "state": self.member_state,
                "head_address": self.head_used}

    def save(self, report=None):
        if self.head is not None:
            self.saved_at, self.saved_merged = time.monotonic(), self.head.merged
        doc = dict(self.document(report), agent_pid=os.getpid(), updated=now())
        try:
            write_atomic(os.path.join(self.rundir, STATE), jsonc.dumps(doc), 0o666)
        except (OSError, ValueError) as exc:
            note(self.host, "cannot write state: %s" % exc)

    # ---- signals
    def request_stop(self, reason):
        if self.stop_request is None:
            self.stop_request = reason
            if self.is_head:
                self.events.append(heads.stop_asked(reason))

    def install_signals(self):
        signal.signal(signal.SIGTERM, lambda *a: self.request_stop("a signal (SIGTERM) to the run's supervisor"))
        signal.signal(signal.SIGINT, lambda *a: self.request_stop("a signal (SIGINT) to the run's supervisor"))
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGCHLD, self.local.collect)   # each child's end noted as it comes

    def open_wake(self):
        """What wakes the loop before its turn: signals (signal.set_wakeup_fd: SIGCHLD, a stop) and
        the run directory's FIFO (layout.WAKE, 0600), where `agent.py rank` writes a byte once a
        rank's pid or end is written. The loop holds a writer of its own, so the FIFO never reads
        as ended. Without them (no FIFO can be made) the loop still reads everything each turn."""
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self.wake_fds = [r, w]
        self.sel.register(r, "wake")
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        path = os.path.join(self.rundir, WAKE)
        try:
            try:
                os.mkfifo(path, 0o600)
            except FileExistsError:
                if not stat.S_ISFIFO(os.lstat(path).st_mode):
                    raise OSError("%s is not a FIFO" % path) from None
            fifo = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
            self.wake_fds += [fifo, os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)]
            self.sel.register(fifo, "wake")
        except OSError as exc:
            note(self.host, "no wake-up FIFO (ranks' ends are read each second): %s" % exc)

    def close_wake(self):
        if self.wake_fds:
            signal.set_wakeup_fd(-1)
        for fd in self.wake_fds:
            try:
                self.sel.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass
            os.close(fd)
        if len(self.wake_fds) > 2:
            try:
                os.unlink(os.path.join(self.rundir, WAKE))
            except OSError:
                pass
        self.wake_fds = []

    # ---- the loop
    def loop(self):
        self.install_signals()
        self.open_wake()
        try:
            if not self.is_head:
                self.join()
            while not self.done:
                woken = self.io(self.wait())
                changed = False
                # a message alone changes nothing here, unless it started or stopped something
                if woken or self.local.changed or now() - self.polled >= TICK:
                    self.polled = now()
                    changed = self.local.poll()
                self.tick(changed)
            if self.publish_due is not None:   # a change still held back: the last word is whole
                self.publish()
        finally:
            self.close_wake()

    def tick(self, changed):
        """The rest of a turn of the loop: a stop's progress, then the head's or the member's part."""
        looked = None   # what a stop's look found of the run's processes here, this turn
        if self.local.stopping is not None:
            changed = self.local.stop_tick() or changed
            looked = self.local.alive
        if self.is_head:
            self.head_tick(changed)
        else:
            self.member_tick(changed, looked)

    def wait(self):
        """How long the loop may wait for something to happen: TICK while output grows, a stop is
        under way or the head is between attempts (time alone moves those on); else until the
        next heartbeat is due, at most IDLE_TICK."""
        gathered = IDLE_TICK if self.gather_until is None else max(0.0, self.gather_until - time.monotonic())
        if self.local.stopping is not None or self.local.grew or (
                self.head is not None and self.head.phase != heads.Phase.RUN):
            return min(TICK, gathered)
        due = min(self.last_beat + HEARTBEAT - now(), gathered)
        if self.publish_due is not None:
            due = min(due, self.publish_due - time.monotonic())
        return max(0.0, min(IDLE_TICK, due))

    def io(self, timeout):
        """Wait up to `timeout` for the network, signals or the wake FIFO, and handle what came.
        True when woken by a signal or the FIFO (local.poll() has something to read)."""
        self.resume_listeners()
        try:
            ready = self.sel.select(timeout)
        except InterruptedError:
            ready = []
        woken = False
        for key, _ in ready:
            if key.data == "wake":
                woken = True
                drain(key.fd)
                continue
            if key.data == "listen":
                try:
                    self.accept(key.fileobj)
                except Exception as exc:  # noqa: BLE001 - a failed accept costs that peer only
                    note(self.host, "accepting a connection: %s: %s" % (type(exc).__name__, str(exc)[:200]))
                continue
            conn = key.data
            if conn.closed:
                continue
            try:
                for line in conn.recv_lines():
                    if conn.closed:
                        break
                    self.on_line(conn, line)
            except Exception as exc:  # noqa: BLE001 - one connection's fault, whatever it is, is its own
                self.drop(conn, "%s: %s" % (type(exc).__name__, str(exc)[:200]))
        t = now()
        for conn in list(self.conns):
            if not conn.authed and not conn.closed and t - conn.born > proto.HANDSHAKE_TIMEOUT:
                self.drop(conn, "no authentication within %gs" % proto.HANDSHAKE_TIMEOUT)
            if conn.closed:
                self.forget(conn)
            else:
                conn.flush()
        return woken

    def accept(self, listener):
        """Take new connections. Before authentication at most MAX_PENDING + one per host are kept,
        at most PER_SOURCE from one address: a newcomer beyond either cap evicts the oldest
        unauthenticated connection (of its own address first), so a flood cannot keep the run's
        own peers out, only make them retry. Out of descriptors: the listeners pause a second."""
        assert self.head is not None  # only the head listens
        for _ in range(64):
            try:
                sock, addr = accept(listener)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.pause_listeners("cannot accept a connection: %s" % exc)
                return
            pending = [c for c in self.conns if not c.authed]
            same = [c for c in pending if c.peer_ip == addr[0]]
            if len(same) >= PER_SOURCE:
                self.drop(same[0], "evicted: %d unauthenticated connections from %s" % (len(same) + 1, addr[0]))
            elif len(pending) >= MAX_PENDING + len(self.head.hosts):
                self.drop(pending[0], "evicted: %d unauthenticated connections" % (len(pending) + 1))
            conn = Conn(sock)
            conn.register(self.sel)
            self.conns.append(conn)

    def pause_listeners(self, why):
        """No descriptor left: stop polling the listeners for a second (they would be readable at
        once, every time) and say so once."""
        if self.paused_until:
            return
        self.paused_until = now() + 1.0
        for s in self.listeners:
            try:
                self.sel.unregister(s)
            except (KeyError, ValueError):
                pass
        self.drop_note(why + "; not accepting for 1 s")

    def resume_listeners(self):
        if self.paused_until and now() >= self.paused_until:
            self.paused_until = 0.0
            for s in self.listeners:
                try:
                    self.sel.register(s, "listen")
                except (KeyError, ValueError, OSError):
                    pass

    def drop(self, conn, why):
        """Close one connection, and say why in agent.log (drop_note)."""
        if not conn.closed:
            self.drop_note("closed the connection from %s%s: %s" % (
                conn.peer, " (%s %s)" % (conn.role, conn.host or "") if conn.role else "", why))
        self.forget(conn)

    def drop_note(self, text):
        """A line in agent.log about a peer: at most NOTES_PER_MINUTE a minute (a flood of bad
        connections must not fill the disk), then how many more there were."""
        t = now()
        if t - self.notes[0] >= 60:
            if self.notes[2]:
                note(self.host, "%d more such lines in the last minute (not logged one by one)" % self.notes[2])
            self.notes = [t, 0, 0]
        self.notes[1] += 1
        if self.notes[1] <= NOTES_PER_MINUTE:
            note(self.host, text)
        else:
            self.notes[2] += 1

    def forget(self, conn):
        conn.close()
        if conn in self.conns:
            self.conns.remove(conn)
            if self.is_head and conn.authed and conn.role == "member":
                self.events.append(heads.gone(conn.host))

    # ---- head: the handshake and the members' messages
    def on_line(self, conn, line):
        if self.head_conn is not None and conn is self.head_conn:   # a member: its link to the head
            return self.on_head_message(conn.message(line, proto.LINE))
        if conn.authed:
            t, fields = proto.parse(proto.TO_HEAD[conn.role], conn.message(line, proto.LINE))
            if conn.role == "member":
                if t == "report":
                    if fields["report"]["host"] != conn.host:
                        raise proto.ProtocolError("a report for host %r from %s"
                                                  % (fields["report"]["host"], conn.host))
                    self.events.append(heads.reported(conn.host, fields["report"]))
                    return
                self.events.append(heads.reported(conn.host, {"attempt": -1}))  # a sign of life
            if t == "stop":
                self.events.append(heads.stop_asked(fields["reason"]))
            return
        m = conn.message(line, proto.PREAUTH_LINE)
        assert self.head is not None  # only the head has unauthenticated connections
        if conn.stage == "hello":
            h = proto.parse_hello(m)
            if h["run"] != self.run_id:
                conn.send(proto.refused("this port serves another run"))
                raise proto.ProtocolError("hello for run %r" % h["run"][:40])
            if h["role"] == "member" and h["host"] not in self.head.hosts:
                raise proto.ProtocolError("hello from %r, not a host of this run" % (h["host"] or "")[:60])
            conn.role, conn.host, conn.nc = h["role"], h["host"], h["nonce"]
            conn.ns = proto.new_nonce()
            conn.stage = "auth"
            conn.send(proto.challenge(conn.ns, proto.server_proof(self.token, self.run_id, conn.nc, conn.ns)))
            return
        if conn.stage == "auth":
            proof = proto.parse_auth(m)
            want = proto.client_proof(self.token, self.run_id, conn.role, conn.host, conn.nc, conn.ns)
            if not proto.compare_digest(proof, want):
                raise proto.ProtocolError("authentication failed")
            if conn.role == "member" and (conn.host in self.member_hosts or not self.head.can_join(conn.host)):
                conn.send(proto.refused("host %s has joined this run already" % conn.host))
                conn.flush()
                raise proto.ProtocolError("a second join for host %s refused" % conn.host)
            if conn.role != "member" and sum(1 for c in self.conns if c.authed and c.role != "member") >= MAX_WATCHERS:
                raise proto.ProtocolError("too many watchers")
            conn.send(proto.welcome())
            c2s, s2c = proto.session_keys(self.token, conn.nc, conn.ns)
            conn.authenticated(c2s, s2c, proto.LINE)
            conn.stage = "ok"
            if conn.role == "member":
                self.member_hosts.add(conn.host)
                self.events.append(heads.joined(conn.host, conn.local_addr))
                if self.head.phase == heads.Phase.RUN and conn.host in self.head.active:
                    conn.send(self.start_message(conn.host))   # joined late: start with everyone else
                elif self.head.phase == heads.Phase.DONE:
                    conn.send(proto.exit_(self.head.doc["state"]))
            else:   # a watcher, or a control (`agent.py stop`) waiting for the run's end
                if not self.watched(but=conn):   # no one follows the deltas: start them from now
                    self.published = deltas.Publisher(self.head.doc)
                seq, doc = self.published.snapshot()
                conn.send(proto.state(doc, seq))
            return
        raise proto.ProtocolError("unexpected stage")

    def head_tick(self, changed):
        events, self.events = self.events, []
        if changed or now() - self.last_beat >= HEARTBEAT:
            rep = self.fresh_report()
            if rep is not None:
                events.append(heads.reported(self.host, rep))
        assert self.head is not None  # head_tick runs on the head
        turn = time.monotonic()
        _, actions = heads.decide(self.head, events, now())
        for a in actions:
            self.act(a)
        if self.publish_due is not None and time.monotonic() >= self.publish_due:
            self.publish()
        if now() - self.last_beat >= HEARTBEAT:
            self.last_beat = now()
            if self.published_at is None or self.published_at < turn:   # nothing went out this turn
                # a change held back (PUBLISH_GAP), the figures merged since the last write
                # (reports), or the time for a fresh one
                self.publish(save=self.publish_due is not None or self.saved_merged != self.head.merged
                             or time.monotonic() - self.saved_at >= FRESH_EVERY)
            self.broadcast(proto.heartbeat())   # members tell a silent head from a lost one

    def act(self, a):
        kind = a[0]
        if kind == "start":
            k, address, setup = a[1], a[2], a[3]
            assert self.head is not None   # only the head acts
            active = set(self.head.active)
            for c in self.conns:
                if c.authed and c.role == "member" and c.host in active:
                    c.send(self.start_message(c.host))
            self.local.start(k, address, files=proto.unpack_files(setup["files"]), replaced=setup["replaced"])
            self.events.append(heads.reported(self.host, self.local.report()))
        elif kind == "stop":
            self.broadcast(proto.stop(a[1]))
            self.local.restop(a[1], self.grace)
        elif kind == "dump":
            self.broadcast(proto.dump())
            self.local.dump_stacks()
        elif kind == "exit":
            self.broadcast(proto.exit_(a[1]))
        elif kind == "launcher_failed":
            self.quote_launcher(a[1], a[2])
        elif kind == "publish":
            self.publish_soon()
        elif kind == "done":
            self.done = True

    def start_message(self, host):
        """The current attempt's start, as `host` of it gets it (head.attempt_setup)."""
        head = self.head
        assert head is not None   # only the head starts attempts
        setup = head.setup
        files = setup.get("files", "") if setup.get("files_to") == "all" else ""
        return proto.start(head.doc["attempt"], head.doc["head_address"] or "", setup.get("slots", {}).get(host),
                           files, setup.get("replaced", ""))

    def quote_launcher(self, key, host):
        """A failed launcher: where its own output is, and (on this host) how it ends."""
        assert self.head is not None  # the head starts the launchers
        log = os.path.join(attempt_dir(self.rundir, self.head.doc["attempt"]), "%s.log" % key.split(".")[0])
        said = tail_lines(log) if host == self.host else ""
        extra = (", saying:\n%s\n  (all it said: %s)" % (said, log)) if said else " (its own output: %s)" % log
        self.head.doc["message"] += extra
        self.head.doc["attempts"][-1]["message"] += extra
        assert self.head.outcome is not None  # decide() ended the attempt with the launcher's failure
        self.head.outcome = (self.head.outcome[0], self.head.outcome[1] + extra)

    def broadcast(self, m, roles=("member",)):
        for c in self.conns:
            if c.authed and c.role in roles:
                c.send(m)

    def watched(self, but=None):
        return any(c.authed and c.role in ("watcher", "control") and c is not but for c in self.conns)

    def publish_soon(self):
        """Publish the head's changed document now, or PUBLISH_GAP after the last publish (the
        loop's wait() wakes for it); the run's end at once (what changes after it, the members'
        last reports, with the gap again)."""
        assert self.head is not None  # the head publishes its document
        t = time.monotonic()
        if (self.published_at is None or t - self.published_at >= PUBLISH_GAP
                or (RunState(self.head.doc["state"]).is_terminal and not self.published_end)):
            self.publish()
        elif self.publish_due is None:
            self.publish_due = self.published_at + PUBLISH_GAP

    def publish(self, save=True):
        """The head's document out: written as state.json (`save`; a heartbeat's publish writes it
        only when it changed or grew old) and, to the watchers, what changed of it."""
        assert self.head is not None  # the head publishes its document
        self.published_at, self.publish_due = time.monotonic(), None
        if save:
            self.save()
        ended = RunState(self.head.doc["state"]).is_terminal
        self.published_end = self.published_end or ended
        self.history.maybe(self.head.doc, now(), ended)
        if self.watched():   # once the run has ended nothing is held back: the last word is whole
            change = self.published.next(self.head.doc, None if ended else now())
            if change:
                self.broadcast(proto.delta(*change), roles=("watcher", "control"))

    # ---- member
    def join(self):
        deadline = now() + float(self.cfg.get("join_timeout", 60))
        addresses = list(self.cfg.get("head_addresses") or [self.cfg.get("head_address")])
        port = self.cfg["head_port"]
        err: Exception | None = None
        while now() < deadline and self.stop_request is None:
            try:
                conn, addr = open_client(addresses, port, self.token, self.run_id, "member", self.host, proto.LINE)
            except proto.ProtocolError as exc:   # another process on that port, or a refusal: retry
                err = exc
                time.sleep(0.5)
                continue
            except OSError as exc:
                err = exc
                time.sleep(0.5)
                continue
            self.head_conn, self.head_used = conn, addr
            conn.register(self.sel)
            write_info(self.rundir, self.cfg, head_address=addr)
            return
        if self.stop_request is not None:
            note(self.host, "stopped by %s before joining the run's head" % self.stop_request)
            self.member_state = RunState.STOPPED
            self.save()
            self.done = True
            return
        note(self.host, "could not reach the run's head at %s port %s: %s"
             % (", ".join(str(a) for a in addresses), port, err))
        self.member_state = RunState.LOST
        self.save()
        self.done = True

    def on_head_message(self, m):
        t, f = proto.parse(proto.TO_MEMBER, m)
        if t == "start":
            self.local.start(f["attempt"], f["head_address"], f["slot"], f["files"], f["replaced"])
        elif t == "stop":
            self.local.stop(f["reason"], self.grace)
        elif t == "dump":
            self.local.dump_stacks()
        elif t == "exit":
            st = f["state"]
            self.member_state = st if st in {s.value for s in RunState} else RunState.STOPPED
            self.local.stop("the run ended", self.grace)
            self.exiting = True

    def member_tick(self, changed, looked=None):
        """`looked`: whether processes of the run live here, as this turn's stop_tick found (each
        look reads every process's environment: the end and the last report take its answer)."""
        hc = self.head_conn
        if hc is None:
            return
        lost = hc.closed or now() - hc.last > self.lost_after
        if lost and not self.exiting:
            if self.local.stopping is None:
                note(self.host, "lost the run's head (%s): stopping this host's ranks" % self.head_used)
                self.member_state = RunState.LOST
                self.local.stop_state = RankState.LOST
                self.local.stop("lost contact with the launch host", self.grace)
            self.exiting = True
        if self.stop_request and self.local.stopping is None:
            self.local.stop(self.stop_request, self.grace)
            hc.send(proto.stop(self.stop_request))
        beat_due = now() - self.last_beat >= HEARTBEAT
        if changed or beat_due or (self.gather_until is not None and time.monotonic() >= self.gather_until):
            rep = self.fresh_report()
            if rep is not None or beat_due or self.gather_until is None:   # ends gathered: nothing yet
                self.last_beat = now()
                if rep is None:
                    hc.send(proto.heartbeat())
                else:
                    hc.send(proto.report(rep))
                    self.save(rep)
        if not self.exiting:
            return
        if looked is None:   # no stop's look this turn (none under way, or begun in this one)
            looked = self.local.live()
        if self.local.stopping is None or not looked:
            self.local.finish_pending(self.local.stop_state)
            if self.member_state == RunState.RUNNING:
                self.member_state = RunState.STOPPED
            last = self.local.report()
            last["left_nothing"] = not looked   # the head records it: status asks this host no more
            hc.send(proto.report(last))
            hc.flush()
            self.save()
            self.done = True

    def fresh_report(self):
        """This host's report when it differs from the last one sent, else None: then a member
        sends a heartbeat alone (the head counts it a sign of life) and writes no document. An
        idle member of a 128 x 8 run sent and saved a 3.7 KB report every second, and its head
        checked and merged 127 of them a second."""
        rep = self.local.report()
        said = (self.member_state, rep)   # the member's own state goes into its document with it
        if said == self.sent:
            self.gather_until = None
            return None
        if self.head is None and (self.gather_until is None or time.monotonic() < self.gather_until) \
                and good_ends_only(self.sent, said):
            if self.gather_until is None:   # held back, END_GATHER at most from the first of them
                self.gather_until = time.monotonic() + END_GATHER
            return None
        self.sent, self.gather_until = said, None
        return rep

    # ---- a crash
    def crashed(self, exc):
        """Anything unexpected: this host's ranks are stopped and the final state names the error;
        the head's crash ends the run on every host (members see its connection close)."""
        what = "%s: %s" % (type(exc).__name__, str(exc)[:300])
        self.local.stop_state = RankState.STOPPED
        self.local.kill_now(self.grace)
        message = ("the run's supervisor on %s crashed (%s; its traceback is in %s); this host's ranks were "
                   "stopped" % (self.host, what, os.path.join(self.rundir, "agent.log")))
        try:
            if self.head is not None:   # the head's (is_head)
                doc = self.head.doc
                try:   # this host's ranks as they ended (their pids, codes)
                    heads._merge(self.head, self.host, self.local.report())
                except Exception:  # noqa: BLE001 - best effort: the crash is recorded either way
                    pass
                for r in doc["ranks"]:
                    if r.get("end") is None:
                        r.update(state=RankState.STOPPED if r["host"] == self.host else RankState.LOST, end=now())
                if not RunState(doc["state"]).is_terminal:
                    doc.update(state=RunState.FAILED, message=message, ended=now())
                    if doc["attempts"] and doc["attempts"][-1]["state"] == RunState.RUNNING:
                        doc["attempts"][-1].update(state=RunState.FAILED, end=now(), message=message)
                self.broadcast(proto.exit_(doc["state"]))
                for c in self.conns:
                    c.flush()
            else:
                self.member_state = RunState.FAILED
            self.save()
        except Exception as exc2:  # noqa: BLE001 - a crash while recording a crash: noted, not raised
            note(self.host, "could not record the crash: %r" % exc2)
        for c in list(self.conns) + ([self.head_conn] if self.head_conn else []):
            c.close()
        self.local.drop_secrets()


def drain(fd, most=1 << 16):
    """Read what a wake-up descriptor holds (non-blocking; its bytes mean nothing but "look")."""
    got = 0
    while got < most:
        try:
            data = os.read(fd, 4096)
        except OSError:   # drained (EAGAIN), or gone
            return
        if not data:
            return
        got += len(data)


def write_info(rundir, cfg, **more):
    """agent.json: how local clients (watch, stop) reach the run's head; it holds the run's token
    (0600, in a 0700 directory)."""
    info = {k: cfg.get(k) for k in ("run_id", "host", "role", "head_addresses", "head_port", "launcher", "token")}
    write_atomic(os.path.join(rundir, INFO), jsonc.dumps(dict(info, **more)), 0o600)


def read_info(rundir):
    doc = read_json(os.path.join(rundir, INFO), 1 << 16)
    return doc if isinstance(doc, dict) else None


def tail_lines(path, lines=12, limit=2000):
    """What a failed launcher said last, from its own log (launcher_words)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            fh.seek(max(0, fh.tell() - 16384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    from .words import launcher_words   # lazy: the head's, for a failed launcher alone
    return launcher_words(text, lines, limit)
