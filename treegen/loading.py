"""Loading a target model and its tokenizer: hub id or local folder, dtype, device, device_map, bitsandbytes."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from . import validate
from .engine import int8, q4

DEFAULT_DTYPE = "auto"
DEFAULT_DEVICE = "auto"
DEFAULT_ATTN = "sdpa"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
          "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
INT8 = int8.NAME   # weight-only int8 linears, the rest in auto's dtype
Q4 = q4.NAME       # the decoder's linears as Q4_1 blocks (int8 activations), the rest in auto's dtype


class LoadError(RuntimeError):
    """A model or tokenizer that cannot be loaded; the message is one line for the user."""


def resolve_device(device: str = DEFAULT_DEVICE) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LoadError(f"--device {device} asked for, but this machine has no CUDA device")
    if device == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise LoadError("--device mps asked for, but this machine has no MPS device (Apple silicon)")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise LoadError(f"unknown device {device!r}: use auto, cpu, cuda, cuda:N or mps") from err


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype: auto's is bf16 where the device multiplies it natively, else fp32 (int8 linear layers,
    int8_weights, compute in it too)."""
    if dtype in ("auto", INT8, Q4):   # bf16 where the device multiplies it natively: half the bytes a token reads
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if device.type == "cpu" and native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise LoadError(f"unknown dtype {dtype!r}: use auto, fp32, fp16, bf16, int8 or q4")
    return DTYPES[dtype]


def int8_weights(dtype: str, device: torch.device) -> bool:
    """Whether the target loads with int8 linear layers (engine/int8.py): asked for, or `auto` on a CPU without
    native bf16 where the compiled int8 product builds (it reads a quarter of fp32's bytes a token)."""
    if dtype == INT8:
        return True
    if dtype != "auto" or device.type != "cpu" or native_bf16():
        return False
    from .engine import kernels

    return kernels.int8_library() is not None


def q4_native(device: torch.device, types: tuple[str, ...] = ("Q4_1",)) -> bool:
    """Whether `auto` loads a GGUF with these tensor types as its own blocks (`q4`, engine/q4.py): Q4_1 linears,
    on a CPU with native bf16 where row_q4.c builds (AVX512-VNNI): 5 bits a layer weight where bf16 reads 16."""
    if "Q4_1" not in types or device.type != "cpu" or not native_bf16():
        return False
    from .engine import kernels

    return kernels.q4_library() is not None


def loads_blocks(dtype: str, device: torch.device, types: tuple[str, ...], quantized: bool = False) -> bool:
    """Whether --dtype loads a target (a GGUF with these tensor types, or none) as blocks (`q4`): asked for,
    or `auto` where q4_native holds and neither bitsandbytes nor a device map places the weights (quantized)."""
    return dtype.lower() == Q4 or (dtype.lower() == "auto" and not quantized and q4_native(device, types))


def auto_weights(device: torch.device) -> str:
    """What `--dtype auto` loads on this device, in words (treegen info)."""
    compute = str(resolve_dtype("auto", device)).removeprefix("torch.")
    words = f"int8 linear layers, {compute} elsewhere" if int8_weights("auto", device) else compute
    return words + ("; a Q4_1 GGUF as its own blocks (q4)" if q4_native(device) else "")


def native_bf16() -> bool:
    """A CPU with bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def check_source(name: str) -> str:
    """A local folder must exist and hold a config.json (or one .gguf file, as a .gguf path may name);
    an OWNER/NAME is a hub id (see treegen.validate)."""
    try:
        return validate.check_source(name, "target")
    except validate.OptionError as err:
        raise LoadError(str(err)) from None


def gguf_converted(source: str) -> tuple[str, tuple[str, ...]]:
    """A GGUF target is loaded from its converted folder in the cache (converted on its first load); -> the
    folder and the file's tensor types (none for another source)."""
    from . import gguf

    try:
        file = gguf.gguf_file(Path(source)) if Path(source).exists() else None
        if file is None:
            return source, ()
        folder = gguf.cached_target(file)
        return str(folder), gguf.tensor_types(file, folder)
    except gguf.GGUFError as err:
        raise LoadError(str(err)) from None


