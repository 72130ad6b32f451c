"""Training a shipped adapter on in pieces (issue 55): `adapter.init_from` starts a run's adapter from a shipped one
(its weights as shipped, bfloat16-rounded, mask embedding included; a fresh optimizer; one-line refusals of another
rank, alpha, targets, base or mask token; the workdir's own checkpoint wins), `data.skip` moves a fresh run's stream
on, `ship --continues` adds the steps and joins the logs, and `piece.py` does all of it and resumes. On the
small-scale arithmetic model (a tiny base), never SmolLM2."""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

from experiments.draft_training import piece, run, ship
from sbd_jax.checkpoints import adapter as ad
from sbd_jax.checkpoints import load as load_module
from sbd_jax.checkpoints.files import save_safetensors
from sbd_jax.data import streaming
from sbd_jax.errors import UserError
from sbd_jax.model.adapter import MASK_EMBEDDING
from sbd_jax.training import checkpoints as train_checkpoints
from sbd_jax.training.config import TrainConfig, default_config_dict
from sbd_jax.training.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = os.path.join(ROOT, "experiments", "small_scale", "models", "sbd_arith")
TARGETS = ("q_proj", "v_proj", "down_proj")
SHIPPED_STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from experiments.small_scale.task import study_splits

    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": p.question, "completion": p.answer}) + "\n"
                            for p in study_splits().train[:200]))
    return str(path)


def tiny_config(data, steps=2, objective=None, **changes):
    """An adapter run on the small-scale model (rank 2); `changes`: SECTION__FIELD=value (or FIELD=value)."""
    cfg = default_config_dict()
    cfg.model.name, cfg.data.files, cfg.data.seq_len, cfg.data.workers = SMALL, (data,), 64, 0
    cfg.train.steps, cfg.train.batch_size, cfg.checkpoint.every, cfg.mesh = steps, 8, steps, (-1, 1, 1)
    cfg.adapter.rank, cfg.adapter.targets, cfg.export_hf = 2, TARGETS, False
    for key, value in (objective or {}).items():
        cfg.objective[key] = value
    for name, value in changes.items():
        if "__" in name:
            section, key = name.split("__")
            cfg[section][key] = value
        else:
            cfg[name] = value
    return TrainConfig.from_config_dict(cfg)


def randomized(path, seed):
    """The adapter directory `path` with every tensor replaced by random values (B too: it changes the model)."""
    rng = np.random.default_rng(seed)
    tensors = {n: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for n, v in ad.read_tensors(path).items()}
    save_safetensors(tensors, os.path.join(path, ad.WEIGHTS))
    return path


@pytest.fixture(scope="module")
def shipped(data, tmp_path_factory):
    """A shipped adapter of SHIPPED_STEPS steps (a trained-looking export of the tiny run, shipped in bfloat16)."""
    root = tmp_path_factory.mktemp("shipped")
    export = str(root / "run" / f"export_{SHIPPED_STEPS}")
    Trainer(tiny_config(data), str(root / "run")).export(export)
    randomized(export, seed=0)
    rows = [{"step": s, "loss": 9.0 - s, "lr": 1e-3, "seconds": 2.0} for s in range(1, SHIPPED_STEPS + 1)]
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ship.ship(export, "arith-sbd", out=str(root / "arith-sbd"), trained_at_commit="abc1234")


def per_layer(params):
    return {name: np.asarray(value) for name, value in ad._flat(ad._per_layer(jax.device_get(params))).items()}


def as_shipped(folder):
    """The shipped tensors as a float32 run holds them (bfloat16 values, exactly)."""
    tensors = ad.read_tensors(folder)
    assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    return {name: value.astype(np.float32) for name, value in tensors.items()}


