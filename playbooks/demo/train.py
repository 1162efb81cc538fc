"""A tiny data-parallel training job that needs nothing but Python.

Each rank fits the same linear model to its own shard of synthetic data; every
step the ranks average their gradients through rank 0 (a minimal TCP
all-reduce on MASTER_ADDR:MASTER_PORT), so all ranks keep identical weights,
exactly as data-parallel training does. It reads the environment every orch
launcher provides (RANK_ID/RANK_SIZE, or RANK/WORLD_SIZE, or OpenMPI's
OMPI_COMM_WORLD_*), prints the seeds' `epoch: E, step: S, loss is L` lines and,
at the end, a checksum of its weights (the same on every rank).
"""

import hashlib
import json
import os
import random
import socket
import struct
import threading
import time

FEATURES, SAMPLES, EPOCHS, STEPS, LR = 8, 256, 3, 10, 0.1


def env_int(*names, default=None):
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    if default is None:
        raise SystemExit(f"none of {names} is set: start me with orch")
    return default


RANK = env_int("RANK_ID", "RANK", "OMPI_COMM_WORLD_RANK")
SIZE = env_int("RANK_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")
ADDR = os.environ.get("MASTER_ADDR", "127.0.0.1")
PORT = env_int("MASTER_PORT", default=29517)


def send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def recv(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            raise ConnectionError("peer closed")
        head += chunk
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return json.loads(data)


def serve(listener, peers):
    """Rank 0: accept every other rank, then average what they send, step after step."""
    conns = []
    while len(conns) < SIZE - 1:
        conn, _ = listener.accept()
        conns.append(conn)
    peers.extend(conns)


def allreduce(vec, peers, upstream):
    if SIZE == 1:
        return vec
    if RANK == 0:
        total = list(vec)
        for c in peers:
            for i, v in enumerate(recv(c)):
                total[i] += v
        avg = [t / SIZE for t in total]
        for c in peers:
            send(c, avg)
        return avg
    send(upstream, vec)
    return recv(upstream)


def main():
    teacher = random.Random(1234)
    w_true = [teacher.uniform(-1, 1) for _ in range(FEATURES)]
    shard = random.Random(1000 + RANK)  # a different shard on every rank
    xs = [[shard.gauss(0, 1) for _ in range(FEATURES)] for _ in range(SAMPLES)]
    ys = [sum(a * b for a, b in zip(x, w_true)) + shard.gauss(0, 0.01) for x in xs]

    peers, upstream = [], None
    if SIZE > 1 and RANK == 0:
        listener = socket.create_server(("", PORT), reuse_port=False)
        listener.settimeout(120)
        t = threading.Thread(target=serve, args=(listener, peers))
        t.start()
        t.join(timeout=120)
        if len(peers) < SIZE - 1:
            raise SystemExit(f"only {len(peers)} of {SIZE - 1} ranks connected to {ADDR}:{PORT}")
    elif SIZE > 1:
        deadline = time.time() + 120
        while True:
            try:
                upstream = socket.create_connection((ADDR, PORT), timeout=120)
                break
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)

    w = [0.0] * FEATURES
    batch = SAMPLES // STEPS
    for epoch in range(1, EPOCHS + 1):
        for step in range(1, STEPS + 1):
            bx, by = xs[(step - 1) * batch: step * batch], ys[(step - 1) * batch: step * batch]
            grad, loss = [0.0] * FEATURES, 0.0
            for x, y in zip(bx, by):
                err = sum(a * b for a, b in zip(w, x)) - y
                loss += err * err / len(bx)
                for i in range(FEATURES):
                    grad[i] += 2 * err * x[i] / len(bx)
            reduced = allreduce(grad + [loss], peers, upstream)
            grad, loss = reduced[:-1], reduced[-1]
            w = [wi - LR * gi for wi, gi in zip(w, grad)]
            print(f"epoch: {epoch}, step: {step}, loss is {loss:.6f}", flush=True)
    digest = hashlib.sha256(json.dumps([round(x, 12) for x in w]).encode()).hexdigest()[:16]
    print(f"rank {RANK}/{SIZE} on {socket.gethostname()}: weights checksum {digest}", flush=True)


if __name__ == "__main__":
    main()
