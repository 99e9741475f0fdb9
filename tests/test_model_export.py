"""The personalised model out: `coterie model export` from a (running) node's state dir,
`coterie.load_model`, `coterie predict`, GET /model, ONNX. The exported model of round r must
give, on the node's own test split, the accuracy the node reported for round r."""

from __future__ import annotations

import asyncio
import csv
import io
import json

import httpx
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import coterie
from coterie.cli.main import app
from coterie.node.admin_token import bearer, token_for_state_dir
from coterie.node.config import validate_config
from coterie.node.daemon import Node
from coterie.node.learning.config import LearnerConfig
from coterie.node.learning.torch_learner import build_learner
from coterie.node.modelfile import FORMAT, export_state_dir, load_model, sidecar_path
from coterie.node.transport.inproc import InProcNetwork
from tests.nodeproc import tiny_learner

runner = CliRunner()
ROUNDS = 3


def _config(tmp, i, n, peers, **extra):
    return validate_config(
        {
            "node_id": f"n{i}",
            "state_dir": str(tmp / f"n{i}"),
            "strategy": "fedfomo",
            "peers": peers,
            "heartbeat_interval_s": 0.2,
            "request_timeout_s": 10,
            "rounds": ROUNDS,
            "min_peers": n - 1,
            "round_interval_s": 0.0,
            "admin_listen": "127.0.0.1:0",
            "learner": tiny_learner(n, i, clusters=2, samples=200),
            **extra,
        }
    )


