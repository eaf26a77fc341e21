/* Small CPU kernels for manifold Muon's step (weightgeom.optim.manifold_muon, weightgeom.linalg.split).
 *
 * lanczos_{f32,f64}: the recurrence of weightgeom.optim.manifold_muon._lanczos_coefficients on one symmetric n×n
 * matrix G (row-major; the Gram AᵀA already divided by its largest diagonal entry) from the unit start vector v, in
 * the same order of operations: for j = 0..k-1
 *     w = G q_j;  scale = max(scale, ‖w‖);  α_j = q_jᵀ w
 *     twice: c = Q_jᵀ w, w = w − Q_j c          (full reorthogonalisation against q_0..q_j)
 *     β_j = ‖w‖ if ‖w‖ > noise·scale else 0 (breakdown: the recurrence ends, later α, β are 0)
 *     q_{j+1} = w / max(β_j, tiny) if not broken down else 0
 * coef receives α_0..α_{k-1}, β_0..β_{k-2}, 0 (2k doubles). Vectors are in the matrix's type, dot products and norms
 * are summed in double. The torch version is the reference (tests compare the two); this one exists because on a CPU
 * its ~15 tensor operations per step cost ~5 ms per 768×768 Gram in dispatch alone, against ~1 ms here.
 *
 * split_bf16_f32: X (n floats) -> hi = bf16(X clamped to ±BF16_MAX), lo = bf16(X - hi), rounded to nearest even as
 * torch's conversion: one pass instead of torch's four, the same bits but for NaN's sign and payload (torch's
 * vectorised and scalar conversions differ there themselves). ±inf gives hi = ±BF16_MAX, lo = ±inf. lo = NULL: hi alone.
 *
 * symsum_f32: out = alpha·(S + Sᵀ) of one n×n matrix (beta = 0: out is not read), or out ← (out + alpha·S) +
 * alpha·Sᵀ (beta = 1), in torch's order of operations for alpha·(S + S.mT) and out.add_(S).add_(S.mT): the same bits
 * (torch rounds out + alpha·S with alpha ≠ 1 as one multiply-add; this kernel, compiled as ISO C, does not). Rows of S and out are ld apart; out must not overlap S. In 8×8 blocks, the transposed one turned in vector
 * registers: torch reads S.mT with a stride of a row per element (768×768: 0.33 ms; here 0.11 ms, 2-core AMX Xeon).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PAR_MIN 65536 /* a matrix-vector product below this many entries runs on one thread */

