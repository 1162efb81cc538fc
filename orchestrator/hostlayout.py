"""Where orch keeps things on the hosts, and how it runs its own Python there (pure).

- `orch_dir(workdir)`: `<workdir>/.orch`, one directory per run, the workdir's lock and Slurm's
  go files;
- `run_dir(cluster, run_id)`: a run's supervisor, state and (per attempt, `a<K>`) logs;
- `log_dir_path(cluster)`: the job's own log directory (`job.log_dir`) in workdir;
- `PY`: the interpreter line of every stdlib script orch runs on a host.

The names inside a run directory are the supervisor's (`agent.layout`): one copy, there.
"""

from __future__ import annotations

import posixpath

from .agent.layout import ORCH_DIR
from .model import Cluster

# orch's own python on the hosts (the supervisor, each rank's `agent.py rank` wrapper, the sync
# receiver, gather, prepare's probe) needs nothing but the standard library: without `site` (-S),
# each start skips the site-packages' .pth files (a third of it, often more)
PY = ("python3", "-S")


def orch_dir(workdir: str) -> str:
    """orch's directory in a workdir on the hosts: one directory per run, the workdir's lock
    (LOCK, as agent.py names it) and Slurm's go files."""
    return posixpath.join(workdir, ORCH_DIR)


def run_dir(cluster: Cluster, run_id: str) -> str:
    """Where a run keeps its supervisor, state and (per attempt) logs on each host."""
    return posixpath.join(orch_dir(cluster.job.workdir), run_id)


def log_dir_path(cluster: Cluster) -> str:
    """The job's log directory on the hosts (job.log_dir, relative to workdir)."""
    return posixpath.join(cluster.job.workdir, cluster.job.log_dir)
