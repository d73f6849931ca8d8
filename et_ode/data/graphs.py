"""Graph data from local files (nothing is downloaded), Laplacian positional encodings, and anomaly injection.

Graphs are PyTorch Geometric ``Data`` objects: ``x (n, F)`` float32 node features, ``edge_index (2, E)`` long
(both directions of every undirected edge), ``pe (n, k)`` Laplacian eigenvector encodings once
:func:`add_laplacian_pe` ran, ``y`` the graph label ``(1,)`` (classification) or node labels ``(n,)``. The sources:
:func:`read_tu` (a TU-format data set such as MUTAG, checked line by line before PyG's ``TUDataset`` reads it),
:func:`digits_knn_graph` (the k-nearest-neighbour graph of scikit-learn's digit images), :func:`join_graphs` (many
graphs as one disjoint graph) and :func:`read_node_graph` (an edge-list file, a feature file and optionally a
node-label file). :func:`inject_anomalies` plants structural and contextual anomalies, the standard protocol of
graph anomaly detection benchmarks.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from et_ode.backend.validation import check_positive
from et_ode.data._files import check_file

if TYPE_CHECKING:  # an optional dependency (extra `graph`), imported where a function needs it
    from torch_geometric.data import Data

NORMAL, CONTEXTUAL, STRUCTURAL = 0, 1, 2
TU_REQUIRED = ("A", "graph_indicator", "graph_labels")


def _require_pyg() -> None:
    try:
        import torch_geometric  # noqa: F401
    except ImportError as error:  # pragma: no cover - the dev and graph extras install it
        raise ImportError("graph data needs PyTorch Geometric: pip install 'et-ode[graph]'") from error


# ------------------------------------------------------------------------------------------------ text files
MAX_TEXT_BYTES = 2**28  # the largest text file read (256 MiB), checked before reading (a link to /dev/zero is refused)
MAX_LINE_CHARACTERS = 2**20  # the longest line of such a file (a row of values)


def _bounded_int(text: str) -> int:
    """An integer that fits int64 arrays with room to spare (ValueError otherwise)."""
    value = int(text)
    if not -(2**62) < value < 2**62:
        raise ValueError(f"{value} is out of range")
    return value


def _read_rows(
    path: Path, parse: Callable[[str], float | int], columns: int | None = None, what: str = "values"
) -> list[list]:
    """Rows of numbers, separated by commas and/or whitespace; blank lines and ``#`` comments are skipped.

    Raises ValueError naming ``path:line`` for a value that does not parse or a row of the wrong length.
    """
    if not path.exists():
        raise FileNotFoundError(f"missing file: {path}")
    check_file(path, "text file", MAX_TEXT_BYTES)
    if parse is int:
        parse = _bounded_int
    rows: list[list] = []
    with open(path, encoding="utf-8", errors="strict") as file:
        lines = enumerate(file, start=1)
        while True:
            try:
                number, line = next(lines)
            except StopIteration:
                return rows
            except UnicodeDecodeError:
                raise ValueError(f"{path}: not a text file (bytes that are not UTF-8)") from None
            if len(line) > MAX_LINE_CHARACTERS:
                raise ValueError(
                    f"{path}:{number}: a line of {len(line)} characters, more than the "
                    f"{MAX_LINE_CHARACTERS} of a row of {what}"
                )
            text = line.split("#", 1)[0].replace(",", " ").split()
            if not text:
                continue
            try:
                row = [parse(value) for value in text]
            except ValueError:
                raise ValueError(f"{path}:{number}: expected {what}, got {line.strip()[:100]!r}") from None
            if columns is None:
                columns = len(row)
            if len(row) != columns:
                raise ValueError(
                    f"{path}:{number}: expected {columns} {what} per line (as on the first line), "
                    f"got {len(row)}: {line.strip()[:100]!r}"
                )
            rows.append(row)


def _line_of(path: Path, index: int) -> int:
    """The 1-based line number of the ``index``-th data row of ``path`` (blank lines and comments skipped)."""
    seen = -1
    with open(path) as file:
        for number, line in enumerate(file, start=1):
            if line.split("#", 1)[0].strip():
                seen += 1
                if seen == index:
                    return number
    return seen + 1


def check_tu_files(root: str | Path, name: str) -> tuple[int, int]:
    """Check a TU-format folder ``root/name/raw`` line by line; return (graphs, nodes).

    Raises FileNotFoundError (a missing file or folder, named) or ValueError (``file:line: what is wrong``):
    non-integer entries, node ids outside ``1..N``, edges between graphs, unsorted graph ids, wrong line counts.
    """
    folder = Path(root) / name / "raw"
    if not folder.is_dir():
        raise FileNotFoundError(f"TU data set folder not found: {folder} (expected root/{name}/raw/{name}_A.txt ...)")
    path = {
        kind: folder / f"{name}_{kind}.txt"
        for kind in (*TU_REQUIRED, "node_labels", "node_attributes", "edge_labels", "edge_attributes")
    }
    for kind in TU_REQUIRED:
        if not path[kind].exists():
            raise FileNotFoundError(f"missing file of the TU data set {name!r}: {path[kind]}")
    indicator = np.array(_read_rows(path["graph_indicator"], int, 1, "one integer graph id")).reshape(-1)
    nodes = len(indicator)
    if nodes == 0:
        raise ValueError(f"{path['graph_indicator']}: no nodes")
    graphs = int(indicator.max())
    steps = np.diff(indicator)
    breaks = np.nonzero((steps < 0) | (steps > 1))[0] + 1
    if indicator[0] != 1 or len(breaks):
        i = 0 if indicator[0] != 1 else int(breaks[0])
        raise ValueError(
            f"{path['graph_indicator']}:{_line_of(path['graph_indicator'], i)}: graph id "
            f"{indicator[i]} breaks the order 1, 1, ..., 2, ... (ids must start at 1, be sorted and "
            f"leave no gaps)"
        )
    edges = np.array(_read_rows(path["A"], int, 2, "two integer node ids 'i, j'"), dtype=np.int64).reshape(-1, 2)
    if len(edges) == 0:
        raise ValueError(f"{path['A']}: no edges (the file has no 'i, j' lines); a TU data set lists its edges there")
    bad = np.nonzero((edges < 1) | (edges > nodes))[0]
    if len(bad):
        raise ValueError(
            f"{path['A']}:{_line_of(path['A'], int(bad[0]))}: node id out of range 1..{nodes} "
            f"(the number of lines of {path['graph_indicator'].name}): {edges[bad[0]].tolist()}"
        )
    across = np.nonzero(indicator[edges[:, 0] - 1] != indicator[edges[:, 1] - 1])[0]
    if len(across):
        i, j = edges[across[0]]
        raise ValueError(
            f"{path['A']}:{_line_of(path['A'], int(across[0]))}: edge ({i}, {j}) joins graph "
            f"{indicator[i - 1]} and graph {indicator[j - 1]}"
        )
    labels = _read_rows(path["graph_labels"], int, 1, "one integer graph label")
    _check_categories(path["graph_labels"], labels, "graph label")
    if len(labels) != graphs:
        raise ValueError(
            f"{path['graph_labels']}: {len(labels)} labels for {graphs} graphs (graph ids in {path['graph_indicator'].name})"
        )
    for kind, parse, count in (
        ("node_labels", int, nodes),
        ("node_attributes", float, nodes),
        ("edge_labels", int, len(edges)),
        ("edge_attributes", float, len(edges)),
    ):
        if path[kind].exists():
            rows = _read_rows(path[kind], parse, None, "integers" if parse is int else "numbers")
            if parse is int:
                _check_categories(path[kind], rows, kind[:-1].replace("_", " "))
            if len(rows) != count:
                raise ValueError(
                    f"{path[kind]}: {len(rows)} lines, expected {count} (one per "
                    f"{'node' if kind.startswith('node') else 'edge'})"
                )
    return graphs, nodes


MAX_CATEGORIES = 10_000  # the widest one-hot (max - min + 1 label values) a TU label file may ask for


def _check_categories(path: Path, rows: list[list[int]], what: str) -> None:
    """Integer labels are category ids, one-hot encoded (node and edge labels) or class indices (graph labels):
    their range must stay below :data:`MAX_CATEGORIES`."""
    if not rows:
        return
    values = np.array(rows, dtype=np.int64)
    low = int(values.min())
    too_big = np.nonzero((values - low).max(axis=1) >= MAX_CATEGORIES)[0]
    if len(too_big):
        row = int(too_big[0])
        raise ValueError(
            f"{path}:{_line_of(path, row)}: {what} {int(values[row].max())} spans "
            f"{int(values[row].max()) - low + 1} category ids from the smallest, {low} (more than "
            f"{MAX_CATEGORIES}); labels are category ids (0..C-1 or 1..C), one-hot encoded per value"
        )


def _normalised_copy(source: Path, target: Path) -> None:
    """``source`` (a TU raw folder) copied to ``target`` with the ``.txt`` files rewritten as PyG's reader wants
    them: no blank lines or ``#`` comments, values separated by ", "."""
    target.mkdir(parents=True)
    for file in source.iterdir():
        if file.suffix != ".txt":
            continue
        check_file(file, "text file", MAX_TEXT_BYTES)
        lines = (line.split("#", 1)[0].replace(",", " ").split() for line in file.read_text().splitlines())
        (target / file.name).write_text("".join(", ".join(values) + "\n" for values in lines if values))


