"""Fuzzing the public entry points (hypothesis): every call either succeeds with finite output or raises one of
its documented exceptions with the argument's name in the message, within a time bound (the deadline).

Entry points: ``EnergyTransformer`` (construction, ``energy``, ``grad_g``), ``ETField`` (construction,
``dg_dt``), ``solve``, the file loaders (``load_checkpoint``, ``load_model``, ``load_png_folder``,
``check_tu_files``; generated safetensors headers, ``.npz`` members and PNG headers) and the ``et-ode`` argument
parsing with the configs and models built from it.

Two profiles (environment variable ``ET_ODE_FUZZ``): ``default`` (the default test run: a fixed, derandomised
set of ``DEFAULT_EXAMPLES`` examples per test, a few seconds in all) and ``long`` (``make fuzz``:
``LONG_EXAMPLES`` fresh random examples per test).
"""

from __future__ import annotations

import math
import os
import re
import string
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from et_ode import Adaptive, EnergyTransformer, ETField, EulerET, Fixed, SolveError, Status, SteadyState, solve
from et_ode.integrators.solvers import ADAPTIVE_METHODS, METHODS

DEFAULT_EXAMPLES = 30
LONG_EXAMPLES = 1000
settings.register_profile(
    "et-ode-default",
    max_examples=DEFAULT_EXAMPLES,
    deadline=timedelta(seconds=10),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "et-ode-long",
    max_examples=LONG_EXAMPLES,
    deadline=timedelta(seconds=30),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
FUZZ = settings.get_profile("et-ode-long" if os.environ.get("ET_ODE_FUZZ") == "long" else "et-ode-default")

D = 4  # token size of the fuzzed models (small: each example must be quick)


def names_an_argument(error: Exception, names: tuple[str, ...]) -> bool:
    text = str(error)
    return any(re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z])", text) for name in names)


def expect(call, documented: tuple[type[Exception], ...], names: tuple[str, ...]):
    """Run ``call``; a raised exception must be documented and name one of ``names``. Returns the result or None."""
    try:
        result = call()
    except documented as error:
        event(f"raised {type(error).__name__}")
        if isinstance(error, SolveError):
            assert error.solution is None or error.solution.status is Status.FAILED
            return None
        assert names_an_argument(error, names), f"{type(error).__name__} names none of {names}: {error}"
        return None
    event("succeeded")
    return result


# ---------------------------------------------------------------------------------------------- strategies
SPECIAL = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e30, 0.0, 1e-30])
DTYPES = st.sampled_from([torch.float64] * 5 + [torch.float32, torch.float16, torch.int64])  # mostly the model's


@st.composite
def token_tensors(draw, dim: int = D):
    """A valid ``(*batch, N, D)`` float64 state, often with one flaw: an empty batch, N = 0, a wrong size or
    rank, another dtype, or a special value (NaN, inf, 1e30, ...)."""
    batch = draw(st.lists(st.integers(1, 3), max_size=2))
    n, d, dtype = draw(st.integers(1, 4)), dim, torch.float64
    flaw = draw(st.sampled_from([None, None, None, "empty", "no tokens", "size", "rank", "dtype", "value"]))
    if flaw == "empty":
        batch = [0, *batch]
    elif flaw == "no tokens":
        n = 0
    elif flaw == "size":
        d = draw(st.sampled_from([0, 1, dim + 1]))
    elif flaw == "dtype":
        dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]))
    shape = (*batch, n, d) if flaw != "rank" else tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e3]))
    if flaw == "value" and x.numel():
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(SPECIAL)
    return x.to(dtype)


@st.composite
def masks(draw, n: int):
    kind = draw(st.sampled_from(["none", "good", "batch", "wrong-size", "float", "int-pair", "list"]))
    if kind == "none":
        return None
    if kind == "list":
        return [[True]]
    size = n if kind != "wrong-size" else n + 1
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    allowed = torch.rand(size, size, generator=generator) < draw(st.floats(0.0, 1.0))
    if kind == "batch":
        allowed = allowed.expand(2, size, size)
    if kind == "float":
        return allowed.double()
    if kind == "int-pair":
        return torch.zeros(2, 3, dtype=torch.int64)
    return allowed


def small_model(dtype: torch.dtype = torch.float64, **kwargs) -> EnergyTransformer:
    torch.manual_seed(0)
    return EnergyTransformer(D, 2, 2, 6, **kwargs).to(dtype)


