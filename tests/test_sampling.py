"""The sampler's greedy rule: the fast CPU argmax against torch's."""
from __future__ import annotations

import torch


def test_greedy_argmax_is_torchs_rule():
    """The CPU's NumPy argmax picks what torch.argmax picks: the first maximum, in bf16 and fp32, 1-D too."""
    from treegen.engine.sampling import argmax

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4096, generator=gen)
    x[1, 7] = x[1, 3000] = x[1].max() + 1    # a tie: the first wins
    x[2, 11] = float("nan")
    for t in (x, x.bfloat16(), x[:, ::2]):
        assert torch.equal(argmax(t), t.argmax(-1))
    assert int(argmax(x[0])) == int(x[0].argmax())
