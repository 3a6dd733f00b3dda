/* An FP8 row block's quantization error in one pass (`ckpt_tools.core.fp8_error_c`).
 *
 * `core/fp8.py: reference_error_sq` defines the figure with torch and numpy: ||deq(q) - W32||^2 over a row
 * block, as the sum over its 128x128 blocks of ||scale * (decode(q) - W32 / scale)||^2, where W32 / scale is
 * the clamped value the codes were cast from (the cast itself, the one rounding, stays torch's). That is
 * four passes over the block's fp32 values (a 256-entry table lookup, a subtraction, the scale, a dot
 * product), with a full-size temporary, about 40% of an `--dtype fp8` merge's arithmetic. Here the values
 * and the codes are read once, with the GIL released, and nothing is allocated.
 *
 * Same operations per element as the reference: d = decode(q) - x and d * scale in fp32 (decode is exact:
 * every e4m3fn code but NaN is an fp32 value); the sum of squares is in fp64 here (the reference sums in
 * fp32), in a fixed order: element (r, c) goes to accumulator c % LANES of its row, each row's LANES sums
 * are added to the block's, and those LANES in one fixed tree at the end; the vector path (SSE2) keeps the
 * scalar path's lanes and order, so both give the same bits. No -ffast-math and no fused multiply-add (setup.py passes
 * -ffp-contract=off): the result depends on the block alone, never on the thread or the machine's vector
 * width (tests/test_fp8_error_c.py runs every path). A NaN code (0x7f, 0xff: never cast from a clamped finite value) makes it answer None, and the
 * reference decides.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_AVX2_PATH 1 /* compiled for any x86-64, taken where the CPU has AVX2 (no FMA: never enabled) */
#endif

#define LANES 8   /* element (r, c) is summed in accumulator c % LANES */
#define BLOCK 128 /* weight_block_size [128, 128] */

static inline float f32_from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* The fp32 value of an e4m3fn code (bias 7, 3 mantissa bits, subnormals m * 2^-9): the exponent and
 * mantissa moved to fp32's fields and rebiased; a subnormal comes out of one exact subtraction
 * (2^-6 * (1 + m/8) - 2^-6). Checked on all 256 codes against torch's conversion. */
static inline float decode(uint8_t q) {
    uint32_t o = (uint32_t)(q & 0x7f) << 20;
    float v;
    if ((o & 0x07800000u) == 0) {
        v = f32_from_bits(o + (121u << 23)) - f32_from_bits(121u << 23);
    } else {
        v = f32_from_bits(o + (120u << 23));
    }
    return (q & 0x80) ? -v : v;
}

#ifdef __SSE2__
/* decode() on 4 lanes (codes already widened to 32 bits), the branch as a mask. */
static inline __m128 v_decode(__m128i q) {
    __m128i o = _mm_slli_epi32(_mm_and_si128(q, _mm_set1_epi32(0x7f)), 20);
    __m128i sub = _mm_cmpeq_epi32(_mm_and_si128(o, _mm_set1_epi32(0x07800000)), _mm_setzero_si128());
    __m128 normal = _mm_castsi128_ps(_mm_add_epi32(o, _mm_set1_epi32(120 << 23)));
    __m128 small = _mm_sub_ps(_mm_castsi128_ps(_mm_add_epi32(o, _mm_set1_epi32(121 << 23))),
                              _mm_castsi128_ps(_mm_set1_epi32(121 << 23)));
    __m128 v = _mm_or_ps(_mm_andnot_ps(_mm_castsi128_ps(sub), normal), _mm_and_ps(_mm_castsi128_ps(sub), small));
    return _mm_or_ps(v, _mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(q, _mm_set1_epi32(0x80)), 24)));
}

/* Adds (s * (decode(q[k]) - x[k]))^2 for k in [0, 8) to acc[0..3] (lanes k / 2, k % 2); returns a mask
 * that is non-zero where a code is NaN. */
