"""bfloat16 compute against float32, in training and in decoding, measured in one run.

    python -m benchmarks.bf16 [--steps 100] [--rows 32]

Part 1 (train): configs/tiny.py from the same random init over the same batches, once in float32 and
once with bf16 compute (`model.dtype="bfloat16"`: matmul inputs and activations in bf16, master weights
and AdamW state in float32): both loss curves and their gap.
Part 2 (agreement): greedy outputs in float32 and bf16 of SmolLM2-135M (chat prompts; its mask token is
untrained, `--mask-token-id 4`, so verification mostly corrects) and of the small-scale SBD model
(arithmetic test problems; trained drafts, so most tokens are accepted drafts). Per dtype: how many rows
of verified SBD (block 8) equal NTP's (batch 8), how many rows of NTP at batch 1 equal NTP at batch 8 (the
noise that only the batch shape causes), where rows first differ, and NTP's top-1/top-2 logit margin
there (teacher-forced, batch 1).
Writes benchmarks/results/bf16_<platform>.json, with the commit it was measured at.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from benchmarks import save_result
from sbd_jax.evaluation.scoring import first_difference
from sbd_jax.model.config import RUN_DTYPES, DType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_part(steps: int) -> dict:
    import json

    from configs.tiny import get_config
    from sbd_jax.training.trainer import Trainer

    curves = {}
    for dtype in RUN_DTYPES:
        cfg = get_config()
        cfg.model.dtype = dtype
        cfg.train.steps, cfg.checkpoint.every, cfg.data.workers, cfg.export_hf = steps, steps, 0, False
        with tempfile.TemporaryDirectory() as workdir:
            began = time.perf_counter()
            Trainer(cfg, workdir).run()
            with open(os.path.join(workdir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        curves[dtype] = {name: [r[name] for r in rows] for name in ("loss", "ntp_loss", "matp_loss")}
        curves[dtype]["seconds"] = time.perf_counter() - began
        print(f"{dtype}: loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f} in {curves[dtype]['seconds']:.0f} s",
              flush=True)
    tail = max(steps // 10, 1)

    def mean(xs):
        return sum(xs) / len(xs)

    f32, bf16 = curves[DType.FLOAT32], curves[DType.BFLOAT16]
    gap = {name: {"max_abs": max(abs(a - b) for a, b in zip(f32[name], bf16[name])),
                  "last_tenth_float32": mean(f32[name][-tail:]), "last_tenth_bfloat16": mean(bf16[name][-tail:])}
           for name in ("loss", "ntp_loss", "matp_loss")}
    return {"config": "configs/tiny.py", "steps": steps, "curves": curves, "gap": gap}


def margins(model, prompts, outputs, positions) -> list[float]:
    """NTP's top-1 minus top-2 logit (mask token excluded) where each row's output first differs,
    teacher-forced on the prompt and the output before it, one row at a time."""
    import jax.numpy as jnp

    from sbd_jax.model.transformer import Transformer

    out = []
    for prompt, output, at in zip(prompts, outputs, positions):
        tokens = jnp.asarray([list(prompt) + list(output[:at])], jnp.int32)
        logits, _ = Transformer(model.config).apply({"params": model.params}, tokens,
                                                    jnp.arange(tokens.shape[1])[None])
        last = logits[0, -1].at[model.config.mask_token_id].set(-jnp.inf)
        top2 = jnp.sort(last)[-2:]
        out.append(float(top2[1] - top2[0]))
    return out


def decode(model, prompts, max_new_tokens, batch, block_size=None) -> list[list[int]]:
    from benchmarks.verify import run
    from sbd_jax.decoding.settings import Settings

    setting = Settings.ntp() if block_size is None else Settings.verified(block_size)
    return [g.token_ids for g in run(model, prompts, setting, max_new_tokens, batch, longest=0)[0]]


def agreement(name: str, spec: str, mask_token_id: int | None, prompts_of, max_new_tokens: int) -> dict:
    import jax

    from sbd_jax.checkpoints.load import load_model

    result = {"model": name, "max_new_tokens": max_new_tokens}
    ntp_by_dtype = {}
    for dtype in RUN_DTYPES:
        loaded = load_model(spec, dtype=dtype)
        config = loaded.config if mask_token_id is None else loaded.config.replace(mask_token_id=mask_token_id)
        model = loaded._replace(params=jax.device_put(loaded.params), config=config)
        prompts = prompts_of(loaded.tokenizer)
        began = time.perf_counter()
        ntp = decode(model, prompts, max_new_tokens, 8)
        ntp_b1 = decode(model, prompts, max_new_tokens, 1)
        verified = decode(model, prompts, max_new_tokens, 8, block_size=8)
        ntp_by_dtype[dtype] = ntp
        row = {"rows": len(prompts)}
        for label, other in (("verified_vs_ntp", verified), ("ntp_batch1_vs_batch8", ntp_b1)):
            where = [first_difference(a, b) for a, b in zip(other, ntp)]
            differing = [i for i, w in enumerate(where) if w is not None]
            row[label] = {"identical": len(prompts) - len(differing),
                          "first_difference": sorted(where[i] for i in differing),
                          "margin_at_difference": margins(model, [prompts[i] for i in differing],
                                                          [ntp[i] for i in differing], [where[i] for i in differing])}
        row["seconds"] = time.perf_counter() - began
        result[dtype] = row
        print(f"{name} {dtype}: verified = NTP on {row['verified_vs_ntp']['identical']}/{len(prompts)} rows, "
              f"NTP batch 1 = batch 8 on {row['ntp_batch1_vs_batch8']['identical']}/{len(prompts)} "
              f"({row['seconds']:.0f} s)", flush=True)
    result["bfloat16_ntp_vs_float32_ntp_identical"] = sum(
        a == b for a, b in zip(ntp_by_dtype[DType.BFLOAT16], ntp_by_dtype[DType.FLOAT32]))
    return result


def smollm2_prompts(rows: int):
    from recipes.smollm2_sbd.prompts import make_prompts
    from sbd_jax.checkpoints.tokenizer import encode_prompt

    questions = make_prompts(rows, seed=1, split="heldout")
    return lambda tokenizer: [encode_prompt(tokenizer, q, chat=True) for q in questions]


def arithmetic_prompts(rows: int):
    from experiments.small_scale.task import STUDY
    from sbd_jax.evaluation.arithmetic import problems
    from sbd_jax.evaluation.measure import chat_prompt

    test = problems(rows, STUDY["max_digits"], 1)  # the study's test seed
    return lambda tokenizer: [chat_prompt(tokenizer, p.question) for p in test]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps of each dtype (part 1)")
    parser.add_argument("--rows", type=int, default=32, help="prompts per model (part 2)")
    parser.add_argument("--new-tokens", type=int, default=48, help="SmolLM2's new tokens per prompt")
    parser.add_argument("--parts", nargs="+", choices=("train", "agreement"), default=["train", "agreement"])
    args = parser.parse_args()

    import jax

    result = {"command": "python -m benchmarks.bf16 " + " ".join(sys.argv[1:]), "device": str(jax.devices()[0])}
    name = f"bf16_{jax.devices()[0].platform}"
    if "train" in args.parts:
        result["train"] = train_part(args.steps)
        save_result(name, result)
    if "agreement" in args.parts:
        from experiments.small_scale.task import STUDY

        result["agreement"] = [
            agreement("smollm2-135m (untrained mask token 4)", "smollm2-135m", 4, smollm2_prompts(args.rows),
                      args.new_tokens),
            agreement("small-scale SBD model", os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith"),
                      None, arithmetic_prompts(args.rows), STUDY["max_new_tokens"]),
        ]
    print(f"wrote {save_result(name, result)}")


if __name__ == "__main__":
    main()