#define DEF_LANCZOS(NAME, T, TINY)                                                                                   \
    int NAME(long n, long k, const T *G, const T *v, double noise, double *coef, T *Q, int nthreads) {              \
        T *w = (T *)malloc(sizeof(T) * n);                                                                          \
        double *c = (double *)malloc(sizeof(double) * (k > 0 ? k : 1));                                             \
        if (!w || !c) {                                                                                             \
            free(w);                                                                                                \
            free(c);                                                                                                \
            return 1;                                                                                               \
        }                                                                                                           \
        memset(Q, 0, sizeof(T) * n * k);                                                                            \
        memset(coef, 0, sizeof(double) * 2 * k);                                                                    \
        memcpy(Q, v, sizeof(T) * n);                                                                                \
        double scale = 0.0;                                                                                         \
        for (long j = 0; j < k; j++) {                                                                              \
            const T *q = Q + j * n;                                                                                 \
            _Pragma("omp parallel for schedule(static) num_threads(n * n >= PAR_MIN ? nthreads : 1)")               \
            for (long i = 0; i < n; i++) {                                                                          \
                const T *g = G + i * n;                                                                             \
                T s = 0;                                                                                            \
                _Pragma("omp simd reduction(+:s)")                                                                  \
                for (long l = 0; l < n; l++) s += g[l] * q[l];                                                      \
                w[i] = s;                                                                                           \
            }                                                                                                       \
            double nw = 0.0, a = 0.0;                                                                               \
            _Pragma("omp simd reduction(+:nw, a)")                                                                  \
            for (long i = 0; i < n; i++) {                                                                          \
                nw += (double)w[i] * w[i];                                                                          \
                a += (double)q[i] * w[i];                                                                           \
            }                                                                                                       \
            nw = sqrt(nw);                                                                                          \
            if (nw > scale || isnan(nw)) scale = nw;                                                                \
            coef[j] = a;                                                                                            \
            for (int pass = 0; pass < 2; pass++) {                                                                  \
                for (long p = 0; p <= j; p++) {                                                                     \
                    const T *qp = Q + p * n;                                                                        \
                    double s = 0.0;                                                                                 \
                    _Pragma("omp simd reduction(+:s)")                                                              \
                    for (long i = 0; i < n; i++) s += (double)qp[i] * w[i];                                         \
                    c[p] = s;                                                                                       \
                }                                                                                                   \
                for (long p = 0; p <= j; p++) {                                                                     \
                    const T *qp = Q + p * n;                                                                        \
                    const T cp = (T)c[p];                                                                           \
                    for (long i = 0; i < n; i++) w[i] -= qp[i] * cp;                                                \
                }                                                                                                   \
            }                                                                                                       \
            if (j == k - 1) break;                                                                                  \
            double b = 0.0;                                                                                         \
            _Pragma("omp simd reduction(+:b)")                                                                      \
            for (long i = 0; i < n; i++) b += (double)w[i] * w[i];                                                  \
            b = sqrt(b);                                                                                            \
            int keep = b > noise * scale;                                                                           \
            coef[k + j] = keep ? b : 0.0;                                                                           \
            T *qn = Q + (j + 1) * n;                                                                                \
            const T inv = keep ? (T)(1.0 / (b > TINY ? b : TINY)) : (T)0;                                           \
            for (long i = 0; i < n; i++) qn[i] = w[i] * inv;                                                        \
        }                                                                                                           \
        free(w);                                                                                                    \
        free(c);                                                                                                    \
        return 0;                                                                                                   \
    }

DEF_LANCZOS(lanczos_f32, float, FLT_MIN)
DEF_LANCZOS(lanczos_f64, double, DBL_MIN)

#define BF16_MAX 3.38953138925153547590e38f /* bf16's largest finite value (= weightgeom.linalg.split.BF16_MAX) */

