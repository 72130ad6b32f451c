"""Generate text with an sbd_jax model, one token per pass (NTP) or blocks of tokens per pass (SBD).

    python sample.py --model smollm2-135m --prompt "What is 2+2?" --chat --mode ntp --max-new-tokens 64 [--json]
    python sample.py --model DIR --prompt "..." --mode sbd --gamma 0.35 --block-size 16 [--show-passes]
    python sample.py --model DIR --prompt "..." --mode sbd --verify   # exactly NTP's output (or distribution)
    python sample.py --model smollm2-135m --prompt "..." --chat --mode sbd --verify --drafts lookup   # any model
    python sample.py --model DIR --prompts-file p.jsonl --mode sbd --verify --block-size auto   # fastest k here
    python sample.py --model DIR --prompts-file prompts.jsonl --mode sbd   # {"prompt": "..."} per line
    python sample.py --model DIR --prompts-file big.jsonl --batch-size 16   # written batch by batch

`--model` takes a known name (smollm2-135m), a Hugging Face model directory or a .gguf file.
Bad input ends with a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from typing import Any, Iterator

from sbd_jax.cli import run_cli
from sbd_jax.decoding.base import DEFAULT_GAMMA, check_whole_number
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.generate import BatchTiming, batch_seed, check_seed
from sbd_jax.decoding.settings import Mode
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.decoding.verified import DEFAULT_DRAFT_NODES
from sbd_jax.errors import PromptError, UserError
from sbd_jax.evaluation.recorded import record
from sbd_jax.model.config import RUN_DTYPES, DType

_COLOURS = [31, 32, 33, 34, 35, 36]  # ANSI foreground colours, cycled by pass
_CORRECTED = "7"  # reverse video: a verified run's correction of a rejected draft


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name, HF directory or .gguf file")
    p.add_argument("--prompt", action="append", default=[], help="prompt text; repeat for a batch")
    p.add_argument("--prompts-file", help='JSONL file, one {"prompt": "..."} per line, run in batches of --batch-size')
    p.add_argument("--batch-size", type=int, default=64,
                   help="prompts decoded together (default 64); output is written as each batch finishes. Memory "
                   "grows with it: about 1 MB a row on the shipped 4-layer model, several MB on SmolLM2-135M")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--mode", choices=list(Mode), default=Mode.NTP,
                   help="ntp: one token per forward; sbd: Entropy-Bounded block decoding")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gamma", type=float, default=None,
                   help=f"SBD: entropy budget per pass (0 = one token; default {DEFAULT_GAMMA}); not with --verify")
    p.add_argument("--block-size", type=block_size_arg, default=16,
                   help="SBD: tokens per block; with --verify also 'auto': time blocks 4 / 8 / 16 on this machine "
                   "at this batch (greedy verified decoding of the first 64 tokens of each prompt, then bare "
                   "forwards) and use the fastest predicted, or NTP where none is predicted to beat it")
    p.add_argument("--proxy", default=Proxy.ENTROPY,
                   help=f"SBD: uncertainty score, one of {', '.join(Proxy)} ({Proxy.LEFT_TO_RIGHT}: a diagnostic order)")
    p.add_argument("--verify", action="store_true",
                   help="SBD: verify every drafted block with the causal pass that commits it, so the output "
                   "is exactly greedy NTP's (with --temperature: drawn exactly from NTP's distribution); "
                   "drafts come from one pass, so it never takes more forwards than NTP. Exact in float32; with "
                   "--dtype bfloat16, near-tied tokens can differ as they do between NTP batch sizes")
    p.add_argument("--drafts", choices=[d.value for d in Drafts], default=Drafts.SBD.value,
                   help="with --verify: what proposes the drafts. One chain a pass: sbd (the masked block; needs an "
                   "SBD fine-tune), lookup (what followed the latest earlier occurrence of the last 1-4 tokens in "
                   "prompt + output: any model, no fine-tune) or hybrid (per row, whichever has had more drafts kept). "
                   "A tree a pass (--draft-nodes candidates, block size - 1 deep): context-tree (every "
                   "recent earlier match), successors (the model's own top-k next tokens, kept from every pass), "
                   "tree (both), sbd-tree (the masked block's likeliest tokens at each position; needs an SBD "
                   "fine-tune) or tree-sbd (tree's and sbd-tree's nodes as one tree; needs an SBD fine-tune)")
    p.add_argument("--draft-nodes", type=draft_nodes_arg, default=DEFAULT_DRAFT_NODES, metavar="N|auto",
                   help="tree drafts: candidate tokens checked a pass besides the exact one (wider passes cost more "
                   "on a CPU, about the same on a GPU at small batch: benchmarks/tree_decode.py measures both). "
                   f"auto: up to {AUTO_DRAFT_NODES}, each pass at the width with the most expected tokens per second "
                   "on pass costs timed here at the batch size decoded")
    p.add_argument("--lookup-min-match", type=int, default=1, metavar="N",
                   help="drafts read from the context (lookup, hybrid, context-tree, tree, tree-sbd): the shortest "
                   "n-gram match (1-4) that proposes drafts; passes without "
                   "drafts run one token. 2 is faster on a CPU at batch 1, where a k-token pass costs more than a 1-token "
                   "one (benchmarks/results/lookup_decode_speed_run4_cpu.json); 1 (most tokens per forward) on GPUs")
    p.add_argument("--draft-memory", action="store_true",
                   help="tree drafts (context-tree / successors / tree / tree-sbd): keep the model's successor table "
                   "(Token Recycling's hot start) and the last 4,096 tokens of earlier answers, searched like the "
                   "context (SuffixDecoding), from batch to batch of a prompts file instead of starting each batch "
                   "empty (one batch: no effect); greedy only; outputs are unchanged, forwards depend on the batches "
                   "before")
    p.add_argument("--fallback-blocks", type=int, default=0, metavar="N",
                   help="sbd / hybrid / sbd-tree / tree-sbd drafts: N more masked blocks in each pass, one after each of the first N places "
                   "a draft can be rejected (at most k - 1), so a rejection still leaves drafts for the next pass; "
                   "the pass grows to (2 + N) k tokens (by the roofline nearly free on a GPU at small batch; on a CPU its cost grows with its width)")
    p.add_argument("--adapter", default=None,
                   help="a gated adapter for this base model: a shipped adapter's name (smollm2-135m-sbd, for "
                        "smollm2-135m) or a directory (train.py with adapter.rank > 0 writes workdir/adapter); NTP "
                        "stays the base's exactly, SBD's blocks use the adapter")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="SBD: mask token id, for models whose config.json does not set sbd_mask_token_id; "
                   "every mode then never emits it (so --mode ntp and --verify compare exactly)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="KV cache slots per row (default: the model's context length)")
    p.add_argument("--dtype", choices=RUN_DTYPES, default=DType.FLOAT32, help="compute dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument("--show-passes", action="store_true", help="colour each token by the pass that revealed it")
    return p.parse_args(argv)


AUTO_DRAFT_NODES = 32  # --draft-nodes auto: the widest tree it may run


def draft_nodes_arg(text: str) -> int | str:
    return "auto" if text == "auto" else block_size_arg(text)


def block_size_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {text!r}") from None


def read_prompts_file(path: str) -> list[tuple[int, str]]:
    """(line number, prompt) of each line of a JSONL file; a bad line is named by file and line number."""
    from sbd_jax.data.jsonl import iter_jsonl

    prompts = []
    try:
        for number, row in iter_jsonl(path):
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise UserError(f'{path}:{number}: expected an object with a "prompt" string')
            prompts.append((number, row["prompt"]))
    except UnicodeDecodeError:
        raise UserError(f"{path}:{first_non_utf8_line(path)}: not UTF-8 text; save the file as UTF-8") from None
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def first_non_utf8_line(path: str) -> int:
    """The number of the first line that is not UTF-8 (the decoder reads in blocks, so its error has no line)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return 0


