"""`treegen train ...`: tokenizer, target (the demo pair) and drafter training commands."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from ..cli_errors import guarded
from ..drafters.defaults import DRAFT_VOCAB
from ..validate import shown
from .guards import check_training_inputs, new_folder, stop_signals


def main_rank() -> bool:
    from .common import main_rank as main

    return main()


def _log(msg: str) -> None:
    if main_rank():
        print(msg, file=sys.stderr, flush=True)


def _shipped(value: str, kind: str) -> str:
    """Shipped names (demo, smollm2, demo/NAME, smollm2/NAME) resolved; not installed: a usage error."""
    from ..cli_options import shipped
    from ..validate import OptionError

    try:
        return shipped(value, kind)
    except OptionError as err:
        raise click.UsageError(str(err)) from None


def _set_threads(ctx, param, value: int | None) -> None:
    if value is not None:
        import torch

        torch.set_num_threads(value)


def _device(ctx, param, value: str) -> str:
    """A device this machine lacks is a usage error (exit 2) before anything loads."""
    from .common import DeviceError, check_device

    try:
        check_device(value)
    except DeviceError as err:
        raise click.UsageError(str(err), ctx) from None
    return value


PRECISION_NAMES = ["auto", "fp32", "bf16"]   # common.PRECISIONS' names (torch loads only when a command runs)


def runtime_options(f):
    """--device and --dtype, on every trainer (torchrun's processes each take one device of the node)."""
    f = click.option("--dtype", "precision", type=click.Choice(PRECISION_NAMES), default="auto", show_default=True,
                     help="Compute precision: bf16 autocast (auto: where the device has native bf16: a CUDA GPU "
                          "with bf16, a CPU with AVX512-BF16/AMX) with fp32 master weights and optimizer state, "
                          "or fp32 throughout. The frozen target loads as `treegen chat` serves it there (bf16 "
                          "where native), or in fp32 with --dtype fp32.")(f)
    return click.option("--device", default="auto", show_default=True, callback=_device,
                        help="auto (cuda when present, else the CPU), cpu, cuda or cuda:N; under torchrun each "
                             "process takes cuda:LOCAL_RANK.")(f)


def _folder(path: Path | None) -> str | None:
    return str(path) if path else None


def _budget(minutes: float | None) -> float:
    return math.inf if minutes is None else minutes * 60


@click.group()
def train():
    """Train drafters (and the demo pair's tokenizer and target)."""


POSITIVE = click.IntRange(min=1)


def bounded(most: int) -> click.IntRange:
    """A size-like option: at least 1, at most `most` (a bigger value is a typo or an out-of-memory kill,
    refused before anything loads)."""
    return click.IntRange(min=1, max=most)


def loop_options(lr: float = 1e-3):
    """The options every drafter trainer shares (one definition; ranges checked before anything loads)."""
    shared = [
        click.option("--steps", type=POSITIVE, default=2000, show_default=True, help="Maximum optimizer steps."),
        click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="Wall-clock budget; the LR schedule follows it."),
        click.option("--batch", type=bounded(65536), default=8, show_default=True,
                     help="Windows per optimizer step, all processes together (torchrun splits it evenly)."),
        click.option("--seq-len", type=bounded(1 << 20), default=256, show_default=True),
        click.option("--anchors", type=bounded(4096), default=16, show_default=True,
                     help="Random anchors (blocks) per sequence."),
        click.option("--lr", type=click.FloatRange(min=0, min_open=True, max=1), default=lr, show_default=True),
        click.option("--resume", is_flag=True, help="Continue from OUT/train_state.pt (also after Ctrl-C or SIGTERM)."),
        click.option("--feature-cache", type=click.Path(path_type=Path, file_okay=False), default=None,
                     help="Folder of the target's features of the data, computed once (resumable) and read by "
                          "every step, for targets whose forward is most of a step (chat_data writes one)."),
        click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=0, show_default=True),
        click.option("--threads", type=bounded(1024), default=None, expose_value=False, callback=_set_threads,
                     help="CPU threads for torch (default: torch's; fewer on a machine shared with other work).")]

    def wrap(f):
        for option in reversed(shared):
            f = option(f)
        return runtime_options(f)
    return wrap


SOFT = click.option("--soft", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                    help="Weight of the KL to the target's own next-token law, mixed with the hard labels' loss "
                         "(from the feature cache's last-layer states when it keeps them, else a target forward).")


