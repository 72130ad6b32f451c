"""What users already have: `transformers`' own prompt lookup (`generate(prompt_lookup_num_tokens=...)`) on the
same model, prompts and machine as `benchmarks/tree_decode.py`, greedy, one prompt at a time.

    python -m benchmarks.hf_prompt_lookup          # writes benchmarks/results/hf_prompt_lookup_cpu.json

The base SmolLM2-135M (our GGUF weights exported as an HF directory, float32), the first `--prompts` held-out
test prompts of `recipes/smollm2_sbd`, `--max-new-tokens` each: plain greedy `generate` against prompt lookup
at each `--lookup-tokens` (its drafts per pass), decode tokens/s (wall clock of `generate`, prefill included:
transformers does not time them apart), forwards (counted by a hook on the model) and outputs against plain
greedy's. torch runs on the CPU with its default threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from sbd_jax.evaluation.results import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hf_model(directory: str):
    """The base SmolLM2 as a `transformers` model and tokenizer, exported to `directory` first."""
    import torch
    from transformers import AutoModelForCausalLM

    from sbd_jax.checkpoints.hf import save_hf
    from sbd_jax.checkpoints.load import load_model

    loaded = load_model("smollm2-135m")
    save_hf(directory, loaded.config, loaded.params, loaded.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.eval()
    return model, loaded


def run(model, prompts, max_new_tokens: int, eos_ids, lookup_tokens: int | None) -> dict:
    """Greedy `generate` of each prompt alone; tokens, forwards and seconds summed."""
    import torch

    calls = {"forwards": 0}
    hook = model.register_forward_hook(lambda *_: calls.__setitem__("forwards", calls["forwards"] + 1))
    outputs, seconds = [], 0.0
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            options = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                           pad_token_id=eos_ids[0])
            if lookup_tokens:
                options["prompt_lookup_num_tokens"] = lookup_tokens
            began = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **options)
            seconds += time.perf_counter() - began
            new = out[0, len(prompt):].tolist()
            ends = [i for i, t in enumerate(new) if t in eos_ids]
            outputs.append(new[: ends[0] + 1] if ends else new)  # up to and including the first EOS, as ours
    finally:
        hook.remove()
    tokens = sum(map(len, outputs))
    # Every forward counts: transformers' first one runs the prompt and emits the first token, as our NTP's first
    # decoding forward (its prefill, not counted, caches the prompt but for the last token) does.
    forwards = calls["forwards"]
    return {"tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "seconds": seconds, "tokens_per_second": tokens / seconds, "outputs": outputs}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lookup-tokens", type=int, nargs="+", default=[3, 10])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "hf_prompt_lookup_cpu.json"))
    args = parser.parse_args(argv)
    from benchmarks.lookup_rule import split_prompts

    with tempfile.TemporaryDirectory() as directory:
        model, loaded = hf_model(directory)
        prompts = split_prompts(loaded.tokenizer, "test", args.prompts)
        eos = loaded.config.eos_token_ids
        plain = run(model, prompts, args.max_new_tokens, eos, None)
        rows = [{"decoder": "transformers greedy", **{k: v for k, v in plain.items() if k != "outputs"}}]
        for n in args.lookup_tokens:
            row = run(model, prompts, args.max_new_tokens, eos, n)
            rows.append({"decoder": f"transformers prompt lookup {n}", "vs_greedy": row["tokens_per_second"] /
                         plain["tokens_per_second"], "identical_to_greedy":
                         sum(a == b for a, b in zip(row.pop("outputs"), plain["outputs"])), **row})
            print(rows[-1], flush=True)
    result = {"args": vars(args), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    from sbd_jax.cli import run_cli

    run_cli(main, sys.argv[1:])
