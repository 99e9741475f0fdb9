"""A node learns from its own files: every format on real files written here, splits, agreed class
names, the errors bad data gets, the hooks, the task in the handshake, too few samples for privacy."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.own_data import DataError, load_own_data
from coterie.node.learning.task import describe_task, task_difference
from coterie.node.learning.torch_learner import TorchLearner

CLASSES = ["cat", "dog", "eel"]


def blobs(n: int, seed: int = 0, dim: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Three separable classes: class k's features sit around 4·e_k."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 3
    x = rng.normal(0, 0.5, (n, dim)).astype(np.float32)
    x[np.arange(n), y] += 4.0
    return x, y


def table(x: np.ndarray, labels) -> pa.Table:
    return pa.table({**{f"f{i}": x[:, i] for i in range(x.shape[1])}, "label": list(labels)})


def cfg(path, **kw) -> LearnerConfig:
    base = {"data": str(path), "model": "linear", "lr": 0.2, "local_steps": 40, "device": "cpu"}
    return LearnerConfig(**{**base, **kw})


# ----------------------------------------------------------------------------- npz
def test_npz_split_is_seeded_per_node_and_labels_index_the_agreed_classes(tmp_path):
    x, y = blobs(100)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    a = load_own_data(cfg(tmp_path / "d.npz", classes=CLASSES, data_seed=1, node_index=0))
    again = load_own_data(cfg(tmp_path / "d.npz", classes=CLASSES, data_seed=1, node_index=0))
    other = load_own_data(cfg(tmp_path / "d.npz", classes=CLASSES, data_seed=1, node_index=1))
    assert [len(a.y_train), len(a.y_val), len(a.y_test)] == [60, 20, 20]
    assert np.array_equal(a.x_test, again.x_test) and not np.array_equal(a.x_test, other.x_test)
    # every sample used exactly once across the splits
    rows = {r.tobytes() for s in ("train", "val", "test") for r in getattr(a, f"x_{s}")}
    assert len(rows) == 100
    # integer labels are indices into learner.classes: the feature bump sits at the label
    assert all(int(np.argmax(r)) == k for r, k in zip(a.x_train, a.y_train, strict=True))
    assert a.class_names == CLASSES and a.input_shape == (4,) and a.given_splits == ("train",)


def test_npz_given_splits_are_used_as_they_are(tmp_path):
    x, y = blobs(90)
    np.savez(
        tmp_path / "d.npz",
        x=x[:50],
        y=y[:50],
        x_val=x[50:70],
        y_val=y[50:70],
        x_test=x[70:],
        y_test=np.array(CLASSES)[y[70:]],
    )  # names or indices, split by split
    d = load_own_data(cfg(tmp_path / "d.npz", classes=CLASSES))
    assert np.array_equal(d.x_train, x[:50]) and np.array_equal(d.x_val, x[50:70])
    assert np.array_equal(d.y_test, y[70:]) and d.given_splits == ("train", "val", "test")


def test_npz_object_arrays_are_refused(tmp_path):
    np.savez(tmp_path / "o.npz", x=np.array([[1.0], [2.0, 3.0]], dtype=object), y=np.array([0, 1]))
    with pytest.raises(DataError, match=r"o\.npz: cannot read it as \.npz.*(pickle|Object)"):
        load_own_data(cfg(tmp_path / "o.npz", classes=2))


def test_a_node_learns_from_its_file(tmp_path):
    x, y = blobs(300)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    lrn = TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES))
    before = lrn.evaluate("test").accuracy
    for _ in range(3):
        lrn.train()
    after = lrn.evaluate("test").accuracy
    assert after > 0.9 and after > before
    assert lrn.true_cluster is None and lrn.own_data and lrn.class_names == CLASSES
    assert lrn.data_info()["samples"] == {"train": 180, "val": 60, "test": 60}


# ----------------------------------------------------------------------------- tables
def test_csv_labels_are_names_whatever_a_node_holds(tmp_path):
    x, y = blobs(60)
    only_dogs = y == 1
    pcsv.write_csv(table(x[only_dogs], ["dog"] * int(only_dogs.sum())), tmp_path / "dogs.csv")
    d = load_own_data(cfg(tmp_path / "dogs.csv", classes=CLASSES))
    assert set(d.y_train.tolist()) == {1}  # "dog" is output 1 on every node, held alone or not
    swapped = load_own_data(cfg(tmp_path / "dogs.csv", classes=["dog", "cat", "eel"]))
    assert set(swapped.y_train.tolist()) == {0}


def test_csv_folder_with_split_files_and_another_label_column(tmp_path):
    x, y = blobs(90)
    names = np.array(CLASSES)[y]
    for split, sl in (("train", slice(0, 60)), ("val", slice(60, 75)), ("test", slice(75, 90))):
        t = pa.table({"kind": list(names[sl]), **{f"f{i}": x[sl, i] for i in range(4)}})
        pcsv.write_csv(t, tmp_path / f"pets_{split}.csv")
    d = load_own_data(cfg(tmp_path, classes=CLASSES, data_label="kind"))
    assert [len(d.y_train), len(d.y_val), len(d.y_test)] == [60, 15, 15]
    assert np.allclose(d.x_val, x[60:75]) and np.array_equal(d.y_val, y[60:75])


def test_parquet_without_classes_is_regression(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (200, 2)).astype(np.float32)
    target = 3 * x[:, 0] - x[:, 1]
    pq.write_table(pa.table({"a": x[:, 0], "b": x[:, 1], "label": target}), tmp_path / "r.parquet")
    lrn = TorchLearner(cfg(tmp_path / "r.parquet", lr=0.1, local_steps=200))
    assert lrn.task == "regression" and lrn.class_names is None and lrn.input_shape == (2,)
    assert json.loads(lrn.task_spec()) == {"classes": "regression", "input_shape": [2]}
    lrn.train()
    assert lrn.evaluate("test").loss < 0.05


@pytest.mark.parametrize(
    "body,match",
    [
        ("f0,f1,label\n1,2,cat\n1,nan,dog\n", r"bad\.csv line 3: features hold NaN"),
        ("f0,f1,label\n1,2,cat\n1,2,3,dog\n", r"bad\.csv: cannot read it as csv:.*(columns|Expected)"),
        ("f0,f1,label\n1,x,cat\n1,2,dog\n", r"bad\.csv: feature column 'f1' is not numeric.*line 2"),
        # the bad cell further down a column of numbers written as text: named by its own line
        ("f0,f1,label\n1,2,cat\n1,3,dog\n1,oops,dog\n", r"bad\.csv: feature column 'f1' is not numeric.*line 4"),
        ("f0,f1,label\n1,2,cat\n1,2,cow\n", r"bad\.csv line 3: unknown label 'cow'.*\['cat', 'dog', 'eel'\]"),
        ("f0,f1,kind\n1,2,cat\n", r"bad\.csv: no label column 'label'"),
        ("f0,f1,label\n1,1e999,cat\n", r"bad\.csv line 2: features hold NaN or Inf"),
    ],
)
def test_bad_tables_are_named_by_file_and_line(tmp_path, body, match):
    (tmp_path / "bad.csv").write_text(body)
    with pytest.raises(DataError, match=match):
        load_own_data(cfg(tmp_path / "bad.csv", classes=CLASSES))


def test_truncated_parquet_and_empty_splits_are_clear_errors(tmp_path):
    x, y = blobs(30)
    pq.write_table(table(x, np.array(CLASSES)[y]), tmp_path / "t.parquet")
    raw = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=r"cut\.parquet: cannot read it as parquet"):
        load_own_data(cfg(tmp_path / "cut.parquet", classes=CLASSES))
    pcsv.write_csv(table(x[:2], ["cat", "dog"]), tmp_path / "two.csv")
    with pytest.raises(DataError, match=r"two\.csv: the (val|test) split is empty \(2 samples"):
        load_own_data(cfg(tmp_path / "two.csv", classes=CLASSES, val_fraction=0.2, test_fraction=0.2))
    (tmp_path / "split").mkdir()
    pcsv.write_csv(table(x, np.array(CLASSES)[y]), tmp_path / "split" / "train.csv")
    (tmp_path / "split" / "val.csv").write_text("f0,f1,f2,f3,label\n")
    with pytest.raises(DataError, match=r"val\.csv: no rows"):
        load_own_data(cfg(tmp_path / "split", classes=CLASSES))


# ----------------------------------------------------------------------------- images
def _png(path, value: int, size=(6, 5), mode="L") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, value if mode == "L" else (value, value, value)).save(path)


def test_image_folder_follows_the_agreed_classes_and_resizes(tmp_path):
    root = tmp_path / "imgs"
    for i in range(6):  # eel is the 2nd folder on disk; classes say it is output 2
        _png(root / "eel" / f"{i}.png", 200, size=(12, 10))  # resized to the first image's 6x5
        _png(root / "cat" / f"{i}.png", 20)
    d = load_own_data(cfg(root, classes=CLASSES, val_fraction=0.0, test_fraction=0.5))
    assert d.input_shape == (1, 5, 6)  # C, H, W of the first image (cat/0.png)
    bright = np.concatenate([d.x_train, d.x_test]).mean(axis=(1, 2, 3)) > 0.5
    labels = np.concatenate([d.y_train, d.y_test])
    assert np.array_equal(labels, np.where(bright, 2, 0))
    sized = load_own_data(
        cfg(root, classes=CLASSES, data_params={"image_size": [3, 4, 4]}, val_fraction=0.0, test_fraction=0.5)
    )
    assert sized.input_shape == (3, 4, 4)


def test_image_splits_from_folders_and_image_errors(tmp_path):
    root = tmp_path / "imgs"
    for split in ("train", "val", "test"):
        for k, name in enumerate(("cat", "dog")):
            _png(root / split / name / "a.jpg", 40 * k, mode="RGB")
    d = load_own_data(cfg(root, classes=CLASSES))
    assert d.given_splits == ("train", "val", "test") and d.input_shape == (3, 5, 6)
    assert sorted(d.y_val.tolist()) == [0, 1]
    with pytest.raises(DataError, match="an image folder needs learner.classes"):
        load_own_data(cfg(root))
    _png(root / "train" / "cow" / "x.png", 1)
    with pytest.raises(DataError, match=r"cow/x\.png: unknown label 'cow'"):
        load_own_data(cfg(root, classes=CLASSES))
    (root / "train" / "cow" / "x.png").unlink()
    raw = (root / "train" / "cat" / "a.jpg").read_bytes()
    (root / "train" / "cat" / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n" + raw[:20])
    with pytest.raises(DataError, match=r"cat/b\.png: not a readable image"):
        load_own_data(cfg(root, classes=CLASSES))


# ----------------------------------------------------------------------------- entry points
def install(tmp_path, monkeypatch, module: str, source: str, entry_points: dict[str, dict[str, str]]) -> None:
    """A real installed distribution (module + dist-info with entry_points.txt) on sys.path, found
    by importlib.metadata exactly as a pip-installed package's would be."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "".join(f"[{group}]\n" + "".join(f"{n} = {t}\n" for n, t in eps.items()) for group, eps in entry_points.items())
    )
    monkeypatch.syspath_prepend(str(site))


