"""The OpenSSH client config (`~/.ssh/config`): what an inventory address resolves to.

paramiko's SSHConfig parses the file and matches `Host`/`Match` blocks (first value wins, as
OpenSSH does). Around it, this module adds what orch needs:

- `Include` (paramiko has none): included files are read in place, relative ones from ~/.ssh;
- tokens (`%h %p %r %n %u %d %%`, `~`) are expanded here, with the values orch really uses:
  cluster.yaml wins over ssh_config, so `ProxyCommand nc %h %p` must see the port the inventory
  sets, not the one ssh_config would have picked (paramiko expands them with its own);
- `ProxyJump` hops (`[user@]host[:port]`, comma-separated, `ssh://` URLs) parsed into hops, each
  looked up again (a jump host's alias and settings come from the same file, as with ssh -J).

Reading the file is the only I/O; `SshConfig.from_text` and everything after it is pure.
"""

from __future__ import annotations

import getpass
import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PATH = "~/.ssh/config"
_PCT = "\x00"  # stands in for '%' while paramiko parses, so that paramiko expands no token
_INCLUDE = re.compile(r"^\s*include(?:\s*=\s*|\s+)(.+?)\s*$", re.IGNORECASE)
_BLOCK = re.compile(r"^\s*(host|match)(\s*=\s*|\s+)\S", re.IGNORECASE)
MAX_INCLUDE_DEPTH = 16  # OpenSSH's own limit
MAX_HOPS = 8


class SshConfigError(Exception):
    """A config file orch cannot use: `where` is "FILE" or "FILE:LINE"."""

    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where
        self.message = message


@dataclass(frozen=True)
class Entry:
    """What the config says for one alias, tokens still unexpanded (see `expand`)."""

    hostname: str | None = None
    user: str | None = None
    port: int | None = None
    identity_files: tuple[str, ...] = ()
    known_hosts: tuple[str, ...] = ()
    proxy_jump: str | None = None
    proxy_command: str | None = None
    server_alive_interval: float | None = None
    connect_timeout: float | None = None


@dataclass(frozen=True)
class Hop:
    """One jump host as written in ProxyJump or the inventory's `jump:`: user and port None when
    not given there."""

    host: str
    user: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        return (f"{self.user}@" if self.user else "") + self.host + (f":{self.port}" if self.port else "")


def local_user() -> str:
    """The user ssh would log in as when none is given: this one's login name."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name in some containers
        return "root"


def expand(value: str, *, alias: str, hostname: str, port: int, user: str) -> str:
    """OpenSSH's tokens in `value`, with the values the connection really uses."""
    table = {"h": hostname, "p": str(port), "r": user, "n": alias, "u": local_user(),
             "d": os.path.expanduser("~"), "%": "%"}
    out = re.sub(r"%(.)", lambda m: table.get(m.group(1), m.group(0)), value)
    if out.startswith("~"):
        out = os.path.expanduser(out)
    return out


@dataclass(frozen=True)
class Resolved:
    """An alias as the connection will use it: ssh_config's entry for it, and the user, port and
    HostName that win (the caller's values first, then ssh_config's, then the defaults)."""

    alias: str
    entry: Entry
    user: str
    port: int
    hostname: str | None  # None: the alias itself

    def expand(self, value: str) -> str:
        return expand(value, alias=self.alias, hostname=self.hostname or self.alias, port=self.port,
                      user=self.user)

    def first_identity(self) -> str | None:
        """The first of the entry's IdentityFiles that exists (OpenSSH skips missing ones too)."""
        return next((p for p in map(self.expand, self.entry.identity_files) if os.path.exists(p)), None)


def resolve(config: SshConfig | None, alias: str, user: str | None, port: int | None,
            default_user: str) -> Resolved:
    """`alias` looked up in `config` (none: nothing there), with `user`/`port` winning over it."""
    e = config.lookup(alias) if config is not None else Entry()
    user = user or e.user or default_user
    port = port or e.port or 22
    hostname = expand(e.hostname, alias=alias, hostname=alias, port=port, user=user) if e.hostname else None
    return Resolved(alias, e, user, port, hostname)


def hops_of(spec: str | list[str], where: str) -> tuple[Hop, ...]:
    """The inventory's `jump:` (a string, or a list: a chain) as hops."""
    return parse_hops(",".join(spec) if isinstance(spec, list) else spec, where)


