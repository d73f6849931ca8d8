"""``et-ode train graph``: the options of the graph tasks and their translation into :mod:`et_ode.tasks.graph` calls.

``classify`` runs :func:`et_ode.tasks.graph.cross_validate` on a TU data set; ``anomaly`` runs
:func:`et_ode.tasks.graph.detect_anomalies` on one graph (the digits k-NN graph, MUTAG joined, or the user's files).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from et_ode.cli.dynamics import add_dynamics_arguments
from et_ode.cli.options import add_run_folder_arguments, add_threads_argument, count_in, same_names
from et_ode.data.images import files_fingerprint
from et_ode.models.graph import PAPER_INTEGRATION, POOLS
from et_ode.tasks.graph import INTEGRATION_DEFAULTS, cross_validate, detect_anomalies
from et_ode.training import runs
from et_ode.training.train import TrainConfig

#: the dynamics options of ``et-ode train graph`` (defaults: the task's, the paper's 12 Euler steps of 0.1)
DYNAMICS_OPTIONS = ("solver", "t1", "rtol", "atol", "step", "steps", "gradient", "max_steps")


def add_graph_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``et-ode train graph``: ``classify`` (cross-validation) or ``anomaly`` (node scoring)."""
    parser.add_argument(
        "graph_task",
        metavar="TASK",
        choices=("classify", "anomaly"),
        help="classify: graph classification with cross-validation; anomaly: node anomaly detection",
    )
    data = parser.add_argument_group("data")
    data.add_argument("--root", default=None, help="folder holding NAME/raw/ in TU format (classify; mutag source)")
    data.add_argument("--name", default="MUTAG", help="TU data set name, the files' prefix (default MUTAG)")
    anomaly = parser.add_argument_group("anomaly (the graph and its injected anomalies)")
    anomaly.add_argument(
        "--graph",
        choices=("digits", "mutag", "files"),
        default="digits",
        help="digits k-NN graph, MUTAG molecules joined (--root), or your files",
    )
    anomaly.add_argument("--edges", help="--graph files: edge list (two 0-based node ids per line)")
    anomaly.add_argument("--features", help="--graph files: node features (one row per node)")
    anomaly.add_argument("--labels", help="--graph files: node labels 0/1 (else anomalies are injected)")
    anomaly.add_argument("--knn", type=count_in(1, 1000), default=10, help="neighbours of the digits graph")
    anomaly.add_argument("--cliques", type=count_in(0, 10_000), default=2, help="injected cliques (structural anomalies)")
    anomaly.add_argument("--clique-size", type=count_in(2, 10_000), default=15)
    anomaly.add_argument("--contextual", type=count_in(0, 1_000_000), default=30, help="injected contextual anomalies")
    anomaly.add_argument("--candidates", type=count_in(1, 100_000), default=50, help="candidates per contextual anomaly")
    classify = parser.add_argument_group("classify (node features, cross-validation and ensembles)")
    classify.add_argument(
        "--max-degree",
        type=count_in(0, 10_000),
        default=0,
        help="append a one-hot of the node degree (clamped to this) to the features; 0: none",
    )
    classify.add_argument(
        "--rw-steps",
        type=count_in(0, 1000),
        default=0,
        help="append random-walk return probabilities for 1..this many steps; 0: none",
    )
    classify.add_argument("--folds", type=count_in(2, 1000), default=10, help="cross-validation folds")
    classify.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="OPTION=V1,V2,...",
        help="candidate values of a model or training option (e.g. lr=1e-3,3e-3; repeat for more options), chosen "
        "per fold by an inner cross-validation of its training graphs",
    )
    classify.add_argument("--inner-folds", type=count_in(2, 1000), default=3, help="folds of the inner (selection) CV")
    classify.add_argument(
        "--ensemble",
        type=count_in(1, 1000),
        default=1,
        help="models per run, differently seeded; predictions average their probabilities",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--dim", type=count_in(1, 8192), default=64)
    model.add_argument("--heads", type=count_in(1, 256), default=4)
    model.add_argument("--head-dim", type=count_in(1, 8192), default=16)
    model.add_argument("--memories", type=count_in(1, 65536), default=128)
    model.add_argument("--pe-dim", type=count_in(0, 1000), default=15, help="Laplacian eigenvectors per node")
    model.add_argument("--hopfield", choices=("relu", "softplus", "softmax"), default="relu")
    model.add_argument("--dropout", type=float, default=0.0)
    model.add_argument("--head-hidden", type=count_in(0, 65536), default=0, help="hidden width of the read-out (0: linear)")
    model.add_argument(
        "--pool",
        choices=POOLS,
        default="cls",
        help="classify: read out the CLS token, or it with the mean or sum of the node states",
    )
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=count_in(1), default=None, help="default: 100 (classify), 300 (anomaly)")
    train.add_argument("--batch-size", type=count_in(1, 1_000_000), default=32)
    train.add_argument("--lr", type=float, default=None, help="default: 1e-3 (classify), 5e-3 (anomaly)")
    train.add_argument("--weight-decay", type=float, default=1e-4)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default="auto")
    train.add_argument(
        "--out",
        default=None,
        help="output folder (checkpoints, metrics, results): new or empty, or see --resume, --overwrite",
    )
    train.add_argument("--no-progress", action="store_true")
    add_threads_argument(train)
    add_dynamics_arguments(parser, PAPER_INTEGRATION, options=DYNAMICS_OPTIONS)
    parser.set_defaults(**{name: INTEGRATION_DEFAULTS[name] for name in DYNAMICS_OPTIONS})
    add_run_folder_arguments(parser)