@pytest.mark.parametrize("scan_layers", [False, True])
def test_init_from_starts_from_the_shipped_weights_with_a_fresh_optimizer(data, shipped, tmp_path, scan_layers):
    trainer = Trainer(tiny_config(data, adapter__init_from=shipped, model__scan_layers=scan_layers), str(tmp_path))
    got, want = per_layer(trainer.state.params), as_shipped(shipped)
    assert MASK_EMBEDDING in want and set(got) == set(want)
    for name in want:
        assert got[name].dtype == np.float32
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert int(trainer.state.step) == 0
    assert all(not np.asarray(leaf).any() for leaf in jax.tree.leaves(trainer.state.opt_state))  # moments at zero
    assert trainer.started_from == {"source": shipped, "steps": SHIPPED_STEPS}


def test_a_fresh_run_skips_data_skip_batches_and_a_resumed_one_does_not(data, tmp_path):
    cfg = tiny_config(data, data__skip=2)
    trainer = Trainer(cfg, str(tmp_path))
    reference = streaming.host_batches(cfg.data, trainer.tokenizer, global_batch=8, seed=0, host=0, hosts=1)
    batches = [next(reference) for _ in range(3)]
    manager = trainer.checkpoint_manager()
    _, start = train_checkpoints.resume(manager, cfg, str(tmp_path), trainer.state, trainer.iterator)
    manager.close()
    assert start == 0
    got = next(trainer.iterator)
    for name in got:
        np.testing.assert_array_equal(got[name], batches[2][name], err_msg=name)
    with pytest.raises(UserError, match="data.skip=-1 must be >= 0"):
        tiny_config(data, data__skip=-1)


@pytest.mark.parametrize("change, message", [
    (dict(adapter__rank=4), r"adapter.init_from='.*arith-sbd' has rank 2, this run adapter.rank=4: set adapter.rank=2 "
                            "to continue it"),
    (dict(adapter__alpha=8.0), "has alpha 32.0, this run adapter.alpha=8.0: set adapter.alpha=32.0"),
    (dict(adapter__targets=("q_proj",)), r"has targets \('q_proj', 'v_proj', 'down_proj'\), this run "
                                         r"adapter.targets=\('q_proj',\): set adapter.targets="),
    (dict(adapter__rank=0), "continues an adapter: set adapter.rank"),
    (dict(init_from="/tmp"), "set one of them"),
])
def test_another_rank_alpha_or_targets_is_refused_in_one_line_before_loading(data, shipped, change, message):
    with pytest.raises(UserError, match=message) as caught:
        tiny_config(data, adapter__init_from=shipped, **change)
    assert "\n" not in str(caught.value)


def test_another_base_or_mask_token_is_refused_naming_the_setting(data, shipped, tmp_path):
    other = str(tmp_path / "other-base")
    shutil.copytree(shipped, other)
    meta = json.load(open(os.path.join(other, ad.CONFIG)))
    meta["base"]["fingerprint"] = "0" * 16
    json.dump(meta, open(os.path.join(other, ad.CONFIG), "w"))
    with pytest.raises(UserError, match=r"was trained on base '.*sbd_arith' \(fingerprint 0000000000000000\), this "
                                        r"run's model.name=.* has fingerprint [0-9a-f]{16}: set model.name") as caught:
        Trainer(tiny_config(data, adapter__init_from=other), str(tmp_path / "a"))
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match="was trained with data.mask_token='new' .* set data.mask_token='new'"):
        Trainer(tiny_config(data, adapter__init_from=shipped, data__mask_token="5"), str(tmp_path / "b"))
    with pytest.raises(UserError, match="unknown adapter 'no-such-adapter'"):
        tiny_config(data, adapter__init_from="no-such-adapter")


def test_the_workdirs_own_checkpoint_beats_init_from(data, shipped, tmp_path):
    workdir = str(tmp_path / "w")
    trainer = Trainer(tiny_config(data, adapter__init_from=shipped), workdir)
    assert [r["step"] for r in trainer.run(until=1)] == [1]
    trained = per_layer(trainer.state.params)
    other = str(tmp_path / "other")
    shutil.copytree(shipped, other)
    randomized(other, seed=7)
    cfg = tiny_config(data, adapter__init_from=other)
    again = Trainer(cfg, workdir)
    assert not np.array_equal(per_layer(again.state.params)["layers_0/self_attn/q_proj_lora/b"],
                              trained["layers_0/self_attn/q_proj_lora/b"])
    manager = again.checkpoint_manager()
    state, start = train_checkpoints.resume(manager, cfg, workdir, again.state, again.iterator)
    manager.close()
    assert start == 1
    for name, value in per_layer(state.params).items():
        np.testing.assert_array_equal(value, trained[name], err_msg=name)


