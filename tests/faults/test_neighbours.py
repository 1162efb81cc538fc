"""Another user on a host (a uid of its own, no account on this machine: these tests touch no
/etc) plants links where orch writes, or could change the workdir: orch never writes through
the links, and `orch check` fails a workdir others could change."""

from __future__ import annotations

import pytest

from tests.support import orch, remote_ls, write_fault_cluster

pytestmark = pytest.mark.lab


def test_check_never_truncates_a_file_through_a_planted_temp_link(fx_lab, tmp_path):
    """`.orch-check.<pid>` links to a victim file for every pid the host could hand out next:
    `orch check` probes the workdir with a random, exclusively created name instead; the
    victim keeps its content and no temp file is left."""
    lab = fx_lab("y", 2)
    wd = "/data/fx-planted"
    plant = ("import os; last = int(open('/proc/sys/kernel/ns_last_pid').read()); "
             f"[os.symlink('/data/victim', '{wd}/.orch-check.%d' % p) for p in range(last, last + 4000)]")
    # another user (uid 4242, a process of its own on the host) plants them in a workdir open to all
    lab.exec(1, ["sh", "-c", f"mkdir -p {wd} && chmod 0777 {wd} && echo precious > /data/victim && "
                             f"setpriv --reuid=4242 --regid=4242 --clear-groups python3 -c \"{plant}\""],
             check=True)  # one process: planting must not use up the pids it plants for
    try:
        write_fault_cluster(lab, tmp_path, workdir=wd, command="true", hosts=1)
        res = orch("check", "--json", cwd=tmp_path, check_rc=1)  # the open workdir itself fails the check
        assert b"is writable by group and others" in res.stdout, res.stdout[-2000:]
        assert lab.exec(1, ["cat", "/data/victim"]).stdout == "precious\n"
        assert len(remote_ls(lab, 1, f"{wd}/.orch-check.*")) == 4000  # only the planted links
    finally:
        lab.exec(1, ["rm", "-rf", wd, "/data/victim"])


@pytest.mark.parametrize("make_unsafe, needle", [
    ("chmod 0777 {wd}", "is writable by group and others (mode 777); fix: chmod go-w {wd}"),
    ("chmod 0775 {parent}", "{parent} is writable by its group (mode 775)"),
    ("chown 4242 {wd}", "{wd} is owned by uid 4242, not by the job's user (uid 0) or root"),
])
def test_check_fails_a_workdir_another_user_could_change(fx_lab, tmp_path, make_unsafe, needle):
    """A workdir (or a parent) writable by others, or owned by another user, lets them replace
    the code the ranks run: `orch check` fails it, naming the directory and the fix."""
    lab = fx_lab("y", 2)
    parent, wd = "/data/fx-perm", "/data/fx-perm/job"
    lab.exec(1, ["sh", "-c", f"rm -rf {parent} && mkdir -p {wd} && " + make_unsafe.format(wd=wd, parent=parent)],
             check=True)
    try:
        write_fault_cluster(lab, tmp_path, workdir=wd, command="true", hosts=1)
        res = orch("check", cwd=tmp_path, check_rc=1)
        out = res.stdout.decode()
        assert needle.format(wd=wd, parent=parent) in " ".join(out.split()), out
    finally:
        lab.exec(1, ["rm", "-rf", parent])
