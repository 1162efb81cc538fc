"""One exception tree. Only the CLI turns these into exit codes.

Every error carries a message that says what went wrong and what to do next;
errors about a host carry the host, errors about a file carry where in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .checks.base import Report


@dataclass(frozen=True)
class Location:
    """Where in an input file a problem is: file, 1-based line, dotted field path."""

    file: str
    line: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        out = self.file
        if self.line is not None:
            out += f":{self.line}"
        if self.field:
            out += f": {self.field}"
        return out


class OrchError(Exception):
    """Base of every error orch reports to a user. exit_code is what the CLI returns. `by_host`:
    when it says what failed on several hosts (fanout.Results.raise_if_failed), each host's own
    error, for a caller that decides by what they were."""

    exit_code = 1
    by_host: Mapping[str, OrchError] = MappingProxyType({})

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  hint: {self.hint}"
        return self.message


class UsageError(OrchError):
    exit_code = 2


class SpecError(OrchError):
    """Bad cluster.yaml / inventory. Carries every problem found, each with a location."""

    exit_code = 2

    def __init__(self, problems: list[tuple[Location, str]], *, hint: str | None = None):
        self.problems = list(problems)
        lines = [f"{loc}: {msg}" for loc, msg in self.problems]
        head = "invalid cluster file" if len(lines) != 1 else lines[0]
        body = head if len(lines) == 1 else head + ":\n" + "\n".join(f"  {ln}" for ln in lines)
        super().__init__(body, hint=hint)


class PlanError(OrchError):
    """The job cannot be laid out on these hosts (a device rule, too many ranks...)."""

    exit_code = 2


class HostError(OrchError):
    """Something failed on (or on the way to) one host."""

    def __init__(self, host: str, message: str, *, hint: str | None = None, result: Any = None):
        super().__init__(f"{host}: {message}", hint=hint)
        self.host = host
        self.result = result


class ConnectError(HostError):
    """Could not reach or log in to a host."""


class TransientNetworkError(ConnectError):
    """Refused, reset, timed out: worth retrying."""


class AuthError(ConnectError):
    """Key refused. Never retried."""


class HostKeyError(ConnectError):
    """Host key unknown (under strict) or CHANGED. Never retried."""


class SessionRefused(HostError):
    """The host's SSH server refused one more session on a connection that works (sshd_config
    MaxSessions): the connection stays; a later session, once one of ours ends, may be taken."""


class RemoteTimeout(HostError):
    """A remote command did not finish within its timeout."""


class RemoteCommandError(HostError):
    """A remote command exited non-zero where success was required. Carries the Result."""


class LabError(OrchError):
    """The simulated cluster could not be made or torn down."""


class PreflightFailed(OrchError):
    exit_code = 3
    report: Report | None = None  # the checks that failed (api.up), for the CLI to print


class RunConflict(OrchError):
    """Another run of orch holds the workdir on a host (a second run there would mix its logs)."""
    exit_code = 2


class LocalWriteError(OrchError):
    """orch could not write on this machine (its disk full, a directory read-only): a run's
    record or logs are incomplete; the hosts still have the logs."""
    exit_code = 5

    @classmethod
    def of_log(cls, path: str | os.PathLike[str], exc: OSError) -> LocalWriteError:
        """A log's copy here that cannot be written (the hosts keep the log)."""
        return cls(f"cannot write {path}: {exc.strerror or exc}",
                   hint="free some space here, then `orch logs` fetches the rest")


class LogsIncomplete(OrchError):
    """Some of a run's logs could not be brought here (yet)."""
    exit_code = 5


class Interrupted(OrchError):
    exit_code = 130
