"""Shipped adapters: a bfloat16 copy of an exported adapter loads as the float32 adapter rounded to bfloat16 (NTP
still the base's bit for bit), `experiments.draft_training.ship` writes the folder with where it came from,
known names resolve to the package's folder (one-line errors otherwise), and the folder is package data."""

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import zipfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import sample
from experiments.draft_training import ship
from sbd_jax.api import load
from sbd_jax.checkpoints import adapter as ad
from sbd_jax.checkpoints import load as load_module
from sbd_jax.decoding.base import NTPDecoder
from sbd_jax.decoding.generate import generate
from sbd_jax.decoding.settings import Settings
from sbd_jax.errors import UserError
from sbd_jax.model.adapter import merge
from sbd_jax.model.config import AdapterConfig
from sbd_jax.model.transformer import Transformer
from tests.test_adapter import BASE, CFG, MASK, PROMPTS, NoTokenizer, base_params, random_adapter, random_adapter_for
from tests.test_cli import assert_one_line_error, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith")


def exported(tmp_path, base, adapter, folder="export_3"):
    path = str(tmp_path / "run" / folder)
    ad.save_adapter(path, CFG, adapter, {"name": "tiny", "fingerprint": ad.fingerprint(base), "mask_token": MASK})
    return path


def test_a_bfloat16_copy_loads_as_the_adapter_rounded_to_bfloat16_and_ntp_stays_the_bases(tmp_path):
    base = base_params()
    adapter = random_adapter(base)
    export = exported(tmp_path, base, adapter)
    copy = str(tmp_path / "bf16")
    meta = ad.write_copy(export, copy, note={"source": export})
    assert meta["dtype"] == "bfloat16" and meta["shipped"] == {"source": export}
    assert ad.read_adapter_config(copy)["rank"] == CFG.adapter.rank
    tensors = ad.read_tensors(copy)
    assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    assert 2 * sum(v.nbytes for v in tensors.values()) == sum(v.nbytes for v in ad.read_tensors(export).values())

    config, params, _ = ad.attach_adapter(copy, BASE, base, NoTokenizer())
    _, from_fp32, _ = ad.attach_adapter(export, BASE, base, NoTokenizer())
    rounded = merge(base, jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), adapter))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(rounded)):
        assert got.dtype == jnp.float32, path  # cast to the model's weights dtype
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(path))

    tokens = jnp.asarray(np.random.default_rng(1).integers(0, MASK, (3, 12))).at[:, 8:].set(MASK)
    positions = jnp.broadcast_to(jnp.arange(12), tokens.shape)
    logits = {name: Transformer(config, gate_from=8).apply({"params": p}, tokens, positions)[0]
              for name, p in (("bf16", params), ("rounded", rounded), ("fp32", from_fp32))}
    plain, _ = Transformer(BASE).apply({"params": base}, tokens, positions)
    np.testing.assert_array_equal(np.asarray(logits["bf16"]), np.asarray(logits["rounded"]))
    np.testing.assert_array_equal(np.asarray(logits["bf16"][:, :8]), np.asarray(plain[:, :8]))
    gap = float(jnp.abs(logits["bf16"] - logits["fp32"]).max())
    effect = float(jnp.abs(logits["fp32"] - plain).max())  # what the adapter changes in the block
    assert 0 < gap < 0.05 * effect, (gap, effect)  # bf16 rounding of the adapter's weights only

    reference, _ = generate(NTPDecoder(BASE, max_new_tokens=12), base, PROMPTS)
    ntp, _ = generate(NTPDecoder(config, max_new_tokens=12), params, PROMPTS)
    settings = Settings(mode="sbd", verify=True, block_size=4, max_new_tokens=12)
    verified, _ = generate(settings.decoder(config), params, PROMPTS)
    assert [r.token_ids for r in ntp] == [r.token_ids for r in verified] == [r.token_ids for r in reference]

    _, half_params, _ = ad.attach_adapter(copy, BASE.replace(param_dtype="bfloat16"), base, NoTokenizer())
    assert half_params["layers_0"]["self_attn"]["q_proj_lora"]["a"].dtype == jnp.bfloat16
    with pytest.raises(UserError, match="it would replace the adapter it reads"):
        ad.write_copy(copy, copy)


def test_ship_writes_the_folder_with_its_log_and_where_it_came_from(tmp_path):
    base = base_params()
    export = exported(tmp_path, base, random_adapter(base))
    rows = [{"step": 1, "loss": 9.0, "lr": 0.0, "seconds": 60.0}, {"step": 2, "loss": 8.0, "seconds": 60.0},
            {"step": 2, "loss": 7.5, "seconds": 61.0}, {"step": 3, "loss": 7.0, "seconds": 60.0},
            {"step": 4, "loss": 6.0, "seconds": 60.0}]  # step 2 again: a resumed run; step 4: after the export
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = str(tmp_path / "shipped" / "tiny-sbd")
    assert ship.main(["--export", export, "--name", "tiny-sbd", "--out", out, "--commit", "abc1234",
                      "--note", "piece 1 of the long run"]) == out
    assert sorted(os.listdir(out)) == sorted([ad.CONFIG, ad.WEIGHTS, ship.LOG, ship.README])
    meta = json.load(open(os.path.join(out, ad.CONFIG)))
    shipped = meta["shipped"]
    assert meta["dtype"] == "bfloat16" and shipped["steps"] == 3 and shipped["trained_at_commit"] == "abc1234"
    assert shipped["source"] == os.path.normpath(export) and shipped["shipped_at_commit"]
    log = [json.loads(line) for line in open(os.path.join(out, ship.LOG))]
    assert [(r["step"], r["loss"]) for r in log] == [(1, 9.0), (2, 7.5), (3, 7.0)]
    text = open(os.path.join(out, ship.README)).read()
    assert "--adapter tiny-sbd" in text and "3 training steps" in text and "piece 1 of the long run" in text
    config, _, _ = ad.attach_adapter(out, BASE, base, NoTokenizer())
    assert config.adapter == CFG.adapter

    with pytest.raises(UserError, match="trained on base 'tiny'; 'smollm2-135m-sbd' is listed in KNOWN_ADAPTERS "
                                        "for 'smollm2-135m'"):
        ship.ship(export, "smollm2-135m-sbd", out=str(tmp_path / "x"))
    with pytest.raises(UserError, match="adapter name 'Bad Name'"):
        ship.ship(export, "Bad Name", out=str(tmp_path / "x"))
    assert ship.steps_of(str(tmp_path / "run" / "adapter"), None) is None
    assert ship.steps_of(export + "/", None) == 3 and ship.steps_of(export, 40) == 40
    assert ad.shipped_steps(out) == 3 and ad.shipped_steps(export) is None  # what result files quote


