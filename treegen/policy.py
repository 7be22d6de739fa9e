"""Which method runs when none is named: each shipped pair's default preset, and the best method for any
other target. The pairs' files and names are treegen.assets'; the choice among their presets is made here."""
from __future__ import annotations

from pathlib import Path

from .assets import SMOLLM2
from .presets import Preset, PresetError, load

# Each pair's presets, fastest first as measured on a 2-core CPU (docs/benchmarks.md): the default method is the
# first whose checkpoints are installed; the last needs none. On the demo pair prompt lookup is the fastest on
# every unseen prompt set at T=0; on SmolLM2 in bf16 or int8 the marginal tree with its budget fitted each round
# is among the fastest on both chat sets at T=0 (the default temperature) and needs no head, plain decoding
# where its drafter is missing.
PAIR_PRESETS = {"demo": ("pld",), SMOLLM2: ("smollm2-ddtree", "smollm2-ar")}
# Where the target loads as its GGUF's own 4-bit blocks (q4: `auto` on a CPU with AVX512-VNNI and native bf16),
# a one-row step reads under a third of bf16's bytes, so a round's drafting and host work weigh as much as a few
# verified rows: the small marginal tree (3 nodes at T=0, 2 at T > 0) is the fastest measured on chat, at T=0 and
# T=0.7 (docs/smollm2.md).
BLOCK_PRESETS = {SMOLLM2: ("smollm2-ddtree-small", "smollm2-ar")}


def best_method(drafter: str | None) -> str:
    """With a DFlash drafter the marginal tree is the best shipped method; without one, prompt lookup."""
    return "ddtree" if drafter else "pld"


def default_preset(pair: str, dtype: str | None = None) -> Preset:
    """The pair's fastest preset (loaded) whose drafter is installed (the last of PAIR_PRESETS needs none), for
    the weights `--dtype` loads (None: auto)."""
    names = BLOCK_PRESETS[pair] if pair in BLOCK_PRESETS and loads_blocks(dtype or "auto") else PAIR_PRESETS[pair]
    for name in names:
        try:
            preset = load(name)
        except PresetError:   # not shipped (yet), or its checkpoint is missing
            continue
        if preset.drafter is None or Path(preset.drafter).exists():
            return preset
    return load(names[-1])


def loads_blocks(dtype: str) -> bool:
    """Whether a shipped GGUF target (its linears Q4_1) loads as its own blocks with this --dtype here."""
    from . import loading

    return loading.loads_blocks(dtype, loading.resolve_device("auto"), ("Q4_1",))