async def _until(cond, what, timeout=120.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _cli(*args: str):
    return runner.invoke(app, list(args))


@pytest.mark.slow
async def test_exported_model_reproduces_the_reported_accuracy(tmp_path):
    """Three FedFomo nodes in one process (in-process transport); node 0 also serves its admin API.
    While they run, its model is exported from the state dir (no lock taken) and over GET /model:
    loaded back, it scores node 0's test split exactly as node 0 reported for that round."""
    hub = InProcNetwork()
    nodes = []
    try:
        for i in range(3):
            cfg = _config(tmp_path, i, 3, [nodes[0].address] if nodes else [])
            node = Node(cfg, transport=hub.transport_for(cfg), admin=(i == 0))
            await node.start()
            nodes.append(node)
        n0 = nodes[0]
        await _until(lambda: all(n.done for n in nodes), "every node to finish its rounds")
        reported = n0.history[-1]
        assert reported["round"] == ROUNDS and n0.status()["round"] == ROUNDS

        out = tmp_path / "out" / "n0.safetensors"
        r = await asyncio.to_thread(_cli, "model", "export", "--state-dir", str(n0.store.dir), "--out", str(out))
        assert r.exit_code == 0, r.output
        assert f"round {ROUNDS}" in r.stdout
        card = json.loads(sidecar_path(out).read_text())
        assert card["format"] == FORMAT and card["node_id"] == "n0" and card["round"] == ROUNDS
        assert card["architecture"] == "mlp" and card["input_shape"] == list(n0.learner.input_shape)
        assert card["class_names"] == n0.learner.class_names and card["task"] == "classification"
        assert card["weights"] == n0.saved["weights"] and card["strategy"] == "fedfomo"
        assert card["eval"] == reported["eval"] and card["learner"]["node_index"] == 0
        assert card["version"] == n0.saved["version"] and card["exported_at"] > 0

        model, class_names = coterie.load_model(out)  # the package's own entry point
        assert not model.training and class_names == n0.learner.class_names
        # the card's learner config rebuilds the node's data: the same test split
        rebuilt = build_learner(LearnerConfig(**card["learner"]))
        x, y = rebuilt._data["test"]
        assert torch.equal(x, n0.learner._data["test"][0]) and torch.equal(y, n0.learner._data["test"][1])
        acc = _accuracy(model, x, y)
        assert acc == pytest.approx(reported["eval"]["test_acc"], abs=1e-3)
        assert acc == pytest.approx(n0.status()["last_eval"]["test_acc"], abs=1e-3)
        # personalised: each state dir exports its own node's model, not a shared one (after 3
        # rounds both are near chance on 40 samples, so their accuracies do not order reliably)
        other = await asyncio.to_thread(export_state_dir, nodes[1].store.dir)
        (tmp_path / "n1.safetensors").write_bytes(other[0])
        theirs, mine = load_model(tmp_path / "n1.safetensors").model.state_dict(), model.state_dict()
        # (either may be a blend with its twin, reference.predict: a mixture module, other tensor names)
        assert other[1]["node_id"] == "n1"
        assert set(mine) != set(theirs) or any(not torch.equal(mine[k], theirs[k]) for k in mine)

        # the running node serves the same model at GET /model behind its token
        token = token_for_state_dir(n0.store.dir)
        async with httpx.AsyncClient(base_url=n0.admin_url) as c:
            assert (await c.get("/model")).status_code == 401
            got = await c.get("/model", headers=bearer(token))
            assert got.status_code == 200 and got.headers["X-Coterie-Round"] == str(ROUNDS)
            assert got.headers["Content-Disposition"] == f'attachment; filename="n0-round{ROUNDS}.safetensors"'
            served_card = (await c.get("/model.json", headers=bearer(token))).json()
        served = tmp_path / "served.safetensors"
        served.write_bytes(got.content)
        loaded = load_model(served)  # no sidecar beside it: the card inside the file is enough
        assert loaded.card["round"] == ROUNDS and served_card["round"] == ROUNDS
        for (na, pa), (nb, pb) in zip(model.named_parameters(), loaded.model.named_parameters(), strict=True):
            assert na == nb and torch.equal(pa, pb)

        # predict: CSV on stdout, one row per input, the predicted class name last
        npz = tmp_path / "test.npz"
        np.savez(npz, x=x.numpy(), y=y.numpy())
        r = await asyncio.to_thread(_cli, "predict", "--model", str(out), str(npz))
        assert r.exit_code == 0, r.output
        rows = list(csv.reader(io.StringIO(r.stdout)))
        assert rows[0] == ["index", *(f"score_{c}" for c in class_names), "predicted"]
        assert len(rows) == len(y) + 1
        predicted = [row[-1] for row in rows[1:]]
        assert np.mean([p == class_names[int(t)] for p, t in zip(predicted, y, strict=True)]) == pytest.approx(acc)
        assert all(abs(sum(float(v) for v in row[1:-1]) - 1) < 1e-4 for row in rows[1:])
    finally:
        for n in nodes:
            await n.stop()


def _solo(tmp_path, **extra):
    learner = {
        "dataset": "digits",
        "partition": "iid",
        "num_nodes": 1,
        "model": "cnn",
        "model_params": {"channels": [4, 8], "fc": 16},
        "local_steps": 2,
    }
    learner.update(extra.pop("learner", {}))
    return validate_config(
        {
            "node_id": "solo",
            "security": {"insecure": True},
            "state_dir": str(tmp_path / "solo"),
            "strategy": "local",
            "min_peers": 0,
            "round_interval_s": 0.0,
            "listen": "127.0.0.1:0",
            "admin_listen": "127.0.0.1:0",
            "learner": learner,
            **extra,
        }
    )


async def test_export_while_the_node_checkpoints_every_round(tmp_path):
    """A node committing checkpoints flat out (each replaces the last): exports taken meanwhile all
    succeed, each a whole round, in order."""
    node = Node(_solo(tmp_path, rounds=None), admin=False)
    await node.start()
    try:
        await _until(lambda: node.saved["round"] >= 2, "a few rounds")
        rounds = []
        x, y = node.learner._data["test"]
        for k in range(25):
            data, card = await asyncio.to_thread(export_state_dir, node.store.dir)
            rounds.append(card["round"])
            if card["round"] > 0:  # each mid-run export is its round's model: the accuracy reported then
                (tmp_path / f"{k}.safetensors").write_bytes(data)
                acc = _accuracy(load_model(tmp_path / f"{k}.safetensors").model, x, y)
                assert acc == pytest.approx(card["eval"]["test_acc"], abs=1e-3), card["round"]
        assert rounds == sorted(rounds) and rounds[-1] > rounds[0]  # the node went on meanwhile
    finally:
        await node.stop()


async def test_predict_inputs_onnx_and_bad_files(tmp_path):
    """A CNN on 8x8 digits: predict from an image folder, a CSV with a label column (ignored), an
    ONNX export run by onnxruntime against torch; bad inputs named."""
    node = Node(_solo(tmp_path, rounds=2), admin=False)
    await node.start()
    try:
        await _until(lambda: node.done, "two rounds")
    finally:
        assert await node.stop()
    out = tmp_path / "m.safetensors"
    r = _cli("model", "export", "--state-dir", str(node.store.dir), "--out", str(out))
    assert r.exit_code == 0, r.output
    m = load_model(out)
    assert m.input_shape == (1, 8, 8) and len(m.class_names) == 10
    x, y = node.learner._data["test"]
    x = x[:12]

    # an image folder: 8x8 grey PNGs of the same numbers (0..1 -> 0..255), named in the output
    from PIL import Image

    imgs = tmp_path / "imgs" / "sub"
    imgs.mkdir(parents=True)
    for i in range(len(x)):
        Image.fromarray(np.round(x[i, 0].numpy() * 255).astype(np.uint8), mode="L").save(imgs / f"{i:02d}.png")
    (imgs / "notes.txt").write_text("not an image: skipped")
    r = _cli("predict", "--model", str(out), str(tmp_path / "imgs"))
    assert r.exit_code == 0, r.output
    rows = list(csv.reader(io.StringIO(r.stdout)))
    assert rows[0][0] == "file" and [row[0] for row in rows[1:]] == [f"sub/{i:02d}.png" for i in range(len(x))]
    with torch.no_grad():
        want = [m.class_names[int(k)] for k in m.model(x).argmax(1)]
    assert [row[-1] for row in rows[1:]] == want  # 8-bit rounding does not change these answers
    r = _cli("predict", "--model", str(out), str(imgs / "03.png"))  # one image file
    assert r.exit_code == 0, r.output
    assert list(csv.reader(io.StringIO(r.stdout)))[1:] == [["03.png", *rows[4][1:]]]

    # a CSV of flat feature columns plus a label column, which is ignored
    table = tmp_path / "t.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(64)] + ["label"])
        for i in range(len(x)):
            w.writerow([*(f"{v:.8f}" for v in x[i].reshape(-1).tolist()), "cat"])
    r = _cli("predict", "--model", str(out), str(table))
    assert r.exit_code == 0, r.output
    assert [row[-1] for row in csv.reader(io.StringIO(r.stdout))][1:] == want

    # bad inputs: one line naming the file and what is wrong
    with open(table, "a") as f:
        f.write(",".join(["0.5"] * 10 + ["oops"] + ["0"] * 53) + ",cat\n")
    r = _cli("predict", "--model", str(out), str(table))
    assert r.exit_code == 2 and f"line {len(x) + 2}" in r.stderr and "'f10'" in r.stderr
    np.savez(tmp_path / "bad.npz", x=np.zeros((3, 7), dtype=np.float32))
    r = _cli("predict", "--model", str(out), str(tmp_path / "bad.npz"))
    assert r.exit_code == 2 and "[7]" in r.stderr and "[1, 8, 8]" in r.stderr
    np.savez(tmp_path / "nox.npz", features=np.zeros((3, 64)))
    r = _cli("predict", "--model", str(out), str(tmp_path / "nox.npz"))
    assert r.exit_code == 2 and "no array 'x'" in r.stderr and "features" in r.stderr
    assert "Traceback" not in r.output

    # a sidecar from another export, and a file that is no export at all
    other = tmp_path / "other.safetensors"
    other.write_bytes(out.read_bytes())
    sidecar_path(other).write_text(json.dumps({"file_sha256": "0" * 64}))
    with pytest.raises(ValueError, match="different exports"):
        load_model(other)
    sidecar_path(other).unlink()
    other.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="not a coterie model export"):
        load_model(other)
    r = _cli("model", "export", "--state-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"))
    assert r.exit_code == 1 and "does not exist" in r.stderr

    # ONNX: the same answers from onnxruntime
    ort = pytest.importorskip("onnxruntime")
    onnx_out = tmp_path / "m.onnx"
    r = _cli("model", "export", "--state-dir", str(node.store.dir), "--out", str(onnx_out), "--format", "onnx")
    assert r.exit_code == 0, r.output
    card = json.loads(sidecar_path(onnx_out).read_text())
    assert card["file_format"] == "onnx" and card["onnx"]["output_is"] == "logits"
    session = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"])
    got = session.run(["output"], {"input": x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, m.model(x).numpy(), rtol=1e-4, atol=1e-5)


async def test_regression_model_predicts_values(tmp_path):
    node = Node(_solo(tmp_path, rounds=1, learner={"dataset": "sine", "model": "mlp", "model_params": {}}), admin=False)
    await node.start()
    try:
        await _until(lambda: node.done, "a round")
    finally:
        assert await node.stop()
    out = tmp_path / "sine.safetensors"
    assert _cli("model", "export", "--state-dir", str(node.store.dir), "--out", str(out)).exit_code == 0
    model, class_names = load_model(out)
    assert class_names is None
    table = tmp_path / "x.csv"
    table.write_text("x\n0.5\n-1.0\n2.0\n")
    r = _cli("predict", "--model", str(out), str(table))
    assert r.exit_code == 0, r.output
    rows = list(csv.reader(io.StringIO(r.stdout)))
    with torch.no_grad():
        want = model(torch.tensor([[0.5], [-1.0], [2.0]])).reshape(-1)
    assert rows[0] == ["index", "value"] and [float(v) for _, v in rows[1:]] == pytest.approx(want.tolist(), rel=1e-5)


def test_predict_preprocesses_images_exactly_as_training_does(tmp_path):
    """A photo larger than the network's input is resized the same way for `coterie predict` as
    for the node that trained on it (they had two resizers: bilinear in training, Pillow's
    default bicubic in predict — the model saw other pixels at prediction time)."""
    from PIL import Image

    from coterie.node.learning.images import read_images
    from coterie.node.predict import read_inputs

    rng = np.random.default_rng(0)
    (tmp_path / "cat").mkdir()
    Image.fromarray(rng.integers(0, 256, (37, 29, 3), dtype=np.uint8)).save(tmp_path / "cat" / "a.png")
    shape = (3, 8, 8)
    trained = read_images(tmp_path, shape).x
    predicted, ids, _ = read_inputs(tmp_path, shape)
    assert ids == ["cat/a.png"] and predicted.shape == (1, *shape)
    np.testing.assert_array_equal(predicted, trained)


def test_predict_reads_tables_as_training_does(tmp_path):
    """`coterie predict` reads a table with training's reader: the same feature numbers from the
    same file, the label column optional, and a missing value refused naming its line (the old
    reader of its own turned an empty cell into a crash or silently into NaN scores)."""
    from coterie.node.learning.tables import read_table
    from coterie.node.predict import read_inputs

    table = tmp_path / "t.csv"
    table.write_text("a,b,label\n1,2.5,x\n3,4e-3,y\n")
    trained = read_table(table, "csv", "label", regression=False).x
    predicted, ids, _ = read_inputs(table, (2,))
    np.testing.assert_array_equal(predicted, trained.astype(np.float32))
    unlabelled = tmp_path / "u.csv"
    unlabelled.write_text("a,b\n1,2.5\n3,4e-3\n")
    np.testing.assert_array_equal(read_inputs(unlabelled, (2,))[0], predicted)
    unlabelled.write_text("a,b\n1,2.5\n3,\n")
    with pytest.raises(ValueError, match=r"u\.csv line 3: features hold NaN"):
        read_inputs(unlabelled, (2,))


def _nll(out: torch.Tensor, y: torch.Tensor) -> float:
    """Mean NLL of log-probabilities ``out`` (the mixture module's output), as the node computes it."""
    return float(-out.gather(1, y.view(-1, 1)).clamp_min(np.log(1e-12)).sum()) / len(y)


@pytest.mark.slow
async def test_federico_export_is_the_mixture_the_node_predicts_with(tmp_path):
    """FedeRiCo predicts with Σ_j w_ij p(y|x; θ_j) over its own and cached peer models, and reports
    that mixture's test_acc/test_loss. The export holds every member: loaded back (and through
    `coterie predict`, ONNX), it scores node 0's test split as node 0 reported; `--own` exports
    the own model alone (own_test_acc/own_test_loss). The old export (own model only) fails the
    first half: its loss is own_test_loss, not the mixture's."""
    hub = InProcNetwork()
    nodes = []
    try:
        for i in range(3):
            learner = {
                "dataset": "digits",
                "partition": "iid",
                "num_nodes": 3,
                "node_index": i,
                "model": "mlp",
                "local_steps": 10,
                "optimizer": "adam",
                "lr": 0.01,
            }  # learns in 3 rounds
            # its own mixture, not blended with the twin (reference.predict = "blend" would add the
            # twin as a member, at a weight the run decides: tests/test_blend.py exports a blend)
            cfg = _config(
                tmp_path,
                i,
                3,
                [nodes[0].address] if nodes else [],
                strategy="federico",
                learner=learner,
                reference={"predict": "choose"},
            )
            node = Node(cfg, transport=hub.transport_for(cfg), admin=False)
            await node.start()
            nodes.append(node)
        n0 = nodes[0]
        await _until(lambda: all(n.done for n in nodes), "every node to finish its rounds")
    finally:
        for n in nodes:
            await n.stop()
    reported = n0.history[-1]["eval"]
    assert reported["mixture_members"] >= 2  # peers carry weight: a real mixture
    # ... that predicts unlike the own model (e.g. 1.05 against 0.74 here): the two exports differ
    assert abs(reported["test_loss"] - reported["own_test_loss"]) > 1e-2
    x, y = n0.learner._data["test"]

    out = tmp_path / "mix.safetensors"
    r = await asyncio.to_thread(_cli, "model", "export", "--state-dir", str(n0.store.dir), "--out", str(out))
    assert r.exit_code == 0, r.output
    assert "mixture of" in r.stdout
    card = json.loads(sidecar_path(out).read_text())
    mixture = card["mixture"]
    assert len(mixture) == reported["mixture_members"] and mixture[0]["node_id"] == "n0"
    assert {m["node_id"] for m in mixture} <= {"n0", "n1", "n2"}
    assert sum(m["weight"] for m in mixture) == pytest.approx(1.0)
    weights = card["weights"]
    tot = sum(weights[m["node_id"]] for m in mixture)
    for m in mixture:  # the members are weighted by the node's collaborator weights, normalised
        assert m["weight"] == pytest.approx(weights[m["node_id"]] / tot)
    model, class_names = coterie.load_model(out)
    assert class_names == n0.learner.class_names and not model.training
    with torch.no_grad():
        logp = model(x)
    assert _accuracy(model, x, y) == pytest.approx(reported["test_acc"], abs=1e-3)
    assert _nll(logp, y) == pytest.approx(reported["test_loss"], rel=1e-4)
    assert torch.allclose(logp.exp().sum(1), torch.ones(len(y)), atol=1e-5)  # log-probabilities

    # coterie predict scores with the mixture
    npz = tmp_path / "test.npz"
    np.savez(npz, x=x.numpy(), y=y.numpy())
    r = await asyncio.to_thread(_cli, "predict", "--model", str(out), str(npz))
    assert r.exit_code == 0, r.output
    predicted = [row[-1] for row in list(csv.reader(io.StringIO(r.stdout)))[1:]]
    assert np.mean([p == class_names[int(t)] for p, t in zip(predicted, y, strict=True)]) == pytest.approx(
        reported["test_acc"], abs=1e-3
    )

    # --own: the node's own model alone, as before
    own = tmp_path / "own.safetensors"
    r = await asyncio.to_thread(_cli, "model", "export", "--own", "--state-dir", str(n0.store.dir), "--out", str(own))
    assert r.exit_code == 0, r.output
    own_card = json.loads(sidecar_path(own).read_text())
    assert "mixture" not in own_card
    own_model = load_model(own).model
    assert _accuracy(own_model, x, y) == pytest.approx(reported["own_test_acc"], abs=1e-3)
    with torch.no_grad():
        assert float(torch.nn.functional.cross_entropy(own_model(x), y)) == pytest.approx(
            reported["own_test_loss"], rel=1e-4
        )

    # ONNX: the mixture module itself, the same log-probabilities from onnxruntime
    ort = pytest.importorskip("onnxruntime")
    onnx_out = tmp_path / "mix.onnx"
    r = await asyncio.to_thread(
        _cli, "model", "export", "--state-dir", str(n0.store.dir), "--out", str(onnx_out), "--format", "onnx"
    )
    assert r.exit_code == 0, r.output
    assert json.loads(sidecar_path(onnx_out).read_text())["onnx"]["output_is"] == "log_probabilities"
    got = ort.InferenceSession(str(onnx_out), providers=["CPUExecutionProvider"]).run(["output"], {"input": x.numpy()})[
        0
    ]
    np.testing.assert_allclose(got, logp.numpy(), rtol=1e-4, atol=1e-5)


def test_a_malformed_mixture_export_is_refused(tmp_path):
    """A mixture card whose members' tensors are missing, or whose weights are not positive, is
    refused naming the problem (not loaded as a wrong model)."""
    from safetensors.torch import save as st_save

    from coterie.node.learning.models import build_model
    from coterie.node.modelfile import META_KEY

    m = build_model("mlp", [40], 10)
    params = {f"member{k}.{n}": p.detach().clone() for k in range(2) for n, p in m.named_parameters()}
    card = {
        "format": FORMAT,
        "architecture": "mlp",
        "model_params": {},
        "input_shape": [40],
        "num_classes": 10,
        "task": "classification",
        "class_names": [str(i) for i in range(10)],
        "mixture": [{"node_id": "a", "weight": 0.5}, {"node_id": "b", "weight": 0.5}],
    }
    f = tmp_path / "m.safetensors"
    f.write_bytes(st_save(params, metadata={META_KEY: json.dumps(card)}))
    assert isinstance(load_model(f).model, coterie.node.modelfile.MixtureModel)
    f.write_bytes(
        st_save({k: v for k, v in params.items() if k.startswith("member0.")}, metadata={META_KEY: json.dumps(card)})
    )
    with pytest.raises(ValueError, match="mixture member 1"):
        load_model(f)
    bad = {**card, "mixture": [{"node_id": "a", "weight": 1.0}, {"node_id": "b", "weight": 0.0}]}
    f.write_bytes(st_save(params, metadata={META_KEY: json.dumps(bad)}))
    with pytest.raises(ValueError, match="weights must be positive"):
        load_model(f)
