"""Extension points (docs/extending.md): strategies from installed packages (``coterie.strategies``
entry points) next to the built-in ones, clear errors for unknown or broken ones, and the worked
example package (examples/coterie-example) installed with pip and trained on a 3-node network.

Entry points here are real: a package's ``*.dist-info/entry_points.txt`` on ``sys.path``, found by
``importlib.metadata`` exactly as for a pip-installed one."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coterie.node.strategies import registry
from coterie.node.strategies.base import Strategy
from coterie.node.strategies.registry import StrategyError, available, get_strategy

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "coterie-example"


def install_fake_dist(where: Path, dist: str, modules: dict[str, str], entry_points: dict[str, dict[str, str]]) -> None:
    """An installed distribution as pip leaves it: modules plus ``<dist>-0.1.dist-info``."""
    for name, src in modules.items():
        (where / f"{name}.py").write_text(textwrap.dedent(src))
    info = where / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in entry_points.items())
    )


PLUGIN = """
from coterie.node.strategies.base import RoundReport, Strategy

class Echo(Strategy):
    name = "echo"
    defaults = {"gain": 1.0}
    async def run_round(self, rnd):
        return RoundReport(train_loss=0.0)
    def weights(self):
        return {self.node_id: 1.0}

def make_echo(node_id, learner, network, params=None, seed=0):
    return Echo(node_id, learner, network, params, seed=seed)

def make_nothing(*a, **kw):
    return "not a strategy"

class NotAStrategy:
    pass

class Half(Strategy):  # forgets weights()
    name = "half"
    async def run_round(self, rnd):
        return RoundReport()
