"""What every evaluation of the recipe (`eval.py`, `headline.py`, `plain.py`) decodes: the models, the prompts
and the decoding settings of its rows (`sbd_jax.decoding.settings.Settings`: `Settings.ntp`, `.plain_sbd`, `.verified`; recorded in result files by
`sbd_jax.evaluation.recorded`)."""

from __future__ import annotations

import argparse
import os
from typing import Any, NamedTuple, Sequence

from sbd_jax.model.config import RUN_DTYPES, backend_dtype


class Prompt(NamedTuple):
    question: str  # the shape experiments.small_scale.evaluate's helpers read


def chat(tokenizer: Any, question: str) -> list[int]:
    """A question as the fine-tune saw its prompts (the chat template, generation prompt added)."""
    from sbd_jax.checkpoints.tokenizer import encode_prompt

    return encode_prompt(tokenizer, question, chat=True)


def humaneval_prompts(tasks: list[dict]) -> list[Prompt]:
    """HumanEval problems as the evaluation asks them (its entries are keyed by these prompts' count)."""
    from recipes.smollm2_sbd.humaneval import INSTRUCTION

    return [Prompt(INSTRUCTION.format(prompt=p["prompt"])) for p in tasks]


def load(name: str, spec: str, scan_layers: bool, dtype: str, base: str | None = None):
    """A model to evaluate: an HF directory / GGUF / known name, or a gated adapter's directory (train.py's
    workdir/adapter) on `base`."""
    import jax

    from sbd_jax.checkpoints.adapter import CONFIG, attach_adapter
    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.evaluation.measure import EvaluatedModel

    adapter = os.path.isfile(os.path.join(spec, CONFIG))
    loaded = load_model(base if adapter else spec, dtype=dtype, scan_layers=scan_layers)
    config, params, tokenizer = loaded.config, loaded.params, loaded.tokenizer
    if adapter:
        config, params, tokenizer = attach_adapter(spec, config, params, tokenizer)
    return EvaluatedModel(name, config, jax.device_put(params), tokenizer)


def add_model_arguments(parser: argparse.ArgumentParser, partial: bool = False) -> None:
    """The options every evaluation of the recipe shares (this one, `headline.py`, `plain.py`): which models,
    prompts and entry cache, how long and how batched the decoding; `partial` (one split or block): also
    `--prompts`, each split's first N."""
    parser.add_argument("--base", default="smollm2-135m")
    parser.add_argument("--tuned", required=True, help="the fine-tune's HF directory (train workdir/hf), or a gated "
                        "adapter's directory (workdir/adapter, on --base)")
    parser.add_argument("--data", required=True, help="the recipe's data folder (valid.jsonl, test.jsonl)")
    parser.add_argument("--cache", required=True, help="the evaluation's entries.json, shared by every evaluation "
                        "(a rerun resumes)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default=None, choices=RUN_DTYPES,
                        help="default: bfloat16 on GPU/TPU, float32 on CPU")
    if partial:
        parser.add_argument("--prompts", type=int, default=None, help="each split's first N prompts or problems "
                            "(default: all)")


def models_and_prompts(args: argparse.Namespace, splits: Sequence[str], limit: int | None = None
                       ) -> tuple[dict, dict, bool, str]:
    """The base and the fine-tune, each split's prompts (its first `limit`; HumanEval's as `humaneval_prompts`
    makes them, so that entries are shared), whether the fine-tune is a gated adapter, and the dtype."""
    import jax

    from recipes.smollm2_sbd.humaneval import problems
    from sbd_jax.checkpoints.adapter import CONFIG
    from sbd_jax.data.jsonl import iter_jsonl

    dtype = args.dtype or backend_dtype(jax.default_backend())
    prompts = {}
    for split in splits:
        if split == "humaneval":
            prompts[split] = humaneval_prompts(problems(limit))
        else:
            rows = iter_jsonl(os.path.join(args.data, f"{split}.jsonl"))
            prompts[split] = [Prompt(r["prompt"]) for _, r in rows][:limit]
    # Scanned layers compile each decoder in a fraction of the time (accuracy runs); unrolled for speed.
    models = {"base": load("base", args.base, True, dtype), "tuned": load("tuned", args.tuned, True, dtype, base=args.base)}
    return models, prompts, os.path.isfile(os.path.join(args.tuned, CONFIG)), dtype