# ---------------------------------------------------------------------------------------------- the model
MODEL_FLAWS = {
    "dim": [0, 1, -3, 2.5, "4"],
    "heads": [0, -1],
    "head_dim": [0, -2],
    "memories": [0, -1],
    "hopfield": ["tanh", "", None],
    "beta": [math.nan, math.inf, 0.0, -1.0, [1.0, 2.0, 3.0]],
    "beta_hn": [math.nan, 0.0, -1.0, math.inf],
    "eps": [0.0, -1e-5, math.nan, math.inf],
}


@FUZZ
@given(
    hopfield=st.sampled_from(["relu", "softplus", "softmax"]),
    data=st.data(),
    flaws=st.lists(st.sampled_from(sorted(MODEL_FLAWS)), max_size=2, unique=True),
    beta=st.one_of(st.none(), st.floats(0.01, 10)),
    beta_hn=st.one_of(st.none(), st.floats(0.01, 10)),
    eps=st.floats(1e-8, 1.0),
)
def test_model_construction(hopfield, data, flaws, beta, beta_hn, eps):
    arguments = dict(dim=D, heads=2, head_dim=2, memories=5, hopfield=hopfield, beta=beta, beta_hn=beta_hn, eps=eps)
    for name in flaws:
        arguments[name] = data.draw(st.sampled_from(MODEL_FLAWS[name]), label=name)
    model = expect(lambda: EnergyTransformer(**arguments), (ValueError, TypeError), tuple(MODEL_FLAWS))
    if model is not None:
        x = torch.randn(2, 3, arguments["dim"])
        energy = model.energy(x)
        assert energy.shape == (2,) and bool(torch.isfinite(energy).all())
        assert bool(torch.isfinite(model.dE_dg(model.activation(x))).all())


@FUZZ
@given(x=token_tensors(), data=st.data(), hopfield=st.sampled_from(["relu", "softplus", "softmax"]))
def test_model_energy_and_gradient(x, data, hopfield):
    model = small_model(hopfield=hopfield)
    n = x.shape[-2] if x.dim() >= 2 else 1
    mask = data.draw(masks(max(n, 1)))
    energy = expect(lambda: model.energy(x, mask), (ValueError, TypeError), ("x", "mask"))
    if energy is not None:
        assert energy.shape == x.shape[:-2] and bool(torch.isfinite(energy).all())
    grad = expect(lambda: model.dE_dg(x, mask), (ValueError, TypeError), ("g", "mask"))
    if grad is not None:
        assert grad.shape == x.shape and bool(torch.isfinite(grad).all())


@FUZZ
@given(
    x=token_tensors(),
    tau=st.one_of(st.floats(0.1, 3), SPECIAL),
    derivative=st.sampled_from(["analytic", "analytic", "autograd", "x"]),
    backend=st.sampled_from(["auto", "auto", "fused", "reference", "gpu"]),
)
def test_field(x, tau, derivative, backend):
    field = expect(
        lambda: ETField(small_model(), tau=tau, derivative=derivative, backend=backend),
        (ValueError, TypeError),
        ("tau", "derivative", "backend"),
    )
    if field is not None:
        velocity = expect(lambda: field.dg_dt(x), (ValueError, TypeError), ("x", "mask"))
        if velocity is not None:
            assert velocity.shape == x.shape and bool(torch.isfinite(velocity).all())


# ---------------------------------------------------------------------------------------------- solve
SOLVE_NAMES = (
    "x0",
    "t",
    "solver",
    "gradient",
    "save",
    "rtol",
    "atol",
    "step_size",
    "alpha",
    "steps",
    "max_steps",
    "SteadyState.tol",
    "stop",
    "mask",
    "per_sample",
    "options",
    "Implicit",
)


VALID_SOLVES = {  # a valid set-up per kind of method; the fuzzer perturbs some of its arguments
    "adaptive": dict(t=(0.0, 0.5), rtol=1e-4, atol=1e-6),
    "fixed": dict(t=(0.0, 0.5), step=0.1),
    "et": dict(t=None, step=0.1, steps=3),
}


