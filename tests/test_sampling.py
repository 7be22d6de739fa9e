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


def test_compiled_draw_is_inverse_cdf_over_the_softmax():
    """The compiled draw (row_select.c's sample_rows) picks, for a uniform u, the index whose softmax(x / t)
    interval holds u (up to its float weights' rounding, 1e-5 here), never one of probability 0: rows of many
    lengths around its blocks of 16, strided, bf16 and fp32, with -inf entries; a row whose maximum is not
    finite goes to the reference draw without failing."""
    from treegen.engine import kernels
    from treegen.engine.sampling import softmax_draw

    if kernels.select_library() is None:
        return   # no compiler here: draw() over torch's softmax is the path itself
    gen = torch.Generator().manual_seed(2)
    grid = torch.linspace(0, 1, 2003, dtype=torch.float64)[:-1, None]   # u in [0, 1)
    for n in (1, 2, 15, 16, 17, 33, 100, 4096):
        x = (torch.randn(4, n + 5, generator=gen) * 3)[:, :n]
        if n > 2:
            x[1, ::3] = -float("inf")    # probability 0: never drawn
            x[2, n // 2] = x[2].max() + 8.0   # one token holds nearly all the mass
        for t, temperature in ((x, 0.7), (x.bfloat16(), 1.3)):
            for r in range(4):
                p = torch.softmax(t[r].double() / temperature, -1)
                cdf = p.cumsum(0)
                got = softmax_draw(t[r:r + 1].expand(len(grid), n), temperature, u=grid)
                assert bool((p[got] > 0).all()), (n, r)
                low = torch.cat([cdf.new_zeros(1), cdf])[got]
                assert bool(((low - 1e-5 <= grid[:, 0]) & (grid[:, 0] <= cdf[got] + 1e-5)).all()), (n, r, t.dtype)
    drawn = torch.stack([softmax_draw(torch.tensor([[0.0, -float("inf"), 1.0, 2.0]]), 1.0, gen) for _ in range(20000)])
    share = torch.bincount(drawn[:, 0], minlength=4).float() / 20000
    want = torch.softmax(torch.tensor([0.0, -float("inf"), 1.0, 2.0]), -1)
    assert share[1] == 0 and torch.allclose(share, want, atol=0.015)
    odd = torch.tensor([[-float("inf")] * 20, [0.0] * 19 + [float("nan")]])
    assert softmax_draw(odd, 1.0, gen).shape == (2,)


def test_compiled_draw_spends_the_generator_as_draw_does():
    """Plain decoding and verification draw through the same sampler, one fp64 uniform a row from the seeded
    generator: on a CPU the compiled draw and the reference (torch's softmax, then draw()) pick the same index
    for the same seed wherever the row's intervals are not within rounding of the uniform."""
    from treegen.engine.sampling import Sampler, draw

    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(3)) * 4
    sampler = Sampler(temperature=0.8)
    for seed in range(20):
        fast = sampler.sample(logits, torch.Generator().manual_seed(seed))
        slow = draw(torch.softmax(logits / 0.8, -1), torch.Generator().manual_seed(seed))
        assert torch.equal(fast, slow), seed
