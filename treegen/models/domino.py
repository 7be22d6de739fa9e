"""Domino's autoregressive correction head on a DFlash backbone, in the published layout.

A checkpoint is z-lab's DFlash keys (no prefix) plus `prefix_gru.weight_{ih,hh}_l0` (GRU H -> G, no bias)
and `embed_proj.{0,2}.weight` (Linear(H+G -> E) -> SiLU -> Linear(E -> V), no biases), with
`dflash_config.projector_type = "domino"`, `emb_dim`, `gru_hidden_dim`, `shift_label`, `pure_draft_prefix_len`.

Draft i (depth i+1) is scored from z_i, the backbone state that predicts it, and s_i, the GRU state after
reading the anchor and drafts 1..i: logits = lm_head(z_i) + embed_proj([z_i; s_i]) (base logits only for
i < pure_draft_prefix_len). shift_label false: z_i is block position i+1 (B-1 drafts); true: block
position i (B drafts, the anchor's own position predicts the first).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import (
    CheckpointError,
    check_fits,
    config_to_json,
    load_weights,
    read_config,
    read_state_dict,
    resolve_checkpoint,
)
from .dflash import DFlashConfig, DFlashDrafter


@dataclass(frozen=True)
class HeadConfig:
    emb_dim: int
    gru_hidden_dim: int
    shift_label: bool = False
    pure_draft_prefix_len: int = 0

    def drafts(self, block_size: int) -> int:
        """How many tokens one block drafts."""
        return block_size if self.shift_label else block_size - 1


class DominoHead(nn.Module):
    """The two published modules; parameter names are the checkpoint's keys."""

    def __init__(self, hidden_size: int, vocab_size: int, head: HeadConfig):
        super().__init__()
        self.config = head
        self.prefix_gru = nn.GRU(hidden_size, head.gru_hidden_dim, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + head.gru_hidden_dim, head.emb_dim, bias=False),
                                        nn.SiLU(), nn.Linear(head.emb_dim, vocab_size, bias=False))

    def teacher_forced(self, z: torch.Tensor, prefix_embeds: torch.Tensor) -> torch.Tensor:
        """z [N, D, H]; prefix_embeds [N, D, H] = embeddings of (anchor, y1 .. y_{D-1}) -> corrections [N, D, V]
        (row i sees the anchor and y1..yi, as at inference)."""
        states, _ = self.prefix_gru(prefix_embeds)
        return self.embed_proj(torch.cat([z, states.to(z.dtype)], dim=-1))


class HeadTables:
    """The head split for per-step and per-depth use (DARTree's layout): W_z, W_s, W2 rows, the GRU cell,
    and the GRU input projection of the whole vocabulary, computed once per loaded head."""

    def __init__(self, head: DominoHead, embed: torch.Tensor):
        hidden = embed.shape[1]
        fc1, fc2 = head.embed_proj[0].weight.detach(), head.embed_proj[2].weight.detach()
        self.w_z, self.w_s, self.w2 = fc1[:, :hidden].contiguous(), fc1[:, hidden:].contiguous(), fc2
        self.w_hh = head.prefix_gru.weight_hh_l0.detach()
        self.gru_in = embed.detach() @ head.prefix_gru.weight_ih_l0.detach().T   # [V, 3G]
        self.config = head.config

    def gru_step(self, tokens: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """One GRU cell step for a batch: tokens [n], h [n, G] -> [n, G] (PyTorch's r, z, n gates)."""
        gi, gh, g = self.gru_in[tokens], h @ self.w_hh.T, h.shape[-1]
        r, update = torch.sigmoid(gi[:, :2 * g] + gh[:, :2 * g]).chunk(2, dim=-1)  # both gates in one op
        candidate = torch.tanh(gi[:, 2 * g:] + r * gh[:, 2 * g:])
        return candidate + update * (h - candidate)  # = (1 - update) * candidate + update * h

    def root_state(self, anchor: torch.Tensor) -> torch.Tensor:
        """[1, G]: the GRU from zero after reading the anchor."""
        zero = torch.zeros(1, self.w_hh.shape[1], dtype=self.w_hh.dtype, device=self.w_hh.device)
        return self.gru_step(anchor.view(1), zero)

    def hidden_part(self, z_proj: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """SiLU(W_z z + W_s s) for a batch of GRU states; z_proj = z @ W_z^T is computed once."""
        return F.silu(z_proj + h @ self.w_s.T)


def head_config_from_json(raw: dict, source: str) -> HeadConfig:
    dflash = raw.get("dflash_config") or {}
    kind = dflash.get("projector_type")
    if kind != "domino":
        raise CheckpointError(f"{source}: a DFlash checkpoint without a Domino head (dflash_config.projector_type "
                              f"is {kind!r}, not 'domino'); use it with dflash or ddtree, or give a Domino checkpoint")
    sizes = {k: dflash.get(k, raw.get(k)) for k in ("emb_dim", "gru_hidden_dim")}
    missing = [k for k, v in sizes.items() if not isinstance(v, int) or v < 1]
    if missing:
        raise CheckpointError(f"{source}: Domino config needs a positive integer {missing[0]}")
    prefix = dflash.get("pure_draft_prefix_len", 0) or 0
    return HeadConfig(sizes["emb_dim"], sizes["gru_hidden_dim"], bool(dflash.get("shift_label", False)), int(prefix))


def load_domino(name: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """(backbone, head) from a folder or hub id in the published Domino layout."""
    folder = resolve_checkpoint(name)
    config = read_config(folder)
    head_cfg = head_config_from_json(config.extra, str(folder / "config.json"))
    if config.vocab_size is None:
        raise CheckpointError(f"{folder}/config.json: vocab_size is missing (the head's output size)")
    if head_cfg.pure_draft_prefix_len >= head_cfg.drafts(config.block_size):
        raise CheckpointError(f"{folder}/config.json: pure_draft_prefix_len {head_cfg.pure_draft_prefix_len} "
                              f"leaves no draft to correct in a block of {config.block_size}")
    backbone, head = DFlashDrafter(config), DominoHead(config.hidden_size, config.vocab_size, head_cfg)
    state = read_state_dict(folder)
    load_weights(backbone, state, folder)
    load_weights(head, state, folder)
    return backbone.to(device=device, dtype=dtype).eval(), head.to(device=device, dtype=dtype).eval()


def save_domino(backbone: DFlashDrafter, head: DominoHead, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    merged = {**backbone.state_dict(), **head.state_dict()}
    state = {k: (v.to(dtype) if dtype else v).detach().contiguous() for k, v in merged.items()}
    save_file(state, out_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = domino_config_json(backbone.config, head.config)
    cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def domino_config_json(config: DFlashConfig, head: HeadConfig) -> dict:
    cfg = config_to_json(config)
    sizes = {"emb_dim": head.emb_dim, "gru_hidden_dim": head.gru_hidden_dim}
    cfg.update(sizes)  # the published config repeats the sizes at the top level
    cfg["dflash_config"] = {**cfg["dflash_config"], "projector_type": "domino", **sizes,
                            "shift_label": head.shift_label, "pure_draft_prefix_len": head.pure_draft_prefix_len}
    return cfg


def check_domino_fits(backbone: DFlashDrafter, head: DominoHead, target) -> None:
    check_fits(backbone.config, target)
    rows = target.get_output_embeddings().out_features   # a Linear, or treegen's Int8Linear
    out = head.embed_proj[2].weight.shape[0]
    if out != rows:
        raise CheckpointError(f"Domino head does not fit the target: embed_proj scores {out} tokens, "
                              f"the target's lm_head {rows}")
