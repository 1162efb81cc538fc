"""Transports: how orch reaches a host. `Pool` keeps ONE per host per invocation."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..model import Cluster, Host, SshSettings
from .base import Result, Transport, build_script, quote_argv
from .local import LocalTransport

if TYPE_CHECKING:
    from .ssh import Gateways

__all__ = ["Pool", "Result", "Transport", "build_script", "make_transport", "quote_argv"]


def make_transport(host: Host, ssh: SshSettings, gateways=None) -> Transport:
    """The host's transport; `gateways` (ssh.Gateways) shares jump-host connections between hosts."""
    if host.connection == "local":
        return LocalTransport(host, ssh.command_timeout)
    from .ssh import SshTransport  # lazy: paramiko, only for ssh hosts

    return SshTransport.for_settings(host, ssh, gateways)


class Pool:
    """One transport (so one SSH connection) per host, shared by every step of a command: the
    inventory's hosts by name or Host, and any other Host it is given (a Slurm login host: the
    Slurm client takes `pool.__getitem__` as its transport factory).

    Use as a context manager; everything is closed on exit."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._transports: dict[str, Transport] = {}
        self._gateways: Gateways | None = None  # made for the first host behind a jump host
        self._lock = threading.Lock()

    def __getitem__(self, host: Host | str) -> Transport:
        if isinstance(host, str):
            host = self.cluster.host(host)
        with self._lock:
            t = self._transports.get(host.name)
            if t is None:
                t = self._transports[host.name] = make_transport(host, self.cluster.ssh, self._gateways_for(host))
            return t

    def _gateways_for(self, host: Host):
        """The invocation's jump-host connections (made for the first host behind one). Lock held."""
        if host.jump and self._gateways is None:
            from .ssh import Gateways  # lazy: paramiko, only behind a jump host

            self._gateways = Gateways(self.cluster.ssh)
        return self._gateways

    def release_held(self) -> None:
        """Every session a probe held for a later command (Transport.probe(hold=True)) closed."""
        with self._lock:
            transports = list(self._transports.values())
        for t in transports:
            t.release_held()

    def close(self) -> None:
        with self._lock:
            transports: list[Transport | Gateways]
            transports, self._transports = list(self._transports.values()), {}
            if self._gateways is not None:
                transports.append(self._gateways)  # after the hosts behind them
                self._gateways = None
        for t in transports:
            try:
                t.close()
            except Exception:  # noqa: BLE001 - closing must never mask the real outcome
                pass

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
