/* Fused magnitude-direction + Adam step for one matrix on CPU (float32 and float64), used by
 * weightgeom.optim.MagnitudeDirection when its base optimizer is torch.optim.Adam/AdamW (weightgeom/optim/md_fused.py).
 *
 * W = diag(g_r) D diag(g_c) with g = phi(theta) (phi = softplus or exp), D on a sphere (docs/md.md). Matrices are
 * row-major (m, n) and contiguous. Two passes over memory, parallel over rows with OpenMP; sums in double.
 *
 * Pass 1, with Gh = g_r,i G_ij g_c,j (the direction gradient):
 *     s_r,i = sum_j D_ij Gh_ij,  s_c,j = sum_i D_ij Gh_ij          log-gain gradients g * dL/dg, from the OLD D
 *     e = Gh + l2 D                                                 Adam's coupled weight decay (0 for AdamW)
 *     M = M + (1 - b1)(e - M);  V = b2 V + (1 - b2) e^2             torch's lerp_ / mul_.addcmul_
 *     D = decay D - step_size M / (sqrt(V) (1/bc2_sqrt) + eps)     decay = 1 - lr wd for AdamW
 *     q_r,i = sum_j D_ij^2,  q_c,j = sum_i D_ij^2                   norms of the NEW D
 * Gains (vectors only): dL/dtheta = s phi'(theta)/phi(theta); theta <- Adam(theta) as md_functional.adam_update_.
 * Sphere: a_i D_ij b_j has norm radius (Frobenius: a = radius/||D||_F; row: a_i = radius_i/||D_i.||; col: b_j).
 * Pass 2: D = a_i D_ij b_j;  W = g'_r,i D_ij g'_c,j with the new gains.
 *
 * The float64 reference is weightgeom.optim.md_functional.fused_step_reference (torch ops, same order).
 */
#include <float.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else /* built without OpenMP (e.g. Apple clang): one thread, the pragmas are ignored */
#define omp_get_thread_num() 0
#endif
#include <tgmath.h>

#define ZERO_NORM 1e-30
/* Effective gains are clamped to [GAIN_MIN, GAIN_MAX] (= md_functional.GAIN_MIN / GAIN_MAX, which explains the values;
 * tests/test_md_fused.py checks they agree); the chain factor below uses the unclamped phi (straight through). */
#define GAIN_MIN 1e-6
#define GAIN_MAX 1e6
/* The gains' Adam clamps its gradient to +-GRAD_MAX (= md_functional.gain_grad_limit: half the square root of the
   type's largest number), so g*g and the second moment stay finite for a finite but huge gradient; a NaN gain sum,
   which only products of both signs past the type's range can make (NaN gradients are refused before any kernel
   runs), counts as 0: that gain does not move. */
#define GRAD_MAX(T) (sizeof(T) == 4 ? 9.223371761976865e18 : 6.703903964971298e153)
/* Gh = g_r G g_c saturates at +-the type's largest number (md_functional.split_gradient_log alike): a finite G times
   gains above 1 would be +-inf, and the base step would turn it into NaN. NaN passes. */
#define BIG(T) ((T)(sizeof(T) == 4 ? FLT_MAX : DBL_MAX))
#define SAT(T, x) ((x) > BIG(T) ? BIG(T) : ((x) < -BIG(T) ? -BIG(T) : (x)))

/* Gains: gamma = phi(theta) clamped to [GAIN_MIN, GAIN_MAX] (NaN passes through, as torch.clamp) and the log-gain
 * chain factor phi'(theta)/phi(theta) of the unclamped phi (softplus: sigmoid/softplus, with torch's threshold 20;
 * exp: 1), one exp and one log1p per entry; loops long enough to pay are split over threads. */
