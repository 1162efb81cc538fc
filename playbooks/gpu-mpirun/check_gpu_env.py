"""Checks that an mpirun launch on GPUs gave THIS rank the environment the plan says.

No GPU is needed: what is tested is the launch contract (seed 002: mpirun + NCCL on
GPU; FORMATS.md: `CUDA_VISIBLE_DEVICES=2,3` picks devices 2 and 3). Usage:

    python3 check_gpu_env.py --devices 2,3 [--size N]

Exits non-zero, loudly, unless
  - CUDA_VISIBLE_DEVICES is exactly the planned devices (in order), on every host;
  - Open MPI started one rank per planned device on this host
    (OMPI_COMM_WORLD_LOCAL_SIZE == number of devices);
  - ranks are contiguous per host, by slot: OMPI_COMM_WORLD_RANK % local size ==
    OMPI_COMM_WORLD_LOCAL_RANK, and the world size is a whole number of hosts
    (and equals --size when given).
Prints which physical GPU the rank would use (CUDA device LOCAL_RANK = the
LOCAL_RANK-th entry of CUDA_VISIBLE_DEVICES).
"""

import argparse
import os
import socket
import sys


def fail(msg):
    print(f"GPU ENV CHECK FAILED on {socket.gethostname()}: {msg}", flush=True)
    sys.exit(1)


def env_int(name):
    value = os.environ.get(name)
    if value is None or not value.strip().isdigit():
        fail(f"{name} is {value!r}: not started by Open MPI's mpirun?")
    return int(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", required=True, help="the planned physical GPU ids on every host, e.g. 2,3")
    ap.add_argument("--size", type=int, help="the planned number of ranks")
    a = ap.parse_args()
    planned = [int(d) for d in a.devices.split(",")]

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        fail(f"CUDA_VISIBLE_DEVICES is not set; the plan uses GPUs {planned}")
    try:
        visible_ids = [int(d) for d in visible.split(",")]
    except ValueError:
        fail(f"CUDA_VISIBLE_DEVICES={visible!r} is not a list of GPU ids")
    if visible_ids != planned:
        fail(f"CUDA_VISIBLE_DEVICES={visible}, the plan uses GPUs {a.devices}")

    rank, size = env_int("OMPI_COMM_WORLD_RANK"), env_int("OMPI_COMM_WORLD_SIZE")
    local_rank, local_size = env_int("OMPI_COMM_WORLD_LOCAL_RANK"), env_int("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local_size != len(planned):
        fail(f"{local_size} ranks on this host, the plan has one per GPU: {len(planned)}")
    if rank % local_size != local_rank:
        fail(f"rank {rank} is local rank {local_rank} of {local_size}: ranks are not contiguous per host")
    if size % local_size:
        fail(f"world size {size} is not a whole number of hosts of {local_size} ranks")
    if a.size is not None and size != a.size:
        fail(f"world size {size}, the plan has {a.size} ranks")
    gpu = visible_ids[local_rank]
    print(f"gpu env ok: rank {rank}/{size} local {local_rank}/{local_size} host {socket.gethostname()} "
          f"node {rank // local_size} CUDA_VISIBLE_DEVICES={visible} gpu {gpu}", flush=True)


if __name__ == "__main__":
    main()