@contextlib.contextmanager
def naming_prompts(sources: list[str], start: int = 0) -> Iterator[None]:
    """A bad prompt of the batch from `sources[start]` on is named by its flag or file line."""
    try:
        yield
    except PromptError as e:
        raise UserError(f"{sources[start + (e.index or 0)]}: {e.problem}") from None


def coloured(tokenizer, token_ids: list[int], passes: list[int], corrected: list[bool]) -> str:
    """The text with each pass's tokens in its colour (a verified run's corrections reversed). Runs of one
    colour are decoded together; one that ends inside a character (byte-level tokens split it) is carried into
    the next, so the character shows whole, in the colour of the pass that completed it, never as U+FFFD."""
    pieces, start = [], 0
    for end in range(1, len(token_ids) + 1):
        style = (passes[end - 1], corrected[end - 1])
        if end < len(token_ids) and (passes[end], corrected[end]) == style:
            continue
        text = tokenizer.decode(token_ids[start:end])
        if end < len(token_ids) and text.endswith("\ufffd"):
            continue  # an incomplete character: the next pass's tokens finish it
        pieces.append(f"\033[{_CORRECTED if style[1] else _COLOURS[style[0] % len(_COLOURS)]}m{text}\033[0m")
        start = end
    return "".join(pieces)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    texts, sources = list(args.prompt), [f"--prompt {i}" for i in range(1, len(args.prompt) + 1)]
    for number, text in read_prompts_file(args.prompts_file) if args.prompts_file else []:
        texts.append(text)
        sources.append(f"{args.prompts_file}:{number}")
    if not texts:
        raise UserError("give at least one --prompt or a --prompts-file")
    check_whole_number("--batch-size", args.batch_size, 1)
    check_seed(args.seed)
    from sbd_jax.api import load
    from sbd_jax.decoding.settings import Settings

    auto = args.block_size == "auto"
    if auto and not (args.mode == Mode.SBD and args.verify):
        raise UserError("--block-size auto picks the fastest block for verified SBD, whose output does not depend "
                        "on it: add --mode sbd --verify, or give plain SBD a number (its block size changes the text)")
    # with auto, block 16 only passes the checks; the measured choice replaces it after the model loads
    settings = Settings(mode=args.mode, max_new_tokens=args.max_new_tokens,
                        block_size=16 if auto else args.block_size, gamma=args.gamma, proxy=args.proxy,
                        verify=args.verify, drafts=args.drafts, lookup_min_match=args.lookup_min_match,
                        fallback_blocks=args.fallback_blocks, draft_memory=args.draft_memory,
                        draft_nodes=AUTO_DRAFT_NODES if args.draft_nodes == "auto" else args.draft_nodes,
                        temperature=args.temperature,
                        top_p=args.top_p)  # checked before the slow model load
    model = load(args.model, dtype=args.dtype, mask_token_id=args.mask_token_id, adapter=args.adapter)
    batch = min(args.batch_size, len(texts))
    if auto:  # measured on the first batch, at the batch size decoded
        with naming_prompts(sources):
            choice = model.choose_block_size(texts[:batch], batch, settings, chat=args.chat)
        print(f"[--block-size auto at batch {batch}: {choice.describe()}]", file=sys.stderr)
        settings = (settings.as_ntp() if choice.block_size == 1
                    else dataclasses.replace(settings, block_size=choice.block_size))
    if args.draft_nodes == "auto" and settings.drafts.is_tree and not settings.drafts.reads_masked_block:  # timed on the first batch, at its size
        with naming_prompts(sources):
            settings = model.with_measured_widths(texts[:batch], batch, settings, chat=args.chat)
        print(f"[--draft-nodes auto at batch {batch}: pass costs {', '.join(f'{w}: {s * 1e3:.1f} ms' for w, s in settings.pass_costs)}]",
              file=sys.stderr)
    results, timings = [], []
    for i, start in enumerate(range(0, len(texts), batch)):  # each batch written as it finishes
        with naming_prompts(sources, start):
            results += model.generate(texts[start: start + batch], settings, chat=args.chat,
                                      seed=batch_seed(args.seed, i), max_cache_len=args.max_cache_len)
        timings.append(model.last_timing)
        print_batch(args, settings, model.tokenizer, texts[start: start + batch], results[start:], timings[-1],
                    alone=len(texts) == 1)
        sys.stdout.flush()
    if not args.json and len(texts) > 1:
        timing = BatchTiming.total(timings)
        tokens = sum(len(r.token_ids) for r in results)
        passes = sum(r.nfe for r in results)
        batches = f"batch of {len(texts)}" if batch == len(texts) else f"{len(texts)} prompts in batches of {batch}"
        print(f"[{settings.mode}, {batches}: {tokens} tokens, mean {tokens / max(passes, 1):.2f} "
              f"tokens/pass, {tokens / timing.seconds:.1f} tokens/s (prefill {timing.prefill_seconds:.2f}s + "
              f"decode {timing.decode_seconds:.2f}s), compile {timing.compile_seconds:.1f}s]")