#define PAR_MIN 2048
#define DEF_GAINS(NAME, T)                                                                                           \
    static void NAME##_phi(long k, const T *th, int param, T *gamma, T *ratio, int nthreads) {                       \
        _Pragma("omp parallel for schedule(static) num_threads(k >= PAR_MIN ? nthreads : 1)")                        \
        for (long i = 0; i < k; i++) {                                                                               \
            const T t = th[i], e = exp(t);                                                                           \
            T v;                                                                                                     \
            if (param == 1) {                                                                                        \
                v = e;                                                                                               \
                if (ratio) ratio[i] = 1;                                                                             \
            } else {                                                                                                 \
                const T sp = t > 20 ? t : log1p(e);                                                                  \
                v = sp;                                                                                              \
                if (ratio) ratio[i] = sp > 0 ? (t > 20 ? (T)1 : e / (1 + e)) / sp : (T)1;                            \
            }                                                                                                        \
            gamma[i] = v < (T)GAIN_MIN ? (T)GAIN_MIN : (v > (T)GAIN_MAX ? (T)GAIN_MAX : v);                          \
        }                                                                                                            \
    }                                                                                                                \
    /* Adam on theta with gradient s * ratio (written to grad), as md_functional.adam_update_ (no weight decay) */   \
    static void NAME##_adam(long k, T *th, T *mm, T *vv, T *grad, const double *s, const T *ratio, double lr,        \
                            double b1, double b2, double eps, double t, int nthreads) {                              \
        const T step = (T)(lr / (1 - pow(b1, t))), ibc2 = (T)(1 / (1 - pow(b2, t))), w1 = (T)(1 - b1);               \
        const T cb2 = (T)b2, w2 = (T)(1 - b2), ce = (T)eps;                                                          \
        _Pragma("omp parallel for simd schedule(static) num_threads(k >= PAR_MIN ? nthreads : 1)")                   \
        for (long i = 0; i < k; i++) {                                                                               \
            const double si = s[i] == s[i] ? s[i] : 0; /* NaN only from +inf - inf products: counts as 0 */          \
            T g = (T)si * ratio[i];                                                                                  \
            if (g > (T)GRAD_MAX(T)) g = (T)GRAD_MAX(T); else if (g < -(T)GRAD_MAX(T)) g = -(T)GRAD_MAX(T); /* NaN */ \
            grad[i] = g;                                                                                             \
            const T a = mm[i] + w1 * (g - mm[i]);                                                                    \
            const T b = vv[i] * cb2 + w2 * g * g;                                                                    \
            mm[i] = a;                                                                                               \
            vv[i] = b;                                                                                               \
            th[i] -= step * (a / (sqrt(b * ibc2) + ce));                                                             \
        }                                                                                                            \
    }                                                                                                                \
    /* the sphere's factors a (fa, m) and b (fb, n) from the squared row norms rq (Frobenius, rows) or column        \
       norms cq (columns): a_i D_ij b_j has norm radius; 1 on a side the sphere leaves alone */                      \
    static void NAME##_sphere(long m, long n, int sphere, const T *radius, const double *rq, const double *cq,       \
                              T *fa, T *fb) {                                                                        \
        for (long i = 0; i < m; i++) fa[i] = 1;                                                                      \
        for (long j = 0; j < n; j++) fb[j] = 1;                                                                      \
        if (sphere == 0) {                                                                                           \
            double tot = 0;                                                                                          \
            for (long i = 0; i < m; i++) tot += rq[i];                                                               \
            const T a = (T)((double)radius[0] / fmax(sqrt(tot), ZERO_NORM));                                         \
            for (long i = 0; i < m; i++) fa[i] = a;                                                                  \
        } else if (sphere == 1) {                                                                                    \
            for (long i = 0; i < m; i++) fa[i] = (T)((double)radius[i] / fmax(sqrt(rq[i]), ZERO_NORM));              \
        } else {                                                                                                     \
            for (long j = 0; j < n; j++) fb[j] = (T)((double)radius[j] / fmax(sqrt(cq[j]), ZERO_NORM));              \
        }                                                                                                            \
    }                                                                                                                \
    /* gamma of the row and column gains (and, where rr/rc are given, their chain factors): 1 where a gain is        \
       absent, a scalar row gain (gain_r == 2) repeated over the m rows */                                           \
    static void NAME##_both(long m, long n, int gain_r, int gain_c, const T *th_r, const T *th_c, int param, T *gr,  \
                            T *gc, T *rr, T *rc, int nthreads) {                                                     \
        for (long i = 0; i < m; i++) gr[i] = 1;                                                                      \
        for (long j = 0; j < n; j++) gc[j] = 1;                                                                      \
        NAME##_phi(gain_r == 1 ? m : (gain_r == 2 ? 1 : 0), th_r, param, gr, rr, nthreads);                          \
        NAME##_phi(gain_c ? n : 0, th_c, param, gc, rc, nthreads);                                                   \
        if (gain_r == 2)                                                                                             \
            for (long i = 1; i < m; i++) gr[i] = gr[0];                                                              \
    }
