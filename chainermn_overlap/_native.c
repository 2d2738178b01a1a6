/*
 * Fused host kernels for the reduction path (optional; see _kernels.py).
 *
 * numpy 1.x converts float32 <-> float16 one element at a time in software
 * (about 2.5 ns per element here) and every numpy expression is one more
 * pass over memory.  These kernels use the F16C conversion instructions and
 * fuse what the reduction does to each element into one pass:
 *
 *   f32_to_f16(src, dst)                 pack a gradient onto the wire
 *   f16_to_f32(src, dst)                 unpack the mean
 *   add_f16(a, b, out, scale)            one ring step: out = f16((a + b) * s)
 *                                        with the sum in float32
 *   ef_project(M, E, Qt, P, n, m, r)     PowerSGD: M += E; P = M Q
 *   project_t(M, P, Qt, n, m, r)         PowerSGD: Qt = P^T M (one pass)
 *   reconstruct(M, E, P, Qt, n, m, r)    PowerSGD: A = P Q^T; E = M - A; M = A
 *   orthogonalize(P, n, r, eps)          Gram-Schmidt on P's columns
 *
 * Conversions round to nearest even, as numpy does, so a packed buffer is
 * bit for bit what numpy would produce.  Every kernel releases the GIL.
 * Without AVX2/FMA/F16C (or off x86-64) the module still imports and
 * reports ``available == False``; the Python side then uses numpy.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CMO_X86 1
#include <immintrin.h>
#endif

static int cmo_available = 0;

/* ------------------------------------------------------------------ */
/* Buffer helpers                                                      */

static int
get_buffer(PyObject *obj, Py_buffer *view, int writable, char format,
           const char *name)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (writable)
        flags |= PyBUF_WRITABLE;
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    Py_ssize_t want = format == 'e' ? 2 : 4;
    if (f[0] != format || f[1] != '\0' || view->itemsize != want) {
        PyErr_Format(PyExc_TypeError,
                     "%s: expected a contiguous %s buffer, got format '%s'",
                     name, format == 'e' ? "float16" : "float32",
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static Py_ssize_t
count(Py_buffer *v)
{
    return v->len / v->itemsize;
}

static int
check_count(Py_buffer *v, Py_ssize_t n, const char *name)
{
    if (count(v) != n) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd elements, expected %zd",
                     name, count(v), n);
        return -1;
    }
    return 0;
}

static int
require_available(void)
{
    if (!cmo_available) {
        PyErr_SetString(PyExc_RuntimeError,
                        "native kernels need an x86-64 CPU with AVX2, FMA "
                        "and F16C");
        return -1;
    }
    return 0;
}

#ifdef CMO_X86
#define CMO_TARGET __attribute__((target("avx2,fma,f16c")))

/* ------------------------------------------------------------------ */
/* float16 <-> float32                                                 */

CMO_TARGET static void
k_f32_to_f16(const float *s, uint16_t *d, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i),
                                    _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(d + i), h);
    }
    if (i < n) {
        float t[8] = {0};
        uint16_t o[8];
        memcpy(t, s + i, (size_t)(n - i) * sizeof(float));
        _mm_storeu_si128((__m128i *)o,
                         _mm256_cvtps_ph(_mm256_loadu_ps(t),
                                         _MM_FROUND_TO_NEAREST_INT));
        memcpy(d + i, o, (size_t)(n - i) * sizeof(uint16_t));
    }
}

CMO_TARGET static void
k_f16_to_f32(const uint16_t *s, float *d, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)(s + i))));
    if (i < n) {
        uint16_t t[8] = {0};
        float o[8];
        memcpy(t, s + i, (size_t)(n - i) * sizeof(uint16_t));
        _mm256_storeu_ps(o, _mm256_cvtph_ps(_mm_loadu_si128((__m128i *)t)));
        memcpy(d + i, o, (size_t)(n - i) * sizeof(float));
    }
}

/* out = f16((f32(a) + f32(b)) * scale); the multiply only when scaled, so
 * that the result equals numpy's add-then-cast bit for bit. */
