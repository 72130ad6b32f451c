"""Evaluation of one trained model: held-out NTP loss, arithmetic exact match and code continuation,
for NTP decoding and for SBD decoding over a (block size, γ) grid. Every decode is greedy."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from experiments.small_scale.arithmetic import Problem, final_result
from sbd_jax import masks
from sbd_jax.config import ModelConfig
from sbd_jax.data import load_packed
from sbd_jax.model import Transformer
from sbd_jax.objective import Batch, ntp_loss
from sbd_jax.sampler import Decoder, NTPDecoder, SBDDecoder, generate, tokens_per_pass


class Trained(NamedTuple):
    name: str
    config: ModelConfig
    params: Any
    tokenizer: Any


@functools.lru_cache(maxsize=None)
def _forward(config: ModelConfig) -> Any:
    """One jitted forward per architecture, so repeated scoring calls reuse its compilations."""
    return jax.jit(Transformer(config).apply)


def heldout_ntp_loss(model: Trained, files: Sequence[str], seq_len: int, batch_size: int = 64) -> float:
    """Mean next-token loss over every loss-carrying token of the files (answers only for chats)."""
    packed = load_packed(files, model.tokenizer, seq_len)
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


def decoders(model: Trained, max_new_tokens: int, block_sizes: Sequence[int],
             gammas: Sequence[float]) -> list[tuple[dict, Decoder]]:
    """(setting, decoder) pairs: NTP decoding, and SBD over the grid if the model has a mask token."""
    common = dict(max_new_tokens=max_new_tokens, eos_ids=model.config.eos_token_ids)
    out: list[tuple[dict, Decoder]] = [(dict(mode="ntp", gamma=None, block_size=1), NTPDecoder(model.config, **common))]
    if model.config.mask_token_id is not None:
        out += [(dict(mode="sbd", gamma=g, block_size=k), SBDDecoder(model.config, block_size=k, gamma=g, **common))
                for k in block_sizes for g in gammas]
    return out


def _chat_prompt(tokenizer: Any, question: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def arithmetic_metrics(model: Trained, decoder: Decoder, test: Sequence[Problem]) -> dict:
    """Exact match of the final result, overall and by answer length (steps), and tokens per pass."""
    prompts = [_chat_prompt(model.tokenizer, p.question) for p in test]
    results, _ = generate(decoder, model.params, prompts)
    texts = [model.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    correct = np.array([final_result(t) == p.result for t, p in zip(texts, test)])
    steps = np.array([p.steps for p in test])
    return {"accuracy": float(correct.mean()), "tokens_per_pass": tokens_per_pass(results),
            "accuracy_by_steps": {int(s): float(correct[steps == s].mean()) for s in np.unique(steps)},
            "examples": [{"question": p.question, "output": t} for p, t in list(zip(test, texts))[:3]]}


def code_prompts(texts: Sequence[str], tokenizer: Any, count: int, prompt_chars: int, seed: int) -> list[list[int]]:
    """`count` prompts: `prompt_chars` characters of held-out code starting at random line starts."""
    rng = np.random.default_rng(seed)
    prompts = []
    while len(prompts) < count:
        text = texts[int(rng.integers(len(texts)))]
        starts = [i + 1 for i, ch in enumerate(text[:-prompt_chars]) if ch == "\n"]
        if starts:
            start = starts[int(rng.integers(len(starts)))]
            prompts.append(tokenizer(text[start: start + prompt_chars])["input_ids"])
    return prompts


def code_continuations(model: Trained, decoder: Decoder, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    results, _ = generate(decoder, model.params, prompts)
    return [r.token_ids for r in results], tokens_per_pass(results)


def agreement(outputs: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Fraction of reference tokens that the output reproduces at the same position."""
    same = sum(sum(a == b for a, b in zip(o, r)) for o, r in zip(outputs, references))
    return same / max(sum(len(r) for r in references), 1)


def mean_logprob(scorer: Trained, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]) -> float:
    """Mean log-probability per continuation token under `scorer` (the NTP-only model), prompt given."""
    vocab = scorer.config.vocab_size
    unk = scorer.tokenizer.unk_token_id
    rows = [list(p) + [t if t < vocab else unk for t in c] for p, c in zip(prompts, continuations)]
    length = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    target = np.zeros((len(rows), length), bool)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        tokens[i, : len(row)] = row
        target[i, len(prompt): len(row)] = True
    logits, _ = _forward(scorer.config)(
        {"params": scorer.params}, jnp.asarray(tokens), jnp.arange(length)[None], mask=masks.causal(length))
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], axis=-1)[..., 0])
    return float(picked[target[:, 1:]].mean())
