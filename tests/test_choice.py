"""Closed sets of names are `str` Enums (`sbd_jax.choice.Choice`): plain strings from config files, JSON and
command lines keep working, and become the members."""

import json

import ml_collections
import pytest

from configs import tiny
from sbd_jax.decoding.base import check_proxy
from sbd_jax.decoding.drafts import Drafts
from sbd_jax.decoding.settings import Mode, Settings
from sbd_jax.decoding.token_choice import Proxy
from sbd_jax.errors import UserError
from sbd_jax.model.attention import AttentionImpl
from sbd_jax.model.config import DType, ModelConfig
from sbd_jax.model.transformer import Remat
from sbd_jax.training.config import ObjectiveKind, Schedule, TrainConfig


def test_a_member_is_its_name():
    for member in (DType.BFLOAT16, Remat.DOTS, AttentionImpl.SPLASH, Proxy.LEFT_TO_RIGHT, ObjectiveKind.NTP,
                   Schedule.WSD, Drafts.SBD_TREE, Mode.SBD):
        name = member.value
        assert member == name and hash(member) == hash(name) and {name: 1}[member] == 1
        assert str(member) == f"{member}" == name and repr(member) == repr(name)
        assert json.loads(json.dumps({"x": member})) == {"x": name}
        assert type(member).parse(name, "x") is member and type(member).parse(member, "x") is member


def test_an_unknown_name_is_one_line_listing_the_names():
    with pytest.raises(UserError, match=r"^proxy='vibes': use one of entropy, confidence, margin, left_to_right$"):
        check_proxy("vibes")
    with pytest.raises(UserError, match=r"^proxy='vibes'"):  # in any mode, not only the one that reads it
        Settings(mode="ntp", proxy="vibes")
    with pytest.raises(UserError, match=r"^config dtype=\['float32'\]: use one of float64, float32, bfloat16"):
        ModelConfig("llama", 8, 4, 8, 1, 1, 1, 4, dtype=["float32"])


def test_config_strings_become_members_and_members_stay_names_in_a_config_dict():
    cfg = tiny.get_config()
    cfg.model.remat, cfg.optimizer.schedule = Remat.DOTS, "wsd"  # a member is stored as its name
    assert type(cfg.model.remat) is str and cfg.model.remat == "dots"
    converted = TrainConfig.from_config_dict(cfg)
    assert converted.model.remat is Remat.DOTS and converted.optimizer.schedule is Schedule.WSD
    assert converted.objective.kind is ObjectiveKind.SBD and converted.model.dtype is DType.FLOAT32
    assert converted.model.attention is AttentionImpl.AUTO
    overridden = ml_collections.ConfigDict(cfg.to_dict())
    overridden.model.dtype = "bfloat16"  # what `--config.model.dtype=bfloat16` does
    assert TrainConfig.from_config_dict(overridden).model.dtype is DType.BFLOAT16


def test_a_model_config_keeps_its_hash_and_equality_with_names():
    named = ModelConfig("llama", 8, 4, 8, 1, 1, 1, 4, dtype="bfloat16", param_dtype="float32")
    members = ModelConfig("llama", 8, 4, 8, 1, 1, 1, 4, dtype=DType.BFLOAT16)
    assert named == members and hash(named) == hash(members) and named.dtype is DType.BFLOAT16
    assert json.dumps(named.dtype) == '"bfloat16"'