LOADER = """
    import numpy as np

    def load(path, n=60, seed=0):
        rng = np.random.default_rng(seed)
        y = np.arange(n) % 3
        x = rng.normal(0, 0.5, (n, 4)).astype(np.float32)
        x[np.arange(n), y] += 4.0
        names = np.array(["cat", "dog", "eel"])
        return {"x": x, "y": names[y], "x_test": x[:9], "y_test": y[:9], "path_seen": None} if path == "bad" \\
            else {"x": x, "y": names[y], "x_test": x[:9], "y_test": y[:9]}
"""


def test_a_coterie_datasets_entry_point_loads_the_data(tmp_path, monkeypatch):
    install(tmp_path, monkeypatch, "cot_test_loader", LOADER, {"coterie.datasets": {"blobs": "cot_test_loader:load"}})
    d = load_own_data(LearnerConfig(data_format="blobs", data_params={"n": 90}, classes=CLASSES))
    assert len(d.y_train) + len(d.y_val) == 90 and len(d.y_test) == 9 and d.given_splits == ("train", "test")
    assert all(int(np.argmax(r)) == k for r, k in zip(d.x_train, d.y_train, strict=True))
    with pytest.raises(DataError, match=r"unexpected arrays \['path_seen'\]"):
        load_own_data(LearnerConfig(data="bad", data_format="blobs", classes=CLASSES))
    with pytest.raises(DataError, match="bad data_params"):
        load_own_data(LearnerConfig(data_format="blobs", data_params={"nope": 1}, classes=CLASSES))
    with pytest.raises(DataError, match=r"not a format.*installed: \['blobs'\]"):
        load_own_data(LearnerConfig(data_format="blobz", classes=CLASSES))