def print_batch(args: argparse.Namespace, settings: Any, tokenizer: Any, texts: list[str], results: list[Any],
                timing: Any, alone: bool) -> None:
    """One batch's generations: JSON objects, coloured passes or plain text (`alone`: with a summary line)."""
    for text, result in zip(texts, results):
        n = len(result.token_ids)
        if args.json:
            print(json.dumps({
                "prompt": text, "text": result.text, "token_ids": result.token_ids, "new_tokens": n,
                "nfe": result.nfe, "tokens_per_pass": result.tokens_per_pass, "seconds": timing.seconds,
                "prefill_seconds": timing.prefill_seconds, "decode_seconds": timing.decode_seconds,
                "compile_seconds": timing.compile_seconds, "batch": len(texts), **record(settings),
                **({"reveal_pass": result.reveal_pass} if settings.mode == Mode.SBD else {}),
                **({"accepted_fraction": result.accepted_fraction,
                    "drafted": result.drafted, "accepted": result.accepted, "lookup_drafted": result.lookup_drafted,
                    "lookup_accepted": result.lookup_accepted, "corrected": result.corrected}
                   if settings.verify else {}),
            }))
        elif args.show_passes:
            print(coloured(tokenizer, result.token_ids, result.reveal_pass, result.corrected))
        else:
            print(result.text)
        if not args.json and alone:
            accepted = (f", {result.accepted_fraction:.0%} of {settings.drafts} drafts accepted" if settings.verify
                        else "")
            print(f"[{settings.mode}: {n} tokens in {result.nfe} passes ({result.tokens_per_pass:.2f} tokens/pass"
                  f"{accepted}); "
                  f"prefill {timing.prefill_seconds:.2f}s, decode {timing.decode_seconds:.2f}s, "
                  f"compile {timing.compile_seconds:.1f}s]")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
