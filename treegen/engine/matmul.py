"""x @ W.T on a CPU in whichever layout runs fastest here, chosen by measurement per weight shape and row count.

Why: the fp32 kernel behind F.linear reads a [N, K] weight at ~8 GB/s for one row (slower for two or three)
on the CPUs measured here, and re-lays the weight out on every call for several rows, while the same product
runs 2-4x faster against a weight laid out once for oneDNN, a transposed copy, or as (W @ x^T)^T. The demo
target's lm_head, cold: one row 1.4 -> 0.6 ms, eight 1.8 -> 0.7 ms, sixteen 2.0 -> 0.75 ms.

Forms: "linear"   F.linear(x, W)                 transformers' own, kept unless another is clearly faster
       "packed"   oneDNN on W laid out once       a copy of W (within COPY_BUDGET)
       "t"        x @ Wt, Wt a [K, N] copy       a copy of W (within COPY_BUDGET)
       "swapped"  (W @ x^T)^T, made contiguous   no copy
Another layout sums the same products in another order: a row's last bits can differ from F.linear's, as
they already do between F.linear's own batch sizes. The choice is kept on disk, so every run of a model
computes its rows the same way.
"""
from __future__ import annotations

import time
import weakref
from typing import ClassVar

import torch
import torch.nn.functional as F

from .disk import cache_root, read_table, write_entry

FORMS = ("linear", "packed", "t", "swapped")
ROWS = (1, 2, 4, 8, 16, 32, 64)     # measured row counts; a count uses the form of the next measured one up
MARGIN = 0.85                       # another form replaces F.linear only when it takes < 85% of its time
COLD_BYTES = 96 << 20               # weights rotated through while timing: more than a CPU's last-level cache
MAX_COPIES = 64                     #   but no more copies than this (a tiny weight would need thousands)
COPY_BUDGET = 2 << 30               # bytes of weight copies (packed or transposed) per process
DTYPES = (torch.float32, torch.bfloat16)


def applies(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2


def packable() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight, 16)   # 16: a batch-size hint only


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


class Matmul:
    """x [..., K] -> x @ W.T [..., N], each row count in its measured-fastest form."""

    measured: ClassVar[dict[str, dict[int, str]]] = {}   # shape, dtype, threads, ... -> row count -> form
    copied: ClassVar[int] = 0                              # bytes of weight copies made so far

    def __init__(self, weight: torch.Tensor, forms: dict[int, str] | None = None):
        self.weight = weight.detach()
        if forms is None:
            forms = self.choose(self.weight) if applies(self.weight) else dict.fromkeys(ROWS, "linear")
        self.copies: dict[str, torch.Tensor] = {}
        for form, make in (("packed", pack), ("t", lambda w: w.t().contiguous())):
            if form in forms.values():
                size = self.weight.numel() * self.weight.element_size()
                if Matmul.copied + size <= COPY_BUDGET:
                    self.copies[form], Matmul.copied = make(self.weight), Matmul.copied + size
                    weakref.finalize(self, Matmul.release, size)
                else:   # over budget: F.linear where this form was chosen
                    forms = {n: ("linear" if f == form else f) for n, f in forms.items()}
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
        if form == "packed":
            return packed_product(x.contiguous(), self.copies["packed"])
        flat = x.reshape(rows, x.shape[-1])
        out = flat @ self.copies["t"] if form == "t" else (self.weight @ flat.t()).t().contiguous()
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def choose(cls, weight: torch.Tensor) -> dict[int, str]:
        """Measured once per machine, shape, dtype and thread count (a second or so), then kept on disk."""
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
    """Per row count the fastest form timed, F.linear unless another takes < MARGIN of its time."""
    forms = {}
    for n in ROWS:
        best = min(seconds, key=lambda f: seconds[f][n])
        forms[n] = best if seconds[best][n] < MARGIN * seconds["linear"][n] else "linear"   # not noise
    return forms


def time_forms(n_out: int, n_in: int, dtype, repeats: int = 7) -> dict[str, dict[int, float]]:
    """Fastest of `repeats` timings per form and row count, each on a weight not read since the cache
    last held it (copies rotated through), as in a forward where the other layers' weights come between."""
    size = n_out * n_in * torch.finfo(dtype).bits // 8
    copies = min(MAX_COPIES, max(2, -(-COLD_BYTES // size)))   # a small weight: a few reads between
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    transposed = [w.t().contiguous() for w in weights]
    run = {"linear": lambda i, x: F.linear(x, weights[i]), "t": lambda i, x: x @ transposed[i],
           "swapped": lambda i, x: (weights[i] @ x.t()).t().contiguous()}
    if packable():
        packed = [pack(w) for w in weights]
        run["packed"] = lambda i, x: packed_product(x, packed[i])
    seconds = {f: dict.fromkeys(ROWS, float("inf")) for f in run}
    turn = 0
    with torch.inference_mode():
        for _ in range(repeats):
            for n in ROWS:
                x = torch.randn(n, n_in, generator=gen).to(dtype)
                for form, product in run.items():
                    t0 = time.perf_counter()
                    product(turn % copies, x)
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


class TunedForward:
    """An nn.Linear's forward through its Matmul; made again if the module's weight was replaced."""

    def __init__(self, module: torch.nn.Linear):
        self.module, self.matmul = weakref.ref(module), Matmul(module.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module().weight
        if weight.data_ptr() != self.matmul.weight.data_ptr() or weight.dtype != self.matmul.weight.dtype:
            self.matmul = Matmul(weight)
        return self.matmul(x)


def tune_linears(*modules: torch.nn.Module) -> None:
    """Every bias-free nn.Linear under these modules computes through a Matmul. For a drafter's own
    modules only (never the target's: its rows must stay what the lean forward or transformers compute)."""
    for root in modules:
        for module in root.modules():
            tuned = isinstance(module.__dict__.get("forward"), TunedForward)   # shared, or tuned by a cast before
            if type(module) is torch.nn.Linear and module.bias is None and applies(module.weight) and not tuned:
                module.forward = TunedForward(module)
