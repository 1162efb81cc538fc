"""SshTransport: paramiko (its SSHClient, directly). The only module that uses it (sshconfig.py
imports it, without invoke, and reads ssh_config with it).

One connection per host for the whole orch invocation; every operation opens a
channel on it. Never prompts. Host keys are checked against the inventory's
known_hosts file (`strict`); `accept-new` records unknown keys there; a CHANGED
key is always refused. A refused key or host key is final for the invocation:
later operations on that host fail at once, without logging in again.
paramiko/socket exceptions are translated here, at the boundary, into orch
errors that name user@host and say what to do.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import select
import shlex
import socket
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from .sshconfig import import_paramiko

import_paramiko()  # without invoke (see there)

import paramiko  # noqa: E402 - once import_paramiko has loaded it
from paramiko.hostkeys import HostKeyEntry, HostKeys  # noqa: E402 - as above

from ..errors import (  # noqa: E402 - as above
    AuthError, ConnectError, HostError, HostKeyError, RemoteTimeout, SessionRefused, TransientNetworkError,
)
from ..model import Host, SshSettings  # noqa: E402 - as above
from .base import CHUNK, HELD_BOOTSTRAP, HELD_EXIT, HELD_GO, PROBE_END, Result, Transport, held_go  # noqa: E402 - as above

# paramiko logs what it catches (a host that never sends its SSH banner: 60 lines of traceback);
# orch reports each failure itself, once, as an error naming the host. With no handler
# anywhere, Python's last-resort handler would print paramiko's records on the terminal.
logging.getLogger("paramiko").addHandler(logging.NullHandler())

_known_hosts_lock = threading.Lock()
# known_hosts files parsed once per invocation: {path: ((mtime_ns, size, inode), [entries])}.
# paramiko's HostKeys.load de-duplicates with a scan of every earlier entry per line (quadratic),
# and was run once per host: at 64 hosts that was half of the controller's CPU.
_known_hosts_cache: dict[str, tuple[tuple, list[HostKeyEntry]]] = {}

# sshd frees a session's place a moment after the session ends: once both sides' CLOSE have
# crossed, in its next loop. A session asked for within that moment, where that one and ours
# open fill the server's places (sshd_config MaxSessions), is refused: with MaxSessions 1, 2 in 300
# back-to-back sessions on a loaded lab host, and one `orch up`'s gather in a CI run (the watch
# before it had just ended there). So a refusal while fewer of ours are open than the server has
# already taken at once is asked again, until LINGER seconds after the last session's end on the
# connection. Any other is said at once: ours fill the server's places (lifecycle.start's
# fallback decides what follows).
LINGER = 1.0


def _stamp(path: str) -> tuple:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


def _known_entries(path: str) -> list[HostKeyEntry]:
    """Every key line of a known_hosts file, parsed as paramiko's HostKeys.load does (lines it
    cannot use are skipped; a key that is not base64 raises InvalidHostKey). Parsed by one
    thread while the others (64 hosts connecting at once) wait for its list."""
    stamp = _stamp(path)
    with _known_hosts_lock:
        hit = _known_hosts_cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        parsing = _parsing.setdefault(path, threading.Lock())
    with parsing:
        with _known_hosts_lock:
            hit = _known_hosts_cache.get(path)
            if hit is not None and hit[0] == stamp:
                return hit[1]
        entries = []
        with open(path) as fh:
            for lineno, line in enumerate(fh, 1):
                line = line.strip()
                if not line or line[0] == "#":
                    continue
                try:
                    entry = HostKeyEntry.from_line(line, lineno)
                except Exception as exc:  # noqa: BLE001 - InvalidHostKey (bad base64) and kin: OpenSSH skips the line
                    _warn_once((path, lineno), f"{path}:{lineno}: skipped a known_hosts line that is not a valid "
                                               f"host key ({type(exc).__name__}); OpenSSH skips it too")
                    continue
                if entry is not None:
                    entries.append(entry)
        with _known_hosts_lock:
            _known_hosts_cache[path] = (stamp, entries)
        return entries


_parsing: dict[str, threading.Lock] = {}
# {path: (the entries list it was made from, {plain host name: [entry index]}, [indexes of hashed
# entries])}: a host's keys without a scan of every line (at 1,000 hosts, 1,000 x 1,000 matches)
_known_index: dict[str, tuple[list, dict[str, list[int]], list[int]]] = {}


def _entries_for(path: str, host_id: str) -> list[HostKeyEntry]:
    """The known_hosts entries that name host_id (plainly or hashed), in file order."""
    entries = _known_entries(path)
    with _known_hosts_lock:
        idx = _known_index.get(path)
        if idx is None or idx[0] is not entries:
            plain: dict[str, list[int]] = {}
            hashed: list[int] = []
            for i, entry in enumerate(entries):
                for n in dict.fromkeys(entry.hostnames):
                    if n.startswith("|1|"):
                        if not hashed or hashed[-1] != i:
                            hashed.append(i)
                    else:
                        plain.setdefault(n, []).append(i)
            idx = _known_index[path] = (entries, plain, hashed)
    _, plain, hashed = idx
    return [entries[i] for i in sorted(set(plain.get(host_id, ())).union(hashed))
            if any(_name_matches(host_id, n) for n in entries[i].hostnames)]


_identities: dict[str, tuple[tuple, paramiko.PKey]] = {}
_warned: set = set()


def _warn_once(key, message: str) -> None:
    """A problem worth a word that must not stop anything: said once per invocation, on stderr."""
    with _known_hosts_lock:
        if key in _warned:
            return
        _warned.add(key)
    sys.stderr.write(f"orch: warning: {message}\n")


def _identity(path: str) -> paramiko.PKey | None:
    """The private key in `path`, read once per invocation (paramiko's key_filename re-reads and
    re-parses it, trying each key type in turn, for every host). None: leave it to paramiko
    (a certificate next to it, a passphrase, a file it cannot read), so it fails as before."""
    if path.endswith("-cert.pub") or os.path.exists(path + "-cert.pub"):
        return None
    try:
        stamp = _stamp(path)
    except OSError:
        return None
    with _known_hosts_lock:
        hit = _identities.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    for kind in (paramiko.RSAKey, paramiko.ECDSAKey, paramiko.Ed25519Key):  # paramiko's order
        try:
            key = kind.from_private_key_file(path)
            break
        except Exception:  # noqa: BLE001 - not this type (or unreadable): paramiko will say why
            continue
    else:
        return None
    with _known_hosts_lock:
        _identities[path] = (stamp, key)
    return key


def _is_public_key(path: str) -> bool:
    """The file holds an OpenSSH public key line ("ssh-ed25519 AAAA... comment"), not a private key."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).split(None, 2)
    except OSError:
        return False
    return len(head) >= 2 and head[0].startswith((b"ssh-", b"ecdsa-", b"sk-")) and head[1].startswith(b"AAAA")


