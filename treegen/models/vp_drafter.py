"""D2SD's variable-prefix (VP) drafter: a DFlash drafter in z-lab's layout, no new keys, trained to draft the
rest of a block when its first i positions hold real tokens. One config field marks it:
`dflash_config.variable_prefix: true` (readers that do not know the field load it as a plain DFlash drafter).
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from .checkpoint import save_dflash
from .dflash import DFlashConfig, DFlashDrafter

MARKER = "variable_prefix"


def is_variable_prefix(config: DFlashConfig) -> bool:
    return (config.extra.get("dflash_config") or {}).get(MARKER) is True


def mark_variable_prefix(model: DFlashDrafter) -> DFlashDrafter:
    """The same module, its config now saying it is a VP-drafter (written into config.json on save)."""
    extra = dict(model.config.extra)
    extra["dflash_config"] = {**(extra.get("dflash_config") or {}), MARKER: True}
    model.config = replace(model.config, extra=extra)
    return model


def save_vp_drafter(model: DFlashDrafter, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    save_dflash(mark_variable_prefix(model), Path(out_dir), dtype)
