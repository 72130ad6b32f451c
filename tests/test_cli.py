"""The command lines as a user runs them: JSON output, and bad input as one line with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import requires_smollm2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "XLA_FLAGS": ""})


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[-1]


def test_sample_unknown_model():
    assert_one_line_error(run("sample.py", "--model", "gpt-7", "--prompt", "hi"), "unknown model 'gpt-7'",
                          "smollm2-135m")


def test_sample_unsupported_model_type(tiny_hf_dir):
    path, _ = tiny_hf_dir("llama")
    config = json.load(open(os.path.join(path, "config.json")))
    config["model_type"] = "falcon"
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    assert_one_line_error(run("sample.py", "--model", path, "--prompt", "hi"),
                          "unsupported model_type 'falcon'", "llama, qwen2, qwen3")


def test_sample_missing_weights(tiny_hf_dir):
    path, _ = tiny_hf_dir("qwen2")
    os.remove(os.path.join(path, "model.safetensors"))
    assert_one_line_error(run("sample.py", "--model", path, "--prompt", "hi"), "weights are missing")


def test_convert_tiny_directory_and_errors(tiny_hf_dir, tmp_path):
    path, _ = tiny_hf_dir("qwen3")
    proc = run("-m", "sbd_jax.convert", path, str(tmp_path / "out"), "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    assert "no tokenizer" in proc.stderr and (tmp_path / "out" / "model.safetensors").exists()
    assert json.load(open(tmp_path / "out" / "config.json"))["model_type"] == "qwen3"
    assert_one_line_error(run("-m", "sbd_jax.convert", "/nope/m.gguf", str(tmp_path / "x")), "does not exist")


@requires_smollm2
@pytest.mark.slow  # SmolLM2 loaded twice in subprocesses
def test_sample_json_on_smollm2_and_too_long_prompt():
    proc = run("sample.py", "--model", "smollm2-135m", "--prompt", "What is 2+2?", "--prompt",
               "Name a color.", "--chat", "--mode", "ntp", "--max-new-tokens", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert {"text", "token_ids", "new_tokens", "nfe", "seconds"} <= set(row)
        assert 0 < row["new_tokens"] == len(row["token_ids"]) == row["nfe"] <= 16
        assert row["text"].strip() and row["seconds"] > 0
    assert_one_line_error(run("sample.py", "--prompt", "hi", "--max-new-tokens", "9000"),
                          "exceeds the model's context (8192)", "lower --max-new-tokens")


@pytest.mark.parametrize("flags, message", [
    (["--gamma", "-1"], "gamma=-1.0 must be a number >= 0"),
    (["--gamma", "nan"], "gamma=nan must be a number >= 0"),
    (["--block-size", "0"], "block_size=0 must be >= 1"),
    (["--proxy", "vibes"], "proxy='vibes': use one of entropy"),
    (["--temperature", "-0.5"], "temperature=-0.5 must be >= 0"),
    (["--verify", "--gamma", "0.5"], "gamma (--gamma) has no effect with verify (--verify)"),
    (["--block-size", "auto"], "--block-size auto picks the fastest block for verified SBD"),
])
def test_sample_bad_sbd_options(flags, message):
    assert_one_line_error(run("sample.py", "--prompt", "hi", "--mode", "sbd", *flags), message)


def test_sample_malformed_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    assert_one_line_error(run("sample.py", "--prompts-file", str(path)), f"{path}:2: not valid JSON")
    path.write_text('{"text": "no prompt key"}\n')
    assert_one_line_error(run("sample.py", "--prompts-file", str(path)), f'{path}:1: expected an object with a "prompt"')


@pytest.mark.slow  # real SmolLM2 in two subprocesses; test_shipped_adapter runs sample.py on it
@requires_smollm2
def test_sample_sbd_on_smollm2(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?"}\n{"prompt": "Name a color."}\n')
    common = ["sample.py", "--prompts-file", str(prompts), "--chat", "--mode", "sbd", "--max-new-tokens", "16",
              "--block-size", "4", "--gamma", "0.5"]
    assert_one_line_error(run(*common), "no mask token configured", "--mask-token-id")
    proc = run(*common, "--mask-token-id", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    for row in map(json.loads, proc.stdout.strip().splitlines()):
        assert row["mode"] == "sbd" and row["block_size"] == 4 and len(row["reveal_pass"]) == row["new_tokens"]
        assert 0 < row["nfe"] and row["tokens_per_pass"] == row["new_tokens"] / row["nfe"]


def test_verify_needs_sbd_mode_and_sbd_options_need_it_too():
    assert_one_line_error(run("sample.py", "--prompt", "hi", "--verify"), "verify (--verify) checks SBD's drafts",
                          "--mode sbd")
    assert_one_line_error(run("sample.py", "--prompt", "hi", "--gamma", "0.5", "--block-size", "8"),
                          "gamma (--gamma), block_size (--block-size): SBD's, not NTP's", "--mode sbd")


@pytest.mark.slow  # times 33 widths; the width rule is tested in-process (test_tree)
def test_draft_nodes_auto_times_the_widths_and_keeps_ntp_text():
    """`--draft-nodes auto`: the pass widths timed here, each pass at the width the rule picks; NTP's text."""
    model = os.path.join("experiments", "small_scale", "models", "sbd_arith")
    common = ["sample.py", "--model", model, "--chat", "--prompt", "c5b7a2+b8a6", "--max-new-tokens", "24", "--json"]
    (ntp,) = [json.loads(line) for line in run(*common).stdout.strip().splitlines()]
    auto = run(*common, "--mode", "sbd", "--verify", "--drafts", "tree", "--block-size", "4", "--draft-nodes", "auto")
    assert auto.returncode == 0, auto.stderr
    assert "[--draft-nodes auto at batch 1: pass costs 1: " in auto.stderr and " 33: " in auto.stderr
    (row,) = [json.loads(line) for line in auto.stdout.strip().splitlines()]
    assert row["token_ids"] == ntp["token_ids"] and row["drafts"] == "tree"