def _name_matches(name: str, pattern: str) -> bool:
    """A known_hosts host name (plain or |1| hashed) against `name`, as paramiko matches them."""
    return pattern == name or (pattern.startswith("|1|") and hmac.compare_digest(HostKeys.hash_host(name, pattern),
                                                                                 pattern))


def _load_host_keys(client: paramiko.SSHClient, path: str, host_id: str) -> None:
    """Give the client the keys known_hosts has for this host only; the first key of each type
    wins, as with paramiko's own lookup."""
    keys = client.get_host_keys()
    seen: set[str] = set()
    for entry in _entries_for(path, host_id):
        kind = entry.key.get_name()
        if kind not in seen:
            seen.add(kind)
            keys.add(host_id, kind, entry.key)


def _host_id(host: Host) -> str:
    """The host's name in known_hosts, as OpenSSH writes it: `[host]:port` for another port."""
    return host.ssh_address if host.port == 22 else f"[{host.ssh_address}]:{host.port}"


def _fingerprint(key: paramiko.PKey) -> str:
    return key.fingerprint if hasattr(key, "fingerprint") else key.get_base64()[:32]


class _Policy(paramiko.MissingHostKeyPolicy):
    """Unknown host key: refuse (strict) or append it to known_hosts (accept-new)."""

    def __init__(self, host: Host, accept_new: bool):
        self.host = host
        self.accept_new = accept_new

    def missing_host_key(self, client, hostname, key):
        fp = _fingerprint(key)
        if not self.accept_new:
            raise HostKeyError(
                self.host.name,
                f"host key of {_host_id(self.host)} is not in {self.host.known_hosts} "
                f"({key.get_name()} {fp})",
                hint=f"check the fingerprint with the host's admin, then either run "
                     f"`ssh-keyscan -p {self.host.port} {self.host.ssh_address} >> {self.host.known_hosts}` "
                     + ("(from a machine that reaches it, e.g. the jump host) " if self.host.jump else "") +
                     "or set ssh.host_key_policy: accept-new")
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            path = Path(self.host.known_hosts)
            path.parent.mkdir(parents=True, exist_ok=True)
            cached = _known_hosts_cache.get(str(path))
            before = _stamp(str(path)) if cached is not None and path.exists() else None
            with open(path, "a") as fh:
                fh.write(line)
            if cached is not None and cached[0] == before:  # keep the parsed copy current, no re-read
                _known_hosts_cache[str(path)] = (_stamp(str(path)), cached[1] + [HostKeyEntry([hostname], key)])
        client.get_host_keys().add(hostname, key.get_name(), key)


