"""Run records under `.orch/runs/<run-id>/` in the directory `orch up` ran from.

`run.json` holds what `status`, `down` and `logs` need without the cluster file:
the hosts (how to reach them), the plan, each host's processes and commands,
start/end times, each rank's exit code. Every write is atomic (temp file +
rename), so a reader never sees half a record, and two runs started from one
directory at once never share a file.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

from .errors import LocalWriteError, UsageError
from .sh import MASK, mask_values, secrets_in, shown_tree
from .model import Cluster, Host, Job
from .rankplan import Rank, RankPlan
from . import __version__

RUNS_DIR = Path(".orch") / "runs"
CONTROLLER_LOCK = "controller.lock"


def new_run_id(now: float | None = None) -> str:
    t = time.gmtime(now if now is not None else time.time())  # UTC: ids sort by start time anywhere
    return time.strftime("%Y%m%d-%H%M%S", t) + "-" + secrets.token_hex(3)


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Write `path` whole or not at all (a temporary file renamed over it); `durable`: on the disk
    before the rename (fsync), not only in the page cache, which a crash of this process keeps
    as well but a crash of the machine may not."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise LocalWriteError(f"cannot write {path}: {exc.strerror or exc}",
                              hint="free some space (or make the directory writable) here, then run the "
                                   "command again; the hosts keep the run's logs") from None
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def secret_values(cluster: Cluster) -> list[str]:
    """The value of every secret variable of the job and of every host (Slurm's included)."""
    return secrets_in(cluster.to_dict())


YAML_BREAKS = ("\r", "\n", "\x85", "\u2028", "\u2029")  # every character YAML reads as a line break


def mask_yaml(text: str, job: Job) -> str:
    """A cluster file's text with the value of every secret variable under any `env:` mapping
    (job.env, inventory defaults and hosts) replaced by MASK, whatever its YAML spelling
    (quoted, escaped, a number, a block scalar, anchored or reached through an alias).

    A value's span is its node's: from its anchor or tag to its end, which for a block scalar
    takes in the line break(s) after it (any of YAML_BREAKS); a line break is put back so the
    next key stays on a line of its own, and the anchor is kept so aliases to it stay defined
    (a tag is dropped: it might not fit MASK)."""
    import yaml

    anchors: dict[int, str] = {}  # id(node) -> the anchor it was given

    class Loader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            event = self.peek_event()
            node = super().compose_node(parent, index)
            if not isinstance(event, yaml.AliasEvent) and getattr(event, "anchor", None):
                anchors[id(node)] = event.anchor
            return node

    try:
        root = yaml.compose(text, Loader=Loader)
    except yaml.YAMLError:
        return text
    spans: dict[tuple[int, int], str] = {}

    def walk(node, key) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else None
                if key == "env" and isinstance(name, str) and job.is_secret(name):
                    anchor = anchors.get(id(v))
                    spans[(v.start_mark.index, v.end_mark.index)] = (f"&{anchor} " if anchor else "") + f"'{MASK}'"
                else:
                    walk(v, name)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, None)

    walk(root, None)
    for (start, end), masked in sorted(spans.items(), reverse=True):
        text = text[:start] + masked + ("\n" if text[start:end].endswith(YAML_BREAKS) else "") + text[end:]
    return text


