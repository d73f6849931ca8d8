"""The native solve: an explicit embedded Runge-Kutta loop and the ET field's closed-form velocity in C (``native.c``).

On the CPU, for an energy of an identity or LayerNorm neuron with one
:class:`~et_ode.energy.energies.EnergyAttention` and one :class:`~et_ode.energy.energies.HopfieldMemory` (the ET's),
without a mask, in float32 or float64 (:func:`supports`), the whole solve runs in C calls: no dispatch of tensor
operations between the field's matrix products, which go to the BLAS PyTorch itself links (its ``sgemm_`` and
``dgemm_``). The source is built once per machine with the system's C compiler (``$CC``, else ``cc`` or ``gcc``;
``-O3 -march=native``, so the CPU's own vector extensions, probed by the compiler) into a cache folder
(``$ET_ODE_CACHE``, else ``$XDG_CACHE_HOME/et_ode`` or ``~/.cache/et_ode``), named by a hash of the source, the
compiler, its flags and the CPU's feature flags; with OpenMP where the compiler has it, so that a per-sample solve's
samples step on several threads, and a group's passes between its matrix products run on as many threads as they.
Without a compiler, the BLAS symbols or a passing probe (:func:`library`), :meth:`NativeSolve.create` answers None and
the caller goes on without.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from et_ode.energy.energies import EnergyAttention, HopfieldMemory
from et_ode.energy.model import EnergyModel
from et_ode.energy.neurons import IdentityNeuron, LayerNormNeuron

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared")
OPENMP = ("-fopenmp",)  # the groups, or a group's passes, on several threads, where the compiler has it
BUILD_SECONDS = 120  # a build that takes longer is given up (the solve goes on without)
_REALS = {torch.float32: ("float", "sgemm_", "sgemm_batch_"), torch.float64: ("double", "dgemm_", "dgemm_batch_")}
_NEURONS = {IdentityNeuron: 0, LayerNormNeuron: 1}
_HOPFIELD_FORMS = {"relu": 0, "softplus": 1, "softmax": 2}
_LOG = logging.getLogger(__name__)

_I64, _F64, _PTR = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class _Field(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("tokens", "dim", "heads", "head_dim", "memories", "neuron", "hopfield")),
        ("self_attention", _I64),
        *((name, _F64) for name in ("gamma", "eps", "hopfield_beta", "tau")),
        *((name, _PTR) for name in ("delta", "w", "beta", "gemm", "gemm_batch", "g", "p", "coef", "scores", "pointers")),
        ("threads", _I64),  # of its passes between the products
    ]


class _Solver(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("groups", "samples", "stages", "times", "logged", "degree", "width")),
        *((name, _F64) for name in ("t_end", "rtol", "atol", "error_order", "pcoeff", "icoeff", "dcoeff")),
        *((name, _F64) for name in ("safety", "factor_min", "factor_max")),
        *((name, _PTR) for name in ("matrix", "dense", "out_times", "k", "y1", "stage")),
        *((name, _PTR) for name in ("ratio", "step", "t1", "next_dt", "history")),
    ]


def cache_folder() -> Path:
    """Where built libraries are kept: ``$ET_ODE_CACHE``, else ``$XDG_CACHE_HOME/et_ode`` or ``~/.cache/et_ode``."""
    given = os.environ.get("ET_ODE_CACHE")
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "et_ode"


def _compiler() -> str | None:
    given = os.environ.get("CC")
    return shutil.which(given) if given else shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), or its name where the system does not list them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def _build(real: str) -> Path | None:
    """The library for ``real`` (``"float"`` or ``"double"``), built where the cache lacks it, with OpenMP where the
    compiler has it (else without); None without a compiler, or where the cache folder cannot be written or the build
    fails (logged)."""
    compiler = _compiler()
    if compiler is None:
        return None
    for extra in (OPENMP, ()):
        command = [compiler, *FLAGS, *extra, f"-DREAL={real}"]
        key = hashlib.sha256("\n".join([SOURCE.read_text(), *command, _cpu_flags()]).encode()).hexdigest()[:20]
        target = cache_folder() / "native" / f"et_native_{real}_{key}.so"
        if target.exists() or _compile(command, target):
            return target
    return None


def _compile(command: list[str], target: Path) -> bool:
    """Whether ``command`` (a compiler and its flags) built the source into ``target`` (atomically; logged where
    not)."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryDirectory(dir=target.parent) as folder:
            built = Path(folder) / target.name
            run = [*command, "-o", str(built), str(SOURCE), "-lm"]
            result = subprocess.run(run, capture_output=True, text=True, timeout=BUILD_SECONDS)
            if result.returncode != 0:
                _LOG.info("native solve not built with %s: %s", " ".join(command[1:]), result.stderr.strip()[:500])
                return False
            os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
    except (OSError, subprocess.TimeoutExpired) as error:
        _LOG.info("native solve not built in %s: %s", target.parent, error)
        return False
    return True


