"""Data-parallel training with PyTorch DDP, started by torchrun (gloo backend, CPU).

A softmax-regression classifier (one Linear(FEATURES, 10) layer, cross-entropy loss) on
synthetic data whose labels come from a fixed random linear teacher. Every rank builds the
same global data set (fixed seed) and trains on its own shard (`rank::world`); DDP averages
the gradients across every rank each step (gloo all-reduce over TCP between hosts), so every
rank applies the same update and keeps the same weights.

Prints the seeds' `epoch: E, step: S, loss is L` lines (this rank's batch loss) and, at the
end, a checksum of the weights: the same on every rank when they stayed in sync.

With CKPT_DIR set (a directory every host shares, such as `orch lab up N --shared /data/shared`
gives), rank 0 writes a checkpoint there after every epoch (atomically), and every rank starts
from the latest one when there is one: a run that orch restarts (ORCH_ATTEMPT > 1), on the same
hosts or with a spare in a lost host's place, resumes where it stopped and ends with the weights
an undisturbed run has. EPOCH_SLEEP seconds of rest after each epoch make a run long enough to
disturb on purpose.

    torchrun --nproc-per-node=2 train.py      # or: orch up playbooks/torch-ddp/cluster.yaml
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

FEATURES, CLASSES = 64, 10
EPOCHS = int(os.environ.get("EPOCHS", "3"))
SAMPLES = int(os.environ.get("SAMPLES", "4096"))   # the global data set
BATCH = int(os.environ.get("BATCH", "32"))         # per rank
LR = float(os.environ.get("LR", "0.5"))
PRINT_EVERY = int(os.environ.get("PRINT_EVERY", "8"))
CKPT_DIR = os.environ.get("CKPT_DIR")
EPOCH_SLEEP = float(os.environ.get("EPOCH_SLEEP", "0"))


def load_checkpoint(model: nn.Module) -> tuple[int, int]:
    """(first epoch to run, step count) after the latest checkpoint; (0, 0) without one."""
    path = os.path.join(CKPT_DIR, "ckpt.pt") if CKPT_DIR else None
    if not path or not os.path.exists(path):
        return 0, 0
    ck = torch.load(path)
    model.load_state_dict(ck["model"])
    print(f"resumed from {path}: epoch {ck['epoch']} done, step {ck['step']} "
          f"(attempt {os.environ.get('ORCH_ATTEMPT', '?')})", flush=True)
    return ck["epoch"] + 1, ck["step"]


def save_checkpoint(model: nn.Module, epoch: int, step: int) -> None:
    """Rank 0: the weights after `epoch`, written whole or not at all (temp file + rename)."""
    path = os.path.join(CKPT_DIR, "ckpt.pt")
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save({"model": model.state_dict(), "epoch": epoch, "step": step}, tmp)
    os.replace(tmp, path)


def main() -> None:
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(2024)  # the same data set and the same initial weights on every rank
    teacher = torch.randn(FEATURES, CLASSES)
    x = torch.randn(SAMPLES, FEATURES)
    y = torch.argmax(x @ teacher, dim=1)
    x, y = x[rank::world], y[rank::world]
    net = nn.Linear(FEATURES, CLASSES)
    first, step = load_checkpoint(net)   # plain SGD keeps no state of its own: the weights are all
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(first, EPOCHS):
        for i in range(0, len(x) - BATCH + 1, BATCH):
            opt.zero_grad()
            loss = loss_fn(model(x[i:i + BATCH]), y[i:i + BATCH])
            loss.backward()  # DDP all-reduces (averages) the gradients here
            opt.step()
            if step % PRINT_EVERY == 0:
                print(f"epoch: {epoch}, step: {step}, loss is {loss.item():.6f}", flush=True)
            step += 1
        if CKPT_DIR and rank == 0:
            save_checkpoint(net, epoch, step)
        dist.barrier()   # nobody starts the next epoch before the checkpoint of this one is whole
        time.sleep(EPOCH_SLEEP)
    digest = hashlib.sha256()
    for p in model.module.parameters():
        digest.update(p.detach().numpy().tobytes())
    print(f"rank {rank}/{world} on {socket.gethostname()}: weights checksum {digest.hexdigest()[:16]}", flush=True)
    # every rank reaches the teardown together: a rank that closes its gloo connections while
    # another is still in a collective can make that one abort at exit ("terminate called
    # without an active exception", SIGABRT), after its work is done
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # End here, without the interpreter's finalization: gloo's C++ worker threads can still be
    # torn down during it and abort the process ("terminate called without an active exception",
    # SIGABRT) after the work is done, a known PyTorch problem seen here once in ~10 runs even
    # with destroy_process_group called. The output is flushed first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