"""


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    install_fake_dist(
        tmp_path,
        "plugin_strats",
        {"plugin_strats": PLUGIN, "broken_strats": "import not_there_at_all\n"},
        {
            "coterie.strategies": {
                "echo": "plugin_strats:Echo",
                "echo-factory": "plugin_strats:make_echo",
                "returns-junk": "plugin_strats:make_nothing",
                "not-strategy": "plugin_strats:NotAStrategy",
                "half": "plugin_strats:Half",
                "broken": "broken_strats:Thing",
                "missing-attr": "plugin_strats:NoSuchThing",
                "local": "plugin_strats:Echo",
            }
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for m in ("plugin_strats", "broken_strats"):
        sys.modules.pop(m, None)


def test_builtins_resolve_to_their_classes():
    for name in registry.builtin():
        cls = get_strategy(name)
        assert isinstance(cls, type) and issubclass(cls, Strategy) and cls.name == name


def test_installed_strategies_are_listed_and_resolve(plugins):
    assert {"echo", "echo-factory", "broken"} <= set(available())
    assert set(registry.builtin()) <= set(available())
    cls = get_strategy("echo")
    assert cls.__module__ == "plugin_strats" and issubclass(cls, Strategy)
    s = cls("n0", learner=None, network=None, params={"gain": 2.0}, seed=1)
    assert s.p == {"gain": 2.0} and s.weights() == {"n0": 1.0}
    made = get_strategy("echo-factory")("n1", None, None, {}, seed=0)
    assert type(made).__name__ == "Echo" and made.node_id == "n1"


def test_a_builtin_name_is_not_taken_over_by_a_plugin(plugins):
    assert get_strategy("local").__module__ == "coterie.node.strategies.baselines"
    assert "local" not in registry.installed()


def test_unknown_name_lists_builtin_and_installed(plugins):
    with pytest.raises(StrategyError) as e:
        get_strategy("nope")
    msg = str(e.value)
    assert "unknown strategy 'nope'" in msg and "fedfomo" in msg and "echo" in msg and "coterie.strategies" in msg


@pytest.mark.parametrize(
    "name, expect",
    [
        ("broken", ["'broken'", "broken_strats:Thing", "failed to load", "ModuleNotFoundError", "not_there_at_all"]),
        ("missing-attr", ["failed to load", "AttributeError", "NoSuchThing"]),
        ("not-strategy", ["NotAStrategy", "not a coterie Strategy subclass"]),
        ("half", ["does not implement", "weights"]),
    ],
)
def test_bad_entry_points_say_what_is_wrong(plugins, name, expect):
    with pytest.raises(StrategyError) as e:
        get_strategy(name)
    for part in expect:
        assert part in str(e.value), (part, str(e.value))
    assert "plugin_strats" in str(e.value)  # names the distribution that ships it


def test_a_factory_that_returns_something_else_is_refused_when_called(plugins):
    factory = get_strategy("returns-junk")
    with pytest.raises(StrategyError, match="returned str, not a coterie Strategy"):
        factory("n0", None, None, {}, seed=0)


def test_one_broken_plugin_does_not_hide_the_others(plugins):
    from coterie.lab.launcher import strategy_problem

    assert strategy_problem("echo") is None and strategy_problem("local") is None
    assert "failed to load" in strategy_problem("broken")


def test_register_in_process(plugins):
    import plugin_strats

    registry.register_strategy("echo-inproc", plugin_strats.Echo)
    try:
        assert get_strategy("echo-inproc") is plugin_strats.Echo and "echo-inproc" in available()
    finally:
        registry._REGISTERED.pop("echo-inproc")
    with pytest.raises(StrategyError, match="built in"):
        registry.register_strategy("fedfomo", plugin_strats.Echo)


@pytest.mark.slow
def test_a_broken_plugin_does_not_stop_coterie_run(tmp_path):
    """The launcher's fork server preloads the built-in strategies only: an installed plugin that
    fails to import cannot take it down, and a network of built-in strategies still runs."""
    site = tmp_path / "site"
    site.mkdir()
    install_fake_dist(
        site,
        "broken_plugin",
        {"broken_strats": "raise RuntimeError('plugin bug')\n"},
        {"coterie.strategies": {"broken": "broken_strats:Thing"}},
    )
    sc = tmp_path / "sc.toml"
    sc.write_text(
        'nodes = 2\nrounds = 1\nstrategy = "local"\n[learner]\ndataset = "gaussian"\n'
        "dataset_params = { num_samples = 400 }\npartition_params = { num_clusters = 2 }\n"
        'model = "linear"\n[node]\nround_interval_s = 0.0\n'
    )
    r = subprocess.run(
        [sys.executable, "-m", "coterie.cli.main", "run", str(sc), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(site),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert json.loads((tmp_path / "o" / "results.json").read_text())["strategies"]["local"]["nodes"]["n1"][
        "rounds"
    ] == [1]


# ------------------------------------------------------------------ the worked example package
def _pip_install(target: Path, workdir: Path) -> None:
    """pip install examples/coterie-example into ``target`` (no index needed when this
    environment's setuptools can build it; otherwise pip fetches a build backend). Built from a
    copy: a build leaves build/ and *.egg-info behind, which do not belong in the checkout."""
    src = workdir / "coterie-example"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(src)]
    try:
        import setuptools
        import wheel  # noqa: F401  (bdist_wheel for setuptools < 70.1)

        can_build = int(setuptools.__version__.split(".")[0]) >= 61
    except ImportError:
        import setuptools

        can_build = tuple(int(p) for p in setuptools.__version__.split(".")[:2]) >= (70, 1)
    if can_build:
        cmd.insert(4, "--no-build-isolation")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    _pip_install(target, tmp_path_factory.mktemp("build"))
    assert (target / "coterie_example").is_dir()
    return target


def _env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COTERIE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def test_example_registers_a_model_a_loader_and_a_strategy(example):
    probe = textwrap.dedent("""
        import json, importlib.metadata as md
        from coterie.node.learning.models import build_model, available_models
        from coterie.node.strategies.registry import get_strategy, installed
        m = build_model("sensor-net", (12,), 4, hidden=16)
        loaders = {ep.name: ep.value for ep in md.entry_points(group="coterie.datasets")}
        print(json.dumps({"models": available_models(), "strategies": installed(),
                          "strategy": get_strategy("simavg").__qualname__, "loaders": loaders,
                          "params": sum(p.numel() for p in m.parameters())}))
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=_env(example))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert "sensor-net" in got["models"]
    assert got["strategies"] == {"simavg": "coterie_example.strategy:SimilarityAveraging"}
    assert got["strategy"] == "SimilarityAveraging"
    assert got["loaders"] == {"sensors": "coterie_example.data:load_sensors"}
    assert got["params"] == 2 * 12 + (12 * 16 + 16) + (16 * 4 + 4)  # LayerNorm, hidden, output


