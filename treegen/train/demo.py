"""Build the shipped demo pair end to end: corpus -> tokenizer -> target -> DFlash drafter.

    python -m treegen.train.demo --work /tmp/demo-build [--resume] [--stage tokenizer|target|drafter|export]

Every stage writes into --work and is skipped when its output exists, so the command resumes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..exit import end
from .common import encode_corpus, leave, runtime_from, runtime_options
from .corpus import read_texts, stdlib_files

STAGES = ("tokenizer", "target", "drafter", "export")
DEMO_DRAFTER_LAYERS = (1, 3, 5)  # with 6 target layers, the last one carries the most next-token signal


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stage_tokenizer(work: Path) -> None:
    from transformers import AutoTokenizer

    from .tokenizer import train_tokenizer

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        texts = read_texts(stdlib_files("train"))
        log(f"training tokenizer on {len(texts)} files")
        train_tokenizer(texts, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for split in ("train", "heldout"):
        path = work / f"{split}.pt"
        if not path.exists():
            texts = read_texts(stdlib_files(split))
            stream = encode_corpus(texts, tok)
            torch.save(stream, path)
            log(f"{split}: {len(texts)} files, {sum(map(len, texts))} chars, {len(stream)} tokens")


def stage_target(work: Path, minutes: float, resume: bool, rt) -> None:
    from transformers import AutoTokenizer

    from .target import build_target, perplexity, train_target

    out = work / "target"
    if (out / "model.safetensors").exists():
        return
    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    model = build_target(tok)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    steps, secs = train_target(model, torch.load(work / "train.pt"), work / "target-train",
                               max_seconds=minutes * 60, max_steps=100_000, resume=resume,
                               device=rt.option_device, precision=rt.option_precision)
    if not rt.main:
        return
    ppl = perplexity(model, torch.load(work / "heldout.pt"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"steps": steps, "seconds": secs, "tokens": steps * 16 * 256, "heldout_ppl": ppl}
    (out / "training.json").write_text(json.dumps(info, indent=2))
    log(f"target done: {info}")


def stage_drafter(work: Path, minutes: float, regen: int, resume: bool, rt) -> None:
    from ..loading import load_target
    from .data import regenerate
    from .dflash import DFlashTrainConfig, build_drafter, train_dflash
    from .pipeline import estimate

    out = work / "dflash"
    if (out / "done.json").exists():
        return
    target, tok = load_target(str(work / "target"), dtype=rt.target_dtype, device=str(rt.device))
    cached = work / "regenerated.pt"
    if not cached.exists():
        # greedy continuations only: the demo's T=0 acceptance is what they teach (T=1 data from a target
        # with held-out perplexity ~64 is mostly noise a 5M drafter cannot fit in 30 CPU minutes)
        rows = regenerate(target, torch.load(work / "train.pt"), regen, 64, 192, temperatures=(0.0,), log=log, rt=rt)
        if rt.main:
            torch.save(rows.flatten().to(torch.int32), cached)
        rt.barrier()
    stream = torch.load(cached)
    cfg = DFlashTrainConfig(num_layers=3, block_size=16, target_layer_ids=DEMO_DRAFTER_LAYERS, batch=8,
                            seq_len=256, anchors=16, lr=1.5e-3, max_steps=100_000, max_seconds=minutes * 60,
                            device=rt.option_device, precision=rt.option_precision)
    drafter = build_drafter(target, tok.mask_token_id, cfg)
    log(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters, {len(stream)} tokens")
    steps, secs = train_dflash(target, drafter, stream, out, cfg, resume=resume, log=log)
    if not rt.main:
        return
    result = estimate(target, out, torch.load(work / "heldout.pt"), log, n=16)
    info = {"steps": steps, "seconds": secs, "block_tokens": steps * cfg.batch * cfg.anchors * cfg.block_size,
            "regenerated_sequences": regen, "heldout_acceptance": result}
    (out / "done.json").write_text(json.dumps(info, indent=2))
    log(f"drafter done: {info}")


def stage_export(work: Path, assets: Path) -> None:
    """Copy the pair into the package as fp16 safetensors (what ships)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.checkpoint import load_dflash, save_dflash

    target = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float32)
    target.to(torch.float16).save_pretrained(assets / "target")
    AutoTokenizer.from_pretrained(work / "target").save_pretrained(assets / "target")
    for name in ("training.json",):
        (assets / "target" / name).write_text((work / "target" / name).read_text())
    save_dflash(load_dflash(str(work / "dflash")), assets / "dflash", dtype=torch.float16)
    (assets / "dflash" / "training.json").write_text((work / "dflash" / "done.json").read_text())
    log(f"exported to {assets}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--stage", choices=STAGES, action="append")
    ap.add_argument("--target-minutes", type=float, default=75)
    ap.add_argument("--drafter-minutes", type=float, default=28)
    ap.add_argument("--regenerate", type=int, default=1024)
    ap.add_argument("--assets", type=Path, default=Path(__file__).resolve().parents[1] / "assets" / "demo")
    ap.add_argument("--resume", action="store_true")
    runtime_options(ap)
    args = ap.parse_args(argv)
    rt = runtime_from(args)
    torch.set_num_threads(2)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stage or STAGES
    if "tokenizer" in stages:
        stage_tokenizer(args.work)
    if "target" in stages:
        stage_target(args.work, args.target_minutes, args.resume, rt)
    if "drafter" in stages:
        stage_drafter(args.work, args.drafter_minutes, args.regenerate, args.resume, rt)
    if "export" in stages and rt.main:
        stage_export(args.work, args.assets)
    leave()


if __name__ == "__main__":
    end(main())
