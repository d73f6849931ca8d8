"""Graph tasks: cross-validated MUTAG classification, anomaly metrics and detection, the CLI entry points."""

import argparse
import json

import numpy as np
import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.data import Data  # noqa: E402

from et_ode.cli.graph import add_graph_train_arguments, load_anomaly_graph, parse_grid, run_graph_train  # noqa: E402
from et_ode.data.graphs import add_laplacian_pe, inject_anomalies, read_tu  # noqa: E402
from et_ode.tasks import graph as graph_task  # noqa: E402
from et_ode.tasks.graph import anomaly_metrics, collate_graphs, cross_validate, detect_anomalies, expand_grid  # noqa: E402
from et_ode.training.train import TrainConfig, load_checkpoint  # noqa: E402

SMALL = dict(dim=16, heads=2, head_dim=8, memories=32, steps=4, step=0.2)


def test_a_few_epochs_on_mutag_beat_the_majority_class_on_held_out_folds(fixtures):
    graphs = read_tu(fixtures, "MUTAG", pe_dim=8)
    config = TrainConfig(epochs=12, batch_size=32, lr=5e-3, warmup=0.1, device="cpu", progress=False)
    result = cross_validate(graphs, {**SMALL, "pe_dim": 8}, config, folds=3, seed=0, verbose=False)
    assert len(result["accuracies"]) == 3
    assert result["majority"] == pytest.approx(125 / 188, abs=0.01)
    assert result["mean"] > result["majority"] + 0.05, result


def test_nested_selection_never_sees_test_graphs_and_keeps_the_best_candidate(fixtures, monkeypatch):
    graphs = read_tu(fixtures, "MUTAG", pe_dim=4)
    runs = []

    def fake_run(graphs, train_index, test_index, model_kwargs, config, seed, run_dir, meta, ensemble=1):
        # a score that depends on the candidate and the fold, so the choice differs between folds
        score = 0.5 + 0.1 * model_kwargs["steps"] + (0.3 if config.lr == 1e-2 and meta["fold"] == 1 else 0.0)
        runs.append(
            dict(
                train=set(train_index.tolist()),
                test=set(test_index.tolist()),
                steps=model_kwargs["steps"],
                lr=config.lr,
                **meta,
            )
        )
        return {"test_acc": score, "test_loss": 0.0, "test_size": len(test_index)}

    monkeypatch.setattr(graph_task, "_train_and_score", fake_run)
    config = TrainConfig(epochs=1, lr=1e-3, device="cpu", progress=False)
    result = cross_validate(
        graphs,
        {**SMALL, "pe_dim": 4},
        config,
        folds=3,
        seed=0,
        verbose=False,
        grid={"steps": [1, 2], "lr": [1e-3, 1e-2]},
        inner_folds=2,
    )
    finals = [run for run in runs if "candidate" not in run]
    assert len(finals) == 3 and len(runs) == 3 * (4 * 2 + 1)
    for final in finals:
        inner = [run for run in runs if run["fold"] == final["fold"] and "candidate" in run]
        assert all(run["train"] | run["test"] == final["train"] for run in inner)  # only the fold's training graphs
        assert all(not (run["train"] | run["test"]) & final["test"] for run in inner)
        assert all(not run["train"] & run["test"] for run in inner)
    assert [(f["steps"], f["lr"]) for f in finals] == [(2, 1e-3), (2, 1e-2), (2, 1e-3)]
    assert result["chosen"] == [{"steps": 2, "lr": 1e-3}, {"steps": 2, "lr": 1e-2}, {"steps": 2, "lr": 1e-3}]


def test_an_ensemble_predicts_the_mean_of_its_members_probabilities(fixtures, tmp_path):
    graphs = read_tu(fixtures, "MUTAG", pe_dim=4)
    train_index, test_index = np.arange(0, 188, 2), np.arange(1, 188, 2)
    kwargs = {**SMALL, "pe_dim": 4}
    config = TrainConfig(epochs=2, batch_size=32, lr=5e-3, device="cpu", progress=False)
    result = graph_task._train_and_score(graphs, train_index, test_index, kwargs, config, 7, tmp_path, {}, 2)
    test = collate_graphs([graphs[i] for i in test_index])
    probabilities = []
    for member in range(2):
        model = graph_task.graph_model(graphs[0].x.shape[1], 2, "graph", kwargs)
        model.load_state_dict(load_checkpoint(tmp_path / f"member_{member}" / "checkpoint.safetensors")["model"])
        with torch.no_grad():
            probabilities.append(torch.softmax(model.eval()(test).double(), dim=-1))
    mean = (probabilities[0] + probabilities[1]) / 2
    assert result["test_acc"] == pytest.approx(float((mean.argmax(-1) == test.y).double().mean()))
    assert result["test_loss"] == pytest.approx(float(-mean[torch.arange(94), test.y].log().mean()), rel=1e-9)
    assert not torch.equal(probabilities[0], probabilities[1])  # differently seeded members
    assert json.loads((tmp_path / "score.json").read_text()) == result
    with pytest.raises(ValueError, match="ensemble must be a positive integer"):
        cross_validate(graphs, kwargs, config, ensemble=0)