def test_the_registry_names_the_package_folder_and_its_errors_are_one_line(monkeypatch, tmp_path):
    assert load_module.KNOWN_ADAPTERS["smollm2-135m-sbd"] == ("smollm2-135m", "adapters/smollm2-135m-sbd")
    folder = load_module.adapter_folder("smollm2-135m-sbd")
    assert folder == os.path.join(ROOT, "sbd_jax", "adapters", "smollm2-135m-sbd")
    for spec, message in [("nope", "unknown adapter 'nope': give an adapter directory .* known names: "
                                   "smollm2-135m-sbd"),
                          (str(tmp_path / "missing"), "adapter directory .*missing does not exist")]:
        with pytest.raises(UserError, match=message) as caught:
            load_module.resolve_adapter(spec)
        assert "\n" not in str(caught.value)
    monkeypatch.setitem(load_module.KNOWN_ADAPTERS, "not-shipped", ("smollm2-135m", "adapters/not-shipped"))
    with pytest.raises(UserError, match="adapter 'not-shipped' is known but not in this installation .*"
                                        "python -m experiments.draft_training.ship --export DIR --name not-shipped"):
        load_module.resolve_adapter("not-shipped")


def test_a_known_name_loads_from_the_api_and_sample_py(monkeypatch, tmp_path, capsys):
    """By name through `sbd_jax.load` and `sample.py --adapter` (the folder moved to tmp_path, so the test
    writes nothing into the package); a base with other weights is refused naming the name."""
    plain = load(SMALL)
    config = plain.config.replace(adapter=AdapterConfig(rank=2))
    export = str(tmp_path / "export")
    ad.save_adapter(export, config, random_adapter_for(config, plain.params),
                    {"name": SMALL, "fingerprint": ad.fingerprint(plain.params), "mask_token": "new"})
    shipped = ship.ship(export, "arith-sbd", out=str(tmp_path / "arith-sbd"))
    monkeypatch.setitem(load_module.KNOWN_ADAPTERS, "arith-sbd", (SMALL, "adapters/arith-sbd"))
    real_folder = load_module.adapter_folder
    monkeypatch.setattr(load_module, "adapter_folder", lambda name: shipped if name == "arith-sbd" else
                        real_folder(name))
    tuned = load(SMALL, adapter="arith-sbd")
    assert tuned.config.adapter.rank == 2
    (a,) = plain.generate("c5b7a2+b8a6", chat=True, max_new_tokens=16)
    (b,) = tuned.generate("c5b7a2+b8a6", chat=True, max_new_tokens=16, mode="sbd", verify=True, block_size=4)
    assert a.token_ids == b.token_ids
    sample.main(["--model", SMALL, "--adapter", "arith-sbd", "--prompt", "c5b7a2+b8a6", "--chat",
                 "--max-new-tokens", "16", "--json"])
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"] == a.token_ids
    other = dict(plain.params, norm={"weight": plain.params["norm"]["weight"] + 1})
    with pytest.raises(UserError, match="adapter arith-sbd was trained on other weights"):
        ad.attach_adapter("arith-sbd", plain.config, other, plain.tokenizer)


def test_sample_py_names_the_known_adapters_for_an_unknown_one():
    assert_one_line_error(run("sample.py", "--model", SMALL, "--adapter", "no-such-adapter", "--prompt", "hi"),
                          "unknown adapter 'no-such-adapter'", "smollm2-135m-sbd")


SHIPPED_FILES = [ad.CONFIG, ad.WEIGHTS, ship.LOG, ship.README]


def test_the_package_data_globs_cover_every_file_ship_writes():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["sbd_jax"]
    for file in [*(f"adapters/smollm2-135m-sbd/{name}" for name in SHIPPED_FILES), "adapters/README.md"]:
        assert any(fnmatch.fnmatch(file, g) for g in globs), file
    assert os.path.isfile(os.path.join(ROOT, "sbd_jax", "adapters", "README.md"))


@pytest.mark.slow
def test_a_wheel_carries_the_shipped_adapters(tmp_path):
    """A non-editable wheel of the tracked tree plus a shipped folder holds the folder's every file."""
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files", "pyproject.toml", "README.md", "sbd_jax"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for file in files:
        if os.path.exists(os.path.join(ROOT, file)):
            os.makedirs(tree / os.path.dirname(file), exist_ok=True)
            shutil.copy(os.path.join(ROOT, file), tree / file)
    folder = tree / "sbd_jax" / "adapters" / "tiny-sbd"
    folder.mkdir(parents=True)
    for name in SHIPPED_FILES:
        (folder / name).write_text("x")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "w"), str(tree)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "w").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"sbd_jax/adapters/tiny-sbd/{name}" for name in SHIPPED_FILES} | {"sbd_jax/adapters/README.md"} <= names
