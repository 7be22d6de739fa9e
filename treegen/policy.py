"""Which method runs when none is named: each shipped pair's default preset, and the best method for any
other target. The pairs' files and names are treegen.assets'; the choice among their presets is made here."""
from __future__ import annotations

from pathlib import Path

from .assets import SMOLLM2
from .presets import Preset, PresetError, load

# Each pair's presets, fastest first as measured on a 2-core CPU (docs/benchmarks.md): the default method is the
# first whose checkpoints are installed; the last needs none. On the demo pair prompt lookup is the fastest on
# every unseen prompt set at T=0; on SmolLM2 the marginal tree with its budget fitted each round is among the
# fastest on both chat sets at T=0 (the default temperature; TreeFlash with lookup is level with it) and needs no
# head, plain decoding where its drafter is missing.
PAIR_PRESETS = {"demo": ("pld",), SMOLLM2: ("smollm2-ddtree", "smollm2-ar")}


def best_method(drafter: str | None) -> str:
    """With a DFlash drafter the marginal tree is the best shipped method; without one, prompt lookup."""
    return "ddtree" if drafter else "pld"


def default_preset(pair: str) -> Preset:
    """The pair's fastest preset (loaded) whose drafter is installed (the last of PAIR_PRESETS needs none)."""
    for name in PAIR_PRESETS[pair]:
        try:
            preset = load(name)
        except PresetError:   # not shipped (yet), or its checkpoint is missing
            continue
        if preset.drafter is None or Path(preset.drafter).exists():
            return preset
    return load(PAIR_PRESETS[pair][-1])
