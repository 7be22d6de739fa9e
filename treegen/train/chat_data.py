"""Training data for a chat target's drafters: the target's OWN replies to a few thousand prompts built offline.

    python -m treegen.train.chat_data --target smollm2 --out /work/train/smollm2 [--rows 2400]

Prompts (none of them from a benchmark set; chat_prompts.py): `--mix broad` (the default) takes emails,
notes and descriptions, everyday advice, puzzles, word problems, general explanations and coding tasks from
the stdlib's training split; `--mix templates` the narrower families of the earlier sets. Each is rendered
with the target's chat template and answered by the target itself (half greedy, half at T=0.7, at most 256
new tokens, stopping at its end-of-turn token), in length-sorted batches; every batch is saved as it
finishes, so a rerun resumes after the last saved one. The result is one int32 token stream (prompt + reply +
EOS per conversation) for `treegen train ... --data`.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ..exit import end
from .chat_prompts import DEFAULT_MIX, MIXES, build_prompts
from .common import leave, runtime_from, runtime_options

MAX_NEW = 256
TEMPERATURES = (0.0, 0.7)
SEPARATOR = "\n\x1e\n"   # between prompts in prompts.txt (a prompt may hold blank lines)

def feature_layers(config) -> tuple[int, ...]:
    """The target layers whose states are kept: z-lab's spread for 3- and for 5-layer drafters, and the last
    layer (the target's own next-token law for a soft loss: features.final_layer)."""
    from ..models.dflash import default_target_layer_ids

    n = config.num_hidden_layers
    return tuple(sorted(set(default_target_layer_ids(n, 3)) | set(default_target_layer_ids(n, 5)) | {n - 1}))


class LayerTap:
    """Forward hooks that keep the outputs of some decoder layers over a whole generate() call: the
    drafter's training features come from the generation's own forwards, not from a second pass. Each is
    kept as transformers' output_hidden_states gives it (features.target_features): the last layer's after
    the final norm."""

    def __init__(self, target, layer_ids: tuple[int, ...]):
        decoder = target.get_decoder()
        last = len(decoder.layers) - 1
        self.outputs: list[list] = [[] for _ in layer_ids]
        self.handles = [decoder.layers[i].register_forward_hook(self._keep(k, decoder.norm if i == last else None))
                        for k, i in enumerate(layer_ids)]

    def _keep(self, k: int, norm):
        def hook(module, args, output):
            state = output[0] if isinstance(output, tuple) else output
            if norm is not None:
                state = norm(state)
            self.outputs[k].append(state.clamp(-65504, 65504).to(torch.float16))   # fp16's range, never inf
        return hook

    def features(self, length: int):
        """[batch, length, k*H]: the kept states of every position; the last token, never fed, gets zeros."""
        got = torch.cat([torch.cat(steps, dim=1) for steps in self.outputs], dim=-1)
        return torch.nn.functional.pad(got, (0, 0, 0, length - got.shape[1]))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def generate(target, tokenizer, prompts: list[str], out: Path, batch: int, log, rt=None) -> None:
    """Replies in length-sorted batches, run in a shuffled order; batch i is saved to out/part-i.pt (token
    ids and the target's states at feature_layers per conversation), so a rerun resumes and the parts written
    so far are already a fair sample of the whole. Under torchrun (rt) the ranks take the batches round robin;
    a batch's reply depends on its index alone, so the parts are those one process writes."""
    tokenizer.padding_side = "left"
    rendered = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                              add_generation_prompt=True) for p in prompts]
    order = sorted(range(len(rendered)), key=lambda i: len(rendered[i]))
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    eos, layers = tokenizer.eos_token_id, feature_layers(target.config)
    t0, done = time.perf_counter(), 0
    shuffled = random.Random(0).sample(range(len(batches)), len(batches))   # any prefix is a sample
    for n in (rt.mine(len(shuffled)) if rt else range(len(shuffled))):
        i = shuffled[n]
        rows = batches[i]
        part = out / f"part-{i:04d}.pt"
        if part.exists():
            continue
        enc = tokenizer([rendered[j] for j in rows], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(target.device)
        temp = TEMPERATURES[i % len(TEMPERATURES)]
        torch.manual_seed(i)
        sampling = {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0} if temp > 0 \
            else {"do_sample": False}
        tap = LayerTap(target, layers)
        try:
            with torch.no_grad():
                got = target.generate(**enc, max_new_tokens=MAX_NEW, pad_token_id=eos, eos_token_id=eos, **sampling)
            got, feats = got.cpu(), tap.features(got.shape[1]).cpu()
        finally:
            tap.close()
        pad, width = (enc["attention_mask"] == 0).sum(1).tolist(), enc["input_ids"].shape[1]
        convs = []
        for r in range(len(rows)):
            stop = (got[r, width:] == eos).nonzero()
            end = width + (int(stop[0]) + 1 if len(stop) else got.shape[1] - width)
            # prompt + reply + EOS without the padding, and the states of those positions
            convs.append((got[r, pad[r]:end].to(torch.int32), feats[r, pad[r]:end].clone()))
        torch.save({"layer_ids": layers, "conversations": convs}, part)
        done += len(rows)
        log(f"batch {n + 1}/{len(batches)} (T={temp}): {done} of {len(prompts)} conversations this run, "
            f"{time.perf_counter() - t0:.0f} s")


def collect(out: Path, hidden: int, header: list[int]) -> int:
    """stream.pt (every conversation's ids, concatenated) and beside it the feature store of the same tokens
    (features.FeatureStore, with anchors preferred where the next token is a reply's: `header` is the chat
    template's assistant header), from the saved parts; returns the number of tokens."""
    from .features import FeatureStore

    parts = sorted(out.glob("part-*.pt"))
    loaded = [torch.load(p) for p in parts]
    convs = [c for part in loaded for c in part["conversations"]]
    stream = torch.cat([ids for ids, _ in convs])
    torch.save(stream, out / "stream.pt")
    store = FeatureStore.create(out / "features", stream, loaded[0]["layer_ids"], hidden)
    allowed, at = np.zeros(len(stream), dtype=bool), 0
    for ids, feats in convs:
        store.data[at:at + len(ids)] = feats.cpu().numpy()
        allowed[at + reply_start(ids, header) - 1:at + len(ids) - 1] = True   # the next token is the reply's
        at += len(ids)
    store.finish(len(stream))
    store.write_anchors(allowed)
    return len(stream)


def assistant_header(tokenizer) -> list[int]:
    """The tokens the chat template adds where the assistant speaks next (SmolLM2: <|im_start|>assistant\\n)."""
    messages = [{"role": "user", "content": "x"}]
    bare = tokenizer.apply_chat_template(messages, tokenize=False)
    full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not full.startswith(bare) or full == bare:
        raise ValueError("the chat template adds no assistant header of its own; cannot find the replies")
    return tokenizer(full[len(bare):], add_special_tokens=False)["input_ids"]


def reply_start(ids: torch.Tensor, header: list[int]) -> int:
    """Index of a conversation's first reply token: just after the (last) assistant header of its prompt."""
    seq, n = ids.tolist(), len(header)
    starts = [i + n for i in range(len(seq) - n + 1) if seq[i:i + n] == header]
    return starts[-1] if starts else len(seq)


def saved_prompts(saved: Path, rows: int, seed: int, rt, mix: str = DEFAULT_MIX) -> list[str]:
    """The prompts of this run: those its saved parts answered (a rerun resumes), else new ones, written by the
    main rank before any rank reads them."""
    if rt.main and not saved.exists():
        saved.write_text(SEPARATOR.join(build_prompts(rows, seed, mix)), encoding="utf-8")
    rt.barrier()
    return saved.read_text(encoding="utf-8").split(SEPARATOR)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="a target path, .gguf, or 'smollm2'")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=2400, help="conversations to generate")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0,
                        help="which prompt set: another seed gives other conversations (more data for a drafter)")
    parser.add_argument("--mix", choices=list(MIXES), default=DEFAULT_MIX,
                        help="the prompts' families (chat_prompts.py): broad, or the earlier sets' narrower templates")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--collect-only", action="store_true",
                        help="write stream.pt and the feature store from the batches saved so far, generate nothing")
    runtime_options(parser)
    args = parser.parse_args(argv)
    from ..assets import shipped
    from ..loading import load_target

    if args.threads:
        torch.set_num_threads(args.threads)

    rt = runtime_from(args)

    @rt.log
    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    if args.collect_only:   # the tokenizer and the width are all collect needs: no model load
        from transformers import AutoConfig, AutoTokenizer

        from ..loading import gguf_converted

        folder, _ = gguf_converted(shipped(args.target, "target"))
        tok, hidden = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder).hidden_size
    else:
        target, tok = load_target(shipped(args.target, "target"), dtype=rt.target_dtype, device=str(rt.device))
        hidden = target.config.hidden_size
        prompts = saved_prompts(args.out / "prompts.txt", args.rows, args.seed, rt, args.mix)
        log(f"{len(prompts)} prompts; generating replies in batches of {args.batch}")
        generate(target, tok, prompts, args.out, args.batch, log, rt)
        rt.barrier()   # every rank's parts are written before the main rank collects them
    if rt.main:
        tokens = collect(args.out, hidden, assistant_header(tok))
        log(f"wrote {args.out / 'stream.pt'} and its target features: {tokens} tokens")
    leave()
    return 0


if __name__ == "__main__":
    end(main())
