"""A soak test: every method generates a long stretch of tokens (as many generations as it takes, prompts in
turn, each up to the context limit), with the process memory measured after a warm-up, after the first
pass and at the end. Growth beyond one generation's KV cache means something is kept alive between
generations; a repeat that differs, or acceptance that drifts, means state leaks from one generation into
the next.

    python -m treegen.bench.soak --methods ar,pld,dflash,ddtree -n 5000
    python -m treegen.bench.soak --target Qwen/Qwen3-8B --drafter z-lab/Qwen3-8B-DFlash-b16 -n 5000

The prompts are run pass after pass (at least two passes, T=0), so the last pass must repeat the first token
for token. Exit status 1 when a method's memory grew more than --max-growth-mb (plus one KV cache), or a
repeat differs, or its acceptance moved more than --max-drift between the first and last pass.
"""
from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import asdict, dataclass

import click

from .prompts import DEFAULT_PROMPTS, load_prompts


def rss_mb() -> float:
    """Resident memory of this process (Linux /proc; elsewhere the peak from resource)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def device_mb() -> float:
    import torch

    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0


def kv_cache_mb(model, tokens: int) -> float:
    """One generation's KV cache at `tokens` positions: 2 (K and V) x layers x kv heads x head dim x bytes."""
    c = getattr(model.config, "text_config", None) or model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * tokens / 2**20


@dataclass
class SoakResult:
    method: str
    generations: int
    tokens: int
    seconds: float
    rss_start_mb: float       # after a warm-up generation
    rss_first_pass_mb: float  # after the first pass over the prompts
    rss_end_mb: float
    device_start_mb: float
    device_end_mb: float
    kv_cache_mb: float        # one generation's cache at the context limit
    tau_first_pass: float
    tau_last_pass: float
    repeats_identical: bool   # at T=0 the last pass must give the first pass's tokens, prompt by prompt

    @property
    def growth_mb(self) -> float:
        return max(self.rss_end_mb - self.rss_start_mb, self.device_end_mb - self.device_start_mb)


def soak(gen, prompts: list[str], tokens: int, per_generation: int) -> SoakResult:
    """Pass after pass over the same prompts (at least two) until `tokens` are generated, at T=0."""
    limit = gen.model.config.max_position_embeddings
    sizes = [max(1, min(per_generation, limit - len(gen.encode(p)) - 1)) for p in prompts]
    passes = max(2, -(-tokens // sum(sizes)))
    gen.generate(prompts[0], max_new_tokens=min(32, sizes[0]))   # warm-up: lazy allocations happen now
    gc.collect()
    start_rss, start_dev, first_pass_rss = rss_mb(), device_mb(), 0.0
    runs: list[list] = []
    t0 = time.perf_counter()
    for _ in range(passes):
        runs.append([gen.generate(p, max_new_tokens=n) for p, n in zip(prompts, sizes)])
        gc.collect()
        first_pass_rss = first_pass_rss or rss_mb()
    seconds = time.perf_counter() - t0
    same = all(a.token_ids == b.token_ids for a, b in zip(runs[0], runs[-1]))
    return SoakResult(gen.method, passes * len(prompts), sum(len(o.token_ids) for run in runs for o in run),
                      seconds, start_rss, first_pass_rss, rss_mb(), start_dev, device_mb(),
                      kv_cache_mb(gen.model, limit), tau(runs[0]), tau(runs[-1]), same)


def tau(outs) -> float:
    committed = sum(o.stats.accepted_drafts + o.stats.rounds for o in outs)
    rounds = sum(o.stats.rounds for o in outs)
    return committed / rounds if rounds else 0.0


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--methods", default="ar,pld,dflash,ddtree", show_default=True, help="Comma-separated methods.")
@click.option("-n", "--tokens", type=click.IntRange(min=1), default=5000, show_default=True,
              help="Tokens per method, over as many generations as it takes.")
@click.option("--per-generation", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Most tokens in one generation (the context limit applies too).")
@click.option("--prompts", default=DEFAULT_PROMPTS, show_default=True, help="Prompt file or built-in set.")
@click.option("--limit", type=click.IntRange(min=1), default=4, show_default=True, help="Prompts used, in turn.")
@click.option("--target", help="Target model (default: the demo target).")
@click.option("--drafter", help="DFlash drafter (default on the demo target: the demo drafter).")
@click.option("--threads", type=click.IntRange(min=1), help="CPU threads for torch.")
@click.option("--max-growth-mb", type=float, default=64.0, show_default=True,
              help="Memory growth allowed beyond one KV cache.")
@click.option("--max-drift", type=float, default=0.0, show_default=True,
              help="Largest change of mean acceptance length between the first and last pass (0: at T=0 the "
                   "passes are identical).")
@click.option("--json", "json_path", help="Write the results as JSON.")
def main(methods, tokens, per_generation, prompts, limit, target, drafter, threads, max_growth_mb, max_drift,
         json_path):
    """Soak every method: long generation, memory at start and end, acceptance in both halves."""
    import torch

    from ..api import Generator

    if threads:
        torch.set_num_threads(threads)
    texts = [p.text for p in load_prompts(prompts, limit)]
    base = Generator(target=target, drafter=drafter, method="ar")
    drafter_path = base.drafter
    results, failed = [], False
    for method in methods.split(","):
        gen = base.with_method(method, drafter_path if method in ("dflash", "ddtree") else None)
        r = soak(gen, texts, tokens, per_generation)
        ok = r.growth_mb <= max_growth_mb + r.kv_cache_mb and r.repeats_identical \
            and abs(r.tau_last_pass - r.tau_first_pass) <= max_drift
        failed |= not ok
        results.append({**asdict(r), "growth_mb": r.growth_mb, "ok": ok})
        print(f"{method:8s} {r.generations:3d} generations {r.tokens:6d} tokens {r.seconds:7.1f} s "
              f"{r.tokens / r.seconds:6.1f} tok/s | rss {r.rss_start_mb:.1f} -> {r.rss_first_pass_mb:.1f} -> "
              f"{r.rss_end_mb:.1f} MB (growth {r.growth_mb:+.1f}; one KV cache {r.kv_cache_mb:.1f}) | tau "
              f"{r.tau_first_pass:.2f} -> {r.tau_last_pass:.2f}, repeat identical: {r.repeats_identical} | "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