def test_grid_options_are_parsed_and_checked():
    assert parse_grid(["lr=1e-3,3e-3", "pool=cls,cls+sum", "head-hidden=0,32", "self_attention=true"]) == {
        "lr": [1e-3, 3e-3],
        "pool": ["cls", "cls+sum"],
        "head_hidden": [0, 32],
        "self_attention": [True],
    }
    config = TrainConfig()
    assert expand_grid({"lr": [1, 2], "steps": [3, 4]}, config) == [
        {"lr": 1, "steps": 3},
        {"lr": 1, "steps": 4},
        {"lr": 2, "steps": 3},
        {"lr": 2, "steps": 4},
    ]
    assert expand_grid(None, config) == [{}]
    with pytest.raises(ValueError, match="OPTION=V1,V2"):
        parse_grid(["lr"])
    with pytest.raises(ValueError, match="'pe_dim' changes the data encoding"):
        expand_grid({"pe_dim": [4, 8]}, config)
    with pytest.raises(ValueError, match="'layers' is neither a GraphET argument, a dynamics option nor a TrainConfig"):
        expand_grid({"layers": [1, 2]}, config)
    with pytest.raises(ValueError, match="non-empty list"):
        expand_grid({"lr": []}, config)
    with pytest.raises(ValueError, match="'lr' takes numbers .* got 'fast'"):
        expand_grid(parse_grid(["lr=1e-3,fast"]), config)


def auc_by_pairs(scores: np.ndarray, labels: np.ndarray) -> float:
    positive, negative = scores[labels == 1], scores[labels == 0]
    wins = (positive[:, None] > negative[None, :]).sum() + 0.5 * (positive[:, None] == negative[None, :]).sum()
    return wins / (len(positive) * len(negative))


def test_anomaly_metrics_auc_and_validation_threshold():
    rng = np.random.default_rng(0)
    labels = torch.tensor(rng.random(200) < 0.1).long()
    scores = torch.tensor(rng.normal(size=200) + 1.5 * labels.numpy())
    masks = {"val": torch.arange(200) < 100, "test": torch.arange(200) >= 100}
    metrics = anomaly_metrics(scores, labels, masks)
    test = masks["test"].numpy()
    assert metrics["auc"] == pytest.approx(auc_by_pairs(scores.numpy()[test], labels.numpy()[test]))
    val = masks["val"].numpy()

    def macro_f1(s, y, t):
        predicted = s >= t
        f1 = []
        for positive_class in (True, False):
            tp = np.sum((predicted == positive_class) & ((y == 1) == positive_class))
            fp = np.sum((predicted == positive_class) & ((y == 1) != positive_class))
            fn = np.sum((predicted != positive_class) & ((y == 1) == positive_class))
            f1.append(2 * tp / max(2 * tp + fp + fn, 1))
        return float(np.mean(f1))

    s, y = scores.numpy(), labels.numpy()
    best = max(np.unique(s[val]), key=lambda t: macro_f1(s[val], y[val], t))
    assert metrics["threshold"] == pytest.approx(best)
    assert metrics["macro_f1"] == pytest.approx(macro_f1(s[test], y[test], best))


def test_detect_anomalies_runs_all_three_models_reproducibly():
    torch.manual_seed(0)
    n = 120
    nodes = torch.arange(n)
    ring = torch.cat([torch.stack([nodes, (nodes + 1) % n]), torch.stack([nodes, (nodes + 2) % n])], dim=1)
    graph = Data(x=torch.randn(n, 4).cumsum(0) / 5, edge_index=torch.cat([ring, ring.flip(0)], dim=1))
    graph = add_laplacian_pe(inject_anomalies(graph, cliques=2, clique_size=6, contextual=8, seed=1), 4)
    config = TrainConfig(epochs=15, lr=5e-3, device="cpu", progress=False)
    results = detect_anomalies(graph, {**SMALL, "pe_dim": 4}, config, seed=0)
    assert results["nodes"] == n and results["anomalies"] == 20
    for name in ("et", "logistic_regression", "gcn"):
        assert 0 <= results[name]["auc"] <= 1 and 0 <= results[name]["macro_f1"] <= 1
    again = detect_anomalies(graph, {**SMALL, "pe_dim": 4}, config, seed=0)
    assert again["et"] == results["et"] and again["gcn"] == results["gcn"]


