"""The drafter's precision (`dtype`, every method with a drafter): a bf16 drafter, or int8 drafting products, for
an fp32 target change what is drafted, never what is generated; the target keeps its own weights; a bad value
fails before loading."""
from __future__ import annotations

import pytest
import torch

from treegen.drafters import MethodError, build_drafter, check_options, get_method
from treegen.drafters.base import inverse_cdf
from treegen.drafters.precision import draft_dtype
from treegen.engine import kernels
from treegen.engine.drafter import DraftState
from treegen.engine.sampling import Sampler
from treegen.models.dflash import Rotary

DRAFTING = ["dflash", "ddtree", "treeflash", "domino", "dartree", "d2sd"]
PROMPTS = ["import numpy as np\nimport pandas as pd\n\n\ndef load(path):\n",
           "class Stack:\n    def __init__(self):\n", "    for key, value in sorted(items.items()):\n"]


@pytest.fixture(scope="module")
def demo():
    from treegen.api import Generator

    return Generator(target="demo", method="ar", dtype="fp32")   # the fp32 target the drafter precision reads


def drafting(demo, method: str, dtype: str):
    from treegen.assets import pair_drafter_for

    return demo.with_method(method, str(pair_drafter_for("demo", method)), {"dtype": dtype})


def blocks(drafter):
    return [drafter.first, drafter.vp] if hasattr(drafter, "vp") else [drafter.block]


def assert_greedy_output(demo, g) -> None:
    """g's T=0 output equals plain decoding of demo's target on every prompt, and it accepted drafts."""
    accepted = 0
    for prompt in PROMPTS:
        ref = demo.generate(prompt, max_new_tokens=32)
        out = g.generate(prompt, max_new_tokens=32)
        assert out.token_ids == ref.token_ids, (g.method, prompt)
        accepted += out.stats.accepted_drafts
    assert accepted > 0


@pytest.mark.parametrize("method", DRAFTING)
def test_bf16_drafter_keeps_greedy_output(demo, method):
    """Every drafting method with a bf16 drafter on the fp32 demo target: T=0 output equals plain decoding."""
    g = drafting(demo, method, "bf16")
    assert all(b.model.fc.weight.dtype == torch.bfloat16 and b.lm_head.weight.dtype == torch.bfloat16
               for b in blocks(g.draft_model))
    assert demo.model.get_output_embeddings().weight.dtype == torch.float32   # the target keeps its weights
    assert_greedy_output(demo, g)


@pytest.mark.parametrize("method", DRAFTING)
def test_int8_drafting_keeps_greedy_output(demo, method):
    """int8 drafting products (fp32 weights kept, each product quantized once): T=0 output equals plain decoding."""
    from treegen.engine.int8 import Int8Weight

    g = drafting(demo, method, "int8")
    for b in blocks(g.draft_model):
        assert b.form == "int8" and b.model.fc.weight.dtype == torch.float32
    assert_greedy_output(demo, g)
    for b in blocks(g.draft_model):   # the products drafting ran were the int8 ones
        assert isinstance(b.model.layers[0].mlp.gate_up.projections.parts[0], Int8Weight)


@pytest.mark.skipif(kernels.q4_library() is None, reason="4-bit block products need AVX512-VNNI")
@pytest.mark.parametrize("method", ["ddtree", "treeflash"])
def test_block_drafting_keeps_greedy_output(demo, method):
    """4-bit block drafting products (bf16 weights kept, the lm_head's rows as Q8_0): T=0 output equals plain
    decoding; `auto` picks them beside a q4 target."""
    from treegen.engine.q4 import Q4Weight, Q8Weight

    g = drafting(demo, method, "q4")
    for b in blocks(g.draft_model):
        assert b.form == "q4" and b.model.fc.weight.dtype == torch.bfloat16
        assert b.vocab is None or isinstance(b.vocab.product, Q8Weight)
    assert_greedy_output(demo, g)
    for b in blocks(g.draft_model):
        assert b.model.compiled_stack(torch.zeros(1, dtype=torch.bfloat16)).shape.q4 == 1
        # fc in 4-bit blocks: the per-call product where it ran, the compiled pass's layout where that served
        fc = b.model.fc_product.projections
        assert b.model.fc_product.form == "q4" and (fc is None or isinstance(fc.parts[0], Q4Weight))


