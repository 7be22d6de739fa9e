"""Pieces every trainer shares: token streams, the LR schedule, checkpoints that resume, a progress line, and
the one loop (fit) with its device, precision and torchrun data parallelism (distributed.py, used only here)."""
from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..drafters.defaults import DRAFT_VOCAB
from .distributed import (
    PRECISIONS,
    DeviceError,
    Runtime,
    as_served,
    check_device,
    check_precision,
    leave,
    main_rank,
    native_bf16,
    runtime,
)

__all__ = [
    "PRECISIONS",
    "DeviceError",
    "Runtime",
    "as_served",
    "check_device",
    "check_precision",
    "main_rank",
    "native_bf16",
    "run_on",
    "runtime",
]


def encode_corpus(texts: list[str], tokenizer) -> torch.Tensor:
    """One flat int32 stream: every document followed by EOS, so a model learns where files end."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for chunk in range(0, len(texts), 256):
        for enc in tokenizer(texts[chunk:chunk + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    if len(stream) < seq_len + 2:
        raise ValueError(f"the training data is {len(stream)} tokens; windows of {seq_len} need at least "
                         f"{seq_len + 2} (more data, or a shorter --seq-len)")
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len] for s in starts.tolist()]).long()


@dataclass(frozen=True)
class LoopConfig:
    """What every trainer's loop takes (each recipe's config adds its own fields): batch shape, LR, budget."""
    batch: int = 8
    seq_len: int = 256
    anchors: int = 16
    lr: float = 1e-3
    max_steps: int = 2000
    max_seconds: float = math.inf
    gamma: float | None = None        # position-weight decay; None: by block size (7 for B=16)
    seed: int = 0
    ckpt_every: int = 50
    feature_cache: str | None = None  # folder: the target's features of the data, computed once (features.py)
    heldout_windows: int = 0          # the stream's last windows, never trained on, scored at every checkpoint
    device: str = "auto"              # auto: cuda (cuda:LOCAL_RANK under torchrun) when present, else the CPU
    precision: str = "auto"           # autocast's compute type (auto: bf16 where native); weights stay fp32
    draft_vocab: int = DRAFT_VOCAB    # tokens the export lists for its head to score (drafters/vocab.py)


def run_on(cfg) -> Runtime:
    """The Runtime a config asks for (under torchrun: this rank's, the process group joined), refused when
    its global batch does not divide among the processes."""
    rt = runtime(getattr(cfg, "device", "auto"), getattr(cfg, "precision", "auto"))
    rt.check_batch(cfg.batch)
    return rt


def runtime_options(parser) -> None:
    """--device and --dtype on a data generator's argparse command line (the train commands have click's)."""
    parser.add_argument("--device", default="auto", help="auto (cuda when present, else the CPU), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=list(PRECISIONS),
                        help="precision (auto: bf16 where the device has it natively); the target generates as it "
                             "is served on the device (bf16 where native), or in fp32 with --dtype fp32")


def runtime_from(args) -> Runtime:
    """The Runtime a generator's --device / --dtype ask for; one that cannot run here: one line, exit 2."""
    try:
        check_device(args.device)
    except DeviceError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    return runtime(args.device, args.dtype)


def local(model) -> Runtime:
    """No runtime given: this process alone, where the model is, full precision."""
    return Runtime(next(model.parameters()).device, torch.float32)


@dataclass
class Schedule:
    """Warm-up then cosine to 10%; progress is steps or wall time, whichever is further along."""
    lr: float
    max_steps: int
    max_seconds: float = math.inf
    warmup: int = 100

    def progress(self, step: int, elapsed: float) -> float:
        return min(1.0, max(step / self.max_steps, elapsed / self.max_seconds))

    def lr_at(self, step: int, elapsed: float) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        return self.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * self.progress(step, elapsed))))

    def done(self, step: int, elapsed: float) -> bool:
        return self.progress(step, elapsed) >= 1.0


STOP = threading.Event()   # set by SIGINT/SIGTERM (treegen.train.guards.stop_signals): stop at the next step


def save_checkpoint(path: Path, model, optimizer, step: int, elapsed: float, gen: torch.Generator) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                "elapsed": elapsed, "rng": gen.get_state()}, tmp)
    tmp.replace(path)  # atomic: a kill mid-write never leaves a broken checkpoint


def load_checkpoint(path: Path, model, optimizer, gen: torch.Generator) -> tuple[int, float]:
    state = torch.load(path, weights_only=False, map_location=next(model.parameters()).device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["rng"])
    return state["step"], state["elapsed"]