def test_cli_classify_writes_results_and_resumes(fixtures, tmp_path):
    parser = argparse.ArgumentParser()
    add_graph_train_arguments(parser)
    argv = [
        "classify",
        "--root",
        str(fixtures),
        "--folds",
        "2",
        "--epochs",
        "1",
        "--dim",
        "8",
        "--heads",
        "1",
        "--head-dim",
        "4",
        "--memories",
        "8",
        "--steps",
        "2",
        "--pe-dim",
        "4",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(tmp_path),
    ]
    first = run_graph_train(parser.parse_args(argv))
    saved = json.loads((tmp_path / "cv_results.json").read_text())
    assert saved["accuracies"] == first["accuracies"] and len(first["accuracies"]) == 2
    assert all((tmp_path / f"fold_{k}" / "checkpoint.safetensors").is_file() for k in range(2))
    (tmp_path / "fold_1" / "result.json").write_text(json.dumps({"test_acc": 0.5, "majority": 0.6}))
    second = run_graph_train(parser.parse_args([*argv, "--resume"]))  # finished folds are read back, not retrained
    assert second["accuracies"] == [first["accuracies"][0], 0.5]
    with pytest.raises(ValueError, match="--root"):
        run_graph_train(parser.parse_args(["classify", "--no-progress"]))


def test_cli_nested_selection_writes_inner_runs_and_resumes(fixtures, tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    add_graph_train_arguments(parser)
    argv = [
        "classify",
        "--root",
        str(fixtures),
        "--folds",
        "2",
        "--epochs",
        "1",
        "--dim",
        "8",
        "--heads",
        "1",
        "--head-dim",
        "4",
        "--memories",
        "8",
        "--steps",
        "2",
        "--pe-dim",
        "4",
        "--rw-steps",
        "3",
        "--device",
        "cpu",
        "--no-progress",
        "--out",
        str(tmp_path),
        "--grid",
        "pool=cls,cls+sum",
        "--inner-folds",
        "2",
    ]
    first = run_graph_train(parser.parse_args(argv))
    assert all(choice["pool"] in ("cls", "cls+sum") for choice in first["chosen"])
    for fold in range(2):
        result = json.loads((tmp_path / f"fold_{fold}" / "result.json").read_text())
        assert [entry["options"] for entry in result["selection"]] == [{"pool": "cls"}, {"pool": "cls+sum"}]
        assert all(
            (tmp_path / f"fold_{fold}" / "selection" / f"candidate_{j}" / f"inner_{i}" / "score.json").is_file()
            for j in range(2)
            for i in range(2)
        )
    (tmp_path / "fold_1" / "result.json").unlink()  # an interrupted fold: its finished inner runs are kept

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr(graph_task, "fit", no_training)
    second = run_graph_train(parser.parse_args([*argv, "--resume"]))
    assert second["accuracies"] == first["accuracies"] and second["chosen"] == first["chosen"]


def test_cli_anomaly_graph_sources(fixtures, tmp_path):
    parser = argparse.ArgumentParser()
    add_graph_train_arguments(parser)
    mutag = load_anomaly_graph(parser.parse_args(["anomaly", "--graph", "mutag", "--root", str(fixtures)]))
    assert mutag.num_nodes == 3371 and int(mutag.y.sum()) == 2 * 15 + 30 and mutag.pe.shape == (3371, 15)
    (tmp_path / "e.txt").write_text("0 1\n1 2\n2 3\n3 0\n")
    (tmp_path / "x.txt").write_text("1 0\n0 1\n1 1\n0 0\n")
    (tmp_path / "y.txt").write_text("0\n0\n1\n0\n")
    argv = [
        "anomaly",
        "--graph",
        "files",
        "--edges",
        str(tmp_path / "e.txt"),
        "--features",
        str(tmp_path / "x.txt"),
        "--labels",
        str(tmp_path / "y.txt"),
        "--pe-dim",
        "2",
    ]
    own = load_anomaly_graph(parser.parse_args(argv))
    assert own.y.tolist() == [0, 0, 1, 0] and own.pe.shape == (4, 2)  # labels given: nothing injected
    with pytest.raises(ValueError, match="--edges and --features"):
        load_anomaly_graph(parser.parse_args(["anomaly", "--graph", "files"]))