CMO_TARGET static void
k_add_f16(const uint16_t *a, const uint16_t *b, uint16_t *out, Py_ssize_t n,
          float scale, int scaled)
{
    __m256 sc = _mm256_set1_ps(scale);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        __m256 y = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        __m256 z = _mm256_add_ps(x, y);
        if (scaled)
            z = _mm256_mul_ps(z, sc);
        _mm_storeu_si128((__m128i *)(out + i),
                         _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT));
    }
    if (i < n) {
        uint16_t ta[8] = {0}, tb[8] = {0}, o[8];
        memcpy(ta, a + i, (size_t)(n - i) * 2);
        memcpy(tb, b + i, (size_t)(n - i) * 2);
        __m256 z = _mm256_add_ps(_mm256_cvtph_ps(_mm_loadu_si128((__m128i *)ta)),
                                 _mm256_cvtph_ps(_mm_loadu_si128((__m128i *)tb)));
        if (scaled)
            z = _mm256_mul_ps(z, sc);
        _mm_storeu_si128((__m128i *)o,
                         _mm256_cvtps_ph(z, _MM_FROUND_TO_NEAREST_INT));
        memcpy(out + i, o, (size_t)(n - i) * 2);
    }
}

/* ------------------------------------------------------------------ */
/* PowerSGD                                                            */

#define CMO_MAX_RANK 16

CMO_TARGET static float
hsum(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The PowerSGD kernels are written once, as always-inlined bodies taking
 * the rank r, and instantiated for the common ranks with r a constant:
 * then the loops over k unroll and the accumulators stay in registers (with
 * a run-time r they live on the stack, and every FMA waits for a store).
 * The order of every sum is the same in all instances, so the results do
 * not depend on which one runs. */
#define CMO_INLINE static inline __attribute__((always_inline))
#define CMO_DISPATCH(body, r, ...)                                          \
    switch (r) {                                                            \
    case 1: body(__VA_ARGS__, 1); break;                                    \
    case 2: body(__VA_ARGS__, 2); break;                                    \
    case 4: body(__VA_ARGS__, 4); break;                                    \
    default: body(__VA_ARGS__, r); break;                                   \
    }

/* Rows i .. i + rows - 1 (rows <= 2) of M: M[i] += E[i] (E may be NULL),
 * then P[i, k] = M[i] . Qt[k].  Two rows share each load of Qt. */
CMO_TARGET CMO_INLINE void
ef_project_rows(float *M, const float *E, const float *Qt, float *P,
                Py_ssize_t i, int rows, Py_ssize_t m, Py_ssize_t r)
{
    __m256 acc[2][CMO_MAX_RANK];
    float tail[2][CMO_MAX_RANK];
    for (int b = 0; b < 2; b++)
        for (Py_ssize_t k = 0; k < r; k++) {
            acc[b][k] = _mm256_setzero_ps();
            tail[b][k] = 0.0f;
        }
    float *row0 = M + i * m, *row1 = row0 + (rows > 1 ? m : 0);
    const float *e0 = E ? E + i * m : NULL;
    const float *e1 = E ? e0 + (rows > 1 ? m : 0) : NULL;
    Py_ssize_t j = 0;
    for (; j + 8 <= m; j += 8) {
        __m256 v0 = _mm256_loadu_ps(row0 + j), v1 = _mm256_loadu_ps(row1 + j);
        if (E) {
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(e0 + j));
            v1 = _mm256_add_ps(v1, _mm256_loadu_ps(e1 + j));
            _mm256_storeu_ps(row0 + j, v0);
            if (rows > 1)
                _mm256_storeu_ps(row1 + j, v1);
        }
        for (Py_ssize_t k = 0; k < r; k++) {
            __m256 q = _mm256_loadu_ps(Qt + k * m + j);
            acc[0][k] = _mm256_fmadd_ps(v0, q, acc[0][k]);
            acc[1][k] = _mm256_fmadd_ps(v1, q, acc[1][k]);
        }
    }
    for (; j < m; j++) {
        for (int b = 0; b < rows; b++) {
            float *row = b ? row1 : row0;
            float v = row[j];
            if (E) {
                v += (b ? e1 : e0)[j];
                row[j] = v;
            }
            for (Py_ssize_t k = 0; k < r; k++)
                tail[b][k] = fmaf(v, Qt[k * m + j], tail[b][k]);
        }
    }
    for (int b = 0; b < rows; b++)
        for (Py_ssize_t k = 0; k < r; k++)
            P[(i + b) * r + k] = hsum(acc[b][k]) + tail[b][k];
}

