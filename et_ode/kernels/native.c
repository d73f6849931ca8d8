/* et-ode's native solve: the explicit embedded Runge-Kutta loop of et_ode.integrators.adaptive_loop._whole_solve
 * and the ET field's closed-form velocity, in C, for the CPU. Built by et_ode/kernels/native.py with the system's
 * C compiler (-DREAL=float or double); the matrix products go to the BLAS that PyTorch links (its ?gemm_, passed in
 * as a pointer). No fast-math: NaN and inf propagate as in PyTorch.
 *
 * Layouts (row-major): a state block of b samples is (b, N, D); the stacked weights W = [WK; WQ; xi] are (R, D),
 * R = 2 H Y + K; the projections P = g W^T are (b N, R) = [keys | queries | overlaps h]; the coefficients C that
 * give the velocity C W / tau are laid out as P: [sum_C S_h[B, C] Q_hC | sum_B S_h[B, C] K_hB | phi(h)].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef REAL
#define REAL float
#endif
typedef REAL real;
/* the signed integer as wide as a real (its bits, and exp's powers of two, in the same vector lanes) */
#define WIDTH_float 32
#define WIDTH_double 64
#define WIDTH_OF(type) WIDTH_##type
#define WIDTH(type) WIDTH_OF(type)
#if WIDTH(REAL) == 32
typedef int32_t integer;
#else
typedef int64_t integer;
#endif

/* Fortran BLAS ?gemm_: integers are read through pointers to 64-bit storage, which an LP64 BLAS reads as its 32-bit
 * value (little-endian) and an ILP64 BLAS whole. */
typedef void (*gemm_fn)(const char *, const char *, const void *, const void *, const void *, const real *,
                        const real *, const void *, const real *, const void *, const real *, real *, const void *);

/* MKL's ?gemm_batch_ with one group (so each of its integer arrays holds one value, read as above), or NULL. */
typedef void (*gemm_batch_fn)(const char *, const char *, const void *, const void *, const void *, const real *,
                              const real **, const void *, const real **, const void *, const real *, real **,
                              const void *, const void *, const void *);

typedef struct {
    int64_t tokens, dim, heads, head_dim, memories;
    int64_t neuron;   /* 0: identity (g = x), 1: LayerNorm (g = gamma (x - mean) / sqrt(var + eps) + delta) */
    int64_t hopfield; /* 0: relu, 1: softplus, 2: softmax */
    int64_t self_attention;
    double gamma, eps, hopfield_beta, tau;
    const real *delta; /* (D) */
    const real *w;     /* (R, D) */
    const real *beta;  /* (H) */
    gemm_fn gemm;
    gemm_batch_fn gemm_batch;
    real *g, *p, *coef, *scores; /* workspace: (b N D), (b N R), (b N R), (N + 3) b H N */
    void **pointers;             /* workspace: (3 b H) */
    int64_t threads;             /* the threads of its own passes (those between the products) */
} et_field;

typedef struct {
    int64_t groups, samples, stages, times, logged, degree; /* samples: per group; degree: the dense polynomials' */
    int64_t width;                                          /* of a group's state: samples N D */
    double t_end, rtol, atol, error_order, pcoeff, icoeff, dcoeff, safety, factor_min, factor_max;
    const real *matrix;       /* (S + 1, S): stage inputs (rows 0 .. S-2), error (row S-1) */
    const real *dense;        /* (S, degree + 1): y(t0 + theta h) = y0 + h sum_j b_j(theta) k_j */
    const double *out_times;  /* (T) */
    real *k, *y1, *stage;     /* workspace: (G, S, M), (G, M), (threads, M) */
    double *ratio, *step, *t1, *next_dt, *history; /* workspace: (G), (G), (G), (G), (G, 2) */
} et_solver;

/* Run `call` once on each of `team` threads (team > 1, built with OpenMP), with [lo, hi) its contiguous part of
 * [0, count), else once with the whole range; each element's work is the same either way, so are the bits. */
