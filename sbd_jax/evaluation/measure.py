"""Measuring a trained model: held-out NTP loss, greedy decoding with a setting, arithmetic exact match
and tokens per second. Shared by the small-scale study, the recipes and the benchmarks."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sbd_jax.checkpoints.tokenizer import encode_prompt
from sbd_jax.data.packing import Batch, load_packed
from sbd_jax.decoding.generate import BatchTiming, Executables, Generation, generate_batched, tokens_per_pass
from sbd_jax.decoding.settings import Settings
from sbd_jax.evaluation.arithmetic import Problem, final_result
from sbd_jax.evaluation.scoring import wilson
from sbd_jax.model.config import ModelConfig
from sbd_jax.model.transformer import Transformer
from sbd_jax.training.objective import ntp_loss


@dataclasses.dataclass(frozen=True)
class EvaluatedModel:
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


def heldout_ntp_loss(model: EvaluatedModel, files: Sequence[str], seq_len: int, batch_size: int = 64,
                     max_rows: int | None = None) -> float:
    """Mean next-token loss over every loss-carrying token of the files (answers only for chats), or of
    `max_rows` packed rows spread evenly over them."""
    packed = load_packed(files, model.tokenizer, seq_len)
    if max_rows is not None and max_rows < len(packed.tokens):
        packed = Batch(*(x[np.linspace(0, len(x) - 1, max_rows).astype(int)] for x in packed))
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


def decode(model: EvaluatedModel, settings: Settings, prompts: Sequence[Sequence[int]], max_new_tokens: int,
           batch: int = 0) -> tuple[list[Generation], BatchTiming]:
    """Decoding of token-id prompts `batch` at a time (0: all in one batch) with `settings`, each prompt to at most
    `max_new_tokens` (the run's length, whatever `settings` say)."""
    settings = dataclasses.replace(settings, max_new_tokens=max_new_tokens)
    return generate_batched(settings.decoder(model.config), model.params, prompts, batch or len(prompts),
                            executables=model.executables, gamma=settings.entropy_budget)


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    """A question as one user turn through the chat template (`sample.py --chat`'s encoding)."""
    return encode_prompt(tokenizer, question, chat=True)


Prompt = Callable[[Any, str], list[int]]  # (tokenizer, question) -> token ids the answer follows


def arithmetic_metrics(model: EvaluatedModel, settings: Settings, test: Sequence[Problem], max_new_tokens: int,
                       prompt: Prompt = chat_prompt, batch_size: int = 0) -> dict:
    """Whole-answer exact match (the worked steps and the result, as the model should write them),
    final-number match, both by answer length (steps), and tokens per pass (with verified SBD, the
    fraction of drafted tokens accepted). Decoded in batches of `batch_size` (0: all at once)."""
    prompts = [prompt(model.tokenizer, p.question) for p in test]
    results = decode(model, settings, prompts, max_new_tokens, batch_size)[0]
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


def tokens_per_second(model: EvaluatedModel, settings: Settings, test: Sequence[Problem], max_new_tokens: int, batch: int,
                      repeats: int, prompt: Prompt = chat_prompt) -> tuple[float, float]:
    """Generated tokens per second of decoding the problems in batches of `batch`, compile excluded (every
    batch is padded to one compiled shape): (decoding alone, what SBD changes; with the prompts' prefill,
    which both modes share), the run with the median decoding rate of `repeats`."""
    prompts = [prompt(model.tokenizer, p.question) for p in test]
    rates = []
    for _ in range(repeats):
        results, timing = decode(model, settings, prompts, max_new_tokens, batch)
        tokens = sum(len(r.token_ids) for r in results)
        rates.append((tokens / timing.decode_seconds, tokens / timing.seconds))
    return sorted(rates)[len(rates) // 2]
