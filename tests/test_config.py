"""Node config: precedence and errors that name the field."""
from __future__ import annotations

import pytest

from coterie.node.config import ConfigError, env_overrides, load_config


def test_env_only_maps_config_fields():
    env = {"COTERIE_STRATEGY": "dpsgd", "COTERIE_LEARNER__LR": "0.1", "COTERIE_PEERS": "a:1,b:2",
           "COTERIE_CACHE_DIR": "/tmp/x", "COTERIE_CONFIG": "n.toml", "OTHER": "1"}
    assert env_overrides(env) == {"strategy": "dpsgd", "learner": {"lr": 0.1}, "peers": ["a:1", "b:2"]}


def test_flags_beat_env_beat_file(tmp_path):
    f = tmp_path / "n.toml"
    f.write_text('strategy = "local"\nseed = 3\n[learner]\nlr = 0.5\n')
    cfg = load_config(f, {"seed": 9}, environ={"COTERIE_STRATEGY": "dpsgd", "COTERIE_SEED": "4"})
    assert (cfg.strategy, cfg.seed, cfg.learner.lr) == ("dpsgd", 9, 0.5)


@pytest.mark.parametrize("override, field", [({"learner": {"lr": -1}}, "learner.lr"),
                                             ({"listen": "nohost"}, "listen"),
                                             ({"chunk_bytes": 64 << 20}, "chunk_bytes"),
                                             ({"bogus": 1}, "bogus")])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=override, environ={})