class Gateways:
    """The jump-host connections of one invocation: one per hop chain (and key), shared by every
    host behind it, and a cap (ssh.jump_fanout) on how many hosts' handshakes go through one jump
    host at once (each is a TCP connection the jump host opens, and CPU on both ends)."""

    def __init__(self, ssh: SshSettings):
        self.ssh = ssh
        self._lock = threading.Lock()
        self._hops: dict[tuple, tuple[SshTransport, threading.BoundedSemaphore]] = {}

    def hop(self, chain: tuple[Host, ...]) -> tuple[SshTransport, threading.BoundedSemaphore]:
        """The connection to chain[-1] (made through chain[:-1]) and its slots for new tunnels."""
        key = tuple((j.user, j.ssh_address, j.port, j.identity_file, j.known_hosts) for j in chain)
        with self._lock:
            got = self._hops.get(key)
            if got is None:
                t = SshTransport.for_settings(replace(chain[-1], jump=chain[:-1]), self.ssh, self)
                # every host behind it would try (and wait) again: its failure answers them all for
                # a while (a refused key or host key: for good, as for any host)
                t.failure_memory = t.connect_timeout * t.retries
                got = self._hops[key] = (t, threading.BoundedSemaphore(self.ssh.jump_fanout))
            return got

    def close(self) -> None:
        with self._lock:
            hops, self._hops = list(self._hops.values()), {}
        for t, _ in sorted(hops, key=lambda h: -len(h[0].host.jump)):  # the hops behind a hop first
            t.close()


