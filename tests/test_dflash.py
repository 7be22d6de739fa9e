"""DFlash drafter: published checkpoint layout, context-cache correctness, and exactness of dflash/ddtree."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_qwen3

from treegen.drafters import build_drafter
from treegen.engine.generate import GenerationConfig, generate
from treegen.engine.sampling import Sampler
from treegen.models.checkpoint import CheckpointError, load_dflash, save_dflash
from treegen.models.dflash import ContextKV, DFlashConfig, DFlashDrafter

Z_LAB_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
        "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
        "post_attention_layernorm")}


def tiny_drafter_config(target, block_size: int = 8, layer_ids=(0, 1)) -> DFlashConfig:
    t = target.config
    return DFlashConfig(hidden_size=t.hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=t.hidden_size // 4, num_target_layers=t.num_hidden_layers,
                        target_layer_ids=tuple(layer_ids), mask_token_id=t.vocab_size - 1,
                        vocab_size=t.vocab_size, block_size=block_size)


@pytest.fixture(scope="module")
def target():
    return tiny_qwen3(vocab=64, seed=1)


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    torch.manual_seed(2)
    model = DFlashDrafter(tiny_drafter_config(target))
    for p in model.parameters():  # random norms too, so a wrong key mapping cannot hide
        p.data.normal_(0, 0.3 if p.dim() == 2 else 1.0)
    out = tmp_path_factory.mktemp("dflash")
    save_dflash(model, out)
    return out


def test_published_layout(drafter_dir):
    from safetensors import safe_open

    cfg = json.loads((drafter_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 2 and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"] == {"mask_token_id": 63, "target_layer_ids": [0, 1]}
    with safe_open(drafter_dir / "model.safetensors", "pt") as f:
        assert set(f.keys()) == Z_LAB_KEYS


def test_round_trip_identical(drafter_dir, tmp_path):
    a = load_dflash(str(drafter_dir))
    save_dflash(a, tmp_path)
    b = load_dflash(str(tmp_path))
    block, ctx = torch.randn(1, 8, 32), torch.randn(1, 5, 32)
    pos_b, pos_c = torch.arange(5, 13)[None], torch.arange(5)[None]
    assert torch.equal(a(block, pos_b, ctx, pos_c), b(block, pos_b, ctx, pos_c))


@pytest.mark.parametrize("capacity", [256, 4], ids=["one-buffer", "grown-four-times"])
def test_context_cache_equals_naive_recompute(drafter_dir, capacity, monkeypatch):
    """Cached context K/V across rounds == full attention over [context; block] from scratch, fp32; with a
    small first buffer it is grown (copied) on the way."""
    import treegen.engine.cache as cache_module

    monkeypatch.setattr(cache_module, "MIN_CAPACITY", capacity)
    model = load_dflash(str(drafter_dir))
    torch.manual_seed(0)
    feats = torch.randn(40, 2 * 32)
    cache, seen = ContextKV(2), 0
    with torch.no_grad():
        for new in (11, 1, 4, 7, 2):
            ctx = model.project_context(feats[:seen + new])
            block = torch.randn(1, 8, 32)
            pos_b = torch.arange(seen + new, seen + new + 8)[None]
            cached = model(block, pos_b, ctx[None, seen:], torch.arange(seen, seen + new)[None], cache)
            naive = model(block, pos_b, ctx[None], torch.arange(seen + new)[None])
            torch.testing.assert_close(cached, naive, atol=1e-5, rtol=1e-5)
            seen += new


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_greedy_exact(method, target, drafter_dir):
    drafter = build_drafter(method, target, str(drafter_dir))
    gen = torch.Generator().manual_seed(3)
    for i in range(20):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        prompt = torch.randint(0, 63, (n,), generator=gen)
        if i % 3 == 0:  # repeated spans: the target's greedy output loops, the drafter gets some right
            prompt = prompt.repeat(3)
        ref = target.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, prompt.numel():].tolist()
        out = [t for r in generate(target, drafter, prompt, GenerationConfig(24)) for t in r.tokens]
        assert out == ref, f"prompt {i}"


def test_ddtree_branches_and_respects_budget(target, drafter_dir):
    drafter = build_drafter("ddtree", target, str(drafter_dir), {"budget": 20})
    rounds = list(generate(target, drafter, torch.arange(10), GenerationConfig(16)))
    assert all(r.drafted <= 20 for r in rounds)
    assert any(r.drafted > r.depth for r in rounds[1:])  # more nodes than depth: a real tree


def test_ddtree_sampled_budget(target, drafter_dir):
    """sampled_budget sizes the rounds at T > 0 (budget the greedy ones) in one drafter; with deterministic
    drafts a seeded T > 0 output is plain decoding's under the same seed, as at T = 0 it is plain decoding's."""
    from treegen.drafters import MethodError

    drafter = build_drafter("ddtree", target, str(drafter_dir), {"budget": 1, "sampled_budget": 3, "sample": False})
    plain = build_drafter("ar", target)
    prompt = torch.arange(10)
    greedy = list(generate(target, drafter, prompt, GenerationConfig(16)))
    assert max(r.drafted for r in greedy[1:]) == 1
    cfg = GenerationConfig(16, Sampler(temperature=0.8), seed=7)
    sampled = list(generate(target, drafter, prompt, cfg))
    assert max(r.drafted for r in sampled[1:]) == 3
    assert [t for r in sampled for t in r.tokens] == [t for r in generate(target, plain, prompt, cfg) for t in r.tokens]
    assert [t for r in greedy for t in r.tokens] == [t for r in generate(target, plain, prompt, GenerationConfig(16))
                                                       for t in r.tokens]
    with pytest.raises(MethodError, match="'sampled_budget' needs a fixed budget"):
        build_drafter("ddtree", target, str(drafter_dir), {"budget": "auto", "sampled_budget": 3})


def test_ddtree_sampling_runs_seeded(target, drafter_dir):
    drafter = build_drafter("ddtree", target, str(drafter_dir))
    cfg = GenerationConfig(12, Sampler(temperature=1.0, top_k=20), seed=5)
    a = [t for r in generate(target, drafter, torch.arange(6), cfg) for t in r.tokens]
    b = [t for r in generate(target, drafter, torch.arange(6), cfg) for t in r.tokens]
    assert a == b and len(a) == 12


def test_refuses_drafter_for_another_target(drafter_dir):
    other = tiny_qwen3(vocab=64, hidden=48, seed=1)
    with pytest.raises(CheckpointError, match="hidden size 32 != target's 48"):
        build_drafter("dflash", other, str(drafter_dir))
    deeper_ids = tiny_qwen3(vocab=64, layers=1, seed=1)
    with pytest.raises(CheckpointError, match="reach past"):
        build_drafter("dflash", deeper_ids, str(drafter_dir))


def test_missing_drafter_folder(target, tmp_path):
    with pytest.raises(CheckpointError, match="no such drafter folder"):
        build_drafter("dflash", target, str(tmp_path / "nope"))
    with pytest.raises(CheckpointError, match="no config.json"):
        build_drafter("dflash", target, str(tmp_path))


@pytest.mark.parametrize("path", ["compiled", "lean", "drafting"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lean_drafting_forward_agrees_with_the_modules(dtype, path, monkeypatch):
    """Drafting (no autograd, one block on a CPU) takes a lean path: `compiled` (bf16 on AVX512-BF16: every
    layer in one compiled call, engine/fused.py), else `lean` (per layer: the new context's and the block's
    q/k/v one product, compiled norms, rotary embedding and attention, written straight into the cache) where
    the compiled kernels serve, else `drafting` per layer (q/k/v, context k/v and gate/up one product each,
    compiled norms and rotary embedding). Each computes what the modules compute (training's path, autograd
    on), up to rounding, round after round with the context cache."""
    from treegen.engine import fused, kernels

    if not kernels.ops_usable(torch.zeros(1, dtype=dtype), 16):
        pytest.skip("the compiled norms and rotary embedding did not build here")
    cfg = DFlashConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_target_layers=4, target_layer_ids=(1, 2),
                       mask_token_id=0, vocab_size=64, block_size=8)
    from treegen.models import dflash

    if path == "lean" and not kernels.usable(torch.zeros(1, dtype=dtype), 16):
        pytest.skip("the compiled attention did not build here")
    if path == "compiled" and not (dtype == torch.bfloat16 and fused.available()):
        pytest.skip("the compiled stack is bf16 on AVX512-BF16")
    if path == "drafting":
        monkeypatch.setattr(DFlashDrafter, "lean_usable", lambda self, block: False)
    if path != "compiled":
        monkeypatch.setattr(DFlashDrafter, "compiled_stack", lambda self, block: None)
    lean_calls = []
    owner = fused.FusedStack if path == "compiled" else dflash.Attention
    taken = getattr(owner, "__call__" if path == "compiled" else path)
    monkeypatch.setattr(owner, "__call__" if path == "compiled" else path,
                        lambda self, *a, **k: lean_calls.append(1) or taken(self, *a, **k))
    torch.manual_seed(3)
    model = DFlashDrafter(cfg).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    feats = torch.randn(30, 2 * 64, dtype=dtype)
    lean_cache, plain_cache, seen = ContextKV(2), ContextKV(2), 0
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.05}
    for new in (9, 1, 3, 0, 5):
        block = torch.randn(1, 8, 64, dtype=dtype)
        args = (block, torch.arange(seen + new, seen + new + 8)[None])
        ctx, ctx_pos = model.project_context(feats[seen:seen + new]).detach()[None], torch.arange(seen, seen + new)[None]
        with torch.no_grad():
            lean = model(*args, ctx, ctx_pos, lean_cache)
        with torch.enable_grad():
            plain = model(*args, ctx, ctx_pos, plain_cache).detach()
        torch.testing.assert_close(lean, plain, **tol)
        seen += new
    # every no-grad pass (compiled: one call a pass) or layer took the path
    assert len(lean_calls) == 5 * (1 if path == "compiled" else cfg.num_hidden_layers)
