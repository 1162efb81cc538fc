"""The mountpoints lab hosts bind over on this machine's real fs (/data, /opt/orch-lab,
/run/sshd, /etc/hccn.conf, /home with --user, and /run/netns as a shared bind mount): made
only when missing, recorded in the lab root's shared registry, and removed by the last
`down`. Every lab shares them, hence the lock on the lab root."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from pathlib import Path
from typing import Sequence

from ..errors import LabError
from .model import DEFAULT_ROOT, NETNS_DIR
from .system import listdir, run, write

REGISTRY = "mountpoints.json"

# Real-fs paths a host's mount namespace binds over; created (and later removed) only
# when missing. /root/.ssh is NOT here: it is made inside the host's /root overlay.
MOUNTPOINT_DIRS = ("/data", "/opt/orch-lab", "/run/sshd")
MOUNTPOINT_FILES = ("/etc/hccn.conf",)


@contextlib.contextmanager
def locked(root: Path, timeout: float = 60.0):
    """Exclusive lock on the lab root (subnets and the shared mountpoint registry)."""
    deadline = time.monotonic() + timeout
    while True:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise LabError(
                        f"another orch lab command holds the lock on {root} for over {timeout:g}s",
                        hint="wait for it to finish",
                    ) from None
                time.sleep(0.05)
        try:
            same = os.stat(root).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the root was removed while we waited: start over
    try:
        yield
    finally:
        os.close(fd)


def check_root(root: Path, home: bool = False) -> None:
    """The lab root may not lie under a path lab hosts mount over (/home too with --user)."""
    for bad in ("/tmp", "/root", "/data", "/opt/orch-lab", "/run", "/etc", "/proc", "/sys", "/dev") \
            + (("/home",) if home else ()):
        if root == Path(bad) or Path(bad) in root.parents:
            raise LabError(
                f"ORCH_LAB_ROOT={root} is under {bad}, which lab hosts mount over",
                hint=f"use a directory elsewhere, e.g. the default {DEFAULT_ROOT}",
            )


def claim(root: Path, extra_dirs: Sequence[str] = ()) -> list[str]:
    """Create missing mountpoints on the real fs; record them in the shared registry (call it
    under `locked(root)`). Returns what this call created."""
    reg_path = root / REGISTRY
    try:
        reg = json.loads(reg_path.read_text())
    except (OSError, ValueError):
        reg = {"created_dirs": [], "created_files": [], "mounts": []}
    created = []
    for d in MOUNTPOINT_DIRS + tuple(extra_dirs):
        if not os.path.lexists(d):
            os.makedirs(d, mode=0o755)
            reg["created_dirs"].append(d)
            created.append(d)
    for f in MOUNTPOINT_FILES:
        if not os.path.lexists(f):
            Path(f).touch(mode=0o644)
            reg["created_files"].append(f)
            created.append(f)
    if not is_mountpoint(NETNS_DIR):
        # What `ip netns add` does the first time; done here so `down` can undo it.
        if not os.path.lexists(NETNS_DIR):
            os.makedirs(NETNS_DIR, mode=0o755)
            reg["created_dirs"].insert(0, NETNS_DIR)
            created.append(NETNS_DIR)
        run(["mount", "--bind", NETNS_DIR, NETNS_DIR], what="mount --bind /run/netns")
        run(["mount", "--make-shared", NETNS_DIR], what="mount --make-shared /run/netns")
        reg["mounts"].append(NETNS_DIR)
        created.append(f"mount:{NETNS_DIR}")
    write(reg_path, json.dumps(reg, indent=1) + "\n")
    return created


def release(root: Path) -> None:
    """Once no lab is left under `root` (call it under `locked(root)`): undo every mount, file
    and dir the registry records, then remove the registry and the root."""
    others = [p for p in root.iterdir() if p.is_dir()]
    if others:
        return
    reg_path = root / REGISTRY
    try:
        reg = json.loads(reg_path.read_text())
    except (OSError, ValueError):
        reg = {}
    for path in reg.get("mounts", []):
        while is_mountpoint(path) and not listdir(path):
            if run(["umount", path], check=False, timeout=20).returncode != 0:
                break
    for path in reg.get("created_files", []):
        with contextlib.suppress(OSError):
            if os.path.isfile(path) and os.path.getsize(path) == 0 and not is_mountpoint(path):
                os.unlink(path)
    for path in reversed(reg.get("created_dirs", [])):
        with contextlib.suppress(OSError):
            if not is_mountpoint(path):
                os.rmdir(path)  # only if empty
    with contextlib.suppress(FileNotFoundError):
        reg_path.unlink()
    with contextlib.suppress(OSError):
        root.rmdir()


def is_mountpoint(path: str) -> bool:
    """True if something is mounted at path (os.path.ismount misses same-fs bind mounts)."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                mp = line.split(" ", 5)[4]
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mp)
                if mp == target:
                    return True
    except OSError:
        return os.path.ismount(path)
    return False
