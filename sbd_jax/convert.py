"""`python -m sbd_jax.convert SRC DST`: any model source (name, HF directory, GGUF) -> HF directory (an earlier
export's weight files in DST are replaced, never left beside the new ones)."""

from __future__ import annotations

import argparse
import sys

from sbd_jax.checkpoints.hf import check_export_dir, save_hf
from sbd_jax.checkpoints.load import load_model
from sbd_jax.checkpoints.tokenizer import load_tokenizer
from sbd_jax.cli import run_cli
from sbd_jax.errors import UserError
from sbd_jax.model.config import RUN_DTYPES, DType


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sbd_jax.convert", description=__doc__)
    parser.add_argument("src", help="model name (e.g. smollm2-135m), HF directory or .gguf file")
    parser.add_argument("dst", help="output Hugging Face directory (config.json, safetensors, tokenizer)")
    parser.add_argument("--dtype", choices=RUN_DTYPES, default=DType.FLOAT32, help="weights dtype to save")
    args = parser.parse_args(argv)
    check_export_dir(args.dst)  # before the load, which can take minutes
    model = load_model(args.src, with_tokenizer=False, param_dtype=args.dtype)
    try:
        tokenizer = load_tokenizer(model.source)
    except UserError as e:  # weights alone are still worth converting
        print(f"warning: {e}; {args.dst} will have no tokenizer", file=sys.stderr)
        tokenizer = None
    save_hf(args.dst, model.config, model.params, tokenizer=tokenizer)
    print(f"wrote {args.dst} ({model.config.model_type}, {model.config.num_layers} layers, {args.dtype})")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:])