HOOKS = """
    import torch
    import torch.nn.functional as F

    calls = {"transform": 0}

    def double_ce(out, y, reduction):
        return 2.0 * F.cross_entropy(out, y, reduction=reduction)

    def zero(x):
        calls["transform"] += 1
        return x * 0.0
"""


def test_loss_and_input_transform_hooks_are_entry_points(tmp_path, monkeypatch):
    install(
        tmp_path,
        monkeypatch,
        "cot_test_hooks",
        HOOKS,
        {
            "coterie.losses": {"double_ce": "cot_test_hooks:double_ce"},
            "coterie.transforms": {"zero": "cot_test_hooks:zero"},
        },
    )
    import cot_test_hooks

    x, y = blobs(120)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    plain = TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES))
    doubled = TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES, loss="double_ce"))
    assert doubled.loss(split="val").loss == pytest.approx(2 * plain.loss(split="val").loss, rel=1e-5)
    zeroed = TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES, input_transform="zero"))
    zeroed.train(5)
    assert cot_test_hooks.calls["transform"] >= 5
    # every input is 0 after the transform: all test samples get the same output
    p = zeroed.get_params()
    out = torch.nn.functional.linear(torch.zeros(1, 4), p["1.weight"], p["1.bias"])
    r = zeroed.evaluate("test")
    expect = float(
        torch.nn.functional.cross_entropy(out.expand(len(zeroed._data["test"][1]), -1), zeroed._data["test"][1])
    )
    assert r.loss == pytest.approx(expect, rel=1e-5)
    g = zeroed.clipped_gradient_sum(None, "train", [0, 1, 2], 1.0)  # the transform runs under vmap too
    assert set(g) == set(p)
    with pytest.raises(ValueError, match=r"learner.loss 'nope'.*coterie.losses.*installed: \['double_ce'\]"):
        TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES, loss="nope"))
    mse = TorchLearner(cfg(tmp_path / "d.npz", classes=CLASSES, loss="mse"))
    assert mse.loss(split="val").loss > 0