#ifdef _OPENMP
static void share(int64_t count, int64_t *lo, int64_t *hi) {
    int64_t parts = omp_get_num_threads(), part = omp_get_thread_num(), size = count / parts, rest = count % parts;
    *lo = part * size + (part < rest ? part : rest);
    *hi = *lo + size + (part < rest);
}
#define SPREAD(team, count, lo, hi, call)                                                                              \
    do {                                                                                                               \
        int spread_team = (int)(team);                                                                                 \
        if (spread_team > 1) {                                                                                         \
            _Pragma("omp parallel num_threads(spread_team)") {                                                         \
                int64_t lo, hi;                                                                                        \
                share((count), &lo, &hi);                                                                              \
                call;                                                                                                  \
            }                                                                                                          \
        } else {                                                                                                       \
            int64_t lo = 0, hi = (count);                                                                              \
            call;                                                                                                      \
        }                                                                                                              \
    } while (0)
#else
#define SPREAD(team, count, lo, hi, call)                                                                              \
    do {                                                                                                               \
        int64_t lo = 0, hi = (count);                                                                                  \
        (void)(team);                                                                                                  \
        call;                                                                                                          \
    } while (0)
#endif

static void gemm(const et_field *f, char ta, char tb, int64_t m, int64_t n, int64_t k, real alpha, const real *a,
                 int64_t lda, const real *b, int64_t ldb, real *c, int64_t ldc) {
    const real zero = 0;
    f->gemm(&ta, &tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &zero, c, &ldc);
}

/* exp(x) for x <= 0 (the softmax's shifted arguments, -inf included) in a loop the compiler vectorises, in the
 * state's precision: x = n ln 2 + f, |f| <= ln(2) / 2 (ln 2 in two parts, so that f is exact), e^f by its Taylor
 * polynomial (to f^7 in float, f^13 in double: truncation below a tenth of the epsilon), times 2^n. Below e^-86 in
 * float (e^-707 in double) it is 0 rather than a subnormal number, which the CPU computes many times slower:
 * in a softmax such a term weighs less than the smallest normal number against the row's largest, which is 1. */
#define EXP_TERMS (sizeof(real) == 4 ? 8 : 14)
static const real INVERSE_FACTORIALS[14] = {
    1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040, 1.0 / 40320, 1.0 / 362880,
    1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600, 1.0 / 6227020800.0};

static void exp_nonpositive(real *x, int64_t n) {
    const real lowest = sizeof(real) == 4 ? -86 : -707;
    const real ln2_high = 0.693145751953125, ln2_low = 1.42860682030941723212e-6;
    const integer bias = sizeof(real) == 4 ? 127 : 1023, shift = sizeof(real) == 4 ? 23 : 52;
    for (int64_t i = 0; i < n; i++) {
        real v = x[i] < lowest ? lowest : x[i];
        real whole = __builtin_nearbyint(v * (real)1.4426950408889634);
        real f = (v - whole * ln2_high) - whole * ln2_low;
        real p = INVERSE_FACTORIALS[EXP_TERMS - 1];
        for (int q = EXP_TERMS - 2; q >= 0; q--) p = p * f + INVERSE_FACTORIALS[q];
        union { real r; integer i; } scale;
        scale.i = ((integer)whole + bias) << shift;
        x[i] = x[i] < lowest ? 0 : p * scale.r;
    }
}

/* Sums of d numbers in LANES partial sums, a loop the compiler vectorises (it does not reorder one sum itself). */
#define LANES 16

static real sum_of(const real *x, int64_t d) {
    real partial[LANES] = {0}, total = 0;
    int64_t whole = d - d % LANES;
    for (int64_t j = 0; j < whole; j += LANES)
        for (int64_t l = 0; l < LANES; l++) partial[l] += x[j + l];
    for (int64_t l = 0; l < LANES; l++) total += partial[l];
    for (int64_t j = whole; j < d; j++) total += x[j];
    return total;
}

static real squares_about(const real *x, int64_t d, real mean) {
    real partial[LANES] = {0}, total = 0;
    int64_t whole = d - d % LANES;
    for (int64_t j = 0; j < whole; j += LANES)
        for (int64_t l = 0; l < LANES; l++) partial[l] += (x[j + l] - mean) * (x[j + l] - mean);
    for (int64_t l = 0; l < LANES; l++) total += partial[l];
    for (int64_t j = whole; j < d; j++) total += (x[j] - mean) * (x[j] - mean);
    return total;
}

