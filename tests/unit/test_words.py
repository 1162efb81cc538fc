"""A failed launcher's own words (orchestrator/agent/words.py), read from what OpenMPI 4.1.4
really printed (tests/fixtures/launchers/)."""

from __future__ import annotations

from pathlib import Path

from orchestrator.agent.words import launcher_words

FIX = Path(__file__).resolve().parent.parent / "fixtures" / "launchers"


def words(name: str) -> list[str]:
    return [ln[2:] for ln in launcher_words((FIX / name).read_text()).splitlines()]


def test_cannot_execute_is_quoted_from_the_error_to_the_node():
    """mpirun exit 132: the quote keeps the Executable: and Node: lines that name the cause."""
    assert words("mpirun-4.1.4-cannot-execute.txt") == [
        "mpirun was unable to launch the specified application as it could not access",
        "or execute an executable:",
        "Executable: /nonexistent/prog",
        "Node: vm"]


def test_ssh_refused_keeps_ssh_own_words_and_the_summary_not_the_advice():
    got = words("mpirun-4.1.4-ssh-refused.txt")
    assert got == ["ssh: connect to host 127.0.0.2 port 2222: Connection refused",
                   "ORTE was unable to reliably start one or more daemons.", "This usually is caused by:"]


def test_a_killed_rank_keeps_what_the_rank_said_and_both_blocks_whole():
    got = words("mpirun-4.1.4-rank-killed.txt")
    assert got[0] == "[warn] Epoll MOD(1) on fd 5 failed"
    assert got[1:3] == ["Primary job  terminated normally, but 1 process returned",
                        "a non-zero exit code. Per user-direction, the job has been aborted."]
    assert got[-1].startswith("mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9")


def test_the_last_block_is_kept_whole_however_long_and_noise_before_it_gives_way():
    block = ["-" * 74, "mpirun was unable to start: an error", *[f"detail {i}" for i in range(20)], "Node: n7",
             "advice", "-" * 74]
    text = "\n".join([f"noise {i}" for i in range(30)] + block)
    got = launcher_words(text, lines=12).splitlines()
    assert got[0] == "  mpirun was unable to start: an error" and got[-1] == "  Node: n7" and len(got) == 22
    assert launcher_words("", lines=12) == ""
    assert launcher_words("x" * 5000, limit=100).endswith("...") and len(launcher_words("x" * 5000, limit=100)) == 100
