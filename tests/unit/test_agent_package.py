"""The hosts' supervisor (orchestrator/agent) runs on any host's python3 >= 3.8 with the
standard library alone, and imports its own modules relatively (it is `orch_agent` there)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from orchestrator import supervisor

SOURCES = supervisor.agent_sources()


# standard library modules of pythons newer than the one running the tests (each tried under an
# `except ImportError` that falls back on an older one's)
NEWER_STDLIB = {"_sha2"}   # 3.12+: protocol.py's sha256 (_sha256 before)
STDLIB = sys.stdlib_module_names | NEWER_STDLIB


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_python_3_8_syntax_standard_library_only_relative_imports(name):
    tree = ast.parse(SOURCES[name], filename=name, feature_version=(3, 8))
    in_annotations = {id(n) for a in _annotations(tree) for n in ast.walk(a)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                assert alias.name.split(".")[0] in STDLIB, (name, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                assert node.module.split(".")[0] in STDLIB, (name, node.module)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and id(node) not in in_annotations:
            # builtin generics (list[int]) at run time are 3.9+
            assert node.value.id not in ("list", "dict", "tuple", "set", "frozenset", "type"), (name, node.lineno)
    # annotations (for mypy: states, protocol and head are checked strictly) only where python never
    # evaluates them: `int | None` and `list[str]` are 3.10/3.9 at run time (ruff's FA rules too)
    postponed = any(isinstance(n, ast.ImportFrom) and n.module == "__future__"
                    and any(a.name == "annotations" for a in n.names) for n in tree.body)
    for a in _annotations(tree):
        assert postponed, (name, a.lineno, "an annotation in the agent needs `from __future__ import annotations`")


def _annotations(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            yield from (x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                        if x is not None and x.annotation is not None)
            if node.returns is not None:
                yield node.returns
        elif isinstance(node, ast.AnnAssign):
            yield node.annotation


def test_the_package_is_every_module_of_orchestrator_agent():
    here = Path(supervisor.__file__).resolve().parent.parent / "agent"
    assert set(SOURCES) == {p.name for p in here.glob("*.py")}
    assert {"__init__.py", "cli.py", "head.py", "layout.py", "procs.py", "protocol.py", "server.py",
            "states.py"} <= set(SOURCES)


# What a supervisor's start must not import: each costs milliseconds of CPU on every host of every
# run (typing ~5 ms, subprocess ~5 ms, shutil's bz2/lzma ~3 ms, ipaddress ~1.4 ms: 25 ms -> 16 ms
# for the whole import, measured with bytecode cached; hashlib and hmac, which load OpenSSL, ~2.8 ms
# more: protocol.py's HMAC is on CPython's own sha256), and a 64-host lab's supervisors start on
# 2 shared cores. subprocess is imported where a process is started (procs.Local.start: not on
# mpirun's members); the rank wrapper imports less still (rank.py). json loads re (~3 ms with
# its own parts): the agent reads and writes JSON through CPython's C functions (jsonc.py). enum
# (~3.3 ms with functools and collections) came with signal, socket, selectors and re; re and
# base64 ~1.5 ms more, the idna codec (a str host to getaddrinfo) ~1 ms: the agent uses _signal,
# _socket, its own Poller, binascii, and compiles its patterns when output first needs them
# (test_agent_stdlib.py holds each stand-in to the module it replaces). 14.4 -> 5.7 ms.
HEAVY_AT_START = {"typing", "subprocess", "shutil", "ipaddress", "bz2", "lzma", "threading", "hashlib", "hmac",
                  "_hashlib", "json", "enum", "re", "signal", "socket", "selectors", "base64", "collections",
                  "functools", "encodings.idna"}
# ... nor the head's own modules (server.head_modules: imported when the supervisor is the head),
# ~1 ms of each member's start
HEAD_ONLY = {"orch_agent.head", "orch_agent.delta", "orch_agent.history", "orch_agent.tables", "orch_agent.words"}


def run_package(tmp_path, code: str, head: str = "import sys"):
    """`python -S -c` of `head`, the package (as the hosts get it, in tmp_path) on sys.path, `code`."""
    import subprocess

    pkg = tmp_path / "orch_agent"
    pkg.mkdir()
    for name, text in SOURCES.items():
        (pkg / name).write_text(text)
    return subprocess.run([sys.executable, "-S", "-c", f"{head}\nsys.path.insert(0, {str(tmp_path)!r})\n{code}"],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("module", ["cli", "rank"])
def test_the_supervisor_and_the_rank_wrapper_start_without_heavy_imports(module, tmp_path):
    got = run_package(tmp_path, f"import orch_agent.{module}\n"
                      f"print(' '.join(sorted(m for m in {sorted(HEAVY_AT_START | HEAD_ONLY)!r} if m in sys.modules)))")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == []


def test_output_without_a_progress_line_never_imports_re_and_a_progress_line_is_still_read(tmp_path):
    got = run_package(tmp_path, "from orch_agent import metrics, server\n"
                      "p = metrics.Progress()\np.reset([0])\nr = p.ranks[0]\n"
                      "p.feed(r, b'rank 0 device 0\\nworking {x} epoch\\n', 1.0)\n"
                      "print('re' in sys.modules, r.step)\n"
                      "p.feed(r, b'epoch: 1, step: 20, loss is 2.30\\n', 2.0)\n"
                      "print('re' in sys.modules, r.step, r.loss)\n")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split("\n")[:2] == ["False None", "True 20 2.3"]


def test_the_death_signal_is_looked_up_once_in_the_supervisor_not_in_each_child(tmp_path):
    """procs.Local starts every rank (ranktable) or launcher with die_with_parent's preexec_fn:
    prctl is found (ctypes imported) in the supervisor, once, so each forked child only calls it
    (each importing ctypes again: ~3 ms of CPU a rank). The child still gets the signal: killed
    with its parent."""
    import os

    got = run_package(tmp_path, "from orch_agent import rank\nfn = rank.die_with_parent(signal.SIGKILL)\n"
                      "print('ctypes' in sys.modules, flush=True)\n"
                      "p = subprocess.Popen(['sleep', '300'], preexec_fn=fn)\nprint(p.pid, flush=True)\n"
                      "os.kill(os.getpid(), signal.SIGKILL)\n", head="import sys, os, signal, subprocess")
    imported, pid = got.stdout.split()
    assert imported == "True"
    import time
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        os.kill(int(pid), 9)
        raise AssertionError(f"sleep {pid} outlived the process that started it")


@pytest.mark.parametrize("code, rc, err", [("3", 3, ""), ("None", 0, ""), ("'orch: no'", 1, "orch: no\n")])
def test_agent_py_leaves_without_pythons_teardown_its_output_flushed(code, rc, err, tmp_path):
    """layout.leave, how agent.py's stub and the start's boot end: main's exit status (or
    sys.exit's way with a message), what was printed flushed, and no teardown (~3 ms of CPU on
    every agent call on every host): an atexit handler, which python's own exit runs, does not run."""
    import subprocess

    pkg = tmp_path / "orch_agent"
    pkg.mkdir()
    for name, text in SOURCES.items():
        (pkg / name).write_text(text)
    prog = (f"import sys, atexit\nsys.path.insert(0, {str(tmp_path)!r})\nfrom orch_agent.layout import leave\n"
            "atexit.register(lambda: print('teardown'))\nsys.stdout.write('said')\nleave(%s)\n" % code)
    got = subprocess.run([sys.executable, "-S", "-c", prog], capture_output=True, text=True, timeout=60)
    assert (got.returncode, got.stdout, got.stderr) == (rc, "said", err)


def test_the_stub_and_the_boot_end_through_leave():
    assert supervisor.agent_stub("/w/.orch/agent-x").endswith("leave(main(sys.argv))\n")
    assert supervisor._BOOT_PY.endswith(" leave(main([a,'start',r]+sys.argv[5:]))\n")