def continued_export(tmp_path, shipped, steps=2):
    """An export trained on from `shipped` (as the trainer records it) with its run's metrics.jsonl."""
    export = str(tmp_path / "piece" / "export")
    shutil.copytree(shipped, export)
    meta = json.load(open(os.path.join(export, ad.CONFIG)))
    meta = {k: v for k, v in meta.items() if k not in ("shipped", "dtype")}
    meta["init_from"] = {"source": shipped, "steps": SHIPPED_STEPS}
    json.dump(meta, open(os.path.join(export, ad.CONFIG), "w"))
    rows = [{"step": s, "loss": 5.0 - s, "seconds": 1.0} for s in range(1, steps + 1)]
    (tmp_path / "piece" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return export


def test_ship_adds_the_pieces_steps_and_joins_the_logs(shipped, tmp_path):
    export = continued_export(tmp_path, shipped)
    out = ship.ship(export, "arith-sbd", out=str(tmp_path / "out"), steps=2, continues=shipped,
                    trained_at_commit="def5678", command="python -m experiments.draft_training.piece --steps 2")
    meta = json.load(open(os.path.join(out, ad.CONFIG)))
    assert meta["shipped"]["steps"] == SHIPPED_STEPS + 2
    assert [(p["steps"], p["trained_at_commit"]) for p in meta["shipped"]["pieces"]] == [(3, "abc1234"), (2, "def5678")]
    log = [json.loads(line) for line in open(os.path.join(out, ship.LOG))]
    assert [(r["step"], r["loss"]) for r in log] == [(1, 8.0), (2, 7.0), (3, 6.0), (4, 4.0), (5, 3.0)]
    text = open(os.path.join(out, ship.README)).read()
    assert "5 training steps in all, in 2 pieces" in text and "5 steps (1–5)" in text

    with pytest.raises(UserError, match=r"continues the adapter .* \(3 steps\): give --continues"):
        ship.ship(export, "arith-sbd", out=str(tmp_path / "x"), steps=2)
    with pytest.raises(UserError, match="was trained from an adapter of 3 steps, --continues .* has 5"):
        ship.ship(export, "arith-sbd", out=str(tmp_path / "x"), steps=2, continues=out)


def test_the_piece_runner_trains_from_the_shipped_adapter_ships_over_it_and_reruns(data, shipped, tmp_path,
                                                                                   monkeypatch, capsys):
    folder = str(tmp_path / "package" / "arith-sbd")
    shutil.copytree(shipped, folder)
    monkeypatch.setitem(load_module.KNOWN_ADAPTERS, "arith-sbd", (SMALL, "adapters/arith-sbd"))
    monkeypatch.setattr(load_module, "adapter_folder", lambda name: folder)
    monkeypatch.setattr(ship, "adapter_folder", lambda name: folder)
    monkeypatch.setattr(run, "choose_second", lambda results: None)  # the decision not yet recorded
    trained_on = []  # the data folder each config was asked for (the tiny config trains on `data` whatever it is)
    monkeypatch.setattr(run, "arm_config", lambda name, objective, sizes, workdir, steps, folder: trained_on.append(
        folder) or tiny_config(data, steps, objective, adapter__rank=run.sizes_rank(sizes)))
    configs = []
    real = piece.piece_config
    monkeypatch.setattr(piece, "piece_config", lambda *a: configs.append(real(*a)) or configs[-1])
    workdir = str(tmp_path / "w")
    argv = ["--steps", "2", "--workdir", workdir, "--name", "arith-sbd", "--smoke"]
    with pytest.raises(UserError, match="not recorded in results.json yet: give --arm NAME"):
        piece.main(argv)
    assert piece.main(argv + ["--arm", "adapter_kl_full"]) == folder
    cfg = configs[-1]
    assert (cfg.adapter.init_from, cfg.data.skip, cfg.adapter.rank) == (os.path.join(workdir, "start"), 3, 2)
    assert (cfg.optimizer.schedule, cfg.optimizer.decay_steps, cfg.optimizer.warmup_steps) == ("wsd", 0, 1)
    assert (cfg.objective.full_mask_share, cfg.objective.soft_target) == (1.0, 1.0)  # the arm's objective
    assert trained_on[-1] == run.DATA  # the recipe's kept CPU data, as every piece before --data
    meta = json.load(open(os.path.join(folder, ad.CONFIG)))
    assert meta["shipped"]["steps"] == SHIPPED_STEPS + 2 and meta["init_from"]["steps"] == SHIPPED_STEPS
    assert "--arm adapter_kl_full" in meta["shipped"]["pieces"][-1]["command"]
    log = [json.loads(line) for line in open(os.path.join(folder, ship.LOG))]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5] and log[0]["loss"] == 8.0
    assert "git add " in capsys.readouterr().out
    shipped_weights = ad.read_tensors(folder)

    # A rerun of the finished piece trains nothing and ships the same steps (it starts from WORKDIR/start).
    assert piece.main(argv) == folder
    assert json.load(open(os.path.join(folder, ad.CONFIG)))["shipped"]["steps"] == SHIPPED_STEPS + 2
    for name, value in ad.read_tensors(folder).items():
        np.testing.assert_array_equal(value, shipped_weights[name])
    with pytest.raises(UserError, match="holds a piece with steps=2"):
        piece.main(["--steps", "3", "--workdir", workdir, "--name", "arith-sbd", "--smoke"])

    # A piece on other distilled data: trained on that folder, recorded in its command; refused where it has no
    # train.jsonl, and a rerun of the first piece with other data is refused.
    more = tmp_path / "more"
    with pytest.raises(UserError, match=f"--data {more}: no train.jsonl there"):
        piece.main(["--steps", "1", "--workdir", str(tmp_path / "w2"), "--name", "arith-sbd", "--smoke",
                    "--data", str(more)])
    more.mkdir()
    (more / "train.jsonl").write_text(open(data).read())
    with pytest.raises(UserError, match=f"holds a piece with data='{os.path.relpath(run.DATA, run.ROOT)}'"):
        piece.main(argv + ["--data", str(more)])
    piece.main(["--steps", "1", "--workdir", str(tmp_path / "w2"), "--name", "arith-sbd", "--smoke",
                "--data", str(more), "--arm", "adapter_kl_full"])
    assert os.path.normpath(trained_on[-1]) == str(more)
    meta = json.load(open(os.path.join(folder, ad.CONFIG)))
    assert meta["shipped"]["steps"] == SHIPPED_STEPS + 3
    assert f" --data {os.path.relpath(more, ROOT)} " in meta["shipped"]["pieces"][-1]["command"]
    # the same folder spelled another way is the same piece (one spelling is recorded)
    piece.main(["--steps", "1", "--workdir", str(tmp_path / "w2"), "--name", "arith-sbd", "--smoke",
                "--data", str(more) + "/"])


