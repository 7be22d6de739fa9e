"""x @ W.T on a CPU in whichever layout runs fastest here, chosen by measurement per weight shape and row count.

Why: the fp32 kernel behind F.linear reads a [N, K] weight at ~8 GB/s for one row (slower for two or three)
on the CPUs measured here, and re-lays the weight out on every call for several rows, while the same product
runs 2-4x faster against a weight laid out once for oneDNN, a transposed copy, or as (W @ x^T)^T. The demo
target's lm_head, cold: one row 1.4 -> 0.6 ms, eight 1.8 -> 0.7 ms, sixteen 2.0 -> 0.75 ms.

Forms: "linear"   F.linear(x, W)                 transformers' own, kept unless another is clearly faster
       "packed"   oneDNN on W laid out once       a copy of W (within COPY_BUDGET)
       "t"        x @ Wt, Wt a [K, N] copy       a copy of W (within COPY_BUDGET)
       "swapped"  (W @ x^T)^T, made contiguous   no copy
       "compiled" engine/row_matmul.c on W laid  a copy of W (within COPY_BUDGET); bf16 on a CPU with
                  out for AVX512-BF16 dot products   AVX512-BF16: each row alone, in a fixed order
Another layout sums the same products in another order: a row's last bits can differ from F.linear's, as
they already do between F.linear's own batch sizes. The choice is kept on disk, so every run of a model
computes its rows the same way.
"""
from __future__ import annotations

import functools
import os
import time
import weakref
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F

from . import kernels
from .disk import LoadWatch, cache_root, keep_if_quiet, notice, read_table
from .int8 import Int8Weight
from .q4 import Q4Weight, Q8Weight, fits

FORMS = ("linear", "packed", "t", "swapped", "compiled")
ROWS = (1, 2, 4, 8, 16, 32, 64)     # measured row counts; a count uses the form of the next measured one up
MARGIN = 0.85                       # another form replaces F.linear only when it takes < 85% of its time
COLD_BYTES = 96 << 20               # weights rotated through while timing: more than a CPU's last-level cache
MAX_COPIES = 64                     #   but no more copies than this (a tiny weight would need thousands)
COPY_BUDGET = 2 << 30               # bytes of weight copies (packed or transposed) per process
FREE_SHARE = 0.25                   # and never more than this share of the memory free now, timing included
DTYPES = (torch.float32, torch.bfloat16)


