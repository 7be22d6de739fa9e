"""The prompt's forward (the prefill), in chunks, keeping only what generation reads of it.

Made whole, a prompt's forward keeps a [prompt, vocabulary] logits matrix (a 32k-token prompt with a 152k
vocabulary: ~20 GB in fp32) and every layer's hidden states, where generation reads the last row's logits
and the few layers a drafter reads. Here the prompt goes through the target `chunk` rows at a time, each
chunk attending to the cache the earlier ones filled; the lm_head sees only each chunk's last row
(`logits_to_keep=1`, as transformers' own generate does) and the decoder records only the requested
layers. Peak memory then grows with the KV cache and the features, not with prompt x vocabulary.

Features are gathered on the device of the target's input embedding: the drafters are loaded there
(drafters/dflash.py), so with a device map across GPUs the layers they read are moved to them.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

DEFAULT_CHUNK = 2048   # prompt rows per forward: the attention and MLP work areas stay small beside the cache

# ids [1, n], positions [1, n], cache, hidden-state selection -> (last row's output [1, X], hidden states)
ChunkForward = Callable[[torch.Tensor, torch.Tensor, object, object], tuple[torch.Tensor, Sequence]]


def hidden_selection(layer_ids: Sequence[int]) -> list[int] | bool:
    """`output_hidden_states` naming the requested layers only (transformers records the others as None; a
    release without that selection records them all: the same features, more memory)."""
    return [i + 1 for i in layer_ids] if layer_ids else False


def features(hidden: Sequence, layer_ids: Sequence[int], device: torch.device) -> torch.Tensor | None:
    """[rows, len(layer_ids) * H]: the requested layers' outputs (batch row 0), side by side on `device`."""
    if not layer_ids:
        return None
    return torch.cat([hidden[i + 1][0].to(device) for i in layer_ids], dim=-1)


def input_device(model) -> torch.device:
    """Where the target's input embedding runs (accelerate: its hook's device, the weight may be offloaded);
    a model without transformers' accessors runs where it says it is."""
    try:
        embed = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return model.device
    device = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
    return embed.weight.device if device is None else torch.device(device)


def in_memory(model) -> bool:
    """Every weight in memory: none offloaded by accelerate (kept on meta, loaded by a hook per call)."""
    return all(p.device.type != "meta" for p in model.parameters())


def keeps_logits(model) -> bool:
    """The model's forward takes `logits_to_keep` (transformers' causal LMs do)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def model_rows(model) -> ChunkForward:
    """The whole model per chunk: the last row's logits [1, V] (the lm_head over that row only)."""
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}

    def forward(ids, positions, cache, hidden):
        out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                    output_hidden_states=hidden, **keep)
        return out.logits[0, -1:], out.hidden_states
    return forward


def decoder_rows(model) -> ChunkForward:
    """The decoder per chunk: the last row's final hidden state [1, H] (projected on demand: engine/target.py)."""
    decoder = model.get_decoder()

    def forward(ids, positions, cache, hidden):
        out = decoder(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                      output_hidden_states=hidden)
        return out.last_hidden_state[0, -1:], out.hidden_states
    return forward


def run_chunks(forward: ChunkForward, ids: torch.Tensor, positions: torch.Tensor, cache, layer_ids: Sequence[int],
               chunk: int = DEFAULT_CHUNK, device: torch.device | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids, positions [1, n] -> (the last row's output, the requested layers' features [n, L * H] or None)."""
    if chunk < 1:
        raise ValueError(f"the prefill chunk must be >= 1 rows, got {chunk}")
    n, hidden = ids.shape[1], hidden_selection(layer_ids)
    last, feats = None, None
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        last, states = forward(ids[:, rows], positions[:, rows], cache, hidden)
        part = features(states, layer_ids, device or last.device)
        del states   # this chunk's layers are copied out: let them go before the next chunk runs
        if part is not None:
            feats = part if rows.stop == n and start == 0 else place(feats, part, rows, n)
    return last, feats


def place(feats: torch.Tensor | None, part: torch.Tensor, rows: slice, n: int) -> torch.Tensor:
    """Write one chunk's features into the prompt's [n, W] table (made at the first chunk: no concatenation,
    which would hold the parts and the whole at once)."""
    if feats is None:
        feats = part.new_empty(n, part.shape[-1])
    feats[rows] = part
    return feats