def test_no_ship_exports_the_piece_and_the_same_command_without_it_ships_it(data, shipped, tmp_path, monkeypatch):
    folder = str(tmp_path / "package" / "arith-sbd")
    shutil.copytree(shipped, folder)
    monkeypatch.setitem(load_module.KNOWN_ADAPTERS, "arith-sbd", (SMALL, "adapters/arith-sbd"))
    monkeypatch.setattr(load_module, "adapter_folder", lambda name: folder)
    monkeypatch.setattr(ship, "adapter_folder", lambda name: folder)
    monkeypatch.setattr(run, "arm_config", lambda name, objective, sizes, workdir, steps, data_folder: tiny_config(
        data, steps, objective, adapter__rank=run.sizes_rank(sizes)))
    argv = ["--steps", "1", "--workdir", str(tmp_path / "w"), "--name", "arith-sbd", "--smoke"]  # the decided arm
    before = ad.read_tensors(folder)
    export = piece.main(argv + ["--no-ship"])
    assert export == str(tmp_path / "w" / "export") and os.path.isfile(os.path.join(export, ad.WEIGHTS))
    assert json.load(open(os.path.join(folder, ad.CONFIG)))["shipped"]["steps"] == SHIPPED_STEPS  # untouched
    for name, value in ad.read_tensors(folder).items():
        np.testing.assert_array_equal(value, before[name])
    assert piece.main(argv) == folder
    assert json.load(open(os.path.join(folder, ad.CONFIG)))["shipped"]["steps"] == SHIPPED_STEPS + 1