def _blas_symbol(name: str) -> int:
    """The address of the Fortran BLAS routine ``name`` in PyTorch's own libraries, or 0."""
    folder = Path(torch.__file__).parent / "lib"
    for path in sorted(folder.glob("libtorch_cpu.*")):
        try:
            return ctypes.cast(getattr(ctypes.CDLL(str(path)), name), ctypes.c_void_p).value or 0
        except (OSError, AttributeError):
            continue
    return 0


def can_build() -> bool:
    """Whether this machine has what the native solve needs: a C compiler and PyTorch's Fortran BLAS products."""
    return (
        _compiler() is not None
        and platform.system() != "Windows"
        and all(_blas_symbol(name) for name in ("sgemm_", "dgemm_"))
    )


@functools.cache
def library(dtype: torch.dtype) -> tuple[ctypes.CDLL, tuple[int, int]] | None:
    """The built library for ``dtype`` and the addresses of PyTorch's BLAS product and batched product (0: none),
    once per process, where the library builds, the product exists and the velocity passes :func:`_probe`; else
    None."""
    if dtype not in _REALS or not can_build():
        return None
    real, product, batched = _REALS[dtype]
    blas = (_blas_symbol(product), _blas_symbol(batched))
    path = _build(real)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as error:  # (a damaged file in the cache: remove it, and the next process builds it again)
        _LOG.info("native solve not loaded from %s: %s", path, error)
        path.unlink(missing_ok=True)
        return None
    lib.et_velocity.argtypes = [ctypes.c_void_p, _I64, ctypes.c_void_p, ctypes.c_void_p]
    lib.et_solve.argtypes = [ctypes.c_void_p, ctypes.c_void_p, _I64, *[ctypes.c_void_p] * 8, _I64, _I64]
    if not _probe(lib, blas, dtype):
        _LOG.info("native solve not used: its velocity does not match PyTorch's with %s", product)
        return None
    return lib, blas


