"""A character-level tokenizer (about 100 ids) saved as an ordinary Hugging Face tokenizer directory.

Small models spend most of their time in the output layer when the vocabulary is 49k; one id per
character keeps a few-million-parameter model's step dominated by its layers, and the directory
loads through `sbd_jax.checkpoints.tokenizer.load_tokenizer` like any other model's tokenizer.
"""

from __future__ import annotations

import os

SPECIALS = ("<pad>", "<eos>", "<unk>")
CHARACTERS = "\n\t" + "".join(chr(c) for c in range(32, 127))
# A user turn is the problem, the assistant turn the worked answer; "=" separates them.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}={% else %}"
                 "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def save_char_tokenizer(path: str) -> str:
    """Writes the tokenizer to `path` (a directory) and returns `path`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + tuple(CHARACTERS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", chat_template=CHAT_TEMPLATE)
    os.makedirs(path, exist_ok=True)
    tokenizer.save_pretrained(path)
    return path