def test_example_loader_keeps_its_contract(example, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(example))
    from coterie_example.data import load_sensors

    spec = json.loads((EXAMPLE / "devices" / "garage.json").read_text())
    a = load_sensors(str(EXAMPLE / "devices" / "garage.json"))
    b = load_sensors(str(EXAMPLE / "devices" / "garage.json"))
    assert set(a) == {"x", "y", "x_val", "y_val", "x_test", "y_test"}
    for k in a:  # deterministic: a restarted node learns from the same samples
        assert (a[k] == b[k]).all()
    assert a["x"].shape == (spec["samples"]["train"], spec["features"]) and a["x"].dtype.name == "float32"
    assert set(a["y"]) <= set(spec["classes"])  # class names, as strings
    assert load_sensors(str(EXAMPLE / "devices" / "garage.json"), samples={"train": 5})["x"].shape == (5, 12)
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        load_sensors(str(tmp_path / "nowhere.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**spec, "colour": "red"}))
    with pytest.raises(ValueError, match=r"bad.json: unknown field\(s\) \['colour'\]"):
        load_sensors(str(bad))


def _results(out: Path, strategy: str) -> dict:
    return json.loads((out / "results.json").read_text())["strategies"][strategy]


def _run(example: Path, scenario: Path, out: Path, *args: str) -> None:
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "coterie.cli.main",
            "run",
            str(scenario),
            "--out",
            str(out),
            "--strategy",
            "simavg",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(example),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.slow
def test_example_model_and_strategy_train_a_3_node_network(example, tmp_path):
    """The example's model and strategy on a built-in dataset in two label-permutation clusters:
    real daemons over mTLS; each node leans on the peer of its own cluster."""
    sc = tmp_path / "sc.toml"
    sc.write_text(
        textwrap.dedent("""
        name = "example-builtin-data"
        nodes = 3
        rounds = 4
        strategy = "simavg"
        timeout_s = 300
        [strategy_params.simavg]
        temperature = 0.1
        [learner]
        dataset = "gaussian"
        dataset_params = { num_samples = 1200, dim = 12 }
        partition = "label_permutation"
        partition_params = { num_clusters = 2 }
        model = "sensor-net"
        model_params = { hidden = 32 }
        optimizer = "adam"
        lr = 0.01
        local_steps = 10
        [node]
        round_interval_s = 0.0
    """)
    )
    out = tmp_path / "out"
    _run(example, sc, out)
    res = _results(out, "simavg")
    for n in ("n0", "n1", "n2"):
        assert res["nodes"][n]["rounds"] == [1, 2, 3, 4]
        assert res["node_configs"][n]["learner"]["model"] == "sensor-net"
    clusters = [res["nodes"][f"n{i}"]["true_cluster"] for i in range(3)]
    assert clusters[0] == clusters[1] != clusters[2]
    w = res["final_weights"]  # row i: node i's weights over n0, n1, n2
    # the other cluster's model is all but ignored; the own cluster's counts (on at least one side:
    # a node's own freshly trained model may still beat a peer's older one on its data)
    assert max(w[0][2], w[1][2], w[2][0], w[2][1]) < 1e-3, w
    assert max(w[0][1], w[1][0]) > 0.1, w
    assert min(res["nodes"][n]["final_test_acc"] for n in ("n0", "n1", "n2")) > 0.8


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("coterie.node.learning.own_data") is None,
    reason="learner.data_format entry points arrive with the own-data work (branch owndata)",
)
def test_example_scenario_all_three_plugins(example, tmp_path):
    """The shipped scenario as a user runs it: each node reads its own device file through the
    example's loader, learns the example's model with the example's strategy."""
    out = tmp_path / "out"
    _run(example, EXAMPLE / "scenario.toml", out, "--rounds", "4")
    res = _results(out, "simavg")
    for i, dev in enumerate(("kitchen", "hallway", "garage")):
        cfg = res["node_configs"][f"n{i}"]["learner"]
        assert cfg["data_format"] == "sensors" and cfg["data"].endswith(f"{dev}.json")
        assert res["nodes"][f"n{i}"]["rounds"] == [1, 2, 3, 4]
    w = res["final_weights"]
    # kitchen and hallway are mounted alike; garage reads the channels permuted
    assert max(w[0][2], w[1][2]) < 0.05 and max(w[0][1], w[1][0]) > 0.1, w
    assert min(res["nodes"][f"n{i}"]["final_test_acc"] for i in (0, 1)) > 0.6
