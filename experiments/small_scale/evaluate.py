"""Evaluation of one trained model: held-out NTP loss, and arithmetic whole-answer exact match for NTP
decoding and for SBD decoding over a (block size, γ) grid, wall-clock tokens/s. Every decode is greedy.

    python experiments/small_scale/evaluate.py --model experiments/small_scale/models/sbd_arith
        [--block-size 16 --gamma 0.1 ...] [--problems 2000]   # re-evaluate a saved model, no training
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.small_scale.arithmetic import Problem, final_result
from sbd_jax import masks
from sbd_jax.config import ModelConfig
from sbd_jax.data import Packed, load_packed
from sbd_jax.model import Transformer
from sbd_jax.objective import Batch, ntp_loss
from sbd_jax.decoders import NTPDecoder
from sbd_jax.sampler import BatchTiming, Executables, Generation, generate, tokens_per_pass
from sbd_jax.sbd_decoder import SBDDecoder
from sbd_jax.verified_decoder import VerifiedSBDDecoder


@dataclasses.dataclass(frozen=True)
class Trained:
    name: str
    config: ModelConfig
    params: Any
    tokenizer: Any
    executables: Executables = dataclasses.field(default_factory=Executables)  # its compiled decoders


def heldout_ntp_loss(model: Trained, files: Sequence[str], seq_len: int, batch_size: int = 64,
                     max_rows: int | None = None) -> float:
    """Mean next-token loss over every loss-carrying token of the files (answers only for chats), or of
    `max_rows` packed rows spread evenly over them."""
    packed = load_packed(files, model.tokenizer, seq_len)
    if max_rows is not None and max_rows < len(packed.tokens):
        packed = Packed(*(x[np.linspace(0, len(x) - 1, max_rows).astype(int)] for x in packed))
    loss_fn = _ntp_loss(model.config)
    total, count = 0.0, 0.0
    for start in range(0, len(packed.tokens), batch_size):  # sums stay on device: no host sync per batch
        batch = Batch(*(jnp.asarray(x[start: start + batch_size]) for x in packed))
        loss, metrics = loss_fn(model.params, batch=batch)
        total += loss * metrics["ntp_tokens"]
        count += metrics["ntp_tokens"]
    return float(total / count)


@functools.lru_cache(maxsize=None)
def _ntp_loss(config: ModelConfig) -> Any:
    """One jitted held-out loss per architecture, shared by every model and file of that shape."""
    return jax.jit(functools.partial(ntp_loss, model=Transformer(config)))


def settings(model: Trained, block_sizes: Sequence[int], gammas: Sequence[float],
             diagnostic_block: int) -> list[dict]:
    """Decoding settings: NTP; for a model with a mask token, the left-to-right γ = 0 diagnostic at
    `diagnostic_block` and the Entropy-Bounded grid."""
    out = [dict(mode="ntp", block_size=1, gamma=None, proxy=None)]
    if model.config.mask_token_id is not None:
        out.append(dict(mode="sbd_left_to_right", block_size=diagnostic_block, gamma=0.0, proxy="left_to_right"))
        out += [dict(mode="sbd", block_size=k, gamma=g, proxy="entropy") for k in block_sizes for g in gammas]
    return out


def decode(model: Trained, setting: dict, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           pad_to: int = 0) -> tuple[list[Generation], BatchTiming]:
    """Greedy decoding of token-id prompts in one batch with a setting of `settings`."""
    common = dict(max_new_tokens=max_new_tokens, eos_ids=model.config.eos_token_ids)
    if setting["mode"] == "ntp":
        decoder = NTPDecoder(model.config, **common)
    elif setting.get("verify", False):
        decoder = VerifiedSBDDecoder(model.config, block_size=setting["block_size"], **common)
    else:
        decoder = SBDDecoder(model.config, block_size=setting["block_size"], proxy=setting["proxy"], **common)
    gamma = {} if setting["gamma"] is None else {"gamma": setting["gamma"]}
    return generate(decoder, model.params, prompts, pad_to=pad_to, executables=model.executables, **gamma)


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return float(centre - half), float(centre + half)


def paired_difference(a: Sequence[bool], b: Sequence[bool], z: float = 1.96) -> dict:
    """Accuracy of `a` minus `b` on the same problems, with a 95% interval from the per-problem
    differences, and the discordant counts (a right where b is wrong, and the reverse)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    half = z * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else 1.0
    return {"difference": float(d.mean()), "ci95": [float(d.mean() - half), float(d.mean() + half)],
            "only_first_right": int((d > 0).sum()), "only_second_right": int((d < 0).sum())}


Prompt = Callable[[Any, str], list[int]]  # (tokenizer, question) -> token ids the answer follows