DEF_GAINS(gains_f32, float)
DEF_GAINS(gains_f64, double)

#define DEF_STEP(NAME, T, GAINS)                                                                                     \
    int NAME(long m, long n, const T *G, T *D, T *W, T *M, T *V, double b1, double b2, double step_size,             \
             double bc2_sqrt, double eps, double decay, double l2, int gain_r, int gain_c, int param, T *th_r,       \
             T *m_r, T *v_r, T *d_r, T *th_c, T *m_c, T *v_c, T *d_c, double glr, double gb1, double gb2,            \
             double geps, double t_r, double t_c, int sphere, const T *radius, int nthreads) {                       \
        int failed = 0;                                                                                              \
        T *gr = malloc(sizeof(T) * (size_t)m), *gc = malloc(sizeof(T) * (size_t)n);                                  \
        T *fa = malloc(sizeof(T) * (size_t)m), *fb = malloc(sizeof(T) * (size_t)n);                                  \
        T *wa = malloc(sizeof(T) * (size_t)m), *wb = malloc(sizeof(T) * (size_t)n);                                  \
        T *rr = malloc(sizeof(T) * (size_t)m), *rc = malloc(sizeof(T) * (size_t)n);                                  \
        double *rs = malloc(sizeof(double) * (size_t)m), *rq = malloc(sizeof(double) * (size_t)m);                   \
        double *cs = calloc((size_t)n, sizeof(double)), *cq = calloc((size_t)n, sizeof(double));                     \
        if (!gr || !gc || !fa || !fb || !wa || !wb || !rr || !rc || !rs || !rq || !cs || !cq) {                      \
            failed = 1;                                                                                              \
            goto done;                                                                                               \
        }                                                                                                            \
        GAINS##_both(m, n, gain_r, gain_c, th_r, th_c, param, gr, gc, rr, rc, nthreads);                             \
        const T w1 = (T)(1 - b1), cb2 = (T)b2, w2 = (T)(1 - b2), ss = (T)step_size, ibc = (T)(1 / bc2_sqrt);         \
        const T ce = (T)eps, dk = (T)decay, cl2 = (T)l2;                                                             \
        /* per-thread column sums, added up in thread order afterwards: the result does not depend on timing */      \
        const int nt = nthreads > 0 ? nthreads : 1;                                                                  \
        double *part = calloc((size_t)nt * 2 * (size_t)n, sizeof(double));                                           \
        if (part == NULL) {                                                                                          \
            failed = 1;                                                                                              \
            goto done;                                                                                               \
        }                                                                                                            \
        _Pragma("omp parallel num_threads(nt)") {                                                                    \
            double *ts = part + (size_t)omp_get_thread_num() * 2 * (size_t)n, *tq = ts + n;                          \
            _Pragma("omp for schedule(static)") for (long i = 0; i < m; i++) {                                       \
                const T *g = G + i * n;                                                                              \
                T *d = D + i * n, *mm = M + i * n, *vv = V + i * n;                                                  \
                const T r = gr[i];                                                                                   \
                double ra = 0, rqa = 0;                                                                              \
                _Pragma("omp simd reduction(+ : ra, rqa)") for (long j = 0; j < n; j++) {                            \
                    const T gh = SAT(T, g[j] * r * gc[j]);                                                             \
                    const T p = d[j] * gh;                                                                           \
                    ra += p;                                                                                         \
                    ts[j] += p;                                                                                      \
                    const T e = gh + cl2 * d[j];                                                                     \
                    const T a = mm[j] + w1 * (e - mm[j]);                                                            \
                    const T b = cb2 * vv[j] + w2 * e * e;                                                            \
                    mm[j] = a;                                                                                       \
                    vv[j] = b;                                                                                       \
                    const T x = d[j] * dk - ss * (a / (sqrt(b) * ibc + ce));                                         \
                    d[j] = x;                                                                                        \
                    rqa += (double)x * x;                                                                            \
                    tq[j] += (double)x * x;                                                                          \
                }                                                                                                    \
                rs[i] = ra;                                                                                          \
                rq[i] = rqa;                                                                                         \
            }                                                                                                        \
        }                                                                                                            \
        for (int t = 0; t < nt; t++) {                                                                               \
            const double *ts = part + (size_t)t * 2 * (size_t)n, *tq = ts + n;                                       \
            for (long j = 0; j < n; j++) {                                                                           \
                cs[j] += ts[j];                                                                                      \
                cq[j] += tq[j];                                                                                      \
            }                                                                                                        \
        }                                                                                                            \
        free(part);                                                                                                  \
        if (gain_r == 1) GAINS##_adam(m, th_r, m_r, v_r, d_r, rs, rr, glr, gb1, gb2, geps, t_r, nthreads);           \
        if (gain_r == 2) {                                                                                           \
            double tot = 0;                                                                                          \
            for (long i = 0; i < m; i++) tot += rs[i];                                                               \
            GAINS##_adam(1, th_r, m_r, v_r, d_r, &tot, rr, glr, gb1, gb2, geps, t_r, nthreads);                      \
        }                                                                                                            \
        if (gain_c == 1) GAINS##_adam(n, th_c, m_c, v_c, d_c, cs, rc, glr, gb1, gb2, geps, t_c, nthreads);           \
        GAINS##_sphere(m, n, sphere, radius, rq, cq, fa, fb);                                                        \
        GAINS##_both(m, n, gain_r, gain_c, th_r, th_c, param, wa, wb, NULL, NULL, nthreads); /* the new gains */     \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") for (long i = 0; i < m; i++) {                  \
            T *d = D + i * n, *w = W + i * n;                                                                        \
            const T ai = fa[i], wi = wa[i];                                                                          \
            _Pragma("omp simd") for (long j = 0; j < n; j++) {                                                       \
                const T x = d[j] * ai * fb[j];                                                                       \
                d[j] = x;                                                                                            \
                w[j] = wi * x * wb[j];                                                                               \
            }                                                                                                        \
        }                                                                                                            \
    done:                                                                                                            \
        free(gr); free(gc); free(fa); free(fb); free(wa); free(wb);                                                  \
        free(rr); free(rc); free(rs); free(rq); free(cs); free(cq);                                                  \
        return failed;                                                                                               \
    }