def _scratch(sizes: tuple[int, ...], samples: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """The field's workspace for ``samples`` samples a call (``sizes`` as :func:`_describe`'s): one flat tensor for
    ``g`` ``(b N D)``, the projections and the coefficients ``(b N R)`` each, the scores ``(N, b H N)`` and three
    numbers per query ``(3, b H N)``, and the table
    of the per-head products' operands ``(3 b H)``."""
    n, d, heads, head_dim, memories = sizes[:5]
    rows, r = samples * n, 2 * heads * head_dim + memories
    flat = like.new_empty(rows * d + 2 * rows * r + (n + 3) * samples * heads * n)
    return flat, torch.empty(3 * samples * heads, dtype=torch.int64)


def _describe(
    sizes: tuple[int, ...],
    numbers: tuple[float, ...],
    tensors: tuple[Tensor, Tensor, Tensor],
    scratch: tuple[Tensor, Tensor],
    blas: tuple[int, int],
    threads: int = 1,
) -> _Field:
    """The field's description: ``sizes`` (tokens, dim, heads, head_dim, memories, neuron, Hopfield form,
    self-attention), ``numbers`` (gamma, eps, Hopfield beta, tau), ``tensors`` (the stacked weights ``(R, D)``, delta
    ``(D,)``, beta ``(H,)``), ``scratch`` (:func:`_scratch`'s), its passes between the matrix products (normalizing,
    softmax, memories, the stages' sums) on ``threads`` threads (a part of the rows each: the same bits on any
    number); it points into them: keep them alive while it is used."""
    w, delta, beta = tensors
    flat, table = scratch
    n, d, heads = sizes[:3]
    samples = len(table) // (3 * heads)
    rows, r = samples * n, w.shape[0]
    offsets = [0, rows * d, rows * d + rows * r, rows * d + 2 * rows * r]
    places = [flat.data_ptr() + offset * flat.element_size() for offset in offsets]
    pointers = [t.data_ptr() for t in (delta, w, beta)] + list(blas) + places + [table.data_ptr()]
    return _Field(*sizes, *numbers, *pointers, threads)


def _probe(lib: ctypes.CDLL, blas: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether the velocity of two samples of a small random model (three tokens, two heads, ReLU memories, no
    self-attention, identity neuron) matches its closed form written in PyTorch."""
    generator = torch.Generator().manual_seed(0)
    n, d, heads, y, k = 3, 5, 2, 2, 4
    w = torch.randn(2 * heads * y + k, d, generator=generator, dtype=dtype)
    x = torch.randn(2, n, d, generator=generator, dtype=dtype)
    kq = (x @ w[: 2 * heads * y].T).view(2, n, 2, heads, y).permute(2, 0, 3, 1, 4)  # (2, B, H, N, Y)
    scores = (kq[0] @ kq[1].transpose(-1, -2)).masked_fill(torch.eye(n, dtype=torch.bool), -torch.inf)
    attn = torch.softmax(scores, dim=-2)  # over the keys
    d_keys, d_queries = attn @ kq[1], attn.transpose(-1, -2) @ kq[0]  # (B, H, N, Y)
    per_token = [t.transpose(1, 2).reshape(2, n, heads * y) for t in (d_keys, d_queries)]
    expected = torch.cat([*per_token, torch.relu(x @ w[2 * heads * y :].T)], dim=-1) @ w
    tensors = (w, torch.zeros(d, dtype=dtype), torch.ones(heads, dtype=dtype))
    sizes = (n, d, heads, y, k, 0, 0, 0)
    scratch = _scratch(sizes, 2, w)  # (alive until the call returns)
    field = _describe(sizes, (1.0, 0.0, 1.0, 1.0), tensors, scratch, blas)
    got = torch.empty_like(x)
    lib.et_velocity(ctypes.byref(field), 2, x.data_ptr(), got.data_ptr())
    return bool(torch.allclose(got, expected, rtol=1e-4, atol=1e-5))


def _parts(model: EnergyModel) -> tuple[EnergyAttention, HopfieldMemory] | None:
    """The model's attention and Hopfield memory where those two are all its interactions (by exact type), else
    None."""
    parts = list(model.interactions.values())
    attention = [part for part in parts if type(part) is EnergyAttention]
    hopfield = [part for part in parts if type(part) is HopfieldMemory]
    return (attention[0], hopfield[0]) if len(parts) == 2 and len(attention) == len(hopfield) == 1 else None


def supports(model: EnergyModel, mask: object, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the native solve computes the velocity of ``model`` with ``mask`` at states of ``dtype`` on
    ``device``: on the CPU, in float32 or float64 (the model's), without a mask, for an identity or LayerNorm neuron
    and the interactions :class:`~et_ode.energy.energies.EnergyAttention` and
    :class:`~et_ode.energy.energies.HopfieldMemory`, one each."""
    parts = _parts(model)
    return (
        parts is not None
        and device.type == "cpu"
        and dtype in _REALS
        and mask is None
        and type(model.neuron) in _NEURONS
        and all(p.dtype == dtype and p.device == device for p in model.parameters())
    )


class NativeSolve:
    """One integration's native solve, under the contract of :func:`~et_ode.integrators.adaptive_loop._whole_solve`,
    for the field ``-(1/tau) dE/dg`` of ``model`` on ``groups`` groups of ``samples`` states ``(N, D)`` each (every
    group steps on its own).

    Args:
        model, tau: the ET and its time constant.
        groups: the number of groups.
        event: a group's shape ``(samples, N, D)``.
        tableau: ``(matrix (S + 1, S), dense (S, P), error_order)``: the stage-input and error weights, the dense
            output's polynomials ``b_j(theta)`` (monomial coefficients, lowest first), the embedded order plus one.
        t_end, rtol, atol: the span's end and the tolerances.
        control: ``(pcoeff, icoeff, dcoeff, safety, factor_min, factor_max)``.
        logged: the number of steps whose times each call logs.
        lib: :func:`library`'s answer for the model's dtype.

    Raises:
        ValueError: ``model`` is not of the parts the native loop computes (:func:`supports`).
    """

    def __init__(
        self,
        model: EnergyModel,
        tau: float,
        groups: int,
        event: tuple[int, int, int],
        tableau: tuple[Tensor, Tensor, int],
        t_end: float,
        rtol: float,
        atol: float,
        control: Sequence[float],
        logged: int,
        lib: tuple[ctypes.CDLL, tuple[int, int]],
    ):
        parts = _parts(model)
        if parts is None or type(model.neuron) not in _NEURONS:
            message = (
                "the native loop computes an identity or LayerNorm neuron with one EnergyAttention and one HopfieldMemory"
            )
            raise ValueError(f"model: {message}")
        self.model, self.parts, self.tau, self.groups, self.logged = model, parts, tau, groups, logged
        (self.lib, self.blas), (self.samples, tokens, dim) = lib, event
        attention, hopfield = parts
        dtype = attention.WK.dtype
        matrix, dense, order = tableau
        self.matrix, self.dense = matrix.to(dtype).contiguous(), dense.to(dtype).contiguous()
        stages, width = self.matrix.shape[1], self.samples * tokens * dim
        self.threads = max(1, min(groups, torch.get_num_threads()))  # (each with its own workspace)
        # k (G, S, M), y1 (G, M), a stage input per thread (threads, M)
        self.states = torch.empty((groups * stages + groups + self.threads) * width, dtype=dtype)
        self.numbers = torch.empty(6 * groups, dtype=torch.float64)  # ratio, step, t1, next dt (G) each, history (G, 2)
        size = self.states.element_size()
        state_at = [self.states.data_ptr() + i * width * size for i in (0, groups * stages, groups * stages + groups)]
        numbers_at = [self.numbers.data_ptr() + i * groups * self.numbers.element_size() for i in range(5)]
        sizes = (groups, self.samples, stages, 0, logged, self.dense.shape[1] - 1, width)
        settings = (t_end, rtol, atol, float(order), *control)
        self.solver = _Solver(*sizes, *settings, self.matrix.data_ptr(), self.dense.data_ptr(), 0, *state_at, *numbers_at)
        neuron, form = _NEURONS[type(model.neuron)], _HOPFIELD_FORMS[hopfield.form]
        head = (attention.heads, attention.head_dim, hopfield.memories)
        self.sizes = (tokens, dim, *head, neuron, form, int(attention.self_attention))
        self.scratch = [_scratch(self.sizes, self.samples, self.states) for _ in range(self.threads)]

    @classmethod
    def create(
        cls, model: EnergyModel, mask: object, dtype: torch.dtype, device: torch.device, **settings: object
    ) -> NativeSolve | None:
        """A native solve for states of ``dtype`` on ``device``, or None where :func:`supports` says no or
        :func:`library` has none; ``settings``: the constructor's other arguments."""
        if not supports(model, mask, dtype, device):
            return None
        lib = library(dtype)
        return None if lib is None else cls(model, lib=lib, **settings)  # type: ignore[arg-type]

    def _field(self, threads: int) -> tuple[ctypes.Array[_Field], tuple[Tensor, Tensor, Tensor]]:
        """The field's description with the model's weights at the call, one per thread (each with its workspace,
        its passes on ``threads`` threads), and the weights they point into (keep them alive while they are
        used)."""
        (attention, hopfield), neuron = self.parts, self.model.neuron
        with torch.no_grad():
            d = attention.dim
            w = torch.cat([attention.WK.reshape(-1, d), attention.WQ.reshape(-1, d), hopfield.xi])
            if isinstance(neuron, LayerNormNeuron):
                gamma, eps, delta = float(neuron.gamma), neuron.eps, neuron.delta.detach().contiguous()
            else:
                gamma, eps, delta = 1.0, 0.0, w.new_zeros(d)
        tensors = (w, delta, attention.beta.to(w.dtype))
        numbers = (gamma, eps, float(hopfield.beta), float(self.tau))
        fields = [_describe(self.sizes, numbers, tensors, scratch, self.blas, threads) for scratch in self.scratch]
        return (_Field * self.threads)(*fields), tensors

    def __call__(
        self,
        t: Tensor,
        dt: Tensor,
        history: Tensor,
        y: Tensor,
        f0: Tensor,
        begin: int,
        budget: int,
        saved: Tensor,
        times: Tensor,
        threads: int = 1,
    ) -> tuple[Tensor, ...]:
        """One call: ``_whole_solve``'s arguments (``begin`` and ``budget`` as ints), its results as a tuple (new
        tensors; the arguments are left as they are); the groups' attempts on up to ``threads`` threads (a group on
        one), or, for one group, its passes between the products on PyTorch's thread count (as its products)."""
        team = min(threads, self.threads)
        fields, alive = self._field(torch.get_num_threads() if team <= 1 else 1)
        state = (t, dt, history, y, f0, saved)
        t, dt, history, y, f0, saved = (a.clone(memory_format=torch.contiguous_format) for a in state)
        times = times.to(torch.float64).contiguous()
        log = torch.zeros((self.logged, self.groups), dtype=torch.float64)
        counters = torch.zeros(4, dtype=torch.int64)
        self.solver.times, self.solver.out_times = len(times), times.data_ptr()
        pointers = (a.data_ptr() for a in (t, dt, history, y, f0, saved, log, counters))
        self.lib.et_solve(fields, ctypes.byref(self.solver), team, *pointers, begin, budget)
        del alive
        steps, tried, accepted, failed = counters
        return t, dt, history, y, f0, saved, log, steps, tried, accepted, failed.bool()