CMO_TARGET CMO_INLINE void
ef_project_body(float *M, const float *E, const float *Qt, float *P,
                Py_ssize_t n, Py_ssize_t m, Py_ssize_t r)
{
    Py_ssize_t i = 0;
    for (; i + 2 <= n; i += 2)
        ef_project_rows(M, E, Qt, P, i, 2, m, r);
    if (i < n)
        ef_project_rows(M, E, Qt, P, i, 1, m, r);
}

/* For each row i of M (n x m): M[i] += E[i] (E may be NULL), then
 * P[i, k] = M[i] . Qt[k] for k < r.  Qt is Q transposed (r x m). */
CMO_TARGET static void
k_ef_project(float *M, const float *E, const float *Qt, float *P,
             Py_ssize_t n, Py_ssize_t m, Py_ssize_t r)
{
    CMO_DISPATCH(ef_project_body, r, M, E, Qt, P, n, m)
}

/* Qt = P^T M (r x m), streaming M once: Qt[k] += P[i, k] M[i] row by row,
 * four rows per load and store of Qt (r x m floats, in cache); the sum over
 * rows runs in row order whatever the blocking. */
CMO_TARGET CMO_INLINE void
project_t_body(const float *M, const float *P, float *Qt, Py_ssize_t n,
               Py_ssize_t m, Py_ssize_t r)
{
    memset(Qt, 0, (size_t)(r * m) * sizeof(float));
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *row = M + i * m, *p = P + i * r;
        for (Py_ssize_t k = 0; k < r; k++) {
            float *q = Qt + k * m;
            __m256 p0 = _mm256_set1_ps(p[k]), p1 = _mm256_set1_ps(p[r + k]);
            __m256 p2 = _mm256_set1_ps(p[2 * r + k]);
            __m256 p3 = _mm256_set1_ps(p[3 * r + k]);
            Py_ssize_t j = 0;
            for (; j + 8 <= m; j += 8) {
                __m256 s = _mm256_loadu_ps(q + j);
                s = _mm256_fmadd_ps(p0, _mm256_loadu_ps(row + j), s);
                s = _mm256_fmadd_ps(p1, _mm256_loadu_ps(row + m + j), s);
                s = _mm256_fmadd_ps(p2, _mm256_loadu_ps(row + 2 * m + j), s);
                s = _mm256_fmadd_ps(p3, _mm256_loadu_ps(row + 3 * m + j), s);
                _mm256_storeu_ps(q + j, s);
            }
            for (; j < m; j++) {
                float s = q[j];
                for (int b = 0; b < 4; b++)
                    s = fmaf(p[b * r + k], row[b * m + j], s);
                q[j] = s;
            }
        }
    }
    for (; i < n; i++) {
        const float *row = M + i * m, *p = P + i * r;
        for (Py_ssize_t k = 0; k < r; k++) {
            float *q = Qt + k * m;
            __m256 pk = _mm256_set1_ps(p[k]);
            Py_ssize_t j = 0;
            for (; j + 8 <= m; j += 8)
                _mm256_storeu_ps(q + j, _mm256_fmadd_ps(
                    pk, _mm256_loadu_ps(row + j), _mm256_loadu_ps(q + j)));
            for (; j < m; j++)
                q[j] = fmaf(p[k], row[j], q[j]);
        }
    }
}

CMO_TARGET static void
k_project_t(const float *M, const float *P, float *Qt, Py_ssize_t n,
            Py_ssize_t m, Py_ssize_t r)
{
    CMO_DISPATCH(project_t_body, r, M, P, Qt, n, m)
}

