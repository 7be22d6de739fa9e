"""The drafter's compute precision (the `dtype` option of every method with a drafter), and the target's
embedding and lm_head placed where the drafter reads them.

Drafts only propose: verification runs the target at its own precision, so a drafter in another dtype
changes what is drafted, never what is generated (T=0 output equals the target's greedy output; at T > 0
the laws drafts were drawn from are what verification divides by, in whatever precision they came)."""
from __future__ import annotations

import torch

from ..engine import kernels, matmul, q4
from ..engine.forms import own_weight
from ..engine.prefill import input_device
from ..loading import DTYPES, native_bf16
from . import defaults as D

INT8 = torch.int8     # as a drafter dtype: fp32 weights whose products run in their int8 form (engine/int8.py)
BLOCKS = torch.uint8  # as a drafter dtype: bf16 weights whose products run as 4-bit blocks (engine/q4.py)


def draft_dtype(name: str, target) -> torch.dtype:
    """`auto`, on a CPU: 4-bit block products where row_q4.c serves, for a target in blocks (`--dtype q4`) or
    one the drafter would otherwise draft for in bf16 (a bf16 target, or an fp32 one on a CPU with native bf16):
    the same drafts' ranking at a third of bf16's bytes and twice its products a cycle; else, for an fp32
    target, bf16 where the CPU has native bf16 and int8 products where their kernel built (a quarter of fp32's
    bytes a pass); otherwise the target's own dtype."""
    if name == "int8":
        return INT8
    if name == "q4":
        return BLOCKS
    if name != D.DTYPE:
        return DTYPES[name]
    weight = target.get_input_embeddings().weight
    return auto_dtype(weight.dtype, q4.is_q4(target), input_device(target).type == "cpu")


def auto_dtype(weight: torch.dtype, blocks: bool, cpu: bool) -> torch.dtype:
    """`auto` for a target whose embedding is in `weight` (`blocks`: its linears are 4-bit blocks), on a CPU
    or not: draft_dtype's rule."""
    if not cpu:
        return weight
    float_bf16 = weight == torch.bfloat16 or (weight == torch.float32 and native_bf16())
    if (blocks or float_bf16) and kernels.q4_library() is not None:
        return BLOCKS
    if weight == torch.float32:
        if native_bf16():
            return torch.bfloat16
        if kernels.int8_library() is not None:
            return INT8
    return weight


def auto_words(weight: torch.dtype) -> str:
    """What `auto` drafts in on this CPU beside a target in `weight` (treegen info)."""
    dtype = auto_dtype(weight, False, True)
    return {BLOCKS: "4-bit block products (q4)", INT8: "int8 products"}.get(dtype, str(dtype).removeprefix("torch."))


def float_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a drafter's weights are kept in: int8 drafting keeps fp32 weights, block drafting bf16 (its
    products quantize them)."""
    return torch.float32 if dtype == INT8 else torch.bfloat16 if dtype == BLOCKS else dtype


def product_form(dtype: torch.dtype) -> str:
    """The form a drafter's products take in this drafter dtype (engine/matmul.product)."""
    return {INT8: matmul.INT8, BLOCKS: matmul.BLOCKS}.get(dtype, matmul.FLOAT)


# -- the target's embedding and lm_head as the drafter reads them (its own device and dtype) ---------------

def weight_of(module) -> torch.Tensor:
    """The module's weight, read from accelerate's offload map when it is not in memory (on meta)."""
    weight = module.weight
    if weight.device.type != "meta":
        return weight.detach()
    offloaded = getattr(getattr(module, "_hf_hook", None), "weights_map", None)
    if offloaded is None:
        raise ValueError(f"the target's {type(module).__name__} has no weight in memory (meta) and no offload map")
    return offloaded["weight"]


def resident(module, device: torch.device, dtype: torch.dtype) -> bool:
    """The module's weight is in memory on `device` in `dtype`: the drafter can read it as it is."""
    return module.weight.device == device and module.weight.dtype == dtype


def readable_head(lm_head, dtype: torch.dtype):
    """The target's lm_head with rows a drafter can read: an int8 head (`--dtype int8`, engine/int8.py) or a
    block one (`--dtype q4`, engine/q4.py) as the float weight its values stand for, in `dtype` (drafts only
    propose: the target verifies with its own form)."""
    own = own_weight(lm_head)
    if own is not None:
        return own_linear(torch.nn.Parameter(own.dequantized(dtype), requires_grad=False))
    return lm_head


def plain_head(module) -> bool:
    return type(module) is torch.nn.Linear and module.bias is None


def embedding_on(embed, device: torch.device, dtype: torch.dtype):
    """The target's embedding where the drafter can use it as it is (its hooks kept), else a frozen copy on
    the drafter's device in its dtype (another GPU of a device map, offloaded, or another dtype)."""
    if resident(embed, device, dtype):
        return embed
    return torch.nn.Embedding.from_pretrained(weight_of(embed).to(device=device, dtype=dtype))


def head_on(lm_head, device: torch.device, dtype: torch.dtype, tied: torch.Tensor | None = None):
    """The drafter's lm_head: a bias-free Linear of its own over the target's weight where that is resident
    (shared, not copied: tuning it never touches the target's module), over `tied` (the drafter's embedding
    weight, for a tied target), else over a copy on the drafter's device in its dtype. Drafters read the
    weight's rows directly (drafters/treeflash.py), so it must be where they run, not behind a device hook."""
    if not plain_head(lm_head):
        if resident(lm_head, device, dtype):
            return lm_head   # the target's own module, hooks and all
        raise ValueError(f"a drafter on another device or dtype than the target's lm_head needs a plain lm_head "
                         f"(a bias-free Linear), not {type(lm_head).__name__}")
    if tied is not None:
        return own_linear(tied)
    if resident(lm_head, device, dtype):
        return own_linear(lm_head.weight)
    return own_linear(torch.nn.Parameter(weight_of(lm_head).to(device=device, dtype=dtype), requires_grad=False))


def own_linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free Linear of the drafter's own over `weight` (shared, not copied): tuning its forward
    (engine/matmul.py) must never touch a module of the target's."""
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = weight if isinstance(weight, torch.nn.Parameter) else torch.nn.Parameter(weight, False)
    return linear