class SshTransport(Transport):
    def __init__(self, host: Host, *, connect_timeout: float = 10, command_timeout: float = 120,
                 retries: int = 3, host_key_policy: Literal["strict", "accept-new"] = "strict",
                 gateways: Gateways | None = None):
        super().__init__(host, command_timeout)
        self.connect_timeout = host.connect_timeout or connect_timeout
        self.retries = retries
        self.host_key_policy = host_key_policy
        # jump hosts: the Pool's (shared by every host of the invocation), or this transport's own
        self.gateways = gateways if gateways is not None or not host.jump else \
            Gateways(SshSettings(connect_timeout=connect_timeout, command_timeout=command_timeout,
                                 retries=retries, host_key_policy=host_key_policy))
        self._own_gateways = gateways is None and host.jump != ()
        self._client: paramiko.SSHClient | None = None
        self._transport: paramiko.Transport | None = None
        self._lock = threading.Lock()
        self._held: paramiko.Channel | None = None  # probe(hold=True)'s session, until start_held
        # the connection's sessions (_session, _close): ours open now (the held one too), the most
        # the server has had open at once, and when one last ended (time.monotonic())
        self._sessions: set[paramiko.Channel] = set()
        self._most = 0
        self._ended = float("-inf")
        self.connections_opened = 0
        self._refused: ConnectError | None = None  # a refused key / host key: final for this invocation
        self.failure_memory = 0.0  # a jump host: seconds a failed connect (after its retries) stands
        self._failed: tuple[float, ConnectError] | None = None

    @classmethod
    def for_settings(cls, host: Host, ssh: SshSettings, gateways: Gateways | None = None) -> SshTransport:
        return cls(host, connect_timeout=ssh.connect_timeout, command_timeout=ssh.command_timeout,
                   retries=ssh.retries, host_key_policy=ssh.host_key_policy, gateways=gateways)

    # ---- connection
    def connect(self, attempts: int | None = None) -> None:
        with self._lock:
            if self._transport is not None and self._transport.is_active():
                return
            if self._refused is not None:  # asking again would only be refused again (and logged)
                raise self._refused
            if self._failed is not None and time.monotonic() - self._failed[0] < self.failure_memory:
                raise self._failed[1]
            try:
                self._connect(attempts or self.retries)
            except (AuthError, HostKeyError) as exc:
                self._refused = exc
                raise
            except ConnectError as exc:
                self._failed = (time.monotonic(), exc)
                raise

    def _connect(self, attempts: int) -> None:
        """Up to `attempts` tries (ssh.retries unless a caller asks for fewer), on transient network
        errors only (tenacity), within connect_timeout x attempts in all; the last error is raised."""
        attempts = max(1, attempts)
        deadline = time.monotonic() + self.connect_timeout * attempts
        try:  # the first try: tenacity (~5 ms of import, before any host is reached) waits for a retry
            self._try(attempts, deadline)
            return
        except TransientNetworkError as exc:
            if attempts == 1:
                raise
            first = exc
        from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

        for attempt in Retrying(stop=stop_after_attempt(attempts), reraise=True,
                                wait=wait_exponential(multiplier=0.2, max=2),
                                retry=retry_if_exception_type(TransientNetworkError)):
            with attempt:
                if attempt.retry_state.attempt_number == 1:
                    raise first  # tenacity's first attempt is the try above: its wait and count follow
                self._try(attempts, deadline)

    def _try(self, attempts: int, deadline: float) -> None:
        budget = min(self.connect_timeout, deadline - time.monotonic())
        if budget <= 0.05:
            raise TransientNetworkError(
                self.host.name, f"could not connect to {self.host.route} within "
                f"{self.connect_timeout * attempts:g}s", hint=_UNREACHABLE_HINT)
        self._client = self._open(budget)
        self._transport = self._client.get_transport()
        self._sessions, self._most, self._ended = set(), 0, float("-inf")   # (under connect's lock)

    def _open(self, timeout: float) -> paramiko.SSHClient:
        if not self.host.jump:
            return self._handshake(timeout, None)
        assert self.gateways is not None  # made in __init__ for a host behind jump hosts
        gw, slots = self.gateways.hop(self.host.jump)
        try:
            gw.connect()
        except HostError as exc:  # the hop failed (after its own retries): say which, for this host
            raise _via(exc, self.host, gw.host, retry=False) from None
        if not slots.acquire(timeout=self.command_timeout):
            raise ConnectError(self.host.name, f"waited {self.command_timeout:g}s for one of the {gw.host.target} "
                               "jump host's slots (ssh.jump_fanout) to connect through it",
                               hint="raise ssh.jump_fanout, or ssh.command_timeout")
        try:
            return self._handshake(timeout, gw)
        finally:
            slots.release()

    def open_tunnel(self, address: str, port: int, timeout: float) -> _Tunnel:
        """A TCP connection from this host to address:port (as `ssh -W` makes), for a host behind it."""
        self.connect()
        transport = self._transport
        try:
            assert transport is not None
            return _Tunnel(transport.open_channel("direct-tcpip", (address, port), ("127.0.0.1", 0), timeout=timeout))
        except paramiko.ChannelException as exc:  # the jump host's own connect failed
            raise TransientNetworkError(self.host.name, f"could not reach {address}:{port} from here: {exc.text}",
                                        hint="is the host up, and is this the address the jump host reaches "
                                             "it by? (AllowTcpForwarding must be on in the jump host's sshd)"
                                        ) from None
        except (paramiko.SSHException, EOFError, OSError, AssertionError) as exc:
            if transport is not None and transport.is_active():  # this target is slow: not the connection
                raise TransientNetworkError(self.host.name, f"could not reach {address}:{port} from here: {exc}",
                                            hint="is the host up?") from None
            raise self._lost(exc) from None

    def _handshake(self, timeout: float, gw: SshTransport | None) -> paramiko.SSHClient:
        h = self.host
        kwargs: dict[str, Any] = {"banner_timeout": timeout, "auth_timeout": timeout,
                  "allow_agent": h.identity_file is None, "look_for_keys": h.identity_file is None}
        if h.identity_file:
            if not os.path.exists(h.identity_file):
                raise AuthError(h.name, f"no usable key: identity_file {h.identity_file} does not exist",
                                hint="fix identity_file in the inventory, or leave it unset to use ssh-agent and "
                                     "~/.ssh/id_*")
            key = _identity(h.identity_file)
            if key is None and _is_public_key(h.identity_file):
                raise AuthError(h.name, f"identity_file {h.identity_file} is a public key; orch needs the private "
                                "key that goes with it",
                                hint="point identity_file at the private key (the same path without .pub)")
            if key is not None:
                kwargs["pkey"] = key
            else:  # encrypted (or a certificate): the agent's copy is used if it holds it, as `ssh -i` does
                kwargs["key_filename"] = [h.identity_file]
                kwargs["allow_agent"] = True
        if gw is not None:
            try:
                kwargs["sock"] = gw.open_tunnel(h.ssh_address, h.port, timeout)
            except HostError as exc:
                raise _via(exc, h, gw.host) from None
        elif h.proxy_command:
            try:  # through a shell, as OpenSSH runs it (pipes, redirections, `exec ...`)
                kwargs["sock"] = paramiko.ProxyCommand("sh -c " + shlex.quote("exec " + h.proxy_command))
            except BaseException as exc:  # noqa: BLE001 - could not start it: say so, with the command
                raise ConnectError(h.name, f"ProxyCommand {h.proxy_command!r} could not start: {exc}",
                                   hint="check ProxyCommand in the ssh config (ssh.config_file)") from None
        else:
            try:  # our own TCP connect: exact (float) timeout and socket errors we can name
                kwargs["sock"] = socket.create_connection((h.ssh_address, h.port), timeout=timeout)
                # paramiko writes each SSH message with its own send(): with Nagle's algorithm on, a
                # small message after another one waits for the peer's delayed ACK (40 ms on Linux).
                # That was 40-80 ms on every command (a channel open, the exec request, stdin, EOF).
                kwargs["sock"].setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except BaseException as exc:  # noqa: BLE001 - _translate names it for the user (Ctrl-C passes through)
                raise self._translate(exc, timeout) from None
        client = paramiko.SSHClient()
        if os.path.exists(h.known_hosts):
            try:
                _load_host_keys(client, h.known_hosts, _host_id(h))
            except (OSError, paramiko.SSHException) as exc:
                kwargs["sock"].close()
                raise HostKeyError(h.name, f"cannot read known_hosts {h.known_hosts}: {exc}") from None
        client.set_missing_host_key_policy(_Policy(h, self.host_key_policy == "accept-new"))
        try:
            client.connect(h.ssh_address, port=h.port, username=h.user, transport_factory=_make_transport, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - _translate names it for the user (Ctrl-C passes through)
            t = client.get_transport()  # still up, after the key exchange: the server is not what failed
            answered = t is not None and t.host_key is not None and t.is_active()
            client.close()
            kwargs["sock"].close()
            raise self._translate(exc, timeout, answered=answered) from None
        self.connections_opened += 1
        transport = client.get_transport()
        assert transport is not None  # connect() succeeded
        transport.set_keepalive(int(h.keepalive) if h.keepalive else 15)
        # paramiko's thread wakes every socket timeout (0.1 s) to look at its own state: 0.7 ms of
        # CPU per host per second, for every idle connection of the invocation (all of them, while
        # `orch check` waits for its slowest host or `orch up` follows a job). Data still wakes it
        # at once; only keepalives, rekeying and noticing a close() wait up to this long.
        transport.sock.settimeout(IDLE_WAKEUP)
        return client

    def _translate(self, exc: BaseException, timeout: float, answered: bool = False) -> BaseException:
        """`answered`: the server completed the key exchange (it is an SSH server, and not too busy
        to talk), so what failed after it is this side's: the key, the user."""
        h = self.host
        if isinstance(exc, HostError):
            return exc
        if isinstance(exc, paramiko.BadHostKeyException):
            return HostKeyError(
                h.name, f"HOST KEY CHANGED for {_host_id(h)}: it offered {exc.key.get_name()} "
                f"{_fingerprint(exc.key)} but {h.known_hosts} has {_fingerprint(exc.expected_key)}. "
                "Someone could be intercepting the connection (man-in-the-middle), or the host was "
                "reinstalled; refusing to connect",
                hint=f"if the change is expected, remove the old key with "
                     f"`ssh-keygen -R {_host_id(h)} -f {h.known_hosts}` and connect again")
        if isinstance(exc, paramiko.PasswordRequiredException):
            return AuthError(h.name, f"key {h.identity_file} is protected by a passphrase and orch never prompts",
                             hint="load the key into ssh-agent (ssh-add) and leave identity_file unset")
        if isinstance(exc, paramiko.AuthenticationException):
            key = h.identity_file or "ssh-agent and the default keys (~/.ssh/id_*)"
            return AuthError(h.name, f"password-free SSH to {h.user}@{h.ssh_address} failed: key {key} was refused",
                             hint=f"run `ssh-copy-id -p {h.port} {'-i ' + h.identity_file + ' ' if h.identity_file else ''}"
                                  f"{h.user}@{h.ssh_address}`, or check user/identity_file in the inventory")
        if isinstance(exc, socket.gaierror):
            return ConnectError(h.name, f"cannot resolve {h.ssh_address!r}: {exc.strerror or exc}",
                                hint="check the address in the inventory or your DNS")
        if isinstance(exc, ConnectionRefusedError):
            return TransientNetworkError(h.name, f"connection to {h.ssh_address}:{h.port} refused",
                                         hint="is sshd running on the host and listening on that port?")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return TransientNetworkError(h.name, f"timed out after {timeout:g}s connecting to "
                                         f"{h.ssh_address}:{h.port}", hint=_UNREACHABLE_HINT)
        if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH,
                                                      errno.ENETUNREACH, errno.ETIMEDOUT, errno.EPIPE):
            return TransientNetworkError(h.name, f"cannot connect to {h.ssh_address}:{h.port}: {exc.strerror}",
                                         hint=_UNREACHABLE_HINT)
        if isinstance(exc, paramiko.SSHException) and "No authentication methods available" in str(exc):
            return AuthError(h.name, f"no usable key for {h.user}@{h.ssh_address}: no identity_file, no key in "
                             "ssh-agent and none of ~/.ssh/id_*",
                             hint="set identity_file in the inventory, or load a key with ssh-add")
        if answered and isinstance(exc, paramiko.SSHException):
            key = f"key {h.identity_file}" if h.identity_file else "ssh-agent and the default keys (~/.ssh/id_*)"
            return AuthError(h.name, f"SSH to {h.user}@{h.ssh_address}:{h.port} failed after the server answered, "
                             f"while using {key}: {exc}",
                             hint="check identity_file (a private key that ssh -i accepts) and user in the inventory")
        if isinstance(exc, (EOFError, paramiko.SSHException)):
            return TransientNetworkError(h.name, f"SSH handshake with {h.ssh_address}:{h.port} failed: {exc}",
                                         hint="is it an SSH server? is it overloaded (MaxStartups)?")
        if isinstance(exc, KeyboardInterrupt):
            return exc
        return ConnectError(h.name, f"cannot connect to {h.target}: {type(exc).__name__}: {exc}")

    def _lost(self, exc: BaseException) -> TransientNetworkError:
        """The connection broke under a command (`exc`): closed, and the error that says so."""
        self.close()
        return TransientNetworkError(self.host.name, f"lost the SSH connection to {self.host.target}: {exc}",
                                     hint=_UNREACHABLE_HINT)

    def close(self) -> None:
        self.release_held()
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
                self._transport = None
        if self._own_gateways and self.gateways is not None:
            self.gateways.close()

    # ---- the primitive
    def _exec(self, script, *, stdin, sink, timeout, keep=False):
        """_drive on a new session; `keep`: the session, if _drive kept it, becomes the held one."""
        self.connect()
        transport = self._transport
        assert transport is not None
        deadline = time.monotonic() + timeout
        try:
            chan = self._session(transport, min(timeout, self.connect_timeout))
        except paramiko.ChannelException as exc:   # the connection works: it stays, for the sessions it has
            raise SessionRefused(self.host.name, f"its SSH server refused a new session on the connection ({exc}), "
                                 "as sshd does past its MaxSessions",
                                 hint="orch opens up to 2 sessions at a time on a host's connection: sshd_config's "
                                      "MaxSessions 2 or more (OpenSSH's default is 10)") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            raise self._lost(exc) from None
        kept = False
        try:
            rc, out, err, kept = _drive(chan, script, stdin, sink, deadline, self.host.name, timeout, keep)
            if kept:
                with self._lock:
                    before, self._held = self._held, chan
                if before is not None:
                    self._close(before)
            return rc, out, err
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise self._lost(exc) from None
        finally:
            if not kept:
                self._close(chan)

    def _session(self, transport: paramiko.Transport, timeout: float) -> paramiko.Channel:
        """A new session on the connection. Refused: without the held one, if there is one (a
        server that takes one session at a time); else asked again while fewer of ours are open
        than the server has taken at once, until LINGER after the last one's end; else raised."""
        pause = 0.01
        while True:
            try:
                chan = transport.open_session(timeout=timeout)
            except paramiko.ChannelException:
                if self._held is not None:
                    self.release_held()
                    continue
                with self._lock:
                    left = self._ended + LINGER - time.monotonic()
                    lingering = len(self._sessions) < self._most and left > 0
                if not lingering:
                    raise
                time.sleep(min(pause, left))
                pause = min(2 * pause, 0.2)
            else:
                with self._lock:
                    self._sessions.add(chan)
                    self._most = max(self._most, len(self._sessions))
                return chan

    def _close(self, chan: paramiko.Channel) -> None:
        chan.close()
        with self._lock:
            if chan in self._sessions:   # (not one of an earlier connection)
                self._sessions.discard(chan)
                self._ended = time.monotonic()

    # ---- a session held for a later command (base.HELD_BOOTSTRAP)
    def probe(self, script, *, sink=None, hold=False):
        if not hold:
            return super().probe(script, sink=sink)
        data = script.encode()
        start = time.monotonic()
        rc, out, err = self._exec(HELD_BOOTSTRAP.format(n=len(data)), stdin=data, sink=sink,
                                  timeout=self.command_timeout, keep=True)
        return Result(self.host.name, script, rc, out, err, time.monotonic() - start)

    def start_held(self, env, argv, stdin):
        with self._lock:
            chan, self._held = self._held, None
        if chan is None:
            return None
        start = time.monotonic()
        deadline = start + self.command_timeout
        try:
            if chan.closed or chan.eof_received:   # its process gave up waiting: nothing ran
                self._close(chan)
                return None
            chan.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                chan.sendall(held_go(env, argv))
            except OSError:
                if chan.closed or chan.eof_received:   # gone meanwhile: nothing ran
                    return None
                raise
            # its answer (it runs the command), or its end: nothing ran, the caller runs it its own way
            got = bytearray()
            chan.settimeout(0.0)
            while HELD_GO not in got:
                if chan.recv_ready():
                    got += chan.recv(RECV_MAX)
                    continue
                if chan.eof_received or chan.closed:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RemoteTimeout(self.host.name, f"the held session did not answer within {self.command_timeout:g}s",
                                        hint="raise ssh.command_timeout if the host is just slow")
                select.select([chan], [], [], min(remaining, 1.0))
            said = bytes(got[got.index(HELD_GO) + len(HELD_GO):])
            _, out, err, _ = _feed_and_read(chan, stdin, None, deadline, self.host.name, self.command_timeout, out=said)
        except (OSError, paramiko.SSHException, EOFError) as exc:
            raise self._lost(exc) from None
        finally:
            self._close(chan)
        rc, out = _held_status(out)
        argv_text = " ".join(shlex.quote(a) for a in argv[1:])
        return Result(self.host.name, f"(held session) python3 -c <boot> {argv_text}", rc, out, err,
                      time.monotonic() - start)

    def release_held(self):
        with self._lock:
            chan, self._held = self._held, None
        if chan is not None:
            self._close(chan)


