"""One target forward over [anchor; tree]: the decoder over every row, the lm_head only where it is read.

On a GPU the lm_head over all n+1 rows is one small GEMM, so every row's logits are made at once and the
verify walk reads them with one host sync. On a CPU the lm_head is the widest matrix of a small target
(vocabulary x hidden: 40% of a 65-row step of the demo target), and the walk reads only the rows on its
path (accepted drafts + 1), so those rows are projected one at a time as the walk reaches them.
"""
from __future__ import annotations

import time

import torch

# config fields of architectures whose logits are not just lm_head(hidden): those keep the model's forward
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class Logits:
    """The target's logits of a forward's rows, made on demand (lazy) or all at once."""

    def __init__(self, hidden: torch.Tensor | None, lm_head=None, full: torch.Tensor | None = None):
        self.hidden, self.lm_head, self.full = hidden, lm_head, full
        self.made: dict[int, torch.Tensor] = {}
        self.seconds = 0.0   # spent projecting rows on demand: target compute, though the walk asks for it

    @property
    def eager(self) -> bool:
        return self.full is not None

    def __len__(self) -> int:
        return len(self.full) if self.full is not None else len(self.hidden)

    def row(self, i: int) -> torch.Tensor:
        """[1, V] logits of row i (negative counts from the end)."""
        i = i % len(self)
        if self.full is not None:
            return self.full[i:i + 1]
        if i not in self.made:
            t0 = time.perf_counter()
            with torch.inference_mode():  # also when read outside the round that made the hidden states
                self.made[i] = self.lm_head(self.hidden[i:i + 1])
            self.seconds += time.perf_counter() - t0
        return self.made[i]


def lazy_logits_supported(model) -> bool:
    """A transformers causal LM whose logits are lm_head(decoder output), nothing more."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        return False
    try:
        return model.get_output_embeddings() is not None and model.get_decoder() is not None
    except (AttributeError, NotImplementedError):
        return False


class TargetStep:
    """Runs the target over rows with a cache; returns their Logits and the requested layers' features."""

    def __init__(self, model, layer_ids: tuple[int, ...] = (), lazy: bool | None = None):
        self.model, self.layer_ids = model, tuple(layer_ids)
        if lazy is None:
            lazy = model.device.type == "cpu"
        self.lazy = lazy and lazy_logits_supported(model)

    def __call__(self, ids, positions, mask, cache) -> tuple[Logits, torch.Tensor | None]:
        args = {"input_ids": ids, "position_ids": positions, "attention_mask": mask, "cache": cache,
                "use_cache": True, "output_hidden_states": bool(self.layer_ids)}
        if self.lazy:
            out = self.model.get_decoder()(**args)
            logits = Logits(out.last_hidden_state[0], self.model.get_output_embeddings())
        else:
            out = self.model(**args)
            logits = Logits(None, full=out.logits[0])
        feats = None
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return logits, feats