def test_auto_drafts_in_blocks_beside_a_q4_target():
    from treegen.api import Generator

    if kernels.q4_library() is None:
        pytest.skip("4-bit block products need AVX512-VNNI")
    g = Generator(target="demo", method="ddtree", dtype="q4")
    assert draft_dtype("auto", g.model) == torch.uint8 and g.draft_model.block.form == "q4"


def test_d2sd_drafters_share_one_copy_of_the_targets_tables(demo):
    first, vp = blocks(drafting(demo, "d2sd", "bf16").draft_model)
    assert first.embed is vp.embed and first.lm_head is vp.lm_head


def test_tied_target_gets_one_drafting_copy(demo):
    block = drafting(demo, "ddtree", "bf16").draft_model.block
    assert demo.model.get_output_embeddings().weight is demo.model.get_input_embeddings().weight
    assert block.lm_head.weight is block.embed.weight


def test_auto_follows_the_cpu(demo, monkeypatch):
    """auto, for an fp32 target: 4-bit block products where the CPU has native bf16 and row_q4.c builds, bf16
    where only the first holds, else int8 products where their kernel built, else fp32; an explicit value
    always wins."""
    from treegen.drafters import precision
    from treegen.engine import kernels

    assert demo.model.get_input_embeddings().weight.dtype == torch.float32
    for native, blocks, built, expected in ((True, True, True, torch.uint8), (True, False, True, torch.bfloat16),
                                            (False, True, True, torch.int8), (False, False, False, torch.float32)):
        monkeypatch.setattr(precision, "native_bf16", lambda native=native: native)
        monkeypatch.setattr(kernels, "q4_library", lambda blocks=blocks: object() if blocks else None)
        monkeypatch.setattr(kernels, "int8_library", lambda built=built: object() if built else None)
        assert draft_dtype("auto", demo.model) == expected
        assert draft_dtype("fp32", demo.model) == torch.float32
        assert draft_dtype("bf16", demo.model) == torch.bfloat16
        assert draft_dtype("int8", demo.model) == torch.int8


@pytest.mark.parametrize("value", ["int4", "bfloat", 16])
def test_bad_dtype_is_refused_before_loading(value):
    with pytest.raises(MethodError, match="option 'dtype' must be"):
        check_options(get_method("ddtree"), {"dtype": value})
    with pytest.raises(MethodError, match="has no option 'dtype'"):
        check_options(get_method("pld"), {"dtype": "bf16"})   # no drafter, no drafter precision
    with pytest.raises(MethodError):
        build_drafter("ddtree", None, "unused", {"dtype": value})


def test_rotary_frequencies_stay_fp32():
    """module.to(bf16) must not round RoPE's frequencies (radians of phase by position 1000)."""
    rotary = Rotary(64, 1_000_000.0).to(torch.bfloat16)
    assert rotary.inv_freq.dtype == torch.float32
    cos, _ = rotary(torch.tensor([[1000]]), torch.bfloat16)
    assert cos.dtype == torch.bfloat16


def test_inverse_cdf_draws_follow_the_law():
    """The one-uniform draw of each row (the linked chain's rest draw): frequencies against the law, and it
    never returns a token of probability zero."""
    from test_sampling_distribution import chi_square

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, generator=g) * 2
    logits[:, 5:9] = -torch.inf
    state = DraftState(torch.tensor([1]), 4, Sampler(temperature=1.0), g)
    counts = torch.zeros(2, 40, dtype=torch.float64)
    for _ in range(4000):
        draws, total = inverse_cdf(logits, state)
        counts[[0, 1], draws] += 1
    torch.testing.assert_close(total, logits.logsumexp(-1))
    assert counts[:, 5:9].sum() == 0
    for row in range(2):
        stat, threshold = chi_square(counts[row], logits[row].softmax(-1).double())
        assert stat < threshold, (row, stat, threshold)
