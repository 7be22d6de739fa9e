"""What the target's weights are as loaded, in words and counts: treegen's own forms (engine/int8.py,
engine/q4.py) or the float dtype. The load line, `treegen info`, bench records and the budget's cost tables
(keyed by it) read these."""
from __future__ import annotations

from . import int8, q4

# treegen's own linear modules -> their weight objects, each its own product (Int8Weight, Q4Weight)
OWN = {int8.Int8Linear: lambda m: m.int8, q4.BlockLinear: lambda m: m.blocks}


def own_weight(module) -> int8.Int8Weight | q4.Q4Weight | None:
    """The weight object of one of treegen's own linear modules (int8, blocks); None for any other module."""
    form = OWN.get(type(module))
    return None if form is None else form(module)


def weight_form(model) -> str:
    """int8 (linear layers and lm_head), q4 (the decoder's linear layers), or the dtype."""
    if int8.is_int8(model):
        return int8.NAME
    if q4.is_q4(model):
        return q4.NAME
    return str(model.dtype).removeprefix("torch.")


def parameters(model) -> int:
    """The model's parameter count as loaded, its quantized layers' weights included (buffers, not
    parameters); a tied lm_head counts once, as in the float model."""
    count = sum(p.numel() for p in model.parameters()) + q4.parameters(model)
    count += sum(m.int8.q.numel() for m in model.modules() if type(m) is int8.Int8Linear)
    head = model.get_output_embeddings()
    if type(head) is int8.Int8Linear and getattr(model.config, "tie_word_embeddings", False):
        count -= head.int8.q.numel()
    return count
