"""et-ode's own embedded Runge-Kutta loop (dopri5, tsit5, bosh3), step-size control per sample or shared by the batch.

The state is held as ``G`` groups of ``M`` numbers, ``(G, 1, M)``: per sample (``per_sample=True``) a group is one
sample (``G = batch``, ``M = N * D``); shared, the whole batch is one group (``G = 1``: torchdiffeq's semantics).
Each group has its own time, step size, error norm and accept/reject, and a group that reaches the end or passes a
steady-state stop leaves the active batch. Every operation on a group reads that group's numbers only, so a sample's
trajectory does not depend on the batch around it wherever the field's own evaluation does not. The controller is
diffrax's PID form (torchdiffeq's I-controller a special case); the states at output times inside a step come from
the method's interpolant; each step costs one host synchronisation. Gradients run through the loop by autograd or by
the adjoint (:class:`_Adjoint`), the stop time's own term added by the implicit function theorem. The solving guide
("et-ode's adaptive loop") gives the details.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Literal, NamedTuple, TypeGuard, cast

import torch
from torch import Tensor

from et_ode.dynamics.field import ETField
from et_ode.integrators.solution import Progress, SolveError, Status
from et_ode.integrators.solvers import BUDGET_ADVICE, Adaptive, SolverFailure
from et_ode.integrators.stopping import SteadyState, within_tol
from et_ode.kernels.native import NativeSolve

SAFETY, FACTOR_MIN, FACTOR_MAX = 0.9, 0.2, 10.0
BISECTIONS = 30  # a stop's crossing is first located to 2^-30 of its step on the interpolant,
NEWTON = 3  # then refined by Newton steps with the field's velocity,
CROSSING_SLACK = 1e-6  # and kept where the test's value log(measure / tol) is at most this
I_CONTROLLER = (0.0, 1.0, 0.0)  # (pcoeff, icoeff, dcoeff)
PID_COEFFICIENTS = (0.4, 0.3, 0.0)  # one of diffrax's suggestions for error estimates that do not vary smoothly
UNDERFLOW_ADVICE = (
    "the dynamics overflowed or became too stiff for the solver there: use float64 (x0 and model), "
    "tighter rtol/atol, or smaller weights; or t lies far from 0, where the step does not move the time in "
    "float64 (the field does not depend on time: start t nearer 0)"
)

StepCallback = Callable[[Tensor, Tensor], None]
CaptureMode = Literal["cuda", "eager"]  # how a step is captured and replayed (_StepGraph)
# a step captured, the whole solve compiled, or the whole solve in the native loop where it runs it
GraphMode = CaptureMode | Literal["compile", "native"]
StopTest = Callable[[Tensor, Tensor], Tensor]
# a quantity integrated along the accepted steps, outside step control: called with the accepted groups' ids (n,),
# the indices j of the stages the solution weighs, a function giving stage j's input (n, 1, M) (formed when asked)
# and their weights b_j * dt ((n,) each)
Quadrature = Callable[[Tensor, list[int], Callable[[int], Tensor], list[Tensor]], None]
WARM_STEPS = 2  # shared steps run eagerly before a step is captured (they initialise the libraries' lazy state)
NON_FINITE_ADVICE = "a NaN or inf in the start, the parameters or the field's output (overflow: use float64)"


@dataclass(frozen=True)
class Tableau:
    """An explicit embedded pair whose last stage is evaluated at the solution (first same as last).

    ``c``: the stage times ``(S,)`` as fractions of the step; ``a``: the weights of the stage inputs of stages
    ``1 .. S-1`` (row ``i-1`` has ``i`` entries; the last row gives the solution); ``e``: the error weights ``(S,)``
    (solution minus embedded solution); ``error_order``: the order of the embedded solution plus one; ``mid``: the
    weights of the midpoint state of the quartic interpolant; ``dense``: the method's own interpolant as the
    polynomials ``b_j(theta)`` of ``y(t0 + theta h) = y0 + h sum_j b_j(theta) k_j``, one tuple of monomial
    coefficients (lowest first) per stage; neither: the Hermite cubic.
    """

    c: tuple[float, ...]
    a: tuple[tuple[float, ...], ...]
    e: tuple[float, ...]
    error_order: int
    mid: tuple[float, ...] | None = None
    dense: tuple[tuple[float, ...], ...] | None = None

    @property
    def stages(self) -> int:
        return len(self.c)

    def matrix(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``(S + 1, S)``: rows ``0 .. S-2`` the stage inputs (zero-padded), row ``S-1`` the error, row ``S`` the
        midpoint (zeros without one); a step's weights are ``dt`` times these."""
        s = self.stages
        rows = [list(row) + [0.0] * (s - len(row)) for row in self.a]
        rows += [list(self.e), list(self.mid) if self.mid is not None else [0.0] * s]
        return torch.tensor(rows, dtype=torch.float64).to(dtype=dtype, device=device)

    def polynomials(self) -> tuple[tuple[float, ...], ...]:
        """The interpolant as the polynomials ``b_j(theta)`` of ``y(t0 + theta h) = y0 + h sum_j b_j(theta) k_j``
        (monomial coefficients, lowest first, one tuple per stage): ``dense``, or the quartic through the midpoint
        (``y1``, the midpoint and the first stage's ``k_0`` written in the stages), or the Hermite cubic."""
        if self.dense is not None:
            return self.dense
        s = self.stages
        first, last = [float(j == 0) for j in range(s)], [float(j == s - 1) for j in range(s)]
        solution = [*self.a[-1], 0.0]
        if self.mid is None:  # theta (1 - theta)^2 k0 + theta^2 (3 - 2 theta) b - theta^2 (1 - theta) k_last
            return tuple((0.0, f, -2 * f + 3 * b - e, f - 2 * b + e) for f, b, e in zip(first, solution, last))
        return tuple(
            (0.0, f, e - 4 * f - 5 * b + 16 * m, 5 * f - 3 * e + 14 * b - 32 * m, 2 * (e - f) - 8 * b + 16 * m)
            for f, b, e, m in zip(first, solution, last, self.mid)
        )


DOPRI5 = Tableau(  # Dormand and Prince (1980), with Shampine's (1986) error estimate and midpoint weights (torchdiffeq's)
    c=(0.0, 1 / 5, 3 / 10, 4 / 5, 8 / 9, 1.0, 1.0),
    a=(
        (1 / 5,),
        (3 / 40, 9 / 40),
        (44 / 45, -56 / 15, 32 / 9),
        (19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729),
        (9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656),
        (35 / 384, 0.0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84),
    ),
    e=(
        35 / 384 - 1951 / 21600,
        0.0,
        500 / 1113 - 22642 / 50085,
        125 / 192 - 451 / 720,
        -2187 / 6784 + 12231 / 42400,
        11 / 84 - 649 / 6300,
        -1 / 60,
    ),
    error_order=5,
    mid=(
        6025192743 / 30085553152 / 2,
        0.0,
        51252292925 / 65400821598 / 2,
        -2691868925 / 45128329728 / 2,
        187940372067 / 1594534317056 / 2,
        -1776094331 / 19743644256 / 2,
        11237099 / 235043384 / 2,
    ),
)

BOSH3 = Tableau(  # Bogacki and Shampine (1989), the 3(2) pair
    c=(0.0, 1 / 2, 3 / 4, 1.0),
    a=((1 / 2,), (0.0, 3 / 4), (2 / 9, 1 / 3, 4 / 9)),
    e=(2 / 9 - 7 / 24, 1 / 3 - 1 / 4, 4 / 9 - 1 / 3, -1 / 8),
    error_order=3,
)


def _product(*factors: tuple[float, ...]) -> tuple[float, ...]:
    """The product of polynomials given by their monomial coefficients, lowest first."""
    result: list[float] = [1.0]
    for factor in factors:
        grown = [0.0] * (len(result) + len(factor) - 1)
        for i, a in enumerate(result):
            for j, b in enumerate(factor):
                grown[i + j] += a * b
        result = grown
    return tuple(result)


_T, _T2 = (0.0, 1.0), (0.0, 0.0, 1.0)  # theta, theta^2
TSIT5 = Tableau(  # Tsitouras (2011), the 5(4) pair with its own order-4 interpolant (diffrax's and OrdinaryDiffEq's)
    c=(0.0, 0.161, 0.327, 0.9, 0.9800255409045097, 1.0, 1.0),
    a=(
        (0.161,),
        (-0.008480655492356989, 0.335480655492357),
        (2.8971530571054935, -6.359448489975075, 4.3622954328695815),
        (5.325864828439257, -11.748883564062828, 7.4955393428898365, -0.09249506636175525),
        (5.86145544294642, -12.92096931784711, 8.159367898576159, -0.071584973281401, -0.028269050394068383),
        (0.09646076681806523, 0.01, 0.4798896504144996, 1.379008574103742, -3.290069515436081, 2.324710524099774),
    ),
    e=(
        0.09646076681806523 - 0.09468075576583945,
        0.01 - 0.009183565540343254,
        0.4798896504144996 - 0.4877705284247616,
        1.379008574103742 - 1.234297566930479,
        -3.290069515436081 + 2.7077123499835256,
        2.324710524099774 - 1.866628418170587,
        -1 / 66,
    ),
    error_order=5,
    dense=(
        _product((-1.0530884977290216,), _T, (-1.3299890189751412, 1.0), (0.7139816917074209, -1.4364028541716351, 1.0)),
        _product((0.1017,), _T2, (1.2949852507374631, -2.1966568338249754, 1.0)),
        _product((2.490627285651252793,), _T2, (1.57803468208092486, -2.38535645472061657, 1.0)),
        _product((-16.54810288924490272,), (-1.21712927295533244, 1.0), (-0.61620406037800089, 1.0), _T2),
        _product((47.37952196281928122,), (-1.203071208372362603, 1.0), (-0.658047292653547382, 1.0), _T2),
        _product((-34.87065786149660974,), (-1.2, 1.0), (-0.666666666666666667, 1.0), _T2),
        _product((2.5,), (-1.0, 1.0), (-0.6, 1.0), _T2),
    ),
)

TABLEAUX = {"dopri5": DOPRI5, "bosh3": BOSH3, "tsit5": TSIT5}  # by method: Adaptive.OWN_METHODS


def cuts_per_sample(mask: object) -> TypeGuard[Tensor | None]:
    """Whether a batch under ``mask`` can be cut into samples, each with its own steps: the mask is None or a dense
    tensor (a :class:`~et_ode.GraphMask` joins the graphs of its batch into one)."""
    return mask is None or isinstance(mask, Tensor)


def _per_sample_mask(field: object, batch: torch.Size) -> Tensor | None:
    """The field's mask as one per sample ``(G, N, N)`` (broadcast over the ``batch`` shape), or None where one mask
    serves every sample (ValueError for a mask :func:`cuts_per_sample` refuses)."""
    mask = getattr(field, "mask", None)
    if not cuts_per_sample(mask):
        raise ValueError(f"step_control='per_sample' needs a dense tensor mask or None, got {type(mask).__name__}")
    if mask is None or mask.dim() <= 2 or mask.shape[:-2].numel() == 1:
        return None
    return mask.expand(*batch, *mask.shape[-2:]).reshape(batch.numel(), *mask.shape[-2:])