def read_tu(root: str | Path, name: str, *, pe_dim: int | None = 15, max_degree: int = 0, rw_steps: int = 0) -> list:
    """A TU-format data set as a list of PyG ``Data`` graphs (labels mapped to ``0..C-1``).

    Args:
        root: the folder holding ``name/raw/`` (PyG's layout: ``root/MUTAG/raw/MUTAG_A.txt`` and its siblings for MUTAG).
        name: the data set's name, the prefix of its files (``"MUTAG"``).
        pe_dim: add Laplacian eigenvector encodings ``pe (n, pe_dim)`` (None: none).
        max_degree: if > 0, append a one-hot of the node degree (clamped) to ``x`` (:func:`add_degree_features`).
        rw_steps: if > 0, append random-walk return probabilities for 1..rw_steps steps to ``x``
            (:func:`add_random_walk_features`).

    The files are checked first (:func:`check_tu_files`: ValueError naming ``file:line``); PyG's ``TUDataset`` then
    reads a normalised copy in a temporary folder, so nothing is written next to the data. Node labels become
    one-hot features ``x``.
    """
    _require_pyg()
    from torch_geometric.datasets import TUDataset

    check_tu_files(root, name)
    with tempfile.TemporaryDirectory(prefix="et_ode_tu_") as tmp:
        _normalised_copy(Path(root) / name / "raw", Path(tmp) / name / "raw")
        dataset = TUDataset(tmp, name)
        graphs = [dataset[i] for i in range(len(dataset))]
    for graph in graphs:
        if graph.x is None:  # no node labels or attributes: a constant feature
            graph.x = torch.ones(graph.num_nodes, 1)
        graph.x = graph.x.float()
        if max_degree:
            add_degree_features(graph, max_degree)
        if rw_steps:
            add_random_walk_features(graph, rw_steps)
        if pe_dim:
            add_laplacian_pe(graph, pe_dim)
    return graphs


