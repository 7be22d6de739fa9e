"""`treegen bench`: every method side by side in one run, on the same prompts, interleaved.

Only click and torch-free modules are imported here, so `treegen --help` stays fast; the run is in
run_bench().
"""
from __future__ import annotations

import shlex

import click
from click.core import ParameterSource

from ..cli_options import SpecType
from ..validate import SAMPLING
from .defaults import DEFAULT_REPEATS, DEFAULT_SEED, WARMUP_TOKENS
from .prompts import DEFAULT_PROMPTS

HELP = f"""Benchmark methods side by side: acceptance, tokens/s, speedup vs ar.

Every number is given over all prompts and per prompt category. The table goes to stdout; --json and
--plot write files. Each target is loaded once and shared by its methods; after a warm-up
({WARMUP_TOKENS} tokens per method) every prompt runs every method in turn, so drift hits all alike.
At T=0 an output that differs from ar's is shown in red and makes the exit status 1. A warning on stderr
says when other processes competed for the cores (the timings are then not the methods'). Ctrl-C keeps
the prompts every method finished: their table and JSON, exit status 130.

\b
treegen bench --methods ar,pld,dflash,ddtree -n 128 --json bench.json --plot bench.png
treegen bench --methods ar,a/ddtree-32.yaml,b/ddtree-64.yaml --prompts my.jsonl
treegen bench --target Qwen/Qwen3-8B --methods ar,pld --prompts chat --temperature 0.7
"""


@click.command(help=HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--methods", metavar="LIST",
              help="Comma-separated method names, preset names or preset .yaml paths (each row is labelled "
                   "by its name; two presets of one method compare two settings). A name that is both is the "
                   "method. Default: every method, those needing a drafter when there is one. An `ar` "
                   "baseline is added when missing.")
@click.option("--prompts", metavar="FILE|NAME",
              help=f"A .jsonl file ({{\"prompt\", \"id\", \"category\"}} a line), a text file of prompts "
                   f"separated by blank lines, or a built-in set: {DEFAULT_PROMPTS} (code, the default), "
                   f"thirdparty-code, prose, chat, code-chat.")
@click.option("--chat/--plain", "chat", default=None,
              help="Send each prompt as a user message in the target's chat template (--chat) or as plain text "
                   "to continue (--plain). Default: --chat for the built-in chat and code-chat sets, --plain otherwise.")
@click.option("-n", "--max-new-tokens", type=click.IntRange(min=1), metavar="N",
              help="Most new tokens per generation (default: the API's).")
@click.option("--temperature", "--temp", "temperature", type=SpecType(SAMPLING["temperature"]), metavar="T",
              help="0 = greedy (the default), where every output must equal ar's token for token.")
@click.option("--repeats", type=click.IntRange(min=1), default=DEFAULT_REPEATS, show_default=True, metavar="R",
              help="Passes over the prompts; speedups are medians over repeats.")
@click.option("--limit", type=click.IntRange(min=1), metavar="K", help="Only the first K prompts.")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=DEFAULT_SEED, show_default=True, metavar="S",
              help="Base seed when sampling (prompt i of repeat r gets seed+r*prompts+i, for every method).")
@click.option("--target", metavar="HUB_ID|PATH",
              help="Target model: hub id, folder, .gguf, demo or smollm2 (default: the shipped demo target); overrides "
                   "the presets' too.")
@click.option("--drafter", metavar="PATH",
              help="Drafter checkpoint for the methods that need one (default on a shipped pair's target: the "
                   "checkpoint it ships for each method); overrides the presets' too.")
@click.option("--hf-assistant", metavar="PATH",
              help="An autoregressive draft model for the hf-assisted peer (transformers assisted generation).")
@click.option("--peers/--no-peers", default=True, show_default=True,
              help="Also run transformers' generate(): plain (hf-generate) and with prompt lookup (hf-pld).")
@click.option("--device", help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", help="auto, fp32, fp16, bf16 or int8 (as treegen complete --dtype).")
@click.option("--threads", type=click.IntRange(min=1), metavar="N",
              help="CPU threads for torch (default: torch's; fewer on a machine shared with other work).")
@click.option("--json", "json_path", metavar="PATH", help="Write every number (and every run) as JSON.")
@click.option("--plot", "plot_path", metavar="PATH",
              help="Write a PNG: acceptance length and speedup by category, acceptance per position. Needs "
                   "matplotlib, an optional extra: pip install 'treegen[bench]' (checked before anything loads).")
@click.option("--allow-mismatch", is_flag=True, help="Exit 0 even when a T=0 output differs from ar's.")
@click.option("--quiet", is_flag=True, help="No progress on stderr.")
@click.option("--debug", is_flag=True, help="Show tracebacks of errors.")
@click.pass_context
def bench(ctx, debug, **kw):
    from ..cli_errors import check_output_path, failures

    if kw["hf_assistant"] and not kw["peers"]:
        raise click.UsageError("--hf-assistant is a peer: drop --no-peers", ctx=ctx)
    check_output_path(kw["json_path"], "--json")    # before the run, not after it
    check_output_path(kw["plot_path"], "--plot")
    kw = shipped_names(kw)
    check_inputs(kw)
    with failures(debug):
        from .session import run_bench

        run_bench(kw, command_line(ctx))


def shipped_names(kw: dict) -> dict:
    """--target/--drafter take the shipped names (demo, smollm2, PAIR/NAME) as chat and complete do."""
    from ..cli_options import shipped
    from ..validate import OptionError

    try:
        return {**kw, "target": shipped(kw["target"], "target"), "drafter": shipped(kw["drafter"], "drafter")}
    except OptionError as err:
        raise click.UsageError(str(err)) from None


def check_inputs(kw: dict) -> None:
    """Prompts and --methods entries (methods, presets, their options, drafters): a problem is a usage
    error (exit 2), found before any model loads. run_bench() resolves them again, at no cost."""
    from ..cli_errors import clip
    from .methods import MethodSpecError, default_methods, resolve, split_list
    from .prompts import PromptError, load_prompts

    try:
        load_prompts(kw["prompts"] or DEFAULT_PROMPTS, kw["limit"])
        names = split_list(kw["methods"]) if kw["methods"] else default_methods(kw["target"], kw["drafter"])
        resolve(names, kw["target"], kw["drafter"])
    except (MethodSpecError, PromptError) as err:
        raise click.UsageError(clip(str(err))) from None


def command_line(ctx: click.Context) -> str:
    """The invocation, from the options given (not their defaults), as one shell line."""
    parts = ["treegen", "bench"]
    for param in ctx.command.params:
        if param.name == "debug" or ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        value = ctx.params[param.name]
        if isinstance(value, bool):
            parts.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            parts += [param.opts[-1], str(value)]
    return shlex.join(parts)
