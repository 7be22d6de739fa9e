"""Training D2SD's variable-prefix drafter (SpecForge PR #592's recipe), starting from a DFlash drafter.

The DFlash loss with one change per block: its first i positions hold real tokens (the anchor and i-1 more),
i drawn from [2, B-1] with Pr(i) proportional to beta^i (beta 0.9: short prefixes, where rejections happen,
dominate); the rest are MASK, and the loss is on positions k >= i weighted exp(-(k - i)/gamma), gamma 7.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..assets import shipped
from ..models.dflash import DFlashDrafter
from ..models.vp_drafter import mark_variable_prefix, save_vp_drafter
from .common import LoopConfig, Schedule, fit, run_on, sharded
from .data import read_stream
from .dflash import block_loss, freeze, sample_anchors
from .features import training_windows


@dataclass(frozen=True)
class VPTrainConfig(LoopConfig):
    lr: float = 5e-4           # a fine-tune of a trained drafter (the reference's 6e-4 starts from scratch)
    beta: float = 0.9
    gamma: float = 7.0
    ckpt_every: int = 25
    warmup: int = 30


def visible_law(block: int, beta: float) -> torch.Tensor:
    """[B] probabilities of a visible prefix of i tokens: beta^i on 2..B-1, zero elsewhere."""
    i = torch.arange(block, dtype=torch.float64)
    law = torch.where((i >= 2) & (i <= block - 1), beta ** i, 0.0)
    return (law / law.sum()).float()


def sample_visible(batch: int, n: int, block: int, beta: float, gen: torch.Generator) -> torch.Tensor:
    """[batch, n] visible prefix lengths, one per block."""
    return torch.multinomial(visible_law(block, beta), batch * n, replacement=True, generator=gen).view(batch, n)


def train_vp_drafter(target, drafter: DFlashDrafter, stream: torch.Tensor, out_dir: Path, cfg: VPTrainConfig,
                     resume: bool = False) -> tuple[int, float]:
    """Fine-tune `drafter` into a VP-drafter; checkpoints to out_dir/train_state.pt, exports to out_dir."""
    if drafter.config.block_size < 4:
        raise ValueError(f"a VP-drafter needs a block of at least 4 positions, got {drafter.config.block_size}")
    rt = run_on(cfg)
    freeze(target)
    mark_variable_prefix(drafter)
    drafter.to(rt.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    block = drafter.config.block_size
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)
    windows = training_windows(target, drafter.config, stream, cfg, rt=rt)

    def draw(g):
        batch = windows.draw(g)
        batch["anchors"] = sample_anchors(cfg.batch, cfg.seq_len, cfg.anchors, block, g, batch.pop("allowed"))
        batch["visible"] = sample_visible(cfg.batch, batch["anchors"].shape[1], block, cfg.beta, g)
        return batch

    def loss(part):
        value, acc = block_loss(drafter, target, part["ids"], part["anchors"], part["visible"], cfg.gamma,
                                features=windows.features(part))
        return value, f"acc@+0 {acc[0]:.2f} acc@+3 {acc[min(3, len(acc) - 1)]:.2f}"

    sched = Schedule(cfg.lr, cfg.max_steps, cfg.max_seconds, warmup=cfg.warmup)
    return fit(drafter, opt, sched, gen, out_dir / "train_state.pt", sharded(rt, draw, loss, cfg.batch * cfg.anchors * block),
               resume=resume, ckpt_every=cfg.ckpt_every, on_checkpoint=lambda: save_vp_drafter(drafter, out_dir), rt=rt)


def heldout_acceptance(target, first: str, vp_drafters: dict[str, str], stream: torch.Tensor, n: int,
                       new_tokens: int = 64, log=print) -> dict:
    """tau through the real engine at T=0 on n held-out prompts: dflash, then d2sd (K=4, B2=B) per VP-drafter."""
    from ..drafters import build_drafter
    from .evaluate import acceptance, heldout_prompts

    prompts = heldout_prompts(stream, n, 64)
    runs = {"dflash": ("dflash", {})} | {f"d2sd[{k}]": ("d2sd", {"vp_drafter": v}) for k, v in vp_drafters.items()}
    out = {}
    for label, (method, options) in runs.items():
        stats = acceptance(target, build_drafter(method, target, first, options), prompts, new_tokens)
        out[label] = round(stats.mean_accepted_length, 3)
        log(f"held-out T=0 acceptance length, {label}: {out[label]} ({n} prompts x {new_tokens} tokens)")
    return out


def vp_pipeline(target_name: str, init: str, data: list[str], out: Path, cfg: VPTrainConfig, heldout: list[str],
                n_prompts: int, resume: bool, log=print) -> dict:
    import json

    from ..loading import load_target
    from ..models.checkpoint import check_fits, load_dflash

    rt = run_on(cfg)
    log = rt.log(log)
    target, tok = load_target(shipped(target_name, "target"), dtype=rt.target_dtype, device=str(rt.device))
    init = shipped(init, "drafter")
    drafter = load_dflash(init)
    check_fits(drafter.config, target)
    stream = read_stream(data, tok)
    log(f"VP-drafter from {init}: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"block {drafter.config.block_size}, {len(stream)} training tokens")
    steps, secs = train_vp_drafter(target, drafter, stream, out, cfg, resume=resume)
    log(f"trained {steps} steps in {secs / 60:.1f} min; VP-drafter in {out}")
    if not heldout or not rt.main:
        return {}
    result = heldout_acceptance(target, init, {"untrained": init, "trained": str(out)},
                                read_stream(heldout, tok), n_prompts, log=log)
    (out / "heldout.json").write_text(json.dumps({"steps": steps, "seconds": round(secs, 1), **result}, indent=2))
    return result