def solve_with(
    field: ETField,
    x0,
    t,
    mask,
    *,
    method: str,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    step: float | None = None,
    steps: int | None = 12,
    grad: str = "direct",
    steady_state: float | None = None,
    per_sample: bool = False,
    save: str = "all",
    max_steps: int = 200,
):
    """``solve`` with the fuzzed flat values put into the settings objects (which validate them)."""
    if method == "et":
        solver = EulerET(step, steps)
    elif method in ADAPTIVE_METHODS:
        solver = Adaptive(method, rtol, atol)
    elif method in METHODS:
        solver = Fixed(method, step)
    else:
        solver = method  # an unknown name: solve must refuse it
    stop = SteadyState(steady_state, per_sample=per_sample) if steady_state is not None or per_sample else None
    return solve(field.with_mask(mask), x0, t, solver=solver, gradient=grad, stop=stop, save=save, max_steps=max_steps)


BAD_VALUES = {
    "t": [(0.0, 1.0, 2.0), (1.0, 0.0), (0.0,), (0.0, math.nan), (0.0, math.inf), None, (0.0, 1e-300)],
    "rtol": [0.0, -1.0, math.nan, 1e-12],
    "atol": [0.0, math.nan, math.inf],
    "step": [None, 0.0, -0.1, math.nan, math.inf, 1e-9, 10.0],
    "steps": [None, 0, -1, 10**9, 2.5],
    "max_steps": [0, 1, 3, -5, 10**12],
    "steady_state": [1e-2, 1e-12, 0.0, math.nan, -1.0],
    "grad": ["adjoint", "implicit", "none"],
    "save": ["steps", "final", "last"],
    "per_sample": [True],
    "method": ["rk45", "euler", "dopri5", "et"],
}


@FUZZ
@given(
    x0=token_tensors(),
    data=st.data(),
    method=st.sampled_from(METHODS),
    perturb=st.lists(st.sampled_from(sorted(BAD_VALUES)), max_size=2, unique=True),
    backward=st.booleans(),
)
def test_solve(x0, data, method, perturb, backward):
    n = x0.shape[-2] if x0.dim() >= 2 else 1
    mask = data.draw(masks(max(n, 1)))
    kind = "et" if method == "et" else "adaptive" if method in ADAPTIVE_METHODS else "fixed"
    arguments = dict(VALID_SOLVES[kind], method=method, max_steps=200)
    for name in perturb:
        arguments[name] = data.draw(st.sampled_from(BAD_VALUES[name]), label=name)
    field = ETField(small_model())
    if backward and x0.is_floating_point():
        x0 = x0.detach().requires_grad_(True)
    t = arguments.pop("t")
    solution = expect(lambda: solve_with(field, x0, t, mask, **arguments), (ValueError, TypeError, SolveError), SOLVE_NAMES)
    if solution is None:
        return
    assert solution.x.shape == x0.shape and bool(torch.isfinite(solution.x).all())
    assert bool(torch.isfinite(solution.energies).all()) and solution.stats.nfe_forward >= 1
    if backward and solution.g.requires_grad:
        expect(lambda: solution.g.square().sum().backward(), (SolveError,), SOLVE_NAMES)
        if x0.grad is not None:
            assert bool(torch.isfinite(x0.grad).all())


# ---------------------------------------------------------------------------------------------- loaders
@FUZZ
@given(
    data=st.binary(max_size=400),
    cut=st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.1, 0.0]),
    flips=st.lists(st.integers(0, 10**6), max_size=4),
    kind=st.sampled_from(["random", "checkpoint", "model"]),
)
def test_loaders_on_damaged_files(tmp_path_factory, data, cut, flips, kind):
    from et_ode.training.io import load_model, save_model
    from et_ode.training.train import load_checkpoint, save_checkpoint

    folder = tmp_path_factory.mktemp("files")
    path = folder / "file"
    if kind == "checkpoint":
        save_checkpoint(path, {"model": {"w": torch.arange(6.0)}, "epoch": 1, "meta": {"a": [1, (2, 3)]}})
    elif kind == "model":
        save_model(small_model(), path)
    else:
        path.write_bytes(data)
    raw = bytearray(path.read_bytes())
    for flip in flips:
        if raw:
            raw[flip % len(raw)] ^= 0xFF
    path.write_bytes(bytes(raw[: int(len(raw) * cut) if kind != "random" else len(raw)]))
    for load in (load_checkpoint, load_model):
        expect(lambda load=load: load(path), (ValueError, FileNotFoundError), (str(path), "checkpoint", "model"))


JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
TENSOR_ENTRIES = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(["F32", "F64", "I64", "BOOL", "U8", "F16", "XX", 3]),
        "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), JSON_VALUES),
        "data_offsets": st.one_of(st.lists(st.integers(-5, 2**40), min_size=2, max_size=2), JSON_VALUES),
    }
)