static inline int v_step(const float *x, const uint8_t *q, float s, __m128d *acc) {
    __m128i b = _mm_loadl_epi64((const __m128i *)q), z = _mm_setzero_si128();
    __m128i nan = _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f));
    __m128i w = _mm_unpacklo_epi8(b, z);
    __m128 vs = _mm_set1_ps(s);
    __m128 d0 = _mm_mul_ps(_mm_sub_ps(v_decode(_mm_unpacklo_epi16(w, z)), _mm_loadu_ps(x)), vs);
    __m128 d1 = _mm_mul_ps(_mm_sub_ps(v_decode(_mm_unpackhi_epi16(w, z)), _mm_loadu_ps(x + 4)), vs);
    __m128d e[4] = {_mm_cvtps_pd(d0), _mm_cvtps_pd(_mm_movehl_ps(d0, d0)), _mm_cvtps_pd(d1),
                    _mm_cvtps_pd(_mm_movehl_ps(d1, d1))};
    for (int k = 0; k < 4; k++) acc[k] = _mm_add_pd(acc[k], _mm_mul_pd(e[k], e[k]));
    return _mm_movemask_epi8(nan) & 0xff;
}
#endif

#ifdef HAVE_AVX2_PATH
/* One row's elements [0, c rounded down to LANES) into part[0..LANES) (element j into lane j % LANES, as
 * the SSE2 and scalar paths add them, in the same order: the same bits); returns the count done, and sets
 * *nan where a code is NaN. */
__attribute__((target("avx2"))) static Py_ssize_t row_avx2(const float *x, const uint8_t *q, const float *sr,
                                                            Py_ssize_t c, double *part, int *nan) {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m128i nans = _mm_setzero_si128();
    Py_ssize_t j = 0;
    for (; j + LANES <= c; j += LANES) {
        __m128i b = _mm_loadl_epi64((const __m128i *)(q + j));
        nans = _mm_or_si128(nans, _mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7f)), _mm_set1_epi8(0x7f)));
        __m256i w = _mm256_cvtepu8_epi32(b);
        __m256i o = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7f)), 20);
        __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(o, _mm256_set1_epi32(0x07800000)), _mm256_setzero_si256());
        __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(o, _mm256_set1_epi32(120 << 23)));
        __m256 small = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_add_epi32(o, _mm256_set1_epi32(121 << 23))),
                                     _mm256_castsi256_ps(_mm256_set1_epi32(121 << 23)));
        __m256 v = _mm256_blendv_ps(normal, small, _mm256_castsi256_ps(sub));
        v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24)));
        __m256 d = _mm256_mul_ps(_mm256_sub_ps(v, _mm256_loadu_ps(x + j)), _mm256_set1_ps(sr[j / BLOCK]));
        __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(d)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(lo, lo));
        a1 = _mm256_add_pd(a1, _mm256_mul_pd(hi, hi));
    }
    _mm256_storeu_pd(part, a0);
    _mm256_storeu_pd(part + 4, a1);
    *nan |= _mm_movemask_epi8(nans) != 0;
    return j;
}
#endif

/* The vector paths: 0 none (scalar), 1 SSE2, 2 AVX2; the best this build and CPU have. */
static int best_path(void) {
#ifdef HAVE_AVX2_PATH
    if (__builtin_cpu_supports("avx2")) return 2;
#endif
#ifdef __SSE2__
    return 1;
#else
    return 0;
#endif
}

/* The sum over rows [0, n) x cols [0, c) of a row block whose first row starts a scale row; `scales`
 * holds the block's scale rows (ceil(n / 128) x ceil(c / 128)). Returns -1 where a code is NaN. */
