"""`orch lab ...`: the simulated cluster's commands (orchestrator/lab/). Loaded only when `orch lab`
is run (cli.OrchGroup.lazy): no other command imports the lab."""

from __future__ import annotations

import json
import time

import click

from .errors import LabError
from .lab import Lab, list_labs, preflight
from .lab.model import SSH_PORT, USER_ID
from .lab.slurm import PARTITION
from .lab.system import DOWN_TOOLS


@click.group("lab")
def lab_group() -> None:
    """A simulated N-host cluster on this machine (root, Linux): netns + real sshd per host."""


_name_option = click.option("--name", default="lab", show_default=True, help="Lab name: 1-8 of a-z, 0-9.")


@lab_group.command("up")
@click.argument("n", type=int)
@_name_option
@click.option("--vary", multiple=True, metavar="I:TOOL=VERSION",
              help="Host I reports another version (openmpi, python, nccl, mindspore, torch, any python "
                   "dist; VERSION may be 'none'). I may be '*' for every host. Repeatable.")
@click.option("--all", "all_", multiple=True, metavar="TOOL=VERSION", help="Same as --vary '*:TOOL=VERSION'.")
@click.option("--refuse-key", multiple=True, type=int, metavar="I", help="Host I does not accept the lab key.")
@click.option("--slurm", is_flag=True, help="Also run a real Slurm: slurmctld here, a slurmd on every host "
                                            "(Debian's slurm-wlm and munge); prints its inventory too.")
@click.option("--ssh-port", type=click.IntRange(1, 65535), default=SSH_PORT, show_default=True,
              help="Port of every host's sshd (and the bastion's).")
@click.option("--user", default="root", show_default=True,
              help=f"The inventory's user: an ordinary account (uid {USER_ID}, home /home/USER) on every "
                   "host; root login still works.")
@click.option("--bastion", is_flag=True, help="Put the hosts on a network this machine cannot reach, behind a bastion "
                                              "(host 0, a jump host); writes an ssh_config too.")
@click.option("--dual-homed-head", is_flag=True,
              help="Host 1 is the only host this machine reaches (network A) and the others' jump host: it "
                   "is also on their network B, which this machine is not on; writes an ssh_config too.")
@click.option("--shared", metavar="PATH", help="Mount one directory of the lab at PATH in every host (as NFS or "
                                               "Lustre would): under /data (e.g. /data/shared), or an existing "
                                               "directory of this machine.")
@click.option("--replace", is_flag=True, help="Replace a lab of this name that is already up (everything on it stops).")
def lab_up(n: int, name: str, vary: tuple[str, ...], all_: tuple[str, ...], refuse_key: tuple[int, ...],
           slurm: bool, ssh_port: int, user: str, bastion: bool, dual_homed_head: bool, shared: str | None,
           replace: bool) -> None:
    """Start N hosts; prints the inventory path. A lab of the same name that is up is replaced
    only with --replace (someone may be using it)."""
    lab = Lab(name)
    if lab.exists() and not replace:
        try:
            st = lab.state()
            made = time.strftime("%Y-%m-%d %H:%M", time.localtime(st.get("created_at", 0)))
            what = f"{len(st.get('hosts', []))} hosts, made {made}"
        except LabError:
            what = "its state unreadable"
        raise LabError(f"lab {name} is already up ({what}); someone may be using it",
                       hint=f"pass --replace to remove it and make a new one, or pick another --name "
                            f"(`orch lab down --name {name}` removes it)")
    t0 = time.monotonic()
    lab.up(n, vary=[f"*:{a}" for a in all_] + list(vary), refuse_key=refuse_key, slurm=slurm, ssh_port=ssh_port,
           user=user, bastion=bastion, dual_homed_head=dual_homed_head, shared=shared)
    st = lab.state()
    head = st.get("dual_homed_head")
    where = (f"{st['hosts_subnet']} behind a bastion on {st['subnet']}" if st.get("bastion") else
             f"{st['hosts_subnet']} (network B), host 1 also on {st['subnet']} (network A)" if head else
             st["subnet"])
    click.echo(f"lab {name}: {n} hosts on {where} (bridge {st['bridge']}) up in {time.monotonic() - t0:.1f}s")
    if n <= 32:
        for rec in st["hosts"]:
            extra = " ".join(f"{k}={v}" for k, v in sorted(rec["versions"].items()))
            if rec["refuse_key"]:
                extra += " refuse-key"
            if head and rec["index"] == head["index"]:
                extra += f" also {rec['back_address']} on network B: the jump host"
            click.echo(f"  {rec['name']:<14} {rec['address']:<15} {extra}".rstrip())
    if st.get("bastion"):
        b = st["bastion"]
        click.echo(f"  {b['name']:<14} {b['address']:<15} bastion (host 0), {b['back_address']} on the hosts' side")
    if ssh_port != SSH_PORT or user != "root":
        click.echo(f"ssh: user {user}, port {ssh_port}")
    if st.get("bastion"):
        click.echo(f"ssh_config (every host by name, through the bastion): {lab.ssh_config_path}")
    elif head:
        click.echo(f"ssh_config (every host by name, the others through host 1): {lab.ssh_config_path}")
    if st.get("shared"):
        click.echo(f"shared: {st['shared']} is one directory on every host ({lab.state_dir / 'shared'} here)")
    click.echo(f"use it with any cluster file: orch up FILE -i {lab.inventory_path}", err=True)
    click.echo(str(lab.inventory_path))
    if slurm:
        click.echo(f"Slurm: partition {PARTITION}, SLURM_CONF={lab.slurm_conf}; a Slurm inventory:")
        click.echo(str(lab.slurm_inventory_path))


