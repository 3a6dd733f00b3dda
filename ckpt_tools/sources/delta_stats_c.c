/* One chunk's statistics of W - W0 in one pass (`ckpt_tools.sources.delta_stats_c`).
 *
 * `sources/compare.py: chunk_stats` defines the statistics with torch: the elements whose bits
 * differ, ||W0||^2 and ||W - W0||^2 in fp64, max |W - W0|, and, where inf/nan appear, the count of
 * non-finite differences with the sums and the max over the finite part only. In torch that is
 * ~8 passes over 2 MB fp64 temporaries per chunk, with the GIL held between them: diff-vs-base at 8B
 * used 5x the CPU of `cat` and kept ~3 of 16 cores busy. Here both input buffers are read once,
 * with the GIL released, and nothing is allocated.
 *
 * Same answers as the torch path: the counts and max |d| bit for bit (every d = fp64(w) - fp64(w0)
 * is the same IEEE operation; the upcasts to fp64 are exact). The two sums differ from torch.dot's
 * only in their last bits, by summation order, which is fixed here: element i goes to accumulator
 * i % LANES, the LANES partial sums are added in one fixed tree. No -ffast-math and no fused
 * multiply-add (setup.py passes -ffp-contract=off): the result depends on the chunk alone, never on
 * the thread, the machine's vector width or the number of workers (tests/test_diff_workers.py).
 * `base_sq` uses the very same accumulation as `chunk_stats`, so an identical chunk's ||W0||^2 has
 * the same bits whichever of the two computed it.
 *
 * Dtype codes (compare.py's `_DTYPE_CODES`): 0 bf16, 1 fp16, 2 fp32, 3 fp64. Any other dtype stays on
 * the torch path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define LANES 8   /* element i is summed in accumulator i % LANES */

enum { BF16 = 0, FP16 = 1, FP32 = 2, FP64 = 3, N_CODES = 4 };
static const Py_ssize_t ITEMSIZE[N_CODES] = {2, 2, 4, 8};

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_from_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Exact fp16 -> fp32 in integer arithmetic (no F16C assumed): normal numbers rebias the exponent;
 * inf/nan keep their payload; subnormals m * 2^-24 come out of one exact float subtraction
 * (2^-14 * (1 + m/1024) - 2^-14). Checked on all 65536 patterns against torch's conversion. */
static inline float f32_from_f16(uint16_t h) {
    uint32_t o = (uint32_t)(h & 0x7fff) << 13;
    uint32_t exp = o & 0x0f800000u;
    o += (uint32_t)(127 - 15) << 23;
    if (exp == 0x0f800000u) {
        o += (uint32_t)(128 - 16) << 23;                       /* inf / nan */
    } else if (exp == 0) {
        o += 1u << 23;                                         /* zero / subnormal */
        o = bits_from_f32(f32_from_bits(o) - f32_from_bits(113u << 23));
    }
    return f32_from_bits(o | ((uint32_t)(h & 0x8000) << 16));
}

/* One element as fp64, and whether its bits differ from the other side's. */
static inline double load_bf16(const void *p, Py_ssize_t i) {
    return (double)f32_from_bits((uint32_t)((const uint16_t *)p)[i] << 16);
}
static inline double load_fp16(const void *p, Py_ssize_t i) { return (double)f32_from_f16(((const uint16_t *)p)[i]); }
static inline double load_fp32(const void *p, Py_ssize_t i) { return (double)((const float *)p)[i]; }
static inline double load_fp64(const void *p, Py_ssize_t i) { return ((const double *)p)[i]; }
static inline int differ_bf16(const void *a, const void *b, Py_ssize_t i) {
    return ((const uint16_t *)a)[i] != ((const uint16_t *)b)[i];
}
#define differ_fp16 differ_bf16
static inline int differ_fp32(const void *a, const void *b, Py_ssize_t i) {
    return ((const uint32_t *)a)[i] != ((const uint32_t *)b)[i];
}
static inline int differ_fp64(const void *a, const void *b, Py_ssize_t i) {
    return ((const uint64_t *)a)[i] != ((const uint64_t *)b)[i];
}

#ifdef __SSE2__
/* x86-64: LANES elements at a time, as 4 x 2 doubles. Lane j of every accumulator only ever sees
 * elements j, j + LANES, ... with the same IEEE operations as the scalar code (max_pd(a, m) is
 * a > m ? a : m), so this path and the scalar one give the same bits. Each loader fills x[0..3]
 * with elements [i, i + 8) as fp64 and returns how many of them are EQUAL bitwise to the other
 * side's, as a vector of small counts (summed in `equal_count`). */
