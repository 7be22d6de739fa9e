"""The CPU verify forward's compiled kernels, built once per machine with the system's C compiler into the cache
folder and loaded with ctypes: row_attention.c (attention; without it engine/invariant.py's torch path serves,
the same row invariance, slower), row_matmul.c (bf16 products on AVX512-BF16; without it engine/matmul.py's
other forms serve), row_ops.c (RMS norm, rotary embedding), row_int8.c (weight-only int8 products,
engine/int8.py), row_q4.c (4-bit block products, engine/q4.py) and row_select.c (drafting's top-k and
support logits, drafters/select.py). None where no compiler is found or a build fails."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from .disk import cache_root

SOURCE = Path(__file__).with_name("row_attention.c")
MATMUL_SOURCE = Path(__file__).with_name("row_matmul.c")
OPS_SOURCE = Path(__file__).with_name("row_ops.c")
INT8_SOURCE = Path(__file__).with_name("row_int8.c")
SELECT_SOURCE = Path(__file__).with_name("row_select.c")
Q4_SOURCE = Path(__file__).with_name("row_q4.c")
DECODER_SOURCE = Path(__file__).with_name("row_decoder.c")   # includes the attention, product and ops sources
HEADER = Path(__file__).with_name("row_common.h")   # included by the sources: part of every build's name
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-fast-math")
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
ARGS = [_ptr, _ptr, _ptr] + [_i64] * 9 + [_ptr, _ptr, _i64, ctypes.c_float, _ptr, ctypes.c_int]
MATMUL_ARGS = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int]
INT8_ARGS = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, ctypes.c_int]
NORM_ARGS = [_ptr, _i64, _i64, _i64, _ptr, ctypes.c_float, _ptr]
ROPE_ARGS = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr]
TOP_ARGS = [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr]
GATHERED_ARGS = [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, ctypes.c_int]
MAX_ROPE_DIM = 1024


@functools.lru_cache(maxsize=1)
def tag() -> str:
    """The kernels' sources in a few characters: a measurement kept on disk (a verify cost, a matmul choice)
    belongs to the kernels it timed, and a new version measures again."""
    digest = hashlib.sha256()
    for path in (SOURCE, MATMUL_SOURCE, OPS_SOURCE, INT8_SOURCE, SELECT_SOURCE, DECODER_SOURCE, HEADER):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The built attention kernel, or None (no compiler, a failed build, or TREEGEN_NO_KERNELS set)."""
    lib = build(SOURCE)
    if lib is not None:
        for name in ("attend_f32", "attend_bf16"):
            getattr(lib, name).argtypes, getattr(lib, name).restype = ARGS, None
    return lib


@functools.lru_cache(maxsize=1)
def matmul_library() -> ctypes.CDLL | None:
    """The built bf16 product, or None (as library(), or a CPU without AVX512-BF16)."""
    lib = build(MATMUL_SOURCE)
    if lib is None or not lib.row_matmul_available():
        return None
    lib.row_matmul_bf16.argtypes, lib.row_matmul_bf16.restype = MATMUL_ARGS, None
    return lib


@functools.lru_cache(maxsize=1)
def ops_library() -> ctypes.CDLL | None:
    """The built row-wise ops (RMS norm, rotary embedding, a cache's compaction), or None (as library())."""
    lib = build(OPS_SOURCE)
    if lib is not None:
        for name, args in (("rms_norm_f32", NORM_ARGS), ("rms_norm_bf16", NORM_ARGS), ("rope_f32", ROPE_ARGS),
                           ("rope_bf16", ROPE_ARGS)):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, None
        lib.compact_rows.argtypes, lib.compact_rows.restype = [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr,
                                                               _i64], None
    return lib


@functools.lru_cache(maxsize=1)
def int8_library() -> ctypes.CDLL | None:
    """The built weight-only int8 product (row_int8.c: vectorized with AVX512F or AVX2 and FMA, plain C
    elsewhere), or None (as library())."""
    lib = build(INT8_SOURCE)
    if lib is not None:
        lib.row_int8_f32.argtypes, lib.row_int8_f32.restype = INT8_ARGS, None
        lib.row_int8_vectorized.argtypes, lib.row_int8_vectorized.restype = [], ctypes.c_int
    return lib


@functools.lru_cache(maxsize=1)
def q4_library() -> ctypes.CDLL | None:
    """The built 4-bit block product (row_q4.c), or None (as library(), or a CPU without AVX512-VNNI)."""
    lib = build(Q4_SOURCE)
    if lib is None or not lib.row_q4_available():
        return None
    for name in ("row_matmul_q4", "row_matmul_q8", "row_matmul_q8_streamed"):
        getattr(lib, name).argtypes, getattr(lib, name).restype = MATMUL_ARGS, None
    return lib