DEF_STEP(md_adam_step_f32, float, gains_f32)
DEF_STEP(md_adam_step_f64, double, gains_f64)

/* 1 if any of the n values is NaN or Inf, else 0: MagnitudeDirection.step's all-or-nothing gradient check, one
 * streaming read over threads (x - x is 0 exactly for finite x and NaN otherwise; no overflow, unlike a norm). */
#define DEF_SCAN(NAME, T)                                                                                            \
    int NAME(long n, const T *x, int nthreads) {                                                                     \
        int bad = 0;                                                                                                 \
        _Pragma("omp parallel for simd reduction(| : bad) schedule(static) num_threads(n >= PAR_MIN ? nthreads : 1)") \
        for (long i = 0; i < n; i++) bad |= (x[i] - x[i]) != (T)0;                                                   \
        return bad;                                                                                                  \
    }
DEF_SCAN(any_nonfinite_f32, float)
DEF_SCAN(any_nonfinite_f64, double)

/* The two memory passes of an eager MD step over any other base optimizer (Muon, SGD, ...), used by
 * MagnitudeDirection where the base step itself is not fused (weightgeom/optim/magnitude_direction.py). Same maths
 * and operation order as md_functional.split_gradient_log / project_to_sphere_ / compose (sums in double).
 *
 * md_split: Gh_ij = (G_ij g_r,i) g_c,j written to Gh; s_r,i = sum_j D_ij Gh_ij (if s_r), s_c,j = sum_i D_ij Gh_ij
 * (if s_c). g_r / g_c NULL: 1. One pass. */
