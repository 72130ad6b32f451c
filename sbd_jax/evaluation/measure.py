"""Measuring a trained model: held-out NTP loss, greedy decoding with a setting, arithmetic exact match,
tokens per second and the cost of a k-token forward. Shared by the small-scale study, the recipes and
the benchmarks."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax import masks
from sbd_jax.config import ModelConfig
from sbd_jax.data import Packed, load_packed
from sbd_jax.decoders import NTPDecoder
from sbd_jax.errors import UserError
from sbd_jax.evaluation.arithmetic import Problem, final_result
from sbd_jax.evaluation.scoring import wilson
from sbd_jax.model import Transformer
from sbd_jax.objective import Batch, ntp_loss
from sbd_jax.sampler import (
    BatchTiming,
    Executables,
    Generation,
    generate,
    tokens_per_pass,
)
from sbd_jax.sbd_decoder import SBDDecoder
from sbd_jax.verified_decoder import VerifiedSBDDecoder


@dataclasses.dataclass(frozen=True)
class Trained:
    """A model under evaluation, with the compiled decoders it has used."""

    name: str
    config: ModelConfig
    params: Any
    tokenizer: Any
    executables: Executables = dataclasses.field(default_factory=Executables)  # its compiled decoders


def fingerprint(params: Any) -> str:
    """A short hash of a model's weights (every leaf's dtype, shape and bytes, in tree order): results
    cached for one set of weights are reused only for exactly the same weights."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        leaf = np.asarray(leaf)
        digest.update(f"{leaf.dtype}{leaf.shape}".encode())
        digest.update(leaf.tobytes())
    return digest.hexdigest()[:16]


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


def forward_seconds(model: Any, batch: int, n: int, context: int, calls: int, inner: int = 8,
                    capacity: int | None = None) -> float:
    """Median time of one bare decoding forward of `n` new tokens per row at `batch` rows with `context`
    cached tokens in a cache of `capacity` slots (default `context + n`; attention reads every slot, so
    compare a decoding loop with the bare forward at the loop's own capacity). The model alone: no
    sampling, no cache update; `model` has `.config` and `.params`.

    Timed as `inner` forwards in one compiled loop, as a decoding loop runs them: a call per forward
    would add the host's dispatch time, which is most of a small model's forward on a CPU."""
    from sbd_jax.kv_cache import init_cache

    capacity = context + n if capacity is None else capacity
    if capacity < context + n:
        raise UserError(f"capacity={capacity} cannot hold {context} cached + {n} new tokens")
    cache = init_cache(model.config, batch, capacity)
    cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32))
    positions = cache.lengths[:, None] + jnp.arange(n)

    def forwards(params: Any, cache: Any) -> jax.Array:
        def one(_: int, total: jax.Array) -> jax.Array:
            tokens = jnp.zeros((batch, n), jnp.int32) + (total > jnp.inf)  # depends on the loop: not hoisted
            logits = Transformer(model.config).apply({"params": params}, tokens, positions,
                                                     mask=masks.bidirectional(n), cache=cache)[0]
            return total + logits.sum()  # every logit is used, as decoding reads them all

        return jax.lax.fori_loop(0, inner, one, jnp.float32(0))

    return median_seconds(jax.jit(forwards), model.params, cache, repeats=calls) / inner


def forward_cost_ratio(model: Any, block_size: int, context: int = 40, calls: int = 200, batch: int = 1) -> float:
    """time(k) / time(1) of one decoding forward of k tokens with `context` cached tokens (medians)."""
    return (forward_seconds(model, batch, block_size, context, calls)
            / forward_seconds(model, batch, 1, context, calls))


def median_seconds(fn: Callable[..., Any], *args: Any, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)