static inline __m128i equal_bf16(const void *w, const void *w0, Py_ssize_t i) {
    __m128i a = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    __m128i b = _mm_loadu_si128((const __m128i *)((const uint16_t *)w0 + i));
    return _mm_srli_epi16(_mm_cmpeq_epi16(a, b), 15);                 /* 8 x 16-bit 0/1 */
}
#define equal_fp16 equal_bf16
static inline __m128i equal_fp32(const void *w, const void *w0, Py_ssize_t i) {
    const __m128i *a = (const __m128i *)((const uint32_t *)w + i), *b = (const __m128i *)((const uint32_t *)w0 + i);
    __m128i lo = _mm_cmpeq_epi32(_mm_loadu_si128(a), _mm_loadu_si128(b));
    __m128i hi = _mm_cmpeq_epi32(_mm_loadu_si128(a + 1), _mm_loadu_si128(b + 1));
    return _mm_srli_epi16(_mm_packs_epi32(lo, hi), 15);              /* 8 x 16-bit 0/1 */
}
static inline __m128i equal_fp64(const void *w, const void *w0, Py_ssize_t i) {
    const __m128i *a = (const __m128i *)((const uint64_t *)w + i), *b = (const __m128i *)((const uint64_t *)w0 + i);
    __m128i eq[4];
    for (int k = 0; k < 4; k++) {
        __m128i e = _mm_cmpeq_epi32(_mm_loadu_si128(a + k), _mm_loadu_si128(b + k));
        eq[k] = _mm_and_si128(e, _mm_shuffle_epi32(e, _MM_SHUFFLE(2, 3, 0, 1)));   /* both halves */
    }
    /* each equal element is two -1 words: 16 x 16-bit 0/1 over 8 elements, i.e. 2 per element */
    __m128i lo = _mm_packs_epi32(eq[0], eq[1]), hi = _mm_packs_epi32(eq[2], eq[3]);
    return _mm_add_epi16(_mm_srli_epi16(lo, 15), _mm_srli_epi16(hi, 15));
}
#define EQUAL_UNITS_fp64 2   /* equal_fp64 counts each element twice */
#define EQUAL_UNITS_bf16 1
#define EQUAL_UNITS_fp16 1
#define EQUAL_UNITS_fp32 1

static inline void widen_ps(__m128 f, __m128d *x) {
    x[0] = _mm_cvtps_pd(f);
    x[1] = _mm_cvtps_pd(_mm_movehl_ps(f, f));
}
static inline void v_load_bf16(const void *p, Py_ssize_t i, __m128d *x) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)), z = _mm_setzero_si128();
    widen_ps(_mm_castsi128_ps(_mm_unpacklo_epi16(z, h)), x);          /* (h << 16) as fp32 */
    widen_ps(_mm_castsi128_ps(_mm_unpackhi_epi16(z, h)), x + 2);
}
static inline __m128 v_f32_from_f16(__m128i h) {   /* f32_from_f16 on 4 lanes, the branches as masks */
    __m128i o = _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x7fff)), 13);
    __m128i exp = _mm_and_si128(o, _mm_set1_epi32(0x0f800000));
    o = _mm_add_epi32(o, _mm_set1_epi32((127 - 15) << 23));
    __m128i infnan = _mm_cmpeq_epi32(exp, _mm_set1_epi32(0x0f800000)), sub = _mm_cmpeq_epi32(exp, _mm_setzero_si128());
    o = _mm_add_epi32(o, _mm_and_si128(infnan, _mm_set1_epi32((128 - 16) << 23)));
    __m128 magic = _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(o, _mm_set1_epi32(1 << 23))),
                              _mm_castsi128_ps(_mm_set1_epi32(113 << 23)));
    o = _mm_or_si128(_mm_andnot_si128(sub, o), _mm_and_si128(sub, _mm_castps_si128(magic)));
    return _mm_castsi128_ps(_mm_or_si128(o, _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(0x8000)), 16)));
}
static inline void v_load_fp16(const void *p, Py_ssize_t i, __m128d *x) {
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)), z = _mm_setzero_si128();
    widen_ps(v_f32_from_f16(_mm_unpacklo_epi16(h, z)), x);
    widen_ps(v_f32_from_f16(_mm_unpackhi_epi16(h, z)), x + 2);
}
static inline void v_load_fp32(const void *p, Py_ssize_t i, __m128d *x) {
    widen_ps(_mm_loadu_ps((const float *)p + i), x);
    widen_ps(_mm_loadu_ps((const float *)p + i + 4), x + 2);
}
static inline void v_load_fp64(const void *p, Py_ssize_t i, __m128d *x) {
    for (int k = 0; k < 4; k++) x[k] = _mm_loadu_pd((const double *)p + i + 2 * k);
}
static inline int64_t equal_count(__m128i c) {   /* the sum of 8 x 16-bit counts */
    __m128i s = _mm_madd_epi16(c, _mm_set1_epi16(1));                    /* 4 x 32-bit */
    int32_t v[4];
    _mm_storeu_si128((__m128i *)v, s);
    return (int64_t)v[0] + v[1] + v[2] + v[3];
}
/* The 16-bit counts grow by at most 2 per lane and step (fp64 counts each element twice): flushed
 * every COUNT_BLOCK elements, before a lane passes 16384 (the sum in equal_count is signed). */
#define COUNT_BLOCK ((Py_ssize_t)LANES * 8192)

/* The vector part of the first pass: elements [0, n rounded down to LANES) into the accumulators
 * (bs, ds, mx: LANES each), returning the number of equal elements and setting *done. */