VOCAB = click.option("--draft-vocab", type=click.IntRange(1, 1 << 20), default=DRAFT_VOCAB, show_default=True,
                     help="Tokens listed beside the export (draft_vocab.safetensors, the data's most frequent): "
                          "drafting scores its head over these and the context's only.")


@train.command("dflash")
@click.option("--target", required=True, help="Target model: hub id or folder (frozen during training).")
@click.option("--data", "data", multiple=True, required=True, help="Text file, folder or JSONL of {'text':..}.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Output folder (published layout).")
@click.option("--layers", type=bounded(256), default=3, show_default=True, help="Drafter decoder layers.")
@click.option("--block-size", type=click.IntRange(min=2, max=1024), default=16, show_default=True)
@click.option("--target-layers", default=None, help="Comma-separated target layer ids (default: z-lab's spread).")
@click.option("--mask-token-id", type=click.IntRange(min=0), default=None, help="Default: the tokenizer's mask token.")
@click.option("--init", default=None, help="Continue training this DFlash drafter (folder, hub id, demo or "
              "demo/NAME); its own shape replaces --layers, --block-size, --target-layers, --mask-token-id.")
@click.option("--candidates", type=click.IntRange(min=0), default=0, show_default=True,
              help="Score only the data's K most frequent tokens (and each batch's labels) in the loss: a cheaper "
                   "lm_head for large vocabularies; finish with a run without it (0 = the whole vocabulary).")
@click.option("--init-from-target", is_flag=True,
              help="Start the drafter's layers as copies of the target's last layers (same shapes).")
@click.option("--gamma", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Position weights of the loss, exp(-(k-1)/gamma) for the k-th draft (default: by block size, "
                   "7 for 16, 5 for 10): lower puts the early drafts first, which a drafter that accepts few "
                   "tokens a round needs most.")
@loop_options(lr=1e-3)
@click.option("--regenerate", "regen", type=click.IntRange(min=0), default=0,
              help="Train on N target-regenerated sequences.")
@click.option("--heldout", "heldout", multiple=True, help="Held-out text for the final acceptance estimate.")
@SOFT
@VOCAB
@click.option("--short-blocks", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Share of the blocks cut to a random shorter length (2 .. block size - 1), scored over their "
                   "own positions: drafting runs only as many block rows as a round's tree has depths.")
@click.option("--heldout-windows", type=click.IntRange(min=0), default=0, show_default=True,
              help="Keep the data's last K windows out of training and print their loss at every checkpoint; "
                   "the drafter with the lowest so far is also written to OUT/best.")
@guarded
def dflash_cmd(target, data, out, layers, block_size, target_layers, mask_token_id, init, candidates,
               init_from_target, gamma, steps, minutes, batch, seq_len, anchors, lr, regen, heldout, soft, draft_vocab,
               short_blocks, heldout_windows, resume, feature_cache, seed, device, precision):
    """Train a DFlash block-diffusion drafter for TARGET; writes z-lab's checkpoint layout to OUT.

    Ctrl-C or SIGTERM stops at the end of the current step, with a checkpoint that --resume continues."""
    from .dflash import DFlashTrainConfig
    from .pipeline import train_dflash_pipeline

    ids, target = layer_ids(target_layers), _shipped(target, "target")
    if block_size >= seq_len:
        raise click.UsageError(f"--block-size {block_size} must be below --seq-len {seq_len}")
    if anchors > seq_len - block_size:
        raise click.UsageError(f"--anchors {anchors}: a {seq_len}-token sequence holds at most "
                               f"{seq_len - block_size} anchors of block {block_size}")
    check_training_inputs(target, list(data) + list(heldout), out, resume)
    cfg = DFlashTrainConfig(num_layers=layers, block_size=block_size, target_layer_ids=ids, batch=batch,
                            seq_len=seq_len, anchors=anchors, lr=lr, max_steps=steps,
                            max_seconds=_budget(minutes), seed=seed, init_from_target=init_from_target,
                            candidates=candidates, soft=soft, short_blocks=short_blocks, draft_vocab=draft_vocab,
                            heldout_windows=heldout_windows, gamma=gamma,
                            feature_cache=_folder(feature_cache), device=device, precision=precision)
    with stop_signals(), new_folder(out):
        train_dflash_pipeline(target, list(data), out, cfg, mask_token_id=mask_token_id, regen=regen,
                              heldout=list(heldout), resume=resume, init=init, log=_log)


def layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise click.UsageError(f"--target-layers {shown(text)}: expected comma-separated integers, e.g. 1,3,5")
    if any(i < 0 for i in ids):
        raise click.UsageError(f"--target-layers {shown(text)}: layer ids are >= 0")
    return ids


@train.command("tokenizer")
@click.option("--data", multiple=True, required=True)
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--vocab-size", type=click.IntRange(min=260), default=8192, show_default=True)
@guarded
def tokenizer_cmd(data, out, vocab_size):
    """Train a byte-level BPE tokenizer (with eos, pad and mask tokens)."""
    from .data import read_data
    from .tokenizer import train_tokenizer

    check_training_inputs(None, list(data), out, False)
    with new_folder(out):
        train_tokenizer(read_data(list(data)), out, vocab_size)
    _log(f"tokenizer written to {out}")


@train.command("target")
@click.option("--tokenizer", "tok_dir", required=True, help="Tokenizer folder (from `treegen train tokenizer`).")
@click.option("--data", multiple=True, required=True)
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True)
@click.option("--steps", type=POSITIVE, default=100_000, show_default=True)
@click.option("--minutes", type=click.FloatRange(min=0, min_open=True), default=None)
@click.option("--resume", is_flag=True, help="Continue from OUT/train-state (also after Ctrl-C or SIGTERM).")
@runtime_options
@guarded
def target_cmd(tok_dir, data, out, steps, minutes, resume, device, precision):
    """Train a small Qwen3-architecture target from scratch (how the demo target is made)."""
    from transformers import AutoTokenizer

    from .data import read_data, tokenize
    from .target import build_target, train_target

    check_training_inputs(tok_dir, list(data), out, resume, needs_config=False)
    with stop_signals(), new_folder(out):
        tok = AutoTokenizer.from_pretrained(tok_dir)
        model = build_target(tok)
        train_target(model, tokenize(read_data(list(data)), tok), out / "train-state", max_steps=steps,
                     max_seconds=_budget(minutes), resume=resume, device=device, precision=precision)
        if main_rank():
            model.save_pretrained(out)
            tok.save_pretrained(out)
    _log(f"target written to {out}")