# ------------------------------------------------------------------------------------------------ encodings
def add_laplacian_pe(data: Data, k: int = 15, *, seed: int = 0) -> Data:
    """Set ``data.pe`` ``(n, k)``: eigenvectors of the symmetric normalized Laplacian for the ``k`` smallest
    non-trivial eigenvalues (PyG's ``AddLaplacianEigenvectorPE``), zero-padded when ``n <= k``.

    The eigenvectors' signs are arbitrary; models flip them at random during training. ``seed`` fixes what the
    transform draws: the signs, and on graphs past PyG's sparse threshold the start vector of ARPACK's Lanczos
    iteration (``scipy.sparse.linalg.eigsh``), which otherwise comes from ARPACK's own per-process random state, so
    that the same graph gets the same encoding on every call and in every process.
    """
    _require_pyg()
    from torch_geometric.transforms import AddLaplacianEigenvectorPE

    check_positive("k (pe_dim)", k, integer=True)
    n = data.num_nodes
    if n <= 1:
        data.pe = torch.zeros(n, k)
        return data
    sparse = n >= AddLaplacianEigenvectorPE.SPARSE_THRESHOLD
    use = min(k, n - 2) if sparse else min(k, n - 1)
    start = dict(v0=np.random.default_rng(seed).uniform(-1.0, 1.0, n)) if sparse else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pe = AddLaplacianEigenvectorPE(use, attr_name="pe", is_undirected=True, **start)(data.clone()).pe
    data.pe = torch.cat([pe.float(), torch.zeros(n, k - pe.shape[1])], dim=1)
    return data


def add_degree_features(data: Data, max_degree: int) -> Data:
    """Append a one-hot of each node's in-degree (clamped to ``max_degree``) to ``data.x``: ``F -> F + max_degree + 1``."""
    check_positive("max_degree", max_degree, integer=True)
    degree = torch.bincount(data.edge_index[1], minlength=data.num_nodes).clamp(max=max_degree)
    data.x = torch.cat([data.x, torch.nn.functional.one_hot(degree, max_degree + 1).to(data.x.dtype)], dim=1)
    return data


