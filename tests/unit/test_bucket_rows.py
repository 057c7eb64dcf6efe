"""BucketRows (asyncgraph/runtime/bucket_inputs.py) alone: a bucket batch's rows, copied where
they are read. Filling another list (a graph's static inputs) and materialising into its own
kept inputs give the same batch; the kept inputs are untouched until materialised, and
materialised once."""

from __future__ import annotations

import torch

from asyncgraph.runtime.bucket_inputs import BucketInputs, BucketRows

BATCHED = (True, False, True)


def requests() -> list[list[torch.Tensor]]:
    """Three requests of 2, 1 and 2 rows; the middle input is shared (the batch key)."""
    shared = torch.tensor([7.0, 8.0])
    return [[torch.full((n, 3), float(k)), shared, torch.full((n,), 10.0 + k)]
            for k, n in enumerate((2, 1, 2))]


def expected(pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    first = torch.cat([torch.full((n, 3), float(k)) for k, n in enumerate((2, 1, 2))])
    third = torch.cat([torch.full((n,), 10.0 + k) for k, n in enumerate((2, 1, 2))])
    return (torch.cat([first, first[-1:].expand(pad, 3)]),
            torch.cat([third, third[-1:].expand(pad)]))


def batch(pad: int) -> BucketRows:
    reqs = requests()
    inputs = BucketInputs(BATCHED, per_key=1, max_keys=1).take("k", reqs[0], 5 + pad)
    for x in (inputs[0], inputs[2]):
        x.fill_(-1.0)
    return BucketRows(inputs, reqs, [2, 1, 2], pad, BATCHED)


def test_rows_fill_static_buffers_and_leave_the_kept_inputs_alone() -> None:
    for pad in (0, 3):
        rows = batch(pad)
        static = [torch.empty_like(rows[0]), torch.zeros(2), torch.empty_like(rows[2])]
        rows.fill(static)
        first, third = expected(pad)
        torch.testing.assert_close(static[0], first)
        torch.testing.assert_close(static[1], torch.tensor([7.0, 8.0]))  # its own buffer
        torch.testing.assert_close(static[2], third)
        assert not rows.materialised
        assert bool((rows[0] == -1.0).all()) and bool((rows[2] == -1.0).all())


def test_materialise_fills_the_kept_inputs_once() -> None:
    rows = batch(1)
    assert rows.materialise() is rows and rows.materialised
    first, third = expected(1)
    torch.testing.assert_close(rows[0], first)
    torch.testing.assert_close(rows[2], third)
    torch.testing.assert_close(rows[1], torch.tensor([7.0, 8.0]))  # the shared value
    rows[0].fill_(0.0)
    rows.materialise()  # once: not copied again
    assert bool((rows[0] == 0.0).all())
