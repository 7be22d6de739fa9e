"""Reading and writing drafters in the published layouts (z-lab's DFlash: config.json + model.safetensors)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .dflash import DFlashConfig, DFlashDrafter, default_target_layer_ids


class CheckpointError(RuntimeError):
    """A drafter checkpoint that cannot be read, or that does not fit the target; one line for the user."""


_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def config_from_json(raw: dict, source: str = "config.json") -> DFlashConfig:
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise CheckpointError(f"{source}: not a DFlash drafter config (missing {', '.join(missing)})")
    dflash = raw.get("dflash_config") or {}
    if "mask_token_id" not in dflash:
        raise CheckpointError(f"{source}: dflash_config.mask_token_id is missing")
    layers, heads = raw["num_hidden_layers"], raw["num_attention_heads"]
    num_target = raw.get("num_target_layers")
    ids = dflash.get("target_layer_ids") or default_target_layer_ids(num_target, layers)
    rope = raw.get("rope_parameters") or {}
    return DFlashConfig(
        hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads, num_target_layers=num_target,
        target_layer_ids=tuple(ids), mask_token_id=dflash["mask_token_id"], vocab_size=raw.get("vocab_size"),
        block_size=raw.get("block_size") or dflash.get("block_size") or 16,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta") or raw.get("rope_theta") or 1_000_000.0),
        max_position_embeddings=raw.get("max_position_embeddings", 40960),
        hidden_act=raw.get("hidden_act", "silu"), extra=raw)


def config_to_json(c: DFlashConfig) -> dict:
    out = {k: v for k, v in c.extra.items() if k not in ("rope_theta",)}
    out.update({
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": c.block_size,
        "dflash_config": {**out.get("dflash_config", {}), "mask_token_id": c.mask_token_id,
                          "target_layer_ids": list(c.target_layer_ids)},
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "num_target_layers": c.num_target_layers, "vocab_size": c.vocab_size, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "max_position_embeddings": c.max_position_embeddings, "hidden_act": c.hidden_act,
        "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * c.num_hidden_layers})
    return out


def resolve_checkpoint(name: str) -> Path:
    """A local folder, a shipped checkpoint (`demo/NAME`, `smollm2/NAME`), or a hub id fetched into the local cache
    (fails cleanly when offline)."""
    from ..assets import pair_asset

    path = pair_asset(name) or Path(name).expanduser()
    if path.exists():
        return path
    if pair_asset(name) is not None:
        raise CheckpointError(f"{name}: no such shipped demo checkpoint ({path.parent} has none by that name)")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise CheckpointError(f"{name}: no such drafter folder")
    from ..validate import hub_problem

    problem = hub_problem(name)
    if problem:
        raise CheckpointError(f"drafter {problem}")
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors"]))
    except Exception as err:  # the hub client raises many kinds; all mean "not available"
        raise CheckpointError(f"cannot fetch drafter {name} from the hub (offline?): "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err


def read_config(folder: Path) -> DFlashConfig:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no config.json, so it is not a drafter checkpoint")
    try:
        raw = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{cfg_path}: malformed JSON ({err})") from err
    return config_from_json(raw, str(cfg_path))


def read_state_dict(folder: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """All tensors of the folder's safetensors files, with `prefix` stripped (TreeFlash nests under model.)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as err:  # safetensors raises its own error type (and OSError) for a damaged file
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"{f}: corrupt or truncated safetensors file ({first[:120]})") from err
    if prefix:
        state = {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def load_dflash(name: str, dtype: torch.dtype = torch.float32, device="cpu") -> DFlashDrafter:
    folder = resolve_checkpoint(name)
    config = read_config(folder)
    model = DFlashDrafter(config)
    state = read_state_dict(folder)
    if "fc.weight" not in state and "model.fc.weight" in state:  # a TreeFlash checkpoint: use its backbone
        state = read_state_dict(folder, prefix="model.")
    load_weights(model, state, folder)
    return model.to(device=device, dtype=dtype).eval()


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Fill the module's tensors from a checkpoint's (extra keys ignored), naming the first missing or
    misshapen one."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise CheckpointError(f"{folder}: weights missing for {len(missing)} tensors, e.g. {missing[0]}")
    bad = [k for k in own if state[k].shape != own[k].shape]
    if bad:
        raise CheckpointError(f"{folder}: {bad[0]} has shape {tuple(state[bad[0]].shape)}, "
                              f"config says {tuple(own[bad[0]].shape)}")
    model.load_state_dict({k: state[k] for k in own})


def save_dflash(model: DFlashDrafter, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype else v).contiguous() for k, v in model.state_dict().items()}
    tmp = out_dir / ".model.safetensors.tmp"   # temp file + rename: a kill mid-write leaves no half file
    save_file(state, tmp, metadata={"format": "pt"})
    tmp.replace(out_dir / "model.safetensors")
    cfg = config_to_json(model.config)
    cfg["dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    (out_dir / ".config.json.tmp").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / ".config.json.tmp").replace(out_dir / "config.json")


def check_fits(config: DFlashConfig, target) -> None:
    """Refuse a drafter built for another target, naming what does not fit."""
    t = target.config
    t = getattr(t, "text_config", None) or t
    vocab = target.get_input_embeddings().weight.shape[0]
    problems = []
    if config.hidden_size != t.hidden_size:
        problems.append(f"hidden size {config.hidden_size} != target's {t.hidden_size}")
    if max(config.target_layer_ids) >= t.num_hidden_layers:
        problems.append(f"target_layer_ids {list(config.target_layer_ids)} reach past the target's "
                        f"{t.num_hidden_layers} layers")
    if config.num_target_layers is not None and config.num_target_layers != t.num_hidden_layers:
        problems.append(f"built for a {config.num_target_layers}-layer target, this one has {t.num_hidden_layers}")
    if not 0 <= config.mask_token_id < vocab:
        problems.append(f"mask token {config.mask_token_id} is outside the target's embedding ({vocab} rows)")
    if config.vocab_size is not None and config.vocab_size != t.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} != target's {t.vocab_size}")
    if problems:
        raise CheckpointError("drafter does not fit the target: " + "; ".join(problems))