#define VECTOR_PASS(NAME)                                                                          \
    static int64_t vector_pass_##NAME(const void *w, const void *w0, Py_ssize_t n, double *bs,     \
                                      double *ds, double *mx, Py_ssize_t *done) {                  \
        __m128d vb[4], vd[4], vm[4];                                                               \
        for (int k = 0; k < 4; k++) vb[k] = vd[k] = vm[k] = _mm_setzero_pd();                      \
        int64_t equal = 0;                                                                         \
        Py_ssize_t i = 0;                                                                          \
        while (i + LANES <= n) {                                                                   \
            __m128i count = _mm_setzero_si128();                                                   \
            Py_ssize_t stop = n - i > COUNT_BLOCK ? i + COUNT_BLOCK : n;                           \
            for (; i + LANES <= stop; i += LANES) {                                                \
                __m128d b[4], a[4];                                                                \
                v_load_##NAME(w0, i, b);                                                           \
                v_load_##NAME(w, i, a);                                                            \
                count = _mm_add_epi16(count, equal_##NAME(w, w0, i));                              \
                for (int k = 0; k < 4; k++) {                                                      \
                    __m128d d = _mm_sub_pd(a[k], b[k]);                                            \
                    vb[k] = _mm_add_pd(vb[k], _mm_mul_pd(b[k], b[k]));                             \
                    vd[k] = _mm_add_pd(vd[k], _mm_mul_pd(d, d));                                   \
                    vm[k] = _mm_max_pd(_mm_andnot_pd(_mm_set1_pd(-0.0), d), vm[k]);                \
                }                                                                                  \
            }                                                                                      \
            equal += equal_count(count);                                                           \
        }                                                                                          \
        for (int k = 0; k < 4; k++) {                                                              \
            _mm_storeu_pd(bs + 2 * k, vb[k]);                                                      \
            _mm_storeu_pd(ds + 2 * k, vd[k]);                                                      \
            _mm_storeu_pd(mx + 2 * k, vm[k]);                                                      \
        }                                                                                          \
        *done = i;                                                                                 \
        return equal / EQUAL_UNITS_##NAME;                                                         \
    }                                                                                              \
    static void vector_base_##NAME(const void *w0, Py_ssize_t n, double *bs, Py_ssize_t *done) {  \
        __m128d vb[4];                                                                             \
        for (int k = 0; k < 4; k++) vb[k] = _mm_setzero_pd();                                      \
        Py_ssize_t i = 0;                                                                          \
        for (; i + LANES <= n; i += LANES) {                                                       \
            __m128d b[4];                                                                          \
            v_load_##NAME(w0, i, b);                                                               \
            for (int k = 0; k < 4; k++) vb[k] = _mm_add_pd(vb[k], _mm_mul_pd(b[k], b[k]));         \
        }                                                                                          \
        for (int k = 0; k < 4; k++) _mm_storeu_pd(bs + 2 * k, vb[k]);                              \
        *done = i;                                                                                 \
    }
#else
/* Elsewhere: no vector part; the scalar loop below does every element, in the same lanes. */
#define VECTOR_PASS(NAME)                                                                          \
    static int64_t vector_pass_##NAME(const void *w, const void *w0, Py_ssize_t n, double *bs,     \
                                      double *ds, double *mx, Py_ssize_t *done) {                  \
        for (int j = 0; j < LANES; j++) bs[j] = ds[j] = mx[j] = 0.0;                               \
        *done = 0;                                                                                 \
        return 0;                                                                                  \
    }                                                                                              \
    static void vector_base_##NAME(const void *w0, Py_ssize_t n, double *bs, Py_ssize_t *done) {  \
        for (int j = 0; j < LANES; j++) bs[j] = 0.0;                                               \
        *done = 0;                                                                                 \
    }
#endif

/* The one fixed order in which the LANES partial sums are added. */
static double combine(const double *acc) {
    double a = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double b = (acc[4] + acc[5]) + (acc[6] + acc[7]);
    return a + b;
}

typedef struct {
    int64_t changed;
    double base_sq, delta_sq, max_abs;
    int64_t nonfinite;
    int finite;
} Stats;

/* The first pass, over every element: the unfiltered sums (a nan or inf anywhere makes them
 * non-finite, exactly as torch.dot's), the changed count and max |d|. The second pass runs only
 * when a sum came out non-finite (rare): the count of non-finite d, and the sums and the max over
 * the finite values (torch's path replaces the others by 0, which adds nothing). */
