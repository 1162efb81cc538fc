"""files: the files `orch up` will sync (job.sync) exist here, and whether the hosts' copies are
current: `orch check` by sha256 (or the size of very big files); `orch up`'s probe by the host's
sync listing (size and modification time, as sync compares them: nothing hashed on either side)."""

from __future__ import annotations

import shlex
from typing import Mapping, Sequence

from .. import probes
from ..probes import Section, SyncFile
from ..model import Host
from .base import Check, CheckResult, Probe, register, result, section
from .workdir import WORKDIR


def _shell(plan, host: Host) -> list[tuple[str, str]]:
    if not plan.manifest or plan.listing:  # `orch up`: the sync listing (section synclist) tells
        return []
    listed = plan.manifest[:probes.MAX_COMPARED_FILES]
    small = [f for f in listed if f.sha256 is not None]
    big = [f for f in listed if f.sha256 is None]
    lines = [f"cd {shlex.quote(plan.cluster.job.workdir)} 2>/dev/null || {{ echo orch:no-workdir; exit 0; }}"]
    if small:
        names = " ".join(shlex.quote(f.rel) for f in small)
        lines.append("if command -v sha256sum >/dev/null 2>&1; then "
                     f"for f in {names}; do [ -f \"$f\" ] && printf '%s\\0' \"$f\"; done | "
                     "xargs -0 -r sha256sum --; "
                     "else echo orch:no-sha256sum; fi")
    for f in big:
        q = shlex.quote(f.rel)
        lines.append(f"[ -f {q} ] && printf 'size %s %s\\n' \"$(wc -c < {q})\" {q}")
    lines.append("true")
    return [("files", "\n".join(lines))]


FILES = Probe("files", _shell)


def judge_files(host: Host, sec: Section, manifest: Sequence[SyncFile]) -> CheckResult:
    body = sec.body
    if "orch:no-workdir" in body:
        return result("files", host, "pass", f"not synced yet: orch up copies {len(manifest)} file(s)")
    if "orch:no-sha256sum" in body:
        return result("files", host, "warn", "sha256sum is not on the host: cannot compare the synced files")
    remote = probes.parse_sha256sum(body)
    compared = manifest[:probes.MAX_COMPARED_FILES]
    stale, current = [], 0
    for f in compared:
        got = remote.get(f.rel)
        if got is None:
            continue
        want = f.sha256 if f.sha256 is not None else f"size:{f.size}"
        if got == want:
            current += 1
        else:
            stale.append(f.rel)
    return _verdict(host, manifest, len(compared), current, stale)


def judge_listed(host: Host, listed: Mapping[str, list | None] | None, plan) -> CheckResult:
    """`orch up`'s probe: the files against the host's sync listing (ProbeRun.listed), by size
    and mtime, as sync decides what to send. A listing that did not come back whole (None): a
    warning (sync lists the host again itself), never a failure."""
    if listed is None:
        return result("files", host, "warn", "could not compare the synced files: the host's listing of "
                                             f"{plan.cluster.job.workdir} did not come back whole (orch up lists "
                                             "it again as it syncs)")
    stale, current = [], 0
    for f in plan.manifest:
        have = listed.get(f.rel)
        if have is None:
            continue
        if have[0] == "file" and have[1] == f.size and have[2] == f.mtime_ns:
            current += 1
        else:
            stale.append(f.rel)
    return _verdict(host, plan.manifest, len(plan.manifest), current, stale, " (size or modification time)")


def _verdict(host: Host, manifest: Sequence[SyncFile], compared: int, current: int, stale: list[str],
             how: str = "") -> CheckResult:
    extra = f"; {len(manifest) - compared} more not compared" if len(manifest) > compared else ""
    if stale:
        shown = ", ".join(stale[:10]) + (f" and {len(stale) - 10} more" if len(stale) > 10 else "")
        return result("files", host, "warn", f"stale code on the host: {shown} differ from this machine's{how} "
                                             f"(orch up will re-sync them){extra}")
    absent = compared - current
    if current == 0:
        return result("files", host, "pass", f"not synced yet: orch up copies {len(manifest)} file(s)")
    if absent:
        return result("files", host, "pass", f"{current} file(s) up to date, {absent} not there yet (orch up "
                                             f"copies them){extra}")
    return result("files", host, "pass", f"{current} file(s) up to date{extra}")


def _local(plan) -> list[CheckResult]:
    out = [CheckResult("files", None, "warn", plan.set_aside_note)] if plan.set_aside_note else []
    if not plan.missing_sync:
        return out
    return out + [CheckResult("files", None, "fail", f"job.sync (relative to {plan.cluster.base_dir}): "
                              + "; ".join(plan.missing_sync))]


register(Check("files", applies=lambda plan, host: bool(plan.manifest), probes=(WORKDIR, FILES),
               judge=lambda plan, run: [judge_listed(run.host, run.listed, plan)
                                        if plan.listing else
                                        judge_files(run.host, section(run.sections, "files"), plan.manifest)],
               local=_local))
