"""Cost of SBD passes on a real model: a k-token block pass vs a 1-token NTP step, and the EB rule's share.

    python -m benchmarks.sbd_decode [--model smollm2-135m] [--context 256] [--ks 2 4 8 16] [--batches 1 8]

For each batch and k, times (median of --repeats, each call synchronised) the jitted forwards of the
decoders on a cache holding `--context` tokens: the NTP step (1 token), the SBD refine pass (k tokens,
bidirectional), the SBD first pass (2k tokens: k committed causally + a block), and the EB rule alone
(uncertainty + eb_reveal + token choice on the pass's logits). Weights need no SBD training: timing
does not depend on them. Writes benchmarks/results/sbd_decode_<platform>.json.
"""

from __future__ import annotations

import argparse
import os

from sbd_jax.decoding.timing import median_seconds
from sbd_jax.evaluation.results import write_json
from sbd_jax.model.config import RUN_DTYPES, DType


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--dtype", default=DType.FLOAT32, choices=RUN_DTYPES)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from sbd_jax.checkpoints.load import load_model
    from sbd_jax.decoding.sbd import SBDDecoder
    from sbd_jax.decoding.token_choice import Proxy, choose_tokens, eb_reveal, uncertainty
    from sbd_jax.model.kv_cache import append, init_cache
    from sbd_jax.model.transformer import Transformer

    model = load_model(args.model, with_tokenizer=False, dtype=args.dtype)
    config = model.config.replace(mask_token_id=model.config.mask_token_id or 0)
    params = jax.device_put(model.params)
    net = Transformer(config)

    # Only logits are returned: inside the decode loops the cache append is an in-place k-slot
    # scatter, whereas returning a cache from a standalone jit call would copy all of it.
    @jax.jit
    def ntp_step(params, cache, token):
        logits, _ = net.apply({"params": params}, token[:, None], cache.lengths[:, None], cache=cache)
        return jnp.argmax(logits[:, -1], -1)

    def eb_rule(logits, rng):
        todo = jnp.ones(logits.shape[:2], bool)
        now = eb_reveal(uncertainty(logits, Proxy.ENTROPY), todo, 0.35)
        return jnp.where(now, choose_tokens(logits, rng, 0.0, 1.0), 0)

    rows = []
    for batch in args.batches:
        rng = jax.random.key(0)
        cache = init_cache(config, batch, args.context + 64)
        kv_shape = (config.num_layers, batch, args.context, config.num_kv_heads, config.head_dim)
        fill = jax.random.normal(rng, kv_shape, config.compute_dtype)
        cache = append(cache, fill, fill, args.context)
        token = jnp.zeros((batch,), jnp.int32)
        t_ntp = median_seconds(ntp_step, params, cache, token, repeats=args.repeats)
        for k in args.ks:
            decoder = SBDDecoder(config, max_new_tokens=k, block_size=k)
            block = jnp.zeros((batch, k), jnp.int32)
            refine = jax.jit(decoder.refine_pass)
            first = jax.jit(lambda *a, d=decoder: d.first_pass(*a)[0])
            t_refine = median_seconds(refine, params, cache, block, repeats=args.repeats)
            t_first = median_seconds(first, params, cache, block, jnp.full((batch,), k, jnp.int32), block,
                                     repeats=args.repeats)
            logits = jax.random.normal(rng, (batch, k, config.vocab_size), jnp.float32)
            t_eb = median_seconds(jax.jit(eb_rule), logits, rng, repeats=args.repeats)
            row = {"batch": batch, "k": k, "context": args.context, "ntp_step_ms": 1e3 * t_ntp,
                   "refine_pass_ms": 1e3 * t_refine, "first_pass_ms": 1e3 * t_first, "eb_rule_ms": 1e3 * t_eb,
                   "refine_over_ntp": t_refine / t_ntp, "first_over_ntp": t_first / t_ntp,
                   "eb_share_of_pass": t_eb / (t_refine + t_eb)}
            rows.append(row)
            print(f"batch {batch:2d} k {k:2d}: NTP step {row['ntp_step_ms']:7.2f} ms | k-pass "
                  f"{row['refine_pass_ms']:7.2f} ms ({row['refine_over_ntp']:.2f}x) | 2k-pass "
                  f"{row['first_pass_ms']:7.2f} ms ({row['first_over_ntp']:.2f}x) | EB rule "
                  f"{row['eb_rule_ms']:.3f} ms = {100 * row['eb_share_of_pass']:.1f}% of a pass", flush=True)
    device = jax.devices()[0]
    report = {"model": args.model, "dtype": args.dtype, "platform": device.platform,
              "device": device.device_kind, "cpu_count": os.cpu_count(), "jax": jax.__version__, "rows": rows}
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"sbd_decode_{device.platform}.json")
    write_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