static double squares_in_double(const real *x, int64_t d) {
    double partial[LANES] = {0}, total = 0;
    int64_t whole = d - d % LANES;
    for (int64_t j = 0; j < whole; j += LANES)
        for (int64_t l = 0; l < LANES; l++) partial[l] += (double)x[j + l] * (double)x[j + l];
    for (int64_t l = 0; l < LANES; l++) total += partial[l];
    for (int64_t j = whole; j < d; j++) total += (double)x[j] * (double)x[j];
    return total;
}

/* g = the neuron's output at the rows [lo, hi) of x. */
static void normalize(const et_field *f, int64_t lo, int64_t hi, const real *x, real *g) {
    int64_t d = f->dim;
    for (int64_t i = lo; i < hi; i++) {
        const real *xi = x + i * d;
        real *gi = g + i * d;
        if (f->neuron == 0) {
            memcpy(gi, xi, d * sizeof(real));
            continue;
        }
        real mean = sum_of(xi, d) / (real)d;
        real scale = (real)f->gamma / sqrt(squares_about(xi, d, mean) / (real)d + (real)f->eps);
        for (int64_t j = 0; j < d; j++) gi[j] = (xi[j] - mean) * scale + f->delta[j];
    }
}

/* The per-head products of the b samples' projections p. The scores of every (sample, head) block share one
 * layout: row k (a key) holds, for each block in turn, its N queries, so that a query's softmax over the keys runs
 * down a column and every pass over the scores is one long loop ("lanes": a column per query of every block).
 * which = 0: the scores K_k . Q_c; 1: sum_C S[B, C] Q_C and 2: sum_B S[B, C] K_B, into each head's slot of out.
 * One batched call where the BLAS has one, else a call a head. */
static void head_products(const et_field *f, int64_t b, int which, const real *p, real *out) {
    int64_t n = f->tokens, y = f->head_dim, hy = f->heads * f->head_dim, count = b * f->heads, lanes = count * n;
    int64_t r = 2 * hy + f->memories, lda = r, ldb = which == 0 ? r : lanes, ldc = which == 0 ? lanes : r;
    int64_t m = which == 0 ? n : y, size = 1;
    char ta = which == 0 ? 'T' : 'N', tb = which == 2 ? 'T' : 'N';
    const real **a = (const real **)f->pointers, **bs = a + count;
    real **c = (real **)(bs + count);
    for (int64_t i = 0; i < b; i++)
        for (int64_t h = 0; h < f->heads; h++) {
            int64_t at = i * f->heads + h;
            const real *keys = p + i * n * r + h * y, *queries = keys + hy, *scores = f->scores + at * n;
            a[at] = which == 2 ? keys : queries;
            bs[at] = which == 0 ? keys : scores;
            c[at] = which == 0 ? f->scores + at * n : out + i * n * r + (which == 1 ? 0 : hy) + h * y;
        }
    if (f->gemm_batch != NULL) {
        const real one = 1, zero = 0;
        f->gemm_batch(&ta, &tb, &m, &n, which == 0 ? &y : &n, &one, a, &lda, bs, &ldb, &zero, c, &ldc, &size, &count);
        return;
    }
    for (int64_t at = 0; at < count; at++)
        gemm(f, ta, tb, m, n, which == 0 ? y : n, 1, a[at], lda, bs[at], ldb, c[at], ldc);
}

/* The softmax over the keys (rows) of the columns [lo, hi) of the scores s (n rows of `lanes`): beta_h K_k . Q_c,
 * minus the column's largest, its exp, over the column's sum (a query without a key: no attention); scratch: the
 * columns' largest, sum and beta (lanes each). */
static void softmax_columns(const et_field *f, int64_t lanes, int64_t lo, int64_t hi, real *s, real *largest,
                            real *sum, real *beta) {
    int64_t n = f->tokens;
    for (int64_t j = lo; j < hi; j++) {
        beta[j] = f->beta[(j / n) % f->heads];
        largest[j] = -INFINITY;
        sum[j] = 0;
        if (!f->self_attention) s[(j % n) * lanes + j] = -INFINITY;
    }
    for (int64_t k = 0; k < n; k++) {
        real *row = s + k * lanes;
        for (int64_t j = lo; j < hi; j++) {
            real v = row[j] * beta[j];
            row[j] = v;
            largest[j] = v > largest[j] || v != v ? v : largest[j];
        }
    }
    for (int64_t j = lo; j < hi; j++) largest[j] = largest[j] == -INFINITY ? 0 : largest[j]; /* (keyless: exp 0) */
    for (int64_t k = 0; k < n; k++) {
        real *row = s + k * lanes;
        for (int64_t j = lo; j < hi; j++) row[j] -= largest[j];
        exp_nonpositive(row + lo, hi - lo);
        for (int64_t j = lo; j < hi; j++) sum[j] += row[j];
    }
    for (int64_t k = 0; k < n; k++) {
        real *row = s + k * lanes;
        for (int64_t j = lo; j < hi; j++) row[j] = sum[j] != 0 ? row[j] / sum[j] : 0;
    }
}

