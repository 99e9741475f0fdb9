"""Node config: precedence and errors that name the field."""

from __future__ import annotations

import pytest

from coterie.node.config import ConfigError, env_overrides, load_config, unknown_env


def test_env_only_maps_config_fields():
    env = {
        "COTERIE_STRATEGY": "dpsgd",
        "COTERIE_LEARNER__LR": "0.1",
        "COTERIE_PEERS": "a:1,b:2",
        "COTERIE_CACHE_DIR": "/tmp/x",
        "COTERIE_CONFIG": "n.toml",
        "OTHER": "1",
    }
    # typed fields stay text here; validation converts them ("0.1" -> 0.1)
    assert env_overrides(env) == {"strategy": "dpsgd", "learner": {"lr": "0.1"}, "peers": ["a:1", "b:2"]}
    assert load_config(environ=env).learner.lr == 0.1


def test_flags_beat_env_beat_file(tmp_path):
    f = tmp_path / "n.toml"
    f.write_text('strategy = "local"\nseed = 3\n[learner]\nlr = 0.5\n')
    cfg = load_config(f, {"seed": 9}, environ={"COTERIE_STRATEGY": "dpsgd", "COTERIE_SEED": "4"})
    assert (cfg.strategy, cfg.seed, cfg.learner.lr) == ("dpsgd", 9, 0.5)


@pytest.mark.parametrize(
    "override, field",
    [
        ({"learner": {"lr": -1}}, "learner.lr"),
        ({"listen": "nohost"}, "listen"),
        ({"chunk_bytes": 64 << 20}, "chunk_bytes"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=override, environ={})


def test_env_nested_delimiter_descends_into_free_form_dicts():
    env = {
        "COTERIE_LEARNER__PARTITION_PARAMS__NUM_CLUSTERS": "2",
        "COTERIE_STRATEGY_PARAMS": '{"M": 3, "eps": 0.5}',
        "COTERIE_LABELS__ZONE": "eu",
        "COTERIE_NODE_ID": "123",
        "COTERIE_PEERS": '["a:1"]',
        "COTERIE_ROUNDS": "5",
    }
    cfg = load_config(environ=env)
    assert cfg.learner.partition_params == {"num_clusters": 2}  # JSON number, not the text "2"
    assert cfg.strategy_params == {"M": 3, "eps": 0.5}
    assert cfg.labels == {"zone": "eu"}  # a str-typed dict keeps text
    assert cfg.node_id == "123" and cfg.peers == ["a:1"] and cfg.rounds == 5


def test_env_bad_json_and_nested_typo_are_config_errors():
    with pytest.raises(ConfigError, match="strategy_params"):
        load_config(environ={"COTERIE_STRATEGY_PARAMS": "{not json"})
    with pytest.raises(ConfigError, match=r"learner\.lrr"):
        load_config(environ={"COTERIE_LEARNER__LRR": "0.1"})


def test_unknown_env_variables_are_named_with_a_suggestion():
    env = {
        "COTERIE_STRATEGIE": "dpsgd",
        "COTERIE_ADMIN": "http://x",
        "COTERIE_CACHE_DIR": "/t",
        "COTERIE_LEARNER__LR": "0.1",
        "COTERIE_ZZZ": "1",
        "PATH": "/bin",
    }
    warnings = unknown_env(env)
    assert len(warnings) == 2
    assert "COTERIE_STRATEGIE" in warnings[0] and "did you mean COTERIE_STRATEGY?" in warnings[0]
    assert "COTERIE_ZZZ" in warnings[1] and "did you mean" not in warnings[1]
    assert load_config(environ=env).strategy == "local"  # ignored, not applied


def test_a_given_environment_replaces_the_process_one(monkeypatch):
    """Pins how node/config.py drives pydantic-settings (its EnvSettingsSource through the public
    constructor and ``env_vars``): a mapping passed in is read instead of os.environ, never merged
    with it, and without one os.environ is read, with the same nesting and case rules."""
    monkeypatch.setenv("COTERIE_STRATEGY", "cobo")
    monkeypatch.setenv("coterie_learner__lr", "0.25")  # case-insensitive, like the rest
    assert env_overrides({}) == {}
    assert env_overrides({"COTERIE_SEED": "4"}) == {"seed": "4"}
    assert env_overrides() == {"strategy": "cobo", "learner": {"lr": "0.25"}}
    cfg = load_config()
    assert (cfg.strategy, cfg.learner.lr) == ("cobo", 0.25)