def parse_grid(items: Sequence[str]) -> dict[str, list[Any]]:
    """``["lr=1e-3,3e-3", "pool=cls,cls+sum"]`` -> ``{"lr": [0.001, 0.003], "pool": ["cls", "cls+sum"]}``: values
    become int, float or bool where they read as one; dashes in names become underscores (CLI spelling)."""

    def value(text: str) -> Any:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return text

    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not name or not values:
            raise ValueError(f"--grid expects OPTION=V1,V2,..., got {item!r}")
        grid[name.strip().replace("-", "_")] = [value(v.strip()) for v in values.split(",")]
    return grid


def _model_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    model = ("dim", "heads", "head_dim", "memories", "pe_dim", "hopfield", "dropout", "head_hidden", "pool")
    return same_names(args, *model, *DYNAMICS_OPTIONS)


def load_anomaly_graph(args: argparse.Namespace) -> Any:
    """The graph named by the CLI options, with labels (injected unless given) and Laplacian encodings."""
    from et_ode.data import graphs

    if args.graph == "files":
        if not (args.edges and args.features):
            raise ValueError("--graph files needs --edges and --features (and optionally --labels)")
        graph = graphs.read_node_graph(args.edges, args.features, args.labels)
    elif args.graph == "mutag":  # encodings per molecule (the joined graph's first eigenvectors are constant per molecule)
        if not args.root:
            raise ValueError("--graph mutag needs --root, the folder holding MUTAG/raw/")
        graph = graphs.join_graphs(graphs.read_tu(args.root, args.name, pe_dim=args.pe_dim or None))
    else:
        graph = graphs.digits_knn_graph(args.knn)
    if getattr(graph, "y", None) is None or args.graph != "files":
        injected = same_names(args, "cliques", "clique_size", "contextual", "candidates", "seed")
        graph = graphs.inject_anomalies(graph, **injected)
    if args.pe_dim and args.graph != "mutag":
        graphs.add_laplacian_pe(graph, args.pe_dim)
    return graph


# Options of ``et-ode train graph`` that a resume may change: how the run executes, not what it computes.
RESUMABLE_CHANGES = ("device", "no_progress", "out", "resume", "overwrite")


def run_graph_train(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``et-ode train graph``; prints and returns the results (also written to ``--out``).

    ``--out`` is taken with :func:`et_ode.training.runs.claim` (its ``config.json`` holds the options): a folder holding
    files needs ``--resume`` (same options; finished folds are read back, the unfinished one resumes) or
    ``--overwrite``; otherwise :class:`et_ode.training.runs.RunFolderError`.
    """
    if not args.out:
        return _run_graph_train(args)
    setup = {
        k: v
        for k, v in sorted(vars(args).items())
        if isinstance(v, (str, int, float, bool, list, type(None))) and k not in ("command", "task")
    }
    with runs.claim(
        args.out,
        setup,
        resume=getattr(args, "resume", False),
        overwrite=getattr(args, "overwrite", False),
        may_change=RESUMABLE_CHANGES,
        command="train graph",
        data=files_fingerprint(_data_files(args), "graph"),
    ):
        return _run_graph_train(args)


def _data_files(args: argparse.Namespace) -> list[Path]:
    """The files the run reads: the TU data set's ``--root/NAME/raw/*.txt``, or the ``--graph files`` inputs."""
    files = [Path(f) for f in (getattr(args, name, None) for name in ("edges", "features", "labels")) if f]
    raw = Path(args.root) / args.name / "raw" if getattr(args, "root", None) else None
    if raw is not None and raw.is_dir():
        files += sorted(raw.glob("*.txt"))
    return [f for f in files if f.is_file()]


def _run_graph_train(args: argparse.Namespace) -> dict[str, Any]:
    classify = args.graph_task == "classify"
    config = TrainConfig(
        epochs=args.epochs or (100 if classify else 300),
        batch_size=args.batch_size,
        lr=args.lr or (1e-3 if classify else 5e-3),
        weight_decay=args.weight_decay,
        seed=args.seed,
        device=args.device,
        out_dir=args.out,
        resume=bool(args.out),
        progress=not args.no_progress,
    )
    if classify:
        if not args.root:
            raise ValueError("et-ode train graph classify needs --root, the folder holding NAME/raw/ (TU format)")
        from et_ode.data.graphs import read_tu

        graphs = read_tu(
            args.root, args.name, pe_dim=args.pe_dim or None, max_degree=args.max_degree, rw_steps=args.rw_steps
        )
        results = cross_validate(
            graphs,
            _model_kwargs(args),
            config,
            folds=args.folds,
            seed=args.seed,
            out_dir=args.out,
            grid=parse_grid(args.grid),
            inner_folds=args.inner_folds,
            ensemble=args.ensemble,
        )
        print(
            f"{args.name}: {args.folds}-fold test accuracy {100 * results['mean']:.2f} +- "
            f"{100 * results['std']:.2f} % (majority class {100 * results['majority']:.2f} %)"
        )
        return results
    graph = load_anomaly_graph(args)
    results = detect_anomalies(graph, _model_kwargs(args), config, seed=args.seed)
    print(f"nodes {results['nodes']}, anomalies {results['anomalies']}; test AUC / macro-F1:")
    for name in ("et", "logistic_regression", "gcn"):
        if name in results:
            print(f"  {name:20s} {results[name]['auc']:.4f} / {results[name]['macro_f1']:.4f}")
    return results
