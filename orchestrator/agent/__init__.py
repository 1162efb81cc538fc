"""orch's run supervisor: the one program orch runs on the cluster for a run.

Standard library only, python3 >= 3.8: this package is copied, as it is, once per version into
the workdir on every host (`<workdir>/.orch/agent-<hash>/orch_agent/`, shared by the runs started
from that workdir, its bytecode too; each run's `agent.py` imports it) and run there with the
host's own python3; the controller imports the same modules (`orchestrator.agent`), so every rule both
sides need (states, message formats, file layout) exists once.

    layout    names: environment variables, files and directories of a run on a host
    states    run, attempt and rank states (str words with enum's interface), the terminal set, the transition table,
              describe(), rank folding
    protocol  the head <-> member/watcher wire format: versioned messages, mutual HMAC
              authentication, frame limits
    head      decide(state, events, now) -> actions: fail-fast, lost hosts, stalls, time-out,
              restarts, pure (no I/O, no clock)
    procs     this host's processes: start, reap, stop, stacks
    rank      the rank wrapper (`agent.py rank`), imported alone: light to start
    server    the event loop (its Poller on epoll): listeners, connections, the handshake, limits
    cli       agent.py's commands: start, batch, rank, watch, stop, status

Modules import one another relatively only (the package is `orch_agent` on the hosts). A host's
start imports no enum (nor signal, socket, selectors, re or base64, which import it): the C
modules (layout.signal, _socket) and small stand-ins instead (tests/unit/test_agent_stdlib.py).
"""