@FUZZ
@given(
    metadata=st.one_of(JSON_VALUES, st.dictionaries(st.sampled_from(["format", "state", "x"]), JSON_VALUES, max_size=3)),
    entries=st.dictionaries(st.text(min_size=1, max_size=4), st.one_of(TENSOR_ENTRIES, JSON_VALUES), max_size=3),
    body=st.binary(max_size=64),
    tagged=st.booleans(),
)
def test_checkpoint_loader_on_generated_safetensors_headers(tmp_path_factory, metadata, entries, body, tagged):
    """Any JSON header (a ``__metadata__`` of any type, tensor entries of any dtype, shape and offsets): a
    checkpoint, or a named ValueError; nothing is allocated beyond the header's limits."""
    import json
    import struct

    from et_ode.training.train import load_checkpoint

    if tagged and isinstance(metadata, dict):
        metadata = {**metadata, "format": "et-ode/training-checkpoint/2"}
    header = json.dumps({"__metadata__": metadata, **entries}).encode()
    path = tmp_path_factory.mktemp("safetensors") / "checkpoint.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)
    expect(lambda: load_checkpoint(path), (ValueError,), (str(path),))


NPY_DTYPES = ["<f4", ">f4", "<f8", ">f8", "|u1", "<i8", "|b1", "|O", "<U3", "<c8"]


@FUZZ
@given(
    descr=st.sampled_from(NPY_DTYPES),
    shape=st.lists(st.integers(0, 2**33), max_size=3),
    fortran=st.booleans(),
    data=st.binary(max_size=128),
    name=st.sampled_from(["Xi", "Wk", "other"]),
    compress=st.booleans(),
)
def test_npz_reader_on_generated_members(tmp_path_factory, descr, shape, fortran, data, name, compress):
    """An ``.npz`` member with any header (dtype, shape, order) over any bytes: the arrays, or a FileFormatError
    naming the file; never an allocation beyond the header's limits."""
    import io
    import zipfile

    import numpy as np

    from et_ode.training.statefile import FileFormatError, read_npz

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": fortran, "shape": tuple(shape)})
    path = tmp_path_factory.mktemp("npz") / "member.npz"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as archive:
        archive.writestr(f"{name}.npy", buffer.getvalue() + data)
    arrays = expect(lambda: read_npz(path, ["Xi"], what="archive", allow_empty=True), (FileFormatError,), (str(path),))
    if arrays is not None:
        assert arrays["Xi"].shape == tuple(shape) and arrays["Xi"].dtype.isnative


@FUZZ
@given(contents=st.lists(st.text(alphabet=string.digits + " ,#-\n\tx", max_size=40), min_size=3, max_size=3))
def test_tu_checks_on_random_text(tmp_path_factory, contents):
    from et_ode.data.graphs import check_tu_files

    root = tmp_path_factory.mktemp("tu")
    raw = root / "G" / "raw"
    raw.mkdir(parents=True)
    for kind, text in zip(("A", "graph_indicator", "graph_labels"), contents):
        (raw / f"G_{kind}.txt").write_text(text)
    result = expect(
        lambda: check_tu_files(root, "G"), (ValueError,), ("G_A.txt", "G_graph_indicator.txt", "G_graph_labels.txt")
    )
    if result is not None:
        graphs, nodes = result
        assert graphs >= 1 and nodes >= 1


@FUZZ
@given(data=st.binary(max_size=200), suffix=st.sampled_from([".png", ".PNG", ".Png"]))
def test_png_loader_on_random_bytes(tmp_path_factory, data, suffix):
    from et_ode.data.images import load_png_folder

    folder = tmp_path_factory.mktemp("png")
    (folder / f"image{suffix}").write_bytes(data)
    expect(lambda: load_png_folder(folder), (ValueError,), (f"image{suffix}",))


@FUZZ
@given(
    width=st.integers(0, 2**31 - 1),
    height=st.integers(0, 2**31 - 1),
    depth=st.sampled_from([1, 8, 16, 3]),
    colour=st.sampled_from([0, 2, 3, 4, 6, 5]),
    rows=st.integers(0, 4),
)
def test_image_readers_on_generated_png_headers(tmp_path_factory, width, height, depth, colour, rows):
    """A PNG whose header claims any size, depth and colour type over a few rows of data: an image, or a named
    FileFormatError; a size beyond the pixel limit is refused from the header, before any decoding."""
    import struct
    import zlib

    from et_ode.data.images import MAX_IMAGE_PIXELS, read_photo, read_png
    from et_ode.training.statefile import FileFormatError

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    pixels = zlib.compress(bytes(rows * (1 + min(width, 64) * 8)))
    path = tmp_path_factory.mktemp("png") / "image.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    for read in (read_png, lambda p: read_photo(p, (4, 4))):
        image = expect(lambda read=read: read(path), (FileFormatError,), (str(path),))
        if image is not None:
            assert width * height <= MAX_IMAGE_PIXELS and image.numel() > 0


