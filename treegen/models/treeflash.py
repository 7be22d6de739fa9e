"""TreeFlash (ETH-DISCO): a DFlash backbone plus a SwiGLU "AR approximation" that conditions each block
position on the token chosen before it, in the published layout (peerrh/treeflash-qwen3-4b, -8b).

Layout: config.json is a DFlash config plus `treeflash_config: {ar_approximation: "swiglu",
candidate_tokens: m}`; safetensors keys are the backbone's under `model.` and `ar_approximation.{ug,d,norm}`.
The module names below are those keys, so state_dict() is the published layout as is.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.matmul import FLOAT, product
from .checkpoint import CheckpointError, check_fits, config_to_json, read_config, read_state_dict, resolve_checkpoint
from .dflash import DFlashConfig, DFlashDrafter, RMSNorm

DEFAULT_CANDIDATES = 16


class SwiGLUApproximation(nn.Module):
    """delta(e_prev, h) = d(silu(g) * u), [u, g] = ug([norm(e_prev); final_norm(h)]); d starts at zero, so an
    untrained head leaves the drafter's marginals unchanged."""

    def __init__(self, hidden: int, intermediate: int, eps: float = 1e-6):
        super().__init__()
        self.ug = nn.Linear(2 * hidden, 2 * intermediate)
        self.d = nn.Linear(intermediate, hidden, bias=False)
        self.norm = RMSNorm(hidden, eps)
        self.form = FLOAT   # the drafting products' form (engine/matmul.product), set by the drafter's cast
        nn.init.zeros_(self.d.weight)

    def forward(self, prev_embed: torch.Tensor, normed_hidden: torch.Tensor) -> torch.Tensor:
        return self.combine(self.token_part(prev_embed), self.state_part(normed_hidden))

    # ug is linear in [norm(e_prev); h], so its two halves can be computed apart: the token half once per
    # token (a table over the vocabulary when that is small), the state half once per block position
    def token_part(self, prev_embed: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(self.norm(prev_embed), self.ug.weight[:, :self.norm.weight.shape[0]])
        return self.halves()[0](self.norm(prev_embed))

    def state_part(self, normed_hidden: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            return F.linear(normed_hidden, self.ug.weight[:, self.norm.weight.shape[0]:], self.ug.bias)
        return self.halves()[1](normed_hidden) + self.ug.bias

    def halves(self):
        """Drafting: ug's token and state halves as products of their own in the drafting form (a column slice
        of ug's weight is copied by every F.linear), made again when the weight or the form changes."""
        w = self.ug.weight
        key = (w.data_ptr(), w._version, w.dtype, self.form)
        if self.__dict__.get("_halves_key") != key:
            h = self.norm.weight.shape[0]
            self._halves = tuple(product(half.detach().contiguous(), self.form) for half in (w[:, :h], w[:, h:]))
            self._halves_key = key
        return self._halves

    def combine(self, token_part: torch.Tensor, state_part: torch.Tensor) -> torch.Tensor:
        u, g = (token_part + state_part).chunk(2, dim=-1)
        return self.d(F.silu(g) * u)


class TreeFlashModel(nn.Module):
    """The backbone (`model`) and the head (`ar_approximation`); scores with the target's lm_head."""

    def __init__(self, config: DFlashConfig, candidate_tokens: int = DEFAULT_CANDIDATES):
        super().__init__()
        self.config, self.candidate_tokens = config, candidate_tokens
        self.model = DFlashDrafter(config)
        self.ar_approximation = SwiGLUApproximation(config.hidden_size, config.intermediate_size,
                                                    config.rms_norm_eps)

    def corrected(self, hidden: torch.Tensor, prev_embed: torch.Tensor) -> torch.Tensor:
        """Pre-norm drafter states [.., H] and the embeddings of the tokens before them [.., H] -> the final
        normed states whose lm_head rows are the conditional logits."""
        final_norm = self.model.norm
        return final_norm(hidden + self.ar_approximation(prev_embed, final_norm(hidden)))


def treeflash_config(raw: dict, source: str) -> int:
    """The candidate count of a TreeFlash config.json; a config without the head fails with one line."""
    tf = raw.get("treeflash_config")
    if not isinstance(tf, dict):
        raise CheckpointError(f"{source}: no treeflash_config, so it is not a TreeFlash checkpoint "
                              f"(a DFlash drafter runs with --method ddtree)")
    kind = tf.get("ar_approximation")
    if kind != "swiglu":
        raise CheckpointError(f"{source}: treeflash_config.ar_approximation is {kind!r}; only 'swiglu' is supported")
    return int(tf.get("candidate_tokens", DEFAULT_CANDIDATES))


def load_treeflash(name: str, dtype: torch.dtype = torch.float32, device="cpu") -> TreeFlashModel:
    folder = resolve_checkpoint(name)
    config = read_config(folder)
    model = TreeFlashModel(config, treeflash_config(config.extra, str(folder / "config.json")))
    state, own = read_state_dict(folder), model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        head = [k for k in missing if k.startswith("ar_approximation.")]
        raise CheckpointError(f"{folder}: weights missing for {len(missing)} tensors, e.g. {(head or missing)[0]}"
                              + (" (TreeFlash keeps the backbone under model.)" if "fc.weight" in state else ""))
    bad = [k for k in own if state[k].shape != own[k].shape]
    if bad:
        raise CheckpointError(f"{folder}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, "
                              f"config says {tuple(own[bad[0]].shape)}")
    model.load_state_dict({k: state[k] for k in own})
    return model.to(device=device, dtype=dtype).eval()


def save_treeflash(model: TreeFlashModel, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in model.state_dict().items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = config_to_json(model.config)
    cfg["architectures"] = ["TreeFlashDraftModel"]
    cfg["treeflash_config"] = {"ar_approximation": "swiglu", "candidate_tokens": model.candidate_tokens}
    cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def from_dflash(backbone: DFlashDrafter, candidate_tokens: int = DEFAULT_CANDIDATES) -> TreeFlashModel:
    """A TreeFlash model around a trained DFlash drafter, with a fresh (zero-output) head."""
    model = TreeFlashModel(replace(backbone.config, extra={**backbone.config.extra}), candidate_tokens)
    model.model.load_state_dict(backbone.state_dict())
    return model.to(next(backbone.parameters()).dtype)


def fits(model: TreeFlashModel, target) -> None:
    """The backbone's fit checks (hidden size, layers, mask id, vocabulary), under a TreeFlash name."""
    try:
        check_fits(model.config, target)
    except CheckpointError as err:
        raise CheckpointError(str(err).replace("drafter does not fit", "TreeFlash drafter does not fit")) from None


__all__ = [
    "SwiGLUApproximation",
    "TreeFlashModel",
    "fits",
    "from_dflash",
    "load_treeflash",
    "save_treeflash",
    "treeflash_config",
]