class Run:
    """One run's record. `data` is the JSON document; `save()` writes it atomically."""

    def __init__(self, root: Path, run_id: str, data: dict[str, Any]):
        self.root = root
        self.id = run_id
        self.data = data

    @property
    def dir(self) -> Path:
        return self.root / self.id

    @property
    def logs_dir(self) -> Path:
        return self.dir / "logs"

    def local_log(self, rank: int, attempt: int = 1) -> Path:
        """Attempt 1 (the only one without job.restarts) at logs/rank.N/stdout, attempt K > 1 at
        logs/attempt-K/rank.N/stdout."""
        base = self.logs_dir if attempt <= 1 else self.logs_dir / f"attempt-{attempt}"
        return base / f"rank.{rank}" / "stdout"

    def local_size(self, rank: int, attempt: int = 1) -> int:
        """How many bytes of the rank's log are here (0: none yet)."""
        p = self.local_log(rank, attempt)
        return p.stat().st_size if p.exists() else 0

    @property
    def attempt(self) -> int:
        """The run's latest attempt (1 unless it was restarted)."""
        return int(self.data.get("attempt") or 1)

    @property
    def secret(self) -> bool:
        return bool(self.data.get("has_secrets"))

    def save(self, durable: bool = True) -> None:
        """Write run.json (`durable=False`: see write_atomic; for a save on the way to another)."""
        # Any Secret put in the record (a Slurm allocation's login host, say) is masked here; the
        # file is not world-readable when it holds (masked) secret-bearing commands or env.
        write_atomic(self.dir / "run.json", json.dumps(shown_tree(self.data), indent=2, sort_keys=False) + "\n",
                     0o600 if self.secret else 0o644, durable)

    def write_file(self, name: str, text: str) -> Path:
        path = self.dir / name
        write_atomic(path, text, 0o600 if self.secret else 0o644)
        return path

    # ---- who is following the run
    # The `orch up` that started a run holds an exclusive lock on CONTROLLER_LOCK until it exits
    # (the kernel drops it even on SIGKILL). Another command (`orch down`) can so tell whether
    # that controller is still following the run (and will record its outcome too).
    def hold_controller(self) -> None:
        """Mark this process as the run's controller, for as long as it lives."""
        fd = os.open(self.dir / CONTROLLER_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._controller_fd = fd

    def controller_alive(self) -> bool:
        """Is the `orch up` that started this run still following it (in any process)?"""
        if getattr(self, "_controller_fd", None) is not None:
            return True
        try:
            fd = os.open(self.dir / CONTROLLER_LOCK, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def reload(self) -> None:
        """Read run.json again (another command may have written it since)."""
        try:
            self.data = json.loads((self.dir / "run.json").read_text())
        except (OSError, ValueError):
            pass

    # ---- rebuilding what status/down/logs need
    def hosts(self) -> tuple[Host, ...]:
        return tuple(Host.from_dict(h) for h in self.data["hosts"])

    def plan(self) -> RankPlan:
        """The run's rank plan, as recorded when it started."""
        hosts = {h.name: h for h in self.hosts()}
        doc = self.data["plan"]
        return RankPlan(ranks=tuple(Rank(**r) for r in doc["ranks"]),
                        hosts=tuple(hosts[h["name"]] for h in doc["hosts"]),
                        launcher=doc["launcher"], platform=doc["platform"],
                        spares=tuple(hosts[h["name"]] for h in doc.get("spares", ()) if h["name"] in hosts))

    def log_tail(self, rank: int, attempt: int, lines: int = 20) -> str:
        """The last `lines` lines of a rank's gathered log here ("" when there is none)."""
        local = self.local_log(rank, attempt)
        if not local.exists():
            return ""
        with open(local, "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 65536))
            data = fh.read()
        return b"\n".join(data.splitlines()[-lines:]).decode("utf-8", "replace")

    def cluster(self) -> Cluster:
        """The cluster the run was started with, as it was (secret values masked)."""
        d = self.data
        slurm = d.get("inventory_slurm")
        if slurm is None and d.get("slurm") and d["hosts"]:  # a record from before inventory_slurm was kept
            sl = d["slurm"]
            slurm = {"nodes": len(d["hosts"]), "template": d["hosts"][0], "login": sl.get("login"),
                     "conf": sl.get("conf"), "login_host": sl.get("login_host")}
        return Cluster.from_dict({"name": d["name"], "path": d["cluster_file"], "hosts": d["hosts"], "job": d["job"],
                                  "ssh": d["ssh"], "checks": d.get("checks") or {}, "groups": d.get("groups") or {},
                                  "slurm": slurm})

    @property
    def finished(self) -> bool:
        return self.data.get("ended") is not None


RUN_VERSION = 1   # of run.json's layout (records before it have no "v" and read the same way)


def create_run(cluster: Cluster, plan_doc: dict, *, cwd: Path | None = None, run_id: str = "") -> Run:
    """The run's record, under `run_id` when given (and free: else a new id, as without one)."""
    root = (cwd or Path.cwd()) / RUNS_DIR
    try:  # a full disk, a read-only directory, a file in the way: said, never a crash
        root.mkdir(parents=True, exist_ok=True)
        while True:  # the id is the directory; mkdir is the lock that keeps two runs apart
            run_id = run_id or new_run_id()
            try:
                (root / run_id).mkdir()
                break
            except FileExistsError:
                run_id = ""
    except OSError as exc:
        raise LocalWriteError(f"cannot create the run's record in {root}: {exc.strerror or exc}",
                              hint="free some space (or make the directory writable) here, then run "
                                   "`orch up` again; nothing was started") from None
    job = cluster.job
    secrets = secret_values(cluster)
    model = shown_tree(cluster.to_dict())  # model.Cluster made every secret value a Secret
    try:  # the user's YAML: its secret values masked by key, then any other mention by search
        cluster_text = mask_values(mask_yaml(cluster.path.read_text(), job), secrets)
    except (OSError, UnicodeDecodeError):
        cluster_text = None

    data = {
        "v": RUN_VERSION, "orch": __version__,
        "id": run_id, "name": cluster.name, "cluster_file": str(cluster.path),
        "cluster_text": cluster_text,
        "has_secrets": bool(secrets), "state": "starting", "started": time.time(), "ended": None,
        # the cluster as started (model.Cluster.to_dict, secret values masked): Run.cluster() reads it back
        "job": model["job"], "ssh": model["ssh"], "hosts": model["hosts"], "checks": model["checks"],
        "groups": model["groups"], "inventory_slurm": model["slurm"], "plan": plan_doc,
        "commands": {}, "procs": [], "exit_codes": {}, "first_failure": None, "message": None,
    }
    run = Run(root, run_id, data)
    run.save()
    return run


def load_run(run_id: str | None = None, *, cwd: Path | None = None) -> Run:
    """A run by id (a unique prefix works), or the latest started from this directory."""
    root = (cwd or Path.cwd()) / RUNS_DIR
    ids = _ids(root)
    if not ids:
        raise UsageError(f"no runs recorded in {root}", hint="start one with `orch up`, from this directory")
    if run_id is None:
        chosen = by_start(root, ids)[-1]
    else:
        matches = _matches(ids, run_id)
        if len(matches) != 1:
            raise UsageError(f"no run {run_id!r} in {root}" if not matches else
                             f"run id {run_id!r} is ambiguous: {', '.join(matches)}",
                             hint="known runs: " + ", ".join(ids[-5:]))
        chosen = matches[0]
    try:
        data = json.loads((root / chosen / "run.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read run record {root / chosen / 'run.json'}: {exc}") from None
    v = data.get("v") if isinstance(data, dict) else None
    if isinstance(v, int) and v > RUN_VERSION:

        by = data.get("orch") or "a newer orch"
        raise UsageError(f"run {chosen} was recorded by orch {by} (record format {v}); this orch {__version__} "
                         f"reads formats up to {RUN_VERSION}", hint=f"run `orch status`, `logs` and `down` of it with "
                                                                   f"orch {by} or newer")
    return Run(root, chosen, data)


def recorded(run_id: str, *, cwd: Path | None = None) -> bool:
    """A run with this id (or unique prefix) is recorded under `cwd`: load_run(run_id) finds it."""
    return len(_matches(_ids((cwd or Path.cwd()) / RUNS_DIR), run_id)) == 1


def _ids(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if (p / "run.json").is_file()) if root.is_dir() else []


def _matches(ids: list[str], run_id: str) -> list[str]:
    """The run `run_id` names: itself, else every id it is a prefix of."""
    return [i for i in ids if i == run_id] or [i for i in ids if i.startswith(run_id)]


def by_start(root: Path, ids: list[str] | None = None) -> list[str]:
    """The runs recorded in `root` (a RUNS_DIR), oldest first: by when each started, then by id.
    Not by id alone: two runs started within one second (an id's resolution) sort by their random
    part."""
    return sorted(_ids(root) if ids is None else ids, key=lambda i: (_started(root / i), i))


def _started(path: Path) -> float:
    try:
        return float(json.loads((path / "run.json").read_text()).get("started") or 0)
    except (OSError, ValueError):
        return 0.0