def check_hub(source: str) -> None:
    """A hub id that is neither cached nor reachable fails now, not after the hub client's retries."""
    if not Path(source).exists():
        problem = validate.hub_problem(source)
        if problem:
            raise LoadError(problem)


def _quantization(load_in_8bit: bool, load_in_4bit: bool, compute_dtype: torch.dtype):
    if load_in_8bit and load_in_4bit:
        raise LoadError("choose one of --load-in-8bit and --load-in-4bit")
    if not (load_in_8bit or load_in_4bit):
        return None
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError as err:
        raise LoadError(f"4/8-bit loading needs bitsandbytes: {err}") from err
    if load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_type="nf4")


def quiet_transformers() -> None:
    """Progress bars and advice from transformers would land in the user's stderr (and pipes)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(check_source(name))
    except (OSError, ValueError) as err:
        raise LoadError(f"cannot load a tokenizer from {name}: {_first_line(err)}") from err
    if len(tokenizer) <= 1:  # transformers 5 builds an empty tokenizer when the files are missing
        raise LoadError(f"{name}: no tokenizer files (tokenizer.json, vocab) found")
    return tokenizer


def load_target(name: str, *, dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE,
                device_map: str | None = None, load_in_8bit: bool = False, load_in_4bit: bool = False,
                attn_implementation: str = DEFAULT_ATTN):
    """(model, tokenizer) for a causal LM, in eval mode, on the chosen device."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    source, types = gguf_converted(check_source(name))
    dev = resolve_device(device)
    check_hub(source)
    if loads_blocks(dtype, dev, types, quantized=device_map is not None or load_in_8bit or load_in_4bit):
        dtype = Q4   # the file's own blocks, multiplied as they are
    torch_dtype = resolve_dtype(dtype, dev)
    quant = _quantization(load_in_8bit, load_in_4bit, torch_dtype)
    as_int8 = quant is None and int8_weights(dtype, dev)
    if dtype in (INT8, Q4) and quant is not None:
        raise LoadError(f"--dtype {dtype} quantizes the weights itself: leave out --load-in-8bit / --load-in-4bit")
    # q4 reads fp32 first: a Q4_1 GGUF's blocks are found again exactly only from its dequantized fp32 values
    kwargs = {"dtype": torch.float32 if dtype == Q4 else torch_dtype, "attn_implementation": attn_implementation}
    if quant is not None:
        kwargs["quantization_config"] = quant
    if device_map is not None:
        kwargs["device_map"] = device_map
    elif quant is not None:
        kwargs["device_map"] = {"": dev}
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except ValueError as err:
        raise LoadError(f"{name} is not a causal language model transformers can load: {_first_line(err)}") from err
    except OSError as err:
        where = "this folder" if Path(source).exists() else "the hub (offline?) or a local folder"
        raise LoadError(f"cannot load {name} from {where}: {_first_line(err)}") from err
    except (RuntimeError, SafetensorError) as err:  # weights that are corrupt or do not fit the config
        raise LoadError(f"cannot load the weights of {name}: {_first_line(err)}") from err
    if device_map is None and quant is None:
        model = model.to(dev)
    if as_int8:
        int8.quantize(model)
    if dtype == Q4:
        q4.quantize(model)
        model = model.to(torch_dtype)   # the rest (embeddings, norms, lm_head); the blocks are uint8 buffers
    model.eval()
    return model, load_tokenizer(source)


def context_length(model, tokenizer=None) -> int | None:
    """Positions the target was built for (max_position_embeddings)."""
    return getattr(model.config, "max_position_embeddings", None)


def eos_ids(model, tokenizer) -> frozenset[int]:
    """EOS ids of the generation config and the tokenizer, together."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
