"""Drafting's compiled selections (engine/row_select.c via drafters/select.py) against torch's ops."""
import pytest
import torch

from treegen.drafters import select
from treegen.engine import kernels

needs_kernels = pytest.mark.skipif(kernels.select_library() is None, reason="no C compiler")


@needs_kernels
@pytest.mark.parametrize("n,k", [(8192, 64), (8201, 16), (64, 64), (40, 8), (1, 1)])
def test_top_k_matches_torch(n, k):
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(7, n, generator=gen) * 4
    x[1, : n // 2] = -torch.inf                         # a row partly outside the vocabulary
    top = select.top_k(x, k)
    ref = x.topk(min(k, n), dim=-1)
    assert select.compiled(x)
    assert torch.equal(top.values, ref.values)
    finite = ref.values.isfinite()                     # no ties among them in random data: the same columns
    assert torch.equal(top.columns[finite], ref.indices[finite])
    torch.testing.assert_close(top.lse, x.logsumexp(-1), rtol=1e-6, atol=1e-5)


@needs_kernels
def test_top_k_ties_lower_column_first_and_empty_rows():
    x = torch.zeros(2, 40)
    x[0, 5] = 1.0
    x[1] = -torch.inf
    top = select.top_k(x, 5)
    assert top.columns[0].tolist() == [5, 0, 1, 2, 3]
    assert top.lse[1] == -torch.inf and torch.isinf(top.values[1]).all()


@needs_kernels
def test_top_k_keeps_leading_shape_and_bf16_input():
    x = torch.randn(3, 4, 64).bfloat16()
    top = select.top_k(x, 16)
    ref = x.float().topk(16, dim=-1)
    assert top.values.shape == (3, 4, 16) and top.lse.shape == (3, 4)
    assert torch.equal(top.values, ref.values)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 8, 11])
def test_gathered_logits_match_gather_and_bmm(dtype, m):
    gen = torch.Generator().manual_seed(m)
    states = torch.randn(5, m, 96, generator=gen).to(dtype)
    weight = torch.randn(300, 96, generator=gen).to(dtype)
    support = torch.randint(300, (5, 24), generator=gen)
    out = select.gathered_logits(states, weight, support)
    rows = weight.index_select(0, support.flatten()).view(5, 24, 96).float()
    ref = torch.bmm(states.float(), rows.transpose(1, 2))
    assert out.dtype == torch.float32 and out.shape == (5, m, 24)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_torch_forms_serve_where_the_kernel_does_not(monkeypatch):
    monkeypatch.setattr(select, "compiled", lambda x: False)
    x = torch.randn(3, 50)
    top = select.top_k(x, 70)                           # k past the row: the whole row, ranked
    assert top.values.shape == (3, 50)
    torch.testing.assert_close(top.lse, x.logsumexp(-1))
    states, weight = torch.randn(2, 3, 20), torch.randn(30, 20)   # a width the kernel does not take
    support = torch.randint(30, (2, 4))
    ref = torch.bmm(states, weight[support].transpose(1, 2))
    torch.testing.assert_close(select.gathered_logits(states, weight, support), ref)


@needs_kernels
def test_a_run_repeats_its_numbers():
    x = torch.randn(9, 8192)
    a, b = select.top_k(x, 32), select.top_k(x, 32)
    assert torch.equal(a.values, b.values) and torch.equal(a.columns, b.columns) and torch.equal(a.lse, b.lse)
