"""Graph tasks on top of :func:`et_ode.training.train.fit`:
graph classification with cross-validation, node anomaly detection.

Graph classification (e.g. MUTAG, any TU-format data set): stratified ``folds``-fold cross-validation
(scikit-learn's ``StratifiedKFold``, shuffled with ``seed``). In each fold a fresh :class:`GraphET` (seeded with
``seed + fold``) is trained for a fixed number of epochs on the other folds and evaluated once on the fold's test
graphs, which take no part in training or model selection (the last epoch's model is the one scored; no early
stopping). With a ``grid`` of candidate options the cross-validation is nested: each fold chooses among them by an
inner cross-validation of its own training graphs. The result is the mean and standard deviation over folds of
the test accuracy. With ``out_dir`` each fold writes ``fold_K/`` (checkpoint and metrics from ``fit``, the inner
runs under ``fold_K/selection/``) and ``fold_K/result.json``; a rerun skips finished runs and resumes the
unfinished one.

Node anomaly detection: one graph with node labels ``y`` (1 anomalous), from :func:`inject_anomalies` or a
user's files. The nodes are split (stratified, ``node_split``) into train/val/test; the model sees the whole graph
(transductive) but its loss, a class-weighted cross-entropy, only uses train nodes. The score of a node is its
predicted probability of being anomalous. Reported on the test nodes: ROC AUC, and macro-F1 at the threshold that
maximises macro-F1 on the val nodes. The same protocol scores two baselines: logistic regression on the node
features alone (class-balanced) and a 2-layer GCN (PyG ``GCNConv``, class-weighted cross-entropy, full batch).

``et-ode train graph`` (:mod:`et_ode.cli.graph`) parses its options into these calls.
"""

from __future__ import annotations

import inspect
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

from et_ode.backend.devices import move_to, resolve_device, seed_everything
from et_ode.backend.validation import check_positive
from et_ode.models.graph import GraphET, Readout
from et_ode.solving.integration import Integration
from et_ode.training.train import TrainConfig, fit


def collate_graphs(items: list) -> Any:
    """A list of PyG ``Data`` -> one ``Batch`` (a disjoint graph with a ``batch`` vector)."""
    from torch_geometric.data import Batch

    return Batch.from_data_list(items)


# ------------------------------------------------------------------------------------------- classification
class GraphClassificationTask:
    """Cross-entropy on graph labels; accuracy as the metric (the ``Task`` protocol of ``fit``)."""

    def loss(self, model: nn.Module, batch: Any) -> tuple[Tensor, dict[str, float]]:
        logits = model(batch)
        loss = F.cross_entropy(logits, batch.y)
        return loss, {"acc": float((logits.argmax(-1) == batch.y).float().mean())}

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        correct = total = 0
        loss = 0.0
        for batch in batches:
            logits = model(batch)
            loss += float(F.cross_entropy(logits, batch.y, reduction="sum"))
            correct += int((logits.argmax(-1) == batch.y).sum())
            total += len(batch.y)
        return {"acc": correct / total, "loss": loss / total}


#: Options that change the data's encoding; they are fixed for a cross-validation, not selected in it.
DATA_OPTIONS = ("pe_dim", "max_degree", "rw_steps")
#: the flat dynamics options a model's arguments may hold (:meth:`et_ode.Integration.from_options`), and their
#: defaults here: the paper's graph block, 12 Euler steps of 0.1 (GraphET's default); adaptive methods at rtol 1e-4
INTEGRATION_DEFAULTS = {
    **{name: p.default for name, p in inspect.signature(Integration.from_options).parameters.items()},
    "solver": "et",
    "rtol": 1e-4,
    "atol": 1e-5,
}


def graph_model(in_features: int, classes: int, readout: Readout, model_kwargs: Mapping[str, Any]) -> GraphET:
    """A :class:`GraphET` from flat arguments: the dynamics options among them (``solver``, ``step``, ``steps``,
    ``t1``, ``rtol``, ``gradient``, ...: :data:`INTEGRATION_DEFAULTS`) become its :class:`~et_ode.Integration`, so
    that a command line or a grid search can name them one by one."""
    dynamics = {name: value for name, value in model_kwargs.items() if name in INTEGRATION_DEFAULTS}
    rest = {name: value for name, value in model_kwargs.items() if name not in INTEGRATION_DEFAULTS}
    integration = Integration.from_options(**{**INTEGRATION_DEFAULTS, **dynamics})
    return GraphET(in_features, classes, readout=readout, dynamics=integration, **rest)