def arithmetic_metrics(model: Trained, setting: dict, test: Sequence[Problem], max_new_tokens: int,
                       prompt: Prompt = chat_prompt, batch_size: int = 0) -> dict:
    """Whole-answer exact match (the worked steps and the result, as the model should write them),
    final-number match, both by answer length (steps), and tokens per pass (with verified SBD, the
    fraction of drafted tokens accepted). Decoded in batches of `batch_size` (0: all at once)."""
    prompts = [prompt(model.tokenizer, p.question) for p in test]
    step = batch_size or len(prompts)
    longest = max(len(p) for p in prompts)  # one compiled prompt shape for every batch
    results = [r for start in range(0, len(prompts), step)
               for r in decode(model, setting, prompts[start: start + step], max_new_tokens, longest)[0]]
    texts = [model.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    whole = np.array([t == p.answer for t, p in zip(texts, test)])
    final = np.array([final_result(t) == p.result for t, p in zip(texts, test)])
    steps = np.array([p.steps for p in test])
    return {"n": len(test), "accuracy": float(whole.mean()), "ci95": wilson(int(whole.sum()), len(test)),
            "accuracy_final_number": float(final.mean()), "tokens_per_pass": tokens_per_pass(results),
            "accuracy_by_steps": {int(s): float(whole[steps == s].mean()) for s in np.unique(steps)},
            "accepted_fraction": sum(r.accepted for r in results) / max(sum(r.drafted for r in results), 1),
            "correct": "".join("1" if c else "0" for c in whole),
            "examples": [{"question": p.question, "output": t} for p, t in list(zip(test, texts))[:3]]}


def tokens_per_second(model: Trained, setting: dict, test: Sequence[Problem], max_new_tokens: int, batch: int,
                      repeats: int, prompt: Prompt = chat_prompt) -> tuple[float, float]:
    """Generated tokens per second of decoding the problems in batches of `batch`, compile excluded (every
    batch is padded to one compiled shape): (decoding alone, what SBD changes; with the prompts' prefill,
    which both modes share), the run with the median decoding rate of `repeats`."""
    prompts = [prompt(model.tokenizer, p.question) for p in test]
    longest = max(len(p) for p in prompts)
    rates = []
    for _ in range(repeats):
        tokens, prefill, decoding = 0, 0.0, 0.0
        for start in range(0, len(prompts), batch):
            results, timing = decode(model, setting, prompts[start: start + batch], max_new_tokens, longest)
            tokens += sum(len(r.token_ids) for r in results)
            prefill += timing.prefill_seconds
            decoding += timing.decode_seconds
        rates.append((tokens / decoding, tokens / (prefill + decoding)))
    return sorted(rates)[len(rates) // 2]


def forward_cost_ratio(model: Any, block_size: int, context: int = 40, calls: int = 200) -> float:
    """time(k) / time(1) of one decoding forward of k tokens at batch 1 with `context` cached tokens
    (median per call); `model` has `.config` and `.params`."""
    import time

    from sbd_jax.kv_cache import init_cache

    cache = init_cache(model.config, 1, context + block_size)
    cache = cache.replace(lengths=jnp.full((1,), context, jnp.int32))
    medians = {}
    for k in (1, block_size):
        forward = jax.jit(lambda params, tokens, cache, k=k: Transformer(model.config).apply(
            {"params": params}, tokens, cache.lengths[:, None] + jnp.arange(k), mask=masks.bidirectional(k),
            cache=cache)[0])
        tokens = jnp.zeros((1, k), jnp.int32)
        jax.block_until_ready(forward(model.params, tokens, cache))
        times = []
        for _ in range(calls):
            began = time.perf_counter()
            jax.block_until_ready(forward(model.params, tokens, cache))
            times.append(time.perf_counter() - began)
        medians[k] = float(np.median(times))
    return medians[block_size] / medians[1]


def main() -> None:
    """Re-evaluates a saved model (e.g. the shipped one) on the study's test problems, no training."""
    import argparse
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from experiments.small_scale.arithmetic import splits
    from experiments.small_scale.config import FULL
    from sbd_jax.checkpoints.load import load_model

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="an HF directory with a mask token (sbd_mask_token_id)")
    parser.add_argument("--block-size", type=int, nargs="+", default=[16])
    parser.add_argument("--gamma", type=float, nargs="+", default=[0.0, 0.1, 0.35, 0.6, 1.0])
    parser.add_argument("--verify", action="store_true", help="also the verified (lossless) mode at each setting")
    parser.add_argument("--problems", type=int, default=FULL["test_problems"], help="how many test problems")
    args = parser.parse_args()
    loaded = load_model(args.model)
    model = Trained(args.model, loaded.config, jax.device_put(loaded.params), loaded.tokenizer)
    test = splits(FULL["train_problems"], FULL["valid_problems"], FULL["test_problems"], FULL["max_digits"]).test
    test = test[: args.problems]
    grid = [dict(mode="ntp", block_size=1, gamma=None, proxy=None)]
    grid += [dict(mode="sbd", block_size=k, gamma=g, proxy="entropy", verify=v)
             for k in args.block_size for g in args.gamma for v in ((False, True) if args.verify else (False,))]
    for setting in grid:
        m = arithmetic_metrics(model, setting, test, FULL["max_new_tokens"])
        label = setting["mode"] + (" verified" if setting.get("verify") else "")
        print(f"{label:>12} k={setting['block_size']:>2} γ={setting['gamma']}: whole-answer {m['accuracy']:.1%} "
              f"[{m['ci95'][0]:.1%}, {m['ci95'][1]:.1%}], final number {m['accuracy_final_number']:.1%}, "
              f"{m['tokens_per_pass']:.2f} tokens/pass (n={m['n']})", flush=True)


if __name__ == "__main__":
    main()