LANES = 16  # twice the widest vector of doubles (AVX-512), the stride of ATen's vectorised CPU loops


def _power(base: Tensor, exponent: float) -> Tensor:
    """``base ** exponent`` elementwise, each element's bits independent of its position in ``base``: on the CPU an
    element at the end of a tensor goes through the loop's scalar tail, whose power can differ in the last bit from
    the vectorised one (seen on AVX-512 and on AVX2), so each element is raised in a row of :data:`LANES` (a
    broadcast view, which the vectorised loop reads as a scalar) that the vectorised loop covers whole."""
    if base.device.type != "cpu":
        return base**exponent
    return torch.pow(base.reshape(-1, 1).expand(-1, LANES), exponent)[:, 0].reshape(base.shape)


def _rms(x: Tensor) -> Tensor:
    """RMS of each group: ``(G, 1, M) -> (G,)``."""
    return torch.linalg.vector_norm(x, dim=(1, 2)) / math.sqrt(x.shape[-1])


class _WriteStage(torch.autograd.Function):
    """``k[:, i] = f`` in place, returning ``k``, without bumping ``k``'s version: each slot of a step's stages is
    written once, before anything reads it, so the products that saved ``k[:, :i]`` for their backward still read
    what they read (torchdiffeq's ``_UncheckedAssign``). Gradients: ``k``'s pass through, slot ``i``'s go to ``f``."""

    @staticmethod
    def forward(ctx: Any, k: Tensor, f: Tensor, i: int) -> Tensor:
        ctx.i = i
        k.data[:, i : i + 1] = f
        return k

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, grad[:, ctx.i : ctx.i + 1], None