_UNREACHABLE_HINT = "is the host up and reachable from here (address, firewall, link)?"


class _Tunnel:
    """A direct-tcpip channel used as the socket of the connection behind a jump host, with send()
    and close() never at once: paramiko's Channel lets go of its lock before it writes, so a close
    from another thread (a host's connection dropped after a failure) could reach the jump host
    before the data, and its sshd then drops the WHOLE jump connection ("data packet referred to
    nonexistent channel"), every other host's tunnel with it (seen 10 times in 30 fan-outs)."""

    def __init__(self, chan: paramiko.Channel):
        self._chan = chan
        self._lock = threading.Lock()

    def send(self, data) -> int:
        with self._lock:
            return self._chan.send(data)

    def sendall(self, data) -> None:
        with self._lock:
            self._chan.sendall(data)

    def close(self) -> None:
        with self._lock:
            self._chan.close()

    def __getattr__(self, name):
        return getattr(self._chan, name)


def _via(exc: HostError, host: Host, hop: Host, retry: bool = True) -> HostError:
    """A jump host's error, told for the host behind it, naming the hop that failed: the same kind
    (a refused key stays final); not retried when `retry` is false (the hop retried already)."""
    inner = exc.message[len(exc.host) + 2:] if exc.message.startswith(f"{exc.host}: ") else exc.message
    kind = ConnectError if not retry and isinstance(exc, TransientNetworkError) else type(exc)
    return kind(host.name, f"jump host {hop.target}: {inner}", hint=exc.hint)
