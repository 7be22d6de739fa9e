"""Device maps: every method on a target dispatched by accelerate (its hooks on every module, as across GPUs)
equals ar; the drafter reads the target's embedding and lm_head on its own device, the target keeps its hooks."""
from __future__ import annotations

import pytest
import torch
from accelerate import dispatch_model

from treegen.assets import ASSETS, DEMO_TARGET, pair_drafter_for
from treegen.drafters import build_drafter
from treegen.drafters.precision import embedding_on, head_on
from treegen.engine.generate import GenerationConfig, generate
from treegen.loading import load_target, load_tokenizer

METHODS = ["ar", "pld", "dflash", "ddtree", "treeflash", "domino", "dartree", "d2sd"]
PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Stack:\n    def __init__(self):\n"]
NEW = 40


def demo_target():
    return load_target(str(DEMO_TARGET), dtype="fp32", device="cpu")[0]


def explicit_map(model, where: str = "cpu", heads: str = "cpu") -> dict[str, str]:
    """One entry per module: the decoder layers on `where`, the embedding and lm_head on `heads`."""
    layers = {f"model.layers.{i}": where for i in range(model.config.num_hidden_layers)}
    return {"model.embed_tokens": heads, "model.rotary_emb": where, **layers, "model.norm": where, "lm_head": heads}


def hooked(model, device_map: dict, tmp_path=None):
    """The model dispatched by accelerate with its hooks (on a CPU it attaches them only when forced)."""
    offload = {"offload_dir": str(tmp_path)} if tmp_path is not None else {}
    return dispatch_model(model, device_map=device_map, main_device="cpu", force_hooks=True, **offload)


def options(method: str) -> dict:
    return {"vp_drafter": str(ASSETS / "demo" / "vp-drafter")} if method == "d2sd" else {}


def run(model, method: str, prompt: torch.Tensor, extra: dict | None = None) -> list[int]:
    path = pair_drafter_for("demo", method) if method not in ("ar", "pld") else None
    drafter = build_drafter(method, model, str(path) if path else None, {**options(method), **(extra or {})})
    return [t for r in generate(model, drafter, prompt, GenerationConfig(NEW)) for t in r.tokens]


@pytest.fixture(scope="module")
def prompts():
    tokenizer = load_tokenizer(str(DEMO_TARGET))
    return [torch.tensor(tokenizer(text)["input_ids"]) for text in PROMPTS]


@pytest.fixture(scope="module")
def reference(prompts):
    model = demo_target()
    return [run(model, "ar", p) for p in prompts]


@pytest.mark.parametrize("method", METHODS)
def test_explicit_map_with_hooks_equals_ar(method, prompts, reference):
    target = demo_target()
    model = hooked(target, explicit_map(target))
    assert hasattr(model.lm_head, "_hf_hook") and hasattr(model.model.layers[0], "_hf_hook")
    assert [run(model, method, p) for p in prompts] == reference
    assert hasattr(model.lm_head, "_hf_hook") and hasattr(model.get_input_embeddings(), "_hf_hook")   # kept


@pytest.mark.parametrize("method", METHODS)
def test_device_map_auto_equals_ar(method, prompts, reference):
    """`--device-map auto` as the CLI loads it (on a CPU transformers places, attaching no hooks)."""
    model, _ = load_target(str(DEMO_TARGET), dtype="fp32", device="cpu", device_map="auto")
    assert [run(model, method, p) for p in prompts] == reference


@pytest.mark.parametrize("method", METHODS)
def test_offloaded_lm_head(method, prompts, reference, tmp_path):
    """The lm_head offloaded to disk (its weight on meta, loaded by its hook per call), as `auto` does with the
    last modules when the GPUs are full: the drafter reads a copy on its own device."""
    target = demo_target()
    target.config.tie_word_embeddings = False   # untied, so the map can put the lm_head elsewhere
    target.lm_head.weight = torch.nn.Parameter(target.lm_head.weight.detach().clone())
    model = hooked(target, {**explicit_map(target), "lm_head": "disk"}, tmp_path)
    assert model.lm_head.weight.device.type == "meta" and model.get_input_embeddings().weight.device.type == "cpu"
    assert [run(model, method, p) for p in prompts] == reference


@pytest.mark.parametrize("method", ["dflash", "ddtree", "d2sd"])
def test_offloaded_embedding_and_lm_head(method, prompts, reference, tmp_path):
    """The embedding offloaded too: the engine puts the prompt, and load_block the drafter, on the embedding's
    execution device (its hook's), not on meta."""
    target = demo_target()
    model = hooked(target, explicit_map(target, heads="disk"), tmp_path)
    assert model.lm_head.weight.device.type == "meta"
    assert [run(model, method, p) for p in prompts] == reference


def test_bf16_drafter_on_a_hooked_target(prompts, reference):
    """Another drafter dtype: copies of the target's embedding and lm_head in it, the target's untouched."""
    target = demo_target()
    model = hooked(target, explicit_map(target))
    before = model.lm_head.weight
    assert [run(model, "ddtree", p, {"dtype": "bf16"}) for p in prompts] == reference
    assert model.lm_head.weight is before and before.dtype == torch.float32


def test_weights_follow_the_drafters_device():
    """A drafter on another device than the target's embedding and lm_head (another GPU of a map: meta stands
    in for it here) reads copies there; on the same device in the same dtype it shares the target's."""
    target = demo_target()
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert embedding_on(embed, cpu, torch.float32) is embed
    shared = head_on(head, cpu, torch.float32)
    assert shared is not head and shared.weight is head.weight
    moved = head_on(head, meta, torch.bfloat16)
    assert moved.weight.device == meta and moved.weight.dtype == torch.bfloat16 and not moved.weight.requires_grad
    assert embedding_on(embed, meta, torch.float32).weight.device == meta
    biased = torch.nn.Linear(4, 3)
    assert head_on(biased, cpu, torch.float32) is biased
    with pytest.raises(ValueError, match="plain lm_head"):
        head_on(biased, meta, torch.float32)
