import os

import numpy as np
import pytest

from coterie.node.learning.datasets import dataset_num_classes, load_pool


def _write_cifar10(root, per_file=3):
    d = root / "cifar-10-batches-bin"
    d.mkdir()
    rng = np.random.default_rng(0)
    labels, images = [], []
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        lab = rng.integers(0, 10, per_file, dtype=np.uint8)
        img = rng.integers(0, 256, (per_file, 3072), dtype=np.uint8)
        (d / name).write_bytes(np.concatenate([lab[:, None], img], axis=1).tobytes())
        labels.append(lab)
        images.append(img)
    return d, np.concatenate(labels), np.concatenate(images)


def _write_cifar100(root, n=4):
    d = root / "cifar-100-binary"
    d.mkdir()
    rng = np.random.default_rng(1)
    out = {}
    for name in ["train.bin", "test.bin"]:
        coarse = rng.integers(0, 20, n, dtype=np.uint8)
        fine = rng.integers(0, 100, n, dtype=np.uint8)
        img = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        (d / name).write_bytes(np.concatenate([coarse[:, None], fine[:, None], img], 1).tobytes())
        out[name] = (coarse, fine, img)
    return d, out


def test_mnist1d_procedural_deterministic_and_seeded():
    a = load_pool("mnist1d", {"num_samples": 300}, seed=3)
    b = load_pool("mnist1d", {"num_samples": 300}, seed=3)
    c = load_pool("mnist1d", {"num_samples": 300}, seed=4)
    assert a.x.shape == (300, 40) and a.x.dtype == np.float32 and a.y.dtype == np.int64
    assert a.input_shape == (40,) and a.num_classes == 10 and a.task == "classification"
    assert set(a.y.tolist()) == set(range(10))
    np.testing.assert_array_equal(a.x, b.x)
    assert not np.array_equal(a.x, c.x)
    with pytest.raises(ValueError):  # the cached pool is read-only
        a.x[0, 0] = 1.0


def test_mnist1d_leaves_global_rng_alone():
    np.random.seed(123)
    expected = np.random.rand()
    np.random.seed(123)
    load_pool("mnist1d", {"num_samples": 200}, seed=9)
    assert np.random.rand() == expected


def test_digits():
    p = load_pool("digits", {}, 0)
    assert p.x.shape == (1797, 1, 8, 8) and p.input_shape == (1, 8, 8)
    assert p.x.min() == 0.0 and p.x.max() == 1.0
    assert p.num_classes == 10 == dataset_num_classes("digits")


def test_sine_regression():
    p = load_pool("sine", {"num_samples": 500, "x_range": [-1, 3], "noise": 0.0}, 0)
    assert p.task == "regression" and p.num_classes == 0 and p.y.dtype == np.float32
    assert p.x.shape == (500, 1) and -1 <= p.x.min() and p.x.max() <= 3
    np.testing.assert_allclose(p.y, np.sin(p.x[:, 0]), atol=1e-6)
    noisy = load_pool("sine", {"num_samples": 500, "x_range": [-1, 3], "noise": 0.3}, 0)
    assert 0.2 < np.std(noisy.y - np.sin(noisy.x[:, 0])) < 0.4


