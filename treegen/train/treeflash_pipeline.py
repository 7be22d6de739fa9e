"""The `treegen train treeflash` pipeline: target + DFlash backbone -> train the head -> held-out acceptance
of treeflash against ddtree through the real engine, at the same budgets and on the same prompts."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from ..drafters.ddtree import DDTreeDrafter
from ..drafters.dflash import DFlashBlock
from ..drafters.treeflash import TreeFlashDrafter, load_treeflash_block
from ..loading import load_target
from ..models.checkpoint import load_dflash, read_config, resolve_checkpoint
from ..models.treeflash import TreeFlashModel, fits, from_dflash, load_treeflash
from .common import run_on
from .data import read_stream
from .evaluate import acceptance, heldout_prompts
from .treeflash import TreeFlashTrainConfig, train_treeflash


def start_model(drafter: str, out: Path, resume: bool, seed: int = 0) -> TreeFlashModel:
    """A TreeFlash checkpoint continues its head; a DFlash drafter gets a fresh head (drawn from `seed`);
    --resume reloads OUT."""
    if resume and (out / "train_state.pt").exists():
        return load_treeflash(str(out))  # fit() restores the head and optimizer from train_state.pt
    folder = resolve_checkpoint(drafter)
    if "treeflash_config" in read_config(folder).extra:
        return load_treeflash(str(folder))
    torch.manual_seed(seed)
    return from_dflash(load_dflash(str(folder)))


def compare(target, model: TreeFlashModel, prompts, budgets, supports, new_tokens: int = 64) -> dict:
    """Mean acceptance length (T=0) and seconds per prompt, ddtree vs treeflash, per budget and scoring."""
    block, rows = DFlashBlock(model.model, target), {}
    for budget in budgets:
        runs = {"ddtree": DDTreeDrafter(block, budget)}
        runs.update({f"treeflash support={s}": TreeFlashDrafter(block, model, budget, support=s) for s in supports})
        for name, drafter in runs.items():
            t0 = time.perf_counter()
            stats = acceptance(target, drafter, prompts, new_tokens)
            rows[f"budget {budget} {name}"] = {"accept": round(stats.mean_accepted_length, 3),
                                              "tok_per_s": round(stats.new_tokens / (time.perf_counter() - t0), 1)}
    return rows


def train_treeflash_pipeline(target_name: str, drafter: str, data: list[str], out: Path, cfg: TreeFlashTrainConfig,
                             *, heldout: list[str] = (), prompts: int = 8, budgets=(16, 32, 64), supports=(64, 0),
                             save_dtype: torch.dtype | None = None, resume: bool = False, log=print) -> dict:
    rt = run_on(cfg)
    log = rt.log(log)
    target, tok = load_target(target_name, dtype=rt.target_dtype, device=str(rt.device))
    model = start_model(drafter, out, resume, cfg.seed)
    fits(model, target)
    stream = read_stream(list(data), tok)
    head = sum(p.numel() for p in model.ar_approximation.parameters())
    log(f"TreeFlash head: {head / 1e6:.2f}M parameters on a frozen {model.config.num_hidden_layers}-layer "
        f"backbone; {len(stream)} training tokens")
    steps, secs = train_treeflash(target, model, stream, out, cfg, resume=resume, save_dtype=save_dtype)
    log(f"trained {steps} steps in {secs / 60:.1f} min; checkpoint in {out}")
    if not heldout or not rt.main:
        return {}
    served = load_treeflash_block(target, str(out))[1]   # as served: the target's dtype and device
    result = compare(target, served, heldout_prompts(read_stream(list(heldout), tok), prompts, 64), budgets, supports)
    for name, row in result.items():
        log(f"held-out acceptance ({prompts} prompts x 64 tokens, T=0) {name}: {row['accept']:.3f} "
            f"({row['tok_per_s']:.0f} tok/s)")
    (out / "heldout.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
