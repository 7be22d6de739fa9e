"""Training text: files, folders and JSONL of texts; and target-regenerated continuations."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .common import encode_corpus, random_windows

TEXT_SUFFIXES = {".txt", ".py", ".md", ".rst", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".json"}


class DataError(ValueError):
    pass


def read_data(paths: list[str]) -> list[str]:
    """Texts from files (a JSONL file gives one text per line: {"text": ...}) and folders (recursively)."""
    texts: list[str] = []
    for name in paths:
        path = Path(name).expanduser()
        if not path.exists():
            raise DataError(f"{name}: no such file or folder")
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES | {".jsonl"}) if path.is_dir() \
            else [path]
        for f in files:
            texts.extend(_jsonl(f) if f.suffix == ".jsonl" else [f.read_text(encoding="utf-8", errors="replace")])
    if not texts:
        raise DataError(f"no training text found in {', '.join(paths)}")
    return texts


def _jsonl(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{i}: not JSON ({err.msg})") from err
        text = row.get("text") if isinstance(row, dict) else None
        if not isinstance(text, str):
            raise DataError(f"{path}:{i}: expected an object with a string 'text' field")
        out.append(text)
    return out


def tokenize(texts: list[str], tokenizer) -> torch.Tensor:
    return encode_corpus(texts, tokenizer)


def read_stream(paths: list[str], tokenizer) -> torch.Tensor:
    """One token stream from saved streams (.pt files of 1-D integer ids, as --regenerate caches) and
    text files / folders / JSONL (tokenized), concatenated in the order given."""
    parts, texts = [], []
    for name in paths:
        if name.endswith(".pt"):
            parts.append(load_stream(name))
        else:
            texts.append(name)
    if texts:
        parts.append(tokenize(read_data(texts), tokenizer))
    return torch.cat([p.to(torch.int32) for p in parts]) if len(parts) > 1 else parts[0]


def load_stream(name: str) -> torch.Tensor:
    import pickle

    try:
        stream = torch.load(name)
    except (OSError, RuntimeError, pickle.UnpicklingError, EOFError) as err:
        raise DataError(f"{name}: cannot read a token stream ({str(err).splitlines()[0]})") from err
    if not isinstance(stream, torch.Tensor) or stream.dim() != 1 or stream.is_floating_point():
        raise DataError(f"{name}: expected a 1-D integer tensor of token ids")
    return stream


@torch.no_grad()
def regenerate(target, stream: torch.Tensor, n_seqs: int, prompt_len: int, gen_len: int,
               temperatures: tuple[float, ...] = (0.0, 1.0), batch: int = 32, seed: int = 0, log=None, rt=None):
    """[n_seqs, prompt_len + gen_len] (on the CPU): corpus prompts continued by the target itself, so the
    drafter learns the target's own distribution (as the published drafters were trained). Under torchrun
    (rt) the ranks share the batches round robin and every rank gets them all back in order: the same rows
    as one process makes (each batch's prompts, temperature and seed depend on its index alone)."""
    gen = torch.Generator().manual_seed(seed)
    jobs = [(i, random_windows(stream, min(batch, n_seqs - i), prompt_len, gen), temperatures[k % len(temperatures)])
            for k, i in enumerate(range(0, n_seqs, batch))]   # every rank draws them all: the same prompts
    rows = {}
    for k in (rt.mine(len(jobs)) if rt else range(len(jobs))):
        i, prompts, temp = jobs[k]
        torch.manual_seed(seed + i)
        sampling = {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0} if temp > 0 \
            else {"do_sample": False}
        out = target.generate(prompts.to(target.device), max_new_tokens=gen_len, min_new_tokens=gen_len, **sampling)
        rows[i] = out[:, :prompt_len + gen_len].cpu()
        if log:
            log(f"regenerated {sum(len(r) for r in rows.values())}/{n_seqs} sequences (T={temp})")
    merged = {i: r for part in (rt.gather(rows) if rt else [rows]) for i, r in part.items()}
    return torch.cat([merged[i] for i in sorted(merged)])
