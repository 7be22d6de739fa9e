"""Training a DFlash drafter for a frozen target (the SpecForge recipe).

Each training sequence gets many random anchors a. For each, the block is [x_a, MASK x (B-1)] at
positions a..a+B-1; block queries see the target's context features strictly before a plus their own
block (bidirectionally); the loss is cross entropy on block positions k=1..B-1 against x_{a+k},
weighted exp(-(k-1)/gamma) so that early positions, which every accepted prefix needs, count most.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters import vocab
from ..drafters.untrained import untrained_dflash
from ..models.checkpoint import save_dflash
from ..models.dflash import DFlashDrafter
from .common import LoopConfig, Schedule, as_served, fit, run_on, sharded
from .features import target_features, training_windows

GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass(frozen=True)
class DFlashTrainConfig(LoopConfig):
    num_layers: int = 3
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None   # None: z-lab's default spread
    intermediate_size: int | None = None              # None: the target's
    init_from_target: bool = False                    # start each layer as a copy of one of the target's last
    candidates: int = 0                               # > 0: CE over the data's most frequent tokens + labels
    soft: float = 0.0                                 # weight of KL(target || draft) against the hard labels
    short_blocks: float = 0.0                         # share of blocks cut to a random shorter length (block_lengths)


def build_drafter(target, mask_token_id: int, cfg: DFlashTrainConfig, seed: int = 0) -> DFlashDrafter:
    model = untrained_dflash(target, mask_token_id, cfg.num_layers, cfg.block_size, cfg.target_layer_ids,
                             cfg.intermediate_size, seed)
    if cfg.init_from_target:
        copy_target_layers(model, target)
    return model


def copy_target_layers(drafter: DFlashDrafter, target) -> None:
    """Drafter layer i starts as the target's layer L-n+i (the last n: their output feeds the same final norm
    and lm_head); the projections, MLP and norms are copied, q/k norms (absent in Llama) stay ones."""
    source = target.get_decoder().layers[-len(drafter.layers):]
    with torch.no_grad():
        for mine, theirs in zip(drafter.layers, source):
            own = dict(mine.named_parameters())
            for name, p in theirs.named_parameters():
                if name in own and own[name].shape == p.shape:
                    own[name].copy_(p)


def target_pass(target, ids: torch.Tensor, layer_ids):
    """One frozen target forward: the drafter's context features and the target's own next-token logits."""
    with torch.no_grad(), as_served(target):
        out = target(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1), out.logits


def target_rows(target, anchors: torch.Tensor, depth: int, *, final: torch.Tensor | None = None,
                logits: torch.Tensor | None = None, subset: torch.Tensor | None = None) -> torch.Tensor:
    """The target's own next-token logits at rows anchor + k, k < depth: [b, n, depth, V] (or over `subset`'s
    ids), where draft k predicts ids[anchor + 1 + k] as that row does. From the target's last-layer states
    `final` [b, T, H] after its final norm (a feature store's: only these rows meet the lm_head) or from a
    forward's `logits`."""
    b, n = anchors.shape
    source = final if final is not None else logits
    src = (anchors[..., None] + torch.arange(depth, device=anchors.device)).flatten(1).clamp(max=source.shape[1] - 1)
    rows = source.gather(1, src[..., None].expand(-1, -1, source.shape[-1])).view(b, n, depth, -1)
    if final is not None:
        head = target.get_output_embeddings()
        weight = head.weight if subset is None else head.weight[subset]
        with torch.no_grad():
            return F.linear(rows.to(weight.dtype), weight).float()
    return (rows if subset is None else rows[..., subset]).float()


def soft_mix(loss: torch.Tensor, logits: torch.Tensor, p_logits: torch.Tensor, weights: torch.Tensor,
             soft: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """(1 - soft) * the hard-label loss + soft * the position-weighted KL(target || draft) between the
    draft's logits and the target's (target_rows) [b, n, D, V]: a law calibrated to the target's own (what
    acceptance at T > 0 rewards), not to one sampled continuation."""
    kl = F.kl_div(torch.log_softmax(logits, -1), torch.log_softmax(p_logits, -1), log_target=True,
                  reduction="none").sum(-1)
    return (1 - soft) * loss + soft * per_block(kl, weights, valid)


def sample_anchors(batch: int, seq_len: int, n: int, block: int, gen: torch.Generator,
                   allowed: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, n] distinct anchor positions in [1, seq_len - block]: context >= 1 token, labels in range.
    allowed [batch, seq_len] bool: positions taken first (a chat stream's replies: where drafting happens)."""
    scores = torch.rand(batch, seq_len - block, generator=gen)
    if allowed is not None:
        scores = scores + allowed[:, 1:seq_len - block + 1].float()
    return scores.topk(min(n, seq_len - block), dim=-1).indices.sort(dim=-1).values + 1


def block_lengths(batch: int, n: int, block: int, share: float, gen: torch.Generator) -> torch.Tensor:
    """[batch, n] block lengths: `share` of the blocks cut to a length drawn from 2 .. block - 1, the rest whole.
    Drafting runs only as many block rows as a round's tree has depths (drafters/dflash.py: a two-node tree
    runs three), so a drafter that also learns short blocks drafts them as it was trained."""
    cut = torch.rand(batch, n, generator=gen) < share
    return torch.where(cut, torch.randint(2, max(block, 3), (batch, n), generator=gen), block)


def block_mask(anchors: torch.Tensor, seq_len: int, block: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[b, 1, n*B, T + n*B] bool: a block query sees context before its anchor and its own block (its first
    `lengths` [b, n] positions when given: a shorter block's rows past its end are not there)."""
    (b, n), dev = anchors.shape, anchors.device
    q_anchor = anchors.repeat_interleave(block, dim=1)                          # [b, nB]
    ctx_ok = torch.arange(seq_len, device=dev)[None, None] < q_anchor[..., None]  # [b, nB, T]
    blk = torch.arange(n, device=dev).repeat_interleave(block)
    blk_ok = (blk[:, None] == blk[None, :]).expand(b, -1, -1)                  # [b, nB, nB]
    if lengths is not None:
        inside = torch.arange(block, device=dev).repeat(n)[None] < lengths.repeat_interleave(block, dim=1)
        blk_ok = blk_ok & inside[:, None, :]
    return torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]


def block_pass(drafter: DFlashDrafter, target, ids: torch.Tensor, anchors: torch.Tensor, *, extra_labels: int = 0,
               normed: bool = True, features: torch.Tensor | None = None, visible: torch.Tensor | None = None,
               lengths: torch.Tensor | None = None):
    """The backbone over every anchor's block [x_a, MASK...] (the part every block recipe shares): block states
    [b, n, B, H] and the true tokens x_a .. x_{a+B-1+extra_labels} [b, n, B+extra_labels].
    normed=False: states before the final norm; features: the target's context features of ids, if known;
    visible [b, n]: block positions < visible hold their real tokens (None: the anchor only, DFlash);
    lengths [b, n]: each block's length (block_lengths; None: whole blocks)."""
    c, (b, seq_len), dev = drafter.config, ids.shape, ids.device
    block, n = c.block_size, anchors.shape[1]
    pos = (anchors[..., None] + torch.arange(block, device=dev)).view(b, -1)    # [b, nB]
    span = (anchors[..., None] + torch.arange(block + extra_labels, device=dev)).view(b, -1)
    tokens = ids.gather(1, span.clamp(max=seq_len - 1)).view(b, n, -1)
    shown = torch.ones_like(anchors) if visible is None else visible
    inputs = torch.where(torch.arange(block, device=dev) < shown[..., None], tokens[..., :block], c.mask_token_id)
    embed = target.get_input_embeddings()
    if features is None:
        features = target_features(target, ids, c.target_layer_ids)
    hidden = drafter(embed(inputs.reshape(b, -1)), pos, drafter.project_context(features),
                     torch.arange(seq_len, device=dev)[None].expand(b, -1), mask=block_mask(anchors, seq_len, block, lengths), normed=normed)
    return hidden.view(b, n, block, -1), tokens


def position_weights(n: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-k/gamma) for the k-th draft: early positions, which every accepted prefix needs, count most."""
    return torch.exp(-torch.arange(n, device=device).float() / gamma)


def weighted_ce(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """Cross entropy per draft position [.., D, V] weighted by `weights` [D], normalised by their sum (per
    block, over its `valid` [.., D] positions only when given)."""
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    return per_block(ce, weights, valid)


def per_block(values: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """The mean over blocks of `values` [.., D] weighted by `weights` [D] and normalised in each block (over
    its `valid` positions, when given)."""
    if valid is None:
        return (values * weights).sum(-1).mean() / weights.sum()
    w = weights * valid
    return ((values * w).sum(-1) / w.sum(-1)).mean()


def candidate_logits(target, hidden: torch.Tensor, labels: torch.Tensor, candidates: torch.Tensor | None):
    """(logits, labels, subset) over the whole vocabulary (subset None), or (candidates given) over those token
    ids plus every label of the batch, the labels renumbered into that subset: an lm_head of |subset| rows."""
    head = target.get_output_embeddings()
    if candidates is None:
        return head(hidden).float(), labels, None
    subset = torch.unique(torch.cat([candidates, labels.flatten()]))          # sorted
    logits = F.linear(hidden, head.weight[subset], None if head.bias is None else head.bias[subset]).float()
    return logits, torch.searchsorted(subset, labels.contiguous()), subset


def frequent_tokens(stream: torch.Tensor, k: int) -> torch.Tensor:
    """The k most frequent token ids of a stream, ascending (the candidate vocabulary of a cheaper loss)."""
    return vocab.frequent_tokens(stream, int(stream.max()) + 1, k).sort().values


def exporter(save, out_dir: Path, stream: torch.Tensor, target, size: int = vocab.DRAFT_VOCAB):
    """on_checkpoint(): the drafter in its published layout (`save`), and beside it the tokens its head scores
    when drafting (drafters/vocab.py: the stream's `size` most frequent)."""
    ids = vocab.frequent_tokens(stream, target.get_output_embeddings().out_features, size)

    def export(folder: Path = out_dir) -> None:
        save(folder)
        vocab.save_vocab(folder, ids)
    return export


def dflash_loss(drafter: DFlashDrafter, target, ids: torch.Tensor, anchors: torch.Tensor, gamma: float,
                features: torch.Tensor | None = None, candidates: torch.Tensor | None = None, soft: float = 0.0,
                final: torch.Tensor | None = None, lengths: torch.Tensor | None = None):
    """Position-weighted CE over every anchor's block (over `candidates` + the labels only, when given), mixed
    with the KL to the target's own law when soft > 0 (from its last-layer states `final`, else a forward);
    also returns top-1 accuracy per block position (within that subset). lengths [b, n]: blocks cut shorter
    (block_lengths), scored over their own positions."""
    target_logits = None
    if soft and final is None:
        features, target_logits = target_pass(target, ids, drafter.config.target_layer_ids)
    hidden, tokens = block_pass(drafter, target, ids, anchors, features=features, lengths=lengths)
    logits, labels, subset = candidate_logits(target, hidden[:, :, 1:], tokens[..., 1:], candidates)  # [b, n, B-1, V']
    weights = position_weights(labels.shape[-1], gamma, labels.device)
    valid = None if lengths is None else \
        (torch.arange(1, labels.shape[-1] + 1, device=labels.device) < lengths[..., None]).float()
    loss = weighted_ce(logits, labels, weights, valid)
    if soft:
        p = target_rows(target, anchors, labels.shape[-1], final=final, logits=target_logits, subset=subset)
        loss = soft_mix(loss, logits, p, weights, soft, valid)
    hits = (logits.argmax(-1) == labels).float()
    acc = hits.mean(dim=(0, 1)) if valid is None else (hits * valid).sum((0, 1)) / valid.sum((0, 1)).clamp(min=1)
    return loss, acc


def block_loss(drafter: DFlashDrafter, target, ids: torch.Tensor, anchors: torch.Tensor, visible: torch.Tensor,
               gamma: float, features: torch.Tensor | None = None):
    """Every anchor's block holds real tokens at positions < visible [b, n] (1: the anchor only, DFlash)
    and MASK after; CE on positions k >= visible weighted exp(-(k - visible)/gamma), normalised per block.
    Also returns top-1 accuracy by offset after the visible prefix (offset 0 = the first masked position)."""
    (b, n), block, dev = anchors.shape, drafter.config.block_size, ids.device
    hidden, tokens = block_pass(drafter, target, ids, anchors, visible=visible, features=features)
    after = torch.arange(1, block, device=dev) - visible[..., None]           # [b, n, B-1]
    scored = after >= 0                                                         # only these reach lm_head
    logits = target.get_output_embeddings()(hidden[:, :, 1:][scored]).float()  # [m, V]
    labels, after = tokens[..., 1:][scored], after[scored]
    weights = torch.exp(-after.float() / gamma)
    weighted = F.cross_entropy(logits, labels, reduction="none") * weights
    owner = torch.arange(b * n, device=dev).view(b, n, 1).expand(-1, -1, block - 1)[scored]  # each one's block
    per_block = weights.new_zeros(b * n).index_add(0, owner, weighted) / weights.new_zeros(b * n).index_add(
        0, owner, weights)
    hits = (logits.argmax(-1) == labels).float()
    acc = hits.new_zeros(block - 1).index_add(0, after, hits) / hits.new_zeros(block - 1).index_add(
        0, after, torch.ones_like(hits)).clamp(min=1)
    return per_block.mean(), acc


def heldout_loss(drafter: DFlashDrafter, target, heldout, cfg: DFlashTrainConfig, gamma: float, candidates,
                 chunk: int = 8):
    """() -> ('held-out loss .. acc@1 ..', loss) over fixed anchors of the held-out windows, chunked (bounded
    memory)."""
    ids, features, allowed = heldout
    anchors = sample_anchors(len(ids), ids.shape[1], cfg.anchors, cfg.block_size, torch.Generator().manual_seed(0),
                             allowed)
    ids, anchors, features = (None if t is None else t.to(target.device) for t in (ids, anchors, features))

    def evaluate() -> str:
        parts = [dflash_loss(drafter, target, ids[i:i + chunk], anchors[i:i + chunk], gamma,
                             None if features is None else features[i:i + chunk], candidates)
                 for i in range(0, len(ids), chunk)]
        loss = sum(p[0].item() for p in parts) / len(parts)
        acc = torch.stack([p[1] for p in parts]).mean(0)
        return f"held-out loss {loss:.4f}  acc@1 {acc[0]:.2f} acc@4 {acc[min(3, len(acc) - 1)]:.2f}", loss
    return evaluate


def keeping_best(evaluate, save_best, out_dir: Path):
    """Wraps a held-out evaluate(): the drafter with the lowest held-out loss so far is also written to
    OUT/best by save_best(folder) (a whole published folder, with heldout.json), so a run that goes on past
    its best point still has it."""
    best_dir = out_dir / "best"
    record = best_dir / "heldout.json"

    def evaluate_keeping() -> str:
        line, loss = evaluate()
        best = json.loads(record.read_text())["loss"] if record.exists() else float("inf")
        if loss < best:
            save_best(best_dir)
            record.write_text(json.dumps({"loss": loss, "line": line}) + "\n")
            line += "  (best so far: saved to best/)"
        return line
    return evaluate_keeping


def freeze(target) -> None:
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)


def train_dflash(target, drafter: DFlashDrafter, stream: torch.Tensor, out_dir: Path, cfg: DFlashTrainConfig,
                 resume: bool = False, log=print):
    """Train on random windows of a token stream; checkpoints to out_dir/train_state.pt, exports to out_dir."""
    rt = run_on(cfg)
    freeze(target)
    drafter.to(rt.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = out_dir / "train_state.pt"
    gamma = cfg.gamma or GAMMA_BY_BLOCK.get(cfg.block_size, cfg.block_size / 2.3)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(cfg.seed)

    windows = training_windows(target, drafter.config, stream, cfg, log, rt, final=cfg.soft > 0)
    candidates = frequent_tokens(stream, cfg.candidates).to(rt.device) if cfg.candidates else None

    def draw(g):
        batch = windows.draw(g)
        batch["anchors"] = sample_anchors(cfg.batch, cfg.seq_len, cfg.anchors, cfg.block_size, g, batch.pop("allowed"))
        if cfg.short_blocks:
            batch["lengths"] = block_lengths(cfg.batch, cfg.anchors, cfg.block_size, cfg.short_blocks, g)
        return batch

    def loss(part):
        value, acc = dflash_loss(drafter, target, part["ids"], part["anchors"], gamma, features=windows.features(part),
                                 candidates=candidates, soft=cfg.soft, final=windows.final(part) if cfg.soft else None,
                                 lengths=part.get("lengths"))
        return value, f"acc@1 {acc[0]:.2f} acc@4 {acc[min(3, len(acc) - 1)]:.2f}"

    sched = Schedule(cfg.lr, cfg.max_steps, cfg.max_seconds, warmup=50)
    export = exporter(lambda folder: save_dflash(drafter, folder), out_dir, stream, target, cfg.draft_vocab)
    evaluate = None
    if cfg.heldout_windows and rt.main:
        evaluate = keeping_best(heldout_loss(drafter, target, windows.heldout(), cfg, gamma, candidates), export,
                                out_dir)
    return fit(drafter, opt, sched, gen, ckpt, sharded(rt, draw, loss, cfg.batch * cfg.anchors * cfg.block_size),
               resume=resume, ckpt_every=cfg.ckpt_every, on_checkpoint=export, evaluate=evaluate, rt=rt)
