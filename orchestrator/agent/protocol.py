"""The wire between a run's supervisors: the head listens; members (the other hosts'
supervisors), watchers (`agent.py watch`, the controller's one stream) and controls
(`agent.py stop`) connect. Newline-delimited JSON objects, each of a known type.

Handshake (mutual; the run's token never crosses the wire; fresh nonces both ways):

    client -> head   hello     {v, role, host, run, nonce}             (plain JSON line)
    head -> client   challenge {v, nonce, proof: H(token, "server", run, nc, ns)}
    client -> head   auth      {proof: H(token, "client", run, role, host, nc, ns)}
    head -> client   welcome   {}  |  refused {why}

The client checks the head's proof before it proves anything itself, so a process that took
over the head's port learns nothing. After `welcome` every frame is `MAC JSON\\n`, the MAC an
HMAC-SHA256 over a per-direction sequence number and the JSON, keyed per connection and
direction from both nonces: a frame cannot be replayed, reordered, moved to another
connection or reflected back.

After the handshake:

    member -> head   report {report}        this host's ranks and processes (every second, on change;
                                            the last one says `left_nothing`: no process of the run is left)
                     stop   {reason}        this host was asked to stop the run
    watcher/control -> head
                     stop   {reason}
    head -> member   start  {attempt, head_address}
                     stop   {reason}
                     dump   {}              capture every rank's stack (a stall)
                     exit   {state}         the run is over
                     hb     {}              the head is alive
    head -> watcher, control
                     state  {seq, state}    the run's document (states.py, head.py), on connect
                     delta  {seq, delta}    what changed since seq - 1 (delta.py), on every change

Limits: a line before authentication is at most PREAUTH_LINE bytes and the handshake must be
over within HANDSHAKE_TIMEOUT seconds (server.py enforces both, and a cap on connections);
after it, at most LINE bytes (a watcher reads the head's whole document: WATCH_LINE).
Anything else - not JSON, not an object, an unknown type, a missing or mistyped field, a
wrong MAC, deep nesting - raises ProtocolError, and the server closes that one connection.
"""

from __future__ import annotations

import binascii
import math
import os
import struct
import zlib

# HMAC-SHA256 (RFC 2104) on CPython's own sha256: hashlib and hmac load OpenSSL, ~2.8 ms of CPU on
# every supervisor's start (of every host, every run), for a few short MACs a second.
try:
    from _sha256 import sha256 as _sha256   # type: ignore[import-not-found,unused-ignore]  # python <= 3.11
except ImportError:
    try:
        from _sha2 import sha256 as _sha256   # type: ignore[import-not-found,no-redef,unused-ignore]  # 3.12+
    except ImportError:
        from hashlib import sha256 as _sha256   # type: ignore[assignment,no-redef,unused-ignore]  # neither: OpenSSL's
from _operator import _compare_digest

from .load import parse_load
from .metrics import parse_progress
from . import jsonc
from .states import RankState
from .layout import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Any, Callable, Dict, Literal, overload

    # a message (a JSON object) as it goes on the wire, and the checked fields a parser returns
    Msg = Dict[str, Any]
    Parser = Callable[[Msg], Msg]
else:
    def overload(f):   # at run time the last definition is the function: typing's does the same
        return f

VERSION = 3           # of this protocol: in hello and challenge (2: `delta` to watchers; 3: `left_nothing`)
STATE_VERSION = 1     # of the documents: state.json, the watch stream's E events, `status`
PREAUTH_LINE = 1024
LINE = 1 << 20
WATCH_LINE = 256 << 20
HANDSHAKE_TIMEOUT = 5.0
ROLES = ("member", "watcher", "control")
MAC_HEX = 64



class ProtocolError(ValueError):
    """A frame that breaks the protocol: the connection that sent it is closed."""


# --------------------------------------------------------------------------- field checks