STATE_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64]


@st.composite
def saved_objects(draw):
    """What a states file may hold: a tensor of any small shape and dtype, sometimes with a special value, or another
    object (a dict of tensors, a list, a number, a string)."""
    kind = draw(st.sampled_from(["tensor"] * 6 + ["dict", "list", "number", "text"]))
    if kind == "dict":
        return {"x0": torch.zeros(1, 2, D)}
    if kind == "list":
        return [torch.zeros(2, D)]
    if kind == "number":
        return draw(st.floats(allow_nan=True))
    if kind == "text":
        return draw(st.text(max_size=8))
    shape = draw(st.lists(st.integers(0, 3), max_size=4))
    if shape and draw(st.booleans()):
        shape[-1] = D
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x = torch.randn(shape, generator=generator, dtype=torch.float64) * draw(st.sampled_from([1e-3, 1.0, 1e30]))
    if x.numel() and draw(st.booleans()):
        x.view(-1)[draw(st.integers(0, x.numel() - 1))] = draw(SPECIAL)
    return x.to(draw(st.sampled_from(STATE_DTYPES)))


@FUZZ
@given(
    value=saved_objects(),
    container=st.sampled_from(["torch", "torch", "safetensors"]),
    cut=st.sampled_from([1.0, 1.0, 1.0, 0.9, 0.5, 0.0]),
    flips=st.lists(st.integers(0, 10**6), max_size=3),
)
def test_states_loader_on_generated_files(tmp_path_factory, value, container, cut, flips):
    """``load_states`` (``et-ode analyze --x0``) on any saved object, whole or damaged: dense finite floating states
    ``(batch, N, D)`` or ``(N, D)``, or a FileFormatError naming the file; no code runs, nothing unbounded."""
    from safetensors.torch import save_file

    from et_ode.training.io import load_states
    from et_ode.training.statefile import FileFormatError

    path = tmp_path_factory.mktemp("states") / "x0.pt"
    if container == "safetensors" and isinstance(value, torch.Tensor):
        save_file({"x0": value.contiguous()}, path)
    else:
        torch.save(value, path)
    raw = bytearray(path.read_bytes())
    for flip in flips:
        raw[flip % len(raw)] ^= 0xFF
    path.write_bytes(bytes(raw[: int(len(raw) * cut)]))
    states = expect(lambda: load_states(path, D), (FileFormatError,), (str(path),))
    if states is not None:
        assert isinstance(states, torch.Tensor) and states.is_floating_point() and states.layout == torch.strided
        assert states.dim() in (2, 3) and states.shape[-1] == D and states.numel() > 0
        assert bool(torch.isfinite(states).all())


OFFICIAL_DTYPES = ["<f4", "<f8", ">f4", "<f2", "<i8", "|b1"]