IDLE_WAKEUP = 2.0  # seconds: how often an idle connection's paramiko thread wakes up
# A channel buffers at most its window (2 MiB) of received data: take all of it at once.
# paramiko's buffer drops what is read from its front, so reading 64 KiB at a time from a full
# window moved the rest (up to 2 MiB) for every 64 KiB: a third of the CPU of a log gather.
RECV_MAX = 1 << 22
# Same algorithms, other order: AES-GCM first (one C call per packet, where aes-ctr adds
# hmac-sha2 and paramiko's pure-Python constant-time MAC comparison): ~30% less CPU per MB
# received. Servers without it (none since OpenSSH 6.2) negotiate the rest as before.
_FAST_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


def _make_transport(sock, **kwargs) -> paramiko.Transport:
    """paramiko's Transport, preferring the ciphers that cost the controller least."""
    t = paramiko.Transport(sock, **kwargs)
    opts = t.get_security_options()
    first = [c for c in _FAST_CIPHERS if c in opts.ciphers]
    opts.ciphers = tuple(first + [c for c in opts.ciphers if c not in first])
    return t


def _drive(chan: paramiko.Channel, script: str, stdin, sink, deadline: float, host: str,
           timeout: float, keep: bool = False) -> tuple[int, bytes, bytes, bool]:
    """Run `script` on `chan`: (exit status, stdout, stderr, whether the channel is kept open:
    `keep` and the script's shell ended with PROBE_END while something still holds its output)."""
    # `sh -c` so the remote login shell (bash, zsh, csh...) only ever parses one quoted word.
    chan.exec_command("exec sh -c " + shlex.quote(script))
    return _feed_and_read(chan, stdin, sink, deadline, host, timeout, keep=keep)


