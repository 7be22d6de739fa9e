"""x @ W.T on a CPU in whichever layout streams the weight fastest, chosen by measurement per weight shape.

Why: the fp32 kernel behind F.linear reads a [N, K] weight at ~8 GB/s for one row (and slower for two or
three) on the CPUs measured here, while the same products laid out differently run 2-4x faster: one row
against a transposed copy of W (x @ W^T stored [K, N]), several rows as (W @ x^T)^T. Each layout sums the
same products in another order, so the last bits of a row can differ, as they do between batch sizes of
F.linear itself. The demo target's lm_head: 1.5 -> 0.75 ms for one row, 3.1 -> 1.7 ms for eight.

Forms: "linear"   F.linear(x, W)                 transformers' own, kept unless another is clearly faster
       "t"        x @ Wt, Wt a [K, N] copy       the weight's size again in memory (within COPY_BUDGET)
       "swapped"  (W @ x^T)^T, made contiguous   no copy
"""
from __future__ import annotations

import time
import weakref
from typing import ClassVar

import torch
import torch.nn.functional as F

from .disk import cache_root, read_table, write_entry

FORMS = ("linear", "t", "swapped")
ROWS = (1, 2, 4, 8, 16, 32, 64)     # measured row counts; a count uses the form of the next measured one up
MARGIN = 0.85                       # another form replaces F.linear only when it takes < 85% of its time
COLD_BYTES = 96 << 20               # weights rotated through while timing: more than a CPU's last-level cache
COPY_BUDGET = 1 << 30               # bytes of transposed copies per process


def applies(weight: torch.Tensor) -> bool:
    """Only fp32 on a CPU: bf16 and GPU kernels showed no such gap."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2


class Matmul:
    """x [..., K] -> x @ W.T [..., N], each row count in its measured-fastest form."""

    measured: ClassVar[dict[str, dict[int, str]]] = {}   # shape, dtype, threads, ... -> row count -> form
    copied: ClassVar[int] = 0                              # bytes of transposed copies made so far

    def __init__(self, weight: torch.Tensor, forms: dict[int, str] | None = None):
        self.weight = weight.detach()
        if forms is None:
            forms = self.choose(self.weight) if applies(self.weight) else {n: "linear" for n in ROWS}
        self.wt = None
        if "t" in forms.values():
            size = self.weight.numel() * self.weight.element_size()
            if Matmul.copied + size <= COPY_BUDGET:
                self.wt, Matmul.copied = self.weight.t().contiguous(), Matmul.copied + size
                weakref.finalize(self, Matmul.release, size)
            else:   # over budget: the best form that needs no copy
                forms = {n: ("linear" if f == "t" else f) for n, f in forms.items()}
        self.forms = forms
        self.table = [forms[next(m for m in ROWS if m >= n)] for n in range(1, ROWS[-1] + 1)]

    @classmethod
    def plain(cls, weight: torch.Tensor) -> Matmul:
        """F.linear for every row count: transformers' own bits."""
        return cls(weight, dict.fromkeys(ROWS, "linear"))

    @classmethod
    def release(cls, size: int) -> None:
        cls.copied -= size

    def form(self, rows: int) -> str:
        return self.table[min(rows, ROWS[-1]) - 1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        form = self.form(rows)
        if form == "linear":
            return F.linear(x, self.weight)
        flat = x.reshape(rows, x.shape[-1])
        out = flat @ self.wt if form == "t" else (self.weight @ flat.t()).t().contiguous()
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def choose(cls, weight: torch.Tensor) -> dict[int, str]:
        """Measured once per machine, shape, dtype and thread count; kept on disk, so every run of a model
        computes its rows the same way (the same last bits, the same outputs)."""
        n_out, n_in = weight.shape
        key = (f"{n_out}x{n_in}|{weight.dtype}|threads={torch.get_num_threads()}|torch={torch.__version__}"
               f"|{torch.backends.cpu.get_cpu_capability()}")
        if key not in cls.measured:
            path = cache_root() / "matmul.json"
            saved = read_table(path).get(key)
            if isinstance(saved, dict) and set(saved) == {str(n) for n in ROWS} and set(saved.values()) <= set(FORMS):
                cls.measured[key] = {int(n): f for n, f in saved.items()}
            else:
                cls.measured[key] = pick(time_forms(n_out, n_in, weight.dtype))
                write_entry(path, key, {str(n): f for n, f in cls.measured[key].items()})
        return cls.measured[key]


def pick(seconds: dict[str, dict[int, float]]) -> dict[int, str]:
    """Per row count the fastest form, F.linear unless another takes < MARGIN of its time."""
    forms = {}
    for n in ROWS:
        best = min(FORMS, key=lambda f: seconds[f][n])
        forms[n] = best if seconds[best][n] < MARGIN * seconds["linear"][n] else "linear"   # not noise
    return forms


def time_forms(n_out: int, n_in: int, dtype, repeats: int = 7) -> dict[str, dict[int, float]]:
    """Fastest of `repeats` timings per form and row count, each on a weight not read since the cache
    last held it (copies rotated through), as in a forward where the other layers' weights come between."""
    copies = max(2, -(-COLD_BYTES // (n_out * n_in * torch.finfo(dtype).bits // 8)))
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=gen, dtype=dtype)
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    transposed = [w.t().contiguous() for w in weights]
    run = {"linear": lambda i, x: F.linear(x, weights[i]), "t": lambda i, x: x @ transposed[i],
           "swapped": lambda i, x: (weights[i] @ x.t()).t().contiguous()}
    seconds = {f: dict.fromkeys(ROWS, float("inf")) for f in FORMS}
    turn = 0
    with torch.inference_mode():
        for _ in range(repeats):
            for n in ROWS:
                x = torch.randn(n, n_in, generator=gen, dtype=dtype)
                for form in FORMS:
                    t0 = time.perf_counter()
                    run[form](turn % copies, x)
                    seconds[form][n] = min(seconds[form][n], time.perf_counter() - t0)
                    turn += 1
    return seconds


_per_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> id(weight) -> Matmul


def matmul_for(model, weight: torch.Tensor) -> Matmul:
    """The model's Matmul for one of its weights: measured and copied once, kept as long as the model."""
    table = _per_model.setdefault(model, {})
    if id(weight) not in table:
        table[id(weight)] = Matmul(weight)
    return table[id(weight)]
