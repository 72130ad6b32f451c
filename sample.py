"""Generate text with an sbd_jax model.

    python sample.py --model smollm2-135m --prompt "What is 2+2?" --chat --mode ntp --max-new-tokens 64 [--json]

`--model` takes a known name (smollm2-135m), a Hugging Face model directory or a .gguf file.
Bad input ends with a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from sbd_jax.cli import run_cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model name, HF directory or .gguf file")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--mode", choices=["ntp"], default="ntp", help="ntp: one token per forward pass")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-cache-len", type=int, default=None,
                   help="KV cache slots per row (default: the model's context length)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return p.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    import jax  # imported after argument parsing so --help and usage errors are instant

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.sampler import NTPDecoder, generate
    from sbd_jax.tokenizer import encode_prompt

    decoder_options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p)
    model = load_model(args.model, dtype=args.dtype)
    decoder = NTPDecoder(model.config, eos_ids=model.config.eos_token_ids, **decoder_options)
    prompts = [encode_prompt(model.tokenizer, text, args.chat) for text in args.prompt]
    results, timing = generate(decoder, jax.device_put(model.params), prompts, seed=args.seed,
                               max_cache_len=args.max_cache_len)
    for text, result in zip(args.prompt, results):
        generated = model.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        n = len(result.token_ids)
        if args.json:
            print(json.dumps({
                "prompt": text, "text": generated, "token_ids": result.token_ids, "new_tokens": n,
                "nfe": result.nfe, "tokens_per_pass": n / max(result.nfe, 1), "seconds": timing.seconds,
                "prefill_seconds": timing.prefill_seconds, "decode_seconds": timing.decode_seconds,
                "compile_seconds": timing.compile_seconds, "batch": len(prompts), "mode": args.mode,
            }))
        else:
            print(generated)
            print(f"[{args.mode}: {n} tokens in {result.nfe} passes; batch of {len(prompts)}: prefill "
                  f"{timing.prefill_seconds:.2f}s, decode {timing.decode_seconds:.2f}s, "
                  f"compile {timing.compile_seconds:.1f}s]")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
