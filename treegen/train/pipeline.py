"""The `treegen train dflash` pipeline: data -> (regenerate) -> train -> held-out acceptance."""
from __future__ import annotations

from pathlib import Path

import torch

from ..drafters.dflash import DFlashBlock, DFlashChainDrafter
from ..loading import load_target
from ..models.checkpoint import load_dflash
from .data import read_data, regenerate, tokenize
from .dflash import DFlashTrainConfig, build_drafter, train_dflash
from .evaluate import acceptance, heldout_prompts


def training_stream(target, tok, data: list[str], out: Path, regen: int, seq_len: int, log) -> torch.Tensor:
    stream = tokenize(read_data(data), tok)
    if not regen:
        return stream
    cached = out / "regenerated.pt"
    if cached.exists():  # regeneration is the slow part; --resume must not redo it
        return torch.load(cached)
    out.mkdir(parents=True, exist_ok=True)
    rows = regenerate(target, stream, regen, prompt_len=seq_len // 4, gen_len=seq_len - seq_len // 4, log=log)
    flat = rows.flatten().to(torch.int32)
    torch.save(flat, cached)
    return flat


def estimate(target, out: Path, heldout_stream: torch.Tensor, log, n: int = 8) -> dict:
    block = DFlashBlock(load_dflash(str(out)), target)
    prompts = heldout_prompts(heldout_stream, n, 64)
    result = {}
    for temp in (0.0, 1.0):
        stats = acceptance(target, DFlashChainDrafter(block), prompts, 64, temperature=temp)
        result[f"T={temp:g}"] = round(stats.mean_accepted_length, 3)
    log(f"held-out acceptance length (dflash chain, {n} prompts x 64 tokens): {result}")
    return result


def train_dflash_pipeline(target_name: str, data: list[str], out: Path, cfg: DFlashTrainConfig, *,
                          mask_token_id: int | None = None, regen: int = 0, heldout: list[str] = (),
                          resume: bool = False, log=print) -> dict:
    target, tok = load_target(target_name, dtype="fp32", device="cpu")
    mask = mask_token_id if mask_token_id is not None else tok.mask_token_id
    if mask is None:
        raise ValueError("the tokenizer has no mask token; pass --mask-token-id (an unused embedding row)")
    stream = training_stream(target, tok, data, out, regen, cfg.seq_len, log)
    drafter = build_drafter(target, mask, cfg, cfg.seed)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, "
        f"target layers {list(drafter.config.target_layer_ids)}; {len(stream)} training tokens")
    if heldout:
        untrained_dir = out / "untrained"
        from ..models.checkpoint import save_dflash
        save_dflash(drafter, untrained_dir)
        log("untrained baseline:")
        estimate(target, untrained_dir, tokenize(read_data(heldout), tok), log)
    steps, secs = train_dflash(target, drafter, stream, out, cfg, resume=resume, log=log)
    log(f"trained {steps} steps in {secs / 60:.1f} min; checkpoint in {out}")
    return estimate(target, out, tokenize(read_data(heldout), tok), log) if heldout else {}
