"""A resumed run is the run its checkpoints were trained as (`sbd_jax.training.run_identity`), its steps reach
past the checkpoint's, its rows fit the model's positions, and a failed export is one line: each of these went
on silently (or ended in a traceback) before."""

import errno

import pytest

from sbd_jax.data.streaming import HostBatches
from sbd_jax.errors import UserError
from sbd_jax.model.config import AdapterConfig, ModelConfig
from sbd_jax.training import run_identity
from sbd_jax.training.trainer import Trainer
from tests.conftest import requires_smollm2
from tests.test_train_recovery import small_config

CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, mask_token_id=5)


def test_a_run_that_differs_from_the_recorded_one_is_refused_naming_each_difference(tmp_path):
    adapter = CONFIG.replace(adapter=AdapterConfig(rank=4, alpha=8.0))
    run_identity.record(str(tmp_path), run_identity.run_identity(adapter, "base-a", "sbd"))
    run_identity.check_same_run(str(tmp_path), run_identity.run_identity(adapter, "base-a", "sbd"), "--workdir")
    # How it runs is not what it is: another compute dtype or a scanned stack resumes.
    run_identity.check_same_run(str(tmp_path), run_identity.run_identity(
        adapter.replace(dtype="bfloat16", scan_layers=True), "base-a", "sbd"), "--workdir")
    other = adapter.replace(mask_token_id=6, adapter=AdapterConfig(rank=4, alpha=2.0))
    with pytest.raises(UserError, match=r"were trained as another run \(adapter.alpha 8.0 -> 2.0; base_fingerprint "
                                        r"'base-a' -> 'base-b'; model.mask_token_id 5 -> 6\): resume with the model"):
        run_identity.check_same_run(str(tmp_path), run_identity.run_identity(other, "base-b", "sbd"), "--workdir")
    with pytest.raises(UserError, match=r"adapter \{.*\} -> None; objective 'sbd' -> 'ntp'"):
        run_identity.check_same_run(str(tmp_path), run_identity.run_identity(CONFIG, "base-a", "ntp"), "--workdir")


def test_a_workdir_from_before_identities_or_a_field_added_since_is_not_checked_and_a_damaged_record_is_named(
        tmp_path):
    run_identity.check_same_run(str(tmp_path), run_identity.run_identity(CONFIG, "", "sbd"), "--workdir")
    assert not run_identity.recorded(str(tmp_path))
    older = run_identity.run_identity(CONFIG, "", "sbd")
    del older["model"]["qk_norm"]  # as if written before the field existed
    run_identity.record(str(tmp_path), older)
    run_identity.check_same_run(str(tmp_path), run_identity.run_identity(CONFIG.replace(qk_norm=True), "", "sbd"),
                                "--workdir")
    (tmp_path / run_identity.IDENTITY).write_text('{"model": ')
    with pytest.raises(UserError, match=r"^cannot read .*run_identity.json \(JSONDecodeError: .*\): it records what "
                                        r"the checkpoints beside it were trained as; restore it, or start a new run"):
        run_identity.check_same_run(str(tmp_path), older, "--workdir")