def _feed_and_read(chan: paramiko.Channel, stdin, sink, deadline: float, host: str, timeout: float,
                   keep: bool = False, out: bytes = b"") -> tuple[int, bytes, bytes, bool]:
    """_drive's, once the command runs: `stdin` sent (and then its end, unless `keep`), the output
    read to its end (`keep`: to PROBE_END once the shell has ended). `out`: what came already."""
    if stdin is not None:
        chan.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            if isinstance(stdin, (bytes, bytearray)):
                for i in range(0, len(stdin), CHUNK):
                    chan.sendall(stdin[i:i + CHUNK])
            else:
                while True:
                    asked = time.monotonic()
                    block = stdin.read(CHUNK)
                    # the time this side took to have it (a supervisor's start waits on its stdin
                    # while the code syncs) is not the host's: the timeout bounds the host
                    deadline += time.monotonic() - asked
                    if not block:
                        break
                    chan.settimeout(max(0.1, deadline - time.monotonic()))
                    chan.sendall(block)
        except OSError:
            # The remote command stopped reading (e.g. its disk is full) and closed its end:
            # what it said and its exit status, read below, are the error, not this.
            if not chan.closed and not chan.exit_status_ready() and not chan.recv_stderr_ready():
                raise
    if not chan.closed and not keep:
        chan.shutdown_write()
    buf, err, tail = bytearray(out), bytearray(), b""
    chan.settimeout(0.0)
    while True:
        progressed = False
        while chan.recv_ready():
            data = chan.recv(RECV_MAX)
            if not data:
                break
            progressed = True
            tail = (tail + data)[-len(PROBE_END):]
            if sink is not None:
                sink.write(data)
                # streaming a file (a rank's log): the timeout bounds a stall, not the transfer,
                # which may be gigabytes long
                deadline = max(deadline, time.monotonic() + timeout)
            else:
                buf += data
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(RECV_MAX)
            if not data:
                break
            progressed = True
            err += data
        # EOF comes after the last data byte; the exit status may come before it.
        if chan.eof_received and chan.exit_status_ready() and not chan.recv_ready() \
                and not chan.recv_stderr_ready():
            break
        if chan.closed and not chan.recv_ready():
            break
        if keep and tail == PROBE_END and not chan.recv_ready():
            return 0, bytes(buf), bytes(err), True   # all the script said: its session stays
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RemoteTimeout(host, f"command timed out after {timeout:g}s",
                                hint="raise ssh.command_timeout if the host is just slow")
        if not progressed:
            select.select([chan], [], [], min(remaining, 1.0))
    rc = chan.recv_exit_status()
    if rc == -1:
        raise TransientNetworkError(host, "the SSH channel closed without an exit status")
    return rc, bytes(buf), bytes(err), False


def _held_status(out: bytes) -> tuple[int, bytes]:
    """A held session's output -> (the command's exit status, its output without HELD_EXIT's line);
    255 when that line is missing (the holding process died)."""
    head, sep, last = out.rstrip(b"\n").rpartition(b"\n" + HELD_EXIT + b" ")
    if sep and last.isdigit():
        return int(last), head
    return 255, out + b"\norch: the held session ended without the command's exit status\n"
