"""The command line. The ONLY place that prints tables or exits. It maps each command's flags to
the library's calls (api.py) and prints what they return.

Each command imports the modules it needs when it runs (start-up time: `orch --version` and
`orch status` load nothing they do not use), so the imports here sit inside the commands."""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import tempfile
import time
import traceback
from typing import TYPE_CHECKING, NoReturn

import click

from . import __version__
from .errors import OrchError, UsageError

if TYPE_CHECKING:
    from .lifecycle import Events
else:  # the lifecycle (and all it imports) is loaded only by the commands that run one
    Events = object


def _save_traceback() -> str:
    fd, path = tempfile.mkstemp(prefix="orch-crash-", suffix=".txt")
    with os.fdopen(fd, "w") as fh:
        fh.write(f"orch {__version__} crashed at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        fh.write(f"argv: {sys.argv!r}\n\n")
        traceback.print_exc(file=fh)
    return path


JSON_META = "orch.json"  # ctx.meta: "wanted" once a command's --json is given, "printed" once its object is out


def _json_wanted(ctx: click.Context, param, value: bool) -> bool:
    if value:
        ctx.meta[JSON_META] = "wanted"
    return value


def json_option(help: str):
    """--json: one JSON object on stdout; an error (OrchGroup.invoke) is one too."""
    return click.option("--json", "as_json", is_flag=True, is_eager=True, callback=_json_wanted, help=help)


class OrchGroup(click.Group):
    """Maps OrchError subclasses to exit codes; an unexpected crash saves its traceback.
    `lab` (orchestrator/cli_lab.py, over orchestrator/lab/) is imported only when used: it is big
    and no other command needs it."""

    lazy = {"lab": ("orchestrator.cli_lab", "lab_group")}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(self.lazy))

    def get_command(self, ctx: click.Context, name: str):
        if name in self.lazy and name not in self.commands:
            import importlib

            module, attr = self.lazy[name]
            self.add_command(getattr(importlib.import_module(module), attr), name)
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OrchError as exc:
            if ctx.meta.get(JSON_META) == "wanted":  # stdout still holds one object, for a script
                import json as _json

                click.echo(_json.dumps({"state": "error", "exit_code": exc.exit_code, "message": exc.message,
                                        "hint": exc.hint}))
            click.echo(f"orch: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("orch: interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:  # `orch logs | head`: the reader left; end quietly, as `cat` would
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush there
            except OSError:
                pass
            ctx.exit(141)  # 128 + SIGPIPE, what a shell reports for a writer killed by a closed pipe
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as exc:  # noqa: BLE001 - last-resort handler
            path = _save_traceback()
            click.echo(
                f"orch: internal error: {type(exc).__name__}: {exc}\n"
                f"  the traceback was saved to {path}; please attach it to a bug report",
                err=True,
            )
            ctx.exit(70)


@click.group(cls=OrchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orch")
def cli() -> None:
    """Launch distributed deep-learning training across many machines over SSH."""


def cluster_file_argument(f):
    return click.argument("file", required=False, default="cluster.yaml", metavar="[FILE, default ./cluster.yaml]",
                          type=click.Path(dir_okay=False))(f)


def inventory_option(f):
    """-i/--inventory PATH (or ORCH_INVENTORY): another inventory than the cluster file's own,
    as with Ansible's -i. Kept in the context; `load` uses it."""
    def keep(ctx, param, value):
        if value:
            ctx.meta["orch.inventory"] = value
        return value
    return click.option("-i", "--inventory", "inventory", default=None, metavar="PATH", envvar="ORCH_INVENTORY",
                        expose_value=False, callback=keep, type=click.Path(dir_okay=False),
                        help="use this inventory instead of the cluster file's `inventory:` "
                             "(also ORCH_INVENTORY), e.g. -i \"$(orch lab inventory --name NAME)\"")(f)


def interface_option(f):
    """--interface IFACE: job.interface for this command (plan, check, up), kept in the context;
    `load` applies it."""
    def keep(ctx, param, value):
        if value:
            ctx.meta["orch.interface"] = value
        return value
    return click.option("--interface", default=None, metavar="IFACE", expose_value=False, callback=keep,
                        help="the NIC for MPI/NCCL/HCCL/Gloo traffic, as job.interface (a name, or auto)")(f)


def hosts_option(f):
    return interface_option(inventory_option(click.option(
        "--hosts", "hosts", default=None, metavar="PATTERN",
        help="act on a subset: names, ranges (node[01-04]) or group names, comma-separated")(f)))


@contextlib.contextmanager
def _loading():
    """The `orch` program's start-up (main(): not a test's or a library caller's): the cyclic
    GC is off while a command loads its modules and the cluster file, and what they made is
    frozen after it (gc.freeze: never traversed again). All of it lives as long as the command:
    the collections found nothing to free, and took 9-11 ms of `orch check`'s ~240 ms before its
    first connection at 32 hosts (~70 collections while pydantic, yaml and the models load)."""
    if not _AS_PROGRAM or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def load(file: str, hosts: str | None):
    """cluster.yaml (its inventory replaced by -i, if given) -> validated Cluster, narrowed to
    --hosts, with --interface as its job.interface."""
    from dataclasses import replace

    from .spec import load_cluster

    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    cluster = load_cluster(file, inventory=meta.get("orch.inventory")).select(hosts)
    if meta.get("orch.interface"):
        cluster = replace(cluster, job=replace(cluster.job, interface=meta["orch.interface"]))
    return cluster


# --- plan command (orch plan) ---

PLAN_TABLE_MAX_RANKS = 64


@cli.command("plan")
@cluster_file_argument
@hosts_option
@click.option("--out", "out", default=None, type=click.Path(file_okay=False),
              help="write plan.json, commands.json and the launcher's files (hostfile / rank_table.json) here")
@json_option(help="print plan.json on stdout instead of a table")
@click.option("--probe", is_flag=True,
              help="read /etc/hccn.conf on the hosts for device IPs missing from the inventory "
                   "(ranktable launcher); the only option that touches hosts")
@click.option("--replace", "swaps", multiple=True, metavar="HOST=SPARE",
              help="show the plan and files with spare SPARE in HOST's place, as the run's head renders them "
                   "when HOST is lost (repeatable)")
def plan_command(file: str, hosts: str | None, out: str | None, as_json: bool, probe: bool,
                 swaps: tuple[str, ...]) -> None:
    """Show the rank plan; with --out DIR, write every file and command `orch up` would use
    (plan.json, commands.json, the hostfile or rank table); --json: plan.json on stdout.
    Touches no host (unless --probe)."""
    import shlex
    from pathlib import Path

    from .api import plan_files
    from .devices import HCCN_CONF
    from .launchers import launcher as launcher_of
    from .launchers.ranktable import RANK_TABLE

    cluster = load(file, hosts)
    pairs: dict[str, str] = {}
    for item in swaps:
        old, eq, new = item.partition("=")
        if not eq or not old or not new:
            raise UsageError(f"--replace {item!r}: HOST=SPARE expected")
        pairs[old] = new
    if probe and cluster.slurm is None and not launcher_of(cluster).needs_device_ips(cluster):
        click.echo(f"--probe: nothing to read, launcher {cluster.job.launcher} on platform {cluster.job.platform} "
                   "needs no device IPs", err=True)
    got = plan_files(cluster, replace=pairs, probe=probe)
    cluster, rp, files = got.cluster, got.plan, got.files
    for w in rp.warnings:
        click.secho(w, fg="yellow", bold=True, err=True)
    if as_json:
        click.echo(files["plan.json"], nl=False)
    else:
        _plan_print(cluster, rp)
        if got.slurm_commands is not None and cluster.slurm is not None:
            click.echo(f"\nSlurm (hosts node1..node{cluster.slurm.allocated} stand for the allocated nodes):")
            for what, argv in got.slurm_commands["commands"].items():
                click.echo(f"  {what}: {shlex.join(argv)}")

    if not out and not as_json:
        click.echo(f"the files and commands `orch up` would use: `orch plan --out DIR` writes them "
                   f"({', '.join(sorted(files))})", err=True)
    if out:
        out_dir = Path(out)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (out_dir / name).write_text(text, encoding="utf-8")
        click.echo(f"wrote {', '.join(sorted(files))} to {out_dir}", err=as_json)
    if got.missing is not None and got.slurm_commands is not None:
        click.echo(f"{RANK_TABLE}: rendered at `orch up` from each allocated node's {HCCN_CONF}",
                   err=True)
    elif got.missing is not None:
        click.secho(f"WARNING: {RANK_TABLE} not rendered: {got.missing}\n  run `orch plan --probe` to read "
                    f"{HCCN_CONF} on the hosts"
                    + (" (and npu-smi's spod-info, for rank table 1.2)" if cluster.job.rank_table_version == "1.2"
                       else ""), fg="yellow", err=True)


def _plan_print(cluster, rp) -> None:
    from rich.table import Table

    from .hostsets import fold

    click.echo(f"{cluster.name}: {rp.size} rank{'s' if rp.size != 1 else ''} on {len(rp.hosts)} "
               f"host{'s' if len(rp.hosts) != 1 else ''}, launcher {rp.launcher}, "
               f"platform {rp.platform}, launch host {rp.launch_host.name} ({rp.launch_host.cluster_address})")
    if len(rp.hosts) > 1:
        from .launchers import head_reach

        click.echo(f"the other hosts reach {rp.launch_host.name} at "
                   f"{head_reach(cluster, rp.launch_host, rp.all_hosts).describe(rp.launch_host.name)}")
    console = _console()
    if rp.size <= PLAN_TABLE_MAX_RANKS:
        table = Table("rank", "host", "address", "local rank", "device")
        for r in rp.ranks:
            table.add_row(str(r.rank), r.host, r.address, str(r.local_rank), str(r.device_id))
    else:
        # Hosts in a row with the same layout are shown once, their names folded (node[001-512]).
        table = Table("hosts", "count", "ranks", "per host", "devices")
        runs: list[list] = []
        first = 0
        for h in rp.hosts:
            if runs and runs[-1][1] == h.devices:
                runs[-1][0].append(h.name)
            else:
                runs.append([[h.name], h.devices, first])
            first += h.slots
        for names, devices, start in runs:
            stop = start + len(names) * len(devices) - 1
            table.add_row(fold(names), str(len(names)), f"{start}-{stop}" if stop > start else str(start),
                          str(len(devices)), ",".join(map(str, devices)))
    console.print(table)
    if rp.spares:
        click.echo(f"spares: {fold(h.name for h in rp.spares)} (no ranks; one takes the place of a lost host "
                   f"other than {rp.launch_host.name}: `orch plan --replace HOST=SPARE` shows that plan)")


# --- check command (orch check) ---

CHECK_FOLD_ROWS = 16  # more hosts than this: hosts with identical rows share one (folded) row
_CELL = {"pass": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red"),
         "error": ("error", "magenta")}


@cli.command("check")
@cluster_file_argument
@hosts_option
@json_option(help='print one JSON object on stdout: {"ok": bool, "results": [{check, host, status, message}]}')
@click.option("--full-mesh", is_flag=True,
              help="test ssh between every ordered pair of hosts (default: launch host -> each other host)")
@click.option("--slurm-job", "slurm_job", default=None, metavar="ID",
              help="Slurm inventory: check the nodes of this running allocation (default: allocate briefly)")
@click.option("--print-probe", "print_probe", default=None, metavar="HOST",
              help="print the probe script orch check runs on HOST, and exit")
@click.option("--deep", is_flag=True,
              help="also check device health before a long job (check `health`, ascend/gpu: npu-smi health, "
                   "hccn_tool link/net health/ping; nvidia-smi ECC, kernel-log XIDs); see docs/health.md")
def check_command(file: str, hosts: str | None, as_json: bool, full_mesh: bool, slurm_job: str | None,
                  print_probe: str | None, deep: bool) -> None:
    """Preflight every host: ssh, versions, PATH, NICs, devices, workdir, disk, files, ports, stale
    processes, clocks (--deep: and device health). One SSH connection and one remote command per host.
    A Slurm inventory's nodes are those of --slurm-job, or of a brief allocation (released at once).

    Exit code: 0 nothing failed (warnings allowed), 1 a check failed or could not run, 2 bad file/usage,
    3 Slurm refused the allocation."""
    with _loading():
        from . import api
        from .shards import procs_for

        cluster = load(file, hosts)
    if cluster.slurm is not None and slurm_job is None and not as_json:
        click.echo(f"orch: asking Slurm for {cluster.slurm.allocated} node(s) to check", err=True)
    pending = None if as_json else (lambda jid, why: click.echo(f"orch: Slurm job {jid} is pending ({why}); "
                                                                "Ctrl-C cancels it", err=True))
    report = None
    with api.slurm_nodes(cluster, slurm_job, pending) as cluster:
        if print_probe is not None:
            click.echo(api.probe_script(cluster, print_probe, full_mesh=full_mesh, deep=deep), nl=False)
        else:
            status = None
            if not as_json and sys.stderr.isatty():
                from rich.console import Console

                status = Console(stderr=True, markup=False).status(f"checking {len(cluster.hosts)} host(s)...")
                status.start()
            try:  # past ~128 hosts the probes fan out from several processes
                report = api.check(cluster, full_mesh=full_mesh, deep=deep, procs=procs_for(len(cluster.hosts)))
            finally:
                if status is not None:
                    status.stop()
    if report is None:  # --print-probe (after the with: a Slurm allocation made for it is released)
        _end(0)
    if as_json:
        click.echo(report.to_json())
    else:
        _print_check(cluster, report)
    _end(0 if report.ok else 1)


def _end(code: int) -> NoReturn:
    """A command's end once everything it does is done: its files written and closed, its
    connections closed (each command's Pool is, before it returns), no thread of its own left
    running. As the `orch` program (main()), at once (_exit_now); for a test or a library caller
    of `cli`, by click's usual exit. Used by check, up, status and down."""
    if _AS_PROGRAM:
        _exit_now(code)
    click.get_current_context().exit(code)


def _exit_now(code: int) -> None:
    """End the `orch` program at once, its output flushed and the atexit handlers run (paramiko's,
    logging's, a driver's that wraps main()), without the interpreter's teardown: freeing every
    module and object (pydantic, paramiko, cryptography...) took 60-90 ms after `orch check` at 8
    hosts had printed everything, whether paramiko's connection threads had ended or not (60-64 ms
    with each connection's socket shut down and its thread joined first, 61-74 ms without); 67 ms
    after `orch up` at 32 hosts, 57 ms after `orch down`, 32 ms after `orch status`. Only for
    a command at its end (_end). Returns when the output cannot be flushed (a closed pipe): the
    usual exit then says so, as before."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        return
    import atexit
    import threading

    if any(t.is_alive() and not t.daemon and t is not threading.main_thread() for t in threading.enumerate()):
        return  # the usual exit waits for it: so does this one
    atexit._run_exitfuncs()  # what the usual exit runs before its teardown
    try:  # a handler may have written
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def _print_check(cluster, report) -> None:
    from rich.table import Table
    from rich.text import Text

    from .hostsets import by_value

    cells = report.cells()
    columns = [c for c in report.checks if any(c in row for row in cells.values())]
    rows: list[tuple[str, tuple]] = []
    values = [(h, tuple(cells.get(h, {}).get(c) for c in columns)) for h in report.hosts]
    if len(values) > CHECK_FOLD_ROWS:
        rows = [(names, v) for v, names in by_value(values)]
    else:
        rows = values
    console = _console()
    table = Table("host", *columns, title=f"orch check: {cluster.name}", title_justify="left")
    for name, v in rows:
        table.add_row(name, *[(Text(_CELL[s][0], style=_CELL[s][1]) if s else Text("-", style="dim")) for s in v])
    console.print(table)
    routed = [h for h in cluster.hosts if h.route != h.target or h.ssh_address != h.address]
    if routed:  # say where orch really connected, when ssh_config or jump hosts decide it
        if len(routed) > CHECK_FOLD_ROWS:
            lines = [f"{names}: {via}" for via, names in
                     by_value((h.name, h.route[len(h.target):].strip() or "directly") for h in routed)]
        else:
            lines = [f"{h.name}: {h.route}" for h in routed]
        for line in lines:
            console.print(Text.assemble(("route", "dim"), f" {line}"), soft_wrap=True)
    problems = report.problems()
    for p in problems:
        word, style = _CELL[p.status]
        where = f"{p.hosts}: " if p.hosts else ""
        console.print(Text.assemble((f"{word:5}", style), " ", (p.check, "bold"), f" {where}{p.message}"),
                      soft_wrap=True)
    failed = sum(1 for p in problems if p.status in ("fail", "error"))
    warned = sum(1 for p in problems if p.status == "warn")
    verdict = (f"{failed} problem(s) must be fixed", "bold red") if failed else ("nothing failed", "green")
    console.print(Text.assemble(f"{len(report.hosts)} host(s), {len(report.checks)} check(s): ", verdict,
                                (f", {warned} warning(s)" if warned else "") + f" ({report.duration:.1f}s)"))


# --- run commands (orch up / status / down / logs) ---


def _into_a_pipe(stream) -> bool:
    """Does `stream` go into a pipe or socket? The rank's output through one (`| tee`, `| grep`)
    may reach the terminal by a way orch cannot keep apart from a live view."""
    import stat

    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError):   # not a file at all (a test's buffer): nothing else reads it
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


class _CliEvents(Events):
    """Prints the lifecycle's progress: steps on stderr, the followed rank's bytes on stdout. On
    a terminal (stderr is one, not -q, TERM not dumb, the rank's output not into a pipe) the
    run's live view (top.panel: what `orch top` prints, bounded) stays under the rank's output
    (live.Panel); `close` leaves its last state on screen. Elsewhere: plain lines only, no
    control codes."""

    def __init__(self, quiet: bool, streams_output: bool = True):
        self.quiet = quiet
        self.panel = None
        if not quiet and sys.stderr.isatty() and os.environ.get("TERM") != "dumb" and not (
                streams_output and _into_a_pipe(sys.stdout)):
            from .live import Panel

            self.panel = Panel(sys.stderr, sys.stdout.buffer, out_on_terminal=sys.stdout.isatty())

    def _say(self, message: str, fg: str | None = None) -> None:
        import contextlib

        with self.panel.above() if self.panel is not None else contextlib.nullcontext():
            click.secho(message, err=True, fg=fg) if fg else click.echo(message, err=True)

    def step(self, message: str) -> None:
        if not self.quiet:
            self._say(f"orch: {message}")

    def progress(self, running: int, exited: int, total: int, elapsed: float, view=None) -> None:
        if self.panel is None:
            return
        import shutil

        from . import top

        size = shutil.get_terminal_size()
        head = f"orch: {running} running, {exited}/{total} ranks exited, {elapsed:.0f}s"
        self.panel.show(top.panel(head, view, time.time(), size.lines, size.columns))

    def output(self, rank: int, data: bytes) -> None:
        if self.quiet:
            return
        if self.panel is not None:
            self.panel.write(data)
        else:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()

    def warning(self, message: str) -> None:
        self._say(f"orch: warning: {message}", fg="yellow")

    def close(self) -> None:
        if self.panel is not None:
            self.panel.close()


@cli.command("up")
@cluster_file_argument
@hosts_option
@click.option("--detach", is_flag=True, help="return after launch, printing the run id; the job runs on, "
              "supervised on the cluster")
@click.option("--skip-checks", is_flag=True, help="do not run the preflight checks first")
@click.option("--force", is_flag=True, help="stop a run still live in the same workdir on these hosts first")
@click.option("--follow-rank", type=int, default=0, show_default=True, help="stream this rank's output")
@click.option("--quiet", "-q", is_flag=True, help="no progress and no rank output, only the verdict")
@json_option(help="print the outcome as one JSON object on stdout (no rank output there; progress stays on stderr)")
def up_command(file: str, hosts: str | None, detach: bool, skip_checks: bool, force: bool, follow_rank: int,
               quiet: bool, as_json: bool) -> None:
    """Check, render, distribute, launch, follow and gather a job. On a terminal, the followed
    rank's output streams with the run's live view (what `orch top` prints) kept under it.

    Exit code: 0 every rank exited 0; 1 the job failed (or was lost, stalled, timed out);
    2 bad file/usage, or another run is live in the workdir; 3 preflight failed, or Slurm
    refused the allocation (nothing started); 5 every rank exited 0 but some logs could not
    be kept here (this machine's disk full: `orch logs` fetches them later); 130 interrupted
    or stopped (every rank stopped). With --json, stdout holds only the outcome: run, state,
    exit_code, message, first_failure, exit_codes, attempts, logs, logs_missing."""
    import signal as _signal

    with _loading():
        from . import api
        from .errors import PreflightFailed

        cluster = load(file, hosts)

    def on_term(signum, frame):
        raise api.Terminated

    old = _signal.signal(_signal.SIGTERM, on_term)
    try:
        events = _CliEvents(quiet, streams_output=not (quiet or as_json))
        try:
            result = api.up(cluster, detach=detach, skip_checks=skip_checks, force=force,
                            follow_rank=follow_rank, show_output=not (quiet or as_json), events=events,
                            # finish stopping and gathering whatever signals come
                            on_finishing=lambda: _signal.signal(_signal.SIGTERM, _signal.SIG_IGN))
        finally:
            events.close()   # the live view's last state stays on screen, above the verdict
    except PreflightFailed as exc:
        report = exc.report
        if as_json:
            import json as _json

            click.echo(_json.dumps({"run": None, "state": "preflight_failed", "exit_code": exc.exit_code,
                                    "message": exc.message, "check": report.to_dict() if report else None}))
            click.get_current_context().meta[JSON_META] = "printed"
        elif report is not None:
            _print_check(cluster, report)
        raise
    finally:
        _signal.signal(_signal.SIGTERM, old)
    _report_outcome(result, as_json)


def _up_json(result) -> str:
    import json as _json

    outcome, run = result.outcome, result.run
    view = outcome.view
    return _json.dumps({"run": run.id, "state": outcome.state, "exit_code": result.exit_code,
                        "message": outcome.message, "first_failure": outcome.first_failure,
                        "exit_codes": {str(k): v for k, v in outcome.exit_codes.items()},
                        "attempts": view.attempts if view is not None else [],
                        "logs": str(run.logs_dir), "logs_missing": result.logs_missing})


def _report_outcome(result, as_json: bool = False) -> None:
    """Says how `orch up` ended (`as_json`: also as one JSON object on stdout) and exits with
    result.exit_code."""
    outcome, run = result.outcome, result.run
    if as_json:
        click.echo(_up_json(result))
    if outcome.state == "detached":
        if not as_json:
            click.echo(run.id)
        click.echo(f"orch: run {run.id} started; it is supervised on the cluster: follow it with "
                   f"`orch logs --run {run.id} -f`, see it with `orch status`, stop it with "
                   f"`orch down --run {run.id}`", err=True)
        _end(result.exit_code)
    where = f"logs in {run.logs_dir}"
    view = outcome.view
    if view is not None and len(view.attempts) > 1:
        for a in view.attempts:
            click.echo(f"orch: attempt {a['attempt']}: {a['state']}: {a.get('message') or ''}", err=True)
        from .runstate import history

        for line in history(view):
            click.echo(f"orch: {line}", err=True)
    missing = result.logs_missing
    if result.exit_code == 0:
        click.secho(f"orch: run {run.id} succeeded: {outcome.message} ({where})", fg="green", err=True)
    elif result.exit_code == 5:  # the job is fine, what orch keeps of it is not
        click.secho(f"orch: run {run.id} succeeded: {outcome.message}, but its logs here are incomplete"
                    + (f" (not gathered from {', '.join(missing)})" if missing else "")
                    + (f": {result.lifecycle.write_error}" if result.lifecycle.write_error else "")
                    + f"; the hosts keep them: `orch logs --run {run.id}` fetches what is missing", fg="yellow",
                    err=True)
    else:
        click.secho(f"orch: run {run.id} {outcome.state}: {outcome.message}", fg="red", err=True)
        ff = outcome.first_failure
        if ff is not None:
            tail = result.lifecycle.log_tail(ff["rank"])
            if tail:
                click.echo(f"--- last lines of rank {ff['rank']} ({ff['host']}) ---", err=True)
                click.echo(tail, err=True)
                click.echo("---", err=True)
        click.echo(f"orch: {where}", err=True)
    _end(result.exit_code)


def _run_option(f):
    return click.option("--run", "run_id", default=None, metavar="ID",
                        help="a run id (or unique prefix); default: the latest started from this directory")(f)


@cli.command("status")
@click.argument("file", required=False, default=None, type=click.Path(dir_okay=False),
                metavar="[FILE, default: the latest run recorded here, else ./cluster.yaml]")
@inventory_option
@_run_option
@json_option(help="print the status as one JSON object")
def status_command(file: str | None, run_id: str | None, as_json: bool) -> None:
    """Each rank of a run: host, device, pid, state, exit code; and the run's state, read from
    the cluster. With FILE, the latest run on FILE's hosts (or --run ID: that run, from the
    record here if it has one, else from its launch host).

    Exit code: 0 running or succeeded; 1 failed, lost, stalled or timed out, or its state
    cannot be read (the launch host unreachable); 4 stopped; 2 no such run."""
    import json as _json

    from rich.table import Table

    from . import api, runstate

    if file is None and run_id is None and not _has_runs() and not os.path.exists("cluster.yaml"):
        from .runs import RUNS_DIR

        raise UsageError(f"no runs recorded in {os.path.join(os.getcwd(), RUNS_DIR)} and no cluster.yaml here",
                         hint="run `orch status` in the directory `orch up` ran from, or name the cluster file: "
                              "`orch status FILE` (its latest run, asked of its hosts)")
    if file is not None or (run_id is None and not _has_runs()):
        cluster = load(file or "cluster.yaml", None)
        view, name = api.status(run_id, cluster=cluster), cluster.name
    else:
        view = api.status(run_id)
        name = _record_name(view.run_id)
    rid = view.run_id
    if as_json:
        click.echo(_json.dumps({"run": rid, **view.to_dict()}))
    else:
        console = _console()
        title = f"run {rid} ({name}): {view.state}" + (f", attempt {view.attempt}" if view.attempt > 1 else "")
        if view.slurm:
            title += f" (Slurm job {view.slurm['job_id']}: {view.slurm['state']})"
        table = Table("rank", "host", "device", "pid", "state", "exit", title=title, title_justify="left")
        for r in view.ranks:
            how = "-" if r["exit_code"] is None and not r.get("signal") else (
                runstate.describe(r["exit_code"], r.get("signal")))
            table.add_row(str(r["rank"]), r["host"], str(r["device"]), str(r["pid"] or "-"), r["state"], how)
        console.print(table)
        for line in runstate.history(view):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
        if view.message:
            console.print(view.message, soft_wrap=True)
        if view.nothing_left:
            console.print("nothing of the run is left running on any of its hosts", soft_wrap=True)
        for host, err in view.unreachable.items():
            console.print(f"{host}: unreachable: {err}", style="yellow", soft_wrap=True)
    _end(runstate.EXIT.get(view.state, 1))


@cli.command("top")
@click.argument("file", required=False, default=None, type=click.Path(dir_okay=False),
                metavar="[FILE, default: the latest run recorded here, else ./cluster.yaml]")
@inventory_option
@_run_option
@click.option("--interval", default=2.0, type=click.FloatRange(0.5, 3600), metavar="SECONDS",
              help="on a terminal: seconds between refreshes (default 2)")
@json_option(help="print the figures once as one JSON object")
def top_command(file: str | None, run_id: str | None, interval: float, as_json: bool) -> None:
    """A run's progress: per rank (or per group of alike hosts, the worst first): state, step,
    loss, steps/s, seconds since its last output, host load; stragglers marked. On a terminal it
    refreshes until the run ends (Ctrl-C to leave); in a pipe, or with --json, it prints once."""
    import json as _json

    from . import api, top

    def view():
        if file is not None or (run_id is None and not _has_runs()):
            return api.status(cluster=load(file or "cluster.yaml", None))
        return api.progress(run_id)

    live = sys.stdout.isatty() and not as_json
    while True:
        v = view()
        if as_json:
            click.echo(_json.dumps(top.as_json(v, time.time())))
            return
        text = "\n".join(top.lines(v, time.time()))
        click.echo(("\x1b[H\x1b[2J" if live else "") + text)
        if not live or v.final:
            return
        time.sleep(interval)


@cli.command("report")
@_run_option
@click.option("--out", "out", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="where to write the page (default: .orch/runs/<id>/report.html)")
def report_command(run_id: str | None, out: str | None) -> None:
    """One self-contained HTML page of a recorded run, that opens offline: its timeline, loss
    and every metric per rank over steps, steps and steps/s per rank (stragglers marked), host
    load, the first failure with its log tail. Reads the logs gathered here (`orch logs` fetches
    what is missing) and keeps their figures in logs/metrics.jsonl."""
    from . import api

    page, kept = api.report(run_id, out)
    click.echo(f"{page}\n(metrics: {kept})")


@cli.command("collect")
@_run_option
@click.argument("paths", nargs=-1, metavar="[PATH...]")
def collect_command(run_id: str | None, paths: tuple[str, ...]) -> None:
    """Bring a run's outputs here from every host that has them: PATHs (workdir-relative, globs;
    default: job.collect) into .orch/runs/<id>/collect/<host>/. Only what changed moves; every
    file is checked against its SHA-256 before it is put in place."""
    from . import api, collect

    got, where = api.collect(run_id, paths)
    for line in collect.lines(got):
        click.echo(line)
    click.echo(f"into {where}")


def _record_name(run_id: str | None) -> str | None:
    from .runs import load_run

    return load_run(run_id).data.get("name") if run_id else None


def _console():
    """rich output on stdout: as wide as the terminal on one, and never cut or wrapped when
    stdout is a pipe or a file (scripts read every host name and value whole). Strings are never
    read as markup: what a host printed (mpirun's `[warn] ...`) reaches the terminal as it was
    written; styles are given as rich.text.Text."""
    from rich.console import Console

    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 100_000)


def _has_runs() -> bool:
    from pathlib import Path

    from .runs import RUNS_DIR

    root = Path.cwd() / RUNS_DIR
    return root.is_dir() and any((p / "run.json").is_file() for p in root.iterdir())


@cli.command("down")
@_run_option
@json_option(help="print what was stopped as one JSON object")
def down_command(run_id: str | None, as_json: bool) -> None:
    """Stop every process of a run on every host (its supervisor stops the ranks: TERM, then
    KILL after a grace period; then anything left is swept), and gather its logs. Only that
    run's processes are touched. Safe to repeat.

    Exit code: 0 stopped everywhere; 1 some host could not be reached (run it again once it is);
    2 no such run."""
    import json as _json

    from . import api
    from .hostsets import fold
    from .runs import load_run

    run = load_run(run_id)
    ended = run.data.get("state") if run.finished else None   # how it had ended before this `orch down`
    following = " (the `orch up` following it records the outcome too, and exits 130)" \
        if run.controller_alive() else ""
    stopped, unreachable, view = api.down(run.id)
    if as_json:
        click.echo(_json.dumps({"run": run.id, "state": view.state, "stopped": stopped, "unreachable": unreachable,
                                "logs": str(run.logs_dir)}))
    for line, bad in down_lines(stopped, unreachable, view, ended is None and view.state == "stopped"):
        if bad:
            click.secho(f"orch: {line}", fg="yellow", err=True)
        elif not as_json:
            click.echo(f"orch: {line}", err=True)
    if unreachable:
        click.secho(f"orch: run {run.id} stopped except on {fold(unreachable)}, which could not be "
                    f"reached: its ranks' state is unknown; run `orch down --run {run.id}` again once it is "
                    f"reachable; logs in {run.logs_dir}{following}", fg="yellow", err=True)
        _end(1)
    if ended is not None:
        said = f"run {run.id} had already ended: {ended} (its record is kept)"
    elif view.state == "stopped":
        said = f"run {run.id} stopped"
    else:   # the cluster had ended it before the stop came: its own verdict, recorded
        said = f"run {run.id} had already ended: {view.state}" + (f" ({view.message})" if view.message else "")
    click.echo(f"orch: {said}; logs in {run.logs_dir}{following}", err=True)
    _end(0)


def down_lines(stopped: dict[str, str], unreachable: dict[str, str], view, stopped_now: bool) -> list[tuple[str, bool]]:
    """What `orch down` did, one line per outcome with its hosts folded (`stopped 8 ranks on
    node[01-64]; nothing left on node[65-128]`), never a line per host: (line, is a problem).
    `stopped`: each swept host's word (supervisor.sweep_script: "none" nothing of the run was
    running any more; "stopped" processes left over ended on TERM; "killed PIDS" ... on KILL);
    `view`: the run after the stop (its ranks' states); `stopped_now`: this stop ended the run
    (its ranks shown stopped were stopped by it, not before)."""
    from .hostsets import by_value

    per_host: dict[str, int] = {}
    if stopped_now:
        for r in view.ranks:
            if r.get("state") == "stopped":
                per_host[r["host"]] = per_host.get(r["host"], 0) + 1

    def outcome(host: str, word: str) -> str:
        n = per_host.get(host, 0)
        what = f"stopped {n} rank{'s' if n != 1 else ''}" if n else ""
        if word.startswith("killed"):
            k = len(word.split()) - 1
            extra = f"killed {k} process{'es' if k != 1 else ''} still running after the grace period"
        elif word == "stopped":
            extra = "stopped processes left over"
        else:
            extra = ""
        return "; ".join(x for x in (what, extra) if x) or "nothing of the run left running"

    good = [(h, outcome(h, w)) for h, w in stopped.items() if h != "slurm"]
    parts = [f"{what} on {hosts}" for what, hosts in by_value(good, most_first=True)]
    lines = [("; ".join(parts), False)] if parts else []
    if "slurm" in stopped:
        lines.append((f"Slurm: {stopped['slurm']}", False))
    why = [(h, e.split(": ", 1)[1] if e.startswith(f"{h}: ") else e) for h, e in unreachable.items()]
    lines += [(f"could not stop on {hosts}: {err.splitlines()[0]}", True) for err, hosts in by_value(why)]
    return lines


@cli.command("logs")
@_run_option
@click.option("--rank", type=int, default=None, help="exactly this rank's bytes (pipe-able)")
@click.option("--hosts", "host", default=None, metavar="PATTERN",
              help="only the ranks of these hosts: names, addresses or ranges (node[01-04]), comma-separated")
@click.option("--host", "host_alias", default=None, hidden=True)  # the old name, still accepted
@click.option("--attempt", type=int, default=None, help="this attempt's output (job.restarts); default: the last")
@click.option("-f", "--follow", is_flag=True, help="follow live until the ranks end; exit 1 if one failed")
@click.option("--tail", type=int, default=None, metavar="N", help="only the last N lines")
def logs_command(run_id: str | None, rank: int | None, host: str | None, host_alias: str | None,
                 attempt: int | None, follow: bool,
                 tail: int | None) -> None:
    """A rank's output (or every rank's, each line prefixed with its rank)."""
    from . import api

    stream = api.logs(run_id, rank, host=host or host_alias, follow=follow, tail=tail, attempt=attempt)
    out = sys.stdout.buffer
    for data in stream:  # one rank: its exact bytes; several: every line prefixed with its rank
        out.write(data)
        out.flush()
    if not stream.ok:
        click.get_current_context().exit(1)


@cli.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
def completion_command(shell: str) -> None:
    """Print the shell completion script for SHELL: e.g. `eval "$(orch completion bash)"` in
    ~/.bashrc (`orch completion zsh` in ~/.zshrc; `orch completion fish | source` for fish)."""
    from click.shell_completion import get_completion_class

    completion = get_completion_class(shell)
    assert completion is not None  # click.Choice lets through only the shells click completes
    click.echo(completion(cli, {}, "orch", "_ORCH_COMPLETE").source())


_AS_PROGRAM = False  # main() sets it: this process is the `orch` program, not a test's or a library user's


def main() -> None:
    global _AS_PROGRAM
    _AS_PROGRAM = True
    cli(prog_name="orch")


if __name__ == "__main__":
    main()