@requires_smollm2
def test_a_resume_as_another_run_or_before_its_checkpoint_is_refused_and_the_same_run_resumes(tmp_path, monkeypatch):
    cfg = small_config(train__steps=2, checkpoint__every=2)
    Trainer(cfg, str(tmp_path)).run()
    assert run_identity.recorded(str(tmp_path))
    other = small_config(train__steps=3, checkpoint__every=2)
    other.model.architecture = {**other.model.architecture, "rope_theta": 50000.0}
    with pytest.raises(UserError, match=r"trained as another run \(model.rope_theta 10000.0 -> 50000.0\)"):
        Trainer(other, str(tmp_path)).run()
    closed = []  # a run that ends in an error stops its data workers (their shared memory leaked at exit)
    monkeypatch.setattr(HostBatches, "close", lambda self: closed.append(self))
    refused = Trainer(small_config(train__steps=1), str(tmp_path))
    with pytest.raises(UserError, match=r"is at step 2, past train.steps=1, which counts the whole run: set "
                                        r"train.steps above 2"):
        refused.run()
    assert closed == [refused.iterator]
    # A workdir from before identities resumes, and records its identity from then on.
    (tmp_path / run_identity.IDENTITY).unlink()
    assert [r["step"] for r in Trainer(small_config(train__steps=3), str(tmp_path)).run()] == [3]
    assert run_identity.recorded(str(tmp_path))
    # A branch (init_from) is checked against the run it branches from, and must have steps left to train.
    with pytest.raises(UserError, match=r"checkpoints in init_from .* trained as another run"):
        branched = small_config(train__steps=4)
        branched.init_from, branched.model.architecture = str(tmp_path), other.model.architecture
        Trainer(branched, str(tmp_path / "branch")).run()
    with pytest.raises(UserError, match=r"\(init_from\) is at step 3, already at train.steps=3"):
        branched = small_config(train__steps=3)
        branched.init_from = str(tmp_path)
        Trainer(branched, str(tmp_path / "branch2")).run()
    branched.train.steps = 4
    Trainer(branched, str(tmp_path / "branch2")).run()
    assert run_identity.recorded(str(tmp_path / "branch2"))  # the branch is checked against itself from now on


@requires_smollm2
def test_an_adapter_run_resumed_on_another_base_or_mask_token_is_refused(tmp_path):
    """The motivating case: an adapter run's checkpoint holds only the adapter, so it restored onto any base."""
    cfg = small_config(train__steps=1, adapter__rank=4)
    Trainer(cfg, str(tmp_path)).run()
    other_base = small_config(train__steps=2, adapter__rank=4)
    other_base.seed = 1  # a random base of another seed: other frozen weights
    with pytest.raises(UserError, match=r"another run \(base_fingerprint '\w+' -> '\w+'\)"):
        Trainer(other_base, str(tmp_path)).run()
    other_mask = small_config(train__steps=2, adapter__rank=4, adapter__alpha=8.0, data__mask_token="7")
    with pytest.raises(UserError, match=r"another run \(adapter.alpha 32.0 -> 8.0; model.mask_token_id 49152 -> 7; "
                                        r"model.vocab_size 49153 -> 49152\)"):
        Trainer(other_mask, str(tmp_path)).run()


@requires_smollm2
def test_rows_longer_than_the_models_positions_are_refused(tmp_path):
    cfg = small_config()
    cfg.data.seq_len = cfg.model.architecture["max_position_embeddings"] + 1
    with pytest.raises(UserError, match=r"data.seq_len=1025 exceeds the model's max_position_embeddings=1024: lower "
                                        r"data.seq_len or raise model.architecture's max_position_embeddings$"):
        Trainer(cfg, str(tmp_path))


def test_a_failed_export_is_one_line_naming_the_directory(tmp_path, monkeypatch):
    import numpy as np

    from sbd_jax.checkpoints import hf
    from sbd_jax.model.transformer import init_params

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf, "save_safetensors", full_disk)
    params = init_params(CONFIG, 0)
    with pytest.raises(UserError, match=rf"^cannot write {tmp_path}/hf \(OSError: \[Errno 28\] No space left on "
                                        r"device\); free space or choose a directory you can write, then run the "
                                        r"same command again$"):
        hf.save_hf(str(tmp_path / "hf"), CONFIG, params)

    from sbd_jax.checkpoints import adapter, files

    monkeypatch.setattr(files, "save_safetensors", full_disk)
    tuned = CONFIG.replace(adapter=AdapterConfig(rank=4))
    with pytest.raises(UserError, match=rf"^cannot write {tmp_path}/adapter \(OSError: \[Errno 28\]"):
        adapter.save_adapter(str(tmp_path / "adapter"), tuned, {"embed": {"mask": np.zeros(4, np.float32)}}, {})
