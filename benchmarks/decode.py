"""NTP decode speed: sbd_jax vs transformers' `generate`, same model, prompts and lengths, one run.

    python -m benchmarks.decode [--model smollm2-135m] [--new-tokens 64] [--batches 1 8] [--repeats 3]

Both sides decode exactly `--new-tokens` tokens per row greedily (EOS ignored, so the work is equal)
and are timed end to end, prefill included; best of `--repeats`. Our compile time is reported apart.
Prints a table and writes benchmarks/results/decode_<platform>.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import time

from sbd_jax.evaluation.results import write_json

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a CPU executes an instruction.",
    "What is the capital of France?",
    "Give me three tips for learning a new language.",
    "Write a Python function that checks whether a number is prime.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "List five fruits that are rich in vitamin C and say why they are healthy.",
]


def time_ours(model, prompts, new_tokens, repeats):
    import jax

    from sbd_jax.decoding.base import NTPDecoder
    from sbd_jax.decoding.generate import Executables, generate

    decoder = NTPDecoder(model.config, max_new_tokens=new_tokens)  # no EOS: always new_tokens tokens
    params = jax.device_put(model.params)
    executables = Executables()
    results, first = generate(decoder, params, prompts, executables=executables)
    assert all(len(r.token_ids) == new_tokens for r in results)
    runs = [generate(decoder, params, prompts, executables=executables)[1] for _ in range(repeats)]
    best = min(runs, key=lambda t: t.seconds)
    return {"seconds": best.seconds, "prefill_seconds": best.prefill_seconds,
            "decode_seconds": best.decode_seconds, "compile_seconds": first.compile_seconds}


def time_transformers(model, prompts, new_tokens, repeats):
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(model.source)
    kwargs = {"gguf_file": name} if name.endswith(".gguf") else {}
    hf_model = AutoModelForCausalLM.from_pretrained(folder if kwargs else model.source, dtype=torch.float32,
                                                    **kwargs).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):  # left padding, as transformers expects for generation
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  pad_token_id=0)
    times = []
    with torch.no_grad():
        hf_model.generate(ids, **kwargs)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            out = hf_model.generate(ids, **kwargs)
            times.append(time.perf_counter() - start)
    assert out.shape[1] == width + new_tokens
    return {"seconds": min(times), "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import jax

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.checkpoints.tokenizer import encode_prompt

    model = load_model(args.model)
    encoded = [encode_prompt(model.tokenizer, p, chat=True) for p in PROMPTS]
    rows = []
    for batch in args.batches:
        prompts = [encoded[i % len(encoded)] for i in range(batch)]
        ours = time_ours(model, prompts, args.new_tokens, args.repeats)
        theirs = time_transformers(model, prompts, args.new_tokens, args.repeats)
        tokens = batch * args.new_tokens
        rows.append({
            "batch": batch, "new_tokens": args.new_tokens,
            "sbd_jax_tokens_per_s": tokens / ours["seconds"],
            "sbd_jax_decode_only_tokens_per_s": tokens / ours["decode_seconds"],
            "transformers_tokens_per_s": tokens / theirs["seconds"],
            "speedup_vs_transformers": theirs["seconds"] / ours["seconds"],
            "sbd_jax": ours, "transformers": theirs,
        })
        r = rows[-1]
        print(f"batch {batch}: sbd_jax {r['sbd_jax_tokens_per_s']:.1f} tok/s "
              f"(decode only {r['sbd_jax_decode_only_tokens_per_s']:.1f}, compile {ours['compile_seconds']:.1f}s) | "
              f"transformers {r['transformers_tokens_per_s']:.1f} tok/s | ratio {r['speedup_vs_transformers']:.2f}x",
              flush=True)
    device = jax.devices()[0]
    report = {"model": args.model, "platform": device.platform, "device": device.device_kind,
              "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
              "jax": jax.__version__, "rows": rows}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"decode_{device.platform}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