@overload
def _str(m: Msg, key: str, limit: int = ..., optional: Literal[False] = ...) -> str: ...
@overload
def _str(m: Msg, key: str, limit: int = ..., *, optional: bool) -> str | None: ...
def _str(m: Msg, key: str, limit: int = 256, optional: bool = False) -> str | None:
    v = m.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or len(v) > limit:
        raise ProtocolError("field %r: a string of at most %d characters expected" % (key, limit))
    return v


@overload
def _int(m: Msg, key: str, optional: Literal[False] = ..., lo: int | None = ...) -> int: ...
@overload
def _int(m: Msg, key: str, optional: bool, lo: int | None = ...) -> int | None: ...
def _int(m: Msg, key: str, optional: bool = False, lo: int | None = None) -> int | None:
    v = m.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo) or abs(v) > 1 << 62:
        raise ProtocolError("field %r: an integer expected" % key)
    return v


@overload
def _num(m: Msg, key: str, optional: Literal[False] = ...) -> float: ...
@overload
def _num(m: Msg, key: str, optional: bool) -> float | None: ...
def _num(m: Msg, key: str, optional: bool = False) -> float | None:
    v = m.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ProtocolError("field %r: a number expected" % key)
    return float(v)


def _hex(m: Msg, key: str, n: int) -> str:
    v = _str(m, key, n)
    if len(v) != n or any(c not in "0123456789abcdef" for c in v):
        raise ProtocolError("field %r: %d hex digits expected" % (key, n))
    return v


NONCE_HEX = 32


