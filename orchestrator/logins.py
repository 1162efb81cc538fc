"""Who logs in where (pure): the one rule for "the launch user is root", and the ssh options one
host needs to log in to another as orch does (mpirun's plm_rsh_args, `orch check`'s mesh test)."""

from __future__ import annotations

from .model import Host


# ssh from one host to another (the mesh check, the sync relay): the fast key exchange first, where
# that host's ssh knows it (`ssh -G -o ...` tells)
HOST_KEX = "KexAlgorithms=^curve25519-sha256,curve25519-sha256@libssh.org"


# `orch up`: the launch host's mesh test (mpirun's jobs, the sync relay's) leaves each of its ssh
# connections open for a while (a master, ControlPersist), and mpirun's own ssh to the same host
# (ControlPath in plm_rsh_args) and the sync relay's share it: the key exchange and the login
# happen once, not two or three times (at 4 hosts, mpirun's start 0.38 -> 0.14 s). The sockets
# live in the launch user's own directory, SHARE_DIR with their uid, made private (0700) by the
# test, or not used: a socket there lets whoever can reach it log in as that user.
SHARE_DIR = "/tmp/orch-ssh-{uid}"
SHARE_PERSIST = 30  # seconds a master outlives its last session (the check's, the relay's, mpirun's)


def share_name(token: str) -> str:
    """The socket's name in SHARE_DIR, as ssh's ControlPath ends (`token`: one `orch up`'s own,
    so a master is never one an earlier run left; %C, OpenSSH >= 6.7: a hash of both ends, user
    and port, 40 characters whatever the host's name)."""
    return f"{token}-%C"


def is_root(*, uid: int | None = None, user: str | None = None) -> bool:
    """The one rule for "the launch user is root" (mpirun then needs --allow-run-as-root): uid 0
    when the host said (`id -u`, up's prepare), else the login name (`id -un` in orch check; the
    inventory's user for `orch plan`, which touches no host)."""
    return uid == 0 if uid is not None else user == "root"


def ssh_args(source: Host, target: Host) -> list[str]:
    """What `ssh` on `source` needs, beyond the address, to log in to `target` as orch does: its
    port and user when they are not ssh's defaults there. mpirun gets exactly these
    (plm_rsh_args), and `orch check`'s mesh test uses them too."""
    out = []
    if target.port != 22:
        out += ["-p", str(target.port)]
    if target.user != source.user:
        out += ["-l", target.user]
    return out
