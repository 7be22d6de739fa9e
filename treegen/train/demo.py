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

from .common import encode_corpus
from .corpus import read_texts, stdlib_files

STAGES = ("tokenizer", "target", "drafter", "export")


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stage_tokenizer(work: Path) -> None:
    from .tokenizer import train_tokenizer
    from transformers import AutoTokenizer

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


def stage_target(work: Path, minutes: float, resume: bool) -> None:
    from transformers import AutoTokenizer
    from .target import build_target, perplexity, train_target

    out = work / "target"
    if (out / "model.safetensors").exists():
        return
    tok = AutoTokenizer.from_pretrained(work / "tokenizer")
    model = build_target(tok)
    log(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    steps, secs = train_target(model, torch.load(work / "train.pt"), work / "target-train",
                               max_seconds=minutes * 60, max_steps=100_000, resume=resume)
    ppl = perplexity(model, torch.load(work / "heldout.pt"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"steps": steps, "seconds": secs, "tokens": steps * 16 * 256, "heldout_ppl": ppl}
    (out / "training.json").write_text(json.dumps(info, indent=2))
    log(f"target done: {info}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--stage", choices=STAGES, action="append")
    ap.add_argument("--target-minutes", type=float, default=55)
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    args.work.mkdir(parents=True, exist_ok=True)
    stages = args.stage or STAGES
    if "tokenizer" in stages:
        stage_tokenizer(args.work)
    if "target" in stages:
        stage_target(args.work, args.target_minutes, args.resume)


if __name__ == "__main__":
    main()