@train.command("treeflash")
@click.option("--target", required=True, help="Target model: hub id or folder (frozen).")
@click.option("--drafter", required=True, help="DFlash drafter (frozen backbone; a fresh head) or a TreeFlash "
              "checkpoint (its head is trained further). `demo` = the shipped demo drafter.")
@click.option("--data", "data", multiple=True, required=True, help="A token stream (.pt) or text files/folders.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Output folder (published layout).")
@loop_options(lr=1e-3)
@SOFT
@VOCAB
@click.option("--heldout", "heldout", multiple=True, help="Held-out stream (.pt) or text: acceptance vs ddtree.")
@click.option("--prompts", default=8, show_default=True, help="Held-out prompts for the acceptance estimate.")
@click.option("--budgets", default="16,32,64", show_default=True, help="Tree budgets of the held-out comparison.")
@click.option("--save-dtype", "save_dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default="fp32",
              show_default=True, help="Dtype of the exported checkpoint.")
@guarded
def treeflash_cmd(target, drafter, data, out, steps, minutes, batch, seq_len, anchors, lr, soft, draft_vocab, heldout,
                  prompts, budgets, save_dtype, resume, feature_cache, seed, device, precision):
    """Train TreeFlash's SwiGLU head on a frozen DFlash backbone; writes TreeFlash's published layout to OUT."""
    from ..loading import DTYPES
    from .treeflash import TreeFlashTrainConfig
    from .treeflash_pipeline import train_treeflash_pipeline

    try:
        budget_list = tuple(int(b) for b in budgets.split(","))
    except ValueError:
        raise ValueError(f"--budgets takes comma-separated integers, got {budgets!r}") from None
    target, drafter = _shipped(target, "target"), _shipped(drafter, "drafter")
    cfg = TreeFlashTrainConfig(batch=batch, seq_len=seq_len, anchors=anchors, lr=lr, max_steps=steps,
                               max_seconds=_budget(minutes), soft=soft, seed=seed, feature_cache=_folder(feature_cache),
                               device=device, precision=precision, draft_vocab=draft_vocab)
    with stop_signals():
        train_treeflash_pipeline(target, drafter, list(data), out, cfg, heldout=list(heldout), prompts=prompts,
                                 budgets=budget_list, save_dtype=DTYPES[save_dtype], resume=resume, log=_log)


