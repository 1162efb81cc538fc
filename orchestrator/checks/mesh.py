"""mesh: password-free ssh (BatchMode, as mpirun does) from the launch host (every host with
--full-mesh) to every other host, with the address and options mpirun will use. The slowest
section: it starts in the background first and prints last."""

from __future__ import annotations

import shlex
from typing import Sequence

from .. import probes
from ..probes import NOT_INSTALLED, SHARED, MeshTarget, Section
from ..hostsets import fold
from ..launchers import launcher
from ..logins import HOST_KEX, SHARE_DIR, SHARE_PERSIST, ssh_args
from ..model import Host
from .base import Check, CheckResult, Probe, register, result, section


def _applies(plan, host: Host) -> bool:
    return host.name in plan.mesh_from


def mesh_body(targets: Sequence[MeshTarget], connect_timeout: float, command_timeout: float,
              share: str = "") -> str:
    """`share`: the name of the sockets (logins.share_name, in SHARE_DIR) each test's connection
    stays open on for mpirun, when the launch user's directory for them is theirs alone: the
    SHARED line then says where (probes.mesh_shared); else no master, no line."""
    ct = max(1, round(connect_timeout))
    limit = max(ct + 10, int(command_timeout * 0.8))
    jobs = []
    for t in targets:
        args = "".join(" " + shlex.quote(a) for a in (*t.ssh_args, t.address))
        # (an ssh that said nothing, the usual case, spends no processes on making its words one line)
        jobs.append(f"( e=$(ssh -o BatchMode=yes -o ConnectTimeout={ct}{args} true 2>&1 >/dev/null "
                    f"</dev/null); r=$?; [ -z \"$e\" ] || e=$(printf '%s' \"$e\" | tr '\\t\\n\\r' '   ' | cut -c1-300); "
                    f"printf '%s\\t%s\\t%s\\n' {shlex.quote(t.name)} \"$r\" \"$e\" ) &")
    # ConnectTimeout bounds the TCP connect; `timeout` also bounds a host that accepts but never answers,
    # within the probe's own command_timeout so that the other sections still report
    # OpenSSH >= 9.0 opens with the sntrup761x25519 key exchange, ~0.15 s of CPU on this host per
    # connection (minutes of CPU for a thousand hosts): a test that runs `true` puts curve25519
    # first (mpirun's own ssh keeps its defaults; a server without curve25519 still gets the rest).
    # An ssh that does not know `^` (< 8.2) is left as it is.
    shared = ""
    if share:
        # made here (0700) or made before by this user: anything else (planted by another user, a
        # link, other modes) and the sockets would not be theirs alone: no master then
        d = SHARE_DIR.format(uid="$(id -u)")
        shared = (f'D={d}; mkdir -m 700 -- "$D" 2>/dev/null\n'
                  'if [ -d "$D" ] && [ ! -h "$D" ] && [ "$(stat -c \'%u %a\' -- "$D" 2>/dev/null)" = "$(id -u) 700" ]; '
                  f"then K=\"$K -o ControlMaster=auto -o ControlPersist={SHARE_PERSIST} "
                  f"-o ControlPath=$D/{shlex.quote(share)}\"; echo \"{SHARED} $D/{shlex.quote(share)}\"; fi\n")
    return (f"command -v ssh >/dev/null 2>&1 || {{ echo {NOT_INSTALLED}; exit 0; }}\n"
            f"M=; command -v timeout >/dev/null 2>&1 && M='timeout {limit}'\n"
            f"K=; ssh -G -o {HOST_KEX} localhost >/dev/null 2>&1 && K='-o {HOST_KEX}'\n"
            + shared
            + "S=$(command -v ssh)\nssh() { $M \"$S\" $K \"$@\"; }\n"
            + "\n".join(jobs) + "\nwait")


