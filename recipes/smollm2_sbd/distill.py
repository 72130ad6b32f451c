"""Self-distillation: the base model answers the recipe's prompts with NTP greedy decoding.

Training on the model's own answers keeps the comparison honest: whatever changes after the
fine-tune comes from the SBD objective, not from new knowledge in the data. Answers cut off by
`max_new_tokens` are dropped (training on them would teach the model to stop mid-sentence).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from sbd_jax.decoders import Decoder
from sbd_jax.sampler import Generation, generate
from sbd_jax.tokenizer import encode_prompt

HELDOUT_EVERY = 10  # every 10th prompt is held out from training, for the agreement evaluation


def chat_answers(decoder: Decoder, params: Any, tokenizer: Any, prompts: Sequence[str],
                 batch_size: int, gamma: float = 0.0) -> tuple[list[str], list[Generation]]:
    """Decodes chat prompts in batches that share one compiled shape (every batch padded to the longest
    prompt and to `batch_size` rows); answers come back in the prompts' order. `gamma`: SBD's."""
    encoded = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    longest = max(len(e) for e in encoded)
    generations: list[Generation] = []
    for start in range(0, len(encoded), batch_size):
        batch = encoded[start: start + batch_size]
        filled = batch + [batch[-1]] * (min(batch_size, len(encoded)) - len(batch))
        results, _ = generate(decoder, params, filled, pad_to=longest, gamma=gamma)
        generations += results[: len(batch)]
    texts = [tokenizer.decode(g.token_ids, skip_special_tokens=True) for g in generations]
    return texts, generations


def finished(generation: Generation, eos_ids: Sequence[int]) -> bool:
    return bool(generation.token_ids) and generation.token_ids[-1] in eos_ids


def write_distilled(out: str, prompts: Sequence[str], answers: Sequence[str], generations: Sequence[Generation],
                    eos_ids: Sequence[int], keep_unfinished: bool = False) -> dict[str, int]:
    """Writes `train.jsonl` (chat records of finished answers, or of all with `keep_unfinished`) and
    `heldout.jsonl` (prompt + base answer)."""
    os.makedirs(out, exist_ok=True)
    counts = {"train": 0, "heldout": 0, "dropped_unfinished": 0}
    with open(os.path.join(out, "train.jsonl"), "w") as train, open(os.path.join(out, "heldout.jsonl"), "w") as held:
        for i, (prompt, answer, generation) in enumerate(zip(prompts, answers, generations)):
            if i % HELDOUT_EVERY == 0:
                held.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
                counts["heldout"] += 1
            elif keep_unfinished or finished(generation, eos_ids):
                train.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                     {"role": "assistant", "content": answer}]}) + "\n")
                counts["train"] += 1
            else:
                counts["dropped_unfinished"] += 1
    return counts