@lab_group.command("down")
@_name_option
@click.option("--all", "all_", is_flag=True, help="Remove every lab on this machine (stale test labs too).")
def lab_down(name: str, all_: bool) -> None:
    """Remove the lab: processes, namespaces, veths, bridge, state dir. Idempotent."""
    names = list_labs() if all_ else [name]
    if not names:
        click.echo("no labs")
    for n in names:
        removed = Lab(n).down()
        click.echo(f"lab {n}: {'removed' if removed else 'nothing to remove'}")


@lab_group.command("inventory")
@_name_option
@click.option("--slurm", is_flag=True, help="the lab's Slurm inventory (a lab made with --slurm)")
def lab_inventory(name: str, slurm: bool) -> None:
    """Print the path of the lab's inventory, for -i: `orch up FILE -i "$(orch lab inventory --name X)"`."""
    lab = Lab(name)
    path = lab.slurm_inventory_path if slurm else lab.inventory_path
    if not lab.exists() or not path.exists():
        raise LabError(f"lab {name} has no {'Slurm ' if slurm else ''}inventory ({path} does not exist)",
                       hint=f"orch lab up N --name {name}" + (" --slurm" if slurm else ""))
    click.echo(str(path))


@lab_group.command("status")
@_name_option
@click.option("--json", "as_json", is_flag=True, help="print the lab as one JSON object")
def lab_status(name: str, as_json: bool) -> None:
    """Per host: name, address, netns, sshd, link."""
    lab = Lab(name)
    preflight(DOWN_TOOLS)
    if not lab.exists():
        if as_json:
            click.echo(json.dumps({"name": name, "up": False, "hosts": []}))
        else:
            click.echo(f"lab {name}: not up (no {lab.state_path})")
        return
    st = lab.state()
    if as_json:
        b, head = st.get("bastion"), st.get("dual_homed_head")
        h1 = st["hosts"][0]
        click.echo(json.dumps({
            "name": name, "up": True, "status": st.get("status"), "subnet": st["subnet"], "bridge": st["bridge"],
            "bastion": {"name": b["name"], "subnet": b["subnet"], "bridge": b["bridge"]} if b else None,
            "dual_homed_head": {"name": h1["name"], "address": h1["address"], "back_address": h1["back_address"],
                                "subnet": head["subnet"], "bridge": head["bridge"]} if head else None,
            "inventory": str(lab.inventory_path), "ssh_config": str(lab.ssh_config_path) if b or head else None,
            "hosts": [{"index": s.host.index, "name": s.host.name, "address": s.host.address, "netns": s.host.netns,
                       "netns_up": bool(s.netns and s.holder_alive), "sshd_pid": s.sshd_pid, "sshd": s.sshd_alive,
                       "link": s.link_up} for s in lab.status()]}))
        return
    click.echo(f"lab {name}: {st['subnet']} bridge {st['bridge']} status {st.get('status')}")
    head = st.get("dual_homed_head")
    if st.get("bastion"):
        b = st["bastion"]
        click.echo(f"hosts on {b['subnet']} (bridge {b['bridge']}) behind the bastion {b['name']} (host 0)")
    elif head:
        h1 = st["hosts"][0]
        click.echo(f"hosts on {head['subnet']} (bridge {head['bridge']}, network B); {h1['name']} also "
                   f"{h1['back_address']} there: the only host on {st['subnet']} (network A), the others' jump host")
    rows = [("HOST", "ADDRESS", "NETNS", "SSHD", "LINK")]
    for s in lab.status():
        rows.append((
            s.host.name,
            s.host.address,
            s.host.netns + ("" if s.netns and s.holder_alive else " (gone)"),
            f"up (pid {s.sshd_pid})" if s.sshd_alive else "down",
            "up" if s.link_up else "down",
        ))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if st.get("bastion") or head:
        click.echo(f"ssh_config: {lab.ssh_config_path}")
    click.echo(f"inventory: {lab.inventory_path}")


@lab_group.command("sshd")
@click.argument("action", type=click.Choice(["stop", "start"]))
@click.argument("index", type=int)
@_name_option
def lab_sshd(action: str, index: int, name: str) -> None:
    """Stop or start host INDEX's sshd (fault injection); 0 is the bastion."""
    Lab(name).sshd(index, action == "start")
    click.echo(f"lab {name}: host {index} sshd {'started' if action == 'start' else 'stopped'}")


@lab_group.command("link")
@click.argument("action", type=click.Choice(["down", "up"]))
@click.argument("index", type=int)
@_name_option
def lab_link(action: str, index: int, name: str) -> None:
    """Take host INDEX's network link down or up (fault injection); 0 is the bastion's outer link."""
    Lab(name).link(index, action == "up")
    click.echo(f"lab {name}: host {index} link {action}")
