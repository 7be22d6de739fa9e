"""Peers: transformers' own `model.generate()` on the same loaded target, as a user would call it.

hf-generate   plain greedy / sampling
hf-pld        assisted generation with prompt lookup, generate(prompt_lookup_num_tokens=10)
hf-assisted   assisted generation with an autoregressive draft model (--hf-assistant PATH)
"""
from __future__ import annotations

import time

import torch

from ..engine.sampling import DEFAULT_MIN_P, DEFAULT_TOP_K, DEFAULT_TOP_P
from ..engine.stats import Stats
from ..loading import eos_ids
from .runner import Output

HF_PLD_TOKENS = 10      # the value transformers' documentation uses


class HFPeer:
    has_rounds = False
    chat = False

    def __init__(self, label: str, generator, extra: dict | None = None):
        self.label, self.generator, self.extra = label, generator, dict(extra or {})
        self.target = None
        self.eos = sorted(eos_ids(generator.model, generator.tokenizer))

    def encode(self, text: str) -> list[int]:
        from .runner import encode_for

        return encode_for(self.generator, text, self.chat)

    def run(self, ids, max_new_tokens, temperature, seed) -> Output:
        model = self.generator.model
        x = torch.tensor([ids], device=model.device)
        if seed is not None:
            torch.manual_seed(seed)  # transformers samples from the global generator
        sync(model.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                 eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None,
                                 **sampling_kwargs(temperature), **self.extra)
        sync(model.device)
        tokens = out[0, len(ids):].tolist()
        return Output(tokens, Stats(new_tokens=len(tokens), wall_time=time.perf_counter() - t0))


def sampling_kwargs(temperature: float) -> dict:
    """treegen's distribution in transformers' terms: every value set, so the model's generation_config
    (Qwen3 ships top_k=20, do_sample=True) cannot change what is compared."""
    if temperature == 0:
        return {"do_sample": False, "repetition_penalty": 1.0}
    return {"do_sample": True, "temperature": temperature, "top_k": DEFAULT_TOP_K, "top_p": DEFAULT_TOP_P,
            "min_p": DEFAULT_MIN_P, "repetition_penalty": 1.0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_peers(generator, target: str | None, assistant: str | None, load: dict) -> list[HFPeer]:
    """The peers on one loaded target; hf-assisted only when an assistant is given."""
    peers = [HFPeer("hf-generate", generator), HFPeer("hf-pld", generator, {"prompt_lookup_num_tokens": HF_PLD_TOKENS})]
    if assistant:
        peers.append(HFPeer("hf-assisted", generator, {"assistant_model": load_assistant(assistant, generator, load)}))
    for peer in peers:
        peer.target = target
    return peers


def load_assistant(path: str, generator, load: dict):
    """The draft model in the target's dtype and on its device, as assisted generation needs."""
    from ..loading import load_target

    model, _ = load_target(path, **{k: v for k, v in load.items() if k not in ("dtype",)},
                           dtype=dtype_name(generator.model.dtype))
    return model


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, "auto")