class _Interpolant:
    """The dense output of one step of the groups ``rows``: dopri5's quartic through ``y0``, the midpoint and ``y1``
    with the slopes ``f0``, ``f1`` (Shampine), tsit5's own polynomials, or the Hermite cubic (bosh3); :meth:`at`
    gives the state and its velocity (the derivative of the interpolant) at fractions of the step."""

    def __init__(
        self,
        tableau: Tableau,
        rows: Tensor,
        y0: Tensor,
        y1: Tensor,
        k: Tensor,
        weights: Tensor,
        dt: Tensor,
        dtype: torch.dtype,
    ):
        s = tableau.stages
        self.y0, self.y1, k = y0[rows], y1[rows], k[rows]
        self.h = dt[rows].to(dtype)[:, None, None]
        self.dtype = dtype
        self.f0, self.f1 = k[:, :1], k[:, s - 1 : s]
        self.quartic: tuple[Tensor, Tensor, Tensor] | None = None
        self.k, self.polynomials = k, tableau.dense
        if tableau.mid is not None:
            y_mid = torch.baddbmm(self.y0, weights[rows, s : s + 1], k)
            y0, y1, f0, f1, h = self.y0, self.y1, self.f0, self.f1, self.h
            self.quartic = (
                2 * h * (f1 - f0) - 8 * (y1 + y0) + 16 * y_mid,
                h * (5 * f0 - 3 * f1) + 18 * y0 + 14 * y1 - 32 * y_mid,
                h * (f1 - 4 * f0) - 11 * y0 - 5 * y1 + 16 * y_mid,
            )

    def at(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        """The state ``(n, 1, M)`` (exactly ``y1`` where ``theta`` is 1) and the velocity at ``theta`` ``(n,)``."""
        x = theta.to(self.dtype)[:, None, None]
        y0, y1, f0, f1, h = self.y0, self.y1, self.f0, self.f1, self.h
        if self.polynomials is not None:  # the method's own: y0 + h sum_j b_j(theta) k_j
            # theta^0 .. theta^(P-1) by products (correctly rounded, so the same bits wherever a group sits)
            powers = torch.cat([torch.ones_like(x), x.expand(*x.shape[:-1], len(self.polynomials[0]) - 1)], -1).cumprod(-1)
            coefficients = torch.tensor(self.polynomials, dtype=self.dtype, device=x.device)  # (S, P)
            slopes = coefficients[:, 1:] * torch.arange(1, coefficients.shape[1], dtype=self.dtype, device=x.device)
            # (n, 1, S): each group's own sums (a matrix product's blocking would depend on n)
            b = (powers[..., None, :] * coefficients).sum(-1)
            db = (powers[..., None, :-1] * slopes).sum(-1)
            value = torch.baddbmm(y0, h * b, self.k)
            velocity = torch.bmm(db, self.k)
        elif self.quartic is None:  # Hermite cubic
            one = 1 - x
            value = (1 + 2 * x) * one * one * y0 + x * one * one * h * f0 + x * x * (3 - 2 * x) * y1 - x * x * one * h * f1
            velocity = (6 * x * (x - 1) * (y0 - y1)) / h + (3 * x - 1) * (x - 1) * f0 + x * (3 * x - 2) * f1
        else:
            a, b, c = self.quartic
            value = y0 + x * (h * f0 + x * (c + x * (b + x * a)))
            velocity = f0 + x * (2 * c + x * (3 * b + x * 4 * a)) / h
        return torch.where(x == 1, y1, value), velocity


class _Buffers:
    """The storage of the active groups without gradients, allocated once per integration (compaction keeps the
    groups still running in its first rows): the stages ``k`` ``(G, S, M)`` (stored stage-major, so that a stage's
    slot ``k[:, i]`` of every group is one contiguous block); the state ``y``, the solution ``y1``, a
    stage input, the error and its scale, each ``(G, 1, M)``; the step's weights ``(G, S + 1, S)``; and the views of
    them every step takes."""

    def __init__(self, k: Tensor, y: Tensor, y1: Tensor, stage: Tensor, err: Tensor, scale: Tensor, weights: Tensor):
        self.k, self.y, self.y1, self.stage, self.err, self.scale, self.weights = k, y, y1, stage, err, scale, weights
        stages = k.shape[1]
        self.k_first = self.k[:, :1]
        self.k_upto = [self.k[:, :i] for i in range(stages + 1)]
        self.k_slot = [self.k[:, i : i + 1] for i in range(stages)]
        self.w_rows = [self.weights[:, i - 1 : i, :i] for i in range(1, stages)]
        self.w_error = self.weights[:, stages - 1 : stages]

    @classmethod
    def empty(cls, groups: int, stages: int, width: int, dtype: torch.dtype, device: torch.device) -> _Buffers:
        def empty(*shape: int) -> Tensor:
            return torch.empty(shape, dtype=dtype, device=device)

        y, y1, stage, err, scale = (empty(groups, 1, width) for _ in range(5))
        k = empty(stages, groups, width).transpose(0, 1)  # each stage's slot one block, which the field writes into
        return cls(k, y, y1, stage, err, scale, empty(groups, stages + 1, stages))

    def first(self, groups: int) -> _Buffers:
        """The same storage for the first ``groups`` groups."""
        return _Buffers(*(t[:groups] for t in (self.k, self.y, self.y1, self.stage, self.err, self.scale, self.weights)))


class _Attempt(NamedTuple):
    """A step's attempt for every active group: whether it is the span's last (``last``), its size ``dt`` and end
    ``t1`` ``(G,)``, the stages ``k`` ``(G, S, M)``, the solution ``y1`` ``(G, 1, M)``, the weights ``(G, S + 1,
    S)``, the error ratio, whether it is accepted, the next step size and the controller's history."""

    last: Tensor
    dt: Tensor
    t1: Tensor
    k: Tensor
    y1: Tensor
    weights: Tensor
    ratio: Tensor
    accepted: Tensor
    next_dt: Tensor
    history: Tensor


class _StepGraph:
    """The attempt of a step of one group (shared control, or a single sample's; :meth:`_Loop.attempt`: the stages, the
    error ratio and the controller) captured once and replayed every step: a CUDA graph (``mode="cuda"``, captured on a
    side stream after one attempt there), or the same discipline run eagerly (``mode="eager"``: that first attempt, then
    the attempt runs again on the same fixed inputs and writes into the captured attempt's outputs, for checking the
    loop around a graph where there is no CUDA). The time, step size and history are copied into fixed inputs before
    each replay; the state and first stage are the loop's buffers, which therefore never trade places. The attempt's own
    evaluations go uncounted (a graph replays no Python); every replay counts them by hand."""

    def __init__(self, loop: _Loop, state: dict[str, Any], buffers: _Buffers, mode: CaptureMode):
        self.loop, self.buffers = loop, buffers
        self.inputs = {name: state[name].clone() for name in ("t", "dt", "history")}
        self.graph = torch.cuda.CUDAGraph() if mode == "cuda" else None
        stream = torch.cuda.Stream(buffers.y.device) if self.graph is not None else None
        # one attempt first on the capture's stream makes the libraries' per-stream handles and workspaces, which a
        # capture cannot make; it reads and writes only what the capture will
        with _side_stream(stream):
            self._attempt()
        with torch.cuda.graph(self.graph, stream=stream) if self.graph is not None else contextlib.nullcontext():
            self.outputs = self._attempt()
        self.captured = False  # the first replay is the step captured itself

    def _attempt(self) -> _Attempt:
        inputs, buffers, loop = self.inputs, self.buffers, self.loop
        loop.counting = False
        try:
            return loop.attempt(inputs["t"], inputs["dt"], inputs["history"], buffers.y, buffers.k_first, buffers)
        finally:
            loop.counting = True

    def replay(self, state: dict[str, Any]) -> _Attempt:
        """The attempt from ``state``'s time, step size and history (the state itself already in the buffers)."""
        if self.captured:
            for name, fixed in self.inputs.items():
                fixed.copy_(state[name])
            if self.graph is None:
                for fixed, fresh in zip(self.outputs, self._attempt(), strict=True):
                    fixed.copy_(fresh)
        self.captured = True
        if self.graph is not None:
            self.graph.replay()
        self.loop.count_evaluations(self.loop.tableau.stages - 1)
        return self.outputs


# Inductor's CPU kernels split their loops across every thread from a few hundred elements on. Below this many state
# elements per thread the split costs more than it saves: a single 17 x 64 sample solved 1.4-1.7x faster on one thread
# than on two, a 50 x 128 one 1.1x slower (2-core Xeon, whole compiled solves).
STATE_ELEMENTS_PER_THREAD = 2048
# A compiled solve runs in calls of about this many seconds (a progress bar moves, and an interrupt lands, between
# them), sized by the time a step of the same kind took in the last call (the first call of a kind takes one step: it
# may compile, and its time says nothing of the next).
CHUNK_SECONDS = 0.2
# A compiled call logs each group's time after each of its first this many steps, from which a progress callback is
# called for every step after the call (a call watched by a callback takes at most this many steps).
LOGGED_STEPS = 64
_STEP_SECONDS: dict[tuple[object, ...], float] = {}  # by kind of solve (shapes, weights, method, saves): a step's time


def _steps_per_call(kind: tuple[object, ...]) -> int:
    """The steps a compiled call of ``kind`` takes in about :data:`CHUNK_SECONDS` (at least one)."""
    seconds = _STEP_SECONDS.get(kind)
    return 1 if seconds is None else max(1, int(CHUNK_SECONDS / seconds))


@contextlib.contextmanager
def _threads_for(state: Tensor) -> Iterator[None]:
    """Compiled code inside the block runs on at most one CPU thread per :data:`STATE_ELEMENTS_PER_THREAD` elements
    of ``state`` (PyTorch's thread count for the process, set back on leaving; at least one thread)."""
    threads = torch.get_num_threads()
    wanted = max(1, min(threads, state.numel() // STATE_ELEMENTS_PER_THREAD))
    if state.device.type != "cpu" or wanted == threads:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _compile_options(device_type: str) -> dict[str, Any] | None:
    """Inductor's options: the C++ wrapper on the CPU (a call into the compiled code costs less)."""
    return {"cpp_wrapper": True} if device_type == "cpu" else None


class _SolveEnd(NamedTuple):
    """Where :func:`_whole_solve` (or the native loop's call) ends, for ``G`` groups: their times ``t`` ``(G,)``,
    next step sizes ``dt`` (the failed step's own where a step failed), the controller's history ``(G, 2)``, the states
    ``y`` and their velocities ``f0`` ``(G, 1, M)``, the states at the output times ``(T * G, 1, M)`` (time-major;
    ``T = 0``: none kept), and the groups' times after each of the call's first :data:`LOGGED_STEPS` steps
    ``(LOGGED_STEPS, G)`` (row ``i``: after step ``i``; rows past the call's steps hold nothing), and (0-d) the numbers
    of steps taken (batched), of the groups' steps tried and accepted, and whether the last step failed."""

    t: Tensor
    dt: Tensor
    history: Tensor
    y: Tensor
    f0: Tensor
    saved: Tensor
    log: Tensor
    steps: Tensor
    tried: Tensor
    accepted: Tensor
    failed: Tensor


def _whole_solve(
    loop: _Loop,
    t: Tensor,
    dt: Tensor,
    history: Tensor,
    y: Tensor,
    f0: Tensor,
    begin: Tensor,
    budget: Tensor,
    saved: Tensor,
    times: Tensor,
) -> _SolveEnd:
    """From the groups ``y`` ``(G, 1, M)`` at their times ``t`` ``(G,)``: where ``begin`` (0-d) is 1 or more, their
    first stage (``f0`` ignored), and where it is 2 their first step sizes (:meth:`_Loop.first_step`; ``dt`` ignored);
    where it is 0, ``f0`` and ``dt`` go on from the call before. Then the steps of :meth:`_Loop.attempt` until every
    group reaches the end, ``budget`` steps are taken or a step fails as the loop's would (a step size that underflows,
    or a NaN error from a non-finite state), as a ``torch.while_loop``: the compiler makes it all one call, the same
    code for every ``begin``. A group that has reached the end keeps its state (its attempts are computed and dropped:
    no compaction). Each accepted step writes the interpolant at the output ``times`` ``(T,)`` inside it into
    ``saved`` ``(T * G, 1, M)`` (as :meth:`_Loop.save`; ``T = 0``: none), and each of the first :data:`LOGGED_STEPS`
    steps the groups' times after it into the ``log``. Its evaluations go uncounted."""
    from torch._higher_order_ops import while_loop  # (PyTorch's control flow, not public API: here, not at import)

    f0 = torch.cond(begin > 0, lambda t, y, f0: loop.first_stage(t, y), lambda t, y, f0: f0.clone(), (t, y, f0))
    dt = torch.cond(
        begin > 1, lambda t, y, f0, dt: loop.first_step(t, y, f0), lambda t, y, f0, dt: dt.clone(), (t, y, f0, dt)
    )
    last_stage = slice(loop.tableau.stages - 1, loop.tableau.stages)

    def running(*carried: Tensor) -> Tensor:
        end = _SolveEnd(*carried)
        return (end.t < loop.t_end).any() & (end.steps < budget) & ~end.failed

    def step(*carried: Tensor) -> tuple[Tensor, ...]:
        now = _SolveEnd(*carried)
        active = now.t < loop.t_end
        attempt = loop.attempt(now.t, now.dt, now.history, now.y, now.f0, None)
        backwards = active & (attempt.t1 <= now.t)
        stalled = backwards | (active & torch.isnan(attempt.ratio))
        finite = torch.isfinite(now.y).flatten(1).all(1) | ~active
        failed = stalled.any() & (backwards.any() | ~finite.all())
        moves = attempt.accepted & active & ~failed
        t_next = torch.where(moves, attempt.t1, now.t)
        return (
            t_next,
            torch.where(active, torch.where(failed, attempt.dt, attempt.next_dt), now.dt),
            torch.where(active[:, None], attempt.history, now.history),
            torch.where(moves[:, None, None], attempt.y1, now.y),
            torch.where(moves[:, None, None], attempt.k[:, last_stage], now.f0),
            _saved_in_step(loop, now, attempt, moves, times),
            torch.where(log_rows == now.steps, t_next, now.log),
            now.steps + 1,
            now.tried + active.sum(),
            now.accepted + moves.sum(),
            failed,
        )

    log_rows = torch.arange(LOGGED_STEPS, device=y.device)[:, None]
    log = torch.zeros((LOGGED_STEPS, len(t)), dtype=t.dtype, device=t.device)
    counters = [torch.zeros((), dtype=torch.long, device=y.device) for _ in range(3)]
    failed = torch.zeros((), dtype=torch.bool, device=y.device)
    return _SolveEnd(*while_loop(running, step, (t, dt, history, y, f0, saved, log, *counters, failed)))


def _saved_in_step(loop: _Loop, now: _SolveEnd, attempt: _Attempt, moves: Tensor, times: Tensor) -> Tensor:
    """``now.saved`` ``(T * G, 1, M)`` with the interpolant of each group's step from ``now`` written at the ``times``
    ``(T,)`` in its ``(t, t1]`` where its step ``moves`` (is accepted): :meth:`_Loop.save`'s states, at every time
    and group (row ``j * G + g``: time ``j`` of group ``g``)."""
    if not len(times):
        return now.saved.clone()
    later, until = times[:, None] > now.t, times[:, None] <= attempt.t1  # (T, G)
    inside = (moves & later & until).flatten()
    rows = torch.arange(len(now.t), device=times.device).repeat(len(times))
    theta = ((times[:, None] - now.t) / attempt.dt).flatten()
    states = loop.dense(rows, theta, now.y, attempt.y1, attempt.k, attempt.weights, attempt.dt)
    return torch.where(inside[:, None, None], states, now.saved)


@functools.cache
def _native_tableau(tableau: Tableau, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """``tableau`` as the native loop takes it: its matrix and its interpolant's polynomials (``dtype``, on the CPU)
    and its error order."""
    polynomials = torch.tensor(tableau.polynomials(), dtype=torch.float64).to(dtype)
    return tableau.matrix(dtype, torch.device("cpu")), polynomials, tableau.error_order


@functools.cache
def _compiled_solve(device_type: str) -> Callable[..., _SolveEnd]:
    """:func:`_whole_solve` under ``torch.compile``, made once per process and device type."""
    return torch.compile(_whole_solve, dynamic=False, options=_compile_options(device_type))


def _warn_uncompiled(option: str, verb: str, error: Exception) -> None:
    """A ``RuntimeWarning`` naming the error by its type and first line (a compiler's message runs to pages)."""
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    warnings.warn(
        f"Adaptive({option}=True): the step could not be {verb} ({reason[:300]}); the solve runs without",
        RuntimeWarning,
        stacklevel=3,
    )


@contextlib.contextmanager
def _side_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Work inside the block runs on ``stream``, ordered after the current stream's work and before its later work
    (None: on the current stream)."""
    if stream is None:
        yield
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        yield
    current.wait_stream(stream)


@dataclass
class _Outputs:
    """The states kept for the output grid: rows of the flat ``(T * samples)`` index and the states ``(n, 1, M)``."""

    rows: list[Tensor]
    states: list[Tensor]


class _Loop:
    """One integration; :func:`integrate` is its front."""

    def __init__(
        self,
        field: Callable[[Tensor | None, Tensor], Tensor],
        x0: Tensor,
        grid: Tensor,
        tableau: Tableau,
        rtol: float,
        atol: float,
        per_sample: bool,
        pid: tuple[float, float, float],
        max_steps: int,
        progress: Progress,
        callback: StepCallback | None,
        stop: StopTest | None = None,
        quadrature: Quadrature | None = None,
        graph: GraphMode | None = None,
    ):
        self.field, self.grid, self.tableau, self.rtol, self.atol = field, grid, tableau, rtol, atol
        self.per_sample, self.pid, self.max_steps, self.progress, self.callback = (
            per_sample,
            pid,
            max_steps,
            progress,
            callback,
        )
        self.x_shape = x0.shape
        batch = x0.shape[:-2].numel()
        self.groups = batch if per_sample else 1
        self.samples_per_group = 1 if per_sample else batch
        self.event = (x0.shape[-2], x0.shape[-1]) if per_sample else tuple(x0.shape)
        self.width = x0.numel() // self.groups
        self.autonomous = type(field) is ETField
        self.mask = _per_sample_mask(field, x0.shape[:-2]) if per_sample else None
        self.field_now = field if self.mask is None else field.with_mask(self.mask)  # type: ignore[attr-defined]
        self.mask_now = self.mask  # the active groups' masks, (G, N, N), or None
        self.matrix = tableau.matrix(x0.dtype, x0.device)
        self.dtype, self.device = x0.dtype, x0.device
        self.atol_tensor = torch.tensor(atol, dtype=x0.dtype, device=x0.device)
        self.in_place = not torch.is_grad_enabled()
        self.t_end = grid[-1]
        self.stop, self.quadrature = stop, quadrature
        # a captured step, or the whole solve compiled (:func:`_whole_solve`, any number of groups), of an ET field
        # without gradients, a stop or a quadrature; a step is captured for shared steps (or a single sample's)
        one_group = not per_sample or self.groups == 1
        graphable = self.in_place and self.autonomous and stop is None and quadrature is None
        captured = graph in ("cuda", "eager") and graphable and one_group
        self.graph_mode: CaptureMode | None = cast(CaptureMode, graph) if captured else None
        self.whole_solve = graph in ("compile", "native") and graphable
        self.native_only = graph == "native"  # (where the native loop does not run the field: step by step)
        self.step_graph: _StepGraph | None = None
        self.traced_field: ETField | None = None  # the field the compiled solve evaluates (see trace_closed_form)
        self.native: NativeSolve | None = None  # the whole solve in C, where it computes the field
        self.counting = True  # evaluations count in nfe (not inside a captured step or the compiled solve)
        self.t_now = grid[:1]  # the active groups' times during a step
        self.next_dt: Tensor | None = None  # the step sizes the latest step proposed
        self.stop_times = torch.full((self.groups,), float(grid[-1]), dtype=torch.float64)
        self.finals = _Outputs([], [])
        self.outputs = _Outputs([], [])

    # -- evaluations -------------------------------------------------------------------------------
    def evaluate(self, t: Tensor | None, y: Tensor, rows: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """The field at the groups ``y`` ``(G, 1, M)`` at their times ``t`` ``(G,)`` (float64): ``(G, 1, M)``;
        ``rows`` ``(G,)``: which of the active groups ``y`` holds (None: all of them, in order), so that each gets its
        own mask; ``out``: where to write it (no gradients; the ET field writes there itself). The ET field is
        autonomous and gets no time (``t`` None); another field gets ``t`` per sample, or the shared 0-d time."""
        groups = y.shape[0]
        state = y.view(groups, *self.event) if self.per_sample else y.view(self.event)
        if not self.counting:  # (a captured step or the compiled solve: an ET field, counted by hand)
            captured = cast(ETField, self.field_now) if self.traced_field is None else self.traced_field
            velocity = captured.velocity(state, out=None if out is None else out.view(state.shape))
            return velocity.reshape(groups, 1, self.width) if out is None else out
        self.progress.sample_evaluations += groups * self.samples_per_group
        time = None if t is None or self.autonomous else (t.to(self.dtype) if self.per_sample else t[0].to(self.dtype))
        field = self.field_now
        if rows is not None and self.mask_now is not None:
            field = self.field.with_mask(self.mask_now[rows])  # type: ignore[attr-defined]
        if out is None:
            return field(time, state).reshape(groups, 1, self.width)
        if self.autonomous:  # the ET field writes into out itself
            cast(ETField, field)(time, state, out=out.view(state.shape))
            return out
        return out.copy_(field(time, state).reshape(groups, 1, self.width))

    def first_stage(self, t: Tensor, y: Tensor) -> Tensor:
        """The field at the groups ``y`` ``(G, 1, M)`` at their times ``t``: the first step's first stage."""
        return self.evaluate(None if self.autonomous else t, y)

    def first_step(self, t: Tensor, y0: Tensor, f0: Tensor) -> Tensor:
        """torchdiffeq's and diffrax's starting step per group (one evaluation): ``(G,)`` float64."""
        with torch.no_grad():
            scale = self.atol + y0.abs() * self.rtol
            d0, d1 = _rms(y0 / scale), _rms(f0 / scale)
            h0 = torch.where((d0 < 1e-5) | (d1 < 1e-5), torch.full_like(d0, 1e-6), 0.01 * d0 / d1)
            f1 = self.evaluate(None if self.autonomous else t + h0.double(), y0 + h0[:, None, None] * f0)
            d2 = _rms((f1 - f0) / scale) / h0
            largest = torch.maximum(d1, d2)
            h1 = torch.where(
                largest <= 1e-15, torch.clamp(h0 * 1e-3, min=1e-6), _power(0.01 / largest, 1.0 / self.tableau.error_order)
            )
            return torch.minimum(100 * h0, h1).double()

    # -- one step of every active group ------------------------------------------------------------
    def stages(
        self, t: Tensor, dt: Tensor, y0: Tensor, f0: Tensor, buffers: _Buffers | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The stages ``(G, S, M)`` and the solution ``(G, 1, M)`` of a step of ``dt`` ``(G,)`` from ``y0``, and the
        step's weights ``(G, S + 1, S)``. Without gradients (``buffers``, whose first stage is ``f0``) the weights,
        stages and stage inputs are written into the buffers; with gradients each step has a stage tensor of its own,
        written slot by slot (autograd keeps it): the same operations on the same numbers either way."""
        s, c = self.tableau.stages, self.tableau.c
        scaled = dt.to(self.dtype).view(-1, 1, 1)
        y = y0
        if buffers is None:  # one new stage tensor per step, each slot written once (autograd keeps it)
            weights = scaled * self.matrix
            k = _WriteStage.apply(torch.empty(y0.shape[0], s, self.width, dtype=self.dtype, device=self.device), f0, 0)
            for i in range(1, s):
                y = torch.baddbmm(y0, weights[:, i - 1 : i, :i], k[:, :i])
                k = _WriteStage.apply(k, self.evaluate(None if self.autonomous else t + c[i] * dt, y), i)
            return k, y, weights
        weights = torch.mul(scaled, self.matrix, out=buffers.weights)
        for i in range(1, s):
            y = torch.baddbmm(y0, buffers.w_rows[i - 1], buffers.k_upto[i], out=buffers.y1 if i == s - 1 else buffers.stage)
            self.evaluate(None if self.autonomous else t + c[i] * dt, y, out=buffers.k_slot[i])
        return buffers.k, y, weights

    def error_ratio(self, k: Tensor, y0: Tensor, y1: Tensor, weights: Tensor, buffers: _Buffers | None) -> Tensor:
        """``RMS(err / (atol + rtol max(|y0|, |y1|)))`` per group, ``(G,)`` float64 (no gradients)."""
        s = self.tableau.stages
        with torch.no_grad():
            if buffers is None:
                err = torch.bmm(weights[:, s - 1 : s].detach(), k.detach())
                scale = torch.maximum(y0.detach().abs(), y1.detach().abs())
            else:
                err = torch.bmm(buffers.w_error, k, out=buffers.err)
                scale = torch.abs(y0, out=buffers.scale)
                torch.maximum(scale, torch.abs(y1, out=buffers.stage), out=scale)
            err.div_(torch.add(self.atol_tensor, scale, alpha=self.rtol, out=scale))
            return _rms(err).double()

    def control(self, ratio: Tensor, dt: Tensor, history: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Accept (``ratio <= 1``: a NaN or infinite error is rejected) and the next step size per group; ``history``
        ``(G, 2)`` holds the two previous accepted inverse errors (the PID terms). Returns (accepted, next dt, next
        history)."""
        p, i, d = self.pid
        order = self.tableau.error_order
        accepted = ratio <= 1
        factor = SAFETY * _power(ratio, -(p + i + d) / order)  # an error of 0 gives inf, an infinite one 0
        if p or d:
            inverse = 1 / ratio
            factor = factor * _power(history[:, 0], -(p + 2 * d) / order) * _power(history[:, 1], d / order)
            kept = torch.where((inverse == 0) | torch.isinf(inverse), torch.ones_like(inverse), inverse)
            history = torch.where(accepted[:, None], torch.stack([kept, history[:, 0]], dim=1), history)
        factor = torch.nan_to_num(factor, nan=FACTOR_MIN)  # a NaN error: the smallest factor
        factor = torch.where(accepted, factor.clamp(1.0, FACTOR_MAX), factor.clamp(FACTOR_MIN, SAFETY))
        return accepted, dt * factor, history

    def dense(self, rows: Tensor, theta: Tensor, y0: Tensor, y1: Tensor, k: Tensor, weights: Tensor, dt: Tensor) -> Tensor:
        """The interpolant of the step of the groups ``rows`` at the fractions ``theta`` ``(n,)``: ``(n, 1, M)``;
        exactly ``y1`` where ``theta`` is 1."""
        return _Interpolant(self.tableau, rows, y0, y1, k, weights, dt, self.dtype).at(theta)[0]

    def crossing(
        self, rows: Tensor, y0: Tensor, y1: Tensor, k: Tensor, weights: Tensor, dt: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Where inside their accepted steps the groups ``rows`` (whose step starts fail the stop's test and ends
        pass it) cross it: bisection on the interpolant with the interpolant's own velocity (no field evaluations) to
        ``2^-BISECTIONS`` of the step, then :data:`NEWTON` Newton steps on the test's value with the field's velocity
        at the interpolated state (one evaluation of those groups each; the slope from the interpolant), so that the
        crossing moves smoothly with the parameters. A group whose last state does not pass (its value above
        :data:`CROSSING_SLACK`) ends at its step's end, which passes. Returns the fractions ``(n,)`` float64 and the
        states there ``(n, 1, M)``."""
        interpolant = _Interpolant(self.tableau, rows, y0, y1, k, weights, dt, self.dtype)
        low = torch.zeros(len(rows), dtype=torch.float64, device=self.device)
        high = torch.ones_like(low)
        for _ in range(BISECTIONS):
            middle = (low + high) / 2
            with torch.no_grad():
                value, velocity = interpolant.at(middle)
                passes = self._converged(value, velocity)
            high, low = torch.where(passes, middle, high), torch.where(passes, low, middle)
        theta, reach = high, 1e-4
        with torch.no_grad():
            for _ in range(NEWTON):
                value = interpolant.at(theta)[0]
                time = None if self.autonomous else self.t_now[rows] + theta * dt[rows]
                exact = self._test(value, self.evaluate(time, value, rows))
                ahead, behind = (theta + reach).clamp(max=1.0), (theta - reach).clamp(min=0.0)
                slope = (self._test(*interpolant.at(ahead)) - self._test(*interpolant.at(behind))) / (ahead - behind)
                step = torch.where(slope < 0, exact / slope, torch.zeros_like(slope))
                theta = (theta - step).clamp(0.0, 1.0)
            value = interpolant.at(theta)[0]
            time = None if self.autonomous else self.t_now[rows] + theta * dt[rows]
            passes = self._test(value, self.evaluate(time, value, rows)) <= CROSSING_SLACK
        theta = torch.where(passes, theta, torch.ones_like(theta))  # the step's end passes (tested with f1)
        return theta, interpolant.at(theta)[0]

    def _pending(self, state: dict[str, Any], accepted: Tensor, t1: Tensor) -> Tensor:
        """Which accepted groups have their next output time inside the step ``(t, t1]``, ``(G,)`` bool."""
        grid, last = self.grid, len(self.grid) - 1
        following = state["next_output"]
        return accepted & (following <= last) & (grid[following.clamp(max=last)] <= t1)

    def save(
        self,
        state: dict[str, Any],
        t1: Tensor,
        accepted: Tensor,
        pending: Tensor,
        y1: Tensor,
        k: Tensor,
        weights: Tensor,
        dt: Tensor,
    ) -> None:
        """Keep the interpolated states at the output times inside each accepted step ``(t, t1]``, starting with
        the groups ``pending`` (:meth:`_pending`)."""
        grid = self.grid
        while True:
            following = state["next_output"]
            rows = torch.nonzero(pending).flatten()
            outputs = following[rows]
            theta = (grid[outputs] - state["t"][rows]) / dt[rows]
            self.outputs.states.append(self.dense(rows, theta, state["y"], y1, k, weights, dt))
            self.outputs.rows.append(outputs * self.groups + state["ids"][rows])
            state["next_output"] = following + pending.long()
            pending = self._pending(state, accepted, t1)
            if not bool(pending.any()):
                return

    # -- the loop ------------------------------------------------------------------------------------
    def run(
        self, x0: Tensor, first_step: float | None, save_all: bool, keep_steps: bool, starts: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        g = self.groups
        y = x0.reshape(g, 1, self.width)
        t = torch.full((g,), float(self.grid[0]), dtype=torch.float64, device=self.device)
        if starts is not None:
            t = starts.to(t).reshape(g).clone()
        given = None if first_step is None else torch.full_like(t, float(first_step))
        totals = (t.to("cpu", copy=True), torch.zeros(g, dtype=torch.long))  # each sample's time and accepted steps
        if self.whole_solve and starts is None:
            ended = self._compiled_run(t, given, y, save_all, keep_steps, totals)  # the whole solve compiled, or None
            if ended is not None:
                return ended
        f0 = self.first_stage(t, y)
        dt = self.first_step(t, y, f0) if given is None else given
        buffers = _Buffers.empty(g, self.tableau.stages, self.width, self.dtype, self.device) if self.in_place else None
        if buffers is not None:  # the loop writes its state in place
            y, f0 = buffers.y.copy_(y), buffers.k_first.copy_(f0)
        state: dict[str, Any] = dict(
            y=y,
            f0=f0,
            t=t,
            dt=dt,
            ids=torch.arange(g, device=self.device),
            history=torch.ones((g, 2), dtype=torch.float64, device=self.device),
            next_output=torch.ones(g, dtype=torch.long, device=self.device),
        )
        if save_all:
            self.outputs.rows.append(state["ids"])
            self.outputs.states.append(x0.reshape(g, 1, self.width))
        if self.stop is not None or starts is not None:  # samples at rest or at the end from the start stop there
            done = t >= self.t_end if self.stop is None else self._converged(y, f0) | (t >= self.t_end)
            if bool(done.any()):
                self._finish(state, done, y, state["t"])
                buffers = self._compact(state, done, buffers)
        capture_at = self.progress.steps + WARM_STEPS + 1  # (the record may hold an earlier solve's steps)
        while len(state["t"]):
            self._count_step(state)
            if self.graph_mode is not None and buffers is not None and self.progress.steps == capture_at:
                self.step_graph = self._capture(state, buffers, self.graph_mode)
            left = self.step(state, buffers, save_all, keep_steps, totals)
            if left is not None:
                buffers = self._compact(state, left, buffers)
        if self.next_dt is not None:
            self.progress.last_dt = float(self.next_dt.min())
        x = self._gather(self.finals, g).view(self.x_shape)
        xs = self._gather(self.outputs, g * len(self.grid)).view(len(self.grid), *self.x_shape) if save_all else None
        return x, xs

    def trace_closed_form(self) -> None:
        """Uncounted evaluations (the compiled solve's) go to the field's closed form from here on: an
        :class:`~et_ode.ETField` of the same model, tau, derivative and mask with ``backend="reference"``."""
        field = cast(ETField, self.field_now)
        self.traced_field = ETField(field.model, field.tau, field.derivative, field.mask, backend="reference")

    def _compiled_run(
        self, t: Tensor, dt: Tensor | None, y: Tensor, save_all: bool, keep_steps: bool, totals: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor | None] | None:
        """The whole solve of the groups ``y`` ``(G, 1, M)`` from their times ``t`` ``(G,)`` (first step sizes ``dt``
        ``(G,)``, or None: chosen; ``totals``: the progress callback's record) compiled (the native loop where it
        runs the field, else :func:`_whole_solve` on the field's closed form under ``torch.compile``), in calls of
        about :data:`CHUNK_SECONDS` each (:func:`_steps_per_call`), each going on from the last one's end; the
        progress bar follows between them, and an interrupt lands there. After each call the progress callback is
        called for each of its steps (at most :data:`LOGGED_STEPS` a call); with ``keep_steps`` (the start of every
        accepted step kept), a step a call. Its steps, evaluations and failures are recorded as the step-by-step loop
        records them; returns the final state ``x0``-shaped and, with ``save_all``, the states at the grid's times
        ``(T, *x0.shape)`` (else None), or None where it cannot be compiled (with a warning) or, for ``graph="native"``,
        where the native loop does not run the field: the loop then goes on step by step, uncompiled."""
        self.native = self._native_solve()
        if self.native is None and self.native_only:
            return None
        if self.native is None:
            self.trace_closed_form()
        g = self.groups
        history = torch.ones((g, 2), dtype=torch.float64, device=self.device)
        times = (self.grid if save_all else self.grid[:0]).clone()  # (the end time is a view of the grid)
        saved = y.new_zeros((len(times) * g, 1, self.width))
        if save_all:
            saved[:g] = y  # the grid's first time is the start
        begin = 2 if dt is None else 1  # evaluations before the first step: the first stage, the first step's choice
        f0, dt = torch.zeros_like(y), torch.zeros_like(t) if dt is None else dt  # (made by the first call)
        weights = tuple(p.shape for p in cast(ETField, self.field).parameters())
        kind = (self.x_shape, weights, self.dtype, self.device, self.tableau.stages, self.per_sample, len(times))
        # a call's most steps: one where each step's start is kept, as many as it logs where a callback reads them
        most = 1 if keep_steps else LOGGED_STEPS if self.callback is not None else self.max_steps
        first = True
        while True:
            started = perf_counter()
            budget = min(_steps_per_call(kind), most, self.max_steps - self.progress.steps)
            end = self._compiled_call(t, dt, history, y, f0, begin, budget, saved, times, may_fall_back=first)
            if end is None:
                return None
            steps, short, failed = self._record_compiled_steps(end, begin)
            _STEP_SECONDS[kind] = (perf_counter() - started) / max(1, steps)
            if self.callback is not None:
                self._report_logged(t, end.log[: steps - failed], totals)
            if failed:
                self._fail_compiled(end)
            if keep_steps and bool((end.t > t).all()):  # (shared: the call's one step accepted)
                self._keep_step_start(t, y)
            if not short or self.progress.steps >= self.max_steps:
                break
            t, dt, history, y, f0, saved, begin, first = end.t, end.dt, end.history, end.y, end.f0, end.saved, 0, False
        if short:  # the budget of steps is spent: the next step fails
            self._count_step(self._state_at(end))
        return end.y.view(self.x_shape), end.saved.view(len(times), *self.x_shape) if save_all else None

    def _native_solve(self) -> NativeSolve | None:
        """The solve in C (:class:`~et_ode.kernels.native.NativeSolve`) where it computes this field, else None."""
        field = cast(ETField, self.field)
        return NativeSolve.create(
            field.model,
            field.mask,
            self.dtype,
            self.device,
            tau=field.tau,
            groups=self.groups,
            event=(self.samples_per_group, *self.x_shape[-2:]),
            tableau=_native_tableau(self.tableau, self.dtype),
            t_end=float(self.t_end),
            rtol=self.rtol,
            atol=self.atol,
            control=(*self.pid, SAFETY, FACTOR_MIN, FACTOR_MAX),
            logged=LOGGED_STEPS,
        )

    def _report_logged(self, t: Tensor, log: Tensor, totals: tuple[Tensor, Tensor]) -> None:
        """Call the progress callback for each step of a compiled call from the groups' times ``t`` ``(G,)``, whose
        ``log`` ``(n, G)`` holds their times after each step, as the step-by-step loop calls it after each (a group's
        step is accepted where it moves its time)."""
        times = torch.cat([t[None], log]).cpu()
        ids = torch.arange(self.groups)
        for before, after in zip(times[:-1], times[1:], strict=True):
            self._report(dict(t=after, ids=ids), after > before, totals)

    def _state_at(self, end: _SolveEnd) -> dict[str, Any]:
        """Every group's time, state and id where a compiled call ended, as the step-by-step loop keeps its state."""
        return dict(t=end.t, y=end.y, ids=torch.arange(self.groups, device=self.device))

    def _compiled_call(
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
        may_fall_back: bool,
    ) -> _SolveEnd | None:
        """One call of the native loop, or of :func:`_whole_solve` compiled, of at most ``budget`` steps. Where it raises and
        ``may_fall_back`` (nothing recorded yet), None, with a warning and the loop told not to compile again."""
        self.counting = False
        try:
            threads = torch.get_num_threads()
            with _threads_for(y if self.native is None else y[0]):  # (the native loop evaluates a group at a time)
                if self.native is not None:  # (its groups on the process's threads, each group on one)
                    return _SolveEnd(*self.native(t, dt, history, y, f0, begin, budget, saved, times, threads))
                solve = _compiled_solve(self.device.type)
                begin_at, budget_at = (torch.tensor(number, device=self.device) for number in (begin, budget))
                return solve(self, t, dt, history, y, f0, begin_at, budget_at, saved, times)
        except Exception as error:  # whatever the compiler raises (an ImportError: a PyTorch without while_loop)
            if not may_fall_back:
                raise
            _warn_uncompiled("compile", "compiled", error)
            self.whole_solve = False  # (the step-by-step loop goes on uncompiled: it captures no step here)
            return None
        finally:
            self.counting = True

    def _record_compiled_steps(self, end: _SolveEnd, at_start: int) -> tuple[int, bool, bool]:
        """Record the steps of a compiled call ending at ``end`` as the step-by-step loop records its own: the
        progress and the evaluations (counted by hand, ``at_start`` of them before the first step); returns the number
        of steps, whether a group is short of the end and whether the last step failed (:meth:`_fail_compiled`)."""
        active = end.t < self.t_end
        counts = torch.stack([end.steps, end.tried, end.accepted, end.failed.long(), active.sum()]).tolist()
        steps, tried, accepted, failed, short = (int(v) for v in counts)
        self.t_now = end.t
        self.progress.steps += steps
        self.progress.accepted += accepted
        self.progress.rejected += tried - accepted - (short if failed else 0)  # (a failed step: neither)
        evaluations = (self.tableau.stages - 1) * steps + at_start
        # torch.compile's solve evaluates every group at every step; the native loop the groups still running only
        running = None if self.native is None else (self.tableau.stages - 1) * tried + at_start * self.groups
        self.count_evaluations(evaluations, running)
        if not failed:
            self.progress.reached(float(end.t.min()))
        return steps, short > 0, bool(failed)

    def _fail_compiled(self, end: _SolveEnd) -> None:
        """Raise the failure of the step a compiled call ``end``ed with as the step-by-step loop raises it."""
        state = self._state_at(end)
        if not bool(torch.isfinite(end.y).all()):
            self._fail_non_finite(state)
        self._fail_underflow(state, end.dt[end.t < self.t_end])

    def step(
        self,
        state: dict[str, Any],
        buffers: _Buffers | None,
        save_all: bool,
        keep_steps: bool,
        totals: tuple[Tensor, Tensor],
    ) -> Tensor | None:
        """One step of every active group; returns which groups leave the batch ``(G,)`` (reached the end or passed
        the stop), or None where none does. One host synchronisation (:meth:`_summary`), plus those of a stop's
        crossing, the saved outputs and the progress callback where they occur."""
        t, y0 = state["t"], state["y"]
        self.t_now = t
        if self.step_graph is not None:
            attempt = self.step_graph.replay(state)
        else:
            attempt = self.attempt(t, state["dt"], state["history"], y0, state["f0"], buffers)
        last, dt, t1, k, y1, weights, ratio, accepted, next_dt, history = attempt
        s = self.tableau.stages
        crossed = accepted & self._converged(y1, k[:, s - 1 : s]) if self.stop is not None else None
        done = accepted & last if crossed is None else accepted & last & ~crossed
        pending = self._pending(state, accepted, t1) if save_all else None
        t_next = torch.where(accepted, t1, t)
        stalled, count, finished, crossings, outputs, reached = self._summary(
            (t1 <= t) | torch.isnan(ratio), accepted, done, crossed, pending, t_next
        )
        if stalled:  # a step size underflowed, or an error is NaN: from a non-finite state nothing recovers
            if not bool(torch.isfinite(y0).all()):
                self._fail_non_finite(state)
            if not bool((t1 > t).all()):
                self._fail_underflow(state, dt)
        state["dt"], state["history"], self.next_dt = next_dt, history, next_dt
        self.progress.accepted += count
        self.progress.rejected += len(t) - count
        self.progress.reached(reached)
        if keep_steps and count:  # shared mode: the start of each accepted step
            self._keep_step_start(t, y0)
        if outputs and pending is not None:
            self.save(state, t1, accepted, pending, y1, k, weights, dt)
        if self.quadrature is not None and count:
            self._accumulate(state, accepted, y0, k, weights)
        if crossings and crossed is not None:  # those end where they first pass the test inside the step
            rows = torch.nonzero(crossed).flatten()
            theta, at = self.crossing(rows, y0, y1, k, weights, dt)
            self._finish(state, crossed, at, t[rows] + theta * dt[rows], rows_given=True)
        if finished:
            self._finish(state, done, y1, t1)
        self._advance(state, accepted, count == len(t), y1, k[:, s - 1 : s], t_next, buffers)
        if self.callback is not None:
            self._report(state, accepted, totals)
        if not (finished or crossings):
            return None
        return done if crossed is None else done | crossed

    def attempt(
        self, t: Tensor, wanted: Tensor, history: Tensor, y0: Tensor, f0: Tensor, buffers: _Buffers | None
    ) -> _Attempt:
        """A step of every active group from ``y0`` (first stage ``f0``) at ``t`` of the size ``wanted`` ``(G,)``, cut
        to the span's end; its error ratio, and the controller's verdict from ``history``."""
        remaining = self.t_end - t
        last = wanted >= remaining
        dt = torch.where(last, remaining, wanted)
        t1 = torch.where(last, self.t_end, t + dt)
        k, y1, weights = self.stages(t, dt, y0, f0, buffers)
        ratio = self.error_ratio(k, y0, y1, weights, buffers)
        accepted, next_dt, history = self.control(ratio, dt, history)
        return _Attempt(last, dt, t1, k, y1, weights, ratio, accepted, next_dt, history)

    def _capture(self, state: dict[str, Any], buffers: _Buffers, mode: CaptureMode) -> _StepGraph | None:
        """The step captured for replay, or None (with a warning) where the field cannot be captured (e.g. it waits on
        the device inside its evaluation): the solve goes on without."""
        try:
            return _StepGraph(self, state, buffers, mode)
        except Exception as error:  # whatever the capture raises; the field's own errors recur without
            _warn_uncompiled("cuda_graph", "captured", error)
            return None

    def count_evaluations(self, evaluations: int, group_evaluations: int | None = None) -> None:
        """Count ``evaluations`` made uncounted (a replayed step's, ``S - 1`` a step, or a compiled call's) as
        :meth:`evaluate` counts its own: of every active group, or ``group_evaluations`` of the groups in all."""
        groups = evaluations * len(self.t_now) if group_evaluations is None else group_evaluations
        self.progress.sample_evaluations += groups * self.samples_per_group
        self.field.count_evaluations(evaluations)  # type: ignore[attr-defined]

    def _accumulate(self, state: dict[str, Any], accepted: Tensor, y0: Tensor, k: Tensor, weights: Tensor) -> None:
        """Hand the quadrature the accepted groups' stages whose solution weight ``b_j`` is not 0, their inputs (formed
        when it asks) and the weights ``b_j dt`` (row ``S - 2`` of the step's weights)."""
        assert self.quadrature is not None
        rows = torch.nonzero(accepted).flatten()
        if len(rows) < len(accepted):  # (every group accepted: the step's own tensors, not copies)
            y0, k, weights = y0[rows], k[rows], weights[rows]
        solution = self.tableau.stages - 2
        stages = [j for j, b in enumerate(self.tableau.a[-1]) if b != 0]

        def stage_input(j: int) -> Tensor:
            return y0 if j == 0 else torch.baddbmm(y0, weights[:, j - 1 : j, :j], k[:, :j])

        self.quadrature(state["ids"][rows], stages, stage_input, [weights[:, solution, j] for j in stages])

    @staticmethod
    def _summary(
        stalled: Tensor,
        accepted: Tensor,
        done: Tensor,
        crossed: Tensor | None,
        pending: Tensor | None,
        times: Tensor,
    ) -> tuple[int, int, int, int, int, float]:
        """What the host needs of a step, in one synchronisation: the numbers of groups whose step is ``stalled``
        (underflows, or has a NaN error), is accepted, reaches the end, crosses the stop or has outputs inside it, and
        the earliest time reached."""
        flags = [stalled, accepted, done, stalled if crossed is None else crossed, stalled if pending is None else pending]
        counts = torch.stack(flags).sum(dim=1, dtype=torch.float64)
        values = torch.cat([counts, times.min().reshape(1)]).tolist()
        stalls, count, finished = int(values[0]), int(values[1]), int(values[2])
        crossings = int(values[3]) if crossed is not None else 0
        outputs = int(values[4]) if pending is not None else 0
        return stalls, count, finished, crossings, outputs, values[5]

    def _keep_step_start(self, t: Tensor, y: Tensor) -> None:
        """Keep the start of an accepted shared step, at ``t`` ``(1,)`` from ``y`` (``save="steps"``)."""
        self.progress.saved.append((float(t[0]), y.detach().reshape(self.x_shape).clone()))

    def _report(self, state: dict[str, Any], accepted: Tensor, totals: tuple[Tensor, Tensor]) -> None:
        """Call the progress callback with every sample's time and accepted steps (the batch's one time when shared)."""
        assert self.callback is not None
        ids = state["ids"].cpu()
        totals[0][ids] = state["t"].cpu()
        totals[1][ids] += accepted.long().cpu()
        shape = (-1,) if self.per_sample else (self.samples_per_group,)
        self.callback(totals[0].expand(shape).clone(), totals[1].expand(shape).clone())

    def _test(self, y: Tensor, f: Tensor) -> Tensor:
        """The stop's value at the groups ``y`` with the velocity ``f`` there, ``(G,)`` float64 (negative: passes;
        no gradients)."""
        assert self.stop is not None
        groups = y.shape[0]
        shape = (groups, *self.event) if self.per_sample else self.event
        with torch.no_grad():
            return self.stop(y.detach().view(shape), f.detach().view(shape)).reshape(groups).double()

    def _converged(self, y: Tensor, f: Tensor) -> Tensor:
        """Whether the groups ``y`` pass the stop's test, ``(G,)`` bool."""
        return self._test(y, f) < 0

    def _finish(self, state: dict[str, Any], done: Tensor, y: Tensor, t: Tensor, rows_given: bool = False) -> None:
        """The groups ``done`` end at ``y`` at the times ``t`` (of every group, or of the ``done`` ones alone)."""
        ids = state["ids"][done]
        self.finals.rows.append(ids)
        self.finals.states.append(y if rows_given else y[done])
        self.stop_times[ids.cpu()] = (t if rows_given else t[done]).cpu()

    def _advance(
        self,
        state: dict[str, Any],
        accepted: Tensor,
        every: bool,
        y1: Tensor,
        f1: Tensor,
        t_next: Tensor,
        buffers: _Buffers | None,
    ) -> None:
        """The accepted groups move to ``y1``, ``f1`` (their times ``t_next``); the others stay."""
        state["t"] = t_next
        mask = accepted[:, None, None]
        if buffers is None:
            state["y"] = torch.where(mask, y1, state["y"])
            state["f0"] = torch.where(mask, f1, state["f0"])
            return
        k0 = buffers.k_first
        if every:
            if self.step_graph is None:  # the two state buffers trade places (a graph reads fixed ones)
                buffers.y, buffers.y1 = buffers.y1, buffers.y
            else:
                buffers.y.copy_(y1)
            k0.copy_(f1)
        else:
            torch.where(mask, y1, buffers.y, out=buffers.y)
            torch.where(mask, f1, k0, out=k0)
        state["y"], state["f0"] = buffers.y, k0

    def _compact(self, state: dict[str, Any], done: Tensor, buffers: _Buffers | None) -> _Buffers | None:
        """The groups that reached the end leave the active batch (the rows still running move to the front of the
        storage, whose views shrink with them)."""
        keep = ~done
        for name in ("t", "dt", "ids", "history", "next_output"):
            state[name] = state[name][keep]
        remaining = len(state["t"])
        if self.mask is not None and remaining:
            self.mask_now = self.mask[state["ids"]]
            self.field_now = self.field.with_mask(self.mask_now)  # type: ignore[attr-defined]
        if buffers is None:
            state["y"], state["f0"] = state["y"][keep], state["f0"][keep]
            return None
        if not remaining:
            return buffers
        y, f0 = state["y"][keep], state["f0"][keep]  # copies: the rows kept move to the front of the storage
        buffers = buffers.first(remaining)
        state["y"], state["f0"] = buffers.y.copy_(y), buffers.k_first.copy_(f0)
        return buffers

    def _gather(self, kept: _Outputs, count: int) -> Tensor:
        """The kept states in the order of their rows ``0 .. count-1`` (each row once): ``(count, 1, M)``."""
        rows, states = torch.cat(kept.rows), torch.cat(kept.states)
        order = torch.empty_like(rows)
        order[rows] = torch.arange(len(rows), device=rows.device)
        if len(rows) != count:
            raise RuntimeError(f"adaptive loop: {len(rows)} states kept for {count} places")
        return states.index_select(0, order)

    def _count_step(self, state: dict[str, Any]) -> None:
        self.progress.steps += 1
        if self.progress.steps > self.max_steps:
            self._fail(state, f"max_steps={self.max_steps} solver steps exceeded", float(state["t"].min()), BUDGET_ADVICE)

    def _fail_non_finite(self, state: dict[str, Any]) -> None:
        self._fail(state, "the state became non-finite (NaN or inf)", float(state["t"].min()), NON_FINITE_ADVICE)

    def _fail_underflow(self, state: dict[str, Any], dt: Tensor) -> None:
        self._fail(state, f"underflow in the step size {float(dt.min()):.3g}", float(state["t"].min()), UNDERFLOW_ADVICE)

    def _fail(self, state: dict[str, Any], message: str, time: float, advice: str) -> None:
        """Record the latest state of every sample (the partial solution) and raise :class:`SolverFailure`."""
        with torch.no_grad():
            rows = [*self.finals.rows, state["ids"]]
            states = [*self.finals.states, state["y"]]
            x = torch.cat(states).detach()[torch.argsort(torch.cat(rows))]
        self.progress.last = (time, x.reshape(self.x_shape).clone())
        raise SolverFailure(f"{message} at t={time:.6g}", time, advice)


class Result(NamedTuple):
    """What :func:`integrate` returns: the final state ``x`` ``(*batch, N, D)``, the states at the grid's times ``xs``
    ``(T, *batch, N, D)`` (or None), and each sample's end time ``ends`` ``(*batch,)`` float64 on the CPU (the end
    of the grid, or where the stop test first passed)."""

    x: Tensor
    xs: Tensor | None
    ends: Tensor


def integrate(
    field: Callable[[Tensor | None, Tensor], Tensor],
    x0: Tensor,
    grid: Tensor,
    *,
    method: str = "dopri5",
    rtol: float = 1e-5,
    atol: float = 1e-6,
    per_sample: bool = True,
    pid: tuple[float, float, float] = I_CONTROLLER,
    first_step: float | None = None,
    max_steps: int = 10_000,
    save_all: bool = True,
    progress: Progress | None = None,
    keep_steps: bool = False,
    callback: StepCallback | None = None,
    stop: StopTest | None = None,
    starts: Tensor | None = None,
    quadrature: Quadrature | None = None,
    graph: GraphMode | None = None,
) -> Result:
    """Integrate ``dx/dt = field(t, x)`` from ``x0`` ``(*batch, N, D)`` over the float64 ``grid`` ``(T,)``.

    Args:
        method: a key of :data:`TABLEAUX` (:attr:`~et_ode.Adaptive.OWN_METHODS`).
        per_sample: each sample its own step size, error norm, accept/reject and end (else one for the batch).
        pid: the controller's ``(pcoeff, icoeff, dcoeff)``; :data:`I_CONTROLLER` by default.
        first_step: the first step size, or None to choose it (one evaluation more).
        save_all: return the states at every time of ``grid`` (by the interpolant), else only the final one.
        progress: a record whose ``steps`` (batched steps), ``accepted`` and ``rejected`` (per sample steps, summed),
            ``sample_evaluations``, ``last_dt``, ``last`` (set on failure) and ``saved`` (``keep_steps``: the start
            of every accepted shared step) are filled.
        callback: called after every step with each sample's time ``(B,)`` float64 and its number of accepted steps
            ``(B,)`` int64 (CPU tensors, B the flattened batch).
        stop: a test ``(x, velocity) -> (G,)`` on the groups' states (per sample: ``(G, N, D)``; shared: the whole
            ``x0``-shaped state, one value), negative where it passes: a group that passes at the start ends there;
            one whose accepted step ends passing ends where the test crosses zero inside the step (see
            :meth:`_Loop.crossing`). Needs ``save_all=False``.
        starts: each sample's start time ``(*batch,)`` (per sample only; a sample starting at or after the grid's end
            ends there at once), or None: the grid's first time. Needs ``save_all=False``.
        quadrature: called after every step with the accepted groups and their stages (see :data:`Quadrature`), for
            a quantity integrated beside the state whose error does not control the steps (the adjoint's parameter
            gradient).
        graph: ``"cuda"``: after :data:`WARM_STEPS` steps, capture a step in a CUDA graph and replay it (shared steps
            of an :class:`~et_ode.ETField` without gradients, a stop or a quadrature; otherwise the loop runs as
            without); ``"eager"``: the same capture and replay discipline run eagerly (see :class:`_StepGraph`);
            ``"compile"``: the whole solve compiled (for the same fields, without ``starts``): the native loop
            (:class:`~et_ode.kernels.native.NativeSolve`) where it computes the field, else :func:`_whole_solve` under
            ``torch.compile`` (every sample evaluated at every step); either writes the states at the grid's times too
            and takes per-sample steps at any batch, in calls of about :data:`CHUNK_SECONDS` (at most
            :data:`LOGGED_STEPS` steps a call with a ``callback``, a step a call with ``keep_steps``); ``"native"``:
            the native loop where it computes the field, else no capture; None: no capture.

    Returns the :class:`Result`. Gradients
    flow through the stages and the interpolant (the step sizes are constants to autograd, as in torchdiffeq and
    diffrax). Raises :class:`~et_ode.integrators.solvers.SolverFailure` past ``max_steps`` steps or on a step-size underflow;
    ValueError naming a bad ``method``, ``per_sample`` with ``keep_steps``, a ``stop`` with ``save_all``, or a bad
    ``pid``.
    """
    if method not in TABLEAUX:
        raise ValueError(f"method must be one of {tuple(TABLEAUX)} for et-ode's adaptive loop, got {method!r}")
    if per_sample and keep_steps:
        raise ValueError("save='steps' needs one step sequence for the batch: use step_control='shared'")
    if stop is not None and (save_all or keep_steps):
        raise ValueError("a stop with et-ode's adaptive loop needs save='final'")
    if len(pid) != 3 or not all(isinstance(c, (int, float)) and c >= 0 for c in pid) or sum(pid) <= 0:
        raise ValueError(f"pid must be three non-negative coefficients (pcoeff, icoeff, dcoeff), not all zero; got {pid!r}")
    if starts is not None and (not per_sample or save_all):
        raise ValueError("starts (a start time per sample) needs per_sample=True and save_all=False")
    if graph not in (None, "cuda", "eager", "compile", "native"):
        raise ValueError(f"graph must be None, 'cuda', 'eager', 'compile' or 'native', got {graph!r}")
    if progress is None:
        progress = Progress()
    loop = _Loop(
        field,
        x0,
        grid,
        TABLEAUX[method],
        rtol,
        atol,
        per_sample,
        pid,
        max_steps,
        progress,
        callback,
        stop,
        quadrature,
        graph,
    )
    x, xs = loop.run(x0, first_step, save_all, keep_steps, starts)
    ends = loop.stop_times if per_sample else loop.stop_times.expand(x0.shape[:-2].numel())
    return Result(x, xs, ends.reshape(x0.shape[:-2]).clone())


def _graph_mode(solver: Adaptive, x0: Tensor) -> GraphMode | None:
    """How ``solver``'s settings capture or compile a solve of ``x0``: the CUDA graph on CUDA, ``torch.compile`` or
    the native loop (``compile=True``), the native loop alone (``compile="auto"`` without a progress callback, whose
    steps it reports one at a time), or nothing."""
    if solver.cuda_graph and x0.is_cuda:
        return "cuda"
    if solver.compile is True:
        return "compile"
    return "native" if solver.compile == "auto" and solver.progress is None else None


def solve_adaptive(
    solver: Adaptive,
    field: ETField,
    x0: Tensor,
    grid: Tensor,
    arguments: dict[str, Any],
    max_steps: int,
    save: str,
    progress: Progress,
    stop: SteadyState | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Status]:
    """``solve``'s entry: integrate with the settings of ``solver`` (et-ode's loop), ``save`` one of ``"all"``,
    ``"steps"``, ``"final"``, filling ``progress``; a ``stop`` ends each sample (per-sample control) or the batch
    (shared) at the end of the first accepted step where it passes. ``arguments`` are the gradient strategy's
    torchdiffeq arguments: with an adjoint's (``adjoint_params``, ``adjoint_method``, ``adjoint_rtol``,
    ``adjoint_atol``) the gradient is the backward solve of :class:`_Adjoint` on this loop, else autograd through
    the loop. Under gradients a stop's time is differentiated too (:func:`_through_the_stop_time`).

    Returns the final state, the saved states (or None), their times ``ts`` (the grid; with a stop, its start and the
    latest stop), each sample's stop time ``(*batch,)`` (with a stop, else None) and the status. ValueError naming
    ``Adjoint.method`` for a backward method this loop does not run."""
    per_sample = solver.step_control == "per_sample"
    settings: dict[str, Any] = dict(
        method=solver.method,
        rtol=solver.rtol,
        atol=solver.atol,
        per_sample=per_sample,
        pid=PID_COEFFICIENTS if solver.controller == "pid" else I_CONTROLLER,
        first_step=dict(solver.options or {}).get("first_step"),
        max_steps=max_steps,
        save_all=save == "all",
        progress=progress,
        keep_steps=save == "steps",
        callback=solver.progress,
        stop=None if stop is None else functools.partial(_stop_value, stop, field, per_sample),
        graph=_graph_mode(solver, x0),
    )
    params = tuple(p for p in field.parameters() if p.requires_grad)
    if "adjoint_params" in arguments and torch.is_grad_enabled() and (x0.requires_grad or params):
        method = arguments.get("adjoint_method") or solver.method
        if method not in TABLEAUX:
            raise ValueError(f"Adjoint.method must be None or one of {tuple(TABLEAUX)} with et-ode's loop, got {method!r}")
        adjoint = _Adjoint(field, grid, settings, method, arguments["adjoint_rtol"], arguments["adjoint_atol"])
        x, xs = _AdjointSolve.apply(x0, adjoint, *params)
        result = Result(x, xs if save == "all" else None, adjoint.ends)
    else:
        result = integrate(field, x0, grid, **settings)
    if stop is None:
        return result.x, result.xs, grid, None, Status.REACHED_END
    last_stop = float(result.ends.max())
    x = result.x
    if torch.is_grad_enabled() and (x.requires_grad or params):
        ends = result.ends.to(x.device)
        crossed = (ends > float(grid[0])) & (ends < float(grid[-1]))  # stopped inside the span, not at its start
        x = _through_the_stop_time(stop, field, per_sample, x, crossed if per_sample else crossed.all())
    with torch.no_grad():
        reached = bool(within_tol(stop.rms(field, result.x, field.velocity(result.x)), stop.tol).all())
    status = Status.STEADY_STATE if reached and last_stop < float(grid[-1]) else Status.REACHED_END
    ts = torch.tensor([float(grid[0]), last_stop], dtype=grid.dtype, device=grid.device)
    return x, None, ts, result.ends, status


class _AdjointField:
    """The adjoint's backward dynamics in reversed time ``s = -t`` on ``z = [x; a]`` (the tokens stacked, ``(..., 2N,
    D)``): ``dx/ds = -f(x)`` and ``da/ds = a^T df/dx`` (a vector-Jacobian product of the field), which the loop
    integrates from each sample's end back to the start. It carries the field's mask, so that the loop binds each
    sample's own as samples leave the batch. With ``params`` (one step size for the batch) each evaluation also pulls
    ``a`` back to the parameters, ``a^T df/dtheta`` summed over the batch, and keeps it in ``records`` for the
    parameter quadrature (:class:`_ParameterGradient`): the first and the last ``kept - 1`` (rejected steps' pullbacks
    are dropped as new ones come)."""

    def __init__(self, field: ETField, params: tuple[Tensor, ...] = ()):
        self.field, self.params = field, params
        self.records: list[tuple[Tensor | None, ...]] = []
        self.kept = 0

    @property
    def mask(self) -> object:
        return self.field.mask

    def with_mask(self, mask: Tensor) -> _AdjointField:
        return _AdjointField(self.field.with_mask(mask))

    def __call__(self, t: Tensor | None, z: Tensor) -> Tensor:
        tokens = z.shape[-2] // 2
        x, a = z[..., :tokens, :], z[..., tokens:, :]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            velocity = self.field(None, x)
            pullback, *parameters = torch.autograd.grad(velocity, (x, *self.params), a, allow_unused=True)
        if self.params:
            self.records.append(tuple(parameters))
            if len(self.records) > self.kept:
                del self.records[1 : len(self.records) - self.kept + 1]
        return torch.cat([-velocity.detach(), pullback], dim=-2)


#: the parameter quadrature stacks a step's stages into one evaluation while their states hold at most this many
#: numbers: that saves the fixed cost of an evaluation on small batches; larger ones run faster a stage at a time
STACK_LIMIT = 2**18


def _stacked(field: ETField, stages: int) -> ETField:
    """``field`` for ``stages`` batches of its samples stacked one after another: its masks, one per sample
    ``(samples, N, N)``, repeated; itself where one mask (or none) serves every sample."""
    mask = field.mask
    if isinstance(mask, Tensor) and mask.shape[:-2].numel() > 1:
        return field.with_mask(mask.repeat(stages, 1, 1))
    return field


class _ParameterGradient:
    """The adjoint's parameter gradient ``integral a^T df/dtheta dt``, a quadrature along each sample's accepted
    backward steps with the method's solution weights: ``sum_j b_j dt a_j^T df/dtheta(x_j)`` at the stage inputs
    ``[x_j; a_j]`` (a :data:`Quadrature` for the loop). Per sample it evaluates the field there, the stages of a step
    stacked into one batch and one vector-Jacobian product where they are small (:data:`STACK_LIMIT`), else one per
    stage; ``masks``: the flattened batch's masks ``(B, N, N)`` per sample, bound to the accepted samples, or None
    (one mask for all). With one step size for the batch, the pullbacks
    the adjoint dynamics ``recorded`` at each evaluation serve instead (no evaluation of its own): a step's stages are
    its last ``stages - 1`` evaluations, and its first stage the evaluation that began the solve or ended the last
    accepted step (first same as last); :meth:`restart` before each solve."""

    def __init__(self, field: ETField, params: tuple[Tensor, ...], masks: Tensor | None, tokens: int, dim: int):
        self.field, self.params, self.masks, self.shape = field, params, masks, (2 * tokens, dim)
        self.total = [torch.zeros_like(p) for p in params]
        self.recorded: _AdjointField | None = None
        self.stages = 0
        self.first: tuple[Tensor | None, ...] | None = None  # the first stage's pullback of the step to come

    def restart(self, recorded: _AdjointField | None, stages: int) -> None:
        """Use the pullbacks of ``recorded`` (None: evaluate at the stage inputs) for a solve by a method of
        ``stages`` stages."""
        self.recorded, self.stages, self.first = recorded, stages, None
        if recorded is not None:
            recorded.records.clear()
            recorded.kept = stages  # the solve's first evaluation and a step's stages - 1

    def __call__(self, ids: Tensor, stages: list[int], stage_input: Callable[[int], Tensor], scales: list[Tensor]) -> None:
        if self.recorded is not None:
            self._add_recorded(stages, scales)
            return
        inputs = [stage_input(j) for j in stages]  # (one group a sample: the weights are theirs)
        field = self.field if self.masks is None else self.field.with_mask(self.masks[ids])
        if len(inputs) * inputs[0].numel() // 2 <= STACK_LIMIT:
            stacked = _stacked(field, len(inputs))
            self._add(stacked, torch.cat(inputs), torch.cat(scales))
            stacked.count_evaluations(len(inputs) - 1)  # one evaluation of the batch per stage, as unstacked
            return
        for z, scale in zip(inputs, scales, strict=True):
            self._add(field, z, scale)

    def _add_recorded(self, stages: list[int], scales: list[Tensor]) -> None:
        """Add ``sum_j b_j dt a_j^T df/dtheta(x_j)`` of the accepted step from the recorded pullbacks."""
        assert self.recorded is not None
        records = self.recorded.records
        step = [self.first if self.first is not None else records[0], *records[-(self.stages - 1) :]]
        for j, scale in zip(stages, scales, strict=True):
            weight = scale.reshape(())  # (one group: the batch)
            for total, grad in zip(self.total, step[j], strict=True):
                if grad is not None:
                    total.add_(grad * weight.to(grad.dtype))
        self.first = records[-1]
        records.clear()

    def _add(self, field: ETField, z: Tensor, weight: Tensor) -> None:
        """Add ``sum_s weight_s a_s^T df/dtheta(x_s)`` over the samples of ``z`` ``[x; a]`` with weights ``(S,)``."""
        z = z.reshape(-1, *self.shape)  # (samples, 2N, D)
        tokens = self.shape[0] // 2
        with torch.enable_grad():
            velocity = field(None, z[:, :tokens])
            cotangent = z[:, tokens:] * weight.to(z.dtype)[:, None, None]
            grads = torch.autograd.grad(velocity, self.params, cotangent, allow_unused=True)
        for total, grad in zip(self.total, grads, strict=True):
            if grad is not None:
                total.add_(grad)


class _Adjoint:
    """One adjoint solve on this loop: the forward integration of ``settings`` (:func:`integrate`'s arguments) without
    a graph, then (:meth:`backward`) the backward solve of :class:`_AdjointField` with the backward ``method``,
    ``rtol``, ``atol`` and the forward's step control, from each sample's end (the grid's end or its stop) back to the
    start: through every saved time of the grid, where the adjoint takes that time's cotangent and the state is reset
    to the forward's (as torchdiffeq's adjoint does), or in one span per sample. The parameters' channels never
    control the steps (a seminorm, always)."""

    def __init__(self, field: ETField, grid: Tensor, settings: dict[str, Any], method: str, rtol: float, atol: float):
        self.field, self.grid, self.settings = field, grid, settings
        self.backward_settings = dict(
            method=method,
            rtol=rtol,
            atol=atol,
            per_sample=settings["per_sample"],
            pid=settings["pid"],
            max_steps=settings["max_steps"],
            save_all=False,
        )
        self.ends = torch.empty(0, dtype=torch.float64)
        self.x = self.xs = torch.empty(0)

    def forward(self, x0: Tensor) -> tuple[Tensor, Tensor]:
        """The final states and the saved ones (an empty tensor where none are saved)."""
        with torch.no_grad():
            result = integrate(self.field, x0, self.grid, **self.settings)
        self.ends, self.x = result.ends, result.x
        self.xs = result.xs if result.xs is not None else x0.new_empty(0)
        return self.x, self.xs

    def backward(
        self, params: tuple[Tensor, ...], grad_x: Tensor | None, grad_xs: Tensor | None
    ) -> tuple[Tensor, list[Tensor]]:
        """The gradient of the start ``(*batch, N, D)`` and of ``params`` given the cotangents of the final and saved
        states (None: zero). SolveError past ``max_steps`` backward steps or on a step-size underflow."""
        end = float(self.ends.max()) if self.ends.numel() else float(self.grid[-1])
        if not all(bool(torch.isfinite(g).all()) for g in (grad_x, grad_xs) if g is not None):
            raise SolveError(
                f"the adjoint's backward solve failed at t={end:.6g}: a non-finite adjoint state (the loss's "
                f"gradient with respect to the solution holds NaN or inf)",
                time=end,
                solution=None,
            )
        shape = self.x.shape
        tokens, dim = shape[-2], shape[-1]
        x = self.x.reshape(-1, tokens, dim)
        a = torch.zeros_like(x) if grad_x is None else grad_x.reshape(x.shape).clone()
        per_sample = self.settings["per_sample"]
        masks = _per_sample_mask(self.field, shape[:-2]) if per_sample else None
        field = self.field if masks is None else self.field.with_mask(masks)
        parameters = _ParameterGradient(field, params, masks, tokens, dim)
        dynamics = _AdjointField(field, () if per_sample else params)  # shared steps: pullbacks at each evaluation
        grid = self.grid
        try:
            if self.settings["save_all"]:
                saved = self.xs.reshape(len(grid), *x.shape)
                cotangents = torch.zeros_like(saved) if grad_xs is None else grad_xs.reshape(saved.shape)
                a = a + cotangents[-1]
                for k in range(len(grid) - 1, 0, -1):
                    span = torch.stack([-grid[k], -grid[k - 1]])
                    a = self._solve(dynamics, saved[k], a, span, None, parameters) + cotangents[k - 1]
            elif float(self.ends.max()) > float(grid[0]):
                ends = self.ends.reshape(-1).to(grid)
                span = torch.stack([-ends.max(), -grid[0]])
                a = self._solve(dynamics, x, a, span, -ends if per_sample else None, parameters)
        except SolverFailure as failure:
            what = {
                BUDGET_ADVICE: f"more than max_steps={self.settings['max_steps']} steps",
                NON_FINITE_ADVICE: "a non-finite adjoint state",
            }.get(failure.advice, "an underflow in its step size")
            raise SolveError(
                f"the adjoint's backward solve failed at t={-failure.time:.6g}: {what}; the backward dynamics are "
                f"stiffer than the forward: raise max_steps, loosen Adjoint(rtol=..., atol=...), or gradient=Direct()",
                time=-failure.time,
                solution=None,
            ) from failure
        return a.reshape(shape), parameters.total

    def _solve(
        self,
        dynamics: _AdjointField,
        x: Tensor,
        a: Tensor,
        span: Tensor,
        starts: Tensor | None,
        parameters: _ParameterGradient,
    ) -> Tensor:
        """The adjoint ``a`` carried back over ``span`` (reversed time) from the states ``x``, ``(B, N, D)``."""
        z = torch.cat([x, a], dim=-2)
        parameters.restart(dynamics if dynamics.params else None, TABLEAUX[self.backward_settings["method"]].stages)
        quadrature = parameters if parameters.params else None  # (no parameter asks for a gradient: none to integrate)
        end = integrate(dynamics, z, span, starts=starts, quadrature=quadrature, **self.backward_settings).x
        return end[:, x.shape[-2] :]


class _AdjointSolve(torch.autograd.Function):
    """The forward solve of an :class:`_Adjoint` as one autograd node of the start and the parameters: its backward
    is the adjoint's backward solve."""

    @staticmethod
    def forward(ctx: Any, x0: Tensor, adjoint: _Adjoint, *params: Tensor) -> tuple[Tensor, Tensor]:
        ctx.adjoint, ctx.params = adjoint, params
        x, xs = adjoint.forward(x0)
        if not xs.numel():
            ctx.mark_non_differentiable(xs)
        return x, xs

    @staticmethod
    def backward(ctx: Any, grad_x: Tensor | None, grad_xs: Tensor | None) -> tuple[Tensor | None, ...]:
        grad_xs = grad_xs if grad_xs is not None and grad_xs.numel() else None
        grad_x0, grad_params = ctx.adjoint.backward(ctx.params, grad_x, grad_xs)
        return (grad_x0, None, *grad_params)


def _through_the_stop_time(stop: SteadyState, field: ETField, per_sample: bool, x: Tensor, crossed: Tensor) -> Tensor:
    """``x`` (the states where the stop's value ``c`` crossed zero, ``(*batch, N, D)``) with the stop time's own
    dependence on the start and the parameters added to its gradient: ``x + f (tau - tau.detach())``, ``tau =
    -c(x, theta) / (dc/dt)``, the implicit function theorem on ``c(x(t*), theta) = 0`` (``dc/dt = dc/dx . f``, the
    field autonomous). Its value is ``x``; backpropagating ``v`` through it adds ``(v . f) dt*/d(x, theta)``.
    ``crossed``: the samples ``(*batch,)`` (per sample) or the batch (one bool) whose stop is a crossing."""
    with torch.no_grad():
        f = field.velocity(x.detach())
    with torch.enable_grad():
        probe = x.detach().requires_grad_(True)
        (slope,) = torch.autograd.grad(_stop_value(stop, field, per_sample, probe, field.velocity(probe)).sum(), probe)
    rate = (slope * f).sum(dim=(-1, -2)) if per_sample else (slope * f).sum()
    value = _stop_value(stop, field, per_sample, x, field.velocity(x))
    usable = crossed & (rate != 0)
    tau = torch.where(usable, -value / torch.where(usable, rate, torch.ones_like(rate)), torch.zeros_like(value))
    shift = tau - tau.detach()
    return x + f * (shift[..., None, None] if per_sample else shift)


def _stop_value(stop: SteadyState, field: ETField, per_sample: bool, x: Tensor, velocity: Tensor) -> Tensor:
    """The stop's value ``log(measure / tol)`` (negative: the test passes): per sample ``(G,)``, or of the largest
    measure of the batch (one value)."""
    measure = stop.rms(field, x, velocity)
    return torch.log((measure if per_sample else measure.max()) / stop.tol)