#define DEF_SPLIT(NAME, T)                                                                                           \
    int NAME(long m, long n, const T *G, const T *D, const T *gr, const T *gc, T *Gh, double *s_r, double *s_c,      \
             int nthreads) {                                                                                         \
        const int nt = nthreads > 0 ? nthreads : 1;                                                                  \
        T *ones = NULL;                                                                                              \
        double *part = NULL;                                                                                         \
        if (gc == NULL) {                                                                                            \
            ones = malloc(sizeof(T) * (size_t)(n > 0 ? n : 1));                                                      \
            if (ones == NULL) return 1;                                                                              \
            for (long j = 0; j < n; j++) ones[j] = 1;                                                                \
            gc = ones;                                                                                               \
        }                                                                                                            \
        if (s_c != NULL) {                                                                                           \
            part = calloc((size_t)nt * (size_t)(n > 0 ? n : 1), sizeof(double));                                    \
            if (part == NULL) {                                                                                      \
                free(ones);                                                                                          \
                return 1;                                                                                            \
            }                                                                                                        \
        }                                                                                                            \
        _Pragma("omp parallel num_threads(nt)") {                                                                    \
            double *ts = part ? part + (size_t)omp_get_thread_num() * (size_t)n : NULL;                              \
            _Pragma("omp for schedule(static)") for (long i = 0; i < m; i++) {                                       \
                const T *g = G + i * n, *d = D + i * n;                                                              \
                T *h = Gh + i * n;                                                                                   \
                const T r = gr ? gr[i] : (T)1;                                                                       \
                double ra = 0;                                                                                       \
                if (ts) {                                                                                            \
                    _Pragma("omp simd reduction(+ : ra)") for (long j = 0; j < n; j++) {                             \
                        const T gh = SAT(T, g[j] * r * gc[j]);                                                         \
                        const T p = d[j] * gh;                                                                       \
                        h[j] = gh;                                                                                   \
                        ra += p;                                                                                     \
                        ts[j] += p;                                                                                  \
                    }                                                                                                \
                } else {                                                                                             \
                    _Pragma("omp simd reduction(+ : ra)") for (long j = 0; j < n; j++) {                             \
                        const T gh = SAT(T, g[j] * r * gc[j]);                                                         \
                        h[j] = gh;                                                                                   \
                        ra += d[j] * gh;                                                                             \
                    }                                                                                                \
                }                                                                                                    \
                if (s_r) s_r[i] = ra;                                                                                \
            }                                                                                                        \
        }                                                                                                            \
        if (s_c != NULL) {                                                                                           \
            for (long j = 0; j < n; j++) s_c[j] = 0;                                                                 \
            for (int t = 0; t < nt; t++)                                                                             \
                for (long j = 0; j < n; j++) s_c[j] += part[(size_t)t * (size_t)n + j];                              \
        }                                                                                                            \
        free(part);                                                                                                  \
        free(ones);                                                                                                  \
        return 0;                                                                                                    \
    }
