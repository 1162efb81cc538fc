"""Seed 004's data-parallel MNIST network, trained for real with MindSpore on CPU under msrun.

The network, loss, optimizer and training step are the seed's (MindSpore "mpirun
startup" / data-parallel tutorial): Flatten -> Dense(28*28, 10) -> ReLU,
CrossEntropyLoss, SGD, `ops.value_and_grad` + `nn.DistributedGradReducer`, with
`ParallelMode.DATA_PARALLEL, gradients_mean=True` and `init()`. Only the device
(`device_target="CPU"`) and the data differ: no download is possible here, so the
data set is synthetic and MNIST-shaped: 28x28 one-channel images whose labels come
from a fixed random linear teacher; every rank builds the same global set (fixed
seed) and trains on its own shard of it (`rank::size`), as MnistDataset(num_shards,
shard_id) would give it.

Prints the seed's `epoch: E, step: S, loss is L` lines and, at the end, a checksum
of the weights: gradients are averaged across ranks every step, so every rank
prints the same checksum (different checksums mean the ranks were not synchronised).

Run it with msrun (one msrun per host; `orch up playbooks/mindspore-msrun/cluster.yaml`
does that), e.g. on one machine: `msrun --worker_num=2 --local_worker_num=2 train.py`.
"""

import hashlib
import os
import socket

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init

EPOCHS = int(os.environ.get("EPOCHS", "3"))
SAMPLES = int(os.environ.get("SAMPLES", "2048"))   # the global data set; each rank gets 1/size of it
BATCH = int(os.environ.get("BATCH", "32"))
LR = float(os.environ.get("LR", "0.05"))
PRINT_EVERY = int(os.environ.get("PRINT_EVERY", "4"))

ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True)
init()
ms.set_seed(1)  # the same initial weights on every rank


class Network(nn.Cell):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(28 * 28, 10, weight_init="normal", bias_init="zeros")
        self.relu = nn.ReLU()

    def construct(self, x):
        x = self.flatten(x)
        logits = self.relu(self.fc(x))
        return logits


def create_dataset(batch_size):
    """Synthetic MNIST: N(0,1) "pixels" (already normalised, as the seed's Rescale+Normalize
    would leave them), labels = argmax of a fixed random linear teacher; this rank's shard."""
    rank_id, rank_size = get_rank(), get_group_size()
    rng = np.random.default_rng(2024)  # the same global data set on every rank
    teacher = rng.normal(size=(28 * 28, 10)).astype(np.float32)
    images = rng.normal(size=(SAMPLES, 1, 28, 28)).astype(np.float32)
    labels = np.argmax(images.reshape(SAMPLES, -1) @ teacher, axis=1).astype(np.int32)
    images, labels = images[rank_id::rank_size], labels[rank_id::rank_size]  # a different shard per rank
    steps = len(images) // batch_size
    return [(ms.Tensor(images[i * batch_size:(i + 1) * batch_size]),
             ms.Tensor(labels[i * batch_size:(i + 1) * batch_size])) for i in range(steps)]


net = Network()
data_set = create_dataset(BATCH)
loss_fn = nn.CrossEntropyLoss()
optimizer = nn.SGD(net.trainable_params(), LR)


def forward_fn(data, label):
    logits = net(data)
    loss = loss_fn(logits, label)
    return loss, logits


grad_fn = ops.value_and_grad(forward_fn, None, net.trainable_params(), has_aux=True)
grad_reducer = nn.DistributedGradReducer(optimizer.parameters)

for epoch in range(EPOCHS):
    i = 0
    for data, label in data_set:
        (loss, _), grads = grad_fn(data, label)
        grads = grad_reducer(grads)
        optimizer(grads)
        if i % PRINT_EVERY == 0:
            print("epoch: %s, step: %s, loss is %s" % (epoch, i, loss), flush=True)
        i += 1

digest = hashlib.sha256()
for p in net.trainable_params():
    digest.update(p.name.encode())
    digest.update(np.ascontiguousarray(p.asnumpy()).tobytes())
print(f"rank {get_rank()}/{get_group_size()} on {socket.gethostname()}: weights checksum {digest.hexdigest()[:16]}",
      flush=True)
