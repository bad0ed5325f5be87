"""Row gathers and scatters on one thread (numpy) give what the torch indexing they replace gives."""

from __future__ import annotations

import pytest
import torch

from swarm.moe import rows as row_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_row_ops_equal_torch_indexing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 3, 4).to(dtype)
    rows, cols = torch.tensor([0, 2, 5]), torch.tensor([1, 0, 2])
    torch.testing.assert_close(row_ops.take_rows(x, rows), x[rows], rtol=0, atol=0)
    torch.testing.assert_close(row_ops.take_pairs(x, rows, cols), x[rows, cols], rtol=0, atol=0)

    out = row_ops.zeros((6, 3, 4), dtype)
    assert out.dtype == dtype and not out.any()
    src = torch.randn(3, 4).to(dtype)
    expected = torch.zeros(6, 3, 4, dtype=dtype)
    expected[rows, cols] = src
    row_ops.put_pairs_(out, rows, cols, src)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    total, reference = x.clone(), x.clone()
    row_ops.add_(total, x)
    reference += x
    add = torch.randn(3, 3, 4).to(dtype)
    row_ops.add_rows_(total, rows, add)
    reference.index_add_(0, rows, add)
    torch.testing.assert_close(total, reference, rtol=0, atol=0)


def test_taken_rows_are_copies() -> None:
    x = torch.zeros(4, 2)
    taken = row_ops.take_rows(x, torch.tensor([1, 3]))
    taken += 1
    assert not x.any()
