"""The rotary table (engine/rope.py) gives each position the bits the per-forward ops give it."""
import pytest
import torch

from treegen.engine.rope import RopeTable, per_forward


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_table_equals_the_per_forward_ops(dtype, threads):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64)
        table = RopeTable(inv_freq, dtype)
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 2, 7, 16, 65, 300):
            positions = torch.randint(0, 5000, (1, rows), generator=gen)
            cos, sin = table(positions)
            angles = per_forward(positions, inv_freq)
            assert torch.equal(cos, angles.cos().to(dtype)) and torch.equal(sin, angles.sin().to(dtype))
    finally:
        torch.set_num_threads(before)


def test_table_grows_and_keeps_what_it_made():
    table = RopeTable(torch.ones(4), torch.float32)
    first, _ = table(torch.tensor([[3]]))
    assert table.cos.shape == (4, 8)
    again, _ = table(torch.tensor([[3, 1000]]))
    assert table.cos.shape[0] >= 1001 and torch.equal(again[0, :1], first[0])