def expand_grid(grid: Mapping[str, Sequence[Any]] | None, config: TrainConfig) -> list[dict[str, Any]]:
    """Every combination of the ``grid``'s values, in order (the last option varying fastest): ``[{}]`` for none.

    Keys are :class:`GraphET` arguments, dynamics options (:data:`INTEGRATION_DEFAULTS`) or :class:`TrainConfig`
    fields; a data option (``pe_dim``, ...), an
    unknown name or an empty list of values raises ``ValueError`` naming it.
    """
    if not grid:
        return [{}]
    defaults = {
        name: p.default
        for name, p in inspect.signature(GraphET).parameters.items()
        if name not in ("in_features", "classes", "readout", "dynamics")
    }
    defaults.update(INTEGRATION_DEFAULTS)
    defaults.update(
        {
            name: value
            for name, value in config.to_dict().items()
            if name not in ("seed", "out_dir", "resume", "device", "progress")
        }
    )
    for key, values in grid.items():
        if key in DATA_OPTIONS:
            raise ValueError(f"grid option {key!r} changes the data encoding; set it for the whole run instead")
        if key not in defaults:
            raise ValueError(
                f"grid option {key!r} is neither a GraphET argument, a dynamics option nor a TrainConfig "
                f"field; choose from {sorted(defaults)}"
            )
        if not isinstance(values, Sequence) or isinstance(values, str) or not values:
            raise ValueError(f"grid option {key!r} needs a non-empty list of values, got {values!r}")
        numeric = isinstance(defaults[key], (int, float)) and not isinstance(defaults[key], bool)
        for value in values:
            if numeric and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"grid option {key!r} takes numbers (default {defaults[key]!r}), got {value!r}")
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def _split_options(
    options: Mapping[str, Any], model_kwargs: dict[str, Any], config: TrainConfig
) -> tuple[dict[str, Any], TrainConfig]:
    """``model_kwargs`` and ``config`` with ``options`` (GraphET arguments and TrainConfig fields) applied."""
    fields = config.to_dict()
    train = {k: v for k, v in options.items() if k in fields}
    return {**model_kwargs, **{k: v for k, v in options.items() if k not in fields}}, TrainConfig(**{**fields, **train})


def _train_and_score(
    graphs: list,
    train_index: np.ndarray,
    test_index: np.ndarray,
    model_kwargs: dict[str, Any],
    config: TrainConfig,
    seed: int,
    run_dir: Path | None,
    meta: dict[str, Any],
    ensemble: int = 1,
) -> dict[str, Any]:
    """Train ``ensemble`` fresh :class:`GraphET` (member ``j`` seeded with ``seed + 1000 j``) on
    ``graphs[train_index]`` for ``config.epochs`` and score them once on ``graphs[test_index]``: the prediction
    is the mean of the members' class probabilities. With ``run_dir`` the runs checkpoint there (``member_j/``
    when ``ensemble > 1``; resumable) and the result is kept in ``run_dir/score.json``, which a rerun reads
    instead of training again."""
    result_file = run_dir / "score.json" if run_dir is not None else None
    if result_file is not None and result_file.is_file():
        return json.loads(result_file.read_text())
    labels = [int(graph.y) for graph in graphs]
    device = resolve_device(config.device)
    test_batch = move_to(collate_graphs([graphs[i] for i in test_index]), device)
    probabilities = []
    for member in range(ensemble):
        member_seed = seed + 1000 * member
        member_dir = run_dir if run_dir is None or ensemble == 1 else run_dir / f"member_{member}"
        torch.manual_seed(member_seed)
        model = graph_model(graphs[0].x.shape[1], max(labels) + 1, "graph", model_kwargs)
        run_config = TrainConfig(
            **{
                **config.to_dict(),
                "seed": member_seed,
                "resume": member_dir is not None,
                "out_dir": None if member_dir is None else str(member_dir),
            }
        )
        fit(
            model,
            GraphClassificationTask(),
            [graphs[i] for i in train_index],
            None,
            run_config,
            collate_fn=collate_graphs,
            meta={"model": model.config, **meta, "member": member},
        )
        with torch.no_grad():
            probabilities.append(torch.softmax(model.eval()(test_batch).double(), dim=-1).cpu())
    mean = torch.stack(probabilities).mean(dim=0)
    target = test_batch.y.cpu()
    result = {
        "test_acc": float((mean.argmax(-1) == target).double().mean()),
        "test_loss": float(F.nll_loss(mean.clamp_min(1e-300).log(), target)),
        "test_size": len(test_index),
    }
    if result_file is not None:
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.write_text(json.dumps(result))
    return result