def test_data_or_passes_trains_both_arms_unshipped_measures_them_and_ships_the_rules_winner(tmp_path, monkeypatch):
    """The third decision's flow, with the training and the measuring replaced (each is tested on its own)."""
    from experiments.draft_training import data_or_passes as decision

    out = tmp_path / "data_or_passes.json"
    monkeypatch.setattr(decision, "OUT", str(out))
    calls = []

    def fake_piece(argv):
        calls.append(argv)
        workdir = argv[argv.index("--workdir") + 1]
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, piece.PIECE), "w") as f:
            json.dump({"arm": "adapter_lr10", "commit": "abc1234"}, f)
        return os.path.join(workdir, "export")

    measured = {"passes": 1.60, "data": 1.63}
    monkeypatch.setattr(piece, "main", fake_piece)
    monkeypatch.setattr(run, "measure", lambda arm, export, step, sizes, base: {
        "verified_sbd_4": measured[os.path.basename(os.path.dirname(export))], "arm": arm, "step": step})
    monkeypatch.setattr(decision, "DATA", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="missing is not distilled yet: python -m recipes.smollm2_sbd.run"):
        decision.main(["--workdir", str(tmp_path / "w")])
    with pytest.raises(UserError, match="does not hold both arms' measurements yet: run without --ship first"):
        decision.main(["--workdir", str(tmp_path / "w"), "--ship"])
    monkeypatch.setattr(decision, "DATA", run.DATA)  # any folder with a train.jsonl
    results = decision.main(["--workdir", str(tmp_path / "w")])
    assert [c[c.index("--workdir") + 1] for c in calls] == [str(tmp_path / "w" / n) for n in ("passes", "data")]
    assert all(c[-1] == "--no-ship" and c[:4] == ["--steps", "150", "--decay-steps", "50"] for c in calls)
    assert results["arms"]["data"]["point"] == {"verified_sbd_4": 1.63, "arm": "adapter_lr10", "step": 150}
    assert (results["arms"]["data"]["workdir"], results["arms"]["data"]["commit"]) == (
        str(tmp_path / "w" / "data"), "abc1234")
    assert results["winner"] == "data" == json.load(open(out))["winner"]  # 0.03 more: past the 0.02 margin
    calls.clear()
    assert decision.main(["--workdir", str(tmp_path / "w")])["winner"] == "data" and not calls  # measured: kept
    with pytest.raises(UserError, match=r"the measured data arm was trained in .*w/data, which this --workdir does "
                                        r"not hold: ship from --workdir .*/w \(another would train it again\)"):
        decision.main(["--workdir", str(tmp_path / "elsewhere"), "--ship"])
    assert decision.main(["--workdir", str(tmp_path / "w"), "--ship"])["winner"] == "data"
    assert "--no-ship" not in calls[-1] and calls[-1][calls[-1].index("--workdir") + 1].endswith("data")
    kept = json.load(open(out))
    kept["arms"]["data"]["point"]["verified_sbd_4"] = 1.615  # within the margin: the passes, no new data kept
    assert decision.choose(kept) == "passes"