/* S_h, the softmax over the keys of each query of beta_h K_k . Q_c, of the b samples' projections p, then the two
 * per-head products into the coefficients; the scores' layout is head_products'. */
static void attention(const et_field *f, int64_t b, const real *p, real *coef) {
    int64_t n = f->tokens, lanes = b * f->heads * n;
    real *s = f->scores, *largest = s + n * lanes, *sum = largest + lanes, *beta = sum + lanes;
    head_products(f, b, 0, p, coef);
    SPREAD(f->threads, lanes, lo, hi, softmax_columns(f, lanes, lo, hi, s, largest, sum, beta));
    head_products(f, b, 1, p, coef);
    head_products(f, b, 2, p, coef);
}

/* phi(h), the memories' activation, at the rows [lo, hi) of the projections p, into the coefficients. */
static void hopfield(const et_field *f, int64_t lo, int64_t hi, const real *p, real *coef) {
    int64_t hy = f->heads * f->head_dim, r = 2 * hy + f->memories, k = f->memories;
    real beta = (real)f->hopfield_beta;
    for (int64_t i = lo; i < hi; i++) {
        const real *h = p + i * r + 2 * hy;
        real *phi = coef + i * r + 2 * hy;
        if (f->hopfield == 0) {
            for (int64_t j = 0; j < k; j++) phi[j] = h[j] > 0 ? h[j] : (h[j] != h[j] ? h[j] : 0);
        } else if (f->hopfield == 1) { /* softplus(beta h) / beta * sigmoid(beta h) */
            for (int64_t j = 0; j < k; j++) {
                real z = beta * h[j];
                real softplus = z > 20 ? z : log1p(exp(z));
                phi[j] = softplus / beta * (1 / (1 + exp(-z)));
            }
        } else { /* softmax over the memories of beta h */
            real largest = -INFINITY, sum = 0;
            for (int64_t j = 0; j < k; j++) {
                phi[j] = beta * h[j];
                largest = phi[j] > largest || phi[j] != phi[j] ? phi[j] : largest;
            }
            for (int64_t j = 0; j < k; j++) phi[j] -= largest;
            exp_nonpositive(phi, k);
            for (int64_t j = 0; j < k; j++) sum += phi[j];
            for (int64_t j = 0; j < k; j++) phi[j] /= sum;
        }
    }
}

/* dx/dt = -(1/tau) dE/dg at the b samples x (b, N, D), written into out. */
void et_velocity(const et_field *f, int64_t b, const real *x, real *out) {
    int64_t n = f->tokens, d = f->dim, rows = b * n;
    int64_t r = 2 * f->heads * f->head_dim + f->memories;
    SPREAD(f->threads, rows, lo, hi, normalize(f, lo, hi, x, f->g));
    gemm(f, 'T', 'N', r, rows, d, 1, f->w, d, f->g, d, f->p, r);
    attention(f, b, f->p, f->coef);
    SPREAD(f->threads, rows, lo, hi, hopfield(f, lo, hi, f->p, f->coef));
    gemm(f, 'N', 'N', d, rows, r, (real)(1.0 / f->tau), f->w, d, f->coef, r, out, d);
}

/* ---- the loop ---------------------------------------------------------------------------------------------- */

/* into = y0 + sum_j weights[j] k_j over j < count (the sum first, then y0: as a batched product adds its input) at
 * the elements [lo, hi) of states of m; y0 NULL: the sum alone. Loops along the state, which the compiler
 * vectorises. */
static void combine_part(int64_t lo, int64_t hi, int64_t m, int64_t count, const real *weights, const real *k,
                         const real *y0, real *into) {
    for (int64_t e = lo; e < hi; e++) into[e] = weights[0] * k[e];
    for (int64_t j = 1; j < count; j++) {
        real w = weights[j];
        const real *kj = k + j * m;
        for (int64_t e = lo; e < hi; e++) into[e] += w * kj[e];
    }
    if (y0 != NULL)
        for (int64_t e = lo; e < hi; e++) into[e] += y0[e];
}

