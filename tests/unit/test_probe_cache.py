"""The reach test's program (checks/reach.py: cached): run from its code object kept in the agent
package's directory on the host where that directory is the user's own, compiled (and kept)
otherwise; always what the program itself does."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
from pathlib import Path

from orchestrator.checks.reach import CACHE_ENV, cached

PROGRAM = "import os,sys\nprint('args', sys.argv[1:], os.environ.get(%r), __name__)\n" % CACHE_ENV


def run(program: str, *args: str, cache: Path | None = None, euid: int | None = None) -> str:
    """`python3 -S -c program args`; `euid`: as a process of that user would see its files."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    if cache is not None:
        env[CACHE_ENV] = str(cache)
    if euid is not None:
        program = f"import os\nos.geteuid=lambda:{euid}\n" + program
    return subprocess.run([sys.executable, "-S", "-c", program, *args], env=env, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def kept(cache: Path) -> list[Path]:
    return sorted(cache.glob("probe-*"))


def test_it_does_what_the_program_does_and_keeps_its_code_where_the_directory_is_the_users(tmp_path):
    want = "args ['a b', 'c'] None __main__\n"
    assert run(PROGRAM, "a b", "c") == want
    assert run(cached(PROGRAM), "a b", "c") == want                       # no directory named: compiled
    home = tmp_path / "agent-x"
    assert run(cached(PROGRAM), "a b", "c", cache=home) == want           # none there yet: compiled, nothing kept
    assert not home.exists()
    home.mkdir(mode=0o700)
    assert run(cached(PROGRAM), "a b", "c", cache=home) == want           # compiled, and kept
    (code,) = kept(home)
    assert f".{sys.implementation.cache_tag}-" in code.name and code.stat().st_mode & 0o077 == 0
    assert run(cached(PROGRAM), "a b", "c", cache=home) == want           # from the kept code
    # it is the kept code that runs: another program's, put in its place, runs instead
    code.write_bytes(marshal.dumps(compile("print('the kept code')", "k", "exec")))
    assert run(cached(PROGRAM), cache=home) == "the kept code\n"
    # another program is another file
    assert run(cached(PROGRAM + "print(2)\n"), cache=home).endswith("2\n") and len(kept(home)) == 2


def test_a_kept_file_that_does_not_load_is_compiled_again_and_replaced(tmp_path):
    home = tmp_path / "agent-x"
    home.mkdir(mode=0o700)
    run(cached(PROGRAM), cache=home)
    (code,) = kept(home)
    good = code.read_bytes()
    for bad in (b"", good[:len(good) // 2], b"\xff" * 64, marshal.dumps(None), marshal.dumps("print(1)")):
        code.write_bytes(bad)
        assert run(cached(PROGRAM), "x", cache=home) == "args ['x'] None __main__\n"
        assert code.read_bytes() == good
    assert not list(home.glob("*.tmp"))


def test_no_code_is_read_or_kept_through_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "agent-x"
    link.symlink_to(real)
    assert run(cached(PROGRAM), cache=link) == "args [] None __main__\n"
    assert not kept(real)                                             # the directory a link names: not ours to use
    home = tmp_path / "agent-y"
    home.mkdir(mode=0o700)
    run(cached(PROGRAM), cache=home)
    (code,) = kept(home)
    target = tmp_path / "planted"
    target.write_bytes(marshal.dumps(compile("print('planted')", "p", "exec")))
    code.unlink()
    code.symlink_to(target)                                           # the file itself a link: not read
    assert run(cached(PROGRAM), cache=home) == "args [] None __main__\n"



def test_what_another_user_could_have_written_is_never_run(tmp_path):
    """A directory or a file another user owns, or may write, is neither read nor written; a
    FIFO in the file's place does not hold the probe up."""
    home = tmp_path / "agent-x"
    home.mkdir(mode=0o700)
    run(cached(PROGRAM), cache=home)
    (code,) = kept(home)
    theirs = marshal.dumps(compile("print('theirs')", "t", "exec"))
    code.write_bytes(theirs)
    assert run(cached(PROGRAM), cache=home) == "theirs\n"                      # the user's own: used
    mine = "args [] None __main__\n"
    assert run(cached(PROGRAM), cache=home, euid=os.geteuid() + 1) == mine     # another user's directory
    code.chmod(0o620)
    assert run(cached(PROGRAM), cache=home) == mine                             # a file others may write
    assert code.read_bytes() != theirs                                          # replaced by the user's own
    code.write_bytes(theirs)
    code.chmod(0o600)
    home.chmod(0o770)
    assert run(cached(PROGRAM), cache=home) == mine                             # a directory others may write
    home.chmod(0o700)
    code.unlink()
    os.mkfifo(code)
    assert run(cached(PROGRAM), cache=home) == mine                             # no wait on a FIFO
