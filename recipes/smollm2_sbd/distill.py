"""Self-distillation: the base model answers the recipe's prompts with NTP greedy decoding.

Training on the model's own answers keeps the comparison honest: whatever changes after the
fine-tune comes from the SBD objective, not from new knowledge in the data (Medusa-2 and EAGLE
regenerate their training data the same way). Answers cut off by `max_new_tokens` are dropped
(training on them would teach the model to stop mid-sentence); how many, and how repetitive the
answers are, is reported (`repetition`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from sbd_jax.checkpoints.tokenizer import encode_prompt
from sbd_jax.decoding.base import Decoder
from sbd_jax.decoding.generate import Executables, generate
from sbd_jax.errors import UserError

LOOP_WINDOW = 16
ANSWERS = "answers.partial.jsonl"  # in the output folder while distilling: the answers so far (a rerun resumes)


def chat_answers(decoder: Decoder, params: Any, tokenizer: Any, prompts: Sequence[str], batch_size: int,
                 gamma: float = 0.0, cache: str | None = None, settings: dict | None = None,
                 ) -> tuple[list[str], list[list[int]], int]:
    """Decodes chat prompts in batches that share one compiled shape (every batch padded to the longest
    prompt and to `batch_size` rows); answers (texts and generated ids, up to and including the first EOS)
    come back in the prompts' order, with how many of them `cache` already held. `gamma`: SBD's.

    `cache`: a JSONL file, `settings` (what decides the answers: model, length, dtype) on its first line, each
    batch's answers appended as it finishes; a rerun with the same prompts and settings starts after the last
    whole answer it holds (a killed distillation loses at most one batch)."""
    encoded = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    longest = max(len(e) for e in encoded)
    answered = cached_answers(cache, prompts, settings) if cache else []
    texts, ids = [a["text"] for a in answered], [a["token_ids"] for a in answered]
    if answered:
        print(f"distillation: {len(answered)} answers from {cache}", flush=True)
    elif cache:
        with open(cache, "w") as f:
            f.write(json.dumps({"settings": settings}) + "\n")
    executables = Executables()
    for start in range(len(answered), len(encoded), batch_size):
        batch = encoded[start: start + batch_size]
        filled = batch + [batch[-1]] * (min(batch_size, len(encoded)) - len(batch))
        results, _ = generate(decoder, params, filled, pad_to=longest, gamma=gamma, executables=executables)
        new = [{"prompt": prompt, "token_ids": g.token_ids,
                "text": tokenizer.decode(g.token_ids, skip_special_tokens=True)}
               for prompt, g in zip(prompts[start: start + len(batch)], results)]
        if cache:
            with open(cache, "a") as f:
                f.writelines(json.dumps(a) + "\n" for a in new)
        texts += [a["text"] for a in new]
        ids += [a["token_ids"] for a in new]
        print(f"distilled {len(ids)} of {len(encoded)} answers", flush=True)
    return texts, ids, len(answered)


def cached_answers(path: str, prompts: Sequence[str], settings: dict | None) -> list[dict]:
    """The answers `chat_answers` appended to `path`, in order; a last line cut short by a kill is cut off the
    file (that answer is decoded again). A file made with other settings or answering other prompts is refused:
    it belongs to another run."""
    if not os.path.exists(path):
        return []
    with open(path, "rb+") as f:
        whole = f.read()
        f.truncate(whole.rfind(b"\n") + 1)  # appends then follow the last whole line
    lines = [json.loads(line) for line in whole[: whole.rfind(b"\n") + 1].decode().splitlines()]
    if not lines:
        return []
    remove = "remove it (or use another output folder) to distil again"
    if lines[0].get("settings") != json.loads(json.dumps(settings)):
        raise UserError(f"{path} holds answers made with {lines[0].get('settings')}, not this distillation's "
                        f"{settings}: {remove}")
    answers = lines[1:]
    for i, answer in enumerate(answers):
        if i >= len(prompts) or answer["prompt"] != prompts[i]:
            raise UserError(f"{path}: answer {i + 1} is to another prompt than this distillation's: {remove}")
    return answers


def finished(token_ids: Sequence[int], eos_ids: Sequence[int]) -> bool:
    return bool(token_ids) and token_ids[-1] in eos_ids


def repeats_a_window(ids: Sequence[int], window: int = LOOP_WINDOW) -> bool:
    """Whether some `window` consecutive tokens occur twice (a verbatim loop, or a long quoted repeat)."""
    seen = set()
    for start in range(len(ids) - window + 1):
        piece = tuple(ids[start: start + window])
        if piece in seen:
            return True
        seen.add(piece)
    return False


def repetition(ids: Sequence[Sequence[int]], eos_ids: Sequence[int]) -> dict[str, float]:
    """How repetitive answers are (repetition makes blocks easy to predict and inflates tokens per pass):
    the share cut off by the length limit, the share repeating a 16-token window, and the mean share of
    distinct 4-grams within an answer."""
    distinct = [len({tuple(t[i: i + 4]) for i in range(len(t) - 3)}) / (len(t) - 3) for t in ids if len(t) > 3]
    return {"answers": len(ids), "mean_tokens": sum(map(len, ids)) / max(len(ids), 1),
            "cut_off": sum(not finished(t, eos_ids) for t in ids) / max(len(ids), 1),
            "repeat_16_token_window": sum(map(repeats_a_window, ids)) / max(len(ids), 1),
            "distinct_4gram_share": sum(distinct) / max(len(distinct), 1)}


def write_distilled(out: str, prompts: Sequence[str], answers: Sequence[str], ids: Sequence[Sequence[int]],
                    eos_ids: Sequence[int], keep_unfinished: bool = False) -> dict[str, int]:
    """Writes `train.jsonl`: chat records of the finished answers (of all with `keep_unfinished`)."""
    os.makedirs(out, exist_ok=True)
    counts = {"train": 0, "dropped_unfinished": 0}
    with open(os.path.join(out, "train.jsonl"), "w") as train:
        for prompt, answer, token_ids in zip(prompts, answers, ids):
            if keep_unfinished or finished(token_ids, eos_ids):
                train.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                     {"role": "assistant", "content": answer}]}) + "\n")
                counts["train"] += 1
            else:
                counts["dropped_unfinished"] += 1
    return counts


def write_prompts(path: str, prompts: Sequence[str]) -> None:
    """One `{"prompt": ...}` per line: the held-out prompts of one split (validation or test)."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": p}) + "\n" for p in prompts)
