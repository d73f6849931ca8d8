"""Graph data: TU files checked line by line, user files, Laplacian encodings, and the anomaly injector."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.data import Data  # noqa: E402

from et_ode.data.graphs import (  # noqa: E402
    CONTEXTUAL,
    STRUCTURAL,
    add_laplacian_pe,
    add_random_walk_features,
    check_tu_files,
    inject_anomalies,
    node_split,
    read_node_graph,
    read_tu,
)


def test_mutag_reads_with_counts_labels_and_encodings(fixtures):
    graphs = read_tu(fixtures, "MUTAG", pe_dim=15)
    assert len(graphs) == 188
    assert sum(g.num_nodes for g in graphs) == 3371
    assert sum(g.edge_index.shape[1] for g in graphs) == 7442
    assert np.bincount([int(g.y) for g in graphs]).tolist() == [63, 125]
    assert all(g.x.shape[1] == 7 and bool((g.x.sum(1) == 1).all()) for g in graphs)  # one-hot atom types
    assert all(g.pe.shape == (g.num_nodes, 15) for g in graphs)
    assert not (fixtures / "MUTAG" / "processed").exists()  # nothing written next to the data


def tu_copy(fixtures: Path, tmp_path: Path) -> Path:
    shutil.copytree(fixtures / "MUTAG" / "raw", tmp_path / "MUTAG" / "raw")
    return tmp_path / "MUTAG" / "raw"


def replace_line(path: Path, line: int, text: str) -> None:
    lines = path.read_text().splitlines()
    lines[line - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "file, line, text, message",
    [
        ("MUTAG_A.txt", 5, "2, 9999", r"MUTAG_A.txt:5: node id out of range 1..3371"),
        ("MUTAG_A.txt", 7, "2; x", r"MUTAG_A.txt:7: expected two integer node ids"),
        ("MUTAG_A.txt", 3, "1, 30", r"MUTAG_A.txt:3: edge \(1, 30\) joins graph 1 and graph 2"),
        ("MUTAG_A.txt", 4, "1, 2, 3", r"MUTAG_A.txt:4: expected 2 two integer node ids"),
        ("MUTAG_graph_indicator.txt", 3, "3", r"MUTAG_graph_indicator.txt:3: graph id 3 breaks the order"),
        ("MUTAG_graph_labels.txt", 2, "positive", r"MUTAG_graph_labels.txt:2: expected one integer graph label"),
    ],
)
def test_malformed_tu_files_name_file_and_line(fixtures, tmp_path, file, line, text, message):
    raw = tu_copy(fixtures, tmp_path)
    replace_line(raw / file, line, text)
    with pytest.raises(ValueError, match=message):
        read_tu(tmp_path, "MUTAG")


def test_missing_tu_files_and_wrong_counts(fixtures, tmp_path):
    with pytest.raises(FileNotFoundError, match="TU data set folder not found"):
        check_tu_files(tmp_path, "MUTAG")
    raw = tu_copy(fixtures, tmp_path)
    (raw / "MUTAG_node_labels.txt").write_text("0\n1\n")
    with pytest.raises(ValueError, match=r"MUTAG_node_labels.txt: 2 lines, expected 3371"):
        check_tu_files(tmp_path, "MUTAG")
    (raw / "MUTAG_graph_indicator.txt").unlink()
    with pytest.raises(FileNotFoundError, match="MUTAG_graph_indicator.txt"):
        check_tu_files(tmp_path, "MUTAG")


def test_user_node_graph_files(tmp_path):
    (tmp_path / "f.txt").write_text("# features\n0.5 1.0\n1,2\n\n3 4\n")
    (tmp_path / "e.txt").write_text("0 1\n1 2  # a comment\n")
    (tmp_path / "y.txt").write_text("0\n1\n0\n")
    graph = read_node_graph(tmp_path / "e.txt", tmp_path / "f.txt", tmp_path / "y.txt")
    assert graph.x.tolist() == [[0.5, 1.0], [1.0, 2.0], [3.0, 4.0]]
    assert sorted(map(tuple, graph.edge_index.T.tolist())) == [(0, 1), (1, 0), (1, 2), (2, 1)]
    assert graph.y.tolist() == [0, 1, 0]
    (tmp_path / "bad_e.txt").write_text("0 1\n\n2 3\n")
    with pytest.raises(ValueError, match=r"bad_e.txt:3: node id out of range 0..2"):
        read_node_graph(tmp_path / "bad_e.txt", tmp_path / "f.txt")
    (tmp_path / "bad_f.txt").write_text("1 2\n3 abc\n")
    with pytest.raises(ValueError, match=r"bad_f.txt:2: expected numbers"):
        read_node_graph(tmp_path / "e.txt", tmp_path / "bad_f.txt")
    (tmp_path / "short_y.txt").write_text("0\n1\n")
    with pytest.raises(ValueError, match=r"short_y.txt: 2 labels for 3 nodes"):
        read_node_graph(tmp_path / "e.txt", tmp_path / "f.txt", tmp_path / "short_y.txt")
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        read_node_graph(tmp_path / "missing.txt", tmp_path / "f.txt")


def test_laplacian_encodings_are_eigenvectors_of_the_normalized_laplacian():
    n = 9  # a path: distinct eigenvalues, so each eigenvector is fixed up to sign
    edges = torch.tensor([[i, i + 1] for i in range(n - 1)]).T
    graph = Data(x=torch.zeros(n, 1), edge_index=torch.cat([edges, edges.flip(0)], dim=1), num_nodes=n)
    add_laplacian_pe(graph, 4)
    degree = np.array([1] + [2] * (n - 2) + [1], dtype=float)
    adjacency = np.zeros((n, n))
    adjacency[edges[0], edges[1]] = adjacency[edges[1], edges[0]] = 1
    laplacian = np.eye(n) - adjacency / np.sqrt(np.outer(degree, degree))
    values, vectors = np.linalg.eigh(laplacian)
    pe = graph.pe.double().numpy()
    for column in range(4):  # skip the trivial eigenvector; each column = +-the next one
        overlap = abs(pe[:, column] @ vectors[:, column + 1])
        assert overlap == pytest.approx(1.0, abs=1e-5)
    small = Data(x=torch.zeros(3, 1), edge_index=torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]]), num_nodes=3)
    assert add_laplacian_pe(small, 5).pe[:, 2:].abs().max() == 0  # padded: only n - 1 = 2 non-trivial vectors


def ring_graph(n: int = 200, features: int = 5) -> Data:
    torch.manual_seed(0)
    nodes = torch.arange(n)
    edges = torch.stack([nodes, (nodes + 1) % n])
    return Data(x=torch.randn(n, features), edge_index=torch.cat([edges, edges.flip(0)], dim=1))


def test_injector_counts_kinds_and_determinism():
    graph = ring_graph()
    out = inject_anomalies(graph, cliques=2, clique_size=5, contextual=7, candidates=20, seed=3)
    kind = out.anomaly_kind
    assert int((kind == STRUCTURAL).sum()) == 10 and int((kind == CONTEXTUAL).sum()) == 7
    assert torch.equal(out.y, (kind > 0).long())
    # structural: features kept, and the 10 nodes form exactly two complete groups of 5 among the new edges
    structural = (kind == STRUCTURAL).nonzero().squeeze(1)
    assert torch.equal(out.x[structural], graph.x[structural])
    old = set(map(tuple, graph.edge_index.T.tolist()))
    new = set(map(tuple, out.edge_index.T.tolist())) - old
    assert old <= set(map(tuple, out.edge_index.T.tolist()))
    neighbours = {int(i): {b for a, b in new if a == i} for i in structural}
    groups = {frozenset(neighbours[i] | {i}) for i in neighbours}
    assert len(groups) == 2 and all(len(group) == 5 for group in groups)
    assert all(a in neighbours and b in neighbours for a, b in new)
    # contextual: each gets another node's original features, far from its own; the rest are untouched
    contextual = (kind == CONTEXTUAL).nonzero().squeeze(1)
    distances = torch.cdist(graph.x, graph.x)
    for i in contextual:
        source = int((graph.x == out.x[i]).all(dim=1).nonzero()[0])
        assert source != int(i)
        assert distances[i, source] > distances[i].median()  # the farthest of 20 beats the median
    normal = kind == 0
    assert torch.equal(out.x[normal], graph.x[normal])
    again = inject_anomalies(graph, cliques=2, clique_size=5, contextual=7, candidates=20, seed=3)
    assert torch.equal(again.x, out.x) and torch.equal(again.edge_index, out.edge_index)
    other = inject_anomalies(graph, cliques=2, clique_size=5, contextual=7, candidates=20, seed=4)
    assert not torch.equal(other.anomaly_kind, out.anomaly_kind)
    with pytest.raises(ValueError, match="cannot inject 210 anomalies"):
        inject_anomalies(graph, cliques=10, clique_size=20, contextual=10)


def test_node_split_is_stratified_and_disjoint():
    labels = torch.tensor([1] * 20 + [0] * 180)
    masks = node_split(labels, (0.6, 0.2, 0.2), seed=1)
    assert torch.equal(masks["train"].int() + masks["val"].int() + masks["test"].int(), torch.ones(200, dtype=torch.int))
    assert [int(labels[masks[k]].sum()) for k in ("train", "val", "test")] == [12, 4, 4]


def test_random_walk_features_are_return_probabilities_of_matrix_powers():
    graph = Data(
        x=torch.ones(5, 1), edge_index=torch.tensor([[0, 1, 1, 2, 2, 3, 3, 0, 0, 4], [1, 0, 2, 1, 3, 2, 0, 3, 4, 0]])
    )
    add_random_walk_features(graph, 4)
    adjacency = torch.zeros(5, 5, dtype=torch.float64)
    adjacency[graph.edge_index[0], graph.edge_index[1]] = 1.0
    walk = adjacency / adjacency.sum(1, keepdim=True)  # P = D^-1 A
    expected = torch.stack([torch.linalg.matrix_power(walk, t).diagonal() for t in range(1, 5)], dim=1)
    assert graph.x.shape == (5, 5)
    torch.testing.assert_close(graph.x[:, 1:].double(), expected, rtol=1e-6, atol=1e-6)
    assert float(graph.x[0, 1]) == 0.0 and abs(float(graph.x[4, 2]) - 1 / 3) < 1e-6  # leaf 4 -> 0 -> 4: 1/3
    with pytest.raises(ValueError, match="rw_steps must be a positive integer"):
        add_random_walk_features(graph, 0)


def test_laplacian_encoding_is_the_same_on_every_call_of_a_large_graph():
    """Past PyG's sparse threshold the eigenvectors come from ARPACK, whose start vector is otherwise drawn from
    ARPACK's per-process state: three calls in one process gave three encodings (column signs flipped)."""
    generator = torch.Generator().manual_seed(0)
    n = 300
    edges = torch.randint(0, n, (2, 1500), generator=generator)
    graph = Data(edge_index=torch.cat([edges, edges.flip(0)], dim=1), num_nodes=n)
    encodings = [add_laplacian_pe(graph.clone(), 8).pe for _ in range(3)]
    assert all(torch.equal(encodings[0], other) for other in encodings[1:])
    assert not torch.equal(encodings[0], add_laplacian_pe(graph.clone(), 8, seed=1).pe)