static double error_sq(const float *x, const uint8_t *q, const float *scales, Py_ssize_t n, Py_ssize_t c,
                       int path) {
    double acc[LANES] = {0};
    Py_ssize_t gc = (c + BLOCK - 1) / BLOCK;
    int nan = 0;
    for (Py_ssize_t r = 0; r < n; r++) {
        const float *xr = x + r * c, *sr = scales + (r / BLOCK) * gc;
        const uint8_t *qr = q + r * c;
        double part[LANES] = {0};
        Py_ssize_t j = 0;
#ifdef HAVE_AVX2_PATH
        if (path == 2) j = row_avx2(xr, qr, sr, c, part, &nan);
#endif
#ifdef __SSE2__
        if (path == 1) {
            __m128d va[4];
            for (int k = 0; k < 4; k++) va[k] = _mm_setzero_pd();
            for (; j + LANES <= c; j += LANES) nan |= v_step(xr + j, qr + j, sr[j / BLOCK], va);
            for (int k = 0; k < 4; k++) _mm_storeu_pd(part + 2 * k, va[k]);
        }
#endif
        for (; j < c; j++) {
            nan |= (qr[j] & 0x7f) == 0x7f;
            float d = (decode(qr[j]) - xr[j]) * sr[j / BLOCK];
            part[j % LANES] += (double)d * (double)d;
        }
        for (int k = 0; k < LANES; k++) acc[k] += part[k];
    }
    if (nan) return -1.0;
    return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

static PyObject *py_error_sq(PyObject *self, PyObject *args) {
    Py_buffer x, q, s;
    Py_ssize_t n, c;
    int path = -1;
    if (!PyArg_ParseTuple(args, "y*y*y*nn|i", &x, &q, &s, &n, &c, &path)) return NULL;
    PyObject *result = NULL;
    int best = best_path();
    if (path < 0 || path > best) path = best;
    Py_ssize_t gr = (n + BLOCK - 1) / BLOCK, gc = (c + BLOCK - 1) / BLOCK;
    if (n < 0 || c < 0 || x.len != n * c * 4 || q.len != n * c || s.len != gr * gc * 4) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd, %zd and %zd bytes for a %zd x %zd block", x.len, q.len,
                     s.len, n, c);
    } else if (!PyBuffer_IsContiguous(&x, 'C') || !PyBuffer_IsContiguous(&q, 'C') ||
               !PyBuffer_IsContiguous(&s, 'C') || (uintptr_t)x.buf % 4 || (uintptr_t)s.buf % 4) {
        result = Py_NewRef(Py_None);
    } else {
        double got;
        Py_BEGIN_ALLOW_THREADS
        got = error_sq((const float *)x.buf, (const uint8_t *)q.buf, (const float *)s.buf, n, c, path);
        Py_END_ALLOW_THREADS
        result = got < 0 ? Py_NewRef(Py_None) : PyFloat_FromDouble(got);
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&q);
    PyBuffer_Release(&s);
    return result;
}

static PyObject *py_decode_all(PyObject *self, PyObject *noargs) {
    PyObject *out = PyList_New(256);
    if (out == NULL) return NULL;
    for (int k = 0; k < 256; k++) {
        PyObject *v = PyFloat_FromDouble((double)decode((uint8_t)k));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}

static PyObject *py_best_path(PyObject *self, PyObject *noargs) { return PyLong_FromLong(best_path()); }

static PyMethodDef methods[] = {
    {"error_sq", py_error_sq, METH_VARARGS,
     "error_sq(x, codes, scales, n, c, path=-1) -> sum of (scale * (decode(q) - x))^2 over an n x c row block "
     "(x: the clamped fp32 values the codes were cast from; scales: its ceil(n/128) x ceil(c/128) scale rows), in "
     "fp64; None for a misaligned buffer or a NaN code (use the reference). path: 0 scalar, 1 SSE2, 2 AVX2, -1 "
     "(or one this build or CPU lacks) the best there is; every path gives the same bits."},
    {"best_path", py_best_path, METH_NOARGS, "best_path() -> the vector path error_sq takes: 0 scalar, 1 SSE2, 2 AVX2."},
    {"decode_all", py_decode_all, METH_NOARGS,
     "decode_all() -> the kernel's fp32 value of each of the 256 e4m3fn codes (NaN codes as it reads them)."},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialization (no state), like io/pickle_scan_c.c: loadable again in one process. */
static PyModuleDef_Slot slots[] = {{0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fp8_error_c", NULL, 0, methods, slots, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_fp8_error_c(void) { return PyModuleDef_Init(&module); }