/* For each row i: A = P[i] Qt (1 x m); E[i] = M[i] - A; M[i] = A. */
CMO_TARGET CMO_INLINE void
reconstruct_body(float *M, float *E, const float *P, const float *Qt,
                 Py_ssize_t n, Py_ssize_t m, Py_ssize_t r)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        float *row = M + i * m, *e = E + i * m;
        const float *p = P + i * r;
        __m256 pk[CMO_MAX_RANK];
        for (Py_ssize_t k = 0; k < r; k++)
            pk[k] = _mm256_set1_ps(p[k]);
        Py_ssize_t j = 0;
        for (; j + 8 <= m; j += 8) {
            __m256 a = _mm256_mul_ps(pk[0], _mm256_loadu_ps(Qt + j));
            for (Py_ssize_t k = 1; k < r; k++)
                a = _mm256_fmadd_ps(pk[k], _mm256_loadu_ps(Qt + k * m + j), a);
            _mm256_storeu_ps(e + j, _mm256_sub_ps(_mm256_loadu_ps(row + j), a));
            _mm256_storeu_ps(row + j, a);
        }
        for (; j < m; j++) {
            float a = p[0] * Qt[j];
            for (Py_ssize_t k = 1; k < r; k++)
                a = fmaf(p[k], Qt[k * m + j], a);
            e[j] = row[j] - a;
            row[j] = a;
        }
    }
}

CMO_TARGET static void
k_reconstruct(float *M, float *E, const float *P, const float *Qt,
              Py_ssize_t n, Py_ssize_t m, Py_ssize_t r)
{
    CMO_DISPATCH(reconstruct_body, r, M, E, P, Qt, n, m)
}
#endif /* CMO_X86 */

/* Gram-Schmidt on the columns of P (n x r, row-major), sums in double:
 * column i is scaled by 1 / (|col| + eps), then removed from the later
 * columns.  Portable C (P is small: n x r with r <= a few). */
static void
k_orthogonalize(float *P, Py_ssize_t n, Py_ssize_t r, double eps)
{
    for (Py_ssize_t i = 0; i < r; i++) {
        double ss = 0.0;
        for (Py_ssize_t a = 0; a < n; a++) {
            double v = P[a * r + i];
            ss += v * v;
        }
        float inv = (float)(1.0 / (sqrt(ss) + eps));
        for (Py_ssize_t a = 0; a < n; a++)
            P[a * r + i] *= inv;
        for (Py_ssize_t k = i + 1; k < r; k++) {
            double d = 0.0;
            for (Py_ssize_t a = 0; a < n; a++)
                d += (double)P[a * r + i] * P[a * r + k];
            float df = (float)d;
            for (Py_ssize_t a = 0; a < n; a++)
                P[a * r + k] -= P[a * r + i] * df;
        }
    }
}

/* ------------------------------------------------------------------ */
/* Python entry points                                                 */

/* One buffer argument of an entry point. */
typedef struct {
    PyObject *obj;
    int writable;
    char format;        /* 'f' float32, 'e' float16 */
    const char *name;
    Py_ssize_t count;   /* expected elements; -1: any */
    int optional;       /* None allowed (the kernel gets NULL) */
} arg_t;

static void
release(Py_buffer *v, int k)
{
    for (int i = 0; i < k; i++)
        if (v[i].obj != NULL)
            PyBuffer_Release(&v[i]);
}

/* Gets every buffer and checks its element count; on failure releases what
 * it got and returns -1 with the error set. */
static int
acquire(const arg_t *a, Py_buffer *v, int k)
{
    for (int i = 0; i < k; i++)
        v[i].obj = NULL;
    for (int i = 0; i < k; i++) {
        if (a[i].optional && a[i].obj == Py_None)
            continue;
        if (get_buffer(a[i].obj, &v[i], a[i].writable, a[i].format,
                       a[i].name) < 0
                || (a[i].count >= 0
                    && check_count(&v[i], a[i].count, a[i].name) < 0)) {
            release(v, k);
            return -1;
        }
    }
    return 0;
}

#define BUF(v, type) ((v).obj != NULL ? (type)(v).buf : NULL)

