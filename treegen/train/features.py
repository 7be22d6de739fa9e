"""The target's context features of a training stream, computed once and memory-mapped.

A drafter trainer needs the target's hidden states at a few layers for every window it sees. For the demo
target a forward per step is cheap; for a real one (SmolLM2's 30 layers on a CPU) it is most of the step,
and every epoch and every head would pay it again. A FeatureStore keeps them beside the stream: fp16
[tokens, layers*H] on disk, with meta.json naming the stream (a digest) and the layers. It is written either
by the data generator from its own forwards (treegen.train.chat_data) or by fill() here, window by window
(resumable: progress is written after every batch). A store may hold more layers than a drafter reads.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch

from .distributed import as_served

META, DATA, ANCHORS = "meta.json", "features.f16", "anchors.u8"


def stream_digest(stream: torch.Tensor) -> str:
    return hashlib.sha1(stream.to(torch.int32).cpu().numpy().tobytes()).hexdigest()[:16]


class FeatureStore:
    def __init__(self, folder: Path, meta: dict, mode: str):
        self.folder, self.meta = Path(folder), meta
        self.layer_ids = tuple(meta["layer_ids"])
        self.data = np.memmap(self.folder / DATA, dtype=np.float16, mode=mode,
                              shape=(meta["tokens"], meta["hidden"] * len(self.layer_ids)))

    @classmethod
    def create(cls, folder: Path, stream: torch.Tensor, layer_ids, hidden: int) -> FeatureStore:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"stream": stream_digest(stream), "tokens": len(stream), "layer_ids": list(layer_ids),
                "hidden": hidden, "done": 0}
        store = cls(folder, meta, "w+")
        store._write_meta()
        return store

    @classmethod
    def open(cls, folder: Path, stream: torch.Tensor) -> FeatureStore | None:
        """The store in folder if it holds this stream's features; None otherwise."""
        try:
            meta = json.loads((Path(folder) / META).read_text())
        except (OSError, ValueError):
            return None
        if meta.get("stream") != stream_digest(stream) or meta.get("tokens") != len(stream) \
                or not (Path(folder) / DATA).exists():
            return None
        return cls(folder, meta, "r+")

    def _write_meta(self) -> None:
        tmp = self.folder / (META + ".tmp")
        tmp.write_text(json.dumps(self.meta))
        tmp.replace(self.folder / META)

    def finish(self, done: int) -> None:
        """Mark the first `done` tokens written (after a flush: a kill never marks unwritten rows done)."""
        self.data.flush()
        self.meta["done"] = done
        self._write_meta()

    @property
    def done(self) -> int:
        return int(self.meta.get("done", 0))

    def write_anchors(self, allowed: np.ndarray) -> None:
        """Positions where anchors go first (a chat stream: those whose next token is a reply's), one byte each."""
        allowed.astype(np.uint8).tofile(self.folder / ANCHORS)

    def anchors(self) -> np.ndarray | None:
        path = self.folder / ANCHORS
        if not path.exists() or path.stat().st_size != self.meta["tokens"]:
            return None
        return np.fromfile(path, dtype=np.uint8).astype(bool)

    def columns(self, layer_ids) -> np.ndarray | None:
        """Column indices of `layer_ids`' states, in that order; None if the store lacks one of them."""
        if not set(layer_ids) <= set(self.layer_ids):
            return None
        h = self.meta["hidden"]
        return np.concatenate([np.arange(h) + h * self.layer_ids.index(i) for i in layer_ids])