DEF_SPLIT(md_split_f32, float)
DEF_SPLIT(md_split_f64, double)

/* md_finish: D back on its sphere and W = g_r D g_c with the new gains (g_r / g_c NULL: 1). Pass 1: the squared
 * norms the sphere needs (Frobenius / rows: row sums; columns: per-thread column sums); pass 2: D_ij = D_ij a_i b_j
 * (a, b as in md_adam_step) and W_ij = (g_r,i D_ij) g_c,j. */
#define DEF_FINISH(NAME, T, GAINS)                                                                                   \
    int NAME(long m, long n, T *D, T *W, int sphere, const T *radius, const T *gr, const T *gc, int nthreads) {      \
        const int nt = nthreads > 0 ? nthreads : 1;                                                                  \
        const size_t mm = (size_t)(m > 0 ? m : 1), nn = (size_t)(n > 0 ? n : 1);                                     \
        T *fa = malloc(sizeof(T) * mm), *fb = malloc(sizeof(T) * nn), *ga = malloc(sizeof(T) * mm);                  \
        T *gb = malloc(sizeof(T) * nn);                                                                              \
        double *rq = malloc(sizeof(double) * mm), *cq = calloc(nn, sizeof(double));                                  \
        double *part = sphere == 2 ? calloc((size_t)nt * nn, sizeof(double)) : NULL;                                 \
        int failed = 0;                                                                                              \
        if (!fa || !fb || !ga || !gb || !rq || !cq || (sphere == 2 && !part)) {                                      \
            failed = 1;                                                                                              \
            goto done;                                                                                               \
        }                                                                                                            \
        _Pragma("omp parallel num_threads(nt)") {                                                                    \
            double *tq = part ? part + (size_t)omp_get_thread_num() * nn : NULL;                                     \
            _Pragma("omp for schedule(static)") for (long i = 0; i < m; i++) {                                       \
                const T *d = D + i * n;                                                                              \
                double q = 0;                                                                                        \
                if (tq) {                                                                                            \
                    _Pragma("omp simd") for (long j = 0; j < n; j++) tq[j] += (double)d[j] * d[j];                   \
                } else {                                                                                             \
                    _Pragma("omp simd reduction(+ : q)") for (long j = 0; j < n; j++) q += (double)d[j] * d[j];      \
                }                                                                                                    \
                rq[i] = q;                                                                                           \
            }                                                                                                        \
        }                                                                                                            \
        if (part)                                                                                                    \
            for (int t = 0; t < nt; t++)                                                                             \
                for (long j = 0; j < n; j++) cq[j] += part[(size_t)t * nn + j];                                      \
        for (long i = 0; i < m; i++) ga[i] = gr ? gr[i] : (T)1;                                                      \
        for (long j = 0; j < n; j++) gb[j] = gc ? gc[j] : (T)1;                                                      \
        GAINS##_sphere(m, n, sphere, radius, rq, cq, fa, fb);                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(nt)") for (long i = 0; i < m; i++) {                  \
            T *d = D + i * n, *w = W + i * n;                                                                        \
            const T ai = fa[i], wi = ga[i];                                                                          \
            _Pragma("omp simd") for (long j = 0; j < n; j++) {                                                       \
                const T x = d[j] * ai * fb[j];                                                                       \
                d[j] = x;                                                                                            \
                w[j] = wi * x * gb[j];                                                                               \
            }                                                                                                        \
        }                                                                                                            \
    done:                                                                                                            \
        free(fa); free(fb); free(ga); free(gb); free(rq); free(cq); free(part);                                     \
        return failed;                                                                                               \
    }
DEF_FINISH(md_finish_f32, float, gains_f32)
DEF_FINISH(md_finish_f64, double, gains_f64)