def add_random_walk_features(data: Data, steps: int) -> Data:
    """Append each node's random-walk return probabilities ``[(P^t)_AA for t = 1..steps]`` to ``data.x``
    (``P = D^-1 A``; PyG's ``AddRandomWalkPE``): ``F -> F + steps``. Unlike eigenvectors they have no sign
    ambiguity, and they see rings (a node of a 6-ring returns at ``t = 6`` along the ring)."""
    _require_pyg()
    from torch_geometric.transforms import AddRandomWalkPE

    check_positive("rw_steps", steps, integer=True)
    walk = AddRandomWalkPE(steps, attr_name="rw")(data.clone()).rw
    data.x = torch.cat([data.x, walk.to(data.x.dtype)], dim=1)
    return data


# ------------------------------------------------------------------------------------------------ node graphs
def digits_knn_graph(k: int = 10) -> Data:
    """The symmetric k-nearest-neighbour graph of scikit-learn's 8x8 digits (1,797 nodes).

    ``x (1797, 64)``: pixels scaled to ``[0, 1]``; ``y``: the digit; an edge joins two images when one is among
    the other's ``k`` nearest (Euclidean) neighbours.
    """
    _require_pyg()
    from sklearn.datasets import load_digits
    from sklearn.neighbors import kneighbors_graph
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    adjacency = kneighbors_graph(digits.data, k, mode="connectivity", include_self=False).tocoo()
    edge_index = to_undirected(torch.tensor(np.stack([adjacency.row, adjacency.col]), dtype=torch.long), num_nodes=len(x))
    return Data(x=x, edge_index=edge_index, y=torch.tensor(digits.target, dtype=torch.long))


def join_graphs(graphs: Sequence[Data]) -> Data:
    """Many graphs as one disjoint graph (node ids offset; ``graph_id (n,)`` names each node's graph).

    Per-graph attributes (``pe``) are concatenated, so encodings computed per graph stay per graph.
    """
    _require_pyg()
    from torch_geometric.data import Batch, Data

    batch = Batch.from_data_list(list(graphs))
    joined = Data(x=batch.x, edge_index=batch.edge_index, graph_id=batch.batch)
    if getattr(batch, "pe", None) is not None:
        joined.pe = batch.pe
    return joined


def read_node_graph(edges: str | Path, features: str | Path, labels: str | Path | None = None) -> Data:
    """A user's graph for node scoring.

    Args:
        edges: text file, one edge per line, two 0-based node ids ``i j`` (or ``i,j``); taken as undirected.
        features: text file, one node per line (line order = node id), the same number of numbers on each.
        labels: optional text file, one integer per node (1 anomalous, 0 normal).

    Blank lines and ``#`` comments are skipped. Errors name the file and line: a value that does not parse,
    a row of the wrong length, a node id outside ``0..n-1``, label counts that differ from the node count.
    """
    _require_pyg()
    from torch_geometric.data import Data
    from torch_geometric.utils import to_undirected

    edges, features = Path(edges), Path(features)
    x = torch.tensor(_read_rows(features, float, None, "numbers"), dtype=torch.float32)
    if len(x) == 0:
        raise ValueError(f"{features}: no nodes (no feature rows)")
    if not bool(torch.isfinite(x).all()):
        row = int((~torch.isfinite(x)).any(dim=1).nonzero()[0])
        raise ValueError(f"{features}:{_line_of(features, row)}: non-finite feature (nan or inf)")
    pairs = torch.tensor(_read_rows(edges, int, 2, "two integer node ids 'i j'"), dtype=torch.long).reshape(-1, 2)
    bad = ((pairs < 0) | (pairs >= len(x))).any(dim=1).nonzero()
    if len(bad):
        row = int(bad[0])
        raise ValueError(
            f"{edges}:{_line_of(edges, row)}: node id out of range 0..{len(x) - 1} (the rows of "
            f"{features.name}): {pairs[row].tolist()}"
        )
    data = Data(x=x, edge_index=to_undirected(pairs.T.contiguous(), num_nodes=len(x)))
    if labels is not None:
        labels = Path(labels)
        y = torch.tensor(_read_rows(labels, int, 1, "one integer label (0 normal, 1 anomalous)"), dtype=torch.long).reshape(
            -1
        )
        if len(y) != len(x):
            raise ValueError(f"{labels}: {len(y)} labels for {len(x)} nodes (the rows of {features.name})")
        if bool(((y != 0) & (y != 1)).any()):
            row = int(((y != 0) & (y != 1)).nonzero()[0])
            raise ValueError(f"{labels}:{_line_of(labels, row)}: label {int(y[row])} is not 0 or 1")
        data.y = y
    return data