#define DEFINE_KERNELS(NAME)                                                                       \
    VECTOR_PASS(NAME)                                                                              \
    static double base_sq_##NAME(const void *w0, Py_ssize_t n) {                                   \
        double bs[LANES];                                                                          \
        Py_ssize_t i;                                                                              \
        vector_base_##NAME(w0, n, bs, &i);                                                         \
        for (; i < n; i++) {                                                                       \
            double b = load_##NAME(w0, i);                                                         \
            bs[i % LANES] += b * b;                                                                \
        }                                                                                          \
        return combine(bs);                                                                        \
    }                                                                                              \
                                                                                                   \
    static void finite_part_##NAME(const void *w, const void *w0, Py_ssize_t n, Stats *st) {       \
        double bs[LANES] = {0}, ds[LANES] = {0}, mx = 0.0;                                         \
        int64_t nonfinite = 0;                                                                     \
        for (Py_ssize_t i = 0; i < n; i++) {                                                       \
            double b = load_##NAME(w0, i), d = load_##NAME(w, i) - b;                              \
            if (isfinite(b)) bs[i % LANES] += b * b;                                               \
            if (isfinite(d)) {                                                                     \
                ds[i % LANES] += d * d;                                                            \
                if (fabs(d) > mx) mx = fabs(d);                                                    \
            } else {                                                                               \
                nonfinite++;                                                                       \
            }                                                                                      \
        }                                                                                          \
        st->base_sq = combine(bs);                                                                 \
        st->delta_sq = combine(ds);                                                                \
        st->max_abs = mx;                                                                          \
        st->nonfinite = nonfinite;                                                                 \
    }                                                                                              \
                                                                                                   \
    static void chunk_stats_##NAME(const void *w, const void *w0, Py_ssize_t n, Stats *st) {       \
        double bs[LANES], ds[LANES], mx[LANES];                                                    \
        Py_ssize_t i;                                                                              \
        int64_t equal = vector_pass_##NAME(w, w0, n, bs, ds, mx, &i);                              \
        int64_t changed = i - equal;                                                               \
        for (; i < n; i++) {                                                                       \
            double b = load_##NAME(w0, i), d = load_##NAME(w, i) - b, a = fabs(d);                 \
            changed += differ_##NAME(w, w0, i);                                                    \
            bs[i % LANES] += b * b;                                                                \
            ds[i % LANES] += d * d;                                                                \
            mx[i % LANES] = a > mx[i % LANES] ? a : mx[i % LANES];                                 \
        }                                                                                          \
        st->changed = changed;                                                                     \
        st->max_abs = 0.0;                                                                         \
        for (int j = 0; j < LANES; j++)                                                            \
            if (mx[j] > st->max_abs) st->max_abs = mx[j];                                          \
        st->base_sq = combine(bs);                                                                 \
        st->delta_sq = combine(ds);                                                                \
        st->nonfinite = 0;                                                                         \
        st->finite = isfinite(st->base_sq) && isfinite(st->delta_sq);                              \
        if (!st->changed) {                  /* identical: all it adds is ||W0||^2 */              \
            st->delta_sq = st->max_abs = 0.0;                                                      \
            st->finite = isfinite(st->base_sq);                                                    \
        } else if (!st->finite) {                                                                  \
            finite_part_##NAME(w, w0, n, st);                                                      \
        }                                                                                          \
    }

DEFINE_KERNELS(bf16)
DEFINE_KERNELS(fp16)
DEFINE_KERNELS(fp32)
DEFINE_KERNELS(fp64)

typedef void (*ChunkKernel)(const void *, const void *, Py_ssize_t, Stats *);
typedef double (*BaseKernel)(const void *, Py_ssize_t);
static const ChunkKernel CHUNK_KERNELS[N_CODES] = {chunk_stats_bf16, chunk_stats_fp16, chunk_stats_fp32,
                                                   chunk_stats_fp64};
static const BaseKernel BASE_KERNELS[N_CODES] = {base_sq_bf16, base_sq_fp16, base_sq_fp32, base_sq_fp64};

/* The element count of a buffer of this dtype, or -1 with an exception set. */
static Py_ssize_t elements(const Py_buffer *buf, int code) {
    if (code < 0 || code >= N_CODES) {
        PyErr_Format(PyExc_ValueError, "unknown dtype code %d", code);
        return -1;
    }
    if (buf->len % ITEMSIZE[code]) {
        PyErr_Format(PyExc_ValueError, "a buffer of %zd bytes is not a whole number of %zd-byte elements",
                     buf->len, ITEMSIZE[code]);
        return -1;
    }
    return buf->len / ITEMSIZE[code];
}

/* The kernels read whole elements through typed pointers: a buffer that is not aligned to its
 * element size (no tensor chunk is; a bytearray at an odd offset could be) is left to the caller's
 * torch path (answer None), as is a buffer that is not C-contiguous bytes. */
static int readable(const Py_buffer *buf, int code) {
    return PyBuffer_IsContiguous(buf, 'C') && (uintptr_t)buf->buf % (uintptr_t)ITEMSIZE[code] == 0;
}

static PyObject *py_chunk_stats(PyObject *self, PyObject *args) {
    Py_buffer w, w0;
    int code;
    if (!PyArg_ParseTuple(args, "y*y*i", &w, &w0, &code)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = elements(&w, code);
    if (n >= 0 && w.len != w0.len) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes", w.len, w0.len);
        n = -1;
    }
    if (n >= 0 && !(readable(&w, code) && readable(&w0, code))) {
        result = Py_NewRef(Py_None);
    } else if (n >= 0) {
        Stats st;
        Py_BEGIN_ALLOW_THREADS
        CHUNK_KERNELS[code](w.buf, w0.buf, n, &st);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("LddLdO", (long long)st.changed, st.base_sq, st.delta_sq, (long long)st.nonfinite,
                               st.max_abs, st.finite ? Py_True : Py_False);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&w0);
    return result;
}