def target_features(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """The target's states at `layer_ids` for ids [B, T], concatenated: [B, T, len(layer_ids) * H]."""
    with torch.no_grad(), as_served(target):  # the decoder alone: the logits over the vocabulary are not needed
        hs = target.get_decoder()(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


@torch.no_grad()
def fill(store: FeatureStore, target, ids: torch.Tensor, seq_len: int, batch: int = 8, log=print) -> None:
    """Compute the states of every aligned seq_len window not yet done, `batch` windows per forward."""
    windows = len(ids) // seq_len
    start, t0 = store.done // seq_len, time.perf_counter()
    for i in range(start, windows, batch):
        j = min(i + batch, windows)
        chunk = ids[i * seq_len:j * seq_len].view(j - i, seq_len).long().to(target.device)
        feats = target_features(target, chunk, store.layer_ids).to(torch.float16)
        store.data[i * seq_len:j * seq_len] = feats.reshape(-1, feats.shape[-1]).cpu().numpy()
        store.finish(j * seq_len)
        if (j // batch) % 10 == 0 or j == windows:
            rate = (j - start) * seq_len / max(time.perf_counter() - t0, 1e-9)
            log(f"target features: {j}/{windows} windows ({rate:.0f} tokens/s)")


def final_layer(target) -> int:
    """The target's last decoder layer: its states, kept after the final norm as output_hidden_states gives
    them, are the target's own next-token law through the lm_head alone (a soft loss without a forward)."""
    return target.config.num_hidden_layers - 1


class FeatureWindows:
    """Random aligned windows of a stream with the target's features at `layer_ids` (and, given `final`, the
    states of that layer apart), from the store in `folder` (made and filled first when it is missing, stale
    or lacks a layer)."""

    def __init__(self, folder: Path, target, stream: torch.Tensor, seq_len: int, layer_ids, hidden: int, log=print,
                 reserve: int = 0, final: int | None = None):
        store = FeatureStore.open(folder, stream)
        wanted = tuple(layer_ids) + (() if final is None or final in layer_ids else (final,))
        if store is None or store.columns(wanted) is None:
            store = FeatureStore.create(folder, stream, wanted, hidden)
        self.seq_len, self.windows = seq_len, len(stream) // seq_len - reserve   # the last `reserve`: held out
        if self.windows < 1:
            raise ValueError(f"the training data is {len(stream)} tokens: no {seq_len}-token window is left "
                             f"for training beside {reserve} held out")
        total = (self.windows + reserve) * seq_len
        if store.done < total:
            log(f"computing the target's features of {total} tokens once into {folder}")
            fill(store, target, stream, seq_len, log=log)
        self.store, self.cols, self.stream = store, store.columns(layer_ids), stream
        self.final_cols = None if final is None else store.columns((final,))
        self.allowed, self.reserve = store.anchors(), reserve

    def __call__(self, batch: int, gen: torch.Generator):
        """ids [b, T], their features [b, T, k*H] (fp32), and where anchors go first [b, T] (or None)."""
        return self.read(self.starts(batch, gen).tolist())

    def starts(self, batch: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randint(0, self.windows, (batch,), generator=gen) * self.seq_len

    def heldout(self):
        """The held-out windows (the stream's last `reserve`), never sampled by __call__."""
        return self.read([(self.windows + i) * self.seq_len for i in range(self.reserve)])

    def read(self, starts: list[int]):
        return self.ids(starts), self.features(starts), self.anchors(starts)

    def ids(self, starts: list[int]) -> torch.Tensor:
        return torch.stack([self.stream[s:s + self.seq_len] for s in starts]).long()

    def features(self, starts: list[int]) -> torch.Tensor:
        return torch.from_numpy(np.stack([self.store.data[s:s + self.seq_len][:, self.cols] for s in starts])).float()

    def final(self, starts: list[int]) -> torch.Tensor | None:
        """[b, T, H] the target's last-layer states (fp32), or None when they were not asked for."""
        if self.final_cols is None:
            return None
        return torch.from_numpy(np.stack([self.store.data[s:s + self.seq_len][:, self.final_cols] for s in starts])).float()

    def anchors(self, starts: list[int]) -> torch.Tensor | None:
        if self.allowed is None:
            return None
        return torch.from_numpy(np.stack([self.allowed[s:s + self.seq_len] for s in starts]))


def training_windows(target, drafter_config, stream: torch.Tensor, cfg, log=print, rt=None, final: bool = False):
    """gen -> (ids [b, T], features [b, T, k*H] or None, anchor preference [b, T] or None) for every trainer:
    random windows of the stream, with the target's features at the drafter's layers from cfg.feature_cache
    when it names a folder (None: the loss runs the target on every batch). The stream's last
    cfg.heldout_windows windows are never trained on; `.heldout()` gives them in the same form.
    Split for data parallelism: draw(gen) -> the global batch's {"ids", "starts", "allowed"}, and
    features(part) -> the features of a rank's share of it only (None without a cache); final(part) the
    target's last-layer states of that share when `final` (a soft loss without a forward; None without a cache).
    Under torchrun (rt) the main rank fills a missing store while the others wait, then all read it."""
    reserve = cfg.heldout_windows
    if cfg.feature_cache is None:
        return StreamWindows(stream, cfg.batch, cfg.seq_len, reserve)

    def open_store():
        return FeatureWindows(Path(cfg.feature_cache), target, stream, cfg.seq_len, drafter_config.target_layer_ids,
                              drafter_config.hidden_size, log, reserve=reserve,
                              final=final_layer(target) if final else None)
    if rt is None or rt.world == 1:
        return FeatureSampler(open_store(), cfg.batch)
    windows = open_store() if rt.main else None
    rt.barrier()
    return FeatureSampler(windows or open_store(), cfg.batch)


class StreamWindows:
    """Random windows of a stream without features; the last `reserve` aligned windows held out."""

    def __init__(self, stream: torch.Tensor, batch: int, seq_len: int, reserve: int):
        from .common import random_windows

        self.train = stream[:len(stream) - reserve * seq_len] if reserve else stream
        self.kept = stream[len(self.train):len(self.train) + reserve * seq_len].long().view(reserve, seq_len)
        self.sample = lambda g: random_windows(self.train, batch, seq_len, g)

    def __call__(self, gen: torch.Generator):
        return self.sample(gen), None, None

    def draw(self, gen: torch.Generator) -> dict:
        return {"ids": self.sample(gen), "allowed": None}

    def features(self, part: dict) -> None:
        return None

    def final(self, part: dict) -> None:
        return None

    def heldout(self):
        return self.kept, None, None


class FeatureSampler:
    """A FeatureWindows store sampled at a fixed batch size."""

    def __init__(self, windows: FeatureWindows, batch: int):
        self.windows, self.batch = windows, batch

    def __call__(self, gen: torch.Generator):
        return self.windows(self.batch, gen)

    def draw(self, gen: torch.Generator) -> dict:
        """The global batch: window starts, ids and anchor preference (features are read per rank)."""
        starts = self.windows.starts(self.batch, gen)
        listed = starts.tolist()
        return {"starts": starts, "ids": self.windows.ids(listed), "allowed": self.windows.anchors(listed)}

    def features(self, part: dict) -> torch.Tensor:
        """The features of a rank's share (part["starts"]), on the device of its ids."""
        return self.windows.features(part["starts"].tolist()).to(part["ids"].device)

    def final(self, part: dict) -> torch.Tensor | None:
        """The target's last-layer states of a rank's share, or None when not kept."""
        got = self.windows.final(part["starts"].tolist())
        return None if got is None else got.to(part["ids"].device)

    def heldout(self):
        return self.windows.heldout()
