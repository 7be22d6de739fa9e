"""Weight-only int8 (`--dtype int8`, engine/int8.py, engine/row_int8.c): the compiled product against a float
reference, its rows' bits independent of the rows beside them and of the thread count, every method exact
against plain decoding of the int8 target, and the option's bad combinations refused before loading."""
from __future__ import annotations

import pytest
import torch

from treegen.engine import forms, int8, kernels
from treegen.engine.int8 import Int8Linear, Int8Weight

pytestmark = pytest.mark.skipif(kernels.int8_library() is None, reason="no C compiler: the int8 product is torch's")


def reference(weight: Int8Weight, x: torch.Tensor) -> torch.Tensor:
    return x.double() @ (weight.plain().double() * weight.scale.double()[:, None]).T


@pytest.mark.parametrize("n,k", [(96, 64), (960, 576), (64, 1536), (32, 8)])
def test_the_product_is_the_dequantized_weights_and_row_invariant(n, k):
    gen = torch.Generator().manual_seed(n + k)
    weight = Int8Weight.quantize(torch.randn(n, k, generator=gen))
    assert weight.packed
    x = torch.randn(64, k, generator=gen)
    out = weight(x)
    torch.testing.assert_close(out.double(), reference(weight, x), rtol=1e-5, atol=1e-4)
    alone = torch.cat([weight(x[i:i + 1]) for i in range(len(x))])
    for rows in range(1, 65):
        assert torch.equal(weight(x[:rows]), alone[:rows]), f"{rows} rows"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(weight(x), out)
    finally:
        torch.set_num_threads(threads)


def test_quantize_keeps_each_output_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=gen)
    w[3] = 0.0   # a zero row: scale 1, all zeros
    q = Int8Weight.quantize(w)
    step = q.scale[:, None]
    assert ((q.dequantized(torch.float32) - w).abs() <= step / 2 + 1e-7).all()
    assert q.plain()[3].abs().sum() == 0


def test_stacked_weights_give_each_output_its_own_bits():
    gen = torch.Generator().manual_seed(1)
    parts = [Int8Weight.quantize(torch.randn(n, 48, generator=gen)) for n in (64, 32, 32)]
    x = torch.randn(5, 48, generator=gen)
    together = Int8Weight.stack(*parts)(x)
    assert torch.equal(together, torch.cat([p(x) for p in parts], dim=-1))


def test_bf16_inputs_and_the_unpacked_path_agree_with_the_kernel():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 40, generator=gen)
    packed = Int8Weight.quantize(w)
    plain = Int8Weight(packed.plain(), packed.scale, packed=False)   # an accelerator's form: F.linear on q
    x = torch.randn(3, 40, generator=gen)
    torch.testing.assert_close(plain(x), packed(x), rtol=1e-5, atol=1e-5)
    assert packed(x.bfloat16()).dtype == torch.bfloat16


def test_a_model_wide_cast_keeps_the_int8_products_bits():
    """Int8Linear holds one copy of its tensors, and model.to(dtype) leaves its int8 values and fp32 scales as
    they are (the float parts of the model are cast; the weights these products stand for are not)."""
    gen = torch.Generator().manual_seed(3)
    layer = Int8Linear(Int8Weight.quantize(torch.randn(64, 40, generator=gen)))
    x = torch.randn(3, 40, generator=gen)
    before = layer(x)
    layer.to(torch.bfloat16).to("cpu")
    assert layer.int8.scale.dtype == torch.float32 and layer.int8.q.dtype == torch.int8
    assert torch.equal(layer(x), before)
    assert {name for name, _ in layer.named_buffers()} == {"q", "scale_bits"}


def test_quantize_replaces_every_bias_free_linear():
    from conftest import tiny_qwen3

    model = tiny_qwen3(hidden=64)
    assert not int8.is_int8(model)
    count = int8.quantize(model)
    assert count == 2 * 7 + 1 and int8.is_int8(model) and forms.weight_form(model) == "int8"
    assert type(model.get_output_embeddings()) is Int8Linear
    assert type(model.get_input_embeddings()) is torch.nn.Embedding   # the embedding keeps its float rows
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]))   # transformers' own forward runs on the int8 layers


@pytest.fixture(scope="module")
def demo_int8():
    from treegen.api import Generator

    return Generator(target="demo", method="ar", dtype="int8")


METHODS = ["pld", "dflash", "ddtree", "treeflash", "domino", "dartree", "d2sd"]


def equals_plain_decoding(plain, method: str) -> None:
    """`method` on the demo pair gives plain decoding's tokens with the same loaded target (plain: an ar
    Generator)."""
    from treegen.assets import pair_drafter_for

    drafter = None if method == "pld" else str(pair_drafter_for("demo", method))
    g = plain.with_method(method, drafter, {"budget": "auto"} if method in ("ddtree", "treeflash") else {})
    for prompt in ("import os\n\n\ndef walk(top):\n", "class Queue:\n    def __init__(self):\n"):
        ref = plain.generate(prompt, max_new_tokens=40)
        out = g.generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids, (method, prompt)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_plain_decoding_of_the_int8_target(demo_int8, method):
    assert demo_int8.weights == "int8"
    equals_plain_decoding(demo_int8, method)


def refused_beside_bitsandbytes(dtype: str, flag: str) -> None:
    """`--dtype DTYPE` with bitsandbytes' FLAG: a usage error that names the clash."""
    from click.testing import CliRunner

    from treegen.cli import cli

    result = CliRunner().invoke(cli, ["complete", "-", "--dtype", dtype, flag], input="x")
    assert result.exit_code == 2
    assert f"--dtype {dtype} quantizes the weights itself" in result.output


def test_int8_with_bitsandbytes_is_a_usage_error():
    refused_beside_bitsandbytes("int8", "--load-in-8bit")


def test_auto_loads_int8_only_on_a_cpu_without_native_bf16(monkeypatch):
    from treegen import loading

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native, expected in ((True, False), (False, True)):
        monkeypatch.setattr(loading, "native_bf16", lambda native=native: native)
        assert loading.int8_weights("auto", cpu) is expected
        assert loading.int8_weights("fp32", cpu) is False and loading.int8_weights("bf16", cpu) is False
        assert loading.int8_weights("int8", cpu) is True
        assert loading.int8_weights("auto", cuda) is False   # a GPU keeps its float weights
    monkeypatch.setattr(kernels, "int8_library", lambda: None)   # no compiler: fp32, not a slow int8
    assert loading.int8_weights("auto", cpu) is False
