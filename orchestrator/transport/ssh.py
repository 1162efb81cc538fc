"""SshTransport: fabric/paramiko. The only module that imports them.

One connection per host for the whole orch invocation; every operation opens a
channel on it. Never prompts. Host keys are checked against the inventory's
known_hosts file (`strict`); `accept-new` records unknown keys there; a CHANGED
key is always refused. paramiko/socket exceptions are translated here, at the
boundary, into orch errors that name user@host and say what to do.
"""

from __future__ import annotations

import errno
import os
import select
import shlex
import socket
import threading
import time
from pathlib import Path

import paramiko
from fabric import Config, Connection
from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ..errors import AuthError, ConnectError, HostError, HostKeyError, RemoteTimeout, TransientNetworkError
from ..spec import Host
from .base import CHUNK, Transport

_known_hosts_lock = threading.Lock()


def _host_id(host: Host) -> str:
    return host.address if host.port == 22 else f"[{host.address}]:{host.port}"


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
                     f"`ssh-keyscan -p {self.host.port} {self.host.address} >> {self.host.known_hosts}` "
                     f"or set ssh.host_key_policy: accept-new")
        line = f"{hostname} {key.get_name()} {key.get_base64()}\n"
        with _known_hosts_lock:
            path = Path(self.host.known_hosts)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as fh:
                fh.write(line)
        client.get_host_keys().add(hostname, key.get_name(), key)


