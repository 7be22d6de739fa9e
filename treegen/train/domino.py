"""Training Domino's correction head on a DFlash backbone (random-anchor blocks, as DFlash trains).

The GRU is teacher-forced on the true block tokens: draft i sees z_i and the GRU state after the anchor and
the true y1..yi. Two recipes:
- `head`: the shipped DFlash backbone frozen, only the head trained, loss = gamma-weighted CE(corrected);
- `joint`: backbone + head from the DFlash weights, loss = (1-lambda) CE(corrected) + lambda CE(base), lambda
  going 1 -> 0 linearly over the first `decay` fraction of training (the published recipe, warm-started).
embed_proj's last Linear starts at zero, so training starts from exactly the DFlash drafter.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..models.dflash import DFlashDrafter
from ..models.domino import DominoHead, HeadConfig, save_domino
from .common import LoopConfig, Schedule, fit, run_on, sharded
from .data import read_stream
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

RECIPES = ("head", "joint")


@dataclass(frozen=True)
class DominoTrainConfig(LoopConfig):
    recipe: str = "head"
    emb_dim: int = 128
    gru_hidden_dim: int = 256
    shift_label: bool = False
    pure_draft_prefix_len: int = 0
    decay: float = 0.3        # joint: the fraction of training over which lambda falls from 1 to 0
    soft: float = 0.0         # weight of KL(target || corrected) against the hard labels (as treeflash's)
    warmup: int = 20          # LR warm-up steps (CPU runs here are a few hundred steps long)

    def head(self) -> HeadConfig:
        return HeadConfig(self.emb_dim, self.gru_hidden_dim, self.shift_label, self.pure_draft_prefix_len)


def new_head(backbone: DFlashDrafter, cfg: DominoTrainConfig) -> DominoHead:
    c = backbone.config
    torch.manual_seed(cfg.seed)
    head = DominoHead(c.hidden_size, c.vocab_size, cfg.head())
    nn.init.zeros_(head.embed_proj[2].weight)  # corrected == base at step 0
    return head


def domino_loss(backbone, head: DominoHead, target, ids, anchors, gamma: float, lam: float, train_backbone: bool,
                features: torch.Tensor | None = None, soft: float = 0.0, final: torch.Tensor | None = None):
    """(loss, top-1 accuracy of the corrected logits per draft position). soft: the corrected law's KL to
    the target's own distribution, mixed in (from the cached last-layer states `final`, else a forward)."""
    hc, block = head.config, backbone.config.block_size
    drafts, first = hc.drafts(block), 0 if hc.shift_label else 1
    target_logits = None
    if soft and final is None:
        features, target_logits = target_pass(target, ids, backbone.config.target_layer_ids)
    with torch.set_grad_enabled(train_backbone):
        hidden, tokens = block_pass(backbone, target, ids, anchors, extra_labels=int(hc.shift_label),
                                    features=features)
    z, labels = hidden[:, :, first:first + drafts], tokens[..., 1:1 + drafts]      # [b, n, D, H], [b, n, D]
    base = target.get_output_embeddings()(z).float()
    prefix = target.get_input_embeddings()(tokens[..., :drafts])                     # anchor, y1 .. y_{D-1}
    corr = head.teacher_forced(z.flatten(0, 1), prefix.flatten(0, 1)).view(base.shape).float()
    keep = (torch.arange(drafts, device=ids.device) >= hc.pure_draft_prefix_len).float()[:, None]      # the pure prefix: base only
    corrected = base + corr * keep
    weights = position_weights(drafts, gamma, ids.device)
    loss = weighted_ce(corrected, labels, weights)
    if soft:   # label k is ids[anchor + 1 + k], predicted by the target's row anchor + k
        p = target_rows(target, anchors, drafts, final=final, logits=target_logits)
        loss = soft_mix(loss, corrected, p, weights, soft)
    loss = (1 - lam) * loss
    if lam > 0:
        loss = loss + lam * weighted_ce(base, labels, weights)
    return loss, (corrected.argmax(-1) == labels).float().mean(dim=(0, 1))


class Joint(nn.Module):
    """Backbone + head as one trainable module (the training checkpoint's state)."""

    def __init__(self, backbone: DFlashDrafter, head: DominoHead):
        super().__init__()
        self.backbone, self.head = backbone, head


