"""engine/matmul.py: every layout computes x @ W.T (up to rounding), each row count takes its measured form,
copies stay within their budget, and the choice is made once per machine (kept on disk)."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from treegen.engine import disk
from treegen.engine import matmul as M


def forms(form: str) -> dict[int, str]:
    return dict.fromkeys(M.ROWS, form)


@pytest.mark.parametrize("form", M.FORMS)
def test_every_form_is_the_same_product(form):
    from treegen.engine import kernels

    weight, tol = torch.randn(48, 24), 1e-5
    if form == "compiled":   # bf16 only, outputs in whole 64s
        weight, tol = torch.randn(128, 24).to(torch.bfloat16), 2e-2
        if not kernels.row_matmul_packable(weight):
            pytest.skip("no AVX512-BF16 here (or no C compiler)")
    mm = M.Matmul(weight, forms(form))
    assert set(mm.forms.values()) == {form}
    for rows in (1, 2, 3, 7, 64, 70):
        x = torch.randn(1, rows, 24).to(weight.dtype)
        out = mm(x)
        assert out.shape == (1, rows, weight.shape[0]) and out.is_contiguous()
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), rtol=tol, atol=tol)
    assert torch.equal(M.Matmul.plain(weight)(x), F.linear(x, weight))   # transformers' own bits


def test_the_compiled_form_steps_aside_where_it_cannot_serve():
    for weight in (torch.randn(128, 24), torch.randn(48, 24).to(torch.bfloat16)):   # fp32; not whole 64s
        assert set(M.Matmul(weight, forms("compiled")).forms.values()) == {"linear"}


def test_a_row_count_takes_the_form_of_the_next_measured_one():
    table = {1: "t", 2: "swapped", 4: "linear", 8: "swapped", 16: "linear", 32: "linear", 64: "t"}
    mm = M.Matmul(torch.randn(8, 4), table)
    assert [mm.form(n) for n in (1, 2, 3, 4, 5, 8, 9, 33, 64, 500)] == \
        ["t", "swapped", "linear", "linear", "swapped", "swapped", "linear", "t", "t", "t"]
    assert set(mm.copies) == {"t"} and not M.Matmul(torch.randn(8, 4), forms("swapped")).copies


def test_linear_is_kept_unless_another_form_is_clearly_faster():
    seconds = {"linear": dict.fromkeys(M.ROWS, 1.0), "t": dict.fromkeys(M.ROWS, 0.9),
               "swapped": dict.fromkeys(M.ROWS, 2.0)}   # a form not timed (no oneDNN) is just absent
    seconds["swapped"][2] = 0.5
    assert M.pick(seconds) == {**forms("linear"), 2: "swapped"}   # 0.9 is not clearly faster


def test_transposed_copies_stay_within_their_budget(monkeypatch):
    weight = torch.randn(64, 32)
    size = weight.numel() * weight.element_size()
    monkeypatch.setattr(M, "COPY_BUDGET", M.Matmul.copied + size)
    first = M.Matmul(weight, forms("t"))
    assert "t" in first.copies
    second = M.Matmul(weight, forms("t"))     # over budget: F.linear instead of a copy
    assert not second.copies and set(second.forms.values()) == {"linear"}
    del first
    gc.collect()
    assert "t" in M.Matmul(weight, forms("t")).copies   # a collected copy gives its bytes back


def test_the_choice_is_measured_once_and_kept_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("TREEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(M.Matmul, "measured", {})
    monkeypatch.setattr(disk, "BUSY_SHARE", float("inf"))   # kept however busy the machine running the tests is
    calls = []

    def timed(n_out, n_in, dtype):
        calls.append((n_out, n_in))
        return {"linear": dict.fromkeys(M.ROWS, 1.0), "t": dict.fromkeys(M.ROWS, 0.1),
                "swapped": dict.fromkeys(M.ROWS, 2.0)}

    monkeypatch.setattr(M, "time_forms", timed)
    assert M.Matmul(torch.randn(16, 8)).forms == forms("t")
    assert M.Matmul(torch.randn(16, 8)).forms == forms("t") and calls == [(16, 8)]   # in this process
    monkeypatch.setattr(M.Matmul, "measured", {})                                    # a new process
    assert M.Matmul(torch.randn(16, 8)).forms == forms("t") and calls == [(16, 8)]   # read from disk
    assert (tmp_path / "matmul.json").exists()


def test_only_fp32_and_bf16_on_a_cpu_are_measured(monkeypatch):
    monkeypatch.setattr(M, "time_forms", lambda *a: pytest.fail("measured"))
    assert M.Matmul(torch.randn(16, 8, dtype=torch.float16)).forms == forms("linear")


@pytest.mark.skipif(not M.packable(), reason="no oneDNN in this torch build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_form_is_the_same_product(dtype):
    weight = torch.randn(48, 24).to(dtype)
    mm = M.Matmul(weight, forms("packed"))
    for rows in (1, 5, 70):
        x = torch.randn(1, rows, 24).to(dtype)
        torch.testing.assert_close(mm(x).float(), F.linear(x, weight).float(), rtol=2e-2, atol=2e-2)


def test_a_tuned_linear_follows_its_weight():
    """tune_linears: the module's forward goes through a Matmul, made again when the weight is replaced
    (a cast), and a Linear with a bias is left alone."""
    plain, biased = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 6)
    M.tune_linears(torch.nn.Sequential(plain, biased))
    assert isinstance(plain.forward, M.TunedForward) and not isinstance(biased.forward, M.TunedForward)
    first = plain.forward
    M.tune_linears(plain)                      # a module shared by two drafters is tuned once
    assert plain.forward is first
    x = torch.randn(3, 8)
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight))
    plain.weight = torch.nn.Parameter(torch.randn(6, 8))
    torch.testing.assert_close(plain(x), F.linear(x, plain.weight))


def test_one_matmul_per_weight_of_a_model():
    model = torch.nn.Linear(8, 4, bias=False)
    assert M.matmul_for(model, model.weight) is M.matmul_for(model, model.weight)