@pytest.mark.slow  # three CLI runs of 72 tokens; test_verify decodes the same model in-process
def test_sample_verify_prints_exactly_the_ntp_text_of_the_shipped_model():
    """The shipped small-scale SBD model: verified SBD writes NTP's text, in fewer passes, at a fixed block
    size and at the one `--block-size auto` measures."""
    model = os.path.join("experiments", "small_scale", "models", "sbd_arith")
    common = ["sample.py", "--model", model, "--chat", "--prompt", "c5b7a2+b8a6", "--prompt", "d1c0b9a9+a1",
              "--max-new-tokens", "72", "--json"]
    ntp = [json.loads(line) for line in run(*common).stdout.strip().splitlines()]
    proc = run(*common, "--mode", "sbd", "--verify", "--block-size", "8")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    for verified, reference in zip(rows, ntp):
        assert verified["token_ids"] == reference["token_ids"] and verified["verify"]
        assert verified["nfe"] < reference["nfe"] and 0 <= verified["accepted_fraction"] <= 1
        assert len(verified["corrected"]) == verified["new_tokens"]
    shown = run(*common[:-1], "--mode", "sbd", "--verify", "--show-passes")
    assert shown.returncode == 0 and "\x1b[" in shown.stdout and "mean" in shown.stdout
    passes = run(*common[:-1], "--mode", "sbd", "--gamma", "0.5", "--show-passes")  # EB: tokens coloured by pass
    assert passes.returncode == 0 and "\x1b[3" in passes.stdout and "mean" in passes.stdout
    auto = run(*common, "--mode", "sbd", "--verify", "--block-size", "auto")  # calibrated here, then decoded
    assert auto.returncode == 0, auto.stderr
    picked = int(auto.stderr.split("picked block size ")[1].split(";")[0])  # trained drafts: a block, not NTP
    rows = [json.loads(line) for line in auto.stdout.strip().splitlines()]
    assert [r["token_ids"] for r in rows] == [r["token_ids"] for r in ntp]
    assert all(r["block_size"] == picked and r["verify"] and r["nfe"] < r["new_tokens"] for r in rows)
    bad = run("sample.py", "--prompt", "hi", "--mode", "sbd", "--verify", "--block-size", "big")
    assert bad.returncode == 2 and "expected a whole number or 'auto', got 'big'" in bad.stderr

