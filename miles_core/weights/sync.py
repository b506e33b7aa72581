"""Trainer-side weight broadcast to rollout engines over a process group (gloo on CPU, NCCL on GPUs).

The trainer is rank 0 of a dedicated group (not the default one, which the trainer may use for
data parallelism); each engine process joins with its own rank. Weights travel in buckets: the
tensors of a bucket are flattened to bytes and concatenated in order (`flatten_bucket`), so one
broadcast carries many small tensors; the receiver rebuilds them from (name, dtype, shape) in the
same order. This is the layout SGLang's `update_weights_from_distributed` reads with
`load_format="flattened_bucket"`; the engine adapter announces each bucket to its servers while
`WeightSender.send` broadcasts it. The asynchronous phase uses the same sender from its trainer.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Bucket:
    names: list[str]
    dtypes: list[str]  # "float32", "bfloat16", ...
    shapes: list[list[int]]
    flat: torch.Tensor  # [sum of byte sizes] uint8, the tensors' bytes in order

    @property
    def nbytes(self) -> int:
        return self.flat.numel()


def flatten_bucket(named: list[tuple[str, torch.Tensor]]) -> Bucket:
    if not named:
        raise ValueError("a weight bucket needs at least one tensor")
    parts = [t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in named]
    return Bucket(
        names=[n for n, _ in named],
        dtypes=[str(t.dtype).removeprefix("torch.") for _, t in named],
        shapes=[list(t.shape) for _, t in named],
        flat=torch.cat(parts),
    )


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group tensors in order into buckets of at most bucket_bytes (a larger tensor goes alone).

    Tensors keep their dtype; each starts at a byte offset the receiver can view as that dtype
    only if earlier sizes are multiples of its item size, so a bucket is closed before a tensor
    that would be misaligned."""
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        misaligned = size % tensor.element_size() != 0
        if current and (size + nbytes > bucket_bytes or misaligned):
            yield flatten_bucket(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield flatten_bucket(current)


class WeightSender:
    """Rank 0 of a weight-update process group reached at tcp://master_address:master_port.

    `open` blocks until all world_size ranks joined, so call it while the receivers are being
    asked to join (e.g. from another thread). The group is created the way torch creates any
    named group (rendezvous store, prefixed by the group name, then the c10d group helper), which
    is how rollout engines build theirs on the other side.
    """

    def __init__(self, group, world_size: int, group_name: str):
        self.group = group
        self.world_size = world_size
        self.group_name = group_name

    @classmethod
    def open(cls, master_address: str, master_port: int, world_size: int, group_name: str, backend: str = "gloo", timeout_s: float = 300.0) -> WeightSender:
        # torch has no public constructor for a second, named group outside init_process_group;
        # the helper below is what init_process_group and new_group use internally.
        from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

        timeout = datetime.timedelta(seconds=timeout_s)
        store, rank, size = next(rendezvous(f"tcp://{master_address}:{master_port}", 0, world_size, timeout=timeout))
        store.set_timeout(timeout)
        group, _ = _new_process_group_helper(
            size,
            rank,
            [],
            Backend(backend),
            PrefixStore(group_name, store),
            group_name=group_name,
            timeout=timeout,
        )
        _world.pg_group_ranks[group] = {i: i for i in range(size)}
        return cls(group, size, group_name)

    def send(self, bucket: Bucket) -> None:
        """Broadcast one bucket's bytes from rank 0 to every receiver."""
        dist.broadcast(bucket.flat, src=0, group=self.group)

    def close(self) -> None:
        dist.destroy_process_group(self.group)
