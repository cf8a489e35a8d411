"""Config validation, environment overrides and config files."""

from __future__ import annotations

import json

import pytest

from specsplit import ConfigError, SpecSplitConfig, TreeConfig
from specsplit.config import DraftConfig, EngineTuning, SamplingParams, TargetConfig


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: TreeConfig(shape="star"), "tree shape"),
        (lambda: TreeConfig(num_draft_tokens=-1), "num_draft_tokens"),
        (lambda: TreeConfig(shape="static", paths=[[0], [2]]), "static tree paths"),
        (lambda: TreeConfig(shape="dynamic", budget=0), "budget"),
        (lambda: SamplingParams(do_sample=True, temperature=0.0), "temperature"),
        (lambda: SamplingParams(top_p=1.5), "top_p"),
        (lambda: DraftConfig(dtype="float8"), "dtype"),
        (lambda: DraftConfig(tuning=EngineTuning(q_top_k=0)), "q_top_k"),
        (lambda: TargetConfig(max_sessions=0), "max_sessions"),
        (lambda: SpecSplitConfig(transport="carrier-pigeon"), "transport"),
        (lambda: SpecSplitConfig(transport="grpc"), "target_address"),
    ],
)
def test_invalid_values_have_actionable_messages(build, match):
    with pytest.raises(ConfigError, match=match):
        build()


def test_env_overrides():
    env = {
        "SPECSPLIT_TRANSPORT": "grpc",
        "SPECSPLIT_TARGET_ADDRESS": "10.0.0.6:50052",
        "SPECSPLIT_DRAFT_ADDRESS": "10.0.0.5:50051",
        "SPECSPLIT_TREE_SHAPE": "dynamic",
        "SPECSPLIT_TREE_BUDGET": "32",
        "SPECSPLIT_TARGET_DEVICE": "cuda:1",
        "SPECSPLIT_OVERLAP": "true",
        "SPECSPLIT_TIMEOUT_S": "2.5",
    }
    cfg = SpecSplitConfig.from_env(environ=env)
    assert cfg.transport == "grpc" and cfg.target_address == "10.0.0.6:50052"
    assert cfg.draft_address == "10.0.0.5:50051"
    assert cfg.tree.shape == "dynamic" and cfg.tree.budget == 32 and cfg.tree.max_nodes == 32
    assert cfg.target.device == "cuda:1" and cfg.overlap is True and cfg.timeout_s == 2.5
    with pytest.raises(ConfigError, match="SPECSPLIT_TREE_BUDGET"):
        SpecSplitConfig.from_env(environ={"SPECSPLIT_TREE_BUDGET": "many"})


def test_from_file_json_and_toml(tmp_path):
    (tmp_path / "c.json").write_text(
        json.dumps({"tree": {"shape": "static"}, "draft": {"tuning": {"q_top_k": 8}}})
    )
    cfg = SpecSplitConfig.from_file(tmp_path / "c.json")
    assert cfg.tree.shape == "static" and cfg.draft.tuning.q_top_k == 8 and cfg.tree.max_nodes == 16
    (tmp_path / "c.toml").write_text('transport = "local"\n[tree]\nshape = "chain"\nnum_draft_tokens = 6\n')
    assert SpecSplitConfig.from_file(tmp_path / "c.toml").tree.max_nodes == 6
    (tmp_path / "bad.json").write_text(json.dumps({"tree": {"colour": "red"}}))
    with pytest.raises(ConfigError, match="colour"):
        SpecSplitConfig.from_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="does not exist"):
        SpecSplitConfig.from_file(tmp_path / "missing.json")
    assert SpecSplitConfig.from_dict(cfg.to_dict()) == cfg