@FUZZ
@given(
    key=st.sampled_from(["Xi", "Wk", "Wq", "LNORM_gamma", "LNORM_bias", "POS_embed", "Wenc", "Bdec", "CLS_token"]),
    reshape=st.sampled_from(["same", "same", "scalar", "empty", "grow", "transpose"]),
    dtype=st.sampled_from(OFFICIAL_DTYPES),
    special=st.one_of(st.none(), SPECIAL),
    seed=st.integers(0, 2**16),
)
def test_official_loader_on_generated_members(tmp_path_factory, fixtures, key, reshape, dtype, special, seed):
    """The official checkpoint with one array replaced by a generated one (another shape, dtype or byte order, a
    special value): an ImageET whose weights are finite, or a FileFormatError naming the file."""
    import numpy as np

    from et_ode.models.official import load_official
    from et_ode.training.statefile import FileFormatError

    with np.load(fixtures / "official-format" / "plaindict_ckpt.npz", allow_pickle=False) as archive:
        arrays = dict(archive)
    array = arrays[key]
    shape = {
        "same": array.shape,
        "scalar": (),
        "empty": (0, *array.shape[1:]),
        "grow": (*array.shape[:-1], array.shape[-1] + 1) if array.ndim else (2,),
        "transpose": array.shape[::-1],
    }[reshape]
    generated = np.random.default_rng(seed).normal(size=shape)
    if special is not None and generated.size:
        generated.reshape(-1)[seed % generated.size] = special
    with np.errstate(invalid="ignore", over="ignore"):
        arrays[key] = generated.astype(np.dtype(dtype))
    path = tmp_path_factory.mktemp("official") / "checkpoint.npz"
    np.savez(path, **arrays)
    model = expect(lambda: load_official(path, (3, 32, 32), 8), (FileFormatError,), (str(path),))
    if model is not None:
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ---------------------------------------------------------------------------------------------- the CLI
TRAIN_OPTIONS = {
    "--patch": st.sampled_from(["0", "1", "2", "3", "x"]),
    "--dim": st.sampled_from(["0", "1", "4", "-3"]),
    "--heads": st.sampled_from(["0", "1", "2"]),
    "--head-dim": st.sampled_from(["0", "2"]),
    "--memories": st.sampled_from(["0", "3", "-1"]),
    "--tau": st.sampled_from(["1", "0", "inf", "nan", "-1"]),
    "--mask-ratio": st.sampled_from(["0.5", "0", "1", "2", "nan"]),
    "--visible-fraction": st.sampled_from(["0", "0.1", "1", "-1"]),
    "--solver": st.sampled_from(["dopri5", "et", "rk4", "bogus"]),
    "--t1": st.sampled_from(["1", "0", "-1", "inf"]),
    "--step": st.sampled_from(["0.1", "0", "nan"]),
    "--steps": st.sampled_from(["3", "0", "-2"]),
    "--epochs": st.sampled_from(["1", "0", "-1"]),
    "--batch-size": st.sampled_from(["4", "0"]),
    "--lr": st.sampled_from(["0.001", "0", "nan", "inf", "-1"]),
    "--warmup": st.sampled_from(["0.1", "-1"]),
    "--threads": st.sampled_from(["1", "0", "100000", "two"]),
    "--device": st.sampled_from(["cpu", "auto", "tpu"]),
    "--gradient": st.sampled_from(["direct", "adjoint", "implicit", "x"]),
    "--steady-state": st.sampled_from(["0.01", "0", "-1"]),
    "--max-steps": st.sampled_from(["10", "0"]),
}


@FUZZ
@given(
    options=st.dictionaries(st.sampled_from(sorted(TRAIN_OPTIONS)), st.just(None), max_size=6),
    data=st.data(),
    flags=st.lists(st.sampled_from(["--resume", "--overwrite", "--cls-token", "--unknown"]), max_size=2),
)
def test_cli_train_image_arguments(monkeypatch, tmp_path_factory, options, data, flags):
    """Parse ``et-ode train image``, build its configs and model (the training itself is replaced): argparse exits
    with usage (SystemExit 2), or the options' values are refused by a ValueError naming the setting."""
    from et_ode import cli
    from et_ode.cli import image as cli_image
    from et_ode.tasks import image as image_task

    argv = ["train", "image", "--out", str(tmp_path_factory.mktemp("out") / "run"), *flags]
    for option in options:
        argv += [option, data.draw(TRAIN_OPTIONS[option], label=option)]
    built = {}

    def build_only(config, out_dir=None):
        built["model"] = image_task.build_model(config, (1, 8, 8))
        return {}

    monkeypatch.setattr(cli_image, "train_image", build_only)
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 2
        return
    names = tuple(option.lstrip("-").replace("-", "_") for option in options) + (
        "ratio",
        "tau",
        "patch",
        "dim",
        "heads",
        "head_dim",
        "memories",
        "lr",
        "batch_size",
        "epochs",
        "warmup",
        "device",
        "threads",
        "solver",
        "gradient",
        "t1",
        "step",
        "steps",
        "steady_state",
        "max_steps",
        "visible_fraction",
    )
    expect(lambda: cli_image._train_image_from_args(args), (ValueError, TypeError), names)


@pytest.mark.parametrize("argv", [["analyze", "--x0"], ["complete"], ["train"], ["train", "graph", "anomaly", "--knn"]])
def test_cli_usage_errors_exit_2(argv, capsys):
    from et_ode.cli import build_parser

    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2 and "error:" in capsys.readouterr().err