def train_domino(target, backbone: DFlashDrafter, head: DominoHead, stream: torch.Tensor, out_dir: Path,
                 cfg: DominoTrainConfig, resume: bool = False):
    """Train on random windows; checkpoints to out_dir/train_state.pt, exports the published layout to out_dir."""
    if cfg.recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {cfg.recipe!r}")
    rt = run_on(cfg)
    freeze(target)
    backbone.to(rt.device), head.to(rt.device)
    joint = cfg.recipe == "joint"
    if not joint:
        freeze(backbone)
    model = Joint(backbone, head) if joint else head
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / "train_state.pt"
    hc, block = head.config, backbone.config.block_size
    gamma = cfg.gamma or GAMMA_BY_BLOCK.get(block, block / 2.3)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    sched = Schedule(cfg.lr, cfg.max_steps, cfg.max_seconds, warmup=cfg.warmup)
    clock = Clock(ckpt if resume else None)
    windows = training_windows(target, backbone.config, stream, cfg, rt=rt, final=cfg.soft > 0)

    def draw(g):
        batch = windows.draw(g)
        batch["anchors"] = sample_anchors(cfg.batch, cfg.seq_len, cfg.anchors, block + int(hc.shift_label), g,
                                          batch.pop("allowed"))
        return batch

    def loss(part):
        lam = max(0.0, 1 - sched.progress(*clock.tick()) / cfg.decay) if joint else 0.0
        value, acc = domino_loss(backbone, head, target, part["ids"], part["anchors"], gamma, lam, joint,
                                 windows.features(part), cfg.soft, windows.final(part) if cfg.soft else None)
        return value, f"acc@1 {acc[0]:.2f} acc@4 {acc[min(3, len(acc) - 1)]:.2f} lambda {lam:.2f}"

    step, elapsed = fit(model, opt, sched, gen, ckpt, sharded(rt, draw, loss, cfg.batch * cfg.anchors * block),
                        resume=resume, ckpt_every=cfg.ckpt_every, rt=rt,
                        on_checkpoint=exporter(lambda folder: save_domino(backbone, head, folder), out_dir, stream, target,
                                               cfg.draft_vocab))
    backbone.eval()
    return step, elapsed


class Clock:
    """Steps and seconds as fit() counts them (resumed from its checkpoint), for the lambda schedule."""

    def __init__(self, ckpt: Path | None):
        state = torch.load(ckpt, weights_only=False, map_location=lambda storage, _: storage) \
            if ckpt and ckpt.exists() else {}
        self.step, self.elapsed = state.get("step", 0), state.get("elapsed", 0.0)
        self.t0 = time.perf_counter()

    def tick(self) -> tuple[int, float]:
        now = (self.step, self.elapsed + time.perf_counter() - self.t0)
        self.step += 1
        return now





# method label -> (method, checkpoint: "dflash" or "domino", options)
COMPARED = {
    "dflash": ("dflash", "dflash", {}), "ddtree-64": ("ddtree", "dflash", {"budget": 64}),
    "domino": ("domino", "domino", {}), "dartree-64": ("dartree", "domino", {"budget": 64}),
    "dartree-64-fixed": ("dartree", "domino", {"budget": 64, "variant": "fixed"}),
    "dartree-16": ("dartree", "domino", {"budget": 16}),
}


def compare(target, dflash_path: str, domino_path: str, heldout: torch.Tensor, n: int = 16, log=print) -> dict:
    """Held-out acceptance length (T=0) through the real engine for every method, on the same prompts."""
    from ..drafters import build_drafter
    from .evaluate import acceptance, heldout_prompts

    prompts = heldout_prompts(heldout, n, 64)
    paths = {"dflash": dflash_path, "domino": domino_path}
    result = {}
    for label, (method, ckpt, options) in COMPARED.items():
        stats = acceptance(target, build_drafter(method, target, paths[ckpt], options), prompts, 64)
        result[label] = round(stats.mean_accepted_length, 3)
    log(f"held-out acceptance length (T=0, {n} prompts x 64 tokens): {result}")
    return result


def train_domino_pipeline(target_name: str, dflash_path: str, data: list[str], out: Path, cfg: DominoTrainConfig,
                          heldout: list[str] = (), resume: bool = False, log=print) -> dict:
    from ..loading import load_target
    from ..models.checkpoint import check_fits, load_dflash

    rt = run_on(cfg)
    log = rt.log(log)
    target, tok = load_target(target_name, dtype=rt.target_dtype, device=str(rt.device))
    backbone = load_dflash(dflash_path)
    check_fits(backbone.config, target)
    if cfg.pure_draft_prefix_len >= cfg.head().drafts(backbone.config.block_size):
        raise ValueError(f"--prefix-len {cfg.pure_draft_prefix_len} leaves no draft for the head to correct")
    head = new_head(backbone, cfg)
    stream = read_stream(list(data), tok)
    log(f"domino head ({cfg.recipe} recipe): {sum(p.numel() for p in head.parameters()) / 1e6:.2f}M parameters, "
        f"E={cfg.emb_dim} G={cfg.gru_hidden_dim} shift_label={cfg.shift_label}; {len(stream)} training tokens")
    steps, secs = train_domino(target, backbone, head, stream, out, cfg, resume=resume)
    log(f"trained {steps} steps in {secs / 60:.1f} min; checkpoint in {out}")
    return compare(target, dflash_path, str(out), read_stream(list(heldout), tok), log=log) \
        if heldout and rt.main else {}
