"""Data-parallel training over real MPI collectives: mpi4py + numpy, started by mpirun.

A softmax-regression classifier (one Dense(FEATURES, 10) layer, cross-entropy loss) on
synthetic data whose labels come from a fixed random linear teacher. Every rank builds
the same global data set (fixed seed) and trains on its own shard of it (`rank::size`);
every step each rank computes its gradient on its own batch and `MPI_Allreduce`
averages the gradients across all ranks (over TCP between hosts), so every rank applies
the same update and keeps the same weights, exactly like data-parallel training does.

Prints the seeds' `epoch: E, step: S, loss is L` lines (this rank's batch loss) and, at
the end, a checksum of the weights: the same on every rank when they stayed in sync.

    mpirun -n 4 python train.py        # or: orch up playbooks/mpi-allreduce/cluster.yaml
"""

import hashlib
import os
import socket

import numpy as np
from mpi4py import MPI

FEATURES, CLASSES = 64, 10
EPOCHS = int(os.environ.get("EPOCHS", "5"))
SAMPLES = int(os.environ.get("SAMPLES", "4096"))   # the global data set
BATCH = int(os.environ.get("BATCH", "32"))         # per rank
LR = float(os.environ.get("LR", "0.5"))
PRINT_EVERY = int(os.environ.get("PRINT_EVERY", "8"))

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def dataset():
    rng = np.random.default_rng(2024)  # the same global data set on every rank
    teacher = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(SAMPLES, FEATURES))
    y = np.argmax(x @ teacher, axis=1)
    return x[rank::size], y[rank::size]  # a different shard per rank


def loss_and_grads(w, b, x, y):
    logits = x @ w + b
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    loss = -np.mean(np.log(p[np.arange(len(y)), y] + 1e-12))
    d = p
    d[np.arange(len(y)), y] -= 1.0
    d /= len(y)
    return loss, x.T @ d, d.sum(axis=0)


def main():
    x, y = dataset()
    w = np.zeros((FEATURES, CLASSES))
    b = np.zeros(CLASSES)
    steps = len(x) // BATCH
    flat = np.empty(w.size + b.size)
    for epoch in range(EPOCHS):
        for i in range(steps):
            bx, by = x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            loss, gw, gb = loss_and_grads(w, b, bx, by)
            local = np.concatenate([gw.ravel(), gb])
            comm.Allreduce(local, flat, op=MPI.SUM)  # the gradients of every rank, summed
            flat /= size                               # ... and averaged
            w -= LR * flat[:w.size].reshape(w.shape)
            b -= LR * flat[w.size:]
            if i % PRINT_EVERY == 0:
                print("epoch: %s, step: %s, loss is %s" % (epoch, i, np.float32(loss)), flush=True)
    digest = hashlib.sha256(np.ascontiguousarray(w).tobytes() + np.ascontiguousarray(b).tobytes()).hexdigest()[:16]
    print(f"rank {rank}/{size} on {socket.gethostname()}: weights checksum {digest}", flush=True)


if __name__ == "__main__":
    main()