class SshTransport(Transport):
    def __init__(self, host: Host, *, connect_timeout: float = 10, command_timeout: float = 120,
                 retries: int = 3, host_key_policy: str = "strict"):
        super().__init__(host, command_timeout)
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.host_key_policy = host_key_policy
        self._conn: Connection | None = None
        self._lock = threading.Lock()
        self.connections_opened = 0

    # ---- connection
    def connect(self) -> None:
        with self._lock:
            if self._conn is not None and self._conn.is_connected:
                return
            deadline = time.monotonic() + self.connect_timeout * self.retries
            for attempt in Retrying(stop=stop_after_attempt(self.retries), reraise=True,
                                    wait=wait_exponential(multiplier=0.2, max=2),
                                    retry=retry_if_exception_type(TransientNetworkError)):
                with attempt:
                    budget = min(self.connect_timeout, deadline - time.monotonic())
                    if budget <= 0.05:
                        raise TransientNetworkError(
                            self.host.name, f"could not connect to {self.host.target} within "
                            f"{self.connect_timeout * self.retries:g}s", hint=_UNREACHABLE_HINT)
                    self._conn = self._open(budget)

    def _open(self, timeout: float) -> Connection:
        h = self.host
        kwargs = {"banner_timeout": timeout, "auth_timeout": timeout,
                  "allow_agent": h.identity_file is None, "look_for_keys": h.identity_file is None}
        if h.identity_file:
            kwargs["key_filename"] = [h.identity_file]
        try:  # our own TCP connect: exact (float) timeout and socket errors we can name
            kwargs["sock"] = socket.create_connection((h.address, h.port), timeout=timeout)
        except BaseException as exc:
            raise self._translate(exc, timeout) from None
        conn = Connection(h.address, user=h.user, port=h.port, connect_kwargs=kwargs,
                          config=Config(overrides={"load_ssh_configs": False}))
        client = conn.client
        if os.path.exists(h.known_hosts):
            try:
                client.load_host_keys(h.known_hosts)
            except (OSError, paramiko.SSHException) as exc:
                raise HostKeyError(h.name, f"cannot read known_hosts {h.known_hosts}: {exc}") from None
        client.set_missing_host_key_policy(_Policy(h, self.host_key_policy == "accept-new"))
        try:
            conn.open()
        except BaseException as exc:
            conn.close()
            raise self._translate(exc, timeout) from None
        self.connections_opened += 1
        conn.transport.set_keepalive(15)
        return conn

    def _translate(self, exc: BaseException, timeout: float) -> BaseException:
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
            return AuthError(h.name, f"password-free SSH to {h.user}@{h.address} failed: key {key} was refused",
                             hint=f"run `ssh-copy-id -p {h.port} {'-i ' + h.identity_file + ' ' if h.identity_file else ''}"
                                  f"{h.user}@{h.address}`, or check user/identity_file in the inventory")
        if isinstance(exc, socket.gaierror):
            return ConnectError(h.name, f"cannot resolve {h.address!r}: {exc.strerror or exc}",
                                hint="check the address in the inventory or your DNS")
        if isinstance(exc, ConnectionRefusedError):
            return TransientNetworkError(h.name, f"connection to {h.address}:{h.port} refused",
                                         hint="is sshd running on the host and listening on that port?")
        if isinstance(exc, (socket.timeout, TimeoutError)):
            return TransientNetworkError(h.name, f"timed out after {timeout:g}s connecting to "
                                         f"{h.address}:{h.port}", hint=_UNREACHABLE_HINT)
        if isinstance(exc, OSError) and exc.errno in (errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH,
                                                      errno.ENETUNREACH, errno.ETIMEDOUT, errno.EPIPE):
            return TransientNetworkError(h.name, f"cannot connect to {h.address}:{h.port}: {exc.strerror}",
                                         hint=_UNREACHABLE_HINT)
        if isinstance(exc, (EOFError, paramiko.SSHException)):
            return TransientNetworkError(h.name, f"SSH handshake with {h.address}:{h.port} failed: {exc}",
                                         hint="is it an SSH server? is it overloaded (MaxStartups)?")
        if isinstance(exc, KeyboardInterrupt):
            return exc
        return ConnectError(h.name, f"cannot connect to {h.target}: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    # ---- the primitive
    def _exec(self, script, *, stdin, sink, timeout):
        self.connect()
        assert self._conn is not None
        deadline = time.monotonic() + timeout
        try:
            chan = self._conn.transport.open_session(timeout=min(timeout, self.connect_timeout))
        except (paramiko.SSHException, EOFError, OSError) as exc:
            self.close()
            raise TransientNetworkError(self.host.name, f"lost the SSH connection to {self.host.target}: {exc}",
                                        hint=_UNREACHABLE_HINT) from None
        try:
            return _drive(chan, script, stdin, sink, deadline, self.host.name, timeout)
        except (socket.error, paramiko.SSHException, EOFError) as exc:
            self.close()
            raise TransientNetworkError(self.host.name, f"lost the SSH connection to {self.host.target}: {exc}",
                                        hint=_UNREACHABLE_HINT) from None
        finally:
            chan.close()


_UNREACHABLE_HINT = "is the host up and reachable from here (address, firewall, link)?"


def _drive(chan: paramiko.Channel, script: str, stdin, sink, deadline: float, host: str,
           timeout: float) -> tuple[int, bytes, bytes]:
    # `sh -c` so the remote login shell (bash, zsh, csh...) only ever parses one quoted word.
    chan.exec_command("exec sh -c " + shlex.quote(script))
    if stdin is not None:
        chan.settimeout(max(0.1, deadline - time.monotonic()))
        if isinstance(stdin, (bytes, bytearray)):
            for i in range(0, len(stdin), CHUNK):
                chan.sendall(stdin[i:i + CHUNK])
        else:
            while True:
                block = stdin.read(CHUNK)
                if not block:
                    break
                chan.sendall(block)
    chan.shutdown_write()
    out, err = bytearray(), bytearray()
    chan.settimeout(0.0)
    while True:
        progressed = False
        while chan.recv_ready():
            data = chan.recv(CHUNK)
            if not data:
                break
            progressed = True
            if sink is not None:
                sink.write(data)
            else:
                out += data
        while chan.recv_stderr_ready():
            data = chan.recv_stderr(CHUNK)
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
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RemoteTimeout(host, f"command timed out after {timeout:g}s",
                                hint="raise ssh.command_timeout if the host is just slow")
        if not progressed:
            select.select([chan], [], [], min(remaining, 1.0))
    rc = chan.recv_exit_status()
    if rc == -1:
        raise TransientNetworkError(host, "the SSH channel closed without an exit status")
    return rc, bytes(out), bytes(err)