# ------------------------------------------------------------------------------------------------ anomalies
def inject_anomalies(
    data: Data, *, cliques: int = 2, clique_size: int = 15, contextual: int = 30, candidates: int = 50, seed: int = 0
) -> Data:
    """A copy of ``data`` with injected anomalies, the protocol of Ding et al. (SDM 2019) and PyGOD.

    1. Draw ``cliques * clique_size + contextual`` distinct nodes uniformly at random (a ``numpy`` generator seeded
       with ``seed``). The first ``cliques * clique_size`` become structural anomalies, in consecutive groups of
       ``clique_size``; the rest become contextual anomalies.
    2. Structural: connect every pair inside each group (both directions), so each group becomes a clique of
       otherwise unrelated nodes. Their features are unchanged.
    3. Contextual: for each chosen node ``i``, draw ``candidates`` other nodes uniformly (without replacement) and
       replace ``x_i`` by the original features of the candidate farthest from ``x_i`` in Euclidean distance. Its
       edges are unchanged. (Distances and copies use the features before injection.)

    Returns a ``Data`` with the new ``x`` and ``edge_index``, ``y (n,)`` long (1 anomalous) and
    ``anomaly_kind (n,)`` long (0 normal, 1 contextual, 2 structural). The same ``seed`` gives the same result.
    Other attributes (e.g. ``pe``) are copied unchanged: call :func:`add_laplacian_pe` afterwards for encodings
    that see the injected cliques.
    """
    _require_pyg()
    from torch_geometric.utils import coalesce

    n = data.num_nodes
    for name, value, low in (
        ("cliques", cliques, 0),
        ("clique_size", clique_size, 2),
        ("contextual", contextual, 0),
        ("candidates", candidates, 1),
    ):
        if not (isinstance(value, int) and value >= low):
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    total = cliques * clique_size + contextual
    if total > n:
        raise ValueError(f"cannot inject {total} anomalies (cliques * clique_size + contextual) into {n} nodes")
    if candidates > n - 1:
        raise ValueError(f"candidates must be at most n - 1 = {n - 1}, got {candidates}")
    rng = np.random.default_rng(seed)
    chosen = rng.choice(n, size=total, replace=False)
    structural, contextual_nodes = chosen[: cliques * clique_size], chosen[cliques * clique_size :]
    x_old = data.x
    x = x_old.clone()
    for i in contextual_nodes:
        others = rng.choice(n - 1, size=candidates, replace=False)
        others = others + (others >= i)  # skip i itself
        distance = (x_old[others] - x_old[i]).norm(dim=1)
        x[i] = x_old[others[int(distance.argmax())]]
    new_edges = []
    for clique in structural.reshape(cliques, clique_size):
        group = torch.as_tensor(clique, dtype=torch.long)
        pairs = torch.cartesian_prod(group, group).T
        new_edges.append(pairs[:, pairs[0] != pairs[1]])
    edge_index = coalesce(torch.cat([data.edge_index, *new_edges], dim=1), num_nodes=n)
    kind = torch.zeros(n, dtype=torch.long)
    kind[torch.as_tensor(structural, dtype=torch.long)] = STRUCTURAL
    kind[torch.as_tensor(contextual_nodes, dtype=torch.long)] = CONTEXTUAL
    out = data.clone()
    out.x, out.edge_index, out.y, out.anomaly_kind = x, edge_index, (kind > 0).long(), kind
    return out


def node_split(labels: Tensor, fractions: Sequence[float] = (0.6, 0.2, 0.2), *, seed: int = 0) -> dict[str, Tensor]:
    """Stratified train/val/test boolean node masks ``(n,)`` with the given fractions (summing to 1)."""
    from sklearn.model_selection import train_test_split

    if len(fractions) != 3 or min(fractions) <= 0 or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"fractions must be three positive numbers summing to 1, got {tuple(fractions)}")
    index = np.arange(len(labels))
    y = labels.cpu().numpy()
    train, rest = train_test_split(index, train_size=fractions[0], stratify=y, random_state=seed)
    val, test = train_test_split(
        rest, train_size=fractions[1] / (fractions[1] + fractions[2]), stratify=y[rest], random_state=seed
    )
    masks = {}
    for name, part in (("train", train), ("val", val), ("test", test)):
        mask = torch.zeros(len(labels), dtype=torch.bool)
        mask[torch.as_tensor(part)] = True
        masks[name] = mask
    return masks