/* combine_part over the whole states, on `team` threads. */
static void combine(int64_t team, int64_t m, int64_t count, const real *weights, const real *k, const real *y0,
                    real *into) {
    SPREAD(team, m, lo, hi, combine_part(lo, hi, m, count, weights, k, y0, into));
}

/* The error estimate sum_j err_weights[j] k_j over its scale atol + rtol max(|y0|, |y1|) at the elements [lo, hi). */
static void scaled_error(const et_solver *s, int64_t lo, int64_t hi, const real *err_weights, const real *k,
                         const real *y0, const real *y1, real *err) {
    combine_part(lo, hi, s->width, s->stages, err_weights, k, NULL, err);
    for (int64_t i = lo; i < hi; i++) {
        real a = y0[i] < 0 ? -y0[i] : y0[i], b = y1[i] < 0 ? -y1[i] : y1[i];
        err[i] /= (real)s->atol + (real)s->rtol * (a > b || b != b ? a : b);
    }
}

/* The RMS of the scaled error (its elements on `team` threads, their squares summed on one). */
static double rms_ratio(const et_solver *s, int64_t team, const real *err_weights, const real *k, const real *y0,
                        const real *y1, real *err) {
    int64_t m = s->width;
    SPREAD(team, m, lo, hi, scaled_error(s, lo, hi, err_weights, k, y0, y1, err));
    return sqrt(squares_in_double(err, m) / (double)m);
}

/* One attempt of group g from y0 (first stage f0) at t of the size wanted: its stages in k, solution in y1, the
 * error ratio, the step's size and end, the controller's next step and history; stage: workspace (M). */
static void attempt(const et_field *f, const et_solver *s, real *stage, int64_t g, double t, double wanted,
                    const double *history, const real *y0, const real *f0) {
    int64_t m = s->width, stages = s->stages;
    real *k = s->k + g * stages * m, *y1 = s->y1 + g * m;
    double remaining = s->t_end - t;
    int last = wanted >= remaining;
    double dt = last ? remaining : wanted;
    s->step[g] = dt;
    s->t1[g] = last ? s->t_end : t + dt;
    real h = (real)dt, weights[64]; /* (a tableau has at most 64 stages) */
    memcpy(k, f0, m * sizeof(real));
    for (int64_t i = 1; i < stages; i++) {
        real *input = i == stages - 1 ? y1 : stage;
        for (int64_t j = 0; j < i; j++) weights[j] = h * s->matrix[(i - 1) * stages + j];
        combine(f->threads, m, i, weights, k, y0, input);
        et_velocity(f, s->samples, input, k + i * m);
    }
    for (int64_t j = 0; j < stages; j++) weights[j] = h * s->matrix[(stages - 1) * stages + j];
    double ratio = rms_ratio(s, f->threads, weights, k, y0, y1, stage);
    s->ratio[g] = ratio;
    int accepted = ratio <= 1;
    double factor = s->safety * pow(ratio, -(s->pcoeff + s->icoeff + s->dcoeff) / s->error_order);
    double kept0 = history[0], kept1 = history[1];
    if (s->pcoeff != 0 || s->dcoeff != 0) {
        double inverse = 1 / ratio;
        factor = factor * pow(history[0], -(s->pcoeff + 2 * s->dcoeff) / s->error_order) *
                 pow(history[1], s->dcoeff / s->error_order);
        if (accepted) {
            kept1 = history[0];
            kept0 = inverse == 0 || isinf(inverse) ? 1.0 : inverse;
        }
    }
    if (isnan(factor)) factor = s->factor_min;
    if (isinf(factor)) factor = factor > 0 ? 1.7976931348623157e308 : -1.7976931348623157e308;
    if (accepted) factor = factor < 1 ? 1 : (factor > s->factor_max ? s->factor_max : factor);
    else factor = factor < s->factor_min ? s->factor_min : (factor > s->safety ? s->safety : factor);
    s->next_dt[g] = dt * factor;
    s->history[2 * g] = kept0;
    s->history[2 * g + 1] = kept1;
}