static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN: a quiet NaN (c10::BFloat16's scalar choice) */
    u += 0x7fffu + ((u >> 16) & 1u);                                           /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

void split_bf16_f32(long n, const float *x, uint16_t *hi, uint16_t *lo, int nthreads) {
    if (!lo) { /* hi alone */
        _Pragma("omp parallel for schedule(static) num_threads(n >= PAR_MIN ? nthreads : 1)")
        for (long i = 0; i < n; i++)
            hi[i] = to_bf16(x[i] > BF16_MAX ? BF16_MAX : (x[i] < -BF16_MAX ? -BF16_MAX : x[i]));
        return;
    }
    _Pragma("omp parallel for schedule(static) num_threads(n >= PAR_MIN ? nthreads : 1)")
    for (long i = 0; i < n; i++) {
        const float c = x[i] > BF16_MAX ? BF16_MAX : (x[i] < -BF16_MAX ? -BF16_MAX : x[i]); /* NaN passes */
        uint16_t h = to_bf16(c);
        float r = x[i] - from_bf16(h);
        hi[i] = h;
        lo[i] = to_bf16(r);
    }
}

/* scale_bf16_f32: out = bf16(x·s), rounded to nearest even as torch's conversion of the float32 product (torch's
 * mixed-dtype torch.mul(x, s, out=<bf16>) gives the same bits but for NaN's sign and payload, at ~4× the time). */
void scale_bf16_f32(long n, const float *x, float s, uint16_t *out, int nthreads) {
    _Pragma("omp parallel for schedule(static) num_threads(n >= PAR_MIN ? nthreads : 1)")
    for (long i = 0; i < n; i++) out[i] = to_bf16(x[i] * s);
}

/* colsumsq_{f32,f64}: out[j] = sum_i X[i,j]^2 of an m×n matrix, summed in double (weightgeom.linalg.norms.column_norms
 * on the CPU: one read pass, no temporary; torch's square-then-sum writes and reads an m×n temporary). Row-major
 * (row stride ld, unit column stride) when colmajor = 0, else column-major (column stride ld, unit row stride).
 * out is in the matrix's type. */
/* Threads a parallel region will really have: without OpenMP the pragmas are ignored and the region runs once. */
static inline int team(int want) {
#ifdef _OPENMP
    return want > 0 ? want : 1;
#else
    (void)want;
    return 1;
#endif
}

#define DEF_COLSUMSQ(NAME, T)                                                                                         \
    void NAME(long m, long n, const T *X, long ld, int colmajor, T *out, int nthreads) {                             \
        const int nt = team(m * n >= PAR_MIN ? nthreads : 1);                                                        \
        if (colmajor) {                                                                                              \
            _Pragma("omp parallel for schedule(static) num_threads(nt)")                                            \
            for (long j = 0; j < n; j++) {                                                                           \
                const T *c = X + j * ld;                                                                             \
                double s = 0.0;                                                                                      \
                _Pragma("omp simd reduction(+:s)")                                                                   \
                for (long i = 0; i < m; i++) s += (double)c[i] * c[i];                                               \
                out[j] = (T)s;                                                                                       \
            }                                                                                                        \
            return;                                                                                                  \
        }                                                                                                            \
        _Pragma("omp parallel num_threads(nt)")                                                                      \
        {                                                                                                            \
            /* the team OpenMP really started (OMP_DYNAMIC / OMP_THREAD_LIMIT may give fewer than asked) */          \
            int t = 0, team_size = 1;                                                                                \
            _PRAGMA_THREAD_NUM                                                                                       \
            const long chunk = (n + team_size - 1) / team_size;                                                      \
            const long j0 = t * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;                                         \
            if (j0 < j1) {                                                                                           \
                double *acc = (double *)calloc((size_t)(j1 - j0), sizeof(double));                                   \
                if (acc) {                                                                                           \
                    for (long i = 0; i < m; i++) {                                                                   \
                        const T *r = X + i * ld + j0;                                                                \
                        _Pragma("omp simd")                                                                          \
                        for (long j = 0; j < j1 - j0; j++) acc[j] += (double)r[j] * r[j];                            \
                    }                                                                                                \
                    for (long j = j0; j < j1; j++) out[j] = (T)acc[j - j0];                                          \
                    free(acc);                                                                                       \
                } else {                                                                                             \
                    for (long j = j0; j < j1; j++) {                                                                 \
                        double s = 0.0;                                                                              \
                        for (long i = 0; i < m; i++) s += (double)X[i * ld + j] * X[i * ld + j];                     \
                        out[j] = (T)s;                                                                               \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
    }

#ifdef _OPENMP
#define _PRAGMA_THREAD_NUM                                                                                           \
    t = omp_get_thread_num();                                                                                        \
    team_size = omp_get_num_threads();
#else
#define _PRAGMA_THREAD_NUM
#endif
DEF_COLSUMSQ(colsumsq_f32, float)
DEF_COLSUMSQ(colsumsq_f64, double)

/* 8-wide float vectors (GCC/clang vector extensions: AVX registers where the CPU has them, pairs of SSE/NEON ones
 * otherwise) and the 8×8 transpose of symsum_f32 in three rounds of two-source shuffles. */
typedef float v8f __attribute__((vector_size(32)));
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shufflevector(a, b, i0, i1, i2, i3, i4, i5, i6, i7)
#else
typedef int v8i __attribute__((vector_size(32)));
#define SHUF8(a, b, i0, i1, i2, i3, i4, i5, i6, i7) __builtin_shuffle(a, b, (v8i){i0, i1, i2, i3, i4, i5, i6, i7})
#endif

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

static inline void transpose8(v8f r[8]) {
    v8f t[8], u[8];
    for (int k = 0; k < 4; k++) { /* interleave row pairs */
        t[2 * k] = SHUF8(r[2 * k], r[2 * k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[2 * k + 1] = SHUF8(r[2 * k], r[2 * k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int k = 0; k < 2; k++)
        for (int h = 0; h < 2; h++) { /* pairs of pairs */
            u[4 * k + 2 * h] = SHUF8(t[4 * k + h], t[4 * k + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[4 * k + 2 * h + 1] = SHUF8(t[4 * k + h], t[4 * k + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int k = 0; k < 4; k++) { /* 128-bit halves */
        r[k] = SHUF8(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[k + 4] = SHUF8(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

void symsum_f32(long n, const float *S, long lds, float *out, long ldo, double alpha, int beta, int nthreads) {
    const long nb = (n + 7) / 8;
    const int nt = team(n * n >= PAR_MIN ? nthreads : 1);
    const float a = (float)alpha;
    _Pragma("omp parallel for schedule(static) num_threads(nt)")
    for (long bi = 0; bi < nb; bi++) {
        const long i0 = bi * 8;
        for (long j0 = 0; j0 < n; j0 += 8) {
            if (i0 + 8 <= n && j0 + 8 <= n) {
                v8f t[8]; /* t[k] = S[j0..j0+8, i0 + k]: the transposed block */
                for (int k = 0; k < 8; k++) t[k] = load8(S + (j0 + k) * lds + i0);
                transpose8(t);
                for (int k = 0; k < 8; k++) {
                    float *o = out + (i0 + k) * ldo + j0;
                    const v8f s = load8(S + (i0 + k) * lds + j0);
                    store8(o, beta ? (load8(o) + a * s) + a * t[k] : a * (s + t[k]));
                }
            } else { /* the ragged edge */
                for (long i = i0; i < i0 + 8 && i < n; i++)
                    for (long j = j0; j < j0 + 8 && j < n; j++) {
                        float *o = out + i * ldo + j;
                        *o = beta ? (*o + a * S[i * lds + j]) + a * S[j * lds + i] : a * (S[i * lds + j] + S[j * lds + i]);
                    }
            }
        }
    }
}

/* normalise_bf16_{f32,bf16}: out = bf16(x / (‖x‖_F·safety + eps)) of n entries (one matrix), ‖x‖_F summed in double in
 * one read pass — no prescale needed: double holds the square of every float32 — and the quotient formed in double
 * before rounding (a norm below float32's range cannot overflow the scale); a zero matrix stays zero, inf/NaN
 * entries leave NaN where they are and zeros elsewhere (the scale is 0), as weightgeom.linalg.msign's torch path.
 * The sum is over NORM_CHUNKS fixed ranges added in order, so it does not depend on the number of threads.
 * Returns the norm. */
#define NORM_CHUNKS 64
#define DEF_NORMALISE(NAME, T, LOAD)                                                                                 \
    double NAME(long n, const T *x, uint16_t *out, double safety, double eps, int nthreads) {                       \
        const int nt = team(n >= PAR_MIN ? nthreads : 1);                                                            \
        double part[NORM_CHUNKS], top[NORM_CHUNKS];                                                                  \
        const long chunk = (n + NORM_CHUNKS - 1) / NORM_CHUNKS;                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(nt)")                                                 \
        for (int c = 0; c < NORM_CHUNKS; c++) {                                                                      \
            const long i0 = c * chunk, i1 = i0 + chunk < n ? i0 + chunk : n;                                         \
            double ss = 0.0, mx = 0.0;                                                                               \
            _Pragma("omp simd reduction(+:ss) reduction(max:mx)")                                                    \
            for (long i = i0; i < i1; i++) {                                                                         \
                const double v = LOAD(x[i]);                                                                         \
                ss += v * v;                                                                                         \
                mx = mx > fabs(v) ? mx : fabs(v);                                                                    \
            }                                                                                                        \
            part[c] = ss;                                                                                            \
            top[c] = mx;                                                                                             \
        }                                                                                                            \
        double ss = 0.0, mx = 0.0;                                                                                   \
        for (int c = 0; c < NORM_CHUNKS; c++) {                                                                      \
            ss += part[c];                                                                                           \
            mx = mx > top[c] ? mx : top[c];                                                                          \
        }                                                                                                            \
        const double norm = sqrt(ss);                                                                                \
        /* eps as the torch path adds it: to the norm of X prescaled by the power of two that brings max|x| into    \
         * [1, 2) (there a guard against 0; for a matrix of tiny entries, added to the raw norm, it would dominate) */ \
        const double p2 = mx > 0 && isfinite(mx) ? exp2(floor(log2(mx))) : 1.0;                                       \
        const double s = norm > 0 ? 1.0 / (norm * safety + eps * p2) : 0.0; /* NaN norm: not > 0, scale 0 */        \
        _Pragma("omp parallel for simd schedule(static) num_threads(nt)")                                           \
        for (long i = 0; i < n; i++) out[i] = to_bf16((float)(LOAD(x[i]) * s));                                     \
        return norm;                                                                                                 \
    }
#define LOAD_F32(v) ((double)(v))
#define LOAD_BF16(v) ((double)from_bf16(v))
DEF_NORMALISE(normalise_bf16_f32, float, LOAD_F32)
DEF_NORMALISE(normalise_bf16_bf16, uint16_t, LOAD_BF16)

/* split_colsumsq_f32: the split pieces of a row-major m×n float32 matrix (row stride ld) — hi = bf16(X) clamped to
 * ±BF16_MAX and lo = bf16(X − hi), split_bf16_f32's bits; lo = NULL: hi = bf16(X) unclamped, torch's conversion (an
 * overflow rounds to inf) — and its column sums of squares (summed in double row by row: colsumsq_f32's bits), in
 * one read pass: the pieces (or a bf16 Gram's factor) and the Gram diagonal from the same matrix. hi and lo are
 * contiguous; columns are split over the threads OpenMP really starts. Returns nonzero when out of memory (nothing
 * reliable written). */
int split_colsumsq_f32(long m, long n, const float *X, long ld, uint16_t *hi, uint16_t *lo, float *sums,
                       int nthreads) {
    int failed = 0;
    const int nt = team(m * n >= PAR_MIN ? nthreads : 1);
    _Pragma("omp parallel num_threads(nt) reduction(|:failed)")
    {
        int t = 0, team_size = 1;
        _PRAGMA_THREAD_NUM
        const long chunk = (n + team_size - 1) / team_size;
        const long j0 = t * chunk, j1 = j0 + chunk < n ? j0 + chunk : n;
        if (j0 < j1) {
            double *acc = (double *)calloc((size_t)(j1 - j0), sizeof(double));
            if (!acc) {
                failed = 1;
            } else {
                for (long i = 0; i < m; i++) {
                    const float *r = X + i * ld + j0;
                    uint16_t *h = hi + i * n + j0;
                    if (lo) {
                        uint16_t *l = lo + i * n + j0;
                        for (long j = 0; j < j1 - j0; j++) {
                            const float x = r[j];
                            const uint16_t b = to_bf16(x > BF16_MAX ? BF16_MAX : (x < -BF16_MAX ? -BF16_MAX : x));
                            acc[j] += (double)x * x;
                            h[j] = b;
                            l[j] = to_bf16(x - from_bf16(b));
                        }
                    } else {
                        for (long j = 0; j < j1 - j0; j++) {
                            acc[j] += (double)r[j] * r[j];
                            h[j] = to_bf16(r[j]);
                        }
                    }
                }
                for (long j = j0; j < j1; j++) sums[j] = (float)acc[j - j0];
                free(acc);
            }
        }
    }
    return failed;
}

/* near_deviation_f32 and near_correction_f32: the n×n arithmetic of one near-manifold polar step
 * (weightgeom.manifolds.stiefel.polar_near), each one pass instead of torch's ~5.
 *
 * near_deviation_f32: E = S⁻¹GS⁻¹ − I from the Gram matrix G (E_ij = G_ij / (s_i·s_j), the product rounded to float
 * first as torch's G / (s.mT * s); s = NULL: E = G − I), written to E (may be G itself), and E_hi = bf16(E) clamped
 * to ±BF16_MAX (the bf16 factor of E² and E³); stats[0] = ‖E‖_F, stats[1] = max_i Σ_j |E_ij| (summed in double, rows
 * added in order: independent of the thread count). Returns nonzero when out of memory (nothing reliable written).
 *
 * near_correction_f32: F = −E/2 (+ 3/8·E2 (− 5/16·E3)) added as torch's F.add_(E2, alpha=0.375) does, one fused
 * multiply-add each, then F_ij·(s_j / s_i) (s = NULL: unscaled); d = diag(F), Bo = bf16(F) with a zero diagonal —
 * constraint_addmm's small update X + X·diag(F) + X_hi·Bo takes them as they are. The bits of torch's expressions
 * (but the norms, which torch sums in float32: they only choose the series order). */
int near_deviation_f32(long n, const float *G, const float *s, float *E, uint16_t *E_hi, double *stats,
                       int nthreads) {
    const int nt = team(n * n >= PAR_MIN ? nthreads : 1);
    double *rows = (double *)malloc(sizeof(double) * 2 * (n > 0 ? n : 1)); /* per row: Σ e², Σ |e| */
    if (!rows) return 1;
    _Pragma("omp parallel for schedule(static) num_threads(nt)")
    for (long i = 0; i < n; i++) {
        double r = 0.0, f = 0.0;
        for (long j = 0; j < n; j++) {
            float e = s ? G[i * n + j] / (s[i] * s[j]) : G[i * n + j];
            if (i == j) e -= 1.0f;
            E[i * n + j] = e;
            E_hi[i * n + j] = to_bf16(e > BF16_MAX ? BF16_MAX : (e < -BF16_MAX ? -BF16_MAX : e));
            f += (double)e * e;
            r += fabs((double)e);
        }
        rows[2 * i] = f;
        rows[2 * i + 1] = r;
    }
    double fro = 0.0, row = 0.0; /* rows added in order: the same bits for any number of threads */
    for (long i = 0; i < n; i++) {
        fro += rows[2 * i];
        if (!(rows[2 * i + 1] <= row)) row = rows[2 * i + 1]; /* NaN wins */
    }
    free(rows);
    stats[0] = sqrt(fro);
    stats[1] = row;
    return 0;
}

void near_correction_f32(long n, const float *E, const float *E2, const float *E3, const float *s, uint16_t *Bo,
                         float *d, int nthreads) {
    const int nt = team(n * n >= PAR_MIN ? nthreads : 1);
    _Pragma("omp parallel for schedule(static) num_threads(nt)")
    for (long i = 0; i < n; i++) {
        for (long j = 0; j < n; j++) {
            float f = E[i * n + j] * -0.5f;
            if (E2) f = fmaf(E2[i * n + j], 0.375f, f);
            if (E3) f = fmaf(E3[i * n + j], -0.3125f, f);
            if (s) f = f * (s[j] / s[i]);
            if (i == j) {
                d[i] = f;
                Bo[i * n + j] = 0;
            } else {
                Bo[i * n + j] = to_bf16(f);
            }
        }
    }
}