def fit(model, opt, sched: Schedule, gen: torch.Generator, ckpt: Path, step_loss, *, resume: bool,
        ckpt_every: int, on_checkpoint=None, evaluate=None, rt: Runtime | None = None) -> tuple[int, float]:
    """The loop every trainer shares: schedule the LR, step, clip, log, checkpoint; resumable.

    step_loss(gen) -> (loss, tokens in the batch, extra text for the progress line), run under rt's
    autocast (see sharded()). Under torchrun the model is DistributedDataParallel (gradients all-reduced in
    backward); the main rank alone logs, evaluates and writes the checkpoint and on_checkpoint()'s export
    (also once at the end). evaluate() -> a line on held-out data, printed at every checkpoint (a falling
    training loss alone hides overfitting).
    """
    rt = rt or local(model)
    step, elapsed = load_checkpoint(ckpt, model, opt, gen) if resume and ckpt.exists() else (0, 0.0)
    progress = Progress(write=rt.log(print))
    model.train()
    stepper = rt.wrap(Stepper(model, step_loss))
    while not sched.done(step, elapsed):
        if rt.anyone(STOP.is_set()):  # between steps, so the checkpoint is exactly where --resume goes on
            stop(rt, ckpt, model, opt, step, elapsed, gen)
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step, elapsed)
        with rt.autocast():
            loss, tokens, extra = stepper(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += rt.most(time.perf_counter() - t0)
        shown = rt.mean(loss.item()) if progress.due(step) else loss.item()
        progress.update(step, shown, tokens, opt.param_groups[0]["lr"], elapsed, extra)
        if step % ckpt_every == 0:
            checkpoint(rt, ckpt, model, opt, step, elapsed, gen, on_checkpoint, evaluate)
    checkpoint(rt, ckpt, model, opt, step, elapsed, gen, on_checkpoint, evaluate if step % ckpt_every else None)
    model.eval()
    return step, elapsed


class Stepper(torch.nn.Module):
    """The trained model with its step as forward: what DistributedDataParallel wraps, so that every step's
    forward goes through it (the trainers call their model's parts, not one forward)."""

    def __init__(self, model, step_loss):
        super().__init__()
        self.model, self.step_loss = model, step_loss

    def forward(self, gen):
        return self.step_loss(gen)


def sharded(rt: Runtime, draw, loss, tokens: int):
    """A step_loss for fit() from two halves: draw(gen) -> the global batch's random choices (a dict of CPU
    tensors, dim 0 = windows; the same on every rank, so a run's batches do not depend on its process count);
    loss(part) -> (loss, extra text) of this rank's equal share of them, moved to its device."""
    def step_loss(gen):
        part = rt.to_device(rt.shard(draw(gen)))
        value, extra = loss(part)
        return value, tokens, extra
    return step_loss


def checkpoint(rt: Runtime, ckpt: Path, model, opt, step: int, elapsed: float, gen, on_checkpoint, evaluate):
    if rt.main:
        save_checkpoint(ckpt, model, opt, step, elapsed, gen)
        if on_checkpoint:
            on_checkpoint()
        if evaluate:
            report(model, step, evaluate, rt)


def stop(rt: Runtime, ckpt: Path, model, opt, step: int, elapsed: float, gen) -> None:
    if rt.main:
        save_checkpoint(ckpt, model, opt, step, elapsed, gen)
        print(f"stopped at step {step}; {ckpt} saved, --resume continues from there", file=sys.stderr, flush=True)
    leave()   # no rank leaves before the checkpoint every rank resumes from is whole
    raise KeyboardInterrupt


def report(model, step: int, evaluate, rt: Runtime) -> None:
    model.eval()
    with torch.no_grad(), rt.autocast():
        line = evaluate()
    model.train()
    print(f"step {step:6d}  {line}", file=sys.stderr, flush=True)


class Progress:
    """One status line (to stderr) every `every` steps: step, loss, tokens/s, lr, elapsed."""

    def __init__(self, every: int = 10, write=print):
        self.every, self.t0, self.tokens, self.write = every, time.perf_counter(), 0, write

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def update(self, step: int, loss: float, tokens: int, lr: float, elapsed: float, extra: str = "") -> None:
        self.tokens += tokens
        if not self.due(step):
            return
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.write(f"step {step:6d}  loss {loss:.4f}  {rate:7.0f} tok/s  lr {lr:.2e}  {elapsed / 60:6.1f} min {extra}",
                   file=sys.stderr, flush=True)
        self.t0, self.tokens = time.perf_counter(), 0