/* The interpolant of group g's step from t (size dt) at the output times inside (t, t1], written into saved (on
 * `team` threads). */
static void save_inside(const et_solver *s, int64_t team, int64_t g, double t, const real *y0, real *saved) {
    int64_t m = s->width, stages = s->stages, degree = s->degree;
    const real *k = s->k + g * stages * m, *y1 = s->y1 + g * m;
    double dt = s->step[g];
    real h = (real)dt, b[64];
    for (int64_t o = 0; o < s->times; o++) {
        double time = s->out_times[o];
        if (!(time > t && time <= s->t1[g])) continue;
        real *into = saved + (o * s->groups + g) * m;
        real theta = (real)((time - t) / dt);
        if (theta == 1) {
            memcpy(into, y1, m * sizeof(real));
            continue;
        }
        for (int64_t j = 0; j < stages; j++) {
            real value = 0, power_of = 1;
            for (int64_t q = 0; q <= degree; q++) {
                value += s->dense[j * (degree + 1) + q] * power_of;
                power_of *= theta;
            }
            b[j] = h * value;
        }
        combine(team, m, stages, b, k, y0, into);
    }
}

static int all_finite(const real *y, int64_t m) {
    real partial[LANES] = {0}, total = 0; /* 0 times each: NaN where one is NaN or infinite */
    int64_t whole = m - m % LANES;
    for (int64_t j = 0; j < whole; j += LANES)
        for (int64_t l = 0; l < LANES; l++) partial[l] += y[j + l] * 0;
    for (int64_t l = 0; l < LANES; l++) total += partial[l];
    for (int64_t j = whole; j < m; j++) total += y[j] * 0;
    return total == 0;
}

/* torchdiffeq's and diffrax's starting step of group g (one evaluation; stage: workspace (M)). */
static double first_step(const et_field *f, const et_solver *s, real *stage, int64_t g, const real *y0,
                         const real *f0) {
    int64_t m = s->width;
    double d0 = 0, d1 = 0, d2 = 0;
    for (int64_t i = 0; i < m; i++) {
        real scale = (real)s->atol + (y0[i] < 0 ? -y0[i] : y0[i]) * (real)s->rtol;
        real a = y0[i] / scale, b = f0[i] / scale;
        d0 += (double)a * a;
        d1 += (double)b * b;
    }
    d0 = sqrt(d0 / (double)m);
    d1 = sqrt(d1 / (double)m);
    real h0 = d0 < 1e-5 || d1 < 1e-5 ? (real)1e-6 : (real)(0.01 * d0 / d1);
    for (int64_t i = 0; i < m; i++) stage[i] = y0[i] + h0 * f0[i];
    real *f1 = s->y1 + g * m; /* (the group's solution workspace, free before a step) */
    et_velocity(f, s->samples, stage, f1);
    for (int64_t i = 0; i < m; i++) {
        real scale = (real)s->atol + (y0[i] < 0 ? -y0[i] : y0[i]) * (real)s->rtol;
        real c = (f1[i] - f0[i]) / scale;
        d2 += (double)c * c;
    }
    d2 = sqrt(d2 / (double)m) / h0;
    double largest = d1 > d2 ? d1 : d2;
    double h1 = largest <= 1e-15 ? (h0 * 1e-3 > 1e-6 ? h0 * 1e-3 : 1e-6) : pow(0.01 / largest, 1.0 / s->error_order);
    return 100.0 * h0 < h1 ? 100.0 * h0 : h1;
}

/* The flags of one round of attempts: whether a group was active, stalled, stepped backwards, and all states finite. */
typedef struct {
    int active, stalled, backwards, finite;
} round_flags;

/* The first stage of group g, and with begin > 1 its first step (on thread `thread`'s workspace). */
static void start_group(const et_field *fields, const et_solver *s, int thread, int64_t g, int64_t begin, double *dt,
                        const real *y, real *f0) {
    int64_t m = s->width;
    et_velocity(fields + thread, s->samples, y + g * m, f0 + g * m);
    if (begin > 1) dt[g] = first_step(fields + thread, s, s->stage + thread * m, g, y + g * m, f0 + g * m);
}