def applies(weight: torch.Tensor) -> bool:
    """A CPU weight whose timing copies fit (on an accelerator every product stays F.linear)."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and TIMING_COPIES * weight.numel() * weight.element_size() <= copy_cap())


TIMING_COPIES = 5   # the most copies of one weight alive while its forms are timed (the weight, t, packed, ...)


def free_bytes() -> int:
    """Memory available now (Linux /proc/meminfo; unbounded elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def copy_cap() -> int:
    """Bytes of weight copies a process may still make: COPY_BUDGET, within FREE_SHARE of free memory."""
    return min(COPY_BUDGET, int(FREE_SHARE * free_bytes()))


def packable(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN lays out a weight of this dtype here (bf16 needs AVX512 or AVX-NE-CONVERT: an AVX2 CPU refuses)."""
    return dtype in _packable_dtypes()


@functools.lru_cache(maxsize=1)
def _packable_dtypes() -> frozenset:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return frozenset()
    works = set()
    for dtype in DTYPES:
        try:
            pack(torch.zeros(16, 16, dtype=dtype))
            works.add(dtype)
        except RuntimeError:
            pass
    return frozenset(works)


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
        if "compiled" in forms.values() and not kernels.row_matmul_packable(self.weight):
            forms = {n: ("linear" if f == "compiled" else f) for n, f in forms.items()}
        if "packed" in forms.values() and not packable(self.weight.dtype):
            forms = {n: ("linear" if f == "packed" else f) for n, f in forms.items()}
        self.copies: dict[str, torch.Tensor] = {}
        for form, make in (("packed", pack), ("t", lambda w: w.t().contiguous()),
                           ("compiled", kernels.row_matmul_pack)):
            if form in forms.values():
                size = self.weight.numel() * self.weight.element_size()
                if Matmul.copied + size <= copy_cap():
                    self.copies[form], Matmul.copied = make(self.weight), Matmul.copied + size
                    weakref.finalize(self, Matmul.release, size)
                else:   # over budget: F.linear where this form was chosen
                    forms = {n: ("linear" if f == form else f) for n, f in forms.items()}
        self.forms = forms
        self.table = [forms[next(m for m in ROWS if m >= n)] for n in range(1, ROWS[-1] + 1)]
        # the compiled copy's kernel bound to it once (a decode step makes four such calls a layer)
        self.bound = kernels.row_matmul_bound(self.copies["compiled"]) if "compiled" in self.copies else None

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
        if form == "compiled":
            return self.bound(x)
        flat = x.reshape(rows, x.shape[-1])
        out = flat @ self.copies["t"] if form == "t" else (self.weight @ flat.t()).t().contiguous()
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def choose(cls, weight: torch.Tensor) -> dict[int, str]:
        """Measured once per machine, shape, dtype and thread count (a second or so), then kept on disk."""
        n_out, n_in = weight.shape
        key = table_key(weight)
        if key not in cls.measured:
            path = cache_root() / "matmul.json"
            saved = read_table(path).get(key)
            if isinstance(saved, dict) and set(saved) == {str(n) for n in ROWS} and set(saved.values()) <= set(FORMS):
                cls.measured[key] = {int(n): f for n, f in saved.items()}
            else:
                kernels.build_all()
                with LoadWatch() as watch:
                    cls.measured[key] = pick(time_forms(n_out, n_in, weight.dtype))
                keep_if_quiet(watch, path, key, {str(n): f for n, f in cls.measured[key].items()}, "matmul layouts")
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
    copies = min(MAX_COPIES, max(2, -(-COLD_BYTES // size)), max(2, copy_cap() // (len(FORMS) * size)))   # a small weight: a few reads between
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
    weights = [weight] + [weight.clone() for _ in range(copies - 1)]
    transposed = [w.t().contiguous() for w in weights]
    run = {"linear": lambda i, x: F.linear(x, weights[i]), "t": lambda i, x: x @ transposed[i],
           "swapped": lambda i, x: (weights[i] @ x.t()).t().contiguous()}
    if packable(dtype):
        packed = [pack(w) for w in weights]
        run["packed"] = lambda i, x: packed_product(x, packed[i])
    if kernels.row_matmul_packable(weight):
        bound = [kernels.row_matmul_bound(kernels.row_matmul_pack(w)) for w in weights]
        run["compiled"] = lambda i, x: bound[i](x)   # as Matmul calls it
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


CHUNKS = (64, 32, 16, 8, 4, 2, 1)   # rows one call of a RowMatmul may carry
CHECKED = tuple(range(2, 17)) + (17, 24, 31, 32, 33, 48, 63, 64)   # row counts whose rows are compared


PIECES = (1, 2, 4)   # a wide input may be cut into pieces: each piece's product row-invariant, summed in fp32


class RowMatmul:
    """x @ W.T with one form for every row count, called on at most `chunk` rows at a time (and, for a wide
    input, on `pieces` slices of it whose products are summed in fp32 in a fixed order), where that form gives
    every row the bits it gives that row alone: a row's product is the same in plain decoding (one row) and
    inside any tree. Form, chunk and pieces are measured once per shape, dtype, thread count and host."""

    measured: ClassVar[dict[str, tuple[str, int, int]]] = {}

    def __init__(self, weight: torch.Tensor, choice: tuple[str, int, int] | None = None):
        self.weight = weight.detach()
        self.form, self.chunk, self.pieces = choice or (
            self.choose(self.weight) if applies(self.weight) else ("linear", 1, 1))
        width = self.weight.shape[1] // self.pieces
        slices = [self.weight] if self.pieces == 1 else \
            [self.weight[:, i * width:(i + 1) * width].contiguous() for i in range(self.pieces)]
        self.inner = [Matmul(w, dict.fromkeys(ROWS, self.form)) for w in slices]
        if any(m.form(1) != self.form for m in self.inner):   # a copy did not fit: F.linear, row by row
            self.form, self.chunk, self.pieces = "linear", 1, 1
            self.inner = [Matmul.plain(self.weight)]
        # the compiled form of a whole weight: straight to its bound kernel, past the row-count lookups
        self.bound = self.inner[0].bound if self.form == "compiled" and self.pieces == 1 else None
        # that copy itself, for a caller that runs the kernel on it directly (engine/fused.py)
        self.packed = self.inner[0].copies["compiled"] if self.bound is not None else None

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.pieces == 1:
            return self.inner[0](x)
        width = x.shape[-1] // self.pieces
        total = self.inner[0](x[..., :width].contiguous()).float()
        for i in range(1, self.pieces):
            total = total + self.inner[i](x[..., i * width:(i + 1) * width].contiguous()).float()
        return total.to(x.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= self.chunk:
            return self.product(x) if self.bound is None else self.bound(x)
        flat = x.reshape(rows, x.shape[-1])
        out = torch.cat([self.product(flat[i:i + self.chunk]) for i in range(0, rows, self.chunk)])
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @classmethod
    def choose(cls, weight: torch.Tensor) -> tuple[str, int, int]:
        n_out, n_in = weight.shape
        key = table_key(weight) + "|row-invariant"
        if key not in cls.measured:
            path = cache_root() / "matmul.json"
            saved = read_table(path).get(key)
            if isinstance(saved, dict) and saved.get("form") in FORMS and saved.get("chunk") in CHUNKS \
                    and saved.get("pieces") in PIECES:
                cls.measured[key] = (saved["form"], saved["chunk"], saved["pieces"])
            else:
                announce(f"{n_out}x{n_in} {str(weight.dtype).removeprefix('torch.')}")
                kernels.build_all()
                with LoadWatch() as watch:
                    cls.measured[key] = measure_invariant(n_out, n_in, weight.dtype)
                form, chunk, pieces = cls.measured[key]
                keep_if_quiet(watch, path, key, {"form": form, "chunk": chunk, "pieces": pieces}, "matmul layouts")
        return cls.measured[key]


def measure_invariant(n_out: int, n_in: int, dtype) -> tuple[str, int, int]:
    """The fewest input pieces with which some form carries 16 rows or more row-invariantly, then the
    fastest form at that cut."""
    for pieces in PIECES:
        if n_in % pieces == 0:
            chunks = invariant_chunks(n_out, n_in // pieces, dtype)
            if max(chunks.values()) >= 16:
                break
    else:
        pieces, chunks = 1, invariant_chunks(n_out, n_in, dtype)
    form, chunk = pick_invariant(time_forms(n_out, n_in // pieces, dtype), chunks)
    return form, chunk, pieces


def invariant_chunks(n_out: int, n_in: int, dtype) -> dict[str, int]:
    """Per form, the most rows a call may carry with each row's bits those of that row alone."""
    weight, x = cancelling(n_out, n_in, CHECKED[-1], dtype)
    run = {"linear": lambda v: F.linear(v, weight)}
    if packable(dtype):
        packed = pack(weight)
        run["packed"] = lambda v: packed_product(v, packed)
    transposed = weight.t().contiguous()
    run["t"] = lambda v: v @ transposed
    if kernels.row_matmul_packable(weight):
        laid = kernels.row_matmul_pack(weight)
        run["compiled"] = lambda v: kernels.row_matmul(v, laid)
    chunks = {}
    with torch.inference_mode():
        for form, product in run.items():
            alone = torch.cat([product(x[i:i + 1]) for i in range(len(x))])
            good = [m for m in CHECKED if torch.equal(product(x[:m]), alone[:m])]
            chunks[form] = next(c for c in CHUNKS if all(m in good for m in CHECKED if m <= c))
    return chunks


def cancelling(n_out: int, n_in: int, rows: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight and rows whose products cancel to ~0 in exact arithmetic (each product meets its negative
    elsewhere in the row), so whatever a summation order rounds stays in the result: a bf16 output shows
    two orders apart where random data would round both to the same bits."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(n_out, n_in, generator=gen).to(dtype)
    x = torch.randn(rows, n_in, generator=gen).to(dtype)
    half = n_in // 2
    perm = torch.randperm(half, generator=gen)
    weight[:, half:2 * half] = -weight[:, :half][:, perm]
    x[:, half:2 * half] = x[:, :half][:, perm]
    return weight, x


def pick_invariant(seconds: dict[str, dict[int, float]], chunks: dict[str, int]) -> tuple[str, int]:
    """The form whose one-row product plus a 16-row product in chunks costs least; F.linear unless another
    takes < MARGIN of its time."""
    def cost(form: str) -> float:
        c = chunks[form]
        return seconds[form][1] + -(-16 // c) * seconds[form][min(16, c)]
    best = min(chunks, key=cost)
    best = best if cost(best) < MARGIN * cost("linear") else "linear"
    return best, chunks[best]


def table_key(weight: torch.Tensor) -> str:
    """What a measured choice depends on: shape, dtype, threads, torch, CPU capability, host, the forms
    there were to choose from and the compiled kernels' version."""
    n_out, n_in = weight.shape
    return (f"{n_out}x{n_in}|{weight.dtype}|threads={torch.get_num_threads()}|torch={torch.__version__}"
            f"|{torch.backends.cpu.get_cpu_capability()}|{machine()}|forms={','.join(FORMS)}|kernels={kernels.tag()}")


def machine() -> str:
    """This host's name: a cache folder shared between machines keeps each one's measurements apart."""
    import platform

    return platform.node() or "host"


def announce(what: str) -> None:
    """The first run on a machine measures each weight shape once (a second or so each): say so."""
    say(f"measuring the fastest row-invariant matmul for {what} (once per machine)")


def say(text: str) -> None:
    """A progress line on a terminal (or with TREEGEN_VERBOSE): what a first run spends its seconds on."""
    import sys

    if sys.stderr.isatty() or os.environ.get("TREEGEN_VERBOSE"):
        notice(f"treegen: {text}")


_per_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # model -> weight ids -> RowMatmul


def matmul_for(model, *weights: torch.Tensor) -> RowMatmul:
    """The model's RowMatmul for one of its weights, or for several stacked (one call for q, k and v):
    measured and copied once, kept as long as the model."""
    table = _per_model.setdefault(model, {})
    key = tuple(id(w) for w in weights)
    if key not in table:
        table[key] = RowMatmul(weights[0] if len(weights) == 1 else torch.cat(weights))
    return table[key]


FLOAT, INT8, BLOCKS = "float", "int8", "q4"   # a drafter's product forms (drafters/precision.py picks one)


def product(weight: torch.Tensor, form: str = FLOAT, head: bool = False):
    """x -> x @ W.T for a drafter's weight: its fastest float layout, its int8 form (engine/int8.py: a quarter
    of fp32's bytes) or, for a bf16 weight where row_q4.c serves, 4-bit blocks (Q8_0 for a head's rows:
    engine/q4.py); for drafters only, whose products need not be the target's bits."""
    if form == INT8:
        return Int8Weight.quantize(weight)
    if form == BLOCKS and blocks_fit(weight):
        return (Q8Weight if head else Q4Weight).quantize(weight)
    return Matmul(weight)


def blocks_fit(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and fits(*weight.shape)
            and kernels.q4_library() is not None)


class TunedForward:
    """An nn.Linear's forward through its Matmul (or another form); made again if the module's weight was
    replaced."""

    def __init__(self, module: torch.nn.Linear, form: str = FLOAT):
        self.module, self.form = weakref.ref(module), form
        self.source = (module.weight.data_ptr(), module.weight.dtype)
        self.matmul = product(module.weight, form)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module().weight
        if (weight.data_ptr(), weight.dtype) != self.source:
            self.source, self.matmul = (weight.data_ptr(), weight.dtype), product(weight, self.form)
        return self.matmul(x)


def tuned_product(module: torch.nn.Module):
    """The product a tuned Linear's forward runs now (tune_linears), or None for one not tuned."""
    forward = module.__dict__.get("forward")
    if not isinstance(forward, TunedForward):
        return None
    weight = module.weight
    if (weight.data_ptr(), weight.dtype) != forward.source:   # replaced since: made again on its next call
        return None
    return forward.matmul


def tune_linears(*modules: torch.nn.Module, form: str = FLOAT) -> None:
    """Every bias-free nn.Linear under these modules computes through a Matmul (or `form`'s product). For a
    drafter's own modules only (never the target's: its rows must stay what the lean forward or transformers
    compute)."""
    for root in modules:
        for module in root.modules():
            forward = module.__dict__.get("forward")   # shared, or tuned by a cast before
            tuned = isinstance(forward, TunedForward) and forward.form == form
            if type(module) is torch.nn.Linear and module.bias is None and applies(module.weight) and not tuned:
                module.forward = TunedForward(module, form)