@functools.lru_cache(maxsize=1)
def select_library() -> ctypes.CDLL | None:
    """The built selections (row_select.c: drafting's per-row top-k with log-sum-exp and gathered dot products,
    greedy decoding's per-row argmax, sampling's per-row draw), or None (as library())."""
    lib = build(SELECT_SOURCE)
    if lib is not None:
        lib.top_k_lse_f32.argtypes, lib.top_k_lse_f32.restype = TOP_ARGS, None
        for name in ("gathered_dot_f32", "gathered_dot_bf16"):
            getattr(lib, name).argtypes, getattr(lib, name).restype = GATHERED_ARGS, None
        lib.argmax_rows.argtypes, lib.argmax_rows.restype = [_ptr, _i64, _i64, _i64, ctypes.c_int, _ptr], None
        lib.sample_rows.argtypes = [_ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_float, _ptr, _ptr, _ptr]
        lib.sample_rows.restype = _i64
    return lib


@functools.lru_cache(maxsize=1)
def decoder_library() -> ctypes.CDLL | None:
    """The built whole-stack forward (row_decoder.c, bf16 on AVX512-BF16), or None (as matmul_library())."""
    lib = build(DECODER_SOURCE, SOURCE, MATMUL_SOURCE, OPS_SOURCE, Q4_SOURCE)
    if lib is None or not lib.decoder_available():
        return None
    lib.decoder_bf16.restype = lib.draft_bf16.restype = lib.treeflash_head_bf16.restype = None
    return lib


def int8_build() -> str | None:
    """How the int8 product was built, in words (treegen info); None without it."""
    lib = int8_library()
    return None if lib is None else ("plain C", "AVX2+FMA", "AVX512F")[lib.row_int8_vectorized()]


def build(path: Path, *included: Path) -> ctypes.CDLL | None:
    """path built into a shared library in the cache folder (its name: the sources it includes, compiler,
    flags and CPU), loaded; None where that fails."""
    cc = compiler()
    if cc is None or os.environ.get("TREEGEN_NO_KERNELS"):
        return None
    source = b"".join(p.read_bytes() for p in (path, *included, HEADER))
    tag = hashlib.sha256(source + " ".join((cc, *FLAGS, platform.machine(), cpu_flags())).encode()).hexdigest()[:16]
    built = cache_root() / "kernels" / f"{path.stem}-{tag}.so"
    if not built.exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        tmp = built.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run([cc, *FLAGS, "-o", str(tmp), str(path), "-lm"], check=True, capture_output=True,
                           timeout=120)
            tmp.replace(built)
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            return None
    try:
        return ctypes.CDLL(str(built))
    except OSError:
        return None


def cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native: a copy in a shared home must not cross CPUs)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def usable(q: torch.Tensor, dim: int) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and dim % 16 == 0
            and dim <= 512 and library() is not None)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, past: int, own: torch.Tensor,
           count: torch.Tensor, scale: float) -> torch.Tensor:
    """q [H, n, D], keys / values [KV, S, D] (the cache with this forward's rows), own [n, m] each row's
    ancestors then itself (offsets from past), count [n] -> [n, H, D] fp32."""
    heads, rows, dim = q.shape
    kv = keys.shape[0]
    own, count = own.contiguous(), count.contiguous()
    if keys.stride(-1) != 1 or values.stride() != keys.stride() or q.stride(-1) != 1:
        keys, values, q = keys.contiguous(), values.contiguous(), q.contiguous()
    out = torch.empty(rows, heads, dim, dtype=torch.float32)
    fn = library().attend_bf16 if q.dtype == torch.bfloat16 else library().attend_f32
    fn(q.data_ptr(), keys.data_ptr(), values.data_ptr(), heads, kv, rows, dim, q.stride(0), q.stride(1),
       keys.stride(0), keys.stride(1), past, own.data_ptr(), count.data_ptr(), own.shape[1], scale,
       out.data_ptr(), torch.get_num_threads())
    return out


def row_matmul_packable(weight: torch.Tensor) -> bool:
    """A bf16 CPU weight the compiled product takes: outputs in whole 64s, an even width, the kernel built."""
    n, k = weight.shape
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and n % 64 == 0 and k % 2 == 0
            and matmul_library() is not None)