/* The attempt of group g, where it is active, with its flags added to `flags`. */
static void attempt_group(const et_field *fields, const et_solver *s, int thread, int64_t g, const double *t,
                          const double *dt, const double *history, const real *y, const real *f0, round_flags *flags) {
    int64_t m = s->width;
    if (!(t[g] < s->t_end)) return;
    attempt(fields + thread, s, s->stage + thread * m, g, t[g], dt[g], history + 2 * g, y + g * m, f0 + g * m);
    int behind = s->t1[g] <= t[g];
    flags->active = 1;
    flags->backwards |= behind;
    flags->stalled |= behind || isnan(s->ratio[g]);
    flags->finite &= all_finite(y + g * m, m);
}

/* One round of every active group's attempt: with team > 1 (built with OpenMP), the groups on that many threads, a
 * group on one (a parallel region only then: a library called inside one runs on one thread). */
static round_flags attempt_round(const et_field *fields, const et_solver *s, int team, const double *t,
                                 const double *dt, const double *history, const real *y, const real *f0) {
    round_flags flags = {0, 0, 0, 1};
    if (team > 1) {
#ifdef _OPENMP
        int active = 0, stalled = 0, backwards = 0, finite = 1;
#pragma omp parallel for num_threads(team) schedule(dynamic, 1) reduction(| : active, stalled, backwards) \
    reduction(& : finite)
        for (int64_t g = 0; g < s->groups; g++) {
            round_flags own = {0, 0, 0, 1};
            attempt_group(fields, s, omp_get_thread_num(), g, t, dt, history, y, f0, &own);
            active |= own.active;
            stalled |= own.stalled;
            backwards |= own.backwards;
            finite &= own.finite;
        }
        round_flags joined = {active, stalled, backwards, finite};
        return joined;
#endif
    }
    for (int64_t g = 0; g < s->groups; g++) attempt_group(fields, s, 0, g, t, dt, history, y, f0, &flags);
    return flags;
}

/* The solve of et_ode.integrators.adaptive_loop._whole_solve, in place on its state: t (G), dt (G), history (G, 2),
 * y and f0 (G, M), saved (T, G, M), log (logged, G); counters: steps, groups' steps tried and accepted, failed.
 * fields: one description of the field per thread (each with its own workspace); with several groups, their
 * attempts run on up to `threads` threads (built with OpenMP), a group on one. */
void et_solve(const et_field *fields, const et_solver *s, int64_t threads, double *t, double *dt, double *history,
              real *y, real *f0, real *saved, double *log, int64_t *counters, int64_t begin, int64_t budget) {
    int64_t groups = s->groups, m = s->width, stages = s->stages;
#ifdef _OPENMP
    int team = (int)(threads < groups ? threads : groups);
#else
    int team = 1;
    (void)threads;
#endif
    if (begin > 0 && team > 1) {
#ifdef _OPENMP
#pragma omp parallel for num_threads(team) schedule(dynamic, 1)
        for (int64_t g = 0; g < groups; g++) start_group(fields, s, omp_get_thread_num(), g, begin, dt, y, f0);
#endif
    } else if (begin > 0) {
        for (int64_t g = 0; g < groups; g++) start_group(fields, s, 0, g, begin, dt, y, f0);
    }
    counters[0] = counters[1] = counters[2] = counters[3] = 0;
    while (counters[0] < budget) {
        round_flags flags = attempt_round(fields, s, team, t, dt, history, y, f0);
        if (!flags.active) break;
        int failed = flags.stalled && (flags.backwards || !flags.finite);
        for (int64_t g = 0; g < groups; g++) {
            if (t[g] < s->t_end) {
                int moves = s->ratio[g] <= 1 && !failed;
                counters[1] += 1;
                if (moves) {
                    counters[2] += 1;
                    if (s->times) save_inside(s, fields[0].threads, g, t[g], y + g * m, saved);
                    memcpy(y + g * m, s->y1 + g * m, m * sizeof(real));
                    memcpy(f0 + g * m, s->k + (g * stages + stages - 1) * m, m * sizeof(real));
                    t[g] = s->t1[g];
                }
                dt[g] = failed ? s->step[g] : s->next_dt[g];
                history[2 * g] = s->history[2 * g];
                history[2 * g + 1] = s->history[2 * g + 1];
            }
            if (counters[0] < s->logged) log[counters[0] * groups + g] = t[g];
        }
        counters[0] += 1;
        if (failed) {
            counters[3] = 1;
            break;
        }
    }
}
