"""The `treegen train dflash` pipeline: data -> (regenerate) -> train -> held-out acceptance."""
from __future__ import annotations

from pathlib import Path

import torch

from ..drafters.dflash import DFlashChainDrafter, load_block
from ..loading import load_target
from ..models.checkpoint import check_fits, load_dflash
from .common import run_on
from .data import read_stream, regenerate
from .dflash import DFlashTrainConfig, build_drafter, train_dflash
from .evaluate import acceptance, heldout_prompts


def training_stream(target, tok, data: list[str], out: Path, regen: int, seq_len: int, log, rt=None) -> torch.Tensor:
    stream = read_stream(data, tok)
    if not regen:
        return stream
    cached = out / "regenerated.pt"
    if cached.exists():  # regeneration is the slow part; --resume must not redo it
        return torch.load(cached)
    out.mkdir(parents=True, exist_ok=True)
    rows = regenerate(target, stream, regen, prompt_len=seq_len // 4, gen_len=seq_len - seq_len // 4, log=log, rt=rt)
    flat = rows.flatten().to(torch.int32)
    if rt is None or rt.main:
        torch.save(flat, cached)
    return flat


def estimate(target, out: Path, heldout_stream: torch.Tensor, log, n: int = 8) -> dict:
    block = load_block(target, str(out))   # as served: the target's dtype and device
    prompts = heldout_prompts(heldout_stream, n, 64)
    result = {}
    for temp in (0.0, 1.0):
        stats = acceptance(target, DFlashChainDrafter(block), prompts, 64, temperature=temp)
        result[f"T={temp:g}"] = round(stats.mean_accepted_length, 3)
    log(f"held-out acceptance length (dflash chain, {n} prompts x 64 tokens): {result}")
    return result


def start_drafter(target, tok, cfg: DFlashTrainConfig, mask_token_id: int | None, init: str | None):
    """A fresh drafter of cfg's shape, or (init) a trained one to continue, refused if it does not fit."""
    if init is not None:
        from ..assets import shipped

        drafter = load_dflash(shipped(init, "drafter"))
        check_fits(drafter.config, target)
        return drafter.train()
    mask = mask_token_id if mask_token_id is not None else tok.mask_token_id
    if mask is None:
        raise ValueError("the tokenizer has no mask token; pass --mask-token-id (an unused embedding row)")
    return build_drafter(target, mask, cfg, cfg.seed)


def train_dflash_pipeline(target_name: str, data: list[str], out: Path, cfg: DFlashTrainConfig, *,
                          mask_token_id: int | None = None, regen: int = 0, heldout: list[str] = (),
                          resume: bool = False, init: str | None = None, log=print) -> dict:
    rt = run_on(cfg)
    log = rt.log(log)
    target, tok = load_target(target_name, dtype=rt.target_dtype, device=str(rt.device))
    stream = training_stream(target, tok, data, out, regen, cfg.seq_len, log, rt)
    drafter = start_drafter(target, tok, cfg, mask_token_id, init)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"target layers {list(drafter.config.target_layer_ids)}; {len(stream)} training tokens")
    heldout_stream = read_stream(heldout, tok) if heldout else None
    if heldout and rt.main:
        untrained_dir = out / "untrained"
        from ..models.checkpoint import save_dflash
        save_dflash(drafter, untrained_dir)
        log("before training:" if init else "untrained baseline:")
        estimate(target, untrained_dir, heldout_stream, log)
    steps, secs = train_dflash(target, drafter, stream, out, cfg, resume=resume, log=log)
    log(f"trained {steps} steps in {secs / 60:.1f} min; checkpoint in {out}")
    return estimate(target, out, heldout_stream, log) if heldout and rt.main else {}
