"""The sampler's rules: the fast CPU greedy argmax against torch's, and the inverse-CDF draw."""
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


def test_compiled_argmax_is_numpys_rule():
    """The compiled argmax (row_select.c) against NumPy's on the same values: ties, NaNs, -inf rows, signed
    zeros, rows with a stride, lengths around its blocks of 16, bf16 and fp32."""
    import numpy as np

    from treegen.engine import kernels
    from treegen.engine.sampling import argmax

    if kernels.select_library() is None:
        return   # no compiler here: the NumPy path is the rule itself
    gen = torch.Generator().manual_seed(1)
    for n in (1, 15, 16, 17, 33, 4096, 49152):
        x = torch.randn(6, n + 3, generator=gen)[:, :n]   # rows a stride apart
        x[1] = x[1].round()                                # many ties
        x[2] = -float("inf")
        x[3, n // 2] = float("nan")
        x[4] = 0.0
        x[4, :: 2] = -0.0
        x[5, n - 1] = float("inf")
        for t in (x, x.bfloat16()):
            want = torch.from_numpy(np.asarray(t.float().numpy().argmax(-1)))
            assert torch.equal(argmax(t), want), (n, t.dtype)


def test_draw_is_inverse_cdf_sampling():
    """sampling.draw: one index per row from one uniform, in proportion to the row's (unnormalised) mass; a
    zero-probability index is never drawn, whatever the row's shape."""
    from treegen.engine.sampling import draw

    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([[0.2, 0.0, 1.2, 0.6], [0.0, 0.0, 0.0, 5.0]])   # rows sum to 2 and 5
    drawn = torch.stack([draw(probs, gen) for _ in range(20000)])        # [20000, 2]
    assert drawn.shape == (20000, 2)
    share = torch.bincount(drawn[:, 0], minlength=4).float() / 20000
    assert share[1] == 0 and torch.allclose(share, torch.tensor([0.1, 0.0, 0.6, 0.3]), atol=0.015)
    assert (drawn[:, 1] == 3).all()
    assert draw(probs[0], gen).shape == ()
    wide = torch.zeros(49152)
    wide[[7, 40000]] = torch.tensor([1.0, 3.0])
    assert set(torch.stack([draw(wide, gen) for _ in range(200)]).tolist()) == {7, 40000}
