"""Step time of `treegen train dflash` in each compute precision, on the shipped SmolLM2 drafter's recipe.

    python -m treegen.train.step_time --out docs/benchmarks/train-step-bf16.json [--device auto] [--threads 2]

The recipe the shipped SmolLM2 DFlash drafter was trained with (its training.json): continued from that
drafter, batch 8 x 256 tokens, 16 anchors of block 10, an 8192-token candidate loss, the target's features
read from a feature cache (the frozen target's forward is not part of a step). The loop is train_dflash's
own; a step's time is fit()'s: the difference between a short and a longer run, so that loading, the
first steps' warm-up and the checkpoints are not counted.
"""
from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..exit import end
from .common import PRECISIONS, runtime

WINDOWS, SEQ_LEN = 8, 256


def stream_of(tok, tokens: int) -> torch.Tensor:
    """stdlib source (the training split), tokenized, cut to `tokens`."""
    from .common import encode_corpus
    from .corpus import read_texts, stdlib_files

    texts = read_texts(stdlib_files("train")[:40])
    return encode_corpus(texts, tok)[:tokens]


def run(target, drafter_dir: str, stream, cache: Path, precision: str, device: str, steps: int) -> float:
    """fit()'s seconds for `steps` steps of the recipe in this precision."""
    from ..models.checkpoint import load_dflash
    from .dflash import DFlashTrainConfig, train_dflash

    drafter = load_dflash(drafter_dir).train()
    c = drafter.config
    cfg = DFlashTrainConfig(num_layers=c.num_hidden_layers, block_size=c.block_size, target_layer_ids=c.target_layer_ids,
                            batch=8, seq_len=SEQ_LEN, anchors=16, lr=1.5e-3, max_steps=steps, candidates=8192,
                            feature_cache=str(cache), ckpt_every=10**9, device=device, precision=precision)
    with tempfile.TemporaryDirectory() as out:
        _, elapsed = train_dflash(target, drafter, stream, Path(out), cfg, log=lambda m: None)
    return elapsed


def cpu_name() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--long", type=int, default=13)
    args = ap.parse_args(argv)
    from ..assets import ASSETS, shipped
    from ..loading import load_target
    from .common import native_bf16

    torch.set_num_threads(args.threads)
    rt = runtime(args.device)

    def target_for(precision: str):   # the frozen target as a run in this precision loads it
        dtype = runtime(args.device, precision).target_dtype
        return load_target(shipped("smollm2", "target"), dtype=dtype, device=str(rt.device))[0], dtype

    tok = load_target(shipped("smollm2", "target"), dtype=rt.target_dtype, device=str(rt.device))[1]
    stream = stream_of(tok, WINDOWS * SEQ_LEN)
    drafter_dir = str(ASSETS / "smollm2" / "dflash")
    result = {"command": "python -m treegen.train.step_time " + " ".join(argv if argv is not None else sys.argv[1:]),
              "what": __doc__.strip().splitlines()[0], "device": str(rt.device), "processor": cpu_name(),
              "native_bf16": native_bf16(rt.device),
              "torch": torch.__version__, "threads": args.threads,
              "recipe": {"batch": 8, "seq_len": SEQ_LEN, "anchors": 16, "block_size": 10, "candidates": 8192,
                         "feature_cache": True, "init": "treegen/assets/smollm2/dflash"},
              "steps_timed": args.long - args.short, "precisions": {}}
    with tempfile.TemporaryDirectory() as cache:
        full, low = [name for name, dtype in PRECISIONS.items() if dtype is not None]   # fp32, bf16
        for precision in (full, low):
            target, dtype = target_for(precision)
            run(target, drafter_dir, stream, Path(cache), precision, args.device, 1)   # fills the cache; warms up
            t0 = time.perf_counter()
            short = run(target, drafter_dir, stream, Path(cache), precision, args.device, args.short)
            long = run(target, drafter_dir, stream, Path(cache), precision, args.device, args.long)
            step = (long - short) / (args.long - args.short)
            result["precisions"][precision] = {"step_s": round(step, 4), "target_dtype": dtype,
                                               "wall_s": round(time.perf_counter() - t0, 1)}
            print(f"{precision}: {step:.3f} s a step", file=sys.stderr, flush=True)
    p = result["precisions"]
    result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)   # Linux: KiB
    result["bf16_speedup"] = round(p[full]["step_s"] / p[low]["step_s"], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    end(main())
