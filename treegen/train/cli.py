"""`treegen train ...`: tokenizer, target (the demo pair) and drafter training commands."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from ..cli_options import guarded


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _budget(minutes: float | None) -> float:
    return math.inf if minutes is None else minutes * 60


@click.group()
def train():
    """Train drafters (and the demo pair's tokenizer and target)."""


@train.command("dflash")
@click.option("--target", required=True, help="Target model: hub id or folder (frozen during training).")
@click.option("--data", "data", multiple=True, required=True, help="Text file, folder or JSONL of {'text':..}.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder (published layout).")
@click.option("--layers", default=3, show_default=True, help="Drafter decoder layers.")
@click.option("--block-size", default=16, show_default=True)
@click.option("--target-layers", default=None, help="Comma-separated target layer ids (default: z-lab's spread).")
@click.option("--mask-token-id", type=int, default=None, help="Default: the tokenizer's mask token.")
@click.option("--steps", default=2000, show_default=True, help="Maximum optimizer steps.")
@click.option("--minutes", type=float, default=None, help="Wall-clock budget; the LR schedule follows it.")
@click.option("--batch", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--anchors", default=16, show_default=True, help="Random anchors (blocks) per sequence.")
@click.option("--lr", default=1e-3, show_default=True)
@click.option("--regenerate", "regen", type=int, default=0, help="Train on N target-regenerated sequences.")
@click.option("--heldout", "heldout", multiple=True, help="Held-out text for the final acceptance estimate.")
@click.option("--resume", is_flag=True, help="Continue from OUT/train_state.pt.")
@click.option("--seed", default=0, show_default=True)
@guarded
def dflash_cmd(target, data, out, layers, block_size, target_layers, mask_token_id, steps, minutes, batch,
               seq_len, anchors, lr, regen, heldout, resume, seed):
    """Train a DFlash block-diffusion drafter for TARGET; writes z-lab's checkpoint layout to OUT."""
    from .dflash import DFlashTrainConfig
    from .pipeline import train_dflash_pipeline

    ids = tuple(int(x) for x in target_layers.split(",")) if target_layers else None
    cfg = DFlashTrainConfig(num_layers=layers, block_size=block_size, target_layer_ids=ids, batch=batch,
                            seq_len=seq_len, anchors=anchors, lr=lr, max_steps=steps,
                            max_seconds=_budget(minutes), seed=seed)
    train_dflash_pipeline(target, list(data), out, cfg, mask_token_id=mask_token_id, regen=regen,
                          heldout=list(heldout), resume=resume, log=_log)


@train.command("tokenizer")
@click.option("--data", multiple=True, required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--vocab-size", default=8192, show_default=True)
@guarded
def tokenizer_cmd(data, out, vocab_size):
    """Train a byte-level BPE tokenizer (with eos, pad and mask tokens)."""
    from .data import read_data
    from .tokenizer import train_tokenizer

    train_tokenizer(read_data(list(data)), out, vocab_size)
    _log(f"tokenizer written to {out}")


@train.command("target")
@click.option("--tokenizer", "tok_dir", required=True, help="Tokenizer folder (from `treegen train tokenizer`).")
@click.option("--data", multiple=True, required=True)
@click.option("--out", type=click.Path(path_type=Path), required=True)
@click.option("--steps", default=100_000, show_default=True)
@click.option("--minutes", type=float, default=None)
@click.option("--resume", is_flag=True)
@guarded
def target_cmd(tok_dir, data, out, steps, minutes, resume):
    """Train a small Qwen3-architecture target from scratch (how the demo target is made)."""
    from transformers import AutoTokenizer

    from .data import read_data, tokenize
    from .target import build_target, train_target

    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = build_target(tok)
    train_target(model, tokenize(read_data(list(data)), tok), out / "train-state", max_steps=steps,
                 max_seconds=_budget(minutes), resume=resume)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _log(f"target written to {out}")


@train.command("vp-drafter")
@click.option("--target", default="demo", show_default=True, help="Target: hub id, folder, or demo.")
@click.option("--init", default="demo", show_default=True,
              help="The DFlash drafter to start from: folder, hub id, demo or demo/NAME.")
@click.option("--data", multiple=True, required=True,
              help="A token stream (.pt, 1-D int tensor) or text files / folders / JSONL.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Output folder (DFlash layout).")
@click.option("--steps", default=2000, show_default=True, help="Maximum optimizer steps.")
@click.option("--minutes", type=float, default=None, help="Wall-clock budget; the LR schedule follows it.")
@click.option("--batch", default=8, show_default=True)
@click.option("--seq-len", default=256, show_default=True)
@click.option("--anchors", default=16, show_default=True, help="Random anchors (blocks) per sequence.")
@click.option("--lr", default=5e-4, show_default=True)
@click.option("--beta", default=0.9, show_default=True, help="Pr(visible prefix i) ~ beta^i, i in [2, B-1].")
@click.option("--gamma", default=7.0, show_default=True, help="Loss weight exp(-(k - i)/gamma) after the prefix.")
@click.option("--heldout", multiple=True, help="Held-out stream (.pt) or text for the acceptance estimate.")
@click.option("--heldout-prompts", default=16, show_default=True)
@click.option("--resume", is_flag=True, help="Continue from OUT/train_state.pt.")
@click.option("--seed", default=0, show_default=True)
@guarded
def vp_drafter_cmd(target, init, data, out, steps, minutes, batch, seq_len, anchors, lr, beta, gamma, heldout,
                   heldout_prompts, resume, seed):
    """Train D2SD's variable-prefix drafter from a DFlash drafter; writes the DFlash layout (marked
    dflash_config.variable_prefix) to OUT."""
    from .vp_drafter import VPTrainConfig, vp_pipeline

    if not 0 < beta <= 1 or gamma <= 0:
        raise ValueError(f"--beta must be in (0, 1] and --gamma > 0, got {beta}, {gamma}")
    cfg = VPTrainConfig(batch=batch, seq_len=seq_len, anchors=anchors, lr=lr, max_steps=steps,
                        max_seconds=_budget(minutes), beta=beta, gamma=gamma, seed=seed)
    vp_pipeline(target, init, list(data), out, cfg, list(heldout), heldout_prompts, resume, log=_log)
