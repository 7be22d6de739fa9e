"""Pieces every trainer shares: token streams, the LR schedule, checkpoints that resume, a progress line."""
from __future__ import annotations

import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch


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
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["rng"])
    return state["step"], state["elapsed"]


def fit(model, opt, sched: Schedule, gen: torch.Generator, ckpt: Path, step_loss, *, resume: bool,
        ckpt_every: int, on_checkpoint=None, evaluate=None) -> tuple[int, float]:
    """The loop every trainer shares: schedule the LR, step, clip, log, checkpoint; resumable.

    step_loss(gen) -> (loss, tokens in the batch, extra text for the progress line).
    evaluate() -> a line on held-out data, printed at every checkpoint (a falling training loss alone
    hides overfitting).
    """
    step, elapsed = load_checkpoint(ckpt, model, opt, gen) if resume and ckpt.exists() else (0, 0.0)
    progress = Progress()
    model.train()
    while not sched.done(step, elapsed):
        if STOP.is_set():  # between steps, so the checkpoint is exactly where --resume goes on
            save_checkpoint(ckpt, model, opt, step, elapsed, gen)
            print(f"stopped at step {step}; {ckpt} saved, --resume continues from there", file=sys.stderr,
                  flush=True)
            raise KeyboardInterrupt
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = sched.lr_at(step, elapsed)
        loss, tokens, extra = step_loss(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        elapsed += time.perf_counter() - t0
        progress.update(step, loss.item(), tokens, opt.param_groups[0]["lr"], elapsed, extra)
        if step % ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step, elapsed, gen)
            if on_checkpoint:
                on_checkpoint()
            if evaluate:
                report(model, step, evaluate)
    save_checkpoint(ckpt, model, opt, step, elapsed, gen)
    if evaluate and step % ckpt_every:
        report(model, step, evaluate)
    return step, elapsed


def report(model, step: int, evaluate) -> None:
    model.eval()
    with torch.no_grad():
        line = evaluate()
    model.train()
    print(f"step {step:6d}  {line}", file=sys.stderr, flush=True)


class Progress:
    """One status line (to stderr) every `every` steps: step, loss, tokens/s, lr, elapsed."""

    def __init__(self, every: int = 10):
        self.every, self.t0, self.tokens = every, time.perf_counter(), 0

    def update(self, step: int, loss: float, tokens: int, lr: float, elapsed: float, extra: str = "") -> None:
        self.tokens += tokens
        if step % self.every:
            return
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        print(f"step {step:6d}  loss {loss:.4f}  {rate:7.0f} tok/s  lr {lr:.2e}  {elapsed / 60:6.1f} min {extra}",
              file=sys.stderr, flush=True)
        self.t0, self.tokens = time.perf_counter(), 0