/* One conversion entry point: src (src_fmt) -> dst (dst_fmt), same count. */
static PyObject *
convert(PyObject *args, const char *spec, char src_fmt, char dst_fmt,
        int to_half)
{
    PyObject *so, *do_;
    Py_buffer v[2];
    if (!PyArg_ParseTuple(args, spec, &so, &do_))
        return NULL;
    arg_t a[] = {{so, 0, src_fmt, "src", -1, 0},
                 {do_, 1, dst_fmt, "dst", -1, 0}};
    if (require_available() < 0 || acquire(a, v, 2) < 0)
        return NULL;
    Py_ssize_t n = count(&v[0]);
    if (check_count(&v[1], n, "dst") < 0) {
        release(v, 2);
        return NULL;
    }
#ifdef CMO_X86
    Py_BEGIN_ALLOW_THREADS
    if (to_half)
        k_f32_to_f16((const float *)v[0].buf, (uint16_t *)v[1].buf, n);
    else
        k_f16_to_f32((const uint16_t *)v[0].buf, (float *)v[1].buf, n);
    Py_END_ALLOW_THREADS
#endif
    release(v, 2);
    Py_RETURN_NONE;
}

static PyObject *
py_f32_to_f16(PyObject *self, PyObject *args)
{
    return convert(args, "OO:f32_to_f16", 'f', 'e', 1);
}

static PyObject *
py_f16_to_f32(PyObject *self, PyObject *args)
{
    return convert(args, "OO:f16_to_f32", 'e', 'f', 0);
}

static PyObject *
py_add_f16(PyObject *self, PyObject *args)
{
    PyObject *ao, *bo, *oo;
    double scale = 1.0;
    Py_buffer v[3];
    if (!PyArg_ParseTuple(args, "OOO|d:add_f16", &ao, &bo, &oo, &scale))
        return NULL;
    arg_t a[] = {{ao, 0, 'e', "a", -1, 0}, {bo, 0, 'e', "b", -1, 0},
                 {oo, 1, 'e', "out", -1, 0}};
    if (require_available() < 0 || acquire(a, v, 3) < 0)
        return NULL;
    Py_ssize_t n = count(&v[0]);
    if (check_count(&v[1], n, "b") < 0 || check_count(&v[2], n, "out") < 0) {
        release(v, 3);
        return NULL;
    }
#ifdef CMO_X86
    float s = (float)scale;
    int scaled = scale != 1.0;
    Py_BEGIN_ALLOW_THREADS
    k_add_f16((const uint16_t *)v[0].buf, (const uint16_t *)v[1].buf,
              (uint16_t *)v[2].buf, n, s, scaled);
    Py_END_ALLOW_THREADS
#endif
    release(v, 3);
    Py_RETURN_NONE;
}

static int
check_rank(Py_ssize_t n, Py_ssize_t m, Py_ssize_t r)
{
    if (n < 0 || m < 0 || r < 1 || r > CMO_MAX_RANK) {
        PyErr_Format(PyExc_ValueError,
                     "bad shape n=%zd m=%zd r=%zd (1 <= r <= %d)", n, m, r,
                     CMO_MAX_RANK);
        return -1;
    }
    return 0;
}

static PyObject *
py_ef_project(PyObject *self, PyObject *args)
{
    PyObject *mo, *eo, *qo, *po;
    Py_ssize_t n, m, r;
    Py_buffer v[4];
    if (!PyArg_ParseTuple(args, "OOOOnnn:ef_project", &mo, &eo, &qo, &po,
                          &n, &m, &r))
        return NULL;
    if (require_available() < 0 || check_rank(n, m, r) < 0)
        return NULL;
    arg_t a[] = {{mo, 1, 'f', "M", n * m, 0}, {eo, 0, 'f', "E", n * m, 1},
                 {qo, 0, 'f', "Qt", r * m, 0}, {po, 1, 'f', "P", n * r, 0}};
    if (acquire(a, v, 4) < 0)
        return NULL;
#ifdef CMO_X86
    Py_BEGIN_ALLOW_THREADS
    k_ef_project((float *)v[0].buf, BUF(v[1], const float *),
                 (const float *)v[2].buf, (float *)v[3].buf, n, m, r);
    Py_END_ALLOW_THREADS
#endif
    release(v, 4);
    Py_RETURN_NONE;
}