def parse_hops(text: str, where: str) -> tuple[Hop, ...]:
    """`[user@]host[:port]` (or `ssh://[user@]host[:port]`), comma-separated -> hops, first hop
    first. `none` is no hop. Raises SshConfigError naming `where`."""
    if text.strip().lower() == "none":
        return ()
    hops = []
    for part in text.split(","):
        part = part.strip()
        if part.startswith("ssh://"):
            part = part[len("ssh://"):].rstrip("/")
        user, _, hostport = part.rpartition("@")
        host, port = hostport, None
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?|([^:\[\]]+)(?::(\d+))?", hostport)
        if not part or not m or any(c.isspace() for c in part):
            raise SshConfigError(where, f"bad jump host {part!r}: expected [user@]host[:port]")
        host = m.group(1) or m.group(3)
        port_s = m.group(2) or m.group(4)
        if port_s is not None:
            port = int(port_s)
            if not 1 <= port <= 65535:
                raise SshConfigError(where, f"bad jump host {part!r}: port must be between 1 and 65535")
        hops.append(Hop(host, user or None, port))
    return tuple(hops)


_MATCH_EXEC = re.compile(r"^\s*match\s.*\bexec\b", re.I | re.M)


def import_paramiko() -> None:
    """Import paramiko without invoke, which paramiko loads only to run ssh_config's `Match exec`
    commands: half of paramiko's import time (0.08-0.17 s of every orch command that connects, on
    a 2-core machine). SshConfig hands paramiko invoke when a config has a `Match exec`."""
    if "paramiko" in sys.modules or "invoke" in sys.modules:
        return
    sys.modules["invoke"] = None  # type: ignore[assignment]  # None: `import invoke` fails, paramiko does without
    try:
        import paramiko  # noqa: F401 - imported once, here; its importers find it loaded
    finally:
        del sys.modules["invoke"]


class SshConfig:
    """One parsed config file; `lookup(alias)` -> Entry."""

    def __init__(self, path: str, text: str):
        import_paramiko()
        import paramiko.config

        if _MATCH_EXEC.search(text):  # paramiko runs a `Match exec` command with invoke
            import invoke

            paramiko.config.invoke = invoke  # type: ignore[attr-defined]  # the stubs omit paramiko's optional import
        self.path = path
        try:
            self._config = paramiko.SSHConfig.from_text(text.replace("%", _PCT))
        except Exception as exc:  # noqa: BLE001 - paramiko's ConfigParseError and kin, named with the file
            raise SshConfigError(path, f"cannot parse it: {str(exc).replace(_PCT, '%')}") from None

    @classmethod
    def load(cls, path: str) -> SshConfig | None:
        """The file at `path` (`~` expanded), Includes inlined; None when it does not exist."""
        full = os.path.expanduser(path)
        if not os.path.exists(full):
            return None
        return cls(full, _read_with_includes(full, 0))

    def lookup(self, alias: str) -> Entry:
        try:
            d = self._config.lookup(alias)
        except Exception as exc:  # noqa: BLE001 - a Match exec/canonical paramiko cannot evaluate, and kin
            raise SshConfigError(self.path, f"cannot look up {alias!r}: {str(exc).replace(_PCT, '%')}") from None

        def one(key: str) -> str | None:
            v = d.get(key)
            return v.replace(_PCT, "%") if isinstance(v, str) else None

        def number(key: str, kind=int):
            v = one(key)
            if v is None:
                return None
            try:
                return kind(v)
            except ValueError:
                raise SshConfigError(self.path, f"{key} {v!r} (for host {alias}) is not a number") from None

        hostname = one("hostname")
        port = number("port")
        if port is not None and not 1 <= port <= 65535:
            raise SshConfigError(self.path, f"Port {port} (for host {alias}) is not between 1 and 65535")
        return Entry(
            hostname=None if hostname in (None, alias) else hostname,
            user=one("user"),
            port=port,
            identity_files=tuple(v.replace(_PCT, "%") for v in d.get("identityfile", ())),
            known_hosts=tuple((one("userknownhostsfile") or "").split()),
            proxy_jump=one("proxyjump"),
            proxy_command=None if (one("proxycommand") or "none").lower() == "none" else one("proxycommand"),
            server_alive_interval=number("serveraliveinterval", float),
            connect_timeout=number("connecttimeout", float),
        )


def _read_with_includes(path: str, depth: int) -> str:
    """The file's text with every `Include` line replaced by the files it names (globs allowed;
    relative names are under ~/.ssh, as for a user's config)."""
    if depth > MAX_INCLUDE_DEPTH:
        raise SshConfigError(path, f"Include nested deeper than {MAX_INCLUDE_DEPTH} levels (a loop?)")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SshConfigError(path, f"cannot read it: {exc}") from None
    out = []
    block = None  # the Host/Match line the file is in: what follows an Include still belongs to it
    for line in text.splitlines():
        m = _INCLUDE.match(line)
        if not m:
            if _BLOCK.match(line):
                block = line
            out.append(line)
            continue
        for name in m.group(1).split():
            name = os.path.expanduser(name.strip('"'))
            if not os.path.isabs(name):
                name = os.path.join(os.path.expanduser("~/.ssh"), name)
            for included in sorted(glob.glob(name)):
                out.append(_read_with_includes(included, depth + 1))
        if block is not None:
            out.append(block)
    return "\n".join(out) + "\n"