static PyObject *py_base_sq(PyObject *self, PyObject *args) {
    Py_buffer w0;
    int code;
    if (!PyArg_ParseTuple(args, "y*i", &w0, &code)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = elements(&w0, code);
    if (n >= 0 && !readable(&w0, code)) {
        result = Py_NewRef(Py_None);
    } else if (n >= 0) {
        double s;
        Py_BEGIN_ALLOW_THREADS
        s = BASE_KERNELS[code](w0.buf, n);
        Py_END_ALLOW_THREADS
        result = PyFloat_FromDouble(s);
    }
    PyBuffer_Release(&w0);
    return result;
}

/* bytearray == bytearray is one memcmp, but with the GIL held: 512 KB of an identical chunk is
 * ~40 us that no other worker can run Python in. */
static PyObject *py_same_bytes(PyObject *self, PyObject *args) {
    Py_buffer a, b;
    if (!PyArg_ParseTuple(args, "y*y*", &a, &b)) return NULL;
    int same = a.len == b.len;
    if (same && a.len) {
        Py_BEGIN_ALLOW_THREADS
        same = memcmp(a.buf, b.buf, (size_t)a.len) == 0;
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return PyBool_FromLong(same);
}

/* A block's statistics in one call: its chunks (`chunk` elements each, the last one shorter) each compared
 * bytewise first when `skip_identical` (an identical chunk adds ||W0||^2 alone, `base_sq`, as compare.py's
 * `identical_chunk_stats`), else through `chunk_stats`. One call per block rather than two or three per
 * chunk: the Python around each call holds the GIL, and at 16 workers that was what they queued on. */
static PyObject *chunk_tuple(const Stats *st) {
    return Py_BuildValue("LddLdO", (long long)st->changed, st->base_sq, st->delta_sq, (long long)st->nonfinite,
                         st->max_abs, st->finite ? Py_True : Py_False);
}

static PyObject *py_block_stats(PyObject *self, PyObject *args) {
    Py_buffer w, w0;
    int code, skip_identical;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "y*y*inp", &w, &w0, &code, &chunk, &skip_identical)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = elements(&w, code);
    if (n >= 0 && (w.len != w0.len || chunk < 1)) {
        PyErr_Format(PyExc_ValueError, "block_stats: buffers of %zd and %zd bytes, chunks of %zd", w.len, w0.len,
                     chunk);
        n = -1;
    }
    if (n >= 0 && !(readable(&w, code) && readable(&w0, code))) {
        result = Py_NewRef(Py_None);
        n = -1;
    }
    if (n >= 0) {
        Py_ssize_t chunks = n ? (n + chunk - 1) / chunk : 0, size = ITEMSIZE[code];
        Stats *st = PyMem_Calloc(chunks ? chunks : 1, sizeof(Stats));
        int all_same = 1;
        if (st == NULL) {
            PyErr_NoMemory();
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t c = 0; c < chunks; c++) {
                Py_ssize_t s = c * chunk, k = n - s < chunk ? n - s : chunk;
                const char *a = (const char *)w.buf + s * size, *b = (const char *)w0.buf + s * size;
                if (skip_identical && memcmp(a, b, (size_t)(k * size)) == 0) {
                    st[c].base_sq = BASE_KERNELS[code](b, k);
                    st[c].finite = isfinite(st[c].base_sq);
                    st[c].changed = -1;   /* (identical: filled below) */
                } else {
                    all_same = 0;
                    CHUNK_KERNELS[code](a, b, k, &st[c]);
                }
            }
            Py_END_ALLOW_THREADS
            if (skip_identical && all_same) {
                result = Py_NewRef(Py_None);
            } else if ((result = PyList_New(chunks)) != NULL) {
                for (Py_ssize_t c = 0; c < chunks; c++) {
                    if (st[c].changed < 0) {
                        st[c].changed = st[c].nonfinite = 0;
                        st[c].delta_sq = st[c].max_abs = 0.0;
                    }
                    PyObject *t = chunk_tuple(&st[c]);
                    if (t == NULL) {
                        Py_CLEAR(result);
                        break;
                    }
                    PyList_SET_ITEM(result, c, t);
                }
            }
            PyMem_Free(st);
        }
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&w0);
    return result;
}

/* ---- the adapter check by value (core/tensor_math.py: check_merged_values defines it) ----
 *
 * Per element, with P the product in its one fixed order (`canonical_p`: p = 0, then p = p + L_ik * R_kj for
 * k = 0 .. r-1, each a rounded fp64 operation, nothing fused):
 *   sp = P * s;  x = W0 + sp;  bound = (|L_i| * |R_j|) * gamma;  e = ((|sp| + |x|) * u + bound * |s|) * 2
 *   lo = round(x - e), hi = round(x + e), expected = round(x)  (fp64 -> fp32 -> W's dtype, as torch's .to())
 *   off: W outside [lo, hi]; tie: lo != hi; max_ulps: over the off elements whose expected value is finite,
 *   |W - expected| in ulps.
 * The P given (`prod`) is any fp64 product (any BLAS kernel, blocking or threads, a GPU's): it is within
 * 2 * gamma64_r * |L_i| * |R_j| of the fixed-order one. So each rounding is made at both ends of a margin m
 * (`margin`) that covers that difference and every fp64 rounding after it: where both ends round alike, that
 * is the fixed-order P's rounding too (rounding is monotone); where they do not (a value within m, ~1e-15
 * relative, of a rounding boundary), the fixed-order P is computed for that element. The counts are thus a
 * function of W, W0, the factors and s alone, whatever computed P: the same from any BLAS and on a GPU
 * (tensor_math.check_merged_values_bounded is this in torch).
 *
 * The pass over most elements is branch-free (`fast_*`: the compiler vectorizes it, with AVX2 / AVX-512
 * clones where the CPU has them; the same IEEE operations in every clone, -ffp-contract=off); a run of
 * SEGMENT elements with anything unusual in it (an element off, a rounding within the margin, a non-finite
 * bound) is done again element by element (`slow_*`), which also gives max_ulps.
 * W is bf16 or fp32 here (any other dtype: None, the torch path); W0 any of the four dtypes. */
