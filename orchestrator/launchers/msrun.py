"""msrun (pure): one msrun per host (MindSpore's dynamic cluster), node_rank = the host's index in
plan order, master = the launch host; each worker runs under `agent.py rank`."""

from __future__ import annotations

import posixpath
from typing import Iterable, Sequence

from ..errors import PlanError
from ..hostlayout import log_dir_path
from ..interpreters import is_python
from ..model import Cluster
from ..rankplan import RankPlan
from .base import ATTEMPT_DIR, Context, PerHost

MSRUN_CLUSTER_TIME_OUT = 600


def msrun_script(command: Sequence[str]) -> list[str]:
    """job.command without its interpreter: msrun runs `python script args` itself.
    `net.py a`, `python net.py a`, `/usr/bin/python3 net.py a` -> ['net.py', 'a'];
    interpreter options stay (`python3 -u net.py` -> ['-u', 'net.py']): orch's worker wrapper
    (msrun_task) hands them to the interpreter."""
    cmd = list(command)
    if cmd and is_python(cmd[0]):
        cmd = cmd[1:]
        if not any(not a.startswith("-") for a in cmd):
            raise PlanError("msrun launcher: job.command names python but no script",
                            hint="command: python net.py [args]")
    return cmd


def msrun_argv(cluster: Cluster, plan: RankPlan, host_name: str, *, log_dir: str | None = None,
               master_addr: str | None = None, task: Sequence[str] | None = None) -> list[str]:
    """One host's msrun command (run in workdir). node_rank = the host's index in plan order;
    master = the plan's launch host, at `master_addr` (launchers.head_reach; default its cluster
    address); `task`: what msrun runs for each worker (default the job's script and arguments,
    msrun_script; orch's launch gives msrun_task)."""
    job = cluster.job
    host = plan.host(host_name)
    return ["msrun",
            f"--worker_num={plan.size}",
            f"--local_worker_num={host.slots}",
            f"--master_addr={master_addr or plan.launch_host.cluster_address}",
            f"--master_port={job.master_port}",
            f"--node_rank={plan.node_rank(host_name)}",
            f"--log_dir={log_dir or log_dir_path(cluster)}",
            "--join=True",
            f"--cluster_time_out={MSRUN_CLUSTER_TIME_OUT}",
            # no worker has this id: msrun copies no worker's output into its own log (by default
            # it tails every worker_N.log into it, a second copy of every rank's output)
            f"--tail_worker_log={plan.size}",
            *(msrun_script(job.command) if task is None else task)]


# msrun starts every worker (and its scheduler) as `python script args`, and nothing but python.
# So each worker starts as `python -c <this> <interpreter> script args`: that python at once
# becomes `agent.py rank -- <interpreter> script args`, which records the rank's own exit status
# on its host. The scheduler (MS_ROLE=MS_SCHED) runs as is.
_MSRUN_EXEC = ("import os,sys; a=sys.argv[1:]; e=os.environ; "
               "w=e.get('MS_ROLE')!='MS_SCHED' and e.get('RANK_ID'); "
               "os.execvp(sys.executable if w else a[0], "
               "[sys.executable, e['ORCH_RUN_DIR']+'/agent.py', 'rank', '--']+a if w else a)")


def msrun_task(command: Iterable[str]) -> list[str]:
    """What msrun runs for every worker, in place of `script args`."""
    command = list(command)
    script = msrun_script(command)
    interp = command[0] if len(command) > len(script) else "python"  # msrun's own default
    # msrun runs `python`/`python3` given as the script as is (anything else: `python X`)
    starter = "python3" if posixpath.basename(interp).startswith("python3") else "python"
    return [starter, "-c", _MSRUN_EXEC, interp, *script]


class Msrun(PerHost):
    name = "msrun"
    program = "msrun"
    tools = ("mindspore",)

    def argv(self, ctx: Context, host: str) -> list[str]:
        return msrun_argv(ctx.cluster, ctx.plan, host, log_dir=ATTEMPT_DIR, master_addr=ctx.master,
                          task=msrun_task(ctx.cluster.job.command))