def new_nonce() -> str:
    return os.urandom(NONCE_HEX // 2).hex()


# --------------------------------------------------------------------------- frames

def decode(line: bytes, limit: int) -> Msg:
    """One line (bytes, without its newline) -> a dict with a string `t`. ProtocolError else."""
    if len(line) > limit:
        raise ProtocolError("line of %d bytes (limit %d)" % (len(line), limit))
    try:
        m = jsonc.loads(line.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError("not JSON: %s" % str(exc)[:80]) from None
    if not isinstance(m, dict) or not isinstance(m.get("t"), str):
        raise ProtocolError("not a message (a JSON object with a type 't')")
    return m


def encode(m: Msg) -> bytes:
    return jsonc.dumps(m, separators=(",", ":")).encode()


class Lines:
    """Bytes in, complete lines out; a line longer than `limit` (newline not seen yet
    included) raises ProtocolError, so no peer makes us hold more than `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out = []
        start = 0
        while True:
            i = self.buf.find(b"\n", start)
            if i < 0:
                break
            out.append(bytes(self.buf[start:i]))
            start = i + 1
        if start:
            del self.buf[:start]
        if len(self.buf) > self.limit or any(len(x) > self.limit for x in out):
            raise ProtocolError("a line longer than %d bytes" % self.limit)
        return out


# --------------------------------------------------------------------------- authentication

compare_digest = _compare_digest   # what hmac.compare_digest is without OpenSSL: constant-time, in C
_BLOCK = 64
_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))


def hmac_sha256(key: bytes, msg: bytes) -> bytes:
    """What hmac.new(key, msg, hashlib.sha256).digest() is."""
    if len(key) > _BLOCK:
        key = _sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    mac: bytes = _sha256(key.translate(_OPAD) + _sha256(key.translate(_IPAD) + msg).digest()).digest()
    return mac


def _h(token: str, *parts: str) -> str:
    return hmac_sha256(token.encode(), b"\0".join(p.encode() for p in parts)).hex()


def server_proof(token: str, run: str, nc: str, ns: str) -> str:
    return _h(token, "server", run, nc, ns)


def client_proof(token: str, run: str, role: str, host: str | None, nc: str, ns: str) -> str:
    return _h(token, "client", run, role, host or "", nc, ns)


def session_keys(token: str, nc: str, ns: str) -> tuple[bytes, bytes]:
    """(client -> head key, head -> client key) of one connection."""
    return (hmac_sha256(token.encode(), b"c2s\0" + nc.encode() + ns.encode()),
            hmac_sha256(token.encode(), b"s2c\0" + nc.encode() + ns.encode()))


class Sealer:
    """One direction of an authenticated connection: seal() frames to send, open() frames
    received (each MAC covers the direction's sequence number and the JSON)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def _mac(self, body: bytes) -> bytes:
        return hmac_sha256(self.key, struct.pack(">Q", self.seq) + body).hex().encode()

    def seal(self, m: Msg) -> bytes:
        body = encode(m)
        mac = self._mac(body)
        self.seq += 1
        return mac + b" " + body + b"\n"

    def open(self, line: bytes, limit: int) -> Msg:
        if len(line) < MAC_HEX + 2 or line[MAC_HEX:MAC_HEX + 1] != b" ":
            raise ProtocolError("an authenticated frame must start with its MAC")
        mac, body = line[:MAC_HEX], line[MAC_HEX + 1:]
        if not compare_digest(mac, self._mac(body)):
            raise ProtocolError("wrong MAC (a forged, replayed or reordered frame)")
        self.seq += 1
        return decode(body, limit)


# --------------------------------------------------------------------------- messages: one constructor and parser each

def hello(role: str, host: str | None, run: str, nonce: str) -> Msg:
    return {"t": "hello", "v": VERSION, "role": role, "host": host, "run": run, "nonce": nonce}


def parse_hello(m: Msg) -> Msg:
    if m.get("t") != "hello":
        raise ProtocolError("the first message must be hello, not %r" % str(m.get("t"))[:20])
    v = _int(m, "v")
    if v != VERSION:
        raise ProtocolError("protocol version %d (this supervisor speaks %d)" % (v, VERSION))
    role = _str(m, "role", 16)
    if role not in ROLES:
        raise ProtocolError("unknown role %r" % role)
    return {"role": role, "host": _str(m, "host", 255, optional=True), "run": _str(m, "run", 128),
            "nonce": _hex(m, "nonce", NONCE_HEX)}


def challenge(nonce: str, proof: str) -> Msg:
    return {"t": "challenge", "v": VERSION, "nonce": nonce, "proof": proof}


def parse_challenge(m: Msg) -> dict[str, str]:
    if m.get("t") == "refused":
        raise ProtocolError("refused by the head: %s" % str(m.get("why"))[:200])
    if m.get("t") != "challenge":
        raise ProtocolError("expected challenge, got %r" % str(m.get("t"))[:20])
    if _int(m, "v") != VERSION:
        raise ProtocolError("the head speaks protocol version %r, this supervisor %d" % (m.get("v"), VERSION))
    return {"nonce": _hex(m, "nonce", NONCE_HEX), "proof": _hex(m, "proof", 64)}


def auth(proof: str) -> Msg:
    return {"t": "auth", "proof": proof}


def parse_auth(m: Msg) -> str:
    if m.get("t") != "auth":
        raise ProtocolError("expected auth, got %r" % str(m.get("t"))[:20])
    return _hex(m, "proof", 64)


def welcome() -> Msg:
    return {"t": "welcome"}


def refused(why: str) -> Msg:
    return {"t": "refused", "why": why[:500]}


def parse_welcome(m: Msg) -> None:
    if m.get("t") == "refused":
        raise ProtocolError("refused by the head: %s" % str(m.get("why"))[:200])
    if m.get("t") != "welcome":
        raise ProtocolError("expected welcome, got %r" % str(m.get("t"))[:20])


def report(rep: Msg) -> Msg:
    return {"t": "report", "report": rep}


def stop(reason: str) -> Msg:
    return {"t": "stop", "reason": reason[:2000]}


def start(attempt: int, head_address: str, slot: str | None = None, files: str = "",
          replaced: str = "") -> Msg:
    """Start an attempt. A spare taking a lost host's place gets `slot` (that host: it runs its
    ranks); when the host set is not the planned one, every host gets the launch `files` the head
    rendered for it (pack_files of {name: text}) and `replaced` (ORCH_REPLACED_HOSTS for the ranks)."""
    m: Msg = {"t": "start", "attempt": attempt, "head_address": head_address}
    if slot:
        m["slot"] = slot
    if files:
        m["files"] = files
    if replaced:
        m["replaced"] = replaced
    return m


FILE_NAME = 64   # a launch file's name (hostfile, rank_table.json): a plain name, no directory
FILES_MAX = LINE // 2      # launch files in a start message, compressed (a 1,024-host rank table: ~100 KiB)
FILES_RAW_MAX = 64 << 20   # and uncompressed: what a member inflates, at most


def pack_files(files: dict[str, str]) -> str:
    """Launch files as a start message carries them: base64 of zlib of their JSON."""
    raw = jsonc.dumps(files, separators=(",", ":")).encode()
    return binascii.b2a_base64(zlib.compress(raw, 6), newline=False).decode("ascii") if files else ""


B64 = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def b64decode(text: str | bytes) -> bytes:
    """base64.b64decode(text, validate=True) without base64, which imports re: ValueError
    (binascii.Error) as it raises it. Python >= 3.11 does it with binascii's strict mode; before,
    with a regular expression (the alphabet, then at most two `=`), done here without one."""
    data = text.encode("ascii") if isinstance(text, str) else bytes(text)   # UnicodeEncodeError: a ValueError
    try:
        return binascii.a2b_base64(data, strict_mode=True)  # type: ignore[call-arg]  # 3.11+: TypeError before
    except TypeError:   # no strict mode (< 3.11)
        pass
    body = data.rstrip(b"=")
    if len(data) - len(body) > 2 or body.translate(None, B64):
        raise binascii.Error("Non-base64 digit found")
    return binascii.a2b_base64(data)


def _files(m: Msg, key: str) -> dict[str, str]:
    return unpack_files(_str(m, key, FILES_MAX, optional=True) or "", key)


def unpack_files(packed: str, key: str = "files") -> dict[str, str]:
    """pack_files' text -> {plain file name: text}; ProtocolError for anything else, and for more
    than FILES_RAW_MAX bytes once inflated."""
    if not packed:
        return {}
    try:
        z = zlib.decompressobj()
        raw = z.decompress(b64decode(packed), FILES_RAW_MAX)
        if z.unconsumed_tail:
            raise ProtocolError("field %r: more than %d bytes of files" % (key, FILES_RAW_MAX))
        v = jsonc.loads(raw)
    except (ValueError, zlib.error) as exc:
        raise ProtocolError("field %r: not packed launch files (%s)" % (key, str(exc)[:80])) from None
    if not isinstance(v, dict) or len(v) > 4:
        raise ProtocolError("field %r: at most 4 files expected" % key)
    for name, text in v.items():
        if (not isinstance(name, str) or not 0 < len(name) <= FILE_NAME or "/" in name or "\0" in name
                or name in (".", "..") or not isinstance(text, str)):
            raise ProtocolError("field %r: plain file names and their text expected" % key)
    return dict(v)


def dump() -> Msg:
    return {"t": "dump"}


def exit_(state: str) -> Msg:
    return {"t": "exit", "state": state}


def heartbeat() -> Msg:
    return {"t": "hb"}


def state(doc: Msg, seq: int = 0) -> Msg:
    return {"t": "state", "seq": seq, "state": doc}


def delta(seq: int, d: Msg) -> Msg:
    return {"t": "delta", "seq": seq, "delta": d}


def _parse_rank(r: object) -> Msg:
    if not isinstance(r, dict):
        raise ProtocolError("a rank record must be an object")
    st = _str(r, "state", 16)
    try:
        RankState(st)
    except ValueError:
        raise ProtocolError("unknown rank state %r" % st) from None
    out: Msg = {"rank": _int(r, "rank", lo=0), "state": st, "pid": _int(r, "pid", optional=True),
           "exit_code": _int(r, "exit_code", optional=True), "signal": _int(r, "signal", optional=True),
           "start": _num(r, "start", optional=True), "end": _num(r, "end", optional=True),
           "attempt": _int(r, "attempt", lo=0)}
    if RankState(st).ended != (out["end"] is not None):
        raise ProtocolError("rank %d: state %r with end %r" % (out["rank"], st, out["end"]))
    return out


def _parse_proc(p: object) -> Msg:
    if not isinstance(p, dict):
        raise ProtocolError("a process record must be an object")
    return {"key": _str(p, "key", 300), "rank": _int(p, "rank", optional=True), "pid": _int(p, "pid", optional=True),
            "exit_code": _int(p, "exit_code", optional=True), "signal": _int(p, "signal", optional=True),
            "start": _num(p, "start", optional=True), "end": _num(p, "end", optional=True)}


def parse_report(rep: object) -> Msg:
    """A member's report (procs.Local.report()), every field checked."""
    if not isinstance(rep, dict):
        raise ProtocolError("a report must be an object")
    ranks, procs = rep.get("ranks"), rep.get("procs")
    if not isinstance(ranks, list) or not isinstance(procs, list) or len(ranks) > 4096 or len(procs) > 4096:
        raise ProtocolError("a report's ranks and procs must be lists")
    live, left = rep.get("live"), rep.get("left_nothing", False)
    if not isinstance(live, bool) or not isinstance(left, bool):
        raise ProtocolError("fields 'live' and 'left_nothing': true or false expected")
    return {"host": _str(rep, "host", 255), "attempt": _int(rep, "attempt", lo=0),
            "ranks": [_parse_rank(r) for r in ranks], "procs": [_parse_proc(p) for p in procs],
            "out": _num(rep, "out"), "stopping": _str(rep, "stopping", 4000, optional=True), "live": live,
            "left_nothing": left,
            "progress": parse_progress(rep.get("progress"), ProtocolError),
            "load": parse_load(rep.get("load"), ProtocolError)}


# what each side accepts once authenticated, and its parser: {type: parse(message) -> fields}
TO_HEAD: dict[str, dict[str, Parser]] = {
    "member": {"report": lambda m: {"report": parse_report(m.get("report"))},
               "hb": lambda m: {},   # a member whose report has not changed since it last sent one
               "stop": lambda m: {"reason": _str(m, "reason", 2000)}},
    "watcher": {"stop": lambda m: {"reason": _str(m, "reason", 2000)}},
    "control": {"stop": lambda m: {"reason": _str(m, "reason", 2000)}},
}
TO_MEMBER: dict[str, Parser] = {
    "start": lambda m: {"attempt": _int(m, "attempt", lo=1), "head_address": _str(m, "head_address", 255),
                        "slot": _str(m, "slot", 255, optional=True), "files": _files(m, "files"),
                        "replaced": _str(m, "replaced", 1 << 16, optional=True) or ""},
    "stop": lambda m: {"reason": _str(m, "reason", 2000)},
    "dump": lambda m: {},
    "exit": lambda m: {"state": _str(m, "state", 16)},
    "hb": lambda m: {},
}
TO_WATCHER: dict[str, Parser] = {   # and to a control
    "state": lambda m: {"state": m["state"] if isinstance(m.get("state"), dict) else {},
                        "seq": _int(m, "seq", optional=True, lo=0) or 0},
    "delta": lambda m: {"seq": _int(m, "seq", lo=1), "delta": m["delta"] if isinstance(m.get("delta"), dict) else {}},
    "hb": lambda m: {},
}


def parse(table: dict[str, Parser], m: Msg) -> tuple[str, Msg]:
    """(type, fields) of a message the table accepts; ProtocolError for any other."""
    t = str(m.get("t"))   # decode() let only a string through
    fn = table.get(t)
    if fn is None:
        raise ProtocolError("unexpected message type %r" % str(t)[:20])
    return t, fn(m)