@train.command("domino")
@click.option("--target", default="demo", show_default=True, help="Target: hub id or folder; demo = the shipped one.")
@click.option("--dflash", "dflash_path", default="demo/dflash", show_default=True,
              help="The DFlash drafter the head sits on (and the joint recipe starts from).")
@click.option("--data", "data", multiple=True, required=True,
              help="A token stream (.pt) or text files, folders, JSONL (best: the target's own continuations).")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Output folder (Domino's layout).")
@click.option("--recipe", type=click.Choice(["head", "joint"]), default="head", show_default=True,
              help="head: frozen backbone, head only; joint: backbone + head, lambda-mixed base/corrected CE.")
@click.option("--emb-dim", default=128, show_default=True, help="embed_proj's inner width E.")
@click.option("--gru-dim", default=256, show_default=True, help="The prefix GRU's state size G.")
@click.option("--shift-label/--no-shift-label", default=False, show_default=True,
              help="Block position k predicts token anchor+k+1 (B drafts) instead of anchor+k (B-1).")
@click.option("--prefix-len", default=0, show_default=True, help="pure_draft_prefix_len: drafts left uncorrected.")
@loop_options(lr=1e-3)
@click.option("--decay", default=0.3, show_default=True, help="joint: lambda falls 1 -> 0 over this fraction.")
@SOFT
@VOCAB
@click.option("--heldout", "heldout", multiple=True, help="Held-out stream (.pt) or text for the final comparison.")
@guarded
def domino_cmd(target, dflash_path, data, out, recipe, emb_dim, gru_dim, shift_label, prefix_len, steps, minutes,
               batch, seq_len, anchors, lr, decay, soft, draft_vocab, heldout, resume, feature_cache, seed, device,
               precision):
    """Train Domino's GRU correction head on a DFlash drafter; writes Domino's published layout to OUT."""
    from .domino import DominoTrainConfig, train_domino_pipeline

    cfg = DominoTrainConfig(recipe=recipe, emb_dim=emb_dim, gru_hidden_dim=gru_dim, shift_label=shift_label,
                            pure_draft_prefix_len=prefix_len, batch=batch, seq_len=seq_len, anchors=anchors, lr=lr,
                            max_steps=steps, max_seconds=_budget(minutes), decay=decay, soft=soft, seed=seed,
                            feature_cache=_folder(feature_cache), device=device, precision=precision,
                            draft_vocab=draft_vocab)
    with stop_signals():
        train_domino_pipeline(_shipped(target, "target"), _shipped(dflash_path, "drafter"), list(data), out, cfg,
                              heldout=list(heldout), resume=resume, log=_log)


@train.command("vp-drafter")
@click.option("--target", default="demo", show_default=True, help="Target: hub id, folder, or demo.")
@click.option("--init", default="demo", show_default=True,
              help="The DFlash drafter to start from: folder, hub id, demo or demo/NAME.")
@click.option("--data", multiple=True, required=True,
              help="A token stream (.pt, 1-D int tensor) or text files / folders / JSONL.")
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), required=True,
              help="Output folder (DFlash layout).")
@loop_options(lr=5e-4)
@click.option("--beta", default=0.9, show_default=True, help="Pr(visible prefix i) ~ beta^i, i in [2, B-1].")
@click.option("--gamma", default=7.0, show_default=True, help="Loss weight exp(-(k - i)/gamma) after the prefix.")
@click.option("--heldout", multiple=True, help="Held-out stream (.pt) or text for the acceptance estimate.")
@click.option("--heldout-prompts", default=16, show_default=True)
@guarded
def vp_drafter_cmd(target, init, data, out, steps, minutes, batch, seq_len, anchors, lr, beta, gamma, heldout,
                   heldout_prompts, resume, feature_cache, seed, device, precision):
    """Train D2SD's variable-prefix drafter from a DFlash drafter; writes the DFlash layout (marked
    dflash_config.variable_prefix) to OUT."""
    from .vp_drafter import VPTrainConfig, vp_pipeline

    if not 0 < beta <= 1 or gamma <= 0:
        raise ValueError(f"--beta must be in (0, 1] and --gamma > 0, got {beta}, {gamma}")
    cfg = VPTrainConfig(batch=batch, seq_len=seq_len, anchors=anchors, lr=lr, max_steps=steps,
                        max_seconds=_budget(minutes), beta=beta, gamma=gamma, seed=seed,
                        feature_cache=_folder(feature_cache), device=device, precision=precision)
    with stop_signals():
        vp_pipeline(target, init, list(data), out, cfg, list(heldout), heldout_prompts, resume, log=_log)
