"""sample.py in-process on the shipped small-scale model: prompts read, named and decoded in batches."""

import json
import os
import re

import pytest

import sample
from sbd_jax.api import SBDModel
from sbd_jax.errors import UserError
from tests.test_cli import assert_one_line_error, run

SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments", "small_scale", "models",
                       "sbd_arith")
PROMPTS = ["c5b7a2+b8a6", "d1c0b9a9+a1", "a1+b2"]


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def test_prompts_are_decoded_in_batches_each_written_when_it_finishes(tmp_path, capsys, monkeypatch):
    """Issue 57, item 6: a prompts file runs `--batch-size` prompts at a time, and each batch's output is out
    before the next batch starts; the texts are those of one big batch (greedy NTP)."""
    path = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    common = ["--model", SHIPPED, "--prompts-file", path, "--chat", "--max-new-tokens", "12", "--json"]
    sample.main(common)
    whole = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    batches, written, generate = [], [], SBDModel.generate

    def watched(self, prompts, *args, **kwargs):
        written.append(capsys.readouterr().out)
        batches.append((len(prompts), "".join(written).count("\n")))  # rows written before this batch
        return generate(self, prompts, *args, **kwargs)

    monkeypatch.setattr(SBDModel, "generate", watched)
    sample.main([*common, "--batch-size", "2"])
    rows = [json.loads(line) for line in ("".join(written) + capsys.readouterr().out).splitlines()]
    assert batches == [(2, 0), (1, 2)]
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in whole] and whole[0]["token_ids"]
    assert [r["batch"] for r in rows] == [2, 2, 1] and [r["batch"] for r in whole] == [3, 3, 3]
    with pytest.raises(UserError, match=r"--batch-size=0 must be >= 1"):
        sample.main([*common, "--batch-size", "0"])


def test_a_bad_prompt_is_named_by_its_flag_or_file_line(tmp_path):
    """Issue 57, notes and item 12: the empty, too-long and undecodable prompts are named where they came from."""
    path = write_prompts(tmp_path / "p.jsonl", [PROMPTS[0], "", "1" * 600])
    with pytest.raises(UserError, match=f"^{re.escape(path)}:2: the prompt is empty after tokenization"):
        sample.main(["--model", SHIPPED, "--prompts-file", path, "--max-new-tokens", "8"])
    path = write_prompts(tmp_path / "p.jsonl", [PROMPTS[0], PROMPTS[1], "1" * 600])
    with pytest.raises(UserError, match=f"^{re.escape(path)}:3: prompt \\(600 tokens\\) \\+ max_new_tokens"):
        sample.main(["--model", SHIPPED, "--prompts-file", path, "--max-new-tokens", "8"])
    with pytest.raises(UserError, match="^--prompt 2: the prompt is not valid UTF-8 text"):
        sample.main(["--model", SHIPPED, "--prompt", PROMPTS[0], "--prompt", "c\udcff5", "--max-new-tokens", "8"])
    # also where `--draft-nodes auto` reads the prompts first, to time the pass widths in their cache
    with pytest.raises(UserError, match="^--prompt 2: the prompt is empty after tokenization"):
        sample.main(["--model", SHIPPED, "--prompt", PROMPTS[0], "--prompt", "", "--mode", "sbd", "--verify",
                     "--drafts", "tree", "--block-size", "4", "--draft-nodes", "auto", "--max-new-tokens", "8"])


def test_max_cache_len_keeps_the_context_check(tmp_path):
    """Issue 57, item 10, as filed: 600 new tokens do not fit the 512-token context, whatever the cache."""
    with pytest.raises(UserError, match="--prompt 1: .* exceeds the model's context \\(512\\)"):
        sample.main(["--model", SHIPPED, "--prompt", PROMPTS[0], "--chat", "--max-new-tokens", "600",
                     "--max-cache-len", "1000"])


def test_a_prompts_file_with_a_latin1_byte_names_its_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}:2: not UTF-8 text; save the file as UTF-8"):
        sample.read_prompts_file(str(path))


def test_seed_and_mask_token_checks_on_the_command_line():
    """Issue 57, items 11 and 12 as filed (one line, exit 2); a non-UTF-8 byte in argv as the shell passes it."""
    assert_one_line_error(run("sample.py", "--prompt", "hi", "--seed", "9223372036854775808"),
                          "seed=9223372036854775808 must be a whole number in [0, 2**63 - 1]")
    with pytest.raises(UserError, match="mask_token_id=1 is an end-of-sequence id"):
        sample.main(["--model", SHIPPED, "--prompt", PROMPTS[0], "--mask-token-id", "1"])
    assert_one_line_error(run("sample.py", "--model", SHIPPED, "--prompt", b"c\xff5", "--max-new-tokens", "4"),
                          "--prompt 1: the prompt is not valid UTF-8 text (character 2 is the byte 0xff)")


class ByteTokenizer:
    """A byte-level tokenizer: one token a UTF-8 byte, so a character can be split over tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_show_passes_keeps_a_character_split_over_passes_whole():
    """Issue 57, item 15: 'é' and '€' split over passes show whole, in the colour of the pass that finished them."""
    ids = list("aé€".encode())  # a | é (2 bytes) | € (3 bytes)
    shown = sample.coloured(ByteTokenizer(), ids, passes=[1, 2, 2, 3, 3, 4], corrected=[False] * 6)
    assert "\ufffd" not in shown
    assert re.sub(r"\x1b\[\d+m", "", shown) == "aé€"
    assert shown.endswith("\x1b[35m€\x1b[0m")  # pass 4's colour: the pass whose token completed it
