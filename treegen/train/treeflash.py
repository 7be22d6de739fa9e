"""Training TreeFlash's SwiGLU head on a frozen DFlash backbone (the recipe is not published; ours below).

For random anchors a (as in DFlash training) the frozen backbone gives the pre-norm state h_k at block
position k = 1..B-1. The head is teacher-forced on the TRUE previous token: it sees e(x_{a+k-1}) and h_k
and predicts x_{a+k}, which is exactly the conditional the tree asks of it when the previous draft was
right (the only case in which its children can be accepted). Loss: DFlash's position-weighted cross
entropy, optionally mixed with the target's own distribution at that position (`soft`, a KL term).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..models.treeflash import TreeFlashModel, save_treeflash
from .common import LoopConfig, Schedule, fit, run_on, sharded
from .dflash import (
    GAMMA_BY_BLOCK,
    block_pass,
    exporter,
    freeze,
    position_weights,
    sample_anchors,
    soft_mix,
    target_pass,
    target_rows,
    weighted_ce,
)
from .features import training_windows


@dataclass(frozen=True)
class TreeFlashTrainConfig(LoopConfig):
    soft: float = 0.0             # weight of KL(target || head) against the hard labels
    ckpt_every: int = 25


def treeflash_loss(model: TreeFlashModel, target, ids: torch.Tensor, anchors: torch.Tensor, gamma: float,
                   soft: float = 0.0, features: torch.Tensor | None = None, final: torch.Tensor | None = None):
    """Position-weighted CE of the head's conditional at block positions 1..B-1, previous token teacher-forced.
    features: the target's cached context features; final: its cached last-layer states (a soft target
    without them needs the target's logits: a forward all the same)."""
    backbone = model.model
    target_logits = None
    if features is None or (soft and final is None):
        features, target_logits = target_pass(target, ids, backbone.config.target_layer_ids)
    with torch.no_grad():  # the backbone is frozen: only the head learns
        hidden, tokens = block_pass(backbone, target, ids, anchors, normed=False, features=features)
    prev = target.get_input_embeddings()(tokens[..., :-1])
    logits = target.get_output_embeddings()(model.corrected(hidden[:, :, 1:], prev)).float()
    weights = position_weights(tokens.shape[-1] - 1, gamma, ids.device)
    loss = weighted_ce(logits, tokens[..., 1:], weights)
    acc = (logits.argmax(-1) == tokens[..., 1:]).float().flatten(0, -2).mean(dim=0)
    if soft:   # the row of x_{a+k-1} predicts x_{a+k}
        p = target_rows(target, anchors, logits.shape[2], final=final, logits=target_logits)
        loss = soft_mix(loss, logits, p, weights, soft)
    return loss, acc


def train_treeflash(target, model: TreeFlashModel, stream: torch.Tensor, out_dir: Path, cfg: TreeFlashTrainConfig,
                    resume: bool = False, save_dtype: torch.dtype | None = None):
    """Train the head on random windows; checkpoints to out_dir/train_state.pt, exports the published layout."""
    rt = run_on(cfg)
    freeze(target)
    model.to(rt.device)
    for p in model.model.parameters():
        p.requires_grad_(False)
    model.model.eval()
    head = model.ar_approximation
    out_dir.mkdir(parents=True, exist_ok=True)
    block = model.config.block_size
    gamma = cfg.gamma or GAMMA_BY_BLOCK.get(block, block / 2.3)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)

    windows = training_windows(target, model.model.config, stream, cfg, rt=rt, final=cfg.soft > 0)

    def draw(g):
        batch = windows.draw(g)
        batch["anchors"] = sample_anchors(cfg.batch, cfg.seq_len, cfg.anchors, block, g, batch.pop("allowed"))
        return batch

    def loss(part):
        value, acc = treeflash_loss(model, target, part["ids"], part["anchors"], gamma, cfg.soft,
                                    windows.features(part), windows.final(part) if cfg.soft else None)
        return value, f"acc@1 {acc[0]:.2f} acc@4 {acc[min(3, len(acc) - 1)]:.2f}"

    sched = Schedule(cfg.lr, cfg.max_steps, cfg.max_seconds, warmup=25)
    return fit(head, opt, sched, gen, out_dir / "train_state.pt", sharded(rt, draw, loss, cfg.batch * cfg.anchors * block),
               resume=resume, ckpt_every=cfg.ckpt_every, rt=rt,
               on_checkpoint=exporter(lambda folder: save_treeflash(model, folder, save_dtype), out_dir, stream, target,
                                          cfg.draft_vocab))
