"""Bucket inputs: a bucket-sized batch's inputs, kept and reused, its rows copied in once.

Why: a batch padded to a bucket (batching.py) has one of a few sizes, so its inputs can be
tensors made once per bucket and batch key (`BucketInputs`) that each request's rows are
copied into: no torch.cat allocating a new tensor per batch, and on a GPU nothing but
enqueued copies. On an Executor that replays whole executions as CUDA graphs, the replay
copies its inputs once more, into its graph instance's static buffers: every row was
copied twice. So a batch's inputs are a `BucketRows`, whose rows are copied only where they
are read: a replay copies them straight from the requests into the static buffers
(cuda/capture.py's `copy_inputs` calls `fill`), and any other use of the batch (the stream
path while a signature warms up, a fallback, a program that returns an input) fills the kept
bucket inputs first (`materialise`), as the batcher did for every batch before.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import torch


class BucketRows(list[Any]):
    """The flat inputs of a batch padded to a bucket, its requests' rows not copied in yet.

    Its items are the batch's inputs as an execution reads them: a kept bucket-sized tensor
    at each batched position (filled by `materialise`), the first request's value elsewhere
    (batch-mates share them: the batch key). So its shapes, dtypes and devices are the
    batch's, and an input signature is computed from it before any row is copied.
    """

    __slots__ = ("_batched", "_pad", "_rows", "_sizes", "materialised")

    def __init__(
        self, inputs: Sequence[Any], rows: Sequence[Sequence[Any]], sizes: Sequence[int],
        pad: int, batched: Sequence[bool],
    ) -> None:
        super().__init__(inputs)
        self._rows = rows  # each request's flat inputs, in order
        self._sizes = list(sizes)  # each request's rows
        self._pad = pad  # copies of the last row after them
        self._batched = batched
        self.materialised = False

    def fill(self, into: Sequence[Any]) -> None:
        """Copy each request's rows, in order, then `pad` copies of the last row, into
        `into`'s tensor at each batched position, and the shared values into `into`'s own
        buffers elsewhere (None, or the value itself, is left alone).

        One `_foreach_copy_` per input copies every request's rows into its block of the
        bucket (views from one `split`): on a GPU a fused copy, a launch or a few where
        `copy_` per request would launch once each (1.4 us a request on the CPU against 2.4
        for the loop)."""
        sizes, pad = self._sizes, self._pad
        rows = sum(sizes)
        with torch.no_grad():
            for i, buffer in enumerate(into):
                if not self._batched[i]:
                    if buffer is not None and buffer is not self[i]:
                        buffer.copy_(self[i])
                    continue
                blocks = buffer.split([*sizes, pad]) if pad else buffer.split(sizes)
                torch._foreach_copy_(blocks[:len(sizes)], [r[i] for r in self._rows])
                if pad:  # padding(rows) > 0 only when some request has a row
                    last = buffer[rows - 1:rows]
                    blocks[-1].copy_(last.expand(pad, *last.shape[1:]))

    def materialise(self) -> BucketRows:
        """Fill the kept bucket inputs (its own items), once; itself."""
        if not self.materialised:
            self.materialised = True
            self.fill(self)
        return self


class BucketInputs:
    """Bucket-sized batch inputs, kept per (bucket, batch key) and reused batch to batch.

    An input is taken for one batch and given back only when nothing reads it any more
    (`give_back`, after the execution returned: on a GPU its work is done by then); a batch
    that fails, is cancelled, or whose outputs share an input's memory keeps it from its
    bucket instead, and the next one makes a new input. A free list per key holds `per_key`
    inputs (as many as batches run at once); the least recently used key's are dropped past
    `max_keys` keys.
    """

    def __init__(self, batched: tuple[bool, ...], per_key: int, max_keys: int) -> None:
        self._batched = batched
        self._per_key = per_key
        self._max_keys = max_keys
        self._free: OrderedDict[Hashable, list[list[Any]]] = OrderedDict()
        self.made = 0  # inputs made (one list of tensors each): the tests' count

    def take(self, key: Hashable, head: list[Any], rows: int) -> list[Any]:
        """Inputs of `rows` rows shaped like request `head`'s batched tensors, the shared
        values as `head` has them: a free one of `key`, or new ones."""
        free = self._free.get(key)
        if free:
            self._free.move_to_end(key)
            tensors = free.pop()
        else:
            self.made += 1
            # a normal tensor even where the loop's thread is in inference mode: an inference
            # tensor would refuse the next batch's copies made outside it
            with torch.inference_mode(False):
                tensors = [
                    torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
                    if batched else None
                    for x, batched in zip(head, self._batched, strict=True)
                ]
        return [x if x is not None else shared for x, shared in zip(tensors, head, strict=True)]

    def give_back(self, key: Hashable, inputs: list[Any], outputs: Sequence[Any]) -> None:
        """`inputs` back to `key`'s free list, unless an output shares memory with one of
        them (then the caller holds it: dropped)."""
        tensors = [x if batched else None for x, batched in zip(inputs, self._batched,
                                                                  strict=True)]
        if _shares_memory(tensors, outputs):
            return
        free = self._free.setdefault(key, [])
        self._free.move_to_end(key)
        if len(free) < self._per_key:
            free.append(tensors)
        while len(self._free) > self._max_keys:
            self._free.popitem(last=False)


def _shares_memory(inputs: list[Any], outputs: Sequence[Any]) -> bool:
    """Whether an output tensor lies in the memory of one of `inputs` (an input returned as
    an output, or a view of one)."""
    held = {x.untyped_storage().data_ptr() for x in inputs if x is not None}
    held.discard(0)  # no memory (an empty or a meta tensor): nothing to share
    return any(
        isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in held
        for out in outputs
    )