static inline double round_w(double x, int code) {   /* branch-free, as bf16_from_f32 */
    float f = (float)x;
    if (code != BF16) return (double)f;
    uint32_t u = bits_from_f32(f);
    uint32_t r = (u + (((u >> 16) & 1u) + 0x7fffu)) & 0xffff0000u;
    uint32_t nan = -(uint32_t)((u & 0x7fffffffu) > 0x7f800000u);   /* (a mask, not a branch: vectorized) */
    return (double)f32_from_bits((r & ~nan) | (0x7fc00000u & nan));
}
static inline uint16_t bf16_from_f32(float f) {   /* c10's round_to_nearest_even */
    if (isnan(f)) return 0x7fc0;
    uint32_t u = bits_from_f32(f);
    return (uint16_t)((u + (((u >> 16) & 1u) + 0x7fffu)) >> 16);
}
static inline int64_t monotone_bits(double v, int code) {   /* tensor_math.ulps_apart's integer line */
    float f = (float)v;
    if (code == BF16) {
        int64_t b = (int16_t)bf16_from_f32(f);
        return b < 0 ? -(b + 32768) : b;
    }
    int64_t b = (int32_t)bits_from_f32(f);
    return b < 0 ? -(b + 2147483648LL) : b;
}

typedef struct {
    int64_t off, ties, max_ulps;
    int finite;
} ValueCheck;

typedef struct {
    double scale, abs_s, gamma;   /* s, |s|, gamma_r of fp32 */
    double k_prod, k_round;       /* the margin: m = (|L_i| |R_j|) k_prod + (|sp| + |x| + e) k_round + MARGIN_FLOOR */
    const double *left;           /* L's rows of the chunk, [rows, rank] */
    const double *right;          /* R, [rank, cols] */
    Py_ssize_t rank, cols;
} Ctx;

#define U32 5.9604644775390625e-08   /* 2^-24 */
#define SEGMENT 256
/* (subnormal results carry an absolute error of up to 2^-1075 per operation) */
#define MARGIN_FLOOR 0x1p-1060

static Ctx make_ctx(double scale, double gamma, const double *left, const double *right, Py_ssize_t rank,
                    Py_ssize_t cols) {
    Ctx c;
    double ru = (double)rank * 0x1p-53;
    c.scale = scale;
    c.abs_s = fabs(scale);
    c.gamma = gamma;
    /* |P_given - P_fixed| <= 2 gamma64_r |L_i| |R_j| (both within gamma64_r sum_k |L_ik R_kj| of the exact
     * product, for any order, FMA or not), doubled for the norms' own rounding; the roundings of sp, x, e and
     * x -/+ e move the result by at most 16 u64 (|sp| + |x| + e): doubled, 2^-48. */
    c.k_prod = 4.0 * c.abs_s * (ru / (1.0 - ru));
    c.k_round = 0x1p-48;
    c.left = left;
    c.right = right;
    c.rank = rank;
    c.cols = cols;
    return c;
}

static inline double canonical_p(const Ctx *c, Py_ssize_t row, Py_ssize_t col) {
    const double *l = c->left + row * c->rank;
    double p = 0.0;
    for (Py_ssize_t k = 0; k < c->rank; k++) p = p + l[k] * c->right[k * c->cols + col];
    return p;
}

static inline double load_w_bf16(const void *p, Py_ssize_t i) { return load_bf16(p, i); }
static inline double load_w_fp32(const void *p, Py_ssize_t i) { return load_fp32(p, i); }
static inline int64_t w_bits_bf16(const void *p, Py_ssize_t i) { return (int16_t)((const uint16_t *)p)[i]; }
static inline int64_t w_bits_fp32(const void *p, Py_ssize_t i) { return (int32_t)((const uint32_t *)p)[i]; }

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* One kernel pair per (W dtype, W0 dtype), the loads inlined. `fast`: elements [k0, k1) of one row (li its
 * |L_i|, rj[k] the |R_j| of element k), 1 when any element needs `slow`, else the ties added to *ties. */
