import importlib.metadata
import math
import threading

import numpy as np
import pytest
import torch
from torch import nn

from coterie.node.learning import models
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.learner import Learner
from coterie.node.learning.torch_learner import TorchLearner, build_learner, resolve_device

GAUSS = {"num_samples": 800, "dim": 6, "num_classes": 3, "separation": 2.0}


def cfg(**kw):
    base = dict(
        dataset="gaussian",
        dataset_params=GAUSS,
        partition="iid",
        num_nodes=4,
        node_index=1,
        model="mlp",
        model_params={"hidden": [16]},
        lr=0.1,
        batch_size=16,
        local_steps=10,
        device="cpu",
    )
    base.update(kw)
    return LearnerConfig(**base)


def same(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def perturbed(params, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in params.items()}


def test_is_a_learner_and_device_auto():
    lrn = build_learner(cfg(device="auto"))
    assert isinstance(lrn, Learner) and isinstance(lrn, TorchLearner)
    assert lrn.device == ("cuda:0" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cuda") == "cuda:0" and resolve_device("cpu") == "cpu"
    if not torch.cuda.is_available():
        assert lrn.device == "cpu"
    assert lrn.true_cluster == 0


def test_same_init_on_every_node_and_global_rng_untouched():
    torch.manual_seed(5)
    expected = torch.rand(1)
    torch.manual_seed(5)
    a = build_learner(cfg(node_index=0))
    assert torch.equal(torch.rand(1), expected)
    b = build_learner(cfg(node_index=3, lr=0.01))
    assert same(a.get_params(), b.get_params())
    assert a.fingerprint() == b.fingerprint() and len(a.fingerprint()) == 64
    c = build_learner(cfg(init_seed=1))
    assert not same(a.get_params(), c.get_params()) and a.fingerprint() == c.fingerprint()
    d = build_learner(cfg(model_params={"hidden": [17]}))
    assert d.fingerprint() != a.fingerprint()
    assert a.param_spec()["0.weight" if "0.weight" in a.param_spec() else "1.weight"][1] == "float32"


def test_training_reduces_loss():
    lrn = build_learner(cfg())
    before = lrn.evaluate("train")
    for _ in range(8):
        r = lrn.train()
    assert r.steps == 10 and r.samples == 160
    after = lrn.evaluate("train")
    assert after.loss < 0.7 * before.loss
    assert after.accuracy > before.accuracy and after.accuracy > 0.7
    assert lrn.evaluate("test").n == lrn.num_samples("test") == 40


def test_local_epochs_and_steps_override():
    lrn = build_learner(cfg(local_epochs=2, batch_size=32))
    n = lrn.num_samples("train")
    assert lrn.train().steps == 2 * math.ceil(n / 32)
    assert lrn.train(steps=3).steps == 3
    assert lrn.train(steps=0).steps == 0


def test_mlp_mnist1d_ten_steps():
    """Ten explicit steps on the MNIST-1D MLP take ten minibatches and move every parameter
    (how fast they run is bench/learner_steps.py's question, not a test's)."""
    lrn = build_learner(
        LearnerConfig(
            dataset="mnist1d",
            dataset_params={"num_samples": 200},
            partition="iid",
            num_nodes=2,
            model="mlp",
            device="cpu",
        )
    )
    before = lrn.get_params()
    r = lrn.train(steps=10)
    assert r.steps == 10 and 0 < r.samples <= 10 * lrn.cfg.batch_size and math.isfinite(r.loss)
    after = lrn.get_params()
    assert all(not torch.equal(before[k], after[k]) for k in before)


def test_params_methods_do_not_touch_live_model():
    lrn = build_learner(cfg())
    lrn.train()
    live = lrn.get_params()
    other = perturbed(live)
    other_copy = {k: v.clone() for k, v in other.items()}
    e_other = lrn.evaluate("test", params=other)
    g, _ = lrn.gradient(other)
    lrn.loss(other, max_samples=5)
    lrn.evaluate_mixture([(0.5, other), (0.5, live)])
    assert same(lrn.get_params(), live)
    assert same(other, other_copy)
    assert e_other.loss != lrn.evaluate("test").loss
    lrn.set_params(other)
    assert lrn.evaluate("test").loss == pytest.approx(e_other.loss)
    assert all(p.grad is None for p in lrn.model.parameters())


def test_get_params_is_a_copy():
    lrn = build_learner(cfg())
    p = lrn.get_params()
    for v in p.values():
        v.add_(1.0)
    assert not same(p, lrn.get_params())


def test_gradient_matches_closed_form_for_linear_softmax():
    lrn = build_learner(cfg(model="linear", model_params={}))
    params = perturbed(lrn.get_params(), 0.3)
    g, res = lrn.gradient(params, split="train")
    assert list(g) == list(lrn.get_params())
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in g.values())
    x, y = lrn._data["train"][0].double(), lrn._data["train"][1]
    W, b = params["1.weight"].double(), params["1.bias"].double()
    prob = torch.softmax(x @ W.T + b, 1)
    delta = prob - torch.nn.functional.one_hot(y, 3).double()
    n = len(y)
    torch.testing.assert_close(g["1.weight"].double(), delta.T @ x / n, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(g["1.bias"].double(), delta.sum(0) / n, atol=1e-5, rtol=1e-4)
    nll = -torch.log(prob[torch.arange(n), y]).mean()
    assert res.loss == pytest.approx(float(nll), rel=1e-5) and res.n == n
    gs, rs = lrn.gradient(params, reduction="sum")
    torch.testing.assert_close(gs["1.bias"], g["1.bias"] * n, atol=1e-4, rtol=1e-4)
    assert rs.loss == pytest.approx(res.loss * n, rel=1e-5)


def test_gradient_finite_difference_mlp():
    lrn = build_learner(cfg())
    params = {k: v.double().float() for k, v in lrn.get_params().items()}
    g, _ = lrn.gradient(params, split="val")
    name = "0.bias" if "0.bias" in params else list(params)[1]
    eps = 1e-2
    for i in range(3):
        up = {k: v.clone() for k, v in params.items()}
        dn = {k: v.clone() for k, v in params.items()}
        up[name].view(-1)[i] += eps
        dn[name].view(-1)[i] -= eps
        fd = (lrn.loss(up, split="val").loss - lrn.loss(dn, split="val").loss) / (2 * eps)
        assert fd == pytest.approx(float(g[name].view(-1)[i]), abs=2e-3, rel=5e-2)


def test_apply_gradient_is_an_sgd_step():
    lrn = build_learner(cfg(lr=0.5))
    before = lrn.get_params()
    g = {k: torch.ones_like(v) for k, v in before.items()}
    lrn.apply_gradient(g)
    after = lrn.get_params()
    for k in before:
        torch.testing.assert_close(after[k], before[k] - 0.5)
    with pytest.raises(ValueError):
        lrn.apply_gradient({"nope": torch.zeros(1)})


def test_momentum_and_adam_steps_closed_form():
    sgd = build_learner(cfg(lr=0.1, momentum=0.5))
    p0 = sgd.get_params()
    ones = {k: torch.ones_like(v) for k, v in p0.items()}
    sgd.apply_gradient(ones)
    sgd.apply_gradient(ones)  # buf: 1 then 1.5 -> total step 0.1 * 2.5
    for k in p0:
        torch.testing.assert_close(sgd.get_params()[k], p0[k] - 0.25)
    adam = build_learner(cfg(optimizer="adam", lr=0.01))
    for _ in range(3):  # constant gradient: bias-corrected Adam moves lr * g / (|g| + eps)
        adam.apply_gradient({k: torch.full_like(v, -2.0) for k, v in p0.items()})
    for k in p0:
        torch.testing.assert_close(adam.get_params()[k], p0[k] + 0.03, atol=1e-6, rtol=0)


def test_max_samples_draws_a_minibatch():
    lrn = build_learner(cfg())
    r = lrn.loss(max_samples=7)
    assert r.n == 7
    assert lrn.loss(max_samples=10_000).n == lrn.num_samples("train")
    _, e = lrn.gradient(max_samples=9)
    assert e.n == 9


def test_mixture_averages_probabilities():
    lrn = build_learner(cfg())
    a = lrn.get_params()
    b = perturbed(a, 1.0)
    single = lrn.evaluate_mixture([(3.0, a)])
    ev = lrn.evaluate("test", params=a)
    assert single.loss == pytest.approx(ev.loss, rel=1e-5) and single.accuracy == ev.accuracy
    mix = lrn.evaluate_mixture([(0.25, a), (0.75, b)])
    x, y = lrn._data["test"]
    with torch.no_grad():
        pa = torch.func.functional_call(lrn._shadow, a, (x,)).softmax(1)
        pb = torch.func.functional_call(lrn._shadow, b, (x,)).softmax(1)
    p = 0.25 * pa + 0.75 * pb
    assert mix.loss == pytest.approx(float(-p[torch.arange(len(y)), y].log().mean()), rel=1e-5)
    assert mix.accuracy == pytest.approx(float((p.argmax(1) == y).float().mean()))
    with pytest.raises(ValueError):
        lrn.evaluate_mixture([(0.0, a)])


def test_regression_sine_linear():
    c = LearnerConfig(
        dataset="sine", partition="sine_intervals", num_nodes=4, node_index=3, model="linear", lr=0.05, device="cpu"
    )
    lrn = build_learner(c)
    assert lrn.true_cluster == 3
    before = lrn.evaluate("test")
    lrn.train(steps=300)
    after = lrn.evaluate("test")
    assert before.accuracy is None and after.accuracy is None
    assert after.loss < 0.5 * before.loss and after.loss < 0.05
    x, y = lrn._data["test"]
    with torch.no_grad():
        pred = lrn.model(x).reshape(-1)
    assert after.loss == pytest.approx(float(((pred - y) ** 2).mean()), rel=1e-5)
    mix = lrn.evaluate_mixture([(1.0, lrn.get_params()), (1.0, lrn.get_params())])
    assert mix.accuracy is None and mix.loss == pytest.approx(after.loss, rel=1e-5)


def test_label_permutation_node_trains_on_its_own_labels():
    c = LearnerConfig(
        dataset="digits",
        partition="label_permutation",
        partition_params={"num_clusters": 2},
        num_nodes=4,
        node_index=3,
        model="mlp",
        device="cpu",
    )
    lrn = build_learner(c)
    assert lrn.true_cluster == 1 and lrn.shard.label_map is not None
    from coterie.node.learning.datasets import load_pool

    pool = load_pool("digits", {}, 0)
    raw = torch.as_tensor(pool.y[lrn.shard.test])
    assert torch.equal(lrn._data["test"][1], torch.as_tensor(lrn.shard.label_map)[raw])


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_export_import_resumes_exactly(opt):
    c = cfg(optimizer=opt, momentum=0.9 if opt == "sgd" else 0.0, lr=0.02)
    a = build_learner(c)
    a.train(steps=7)
    tensors, meta = a.export_state()
    a.train(steps=1)  # the export is a copy: later training does not reach into it
    a.import_state(tensors, meta)
    b = build_learner(c)
    assert not same(a.get_params(), b.get_params())
    b.import_state(*a.export_state())
    assert same(a.get_params(), b.get_params())
    a.train(steps=5)
    b.train(steps=5)  # same momentum / Adam moments and the same minibatches
    assert same(a.get_params(), b.get_params())


def test_import_rejects_what_does_not_fit_and_leaves_the_model_alone():
    lrn = build_learner(cfg(momentum=0.5))
    lrn.train(steps=2)
    before = lrn.get_params()
    other = build_learner(cfg(model_params={"hidden": [8]}))
    with pytest.raises(ValueError, match="saved parameters"):
        lrn.import_state(*other.export_state())
    tensors, meta = build_learner(cfg(momentum=0.5)).export_state()
    with pytest.raises(ValueError, match="optimizer"):
        build_learner(cfg(optimizer="adam")).import_state(tensors, meta)
    tensors["sampler/perm"] = torch.arange(10**6)
    with pytest.raises(ValueError, match="sampler"):
        lrn.import_state(tensors, meta)
    del meta["eval_rng"]
    with pytest.raises(ValueError, match="eval_rng"):
        lrn.import_state(tensors, meta)
    assert same(lrn.get_params(), before)


def test_eval_from_another_thread_while_training():
    lrn = build_learner(cfg())
    theta = lrn.get_params()
    ref = lrn.evaluate("val", params=theta).loss
    results, stop = [], threading.Event()

    def evaluator():
        while not stop.is_set() or not results:
            results.append(lrn.evaluate("val", params=theta).loss)

    t = threading.Thread(target=evaluator)
    t.start()
    for _ in range(10):
        lrn.train()
    stop.set()
    t.join()
    assert results and all(r == ref for r in results)


# ---------------------------------------------------------------------------- models


def test_stock_models_shapes_and_no_batchnorm():
    for shape, conv in [((40,), nn.Conv1d), ((1, 8, 8), nn.Conv2d), ((3, 32, 32), nn.Conv2d)]:
        for name, kw in [("cnn", {"norm": "group"}), ("cnn2", {"channels": 16}), ("cnn", {})]:
            m = models.build_model(name, shape, 10, **kw)
            assert any(isinstance(x, conv) for x in m.modules())
            assert not any(isinstance(x, nn.modules.batchnorm._BatchNorm) for x in m.modules())
            assert m(torch.zeros(2, *shape)).shape == (2, 10)
        assert models.build_model("cnn", shape, 10, norm="group") is not None
    gn = models.build_model("cnn", (1, 8, 8), 10, norm="group")
    assert sum(isinstance(x, nn.GroupNorm) for x in gn.modules()) == 2
    c2 = models.build_model("cnn2", (3, 32, 32), 10)
    assert (
        sum(isinstance(x, nn.Conv2d) and x.out_channels == 128 and x.kernel_size == (3, 3) for x in c2.modules()) == 3
    )
    assert sum(isinstance(x, nn.Linear) for x in c2.modules()) == 1
    assert models.build_model("linear", (1,), 0)(torch.zeros(5, 1)).shape == (5, 1)
    assert models.build_model("mlp", (40,), 10, hidden=[8, 4])(torch.zeros(3, 40)).shape == (3, 10)


def test_unknown_model_lists_available():
    with pytest.raises(ValueError, match="cnn2.*linear.*mlp"):
        models.build_model("resnet9000", (40,), 10)
    with pytest.raises(ValueError):
        models.build_model("cnn", (40,), 10, norm="batch")


def test_batchnorm_model_rejected():
    models.register_model("bn_test", lambda s, c: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(40)))
    with pytest.raises(ValueError, match="BatchNorm"):
        models.build_model("bn_test", (40,), 10)


def test_entry_point_model(monkeypatch):
    ep = importlib.metadata.EntryPoint(
        name="my_linear", group="coterie.models", value="coterie.node.learning.models:linear"
    )
    real = importlib.metadata.entry_points

    def fake(**kw):
        return [ep] if kw.get("group") == "coterie.models" else real(**kw)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    assert "my_linear" in models.available_models()
    lrn = build_learner(cfg(model="my_linear", model_params={}))
    assert lrn.param_spec()["1.weight"] == ((3, 6), "float32")
    assert lrn.fingerprint() != build_learner(cfg(model="linear", model_params={})).fingerprint()


def test_gradient_on_empty_split_raises():
    lrn = build_learner(cfg(val_fraction=0.0))
    assert lrn.num_samples("val") == 0 and math.isnan(lrn.evaluate("val").loss)
    with pytest.raises(ValueError, match="empty"):
        lrn.gradient(split="val")
    assert np.isfinite(lrn.evaluate("test").loss)


def test_export_into_reused_buffers_copies_the_current_state():
    lrn = build_learner(cfg(optimizer="adam"))
    lrn.train(steps=3)
    first, _ = lrn.export_state()
    lrn.train(steps=3)
    again, meta = lrn.export_state(reuse=first)
    fresh, _ = lrn.export_state()
    assert again.keys() == fresh.keys() and all(torch.equal(again[k], fresh[k]) for k in fresh)
    assert all(again[k].data_ptr() == first[k].data_ptr() for k in first if k.startswith(("model/", "optim/")))
    lrn.train(steps=1)  # the export stays a copy
    assert all(torch.equal(again[k], fresh[k]) for k in fresh)