def cross_validate(
    graphs: list,
    model_kwargs: dict[str, Any],
    config: TrainConfig,
    *,
    folds: int = 10,
    seed: int = 0,
    out_dir: str | Path | None = None,
    verbose: bool = True,
    grid: Mapping[str, Sequence[Any]] | None = None,
    inner_folds: int = 3,
    ensemble: int = 1,
) -> dict[str, Any]:
    """Stratified ``folds``-fold cross-validation of :class:`GraphET` on ``graphs`` (PyG ``Data`` with ``pe``),
    nested when a ``grid`` of candidates is given.

    Args:
        graphs: the data set, e.g. :func:`et_ode.data.graphs.read_tu`.
        model_kwargs: :class:`GraphET` arguments other than ``in_features`` and ``classes`` (taken from the data),
            its dynamics as flat options (:func:`graph_model`).
        config: training settings of every run (``out_dir`` and ``seed`` are set per run).
        folds, seed: the split (``StratifiedKFold(folds, shuffle=True, random_state=seed)``); fold ``K``'s models
            are initialised with seed ``seed + K``.
        out_dir: per-run checkpoints and results (resumable); None keeps nothing.
        verbose: print each fold's test accuracy (and choice).
        grid: model selection: option name -> candidate values (GraphET arguments or TrainConfig fields, e.g.
            ``{"lr": [1e-3, 3e-3], "pool": ["cls", "cls+sum"]}``). Each outer fold scores every combination by
            its mean validation accuracy in a stratified ``inner_folds``-fold cross-validation of the fold's own
            training graphs, trains the best (ties: the first) on all of them and scores its test graphs once.
            The test graphs take part in neither training nor selection.
        inner_folds: folds of the inner cross-validation.
        ensemble: models trained per run (differently seeded); a run predicts the mean of their class
            probabilities. Applies to the selection runs too.

    Returns ``{"accuracies": [...], "mean": m, "std": s, "folds": folds, "majority": rate, "chosen": [...]}``
    where ``std`` is the population standard deviation over folds, ``majority`` the test accuracy of always
    predicting the most frequent training class (the floor to beat) and ``chosen`` each fold's selected options.
    """
    from sklearn.model_selection import StratifiedKFold

    labels = np.array([int(graph.y) for graph in graphs])
    check_positive("ensemble", ensemble, integer=True)
    if len(graphs) < folds or np.bincount(labels).min() < folds:
        raise ValueError(
            f"{folds}-fold stratified cross-validation needs at least {folds} graphs of every class; "
            f"class counts: {np.bincount(labels).tolist()}"
        )
    candidates = expand_grid(grid, config)
    classes = int(labels.max()) + 1
    splitter = StratifiedKFold(folds, shuffle=True, random_state=seed)
    accuracies, majority, chosen = [], [], []
    for fold, (train_index, test_index) in enumerate(splitter.split(np.zeros(len(labels)), labels)):
        fold_dir = Path(out_dir) / f"fold_{fold}" if out_dir is not None else None
        result_file = fold_dir / "result.json" if fold_dir is not None else None
        if result_file is not None and result_file.is_file():
            result = json.loads(result_file.read_text())
        else:
            selection = []
            if len(candidates) > 1:
                inner = StratifiedKFold(inner_folds, shuffle=True, random_state=seed + fold)
                splits = list(inner.split(np.zeros(len(train_index)), labels[train_index]))
                for j, options in enumerate(candidates):
                    kwargs, options_config = _split_options(options, model_kwargs, config)
                    scores = [
                        _train_and_score(
                            graphs,
                            train_index[fit_part],
                            train_index[val_part],
                            kwargs,
                            options_config,
                            seed + fold,
                            None if fold_dir is None else fold_dir / "selection" / f"candidate_{j}" / f"inner_{i}",
                            {"fold": fold, "candidate": j, "inner_fold": i},
                            ensemble,
                        )["test_acc"]
                        for i, (fit_part, val_part) in enumerate(splits)
                    ]
                    selection.append({"options": options, "val_acc": float(np.mean(scores))})
            best = max(range(len(candidates)), key=lambda j: (selection[j]["val_acc"] if selection else 0.0, -j))
            kwargs, best_config = _split_options(candidates[best], model_kwargs, config)
            result = _train_and_score(
                graphs, train_index, test_index, kwargs, best_config, seed + fold, fold_dir, {"fold": fold}, ensemble
            )
            common = np.bincount(labels[train_index], minlength=classes).argmax()
            result.update(
                fold=fold,
                majority=float((labels[test_index] == common).mean()),
                chosen=candidates[best],
                selection=selection,
            )
            if result_file is not None:
                result_file.write_text(json.dumps(result))
        accuracies.append(result["test_acc"])
        majority.append(result["majority"])
        chosen.append(result.get("chosen", {}))
        if verbose:
            choice = f", chose {result['chosen']}" if result.get("chosen") else ""
            print(
                f"fold {fold + 1}/{folds}: test accuracy {result['test_acc']:.4f} "
                f"(majority class {result['majority']:.4f}{choice})",
                flush=True,
            )
    summary = {
        "accuracies": accuracies,
        "mean": float(np.mean(accuracies)),
        "std": float(np.std(accuracies)),
        "folds": folds,
        "majority": float(np.mean(majority)),
        "chosen": chosen,
    }
    if out_dir is not None:
        (Path(out_dir) / "cv_results.json").write_text(json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------------------- anomaly detection
def best_macro_f1_threshold(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """The threshold ``t`` among ``scores`` for which ``scores >= t`` has the highest macro-F1, and that F1.

    Every candidate is scored at once: sorting the scores gives the confusion counts of all thresholds.
    Ties go to the highest threshold.
    """
    order = np.argsort(-scores, kind="stable")
    s, y = scores[order], labels[order].astype(bool)
    last = np.r_[s[1:] != s[:-1], True]  # the last position of each distinct score: predict all before it
    tp = np.cumsum(y)[last]
    fp = np.cumsum(~y)[last]
    positives, negatives = y.sum(), (~y).sum()
    fn, tn = positives - tp, negatives - fp
    with np.errstate(divide="ignore", invalid="ignore"):
        f1_pos = np.where(2 * tp + fp + fn > 0, 2 * tp / (2 * tp + fp + fn), 0.0)
        f1_neg = np.where(2 * tn + fn + fp > 0, 2 * tn / (2 * tn + fn + fp), 0.0)
    macro = (f1_pos + f1_neg) / 2
    best = int(np.argmax(macro))
    return float(s[last][best]), float(macro[best])


def anomaly_metrics(scores: Tensor, labels: Tensor, masks: dict[str, Tensor]) -> dict[str, float]:
    """Test ROC AUC and test macro-F1 at the threshold that maximises macro-F1 on the val nodes.

    ``scores (n,)``: higher = more anomalous; ``labels (n,)`` 0/1; ``masks``: boolean ``val`` and ``test`` ``(n,)``.
    """
    from sklearn.metrics import f1_score, roc_auc_score

    s, y = scores.detach().cpu().double().numpy(), labels.cpu().numpy()
    val, test = masks["val"].cpu().numpy(), masks["test"].cpu().numpy()
    threshold, _ = best_macro_f1_threshold(s[val], y[val])
    return {
        "auc": float(roc_auc_score(y[test], s[test])),
        "macro_f1": float(f1_score(y[test], s[test] >= threshold, average="macro", zero_division=0)),
        "val_auc": float(roc_auc_score(y[val], s[val])),
        "threshold": threshold,
    }


class NodeAnomalyTask:
    """Class-weighted cross-entropy on the train nodes of one graph; val AUC and macro-F1 as metrics."""

    def __init__(self, masks: dict[str, Tensor], labels: Tensor):
        self.masks = masks
        counts = torch.bincount(labels[masks["train"]], minlength=2).double()
        self.weight = (counts.sum() / (2 * counts.clamp_min(1))).float()

    def loss(self, model: nn.Module, graph: Any) -> tuple[Tensor, dict[str, float]]:
        logits = model(graph)
        train = self.masks["train"].to(logits.device)
        loss = F.cross_entropy(logits[train], graph.y[train], weight=self.weight.to(logits.device))
        return loss, {}

    def scores(self, model: nn.Module, graph: Any) -> Tensor:
        return torch.softmax(model(graph), dim=-1)[:, 1]

    def evaluate(self, model: nn.Module, batches: Iterable[Any]) -> dict[str, float]:
        from sklearn.metrics import roc_auc_score

        graph = next(iter(batches))
        val = self.masks["val"].to(graph.y.device)
        return {"auc": float(roc_auc_score(graph.y[val].cpu().numpy(), self.scores(model, graph)[val].cpu().numpy()))}


def feature_baseline(graph: Any, masks: dict[str, Tensor], *, seed: int = 0) -> dict[str, float]:
    """Logistic regression (class-balanced) on the node features alone."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = graph.x.cpu().numpy(), graph.y.cpu().numpy()
    train = masks["train"].numpy()
    classifier = make_pipeline(
        StandardScaler(), LogisticRegression(class_weight="balanced", max_iter=2000, random_state=seed)
    )
    classifier.fit(x[train], y[train])
    return anomaly_metrics(torch.from_numpy(classifier.predict_proba(x)[:, 1]), graph.y, masks)


class GCN(nn.Module):
    """Two ``GCNConv`` layers (PyG) with ReLU and dropout: node logits ``(n, classes)``."""

    def __init__(self, in_features: int, hidden: int, classes: int, dropout: float = 0.5):
        super().__init__()
        from torch_geometric.nn import GCNConv

        self.conv1, self.conv2 = GCNConv(in_features, hidden), GCNConv(hidden, classes)
        self.dropout = dropout

    def forward(self, graph: Any) -> Tensor:
        h = F.dropout(torch.relu(self.conv1(graph.x, graph.edge_index)), self.dropout, self.training)
        return self.conv2(h, graph.edge_index)


def gcn_baseline(
    graph: Any,
    masks: dict[str, Tensor],
    *,
    hidden: int = 64,
    epochs: int = 300,
    lr: float = 0.01,
    weight_decay: float = 5e-4,
    seed: int = 0,
    device: str = "auto",
) -> dict[str, float]:
    """A 2-layer GCN trained full-batch with Adam on the train nodes (class-weighted), scored like the ET."""
    seed_everything(seed)
    target = resolve_device(device)
    graph = graph.to(target)
    model = GCN(graph.x.shape[1], hidden, 2).to(target)
    task = NodeAnomalyTask(masks, graph.y.cpu())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    for _ in range(epochs):
        model.train()
        loss, _ = task.loss(model, graph)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        return anomaly_metrics(task.scores(model, graph), graph.y, masks)


class _OneGraph(torch.utils.data.Dataset):
    """A data set of a single graph (each training step is one full-graph step)."""

    def __init__(self, graph: Any):
        self.graph = graph

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> Any:
        return self.graph


def detect_anomalies(
    graph: Any,
    model_kwargs: dict[str, Any],
    config: TrainConfig,
    *,
    split: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
    baselines: bool = True,
) -> dict[str, Any]:
    """Train a node-readout :class:`GraphET` to score anomalies on ``graph`` (``x``, ``edge_index``, ``pe``, ``y``).

    Returns ``{"et": metrics, "logistic_regression": ..., "gcn": ..., "nodes": n, "anomalies": count}``, each
    metrics dict holding the test ``auc``, ``macro_f1``, ``val_auc`` and the chosen ``threshold``.
    """
    from et_ode.data.graphs import node_split

    if getattr(graph, "y", None) is None or graph.y.shape != (graph.num_nodes,):
        raise ValueError("graph.y must hold a 0/1 label per node (from inject_anomalies or a labels file)")
    masks = node_split(graph.y, split, seed=seed)
    torch.manual_seed(seed)
    model = graph_model(graph.x.shape[1], 2, "node", model_kwargs)
    task = NodeAnomalyTask(masks, graph.y)
    config = TrainConfig(**{**config.to_dict(), "batch_size": 1, "seed": seed})
    fit(model, task, _OneGraph(graph), [graph], config, collate_fn=lambda items: items[0], meta={"model": model.config})
    device = resolve_device(config.device)
    with torch.no_grad():
        results: dict[str, Any] = {"et": anomaly_metrics(task.scores(model.eval(), graph.to(device)), graph.y, masks)}
    if baselines:
        results["logistic_regression"] = feature_baseline(graph.cpu(), masks, seed=seed)
        results["gcn"] = gcn_baseline(graph.cpu(), masks, seed=seed, device=config.device)
    results.update(nodes=int(graph.num_nodes), anomalies=int(graph.y.sum()))
    if config.out_dir:
        Path(config.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.out_dir) / "anomaly_results.json").write_text(json.dumps(results, indent=2))
    return results