def row_matmul_pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2]: sixteen outputs' pairs of k side by side, as one load of the kernel."""
    n, k = weight.shape
    return weight.detach().view(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def row_matmul(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [..., K] bf16 @ W.T with W packed by row_matmul_pack -> [..., N] bf16, each row alone in a fixed order."""
    return row_matmul_bound(packed)(x)


def row_matmul_bound(packed: torch.Tensor):
    """row_matmul with one packed weight bound: its shape, pointer and the kernel looked up once, not on each
    of a decode step's calls, four a layer and the lm_head's (the same call, the same bits)."""
    blocks, pairs = packed.shape[:2]
    return bf16_product(matmul_library().row_matmul_bf16, packed, blocks * 16, pairs * 2)


def bf16_product(kernel, packed: torch.Tensor, n: int, k: int):
    """x [..., K] bf16 -> [..., N] bf16 through a compiled product with MATMUL_ARGS over one laid-out weight."""
    weight = packed.data_ptr()

    def call(x: torch.Tensor, _keep=packed) -> torch.Tensor:
        flat = x.reshape(-1, k)
        if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) < k):
            flat = flat.contiguous()
        out = torch.empty(flat.shape[0], n, dtype=torch.bfloat16)
        kernel(flat.data_ptr(), flat.shape[0], flat.stride(0), weight, n, k, out.data_ptr(), n,
               torch.get_num_threads())
        return out.view(*x.shape[:-1], n)
    return call


INT8_GROUP = 32   # outputs side by side in row_int8.c's layout


def int8_pack(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 -> [N/32, K, 32]: the k-th weights of 32 outputs side by side, as the kernel streams them."""
    n, k = q.shape
    return q.view(n // INT8_GROUP, INT8_GROUP, k).permute(0, 2, 1).contiguous()


def int8_unpack(packed: torch.Tensor) -> torch.Tensor:
    groups, k, _ = packed.shape
    return packed.permute(0, 2, 1).reshape(groups * INT8_GROUP, k)


def int8_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] fp32 @ (scale[:, None] * Q).T with Q packed by int8_pack -> [..., N] fp32, each row alone in
    a fixed order (row_int8.c)."""
    return int8_matmul_bound(packed, scale)(x)


def int8_matmul_bound(packed: torch.Tensor, scale: torch.Tensor):
    """x -> int8_matmul(x.float(), packed, scale) in x's dtype, the weight bound once (as row_matmul_bound)."""
    groups, k, _ = packed.shape
    n = groups * INT8_GROUP
    kernel, weight, scales = int8_library().row_int8_f32, packed.data_ptr(), scale.data_ptr()

    def call(x: torch.Tensor, _keep=(packed, scale)) -> torch.Tensor:
        flat = x.reshape(-1, k).float()
        if flat.stride(-1) != 1 or (flat.shape[0] > 1 and flat.stride(0) < k):
            flat = flat.contiguous()
        out = torch.empty(flat.shape[0], n, dtype=torch.float32)
        kernel(flat.data_ptr(), flat.shape[0], flat.stride(0), weight, scales, n, k, out.data_ptr(), n,
               torch.get_num_threads())
        return out.view(*x.shape[:-1], n).to(x.dtype)
    return call


def q4_matmul_bound(packed: torch.Tensor, q8: bool = False):
    """x [..., K] bf16 -> x @ W.T [..., N] bf16 for W packed by engine/q4.py as Q4_1 (or, q8, Q8_0) blocks
    (row_q4.c), bound once as row_matmul_bound."""
    groups, blocks, _ = packed.shape
    name = "row_matmul_q4"
    if q8:   # a head over a quarter of the last-level cache is evicted between steps: prefetched farther ahead
        name = "row_matmul_q8_streamed" if 4 * packed.numel() > last_level_cache() else "row_matmul_q8"
    return bf16_product(getattr(q4_library(), name), packed, groups * 32, blocks * 32)


@functools.cache
def last_level_cache() -> int:
    """Bytes of this CPU's largest cache (sysfs; 32 MiB where it does not say)."""
    sizes, units = [], {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        try:
            sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (ValueError, IndexError):
            continue
    return max(sizes, default=32 * 2 ** 20)


def ops_usable(x: torch.Tensor, dim: int) -> bool:
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) and dim % 16 == 0
            and dim <= MAX_ROPE_DIM and ops_library() is not None)


def _suffix(x: torch.Tensor) -> str:
    return "bf16" if x.dtype == torch.bfloat16 else "f32"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * (x * rsqrt(mean(x^2) + eps)) in x's dtype, each row alone (row_ops.c)."""
    dim = x.shape[-1]
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    getattr(ops_library(), f"rms_norm_{_suffix(x)}")(x.data_ptr(), x.numel() // dim, dim, dim,
                                                      weight.data_ptr(), eps, out.data_ptr())
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [1, n, heads, D] in place (heads D apart within a row, rows any stride apart) by cos / sin
    [n, D] of its dtype: x * cos + rotate_half(x) * sin (row_ops.c)."""
    _, n, heads, dim = x.shape
    assert x.stride(3) == 1 and x.stride(2) == dim and cos.is_contiguous() and sin.is_contiguous()
    getattr(ops_library(), f"rope_{_suffix(x)}")(x.data_ptr(), n, x.stride(1), heads, dim, cos.data_ptr(),
                                                 sin.data_ptr())
    return x


def build_all() -> None:
    """Every kernel built now: before a measurement starts, so that the compiler's processes do not count as
    other work on the machine (disk.LoadWatch)."""
    library(), matmul_library(), ops_library(), int8_library(), q4_library(), select_library(),
    decoder_library()