def test_gaussian_params_and_separability():
    p = load_pool("gaussian", {"num_samples": 600, "dim": 5, "num_classes": 3, "separation": 10.0}, 0)
    assert p.x.shape == (600, 5) and p.num_classes == 3
    assert np.bincount(p.y).tolist() == [200, 200, 200]
    means = np.stack([p.x[p.y == c].mean(0) for c in range(3)])
    nearest = np.argmin(((p.x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (nearest == p.y).mean() > 0.95


def test_unknown_dataset_and_params():
    with pytest.raises(ValueError, match="available"):
        load_pool("imagenet", {}, 0)
    with pytest.raises(ValueError, match="num_sample"):
        load_pool("sine", {"num_sample": 10}, 0)


def test_cifar10_binary_fixture(tmp_path):
    _, labels, images = _write_cifar10(tmp_path)
    for data_dir in (tmp_path, tmp_path / "cifar-10-batches-bin"):
        p = load_pool("cifar10", {"data_dir": str(data_dir)}, 0)
        assert p.x.shape == (18, 3, 32, 32) and p.x.dtype == np.float32
        assert p.num_classes == 10 and p.input_shape == (3, 32, 32)
        np.testing.assert_array_equal(p.y, labels)
        np.testing.assert_allclose(p.x.reshape(18, -1) * 255.0, images, atol=1e-3)
    assert len(load_pool("cifar10", {"data_dir": str(tmp_path), "max_samples": 5}, 0)) == 5


def test_cifar100_fine_and_coarse(tmp_path):
    _, out = _write_cifar100(tmp_path)
    fine = load_pool("cifar100", {"data_dir": str(tmp_path)}, 0)
    coarse = load_pool("cifar100", {"data_dir": str(tmp_path), "label": "coarse"}, 0)
    assert fine.num_classes == 100 and coarse.num_classes == 20
    np.testing.assert_array_equal(fine.y, np.concatenate([out["train.bin"][1], out["test.bin"][1]]))
    np.testing.assert_array_equal(coarse.y, np.concatenate([out["train.bin"][0], out["test.bin"][0]]))
    np.testing.assert_allclose(fine.x[0].reshape(-1) * 255, out["train.bin"][2][0], atol=1e-3)


def test_cifar_missing_file_is_named(tmp_path):
    d, _, _ = _write_cifar10(tmp_path)
    (d / "data_batch_3.bin").unlink()
    with pytest.raises(FileNotFoundError, match="data_batch_3.bin"):
        load_pool("cifar10", {"data_dir": str(tmp_path)}, 0)
    with pytest.raises(FileNotFoundError, match="train.bin"):
        load_pool("cifar100", {"data_dir": str(tmp_path / "nowhere")}, 0)
    with pytest.raises(ValueError, match="data_dir"):
        load_pool("cifar10", {}, 0)


def test_cifar_truncated_file_rejected(tmp_path):
    d, _, _ = _write_cifar10(tmp_path)
    path = d / "test_batch.bin"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(ValueError, match="test_batch.bin"):
        load_pool("cifar10", {"data_dir": str(tmp_path)}, 0)


def test_no_pickle_in_loader():
    import inspect

    from coterie.node.learning import datasets

    src = inspect.getsource(datasets)
    assert "import pickle" not in src and "pickle.load" not in src and "allow_pickle=True" not in src
    assert "get_dataset(" not in src


def test_disk_cache_returns_the_generated_pool_memory_mapped(tmp_path, monkeypatch):
    from coterie.node.learning import datasets as ds

    monkeypatch.setenv("COTERIE_CACHE_DIR", str(tmp_path))
    fresh = ds._mnist1d({"num_samples": 300}, 5)
    first = ds._disk_cached("mnist1d", '{"num_samples": 300}', 5, lambda: fresh)
    assert len(list(tmp_path.glob("pool-mnist1d-*.json"))) == 1
    again = ds._disk_cached(
        "mnist1d", '{"num_samples": 300}', 5, lambda: (_ for _ in ()).throw(AssertionError("regenerated"))
    )
    # one copy per machine: the arrays are read-only maps of the cache files, not private copies
    assert isinstance(again.x, np.memmap) and isinstance(again.y, np.memmap) and not again.x.flags.writeable
    assert np.array_equal(again.x, first.x) and np.array_equal(again.y, first.y) and np.array_equal(again.x, fresh.x)
    assert again.input_shape == fresh.input_shape == (40,) and again.num_classes == 10
    next(tmp_path.glob("pool-*.x.npy")).write_bytes(b"torn")  # unreadable cache: regenerate, no crash
    assert np.array_equal(ds._disk_cached("mnist1d", '{"num_samples": 300}', 5, lambda: fresh).x, fresh.x)
    assert np.array_equal(ds._disk_cached("mnist1d", '{"num_samples": 300}', 5, lambda: 1 / 0).x, fresh.x)


def test_regression_pool_round_trips_the_cache(tmp_path, monkeypatch):
    from coterie.node.learning import datasets as ds

    monkeypatch.setenv("COTERIE_CACHE_DIR", str(tmp_path))
    fresh = ds._sine({"num_samples": 50, "x_range": [0, 2]}, 1)
    ds._disk_cached("sine", "k", 1, lambda: fresh)
    again = ds._disk_cached("sine", "k", 1, lambda: 1 / 0)
    assert again.task == "regression" and again.num_classes == 0 and again.meta == {"x_range": (0.0, 2.0)}
    assert again.y.dtype == np.float32 and np.array_equal(again.y, fresh.y)


def test_a_node_imports_no_generator_even_when_it_generates(tmp_path):
    """Generating needs mnist1d (which imports matplotlib, scipy, PIL, requests: ~74 MB resident)
    or scikit-learn; a daemon imports none of them, neither when its pool is in the machine's
    cache nor when it is not (a child process generates and caches it), and gets the same pool
    as one generated in-process."""
    import subprocess
    import sys

    code = (
        "import sys, hashlib; from coterie.node.learning.datasets import load_pool; "
        "pools = [load_pool(n, p, 3) for n, p in (('mnist1d', {'num_samples': 200}), ('digits', {}))]; "
        "print(sorted(m for m in ('mnist1d', 'matplotlib', 'scipy', 'sklearn') if m in sys.modules)); "
        "print([hashlib.sha256(p.x.tobytes() + p.y.tobytes()).hexdigest() for p in pools])"
    )

    def run(cache: str) -> list[str]:
        env = {**os.environ, "COTERIE_CACHE_DIR": cache}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.splitlines()

    in_process = run("off")  # no cache: generated here, the libraries loaded
    assert "mnist1d" in in_process[0] and "sklearn" in in_process[0]
    first, second = run(str(tmp_path)), run(str(tmp_path))
    assert first[0] == "[]", first  # the first load generated in a child
    assert second[0] == "[]", second  # the second read the cache
    assert first[1] == second[1] == in_process[1]  # the same pool, bit for bit


def test_a_failed_child_generation_falls_back_in_process(tmp_path, monkeypatch):
    """An unwritable cache (the child cannot store) or bad params still give the pool or the
    generator's own error, from this process."""
    from coterie.node.learning import datasets as ds

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("COTERIE_CACHE_DIR", str(ro))
    try:
        if os.access(ro, os.W_OK):  # root ignores the mode: no unwritable cache to test with
            monkeypatch.setenv("COTERIE_CACHE_DIR", str(tmp_path / "file"))
            (tmp_path / "file").write_text("not a directory")
        assert not ds._generate_in_child("mnist1d", '{"num_samples": 200}', 4)
        pool = ds._disk_cached("mnist1d", '{"num_samples": 200}', 4, lambda: ds._mnist1d({"num_samples": 200}, 4))
        assert len(pool) == 200
    finally:
        ro.chmod(0o700)
    monkeypatch.setenv("COTERIE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="unknown dataset_params"):
        load_pool("mnist1d", {"num_sampels": 200}, 4)


def test_partition_is_computed_once_per_process_and_shared_read_only():
    """The nodes of one process share one partition (computing it per node is O(N²) at 1,000
    nodes); its index arrays are read-only, and each node still copies only its own samples."""
    from coterie.node.learning.config import LearnerConfig
    from coterie.node.learning.partition import node_data, partition, shared_partition

    pool = load_pool("gaussian", {"num_samples": 400}, 2)
    cfg = LearnerConfig(
        dataset="gaussian", dataset_params={"num_samples": 400}, partition="iid", num_nodes=4, data_seed=2
    )
    first = shared_partition(pool, cfg)
    assert shared_partition(pool, cfg.model_copy(update={"node_index": 3})) is first
    assert shared_partition(pool, cfg.model_copy(update={"data_seed": 3})) is not first
    fresh = partition(pool, cfg)
    assert all(
        np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test) for a, b in zip(first, fresh, strict=True)
    )
    assert not first[0].train.flags.writeable
    with pytest.raises(ValueError):
        first[0].train[0] = 7
    d = node_data(pool, cfg.model_copy(update={"node_index": 1}))
    assert d.x_train.base is None or not np.shares_memory(d.x_train, pool.x)  # its own copy of its rows
    assert len(d.x_train) == len(first[1].train)