# ----------------------------------------------------------------------------- the task
def test_the_task_says_what_differs():
    mine = describe_task((4,), ["0", "1", "2"])
    assert task_difference(mine, mine, "n3") is None
    assert task_difference(mine, "", "n3") is None  # an older peer: checked on its architecture
    why = task_difference(mine, describe_task((4,), ["cat", "dog"]), "n3")
    assert why == "peer 'n3''s task differs from this node's: classes ['cat', 'dog'] vs ['0', '1', '2']"
    why = task_difference(mine, describe_task((1, 2, 2), ["0", "1", "2"]), "n4", "n0")
    assert why == "peer 'n4''s task differs from node 'n0''s: input shape [1, 2, 2] vs [4]"
    assert "regression" in task_difference(mine, describe_task((4,), None), "n5")


def test_a_peer_with_another_task_is_refused_in_the_handshake():
    import random

    from coterie.node.peering.errors import Refusal
    from coterie.node.peering.membership import Settings, full_membership
    from coterie.node.peering.messages import NodeInfo
    from coterie.node.peering.peer_table import PeerTable
    from coterie.node.peering.problems import ProblemLog
    from coterie.node.transport.serde import node_info_from_pb, node_info_to_pb

    me = NodeInfo("n0", 1, "arch", address="a0", task=describe_task((4,), ["0", "1", "2"]))
    m = full_membership(
        lambda: me,
        lambda: (0, 0),
        PeerTable("n0", 1.0, 3.0),
        None,
        ProblemLog(),
        bootstrap=[],
        period=1.0,
        rng=random.Random(0),
        settings=Settings(),
    )
    other = NodeInfo("n3", 1, "arch", address="a3", task=describe_task((4,), ["cat", "dog", "eel"]))
    other = node_info_from_pb(node_info_to_pb(other))  # as it arrives over the wire
    with pytest.raises(
        Refusal,
        match=r"peer 'n3''s task differs from node 'n0''s: classes \['cat', 'dog', 'eel'\] vs \['0', '1', '2'\]",
    ):
        m.on_handshake(other)
    assert "n3" not in m.peers.records
    same = NodeInfo("n4", 1, "arch", address="a4", task=me.task)
    m.on_handshake(same)
    assert "n4" in m.peers.records


def test_builtin_datasets_have_a_task_and_classes_can_name_them():
    base = {
        "dataset": "gaussian",
        "dataset_params": {"num_samples": 200, "num_classes": 3, "dim": 4},
        "partition": "iid",
        "model": "linear",
        "device": "cpu",
    }
    lrn = TorchLearner(LearnerConfig(**base))
    assert json.loads(lrn.task_spec()) == {"classes": ["0", "1", "2"], "input_shape": [4]}
    named = TorchLearner(LearnerConfig(**base, classes=CLASSES))
    assert named.class_names == CLASSES and lrn.true_cluster == 0
    with pytest.raises(ValueError, match="names 2 classes; dataset 'gaussian' has 3"):
        TorchLearner(LearnerConfig(**base, classes=["a", "b"]))