#define DEFINE_VALUE_CHECK(WN, WCODE, BN)                                                          \
    VECTOR_CLONES                                                                                  \
    static int fast_##WN##_##BN(const void *w, const void *w0, const double *prod, const double *rj, \
                                double li, Py_ssize_t k0, Py_ssize_t k1, const Ctx *c,             \
                                int64_t *ties) {                                                   \
        const double s = c->scale, abs_s = c->abs_s, gamma = c->gamma;                             \
        const double kp = c->k_prod, kr = c->k_round;                                              \
        int64_t t = 0, bad = 0;                                                                    \
        for (Py_ssize_t k = k0; k < k1; k++) {                                                     \
            double sp = prod[k] * s;                                                               \
            double x = load_##BN(w0, k) + sp;                                                      \
            double lr = li * rj[k];                                                                \
            double mag = fabs(sp) + fabs(x);                                                       \
            double e = (mag * U32 + (lr * gamma) * abs_s) * 2.0;                                   \
            double m = (lr * kp + (mag + e) * kr) + MARGIN_FLOOR;                                  \
            double a = x - e, b = x + e;                                                           \
            double lo1 = round_w(a - m, WCODE), lo2 = round_w(a + m, WCODE);                       \
            double hi1 = round_w(b - m, WCODE), hi2 = round_w(b + m, WCODE);                       \
            double wv = load_w_##WN(w, k);                                                         \
            int64_t fine = (lo1 == lo2) & (hi1 == hi2) & (wv >= lo1) & (wv <= hi1) &               \
                           (fabs(lo1) <= DBL_MAX) & (fabs(hi1) <= DBL_MAX);                        \
            bad |= fine ^ 1;                                                                       \
            t += lo1 != hi1;                                                                       \
        }                                                                                          \
        if (bad) return 1;                                                                         \
        *ties += t;                                                                                \
        return 0;                                                                                  \
    }                                                                                              \
    static void slow_##WN##_##BN(const void *w, const void *w0, const double *prod, const double *rj, \
                                 double li, Py_ssize_t k0, Py_ssize_t k1, Py_ssize_t lrow,         \
                                 Py_ssize_t col0, const Ctx *c, ValueCheck *out) {                 \
        const double s = c->scale, abs_s = c->abs_s, gamma = c->gamma;                             \
        const int64_t top = WCODE == BF16 ? 32768 : 2147483648LL;                                  \
        for (Py_ssize_t k = k0; k < k1; k++) {                                                     \
            double w0v = load_##BN(w0, k);                                                         \
            double sp = prod[k] * s;                                                               \
            double x = w0v + sp;                                                                   \
            double lr = li * rj[k];                                                                \
            double mag = fabs(sp) + fabs(x);                                                       \
            double e = (mag * U32 + (lr * gamma) * abs_s) * 2.0;                                   \
            double m = (lr * c->k_prod + (mag + e) * c->k_round) + MARGIN_FLOOR;                   \
            double lo = round_w((x - e) - m, WCODE), hi = round_w((x + e) + m, WCODE), ex = lo;    \
            int sure = lo == round_w((x - e) + m, WCODE) && hi == round_w((x + e) - m, WCODE);     \
            if (sure && lo != hi) {                                                                \
                ex = round_w(x - m, WCODE);                                                        \
                sure = ex == round_w(x + m, WCODE);                                                \
            }                                                                                      \
            if (!sure) {   /* within the margin of a boundary: the fixed-order product decides */  \
                sp = canonical_p(c, lrow, col0 + (k - k0)) * s;                                    \
                x = w0v + sp;                                                                      \
                e = ((fabs(sp) + fabs(x)) * U32 + (lr * gamma) * abs_s) * 2.0;                     \
                lo = round_w(x - e, WCODE);                                                        \
                hi = round_w(x + e, WCODE);                                                        \
                ex = round_w(x, WCODE);                                                            \
            }                                                                                      \
            double wv = load_w_##WN(w, k);                                                         \
            if (lo != hi) out->ties++;                                                             \
            if (!isfinite(ex)) out->finite = 0;                                                    \
            if (!(wv >= lo && wv <= hi)) {                                                         \
                out->off++;                                                                        \
                if (!isfinite(ex)) continue;   /* (a NaN's bits are the kernel's choice) */        \
                int64_t wb = w_bits_##WN(w, k);                                                    \
                wb = wb < 0 ? -(wb + top) : wb;                                                    \
                int64_t d = wb - monotone_bits(ex, WCODE);                                         \
                if (d < 0) d = -d;                                                                 \
                if (d > out->max_ulps) out->max_ulps = d;                                          \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    static void value_check_##WN##_##BN(const void *w, const void *w0, const double *prod,         \
                                        Py_ssize_t n, const double *left_norms,                    \
                                        const double *right_norms, Py_ssize_t first,               \
                                        const Ctx *c, ValueCheck *out) {                           \
        out->off = out->ties = out->max_ulps = 0;                                                  \
        out->finite = 1;                                                                           \
        Py_ssize_t k = 0, cols = c->cols;                                                          \
        while (k < n) {                                                                            \
            Py_ssize_t row = (first + k) / cols, col = (first + k) % cols;                         \
            Py_ssize_t stop = k + (cols - col) < n ? k + (cols - col) : n;                         \
            const double li = left_norms[row];                                                     \
            const double *rj = right_norms + col - k;                                              \
            const Py_ssize_t k_row = k;                                                            \
            for (; k < stop; k += SEGMENT) {                                                       \
                Py_ssize_t end = k + SEGMENT < stop ? k + SEGMENT : stop;                          \
                if (fast_##WN##_##BN(w, w0, prod, rj, li, k, end, c, &out->ties))                  \
                    slow_##WN##_##BN(w, w0, prod, rj, li, k, end, row, col + (k - k_row), c, out); \
            }                                                                                      \
            k = stop;                                                                              \
        }                                                                                          \
    }

DEFINE_VALUE_CHECK(bf16, BF16, bf16)
DEFINE_VALUE_CHECK(bf16, BF16, fp16)
DEFINE_VALUE_CHECK(bf16, BF16, fp32)
DEFINE_VALUE_CHECK(bf16, BF16, fp64)
DEFINE_VALUE_CHECK(fp32, FP32, bf16)
DEFINE_VALUE_CHECK(fp32, FP32, fp16)
DEFINE_VALUE_CHECK(fp32, FP32, fp32)
DEFINE_VALUE_CHECK(fp32, FP32, fp64)

typedef void (*ValueKernel)(const void *, const void *, const double *, Py_ssize_t, const double *,
                            const double *, Py_ssize_t, const Ctx *, ValueCheck *);
static const ValueKernel VALUE_KERNELS[2][N_CODES] = {
    {value_check_bf16_bf16, value_check_bf16_fp16, value_check_bf16_fp32, value_check_bf16_fp64},
    {value_check_fp32_bf16, value_check_fp32_fp16, value_check_fp32_fp32, value_check_fp32_fp64},
};

static PyObject *py_value_check(PyObject *self, PyObject *args) {
    Py_buffer w, w0, prod, left_norms, right_norms, left, right;
    int w_code, w0_code;
    Py_ssize_t first, cols;
    double scale, gamma;
    if (!PyArg_ParseTuple(args, "y*iy*iy*y*y*y*y*nndd", &w, &w_code, &w0, &w0_code, &prod, &left_norms,
                          &right_norms, &left, &right, &first, &cols, &scale, &gamma))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = elements(&w, w_code);
    Py_ssize_t n0 = n >= 0 ? elements(&w0, w0_code) : -1;
    Py_ssize_t np = n0 >= 0 ? elements(&prod, FP64) : -1;
    Py_ssize_t nl = np >= 0 ? elements(&left_norms, FP64) : -1;
    Py_ssize_t nr = nl >= 0 ? elements(&right_norms, FP64) : -1;
    Py_ssize_t nf = nr >= 0 ? elements(&left, FP64) : -1;
    Py_ssize_t ng = nf >= 0 ? elements(&right, FP64) : -1;
    Py_ssize_t rank = ng > 0 && cols > 0 ? ng / cols : 0;
    if (ng >= 0 && (n0 != n || np != n || cols < 1 || nr != cols || first < 0 || rank < 1 || rank * cols != ng ||
                    nf != nl * rank || (n && (first + n - 1) / cols >= nl))) {
        PyErr_SetString(PyExc_ValueError, "value_check: the buffers do not describe one chunk of the block");
        ng = -1;
    }
    if (ng >= 0 && ((w_code != BF16 && w_code != FP32) || !readable(&w, w_code) || !readable(&w0, w0_code) ||
                    !readable(&prod, FP64) || !readable(&left_norms, FP64) || !readable(&right_norms, FP64) ||
                    !readable(&left, FP64) || !readable(&right, FP64))) {
        result = Py_NewRef(Py_None);
    } else if (ng >= 0) {
        ValueCheck vc;
        Ctx c = make_ctx(scale, gamma, (const double *)left.buf, (const double *)right.buf, rank, cols);
        Py_BEGIN_ALLOW_THREADS
        VALUE_KERNELS[w_code == FP32][w0_code](w.buf, w0.buf, (const double *)prod.buf, n,
                                               (const double *)left_norms.buf, (const double *)right_norms.buf,
                                               first, &c, &vc);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("LLLO", (long long)vc.off, (long long)vc.ties, (long long)vc.max_ulps,
                               vc.finite ? Py_True : Py_False);
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&w0);
    PyBuffer_Release(&prod);
    PyBuffer_Release(&left_norms);
    PyBuffer_Release(&right_norms);
    PyBuffer_Release(&left);
    PyBuffer_Release(&right);
    return result;
}

static PyMethodDef methods[] = {
    {"same_bytes", py_same_bytes, METH_VARARGS,
     "same_bytes(a, b) -> whether two C-contiguous buffers hold the same bytes (memcmp, GIL released)."},
    {"chunk_stats", py_chunk_stats, METH_VARARGS,
     "chunk_stats(w, w0, code) -> (changed, base_sq, delta_sq, nonfinite, max_abs, finite): one chunk pair "
     "of the same dtype (code: 0 bf16, 1 fp16, 2 fp32, 3 fp64), as compare.chunk_stats defines them; None for "
     "a buffer not aligned to its elements (use the torch path)."},
    {"base_sq", py_base_sq, METH_VARARGS,
     "base_sq(w0, code) -> sum of fp64(w0)^2 over every element (non-finite where inf/nan are), in the "
     "same order as chunk_stats's; None for a buffer not aligned to its elements."},
    {"block_stats", py_block_stats, METH_VARARGS,
     "block_stats(w, w0, code, chunk, skip_identical) -> a list of chunk_stats tuples, one per chunk of `chunk` "
     "elements (an identical chunk's from base_sq alone when skip_identical), None when skip_identical and every "
     "chunk is identical, or None for a buffer not aligned to its elements (use the torch path)."},
    {"value_check", py_value_check, METH_VARARGS,
     "value_check(w, w_code, w0, w0_code, prod, left_norms, right_norms, left, right, first, cols, scale, gamma) "
     "-> (off, ties, max_ulps, finite): core.tensor_math.check_merged_values over one chunk (elements [first, "
     "first + n) of a row block whose rows of L and their norms are left and left_norms; R [rank, cols]), for any "
     "fp64 P given; None where W is not bf16 or fp32 or a buffer is not aligned (use the torch path)."},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialization (no state), like io/pickle_scan_c.c: loadable again in one process. */
static PyModuleDef_Slot slots[] = {{0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "delta_stats_c", NULL, 0, methods, slots, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_delta_stats_c(void) { return PyModuleDef_Init(&module); }