def mesh_targets(plan, source: Host) -> list[MeshTarget]:
    """Every other host, as mpirun will ssh to it from `source`: the address and ssh options
    mpirun gets (connection: local hosts are this machine)."""
    return [MeshTarget(h.name, h.cluster_address, tuple(ssh_args(source, h))) for h in plan.hosts
            if h.name != source.name and h.connection == "ssh"]


def _shell(plan, host: Host) -> list[tuple[str, str]]:
    targets = mesh_targets(plan, host) if _applies(plan, host) else []
    if not targets:
        return []
    ssh = plan.cluster.ssh
    share = plan.share if host.name == plan.launch.name else ""
    return [("mesh", mesh_body(targets, ssh.connect_timeout, ssh.command_timeout, share))]


MESH = Probe("mesh", _shell, place="background")


def needed_by(plan) -> str:
    """Who needs the ssh the mesh tests, in words: mpirun (its daemons), the sync relay
    (job.sync_via: launch-host), or only --full-mesh."""
    if launcher(plan.cluster).needs_mesh:
        return "mpirun"
    if plan.cluster.job.sync_via == "launch-host":
        return SYNC_RELAY
    return "--full-mesh"


SYNC_RELAY = "the sync relay (job.sync_via: launch-host)"


def judge_mesh(host: Host, sec: Section, targets: Sequence[MeshTarget], connect_timeout: float,
               command_timeout: float = 120, who: str = "mpirun") -> CheckResult:
    """`who`: what needs this ssh (needed_by), named in the words."""
    got = probes.parse_mesh(sec.body)
    if got is None:
        why = {"mpirun": "mpirun needs one to start its daemons on the other hosts",
               SYNC_RELAY: "the launch host passes the code on by ssh (job.sync_via: launch-host; "
                           "`sync_via: controller` sends it from the controller instead)"}.get(who, "")
        return result("mesh", host, "fail", "no ssh client on this host" + (f": {why}" if why else ""))
    failing: dict[str, list[str]] = {}
    for t in targets:
        rc, err = got.get(t.name, (None, ""))
        if rc == 0:
            continue
        if rc is None:
            why = "no answer from the test"
        elif rc == 124 and not err:
            limit = max(round(connect_timeout) + 10, int(command_timeout * 0.8))
            why = f"connected but no answer within {limit}s (ssh was stopped)"
        elif "timed out" in err.lower():
            why = err
        else:
            why = err or f"ssh exited with {rc}"
        failing.setdefault(why, []).append(t.name)
    if not failing:
        return result("mesh", host, "pass", f"password-free ssh (BatchMode) to {len(targets)} host(s), as {who} "
                                            "does")
    parts = [f"{fold(names)}: {why}" for why, names in failing.items()]
    hint = _mesh_hint(" ".join(failing))
    if who == SYNC_RELAY:
        hint = "; ".join(x for x in (hint, "or set job.sync_via: controller (each host gets the code from the "
                                          "controller)") if x)
    n = sum(len(v) for v in failing.values())
    return result("mesh", host, "fail", f"cannot ssh (BatchMode, as {who} does) to {n} of {len(targets)} host(s): "
                                        + "; ".join(parts) + (f"; {hint}" if hint else ""))


def _mesh_hint(errors: str) -> str:
    e = errors.lower()
    if "host key verification failed" in e or "no matching host key" in e:
        return ("add the other hosts' keys to this host's ~/.ssh/known_hosts (ssh-keyscan), since a BatchMode ssh "
                "cannot prompt")
    if "permission denied" in e:
        return "give this host's user key access to the others (ssh-copy-id from this host), or use ssh-agent"
    if "timed out" in e or "no route" in e or "refused" in e:
        return "check that the hosts reach each other on these addresses (firewall, routes, sshd running)"
    return ""


def _judge(plan, run) -> list[CheckResult]:
    ssh = plan.cluster.ssh
    return [judge_mesh(run.host, section(run.sections, "mesh"), mesh_targets(plan, run.host), ssh.connect_timeout,
                       ssh.command_timeout, needed_by(plan))]


register(Check("mesh", applies=_applies, probes=(MESH,), judge=_judge))