static PyObject *
py_reconstruct(PyObject *self, PyObject *args)
{
    PyObject *mo, *eo, *po, *qo;
    Py_ssize_t n, m, r;
    Py_buffer v[4];
    if (!PyArg_ParseTuple(args, "OOOOnnn:reconstruct", &mo, &eo, &po, &qo,
                          &n, &m, &r))
        return NULL;
    if (require_available() < 0 || check_rank(n, m, r) < 0)
        return NULL;
    arg_t a[] = {{mo, 1, 'f', "M", n * m, 0}, {eo, 1, 'f', "E", n * m, 0},
                 {po, 0, 'f', "P", n * r, 0}, {qo, 0, 'f', "Qt", r * m, 0}};
    if (acquire(a, v, 4) < 0)
        return NULL;
    if (v[0].buf == v[1].buf && n * m > 0) {
        release(v, 4);
        PyErr_SetString(PyExc_ValueError, "M and E must not overlap");
        return NULL;
    }
#ifdef CMO_X86
    Py_BEGIN_ALLOW_THREADS
    k_reconstruct((float *)v[0].buf, (float *)v[1].buf,
                  (const float *)v[2].buf, (const float *)v[3].buf, n, m, r);
    Py_END_ALLOW_THREADS
#endif
    release(v, 4);
    Py_RETURN_NONE;
}

static PyObject *
py_project_t(PyObject *self, PyObject *args)
{
    PyObject *mo, *po, *qo;
    Py_ssize_t n, m, r;
    Py_buffer v[3];
    if (!PyArg_ParseTuple(args, "OOOnnn:project_t", &mo, &po, &qo, &n, &m,
                          &r))
        return NULL;
    if (require_available() < 0 || check_rank(n, m, r) < 0)
        return NULL;
    arg_t a[] = {{mo, 0, 'f', "M", n * m, 0}, {po, 0, 'f', "P", n * r, 0},
                 {qo, 1, 'f', "Qt", r * m, 0}};
    if (acquire(a, v, 3) < 0)
        return NULL;
#ifdef CMO_X86
    Py_BEGIN_ALLOW_THREADS
    k_project_t((const float *)v[0].buf, (const float *)v[1].buf,
                (float *)v[2].buf, n, m, r);
    Py_END_ALLOW_THREADS
#endif
    release(v, 3);
    Py_RETURN_NONE;
}

static PyObject *
py_orthogonalize(PyObject *self, PyObject *args)
{
    PyObject *po;
    Py_ssize_t n, r;
    double eps;
    Py_buffer v[1];
    if (!PyArg_ParseTuple(args, "Onnd:orthogonalize", &po, &n, &r, &eps))
        return NULL;
    if (n < 0 || r < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return NULL;
    }
    arg_t a[] = {{po, 1, 'f', "P", n * r, 0}};
    if (acquire(a, v, 1) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    k_orthogonalize((float *)v[0].buf, n, r, eps);
    Py_END_ALLOW_THREADS
    release(v, 1);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"f32_to_f16", py_f32_to_f16, METH_VARARGS,
     "f32_to_f16(src, dst): dst = float16(src), round to nearest even."},
    {"f16_to_f32", py_f16_to_f32, METH_VARARGS,
     "f16_to_f32(src, dst): dst = float32(src)."},
    {"add_f16", py_add_f16, METH_VARARGS,
     "add_f16(a, b, out, scale=1.0): out = float16((a + b) * scale), "
     "the sum in float32."},
    {"ef_project", py_ef_project, METH_VARARGS,
     "ef_project(M, E, Qt, P, n, m, r): M += E (E may be None); P = M Qt^T."},
    {"project_t", py_project_t, METH_VARARGS,
     "project_t(M, P, Qt, n, m, r): Qt = P^T M."},
    {"reconstruct", py_reconstruct, METH_VARARGS,
     "reconstruct(M, E, P, Qt, n, m, r): A = P Qt; E = M - A; M = A."},
    {"orthogonalize", py_orthogonalize, METH_VARARGS,
     "orthogonalize(P, n, r, eps): Gram-Schmidt on P's columns."},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "Fused float16 conversion and PowerSGD kernels (see _kernels.py).",
    -1, methods
};

PyMODINIT_FUNC
PyInit__native(void)
{
    PyObject *mod = PyModule_Create(&module);
    if (mod == NULL)
        return NULL;
#ifdef CMO_X86
    __builtin_cpu_init();
    cmo_available = __builtin_cpu_supports("avx2")
        && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#endif
    if (PyModule_AddIntConstant(mod, "available", cmo_available) < 0
            || PyModule_AddIntConstant(mod, "max_rank", 16) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
