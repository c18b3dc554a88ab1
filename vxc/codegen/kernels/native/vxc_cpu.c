/* vxc's native CPU kernels: the decode-time hot loops of the torch twins, one pass over memory each.
 *
 * Built at first use by ``vxc/codegen/kernels/native.py`` with the host compiler (-O3 -march=native
 * -fopenmp) and loaded after torch, so its OpenMP regions share torch's libgomp thread pool (same soname).
 * Every function mirrors a torch twin (the oracle the tests compare against): fp32
 * arithmetic, results rounded once to the output dtype (bf16: round to nearest even, as torch does).
 * Activations are bf16 (``bf = 1``) or fp32 (``bf = 0``); recurrent state is fp32. Batch 1, contiguous rows.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

/* read prefetch of the n bytes from p into every cache level (prefetcht0), one per 64-byte line: the kernels that
 * stream memory fetch what they read next with it. __builtin_prefetch, not _mm_prefetch: every build has it (the
 * plain fallback build includes no immintrin.h); a prefetch past a buffer's end is a hint that cannot fault. */
static inline __attribute__((always_inline)) void prefetch_bytes(const void *p, long n) {
    for (long i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}
/* prefetch_bytes into L2 (``_MM_HINT_T1``) where how == 2, into L1 otherwise (the packed tiles' ``pf``) */
static inline __attribute__((always_inline)) void prefetch_tile(const void *p, long n, int how) {
    if (how == 2)
        for (long i = 0; i < n; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
    else
        prefetch_bytes(p, n);
}


static inline float bf2f(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

static inline float ld(const void *p, long i, int bf) {
    return bf ? bf2f(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void st(void *p, long i, float v, int bf) {
    if (bf) ((bf16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    if (e == 0x1f) u = s | 0x7f800000u | (m << 13);
    else if (e) u = s | ((e + 112u) << 23) | (m << 13);
    else {
        float f = (float)m * 5.9604644775390625e-8f; /* a subnormal half: m 2^-24, exact */
        return s ? -f : f;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* fp32 -> f16, rounded to nearest even (as torch's cast): F16C's vcvtps2ph, or the same rounding by hand */
static inline uint16_t f2h(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN stays NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* from halfway past 65504: inf */
    if (ax < 0x38800000u) { /* below 2^-14: a subnormal half, m 2^-24 (the scaling is exact, rint rounds to even) */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f));
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu), rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++; /* a carry into the exponent is still right */
    return (uint16_t)(sign | h);
#endif
}

/* a KV cache's element type (``kt``): 0 fp32, 1 bf16, 2 f16 — the cache may be narrower than the activations */
static inline long kt_size(int kt) { return kt ? 2 : 4; }

static inline float ldk(const void *p, long i, int kt) {
    return kt == 2 ? h2f((const uint8_t *)p + 2 * i) : kt == 1 ? bf2f(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void stk(void *p, long i, float v, int kt) {
    if (kt == 2) ((uint16_t *)p)[i] = f2h(v);
    else if (kt == 1) ((bf16_t *)p)[i] = f2bf(v);
    else ((float *)p)[i] = v;
}

#if defined(__AVX512F__)
/* 16 cache elements from element i, widened to fp32 (exact for every kt) */
static inline __attribute__((always_inline)) __m512 ldk16(const void *p, long i, int kt) {
    if (kt == 0) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (kt == 2) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* dst[0..n) = cache elements off.. of type kt widened to fp32 (exact) */
static inline void widen_row(float *dst, const void *src, long off, long n, int kt) {
    long i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, ldk16(src, off + i, kt));
#endif
    for (; i < n; i++) dst[i] = ldk(src, off + i, kt);
}

/* n activations (bf: their dtype) written as cache elements of type kt: a copy when the types agree */
static inline void put_row(void *dst, const void *src, long n, int bf, int kt) {
    if (kt == bf) memcpy(dst, src, (size_t)(n * kt_size(kt)));
    else
        for (long i = 0; i < n; i++) stk(dst, i, ld(src, i, bf), kt);
}

/* round through the activation dtype (a value the torch twin materialises at x.dtype) */
static inline float rnd(float v, int bf) { return bf ? bf2f(f2bf(v)) : v; }

/* exp for the activations, written so that ``omp simd`` loops vectorise it (libm's expf is a scalar call):
 * exp(x) = 2^n e^r, n = round(x log2 e), r = x - n ln 2 (two-part ln 2), e^r by the Cephes degree-6 polynomial.
 * Within 2 ulp of expf over [-87, 88]; the input is clamped there (exp(-87) ~ 1.6e-38: the activations using
 * it saturate long before). */
#pragma omp declare simd notinbranch
static inline float vexp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

#pragma omp declare simd notinbranch
static inline float silu(float v) { return v / (1.0f + vexp(-v)); }
#pragma omp declare simd notinbranch
static inline float sigm(float v) { return 1.0f / (1.0f + vexp(-v)); }
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }
static inline float act(float v, int a) { return a == 1 ? silu(v) : a == 2 ? sigm(v) : v; }

/* act over a row, in place (vectorised) */
static inline void act_row(float *v, long n, int a) {
    if (a == 1) {
#pragma omp simd
        for (long i = 0; i < n; i++) v[i] = silu(v[i]);
    } else if (a == 2) {
#pragma omp simd
        for (long i = 0; i < n; i++) v[i] = sigm(v[i]);
    }
}

/* The ABI version: bumped whenever a function's signature or meaning changes (native.py reads it from here
 * and checks the loaded library's vxc_abi_version() against it). */
#define VXC_ABI_VERSION 59


int vxc_abi_version(void) { return VXC_ABI_VERSION; }

/* ---------------------------------------------------------------------------------------------------------
 * A replayed step's calls run from C (vxc/runtime/replay.py): each call is a function of this library, its integer-
 * class arguments (pointers, sizes, flags) in order in iv and its float arguments in order in fv. On x86-64 System V
 * a call that passes the first six integer-class arguments in registers and the rest on the stack in order, and the
 * float ones in xmm0.. in order, gives a callee the same values whatever it declares beyond them, so every kernel is
 * called through one prototype of PROG_NI integers and PROG_NF floats (a callee reads what it declares; the caller
 * pops the rest). Arguments that move with the position (moving: slot mi[k] = base[k] + slope[k] * pos) are set
 * first. The step's ctypes calls had cost ~0.6-1.5 us each, ~300-450 a step. */
#define PROG_NI 32
#define PROG_NF 8
#define PROG_NM 4
typedef struct {
    void *fn;
    int64_t iv[PROG_NI];
    float fv[PROG_NF];
    int32_t nm;
    int32_t mi[PROG_NM];
    int64_t base[PROG_NM], slope[PROG_NM];
} vxc_prog_call;

typedef void (*prog_fn)(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                        int64_t, int64_t, float, float, float, float, float, float, float, float);

/* the layout the Python side fills: 0 the bytes of one call, 1-5 the offsets of fv, nm, mi, base, slope, 6-8 the
 * numbers of integer / float / moving slots, 9 the offset of iv */
long vxc_program_layout(int what) {
    switch (what) {
    case 0: return (long)sizeof(vxc_prog_call);
    case 1: return (long)offsetof(vxc_prog_call, fv);
    case 2: return (long)offsetof(vxc_prog_call, nm);
    case 3: return (long)offsetof(vxc_prog_call, mi);
    case 4: return (long)offsetof(vxc_prog_call, base);
    case 5: return (long)offsetof(vxc_prog_call, slope);
    case 9: return (long)offsetof(vxc_prog_call, iv);
    default: return (what == 6 ? PROG_NI : what == 7 ? PROG_NF : what == 8 ? PROG_NM : -1);
    }
}

#if defined(__x86_64__) && !defined(_WIN32)
static inline __attribute__((always_inline)) void prog_call(vxc_prog_call *k, long pos) {
    for (int m = 0; m < k->nm; m++) k->iv[k->mi[m]] = k->base[m] + k->slope[m] * pos;
    const int64_t *v = k->iv;
    const float *f = k->fv;
    ((prog_fn)k->fn)(v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[12], v[13], v[14],
                     v[15], v[16], v[17], v[18], v[19], v[20], v[21], v[22], v[23], v[24], v[25], v[26], v[27],
                     v[28], v[29], v[30], v[31], f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7]);
}
#endif

void vxc_run_program(vxc_prog_call *calls, long n, long pos) {
#if defined(__x86_64__) && !defined(_WIN32)
    for (long c = 0; c < n; c++) prog_call(calls + c, pos);
#else
    (void)calls; (void)n; (void)pos;
#endif
}

/* vxc_run_program that adds each call's wall time (CLOCK_MONOTONIC, ns) to ns[c]: the decode step profile (one
 * clock read a call, ~20-30 ns through the vDSO) */
void vxc_run_program_timed(vxc_prog_call *calls, long n, long pos, int64_t *ns) {
#if defined(__x86_64__) && !defined(_WIN32)
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long c = 0; c < n; c++) {
        prog_call(calls + c, pos);
        clock_gettime(CLOCK_MONOTONIC, &b);
        ns[c] += (int64_t)(b.tv_sec - a.tv_sec) * 1000000000 + (b.tv_nsec - a.tv_nsec);
        a = b;
    }
#else
    (void)calls; (void)n; (void)pos; (void)ns;
#endif
}

/* whether vxc_run_program can run this build's kernels (the calling convention above) */
int vxc_program_supported(void) {
#if defined(__x86_64__) && !defined(_WIN32)
    return 1;
#else
    return 0;
#endif
}

/* The thread count of the calling thread's next parallel regions (the decode replay's thread governor), and the
 * count it starts from (OMP_NUM_THREADS, else the CPUs available). No kernel's result depends on it: every
 * parallel loop gives each output element to one thread and reduces within it, in a fixed order. */
void vxc_set_threads(int n) { omp_set_num_threads(n > 0 ? n : 1); }
int vxc_max_threads(void) { return omp_get_max_threads(); }

int vxc_has_avx512bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------ shared: GEMV dot products */

/* One weight row's dot product with x: one accumulator, 32 bf16 (16 fp32) values a step in order, the masked
 * tail last, then the 16 lanes reduced. A block's rows are read one after another (one linear stream per thread):
 * on an AMD EPYC Zen 4 (2 threads, the 197 qwen3-0.6b-shaped bf16 matrices and the head, 1.19 GB, interleaved
 * sweeps in one process) 48.7 / 43.5 GB/s with four interleaved rows where K > 2048 and four accumulators with a
 * 4 KB-ahead prefetch below, 61.0 / 54.1 this way; two or four accumulators a row measured 51.5-59.2 and 48.7-53.8,
 * four interleaved rows 30.4. The software prefetch (a line DOT1_PF bytes ahead each step) is on where it was
 * measured to help, an Intel Xeon (a 4 KB-ahead prefetch took the bf16 sweep from 16.8 to 21.4 GB/s), and off on
 * AMD CPUs, where it cost 3-5 %: ``row_prefetch``, set once at load. It changes no value. */
#ifndef DOT1_PF
#define DOT1_PF 4096
#endif
static int row_prefetch = 1;
/* The fp32 row on AMD: the same line fetched into L2 instead (``_MM_HINT_T1``), measured to help there: the 168
 * qwen3-0.6b-shaped fp32 matrices of 28 layers (1.76 GB), Zen 4, 2 threads, interleaved, best of 6: 38.7-39.5 ms
 * without a prefetch, 39.7-41.0 into L1, 32.4-33.1 into L2 2 or 4 KB ahead (42.3 8 KB ahead); the bf16 row got
 * slower with it (18.3 -> 21.5 ms), so it stays without. */
static int f32_prefetch_l2 = 0;
__attribute__((constructor)) static void vxc_tune_init(void) {
    __builtin_cpu_init();
    row_prefetch = !__builtin_cpu_is("amd");
    f32_prefetch_l2 = __builtin_cpu_is("amd");
}

static inline float dot1_bf16(const bf16_t *w, const bf16_t *x, long K) {
#if defined(__AVX512BF16__)
    __m512 a = _mm512_setzero_ps();
    long k = 0;
    if (row_prefetch) {
        for (; k + 32 <= K; k += 32) {
            _mm_prefetch((const char *)(w + k) + DOT1_PF, _MM_HINT_T0);
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(w + k)), (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
        }
    } else {
        /* two steps an iteration (the same chain, the same order): built as one step an iteration beside the
         * batched blocks of c2e8bbd, this sweep measured 4-15 % slower than the same source built before them (a
         * code-layout effect, the same instructions at other addresses; in-process A/B, 48 Mamba2-780m-shaped
         * layers); unrolled by two it matched the old build (28.6-43.3 against 28.6-43.3 ms); by four or eight it
         * did not (47.5-49.4 against 41.3-41.6). */
#pragma GCC unroll 2
        for (; k + 32 <= K; k += 32)
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(w + k)), (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k), (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
    }
    return _mm512_reduce_add_ps(a);
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long k = 0; k < K; k++) s += bf2f(w[k]) * bf2f(x[k]);
    return s;
#endif
}

static inline float dot1_f32(const float *w, const float *x, long K) {
#if defined(__AVX512F__)
    __m512 a = _mm512_setzero_ps();
    long k = 0;
    if (f32_prefetch_l2) {
        for (; k + 16 <= K; k += 16) {
            _mm_prefetch((const char *)(w + k) + DOT1_PF, _MM_HINT_T1);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
        }
    } else if (row_prefetch) {
        for (; k + 16 <= K; k += 16) {
            _mm_prefetch((const char *)(w + k) + DOT1_PF, _MM_HINT_T0);
            a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
        }
    } else {
        for (; k + 16 <= K; k += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(w + k), _mm512_loadu_ps(x + k), a);
    }
    if (k < K) {
        __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w + k), _mm512_maskz_loadu_ps(m, x + k), a);
    }
    return _mm512_reduce_add_ps(a);
#else
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (long k = 0; k < K; k++) s += w[k] * x[k];
    return s;
#endif
}

static inline void dot4(const void *W, const void *x, long n0, long K, long rows, int bf, float acc[4]) {
    for (long r = 0; r < rows; r++)
        acc[r] = bf ? dot1_bf16((const bf16_t *)W + (n0 + r) * K, (const bf16_t *)x, K)
                    : dot1_f32((const float *)W + (n0 + r) * K, (const float *)x, K);
}

/* ------------------------------------------------------------------------------------------- shared: rows */

static inline void load_row(const void *p, long off, long D, int bf, float *dst) {
    if (bf) {
        const bf16_t *src = (const bf16_t *)p + off;
#pragma omp simd
        for (long i = 0; i < D; i++) dst[i] = bf2f(src[i]);
    } else {
        memcpy(dst, (const float *)p + off, (size_t)D * sizeof(float));
    }
}

static inline void store_row(void *p, long off, long D, int bf, const float *src) {
    if (bf) {
        bf16_t *dst = (bf16_t *)p + off;
#pragma omp simd
        for (long i = 0; i < D; i++) dst[i] = f2bf(src[i]);
    } else {
        memcpy((float *)p + off, src, (size_t)D * sizeof(float));
    }
}

/* 1/sqrt(mean(v²) + eps) with the sum and the root in fp64: the normalised values then carry one rounding (the
 * final cast), so the native norms are at least as close to the exact norm as the fp32 references' are. Random
 * miniatures amplify a norm's ulp-level differences into logit differences of the order of the numerical floor
 * (an fp32 sum of squares put gpt_oss-mxfp4's logits 2.4x the floor from fp64 on one CPU and not another). The
 * residual-add norm then rounds as the references do, twice (the normalised row, its product with w): rounding
 * r * inv * w once in fp64 put a Qwen3-Next miniature at 2.6x the floor on an Intel CPU (1.2x this way) and a
 * mixed-block Kimi-Linear file at 2.1-2.9x (1.5x): closer to exact per call, but apart from the references' own
 * rounding pattern, which the floor measures. */
static inline double rms_inv(const float *v, long n, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) ss += (double)v[i] * (double)v[i];
    return 1.0 / sqrt(ss / (double)n + (double)eps);
}

/* torch's fp32 row sum (aten/src/ATen/native/cpu/SumKernel.cpp, as torch 2.x on x86 runs it: the AVX2 build of
 * the kernel, 8-lane vectors, whatever ATEN_CPU_CAPABILITY says), reproduced so that a norm's sum of squares is the
 * reference's to the bit. ``cascade_rows``: torch's multi_row_sum over ``size`` rows of ``width`` values (row i at
 * q + i * width), summed column-wise in four cascade levels that fold every 2^level_power rows. */
static void cascade_rows(const float *q, long size, int width, float *out) {
    long lp = 1;
    if (size > 2) for (lp = 0; (1L << lp) < size; lp++) {} /* CeilLog2 */
    lp = lp / 4 < 4 ? 4 : lp / 4;
    const long step = 1L << lp, mask = step - 1;
    float acc[4][32];
    memset(acc, 0, sizeof acc);
    long i = 0;
    while (i + step <= size) {
        for (long j = 0; j < step; j++, i++)
            for (int k = 0; k < width; k++) acc[0][k] += q[i * width + k];
        for (int j = 1; j < 4; j++) {
            for (int k = 0; k < width; k++) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = 0.0f; }
            if ((i & (mask << (j * lp))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < width; k++) acc[0][k] += q[i * width + k];
    for (int j = 1; j < 4; j++)
        for (int k = 0; k < width; k++) acc[0][k] += acc[j][k];
    memcpy(out, acc[0], (size_t)width * sizeof(float));
}

/* torch's sum of the n values q: rows of 8 of at least 8 (vectorized_inner_sum: four vectors of 8 lanes per
 * cascade row, the leftover vectors into the first, the four folded in order, then the scalar tail and the 8 lanes
 * in order), else row_sum over rows of four scalars. */
static float torch_sum_f32(const float *q, long n) {
    float ps[32];
    if (n >= 8) {
        long nv = n / 8, rows = nv / 4;
        cascade_rows(q, rows, 32, ps);
        for (long v = rows * 4; v < nv; v++)
            for (int l = 0; l < 8; l++) ps[l] += q[v * 8 + l];
        for (int k = 1; k < 4; k++)
            for (int l = 0; l < 8; l++) ps[l] += ps[k * 8 + l];
        float s = 0.0f;
        for (long k = nv * 8; k < n; k++) s += q[k];
        for (int l = 0; l < 8; l++) s += ps[l];
        return s;
    }
    long rows = n / 4;
    cascade_rows(q, rows, 4, ps);
    for (long k = rows * 4; k < n; k++) ps[0] += q[k];
    return ps[0] + ps[1] + ps[2] + ps[3];
}

/* 1 / sqrt(mean(v^2) + eps) as an fp32 reference norm computes it (``r.pow(2).mean(-1) + eps``, then ``rsqrt``):
 * each square rounded to fp32 (stored in sq, n floats of scratch: no multiply-add contraction into the sum),
 * torch's sum of them, divided by n, eps added, then 1 / sqrtf (torch.rsqrt's rounding). The row is then scaled
 * by this fp32 factor in fp32, as the reference scales it, so the norm is the reference's to the bit (an fp64
 * scale, more exact, differed from it by an ulp in ~15 % of the values, and on a Kimi-Linear miniature with Q4/Q5
 * weights those roundings grew to 2.4x the reference's own fp32 error in the logits on an AMD Zen 4). */
static float rms_inv_f32(const float *v, float *sq, long n, float eps) {
#pragma omp simd
    for (long i = 0; i < n; i++) sq[i] = v[i] * v[i];
    float mean = torch_sum_f32(sq, n) / (float)n;
    return 1.0f / sqrtf(mean + eps);
}

static inline void round_row(float *v, long D) {
#pragma omp simd
    for (long i = 0; i < D; i++) v[i] = bf2f(f2bf(v[i]));
}

/* acc[i] += a * row[off + i] and the dot x . row[off ..], over a row stored as bf16 (bf) or fp32, vectorised */
static inline void axpy_row(float *acc, float a, const void *row, long off, long n, int bf) {
    if (bf) {
        const bf16_t *r = (const bf16_t *)row + off;
#pragma omp simd
        for (long i = 0; i < n; i++) acc[i] += a * bf2f(r[i]);
    } else {
        const float *r = (const float *)row + off;
#pragma omp simd
        for (long i = 0; i < n; i++) acc[i] += a * r[i];
    }
}

static inline float dot_row(const float *x, const void *row, long off, long n, int bf) {
    float s = 0.0f;
    if (bf) {
        const bf16_t *r = (const bf16_t *)row + off;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < n; i++) s += x[i] * bf2f(r[i]);
    } else {
        const float *r = (const float *)row + off;
#pragma omp simd reduction(+ : s)
        for (long i = 0; i < n; i++) s += x[i] * r[i];
    }
    return s;
}

/* axpy_row / dot_row over a KV cache row of element type kt (f16 too) */
static inline void axpyk_row(float *acc, float a, const void *row, long off, long n, int kt) {
    if (kt != 2) {
        axpy_row(acc, a, row, off, n, kt);
        return;
    }
    const uint8_t *r = (const uint8_t *)row + 2 * off;
    for (long i = 0; i < n; i++) acc[i] += a * h2f(r + 2 * i);
}

static inline float dotk_row(const float *x, const void *row, long off, long n, int kt) {
    if (kt != 2) return dot_row(x, row, off, n, kt);
    const uint8_t *r = (const uint8_t *)row + 2 * off;
    float s = 0.0f;
    for (long i = 0; i < n; i++) s += x[i] * h2f(r + 2 * i);
    return s;
}

/* --------------------------------------------------------------------------------------- dense (dense.py) */

/* the linear twin for one row: y[n] = W[n] . x (+ bias[n]), fp32 accumulation, W [N, K] row-major in the
 * activation dtype; the product is rounded to that dtype before the bias is added (as the twin's mv + add). */
void vxc_gemv(const void *W, const void *x, const void *bias, void *y, long N, long K, int bf) {
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 4) {
        long rows = N - n0 < 4 ? N - n0 : 4;
        float acc[4];
        dot4(W, x, n0, K, rows, bf, acc);
        for (long r = 0; r < rows; r++) {
            float v = rnd(acc[r], bf);
            if (bias) v += ld(bias, n0 + r, bf);
            st(y, n0 + r, v, bf);
        }
    }
}

/* The first half of the swiglu twin for one row: h[n] = silu(Wg[n] . x) * (Wu[n] . x), each product and
 * the activation rounded to the activation dtype as the twin materialises them. */
void vxc_swiglu_up(const void *Wg, const void *Wu, const void *x, void *h, long N, long K, int bf) {
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 4) {
        long rows = N - n0 < 4 ? N - n0 : 4;
        float g[4], u[4];
        dot4(Wg, x, n0, K, rows, bf, g);
        dot4(Wu, x, n0, K, rows, bf, u);
        for (long r = 0; r < rows; r++) st(h, n0 + r, rnd(silu(rnd(g[r], bf)), bf) * rnd(u[r], bf), bf);
    }
}

/* The batched GEMV (a decode step of T sequences, 4 <= T <= 16 rows of x against one weight block of 4 rows at a
 * time) fetches the NEXT block of weight rows into L2 while it computes on this one (``_MM_HINT_T1``, the same k
 * offset PF_ROWS_AHEAD rows further on, one line per weight row and 16 fp32 / 32 bf16 values). A step of T >= 4 rows
 * is bound by its multiply-adds, and without it the hardware did not fetch ahead while the cores were busy, so the
 * memory stream and the arithmetic took turns. AMD EPYC Zen 4, 2 threads, the 168 qwen3-0.6b-shaped matrices of 28
 * layers (q, k, v, o, gate + up, down; 1.76 GB fp32), interleaved in one process, best of 6: fp32 4 / 8 / 16 rows
 * 65.9 / 91.7 / 148.2 -> 36.7 / 56.9 / 102.5 ms (a prefetch into L1 instead: 79.6 ms at 8 rows; two rows ahead:
 * 74.9), bf16 40.1 / 54.3 / 86.7 -> 20.3 / 36.0 / 68.6 ms (into L1: no gain). Prefetches change no value. */
#ifndef PF_ROWS_AHEAD
#define PF_ROWS_AHEAD 4
#endif

#if defined(__AVX512BF16__)
/* dot1_bf16 of one weight row with nt rows of x (1 <= nt <= 4; x row stride xs elements) at once: each weight
 * vector is loaded once for the nt rows (an accumulator per row of x), and each result is exactly the value
 * dot1_bf16 gives that row of x alone: the same accumulator, chunks, masked tail and reduction. ``pf``: where to
 * fetch ahead into L2 step by step. */
static inline __attribute__((always_inline)) void dot1_bf16_xn(const bf16_t *w, const bf16_t *x, long xs, long K, const int nt,
                                                               float out[4], const bf16_t *pf) {
    __m512 a[4];
    for (int t = 0; t < nt; t++) a[t] = _mm512_setzero_ps();
    long k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(pf + k), _MM_HINT_T1);
        __m512bh wv = (__m512bh)_mm512_loadu_si512((const void *)(w + k));
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) a[t] = _mm512_dpbf16_ps(a[t], wv, (__m512bh)_mm512_loadu_si512((const void *)(x + t * xs + k)));
    }
    if (k < K) {
        __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
        __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + k);
        for (int t = 0; t < nt; t++) a[t] = _mm512_dpbf16_ps(a[t], wv, (__m512bh)_mm512_maskz_loadu_epi16(m, x + t * xs + k));
    }
    for (int t = 0; t < nt; t++) out[t] = _mm512_reduce_add_ps(a[t]);
}
#endif

#if defined(__AVX512F__)
/* fp32: a block of 4 weight rows (from w0, stride K) with T rows of x (stride K; 2 <= T <= 16) at once, in groups
 * of 4 rows of x (the last group holds the T % 4 rows left over, if any): acc[g][t][r] is exactly dot1_f32 of
 * weight row r with row 4g + t of x alone (one accumulator per pair, the same 16-value steps in the same order, the
 * same masked tail and reduction). The k range is walked in chunks of ROWS_KC values, each dotted with every group
 * while it is in L1 (up to sixteen independent chains a group; the accumulators wait on the stack between chunks;
 * the fetch of the next block into L2 is spread over the groups' passes, as in dot4_bf16_xg, and the first group's
 * pass fetches its rows 256 bytes ahead into L1: 8 / 16 rows of Mamba2-780m-shaped projections 87.7 / 160.2 ->
 * 81.3 / 150.4 ms, 0.6B-model-shaped 56.5 / 104.7 -> 53.6 / 100.1, 4 rows the same). One row of x at a time (dot4
 * per row, one chain each) a batched step is bound by the multiply-adds' latency: 122.1 ms at 8 rows for 196 qwen3
 * matrices that way, 89.6 with 4 x 4 blocks (Zen 4, 2 threads); the chunks measured 2-4 % faster again than one
 * pass over K a group. The rows left over past a multiple of 4 took that one-chain path before too, which made 7
 * rows of x slower than 8. */
#ifndef ROWS_KC
#define ROWS_KC 512
#endif
#ifndef ROWS_L1_AHEAD_F32
#define ROWS_L1_AHEAD_F32 64
#endif
static inline __attribute__((always_inline)) void f32_group_pass(const float *w0, long K, const float *xg, const int nt,
                                                                 long c0, long c1, long kfull, __m512 keep[4][4], int g, int G) {
    __m512 a[4][4];
    const float *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const long ahead = PF_ROWS_AHEAD * K;
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < 4; r++) a[t][r] = c0 ? keep[t][r] : _mm512_setzero_ps();
    for (long k = c0; k < c1; k += 16) {
        __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        for (int r = g; r < 4; r += G) _mm_prefetch((const char *)(w0 + ahead + r * K + k), _MM_HINT_T1);
        if (g == 0) {
            _mm_prefetch((const char *)(w0 + ROWS_L1_AHEAD_F32 + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + ROWS_L1_AHEAD_F32 + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + ROWS_L1_AHEAD_F32 + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w3 + ROWS_L1_AHEAD_F32 + k), _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_loadu_ps(xg + t * K + k);
            a[t][0] = _mm512_fmadd_ps(v0, xv, a[t][0]);
            a[t][1] = _mm512_fmadd_ps(v1, xv, a[t][1]);
            a[t][2] = _mm512_fmadd_ps(v2, xv, a[t][2]);
            a[t][3] = _mm512_fmadd_ps(v3, xv, a[t][3]);
        }
    }
    if (c1 == kfull && kfull < K) {
        __mmask16 m = (__mmask16)((1u << (K - kfull)) - 1);
        __m512 v0 = _mm512_maskz_loadu_ps(m, w0 + kfull), v1 = _mm512_maskz_loadu_ps(m, w1 + kfull);
        __m512 v2 = _mm512_maskz_loadu_ps(m, w2 + kfull), v3 = _mm512_maskz_loadu_ps(m, w3 + kfull);
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_maskz_loadu_ps(m, xg + t * K + kfull);
            a[t][0] = _mm512_fmadd_ps(v0, xv, a[t][0]);
            a[t][1] = _mm512_fmadd_ps(v1, xv, a[t][1]);
            a[t][2] = _mm512_fmadd_ps(v2, xv, a[t][2]);
            a[t][3] = _mm512_fmadd_ps(v3, xv, a[t][3]);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < 4; r++) keep[t][r] = a[t][r];
}

static inline void dot4_f32_xt(const float *w0, const float *x, long K, int T, float acc[4][4][4]) {
    __m512 keep[4][4][4];
    const int G = (T + 3) / 4;
    const long kfull = K & ~15L;
    for (long c0 = 0;; c0 += ROWS_KC) {
        const long c1 = c0 + ROWS_KC < kfull ? c0 + ROWS_KC : kfull;
        for (int g = 0; g < G; g++) {
            const float *xg = x + (long)g * 4 * K;
            switch (T - 4 * g) {
            case 1: f32_group_pass(w0, K, xg, 1, c0, c1, kfull, keep[g], g, G); break;
            case 2: f32_group_pass(w0, K, xg, 2, c0, c1, kfull, keep[g], g, G); break;
            case 3: f32_group_pass(w0, K, xg, 3, c0, c1, kfull, keep[g], g, G); break;
            default: f32_group_pass(w0, K, xg, 4, c0, c1, kfull, keep[g], g, G); break;
            }
        }
        if (c1 == kfull) break;
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < 4 && 4 * g + t < T; t++)
            for (int r = 0; r < 4; r++) acc[g][t][r] = _mm512_reduce_add_ps(keep[g][t][r]);
}
#endif

#if defined(__AVX512BF16__)
/* bf16: a block of 4 weight rows (from w0, stride K) with G groups of 4 rows of x (stride K; 2 <= G <= 4) at once,
 * as dot4_f32_xt does it for fp32: acc[g][t][r] is exactly dot1_bf16 of weight row r with row 4g + t of x alone (one
 * accumulator per pair, the same 32-value steps in the same order, the same masked tail and reduction), over chunks
 * of ROWS_KC_BF16 values, sixteen independent chains a group. The fetch of the next block into L2 is spread over the
 * groups' passes (group g fetches weight rows g, g + G, ...), and the first group's pass also fetches its own rows
 * 256 bytes ahead into L1. Rows of x past a multiple of 4 take dot4_bf16_xt (below). Up to 4 rows of x keep a
 * weight row at a time (dot1_bf16_xn against them): it streams faster there (4 rows 27.9 against 35.5 ms). Against one weight row with 4 rows of x at a time (four chains, every fetch in the first group's
 * pass, the rows past a multiple of 4 one chain each), Zen 4, 2 threads, from memory, interleaved in one process,
 * 48 layers of Mamba2-780m-shaped in / out projections (1.4 GB): rows of x 3 / 6 / 7 / 8 / 12 / 16 56.2 / 61.7 /
 * 71.0 / 59.8 / 82.8 / 104.6 -> 44.8 / 52.5 / 50.1 / 47.5 / 62.4 / 76.1 ms (4 and 5 rows the same); 0.6B-model-
 * shaped (28 layers) 8 rows 35.7 -> 32.7, 16 rows 69.6 -> 58.0. */
#ifndef ROWS_KC_BF16
#define ROWS_KC_BF16 384
#endif
#ifndef ROWS_L1_AHEAD
#define ROWS_L1_AHEAD 128
#endif
/* T rows of x (5 <= T <= 16) that are not a multiple of 4: dot4_bf16_xg's block with a last, partial group of T % 4
 * rows (each pass of a group as bf16_group_pass, the same steps, order, tail and reduction: every result exactly
 * dot1_bf16's for that row alone). Before, the rows past a multiple of 4 took a weight row at a time: 5 / 6 / 7
 * rows one weight row against 4 rows of x then one against the rest, 9 / 13 rows the block and then the rest on the
 * weights in cache — up to 7 rows cost more than 8. Zen 4, 2 threads, 48 layers of Mamba2-780m-shaped in / out
 * projections from memory, interleaved in one process, best of 6: 5 / 6 / 7 / 9 / 13 rows 46.2-52.7 / 49.3-55.2 /
 * 51.3-56.7 / 61.4 / 76.8 -> 37.3-45.7 / 42.9-47.7 / 50.2-52.4 / 58.1 / 69.0 ms (4, 8, 12, 16 rows the same);
 * 0.6B-model-shaped 5 / 6 / 7 / 13 rows 33.6 / 34.4 / 35.8 / 53.5 -> 30.0 / 31.8 / 34.5 / 50.9. Full groups keep
 * dot4_bf16_xg's own loop, the same steps as this pass: built on these passes through the switch, 8 rows measured
 * 53.0 against 46.0 ms; calling this pass with 4 rows and no switch, 3-7 % slower at 8 rows in four interleaved
 * runs (Mamba2-780m shape 54.0 / 57.5 / 63.7 against 50.6 / 55.3 / 61.6 ms, 0.6B-model shape 45.2 against 44.0). */
static inline __attribute__((always_inline)) void bf16_group_pass(const bf16_t *w0, long K, const bf16_t *xg, const int nt,
                                                                  long c0, long c1, long kfull, __m512 keep[4][4], int g, int G) {
    __m512 a[4][4];
    const bf16_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const long ahead = PF_ROWS_AHEAD * K;
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < 4; r++) a[t][r] = c0 ? keep[t][r] : _mm512_setzero_ps();
    for (long k = c0; k < c1; k += 32) {
        __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)(w0 + k));
        __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(w1 + k));
        __m512bh v2 = (__m512bh)_mm512_loadu_si512((const void *)(w2 + k));
        __m512bh v3 = (__m512bh)_mm512_loadu_si512((const void *)(w3 + k));
        for (int r = g; r < 4; r += G) _mm_prefetch((const char *)(w0 + ahead + r * K + k), _MM_HINT_T1);
        if (g == 0) {
            _mm_prefetch((const char *)(w0 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(w3 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xg + t * K + k));
            a[t][0] = _mm512_dpbf16_ps(a[t][0], v0, xv);
            a[t][1] = _mm512_dpbf16_ps(a[t][1], v1, xv);
            a[t][2] = _mm512_dpbf16_ps(a[t][2], v2, xv);
            a[t][3] = _mm512_dpbf16_ps(a[t][3], v3, xv);
        }
    }
    if (c1 == kfull && kfull < K) {
        __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
        __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + kfull);
        __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + kfull);
        __m512bh v2 = (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + kfull);
        __m512bh v3 = (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + kfull);
        for (int t = 0; t < nt; t++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xg + t * K + kfull);
            a[t][0] = _mm512_dpbf16_ps(a[t][0], v0, xv);
            a[t][1] = _mm512_dpbf16_ps(a[t][1], v1, xv);
            a[t][2] = _mm512_dpbf16_ps(a[t][2], v2, xv);
            a[t][3] = _mm512_dpbf16_ps(a[t][3], v3, xv);
        }
    }
    for (int t = 0; t < nt; t++)
        for (int r = 0; r < 4; r++) keep[t][r] = a[t][r];
}

static inline void dot4_bf16_xt(const bf16_t *w0, const bf16_t *x, long K, int T, float acc[4][4][4]) {
    __m512 keep[4][4][4];
    const int G = (T + 3) / 4;
    const long kfull = K & ~31L;
    for (long c0 = 0;; c0 += ROWS_KC_BF16) {
        const long c1 = c0 + ROWS_KC_BF16 < kfull ? c0 + ROWS_KC_BF16 : kfull;
        for (int g = 0; g < G; g++) {
            const bf16_t *xg = x + (long)g * 4 * K;
            switch (T - 4 * g) {
            case 1: bf16_group_pass(w0, K, xg, 1, c0, c1, kfull, keep[g], g, G); break;
            case 2: bf16_group_pass(w0, K, xg, 2, c0, c1, kfull, keep[g], g, G); break;
            case 3: bf16_group_pass(w0, K, xg, 3, c0, c1, kfull, keep[g], g, G); break;
            default: bf16_group_pass(w0, K, xg, 4, c0, c1, kfull, keep[g], g, G); break;
            }
        }
        if (c1 == kfull) break;
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < 4 && 4 * g + t < T; t++)
            for (int r = 0; r < 4; r++) acc[g][t][r] = _mm512_reduce_add_ps(keep[g][t][r]);
}

static inline void dot4_bf16_xg(const bf16_t *w0, const bf16_t *x, long K, int G, float acc[4][4][4]) {
    __m512 keep[4][4][4];
    const bf16_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    const long kfull = K & ~31L, ahead = PF_ROWS_AHEAD * K;
    for (long c0 = 0;; c0 += ROWS_KC_BF16) {
        const long c1 = c0 + ROWS_KC_BF16 < kfull ? c0 + ROWS_KC_BF16 : kfull;
        for (int g = 0; g < G; g++) {
            __m512 a[4][4];
            const bf16_t *xg = x + (long)g * 4 * K;
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 4; r++) a[t][r] = c0 ? keep[g][t][r] : _mm512_setzero_ps();
            for (long k = c0; k < c1; k += 32) {
                __m512bh v0 = (__m512bh)_mm512_loadu_si512((const void *)(w0 + k));
                __m512bh v1 = (__m512bh)_mm512_loadu_si512((const void *)(w1 + k));
                __m512bh v2 = (__m512bh)_mm512_loadu_si512((const void *)(w2 + k));
                __m512bh v3 = (__m512bh)_mm512_loadu_si512((const void *)(w3 + k));
                for (int r = g; r < 4; r += G) _mm_prefetch((const char *)(w0 + ahead + r * K + k), _MM_HINT_T1);
                if (g == 0) {
                    _mm_prefetch((const char *)(w0 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w1 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w2 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
                    _mm_prefetch((const char *)(w3 + ROWS_L1_AHEAD + k), _MM_HINT_T0);
                }
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xg + t * K + k));
                    a[t][0] = _mm512_dpbf16_ps(a[t][0], v0, xv);
                    a[t][1] = _mm512_dpbf16_ps(a[t][1], v1, xv);
                    a[t][2] = _mm512_dpbf16_ps(a[t][2], v2, xv);
                    a[t][3] = _mm512_dpbf16_ps(a[t][3], v3, xv);
                }
            }
            if (c1 == kfull && kfull < K) {
                __mmask32 m = (__mmask32)((1ull << (K - kfull)) - 1);
                __m512bh v0 = (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + kfull);
                __m512bh v1 = (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + kfull);
                __m512bh v2 = (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + kfull);
                __m512bh v3 = (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + kfull);
                for (int t = 0; t < 4; t++) {
                    __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, xg + t * K + kfull);
                    a[t][0] = _mm512_dpbf16_ps(a[t][0], v0, xv);
                    a[t][1] = _mm512_dpbf16_ps(a[t][1], v1, xv);
                    a[t][2] = _mm512_dpbf16_ps(a[t][2], v2, xv);
                    a[t][3] = _mm512_dpbf16_ps(a[t][3], v3, xv);
                }
            }
            for (int t = 0; t < 4; t++)
                for (int r = 0; r < 4; r++) keep[g][t][r] = a[t][r];
        }
        if (c1 == kfull) break;
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < 4; t++)
            for (int r = 0; r < 4; r++) acc[g][t][r] = _mm512_reduce_add_ps(keep[g][t][r]);
}

/* dot1_bf16_xn of each of the 4 weight rows from w with nt rows of x (nt <= 4; T = 4 * g0 + nt rows in all, these
 * being rows 4 * g0 ...), into acc[g0][t][r]; ``pf``: the rows ahead to fetch into L2 (or the rows themselves,
 * when the block's full groups have just read them). */
static inline void bf16_rows_xn(const bf16_t *w, long K, const bf16_t *x, int nt, int g0, const bf16_t *pf, float acc[4][4][4]) {
    for (int r = 0; r < 4; r++) {
        float o[4];
        switch (nt) {
        case 1: dot1_bf16_xn(w + r * K, x, K, K, 1, o, pf + r * K); break;
        case 2: dot1_bf16_xn(w + r * K, x, K, K, 2, o, pf + r * K); break;
        case 3: dot1_bf16_xn(w + r * K, x, K, K, 3, o, pf + r * K); break;
        default: dot1_bf16_xn(w + r * K, x, K, K, 4, o, pf + r * K); break;
        }
        for (int t = 0; t < nt; t++) acc[g0][t][r] = o[t];
    }
}
#endif

/* dot4 of a block of 4 weight rows with the first T rows of x (2 <= T <= 16): acc[t / 4][t % 4][r] equals
 * dot4(W, x_t, n0, K, 4, bf, ...)[r], each weight row read from memory once for all of them (bf16 in AVX-512 BF16
 * builds, fp32 in AVX-512 builds). Returns the number of rows of x done (0 where not built). */
static inline long dot4_rows(const void *W, const void *x, long n0, long K, long T, int bf, float acc[4][4][4]) {
#if defined(__AVX512BF16__)
    if (bf) {
        const bf16_t *w = (const bf16_t *)W + n0 * K, *xb = (const bf16_t *)x;
        const int G = (int)(T / 4), rem = (int)(T % 4);
        if (T < 5) {  /* up to 4 rows: a weight row at a time against them streams faster than the block */
            bf16_rows_xn(w, K, xb, G ? 4 : rem, 0, w + PF_ROWS_AHEAD * K, acc);
        } else if (!rem) {
            dot4_bf16_xg(w, xb, K, G, acc);
        } else {  /* the rows past a multiple of 4 as a last, partial group of the block */
            dot4_bf16_xt(w, xb, K, (int)T, acc);
        }
        return T;
    }
#endif
#if defined(__AVX512F__)
    if (!bf) {
        dot4_f32_xt((const float *)W + n0 * K, (const float *)x, K, (int)T, acc);
        return T;
    }
#endif
    (void)W; (void)x; (void)n0; (void)K; (void)T; (void)bf; (void)acc;
    return 0;
}

/* vxc_gemv over T rows of x (one decode step of T sequences): each group of 4 weight rows is read from memory
 * once and dotted with up to 16 rows of x while it is in cache (4 rows of x at a time from registers); each row's
 * result is computed exactly as vxc_gemv computes it for that row alone (the same dot products, the same order),
 * so a batched step gives every sequence the values its single-sequence step gives. */
void vxc_gemv_rows(const void *W, const void *x, const void *bias, void *y, long N, long K, long T, int bf) {
    if (T == 1) {  /* the one-row kernel itself: the loop below, compiled around the blocks, streamed one row slower */
        vxc_gemv(W, x, bias, y, N, K, bf);
        return;
    }
    const long es = bf ? 2 : 4;
    const long TB = T < 16 ? T : 16;
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 4) {
        long rows = N - n0 < 4 ? N - n0 : 4;
        long t0 = 0;
        float a4[4][4][4];
        if (rows == 4 && TB >= 2 && (t0 = dot4_rows(W, x, n0, K, TB, bf, a4)) > 0) {
            for (long t = 0; t < t0; t++)
                for (long r = 0; r < 4; r++) {
                    float v = rnd(a4[t / 4][t % 4][r], bf);
                    if (bias) v += ld(bias, n0 + r, bf);
                    st((char *)y + t * N * es, n0 + r, v, bf);
                }
        }
        for (long t = t0; t < T; t++) {
            float acc[4];
            void *yt = (char *)y + t * N * es;
            dot4(W, (const char *)x + t * K * es, n0, K, rows, bf, acc);
            for (long r = 0; r < rows; r++) {
                float v = rnd(acc[r], bf);
                if (bias) v += ld(bias, n0 + r, bf);
                st(yt, n0 + r, v, bf);
            }
        }
    }
}

/* vxc_swiglu_up over T rows of x (h: [T, N]), each row as vxc_swiglu_up computes it alone. */
void vxc_swiglu_up_rows(const void *Wg, const void *Wu, const void *x, void *h, long N, long K, long T, int bf) {
    if (T == 1) {
        vxc_swiglu_up(Wg, Wu, x, h, N, K, bf);
        return;
    }
    const long es = bf ? 2 : 4;
    const long TB = T < 16 ? T : 16;
#pragma omp parallel for schedule(static)
    for (long n0 = 0; n0 < N; n0 += 4) {
        long rows = N - n0 < 4 ? N - n0 : 4;
        long t0 = 0;
        float g4[4][4][4], u4[4][4][4];
        if (rows == 4 && TB >= 2 && (t0 = dot4_rows(Wg, x, n0, K, TB, bf, g4)) > 0 && dot4_rows(Wu, x, n0, K, TB, bf, u4) == t0) {
            for (long t = 0; t < t0; t++)
                for (long r = 0; r < 4; r++)
                    st((char *)h + t * N * es, n0 + r, rnd(silu(rnd(g4[t / 4][t % 4][r], bf)), bf) * rnd(u4[t / 4][t % 4][r], bf), bf);
        } else {
            t0 = 0;
        }
        for (long t = t0; t < T; t++) {
            float g[4], u[4];
            const void *xt = (const char *)x + t * K * es;
            void *ht = (char *)h + t * N * es;
            dot4(Wg, xt, n0, K, rows, bf, g);
            dot4(Wu, xt, n0, K, rows, bf, u);
            for (long r = 0; r < rows; r++) st(ht, n0 + r, rnd(silu(rnd(g[r], bf)), bf) * rnd(u[r], bf), bf);
        }
    }
}

/* the embedding twin for T ids: out[t] = table[ids[t]] (rows of D elements of esize bytes). */
void vxc_embedding(const int64_t *ids, const void *table, void *out, long T, long D, long esize) {
    for (long t = 0; t < T; t++)
        memcpy((char *)out + t * D * esize, (const char *)table + ids[t] * D * esize, (size_t)(D * esize));
}

/* T rows of row_bytes bytes, src rows src_stride bytes apart, packed into dst (a row-strided view made dense inside a
 * captured step: native.dense_rows). */
void vxc_copy_rows(const void *src, long src_stride, void *dst, long T, long row_bytes) {
    for (long t = 0; t < T; t++)
        memcpy((char *)dst + t * row_bytes, (const char *)src + t * src_stride, (size_t)row_bytes);
}

/* --------------------------------------------------------------------------------------- norms (norms.py) */

/* the add_rmsnorm twin over T rows of width D. x, out: activation dtype; residual (may be NULL) and
 * new_residual: fp32 when res_f32 else the activation dtype; weight: w_bf selects bf16 / fp32. */
/* r = x + residual over a row at off (x at the activation dtype, bf; the residual and new_residual bf16 where rbf,
 * else fp32; no residual: x alone), rounded to bf16 where rbf, stored to new_residual; sq = r² (each square rounded to
 * fp32, as rms_inv_f32 takes them) */
static inline void add_rows_sq(const void *x, const void *res, void *new_res, long off, long D, int bf, int rbf,
                               float *r, float *sq) {
    if (rbf) { /* bf16 x and residual (rbf implies bf) */
        const bf16_t *xa = (const bf16_t *)x + off, *ra = res ? (const bf16_t *)res + off : NULL;
        bf16_t *na = (bf16_t *)new_res + off;
        if (ra) {
#pragma omp simd
            for (long i = 0; i < D; i++) {
                bf16_t b = f2bf(bf2f(xa[i]) + bf2f(ra[i]));
                float v = bf2f(b);
                na[i] = b;
                r[i] = v;
                sq[i] = v * v;
            }
        } else {
#pragma omp simd
            for (long i = 0; i < D; i++) {
                float v = bf2f(xa[i]);
                na[i] = xa[i];
                r[i] = v;
                sq[i] = v * v;
            }
        }
        return;
    }
    float *na = (float *)new_res + off;
    const float *ra = res ? (const float *)res + off : NULL;
    load_row(x, off, D, bf, r);
    if (ra) { /* (no residual: x as it is, -0 kept) */
#pragma omp simd
        for (long i = 0; i < D; i++) r[i] += ra[i];
    }
#pragma omp simd
    for (long i = 0; i < D; i++) {
        na[i] = r[i];
        sq[i] = r[i] * r[i];
    }
}

void vxc_add_rmsnorm(const void *x, const void *residual, const void *weight, void *out, void *new_residual,
                     long T, long D, float eps, int zero_centred, int res_f32, int bf, int w_bf) {
    int rbf = res_f32 ? 0 : bf;
    /* rows over the threads from two rows of 4096 values in all: in a batched decode step the rows arrive cold (the
     * projections before streamed the caches), and one thread took 11.7-25.7 us a call (8 rows x 1024, fp32,
     * 0.6B-model-shaped Q4_0 step, three runs); two, 9.4-9.6 (each row computed the same way on any thread) */
#pragma omp parallel if (T > 1 && T * D >= 4096)
    {
        float *r = (float *)malloc((size_t)D * 3 * sizeof(float)), *r2 = r + D, *w = r2 + D;
        load_row(weight, 0, D, w_bf, w);
        if (zero_centred) {
            for (long i = 0; i < D; i++) w[i] += 1.0f;
        } else if (bf) {
            round_row(w, D); /* the twin multiplies by the weight cast to the activation dtype */
        }
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            /* one pass: the sum (rounded to bf16 where the residual is bf16), the new residual and the squares;
             * then torch's sum of the squares, then one pass for the output. The same values as loading, adding,
             * rounding, storing and squaring in five passes, which took 1.3-1.6x the time (Zen 4, 2 threads, both
             * interleaved: bf16 128 x 640 38.3 -> 24.4 us, 512 x 640 109 -> 80; fp32 128 x 640 22.7 -> 17.9) */
            add_rows_sq(x, residual, new_residual, t * D, D, bf, rbf, r, r2);
            float inv = 1.0f / sqrtf(torch_sum_f32(r2, D) / (float)D + eps); /* rms_inv_f32's */
            if (!bf) {
                float *o = (float *)out + t * D;
#pragma omp simd
                for (long i = 0; i < D; i++) o[i] = (r[i] * inv) * w[i];
            } else if (zero_centred) { /* the twin's two roundings: the normalised row, then its product with w */
                bf16_t *o = (bf16_t *)out + t * D;
#pragma omp simd
                for (long i = 0; i < D; i++) o[i] = f2bf((r[i] * inv) * w[i]);
            } else {
                bf16_t *o = (bf16_t *)out + t * D;
#pragma omp simd
                for (long i = 0; i < D; i++) o[i] = f2bf(w[i] * bf2f(f2bf(r[i] * inv)));
            }
        }
        free(r);
    }
}

/* the gated_rmsnorm twin over T rows of width D in groups of G channels; act 1 silu, 2 sigmoid.
 * x and z may be row-strided views (row strides sx, sz elements; e.g. slices of one projection); out is
 * contiguous [T, D]. */
void vxc_gated_rmsnorm(const void *x, const void *z, const void *weight, void *out, long T, long D, long G,
                       float eps, int norm_before_gate, int a, int bf, int w_bf, long sx, long sz) {
    /* rows over the threads from two rows of 4096 values: a row's activation (an expf per value) costs ~9 us at
     * width 3072, so a batched step's 8 rows (the 780M SSM shape) took 29 us a call on one thread, 19 on two; each row is
     * computed the same way on any thread */
#pragma omp parallel if (T > 1 && T * D >= 8192)
    {
        float *h = (float *)malloc((size_t)D * 3 * sizeof(float)), *gate = h + D, *w = gate + D;
        load_row(weight, 0, D, w_bf, w);
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            load_row(x, t * sx, D, bf, h);
            load_row(z, t * sz, D, bf, gate);
            act_row(gate, D, a);
            if (!norm_before_gate) {
#pragma omp simd
                for (long i = 0; i < D; i++) h[i] *= gate[i];
            }
            for (long g0 = 0; g0 < D; g0 += G) {
                double inv = rms_inv(h + g0, G, eps);
                if (norm_before_gate) {
#pragma omp simd
                    for (long i = g0; i < g0 + G; i++) h[i] = (float)((double)h[i] * inv * (double)w[i]) * gate[i];
                } else {
#pragma omp simd
                    for (long i = g0; i < g0 + G; i++) h[i] = (float)((double)h[i] * inv * (double)w[i]);
                }
            }
            store_row(out, t * D, D, bf, h);
        }
        free(h);
    }
}

/* ----------------------------------------------------------------------------------------- conv (conv.py) */

/* channels c0 .. c1 of one conv1d step. The all-fp32 four-tap case (Mamba2's and most conv-QKV layers) without
 * the per-element dtype branches: the same history, sum order and products, so the same values. */
/* conv_step_range's general loop for K = 4, one instance per (bf, w_bf, s_bf): the dtype branches resolved at
 * compile time, the activation over 256 channels at a time in a vector loop. The same sums in the same order as the
 * general loop. A Mamba2-780m-shaped bf16 step's 48 calls (3328 channels): 2.09 ms a row in the general loop. */
static inline __attribute__((always_inline)) void conv4_range(const void *x, const void *weight, const void *bias,
                                                              void *state, void *out, long c0, long c1, int a,
                                                              const int bf, const int w_bf, const int s_bf) {
    float y[256];
    for (long b0 = c0; b0 < c1; b0 += 256) {
        const long n = c1 - b0 < 256 ? c1 - b0 : 256;
        for (long i = 0; i < n; i++) {
            const long c = b0 + i;
            float h0 = ld(state, 4 * c + 1, s_bf), h1 = ld(state, 4 * c + 2, s_bf), h2 = ld(state, 4 * c + 3, s_bf);
            float h3 = ld(x, c, bf);
            st(state, 4 * c, h0, s_bf);
            st(state, 4 * c + 1, h1, s_bf);
            st(state, 4 * c + 2, h2, s_bf);
            st(state, 4 * c + 3, h3, s_bf);
            float v = 0.0f;
            v += h0 * ld(weight, 4 * c, w_bf);
            v += h1 * ld(weight, 4 * c + 1, w_bf);
            v += h2 * ld(weight, 4 * c + 2, w_bf);
            v += h3 * ld(weight, 4 * c + 3, w_bf);
            if (bias) v += ld(bias, c, w_bf);
            y[i] = v;
        }
        act_row(y, n, a);
        for (long i = 0; i < n; i++) st(out, b0 + i, y[i], bf);
    }
}

static inline void conv_step_range(const void *x, const void *weight, const void *bias, void *state, void *out,
                                   long c0, long c1, long K, int a, int bf, int w_bf, int s_bf) {
    if (K == 4 && (bf || w_bf || s_bf)) {
        switch ((bf != 0) * 4 + (w_bf != 0) * 2 + (s_bf != 0)) {
        case 1: conv4_range(x, weight, bias, state, out, c0, c1, a, 0, 0, 1); return;
        case 2: conv4_range(x, weight, bias, state, out, c0, c1, a, 0, 1, 0); return;
        case 3: conv4_range(x, weight, bias, state, out, c0, c1, a, 0, 1, 1); return;
        case 4: conv4_range(x, weight, bias, state, out, c0, c1, a, 1, 0, 0); return;
        case 5: conv4_range(x, weight, bias, state, out, c0, c1, a, 1, 0, 1); return;
        case 6: conv4_range(x, weight, bias, state, out, c0, c1, a, 1, 1, 0); return;
        default: conv4_range(x, weight, bias, state, out, c0, c1, a, 1, 1, 1); return;
        }
    }
    if (K == 4 && !bf && !w_bf && !s_bf) {
        const float *xf = (const float *)x, *wf = (const float *)weight, *bfp = (const float *)bias;
        float *sf = (float *)state, *of = (float *)out;
        for (long c = c0; c < c1; c++) {
            float *sc = sf + 4 * c;
            const float *w = wf + 4 * c;
            float h0 = sc[1], h1 = sc[2], h2 = sc[3], h3 = xf[c];
            sc[0] = h0, sc[1] = h1, sc[2] = h2, sc[3] = h3;
            float y = 0.0f;
            y += h0 * w[0];
            y += h1 * w[1];
            y += h2 * w[2];
            y += h3 * w[3];
            if (bfp) y += bfp[c];
            of[c] = act(y, a);
        }
        return;
    }
    for (long c = c0; c < c1; c++) {
        float y = 0.0f;
        for (long j = 0; j < K; j++) {
            float h = j + 1 < K ? ld(state, c * K + j + 1, s_bf) : ld(x, c, bf);
            st(state, c * K + j, h, s_bf);
            y += h * ld(weight, c * K + j, w_bf); /* the twin convolves the unrounded history */
        }
        if (bias) y += ld(bias, c, w_bf);
        st(out, c, act(y, a), bf);
    }
}

/* the conv1d_step twin: x [C], weight [C, K], bias [C] or NULL, state [C, K] (oldest first; s_bf: its
 * dtype), out [C]; act 0 none, 1 silu. */
void vxc_conv1d_step(const void *x, const void *weight, const void *bias, void *state, void *out, long C, long K,
                     int a, int bf, int w_bf, int s_bf) {
    if (C < 8192) {
        conv_step_range(x, weight, bias, state, out, 0, C, K, a, bf, w_bf, s_bf);
        return;
    }
#pragma omp parallel
    {
        long nt = omp_get_num_threads(), t = omp_get_thread_num(), per = (C + nt - 1) / nt;
        long c0 = t * per < C ? t * per : C, c1 = c0 + per < C ? c0 + per : C;
        conv_step_range(x, weight, bias, state, out, c0, c1, K, a, bf, w_bf, s_bf);
    }
}

/* the conv1d_prefill twin: x [T, C] (row stride sx elements), weight [C, K], bias [C] or NULL, state [C, K]
 * (oldest first; s_bf: its dtype), out [T, C] contiguous. Output t reads inputs t-K+1 .. t, where the inputs
 * before x[0] are the last K-1 state columns; afterwards the state holds the K most recent inputs. fp32 sums,
 * vectorised over channels: the weight and the history are transposed to [K, C] fp32 first. */
void vxc_conv1d_prefill(const void *x, const void *weight, const void *bias, void *state, void *out, long T, long C,
                        long K, int a, int bf, int w_bf, int s_bf, long sx) {
    float *wt = (float *)malloc((size_t)(2 * K + 1) * C * sizeof(float)), *hist = wt + K * C, *b = hist + K * C;
    for (long c = 0; c < C; c++) {
        for (long j = 0; j < K; j++) {
            wt[j * C + c] = ld(weight, c * K + j, w_bf);
            hist[j * C + c] = ld(state, c * K + j, s_bf);
        }
        b[c] = bias ? ld(bias, c, w_bf) : 0.0f;
    }
#pragma omp parallel if (T * C >= 32768)
    {
        float *row = (float *)malloc((size_t)C * 2 * sizeof(float)), *acc = row + C;
#pragma omp for schedule(static)
        for (long t = 0; t < T; t++) {
            memcpy(acc, b, (size_t)C * sizeof(float));
            for (long j = 0; j < K; j++) {
                long i = t + 1 + j; /* index into [history (K) | x (T)] */
                const float *wj = wt + j * C, *src;
                if (i < K) {
                    src = hist + i * C;
                } else {
                    load_row(x, (i - K) * sx, C, bf, row);
                    src = row;
                }
#pragma omp simd
                for (long c = 0; c < C; c++) acc[c] += wj[c] * src[c];
            }
            act_row(acc, C, a);
            store_row(out, t * C, C, bf, acc);
        }
        free(row);
    }
    /* the new history: the last K of [history | x] */
    for (long j = 0; j < K; j++) {
        long i = T + j;
        for (long c = 0; c < C; c++) {
            float v = i < K ? hist[i * C + c] : ld(x, (i - K) * sx + c, bf);
            st(state, c * K + j, v, s_bf);
        }
    }
    free(wt);
}

/* ------------------------------------------------------------------------------------------- ssd (ssd.py) */

/* One state row of the SSD recurrence for one token: s[n] = s[n] decay + dx b[n], returning sum_n s[n] c[n].
 * The step and the prefill both run exactly this (the vector form when N is a multiple of 16 up to SSD_VEC_N,
 * on AVX-512: s held in registers across a prefill's tokens; else the one compiled scalar function), so a
 * prefill of T tokens leaves the state and outputs that T single steps give, bit for bit. */
#define SSD_VEC_N 128
__attribute__((noinline)) static float ssd_row_scalar(float *s, const float *b, const float *c, float decay, float dx,
                                                      long N) {
    float y = 0.0f;
    for (long n = 0; n < N; n++) {
        float v = s[n] * decay + dx * b[n];
        s[n] = v;
        y += v * c[n];
    }
    return y;
}

#if defined(__AVX512F__)
static inline int ssd_vec(long N) { return N % 16 == 0 && N <= SSD_VEC_N; }
/* one token of one state row held in sv: the update and its dot with c (two accumulators, even / odd vectors) */
#define SSD_TOKEN(sv, dec, dxv, bt, ct, NJ, yout)                                                                   \
    do {                                                                                                           \
        __m512 a0_ = _mm512_setzero_ps(), a1_ = _mm512_setzero_ps();                                               \
        _Pragma("GCC unroll 8") for (int j = 0; j < (NJ); j++) {                                                   \
            sv[j] = _mm512_fmadd_ps(sv[j], dec, _mm512_mul_ps(dxv, _mm512_loadu_ps((bt) + 16 * j)));                \
            if (j & 1) a1_ = _mm512_fmadd_ps(sv[j], _mm512_loadu_ps((ct) + 16 * j), a1_);                          \
            else a0_ = _mm512_fmadd_ps(sv[j], _mm512_loadu_ps((ct) + 16 * j), a0_);                                \
        }                                                                                                          \
        (yout) = _mm512_reduce_add_ps(_mm512_add_ps(a0_, a1_));                                                    \
    } while (0)

/* T tokens of R (1 or 2) state rows (NJ = N / 16 vectors each, in registers throughout): row r at srow + r N,
 * its dx at dx + r T, its outputs at y + r T; each row's arithmetic is the same for R = 1 and R = 2 */
static inline __attribute__((always_inline)) void ssd_rows_tokens(float *srow, const float *b, const float *c, long N,
                                                                  const float *decay, const float *dx, float *y,
                                                                  long T, int NJ, int R) {
    __m512 s0[SSD_VEC_N / 16], s1[SSD_VEC_N / 16];
#pragma GCC unroll 8
    for (int j = 0; j < NJ; j++) {
        s0[j] = _mm512_loadu_ps(srow + 16 * j);
        if (R == 2) s1[j] = _mm512_loadu_ps(srow + N + 16 * j);
    }
    for (long t = 0; t < T; t++) {
        __m512 dec = _mm512_set1_ps(decay[t]);
        const float *bt = b + t * N, *ct = c + t * N;
        SSD_TOKEN(s0, dec, _mm512_set1_ps(dx[t]), bt, ct, NJ, y[t]);
        if (R == 2) SSD_TOKEN(s1, dec, _mm512_set1_ps(dx[T + t]), bt, ct, NJ, y[T + t]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NJ; j++) {
        _mm512_storeu_ps(srow + 16 * j, s0[j]);
        if (R == 2) _mm512_storeu_ps(srow + N + 16 * j, s1[j]);
    }
}
#define SSD_CASES(R)                                                                                               \
    switch (N / 16) {                                                                                              \
    case 1: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 1, R); break;                                          \
    case 2: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 2, R); break;                                          \
    case 3: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 3, R); break;                                          \
    case 4: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 4, R); break;                                          \
    case 5: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 5, R); break;                                          \
    case 6: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 6, R); break;                                          \
    case 7: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 7, R); break;                                          \
    default: ssd_rows_tokens(srow, b, c, N, decay, dx, y, T, 8, R); break;                                         \
    }
static void ssd_row_run(float *srow, const float *b, const float *c, long N, const float *decay, const float *dx,
                        float *y, long T, int R) {
    if (R == 2) {
        SSD_CASES(2)
    } else {
        SSD_CASES(1)
    }
}
#else
static inline int ssd_vec(long N) { (void)N; return 0; }
static void ssd_row_run(float *srow, const float *b, const float *c, long N, const float *decay, const float *dx,
                        float *y, long T, int R) {
    (void)srow; (void)b; (void)c; (void)N; (void)decay; (void)dx; (void)y; (void)T; (void)R;
}
#endif

/* tokens of one head: x [T, H, P] ... (the strides of the step and the prefill alike), B, C rows of group g
 * converted to fp32 a block of SSD_TB tokens at a time; every state row runs the block's tokens in turn */
#define SSD_TB 64
/* a one-token step reads and writes each head's state rows once, in order: prefetching the row SSD_PF rows ahead
 * (past the head's end: the next head's, a hint that cannot fault) kept the stream going where the hardware
 * prefetcher alone did not: 48 layers x 8 slots of mamba2-780m-shaped state (576 MB), Intel Xeon, 2 threads,
 * interleaved A/B: 44.9 -> 33.7 ms (4 to 64 rows ahead within 6 %) */
#ifndef SSD_PF
#define SSD_PF 16
#endif
static void ssd_head(const void *x, const void *dt, const void *B, const void *Cm, float bias, float e, float Dh,
                     float dt_min, float dt_max, int clamp, float *state, void *out, long T, long H, long P, long G,
                     long N, long h, long g, int bf) {
    long tb = T < SSD_TB ? T : SSD_TB;
    float stackbuf[2 * 1024 + 8]; /* a step (one token, N <= 1024): no allocation */
    float *bb = tb == 1 ? stackbuf : (float *)malloc((size_t)(2 * tb * N + 6 * tb) * sizeof(float));
    float *cc = bb + tb * N, *dv = cc + tb * N, *decay = dv + tb, *dx = decay + tb, *y = dx + 2 * tb;
    int vec = ssd_vec(N);
    for (long t0 = 0; t0 < T; t0 += tb) {
        long nt = T - t0 < tb ? T - t0 : tb;
        for (long t = 0; t < nt; t++) {
            for (long n = 0; n < N; n++) {
                bb[t * N + n] = ld(B, ((t0 + t) * G + g) * N + n, bf);
                cc[t * N + n] = ld(Cm, ((t0 + t) * G + g) * N + n, bf);
            }
            float d = softplus(ld(dt, (t0 + t) * H + h, bf) + bias);
            if (clamp) d = d < dt_min ? dt_min : (d > dt_max ? dt_max : d);
            dv[t] = d;
            decay[t] = expf(d * -e);
        }
        /* two state rows at a time through a block of tokens (independent chains side by side); a step (one
         * token) takes its rows one at a time: the same arithmetic per row either way */
        int R = vec && nt > 1 ? 2 : 1;
        for (long p = 0; p < P; p += R) {
            int r_n = p + R <= P ? R : 1;
            float *srow = state + (h * P + p) * N;
            if (nt == 1) /* a step streams the state once: fetch the rows SSD_PF ahead (see SSD_PF) */
                prefetch_bytes(srow + SSD_PF * N, R * N * 4);
            for (int r = 0; r < r_n; r++)
                for (long t = 0; t < nt; t++) dx[r * nt + t] = dv[t] * ld(x, ((t0 + t) * H + h) * P + p + r, bf);
            if (vec) {
                ssd_row_run(srow, bb, cc, N, decay, dx, y, nt, r_n);
            } else {
                for (long t = 0; t < nt; t++) y[t] = ssd_row_scalar(srow, bb + t * N, cc + t * N, decay[t], dx[t], N);
            }
            for (int r = 0; r < r_n; r++)
                for (long t = 0; t < nt; t++)
                    st(out, ((t0 + t) * H + h) * P + p + r, y[r * nt + t] + Dh * ld(x, ((t0 + t) * H + h) * P + p + r, bf), bf);
            if (r_n < R) p += r_n - R; /* an odd last row went alone: step on by one */
        }
    }
    if (bb != stackbuf) free(bb);
}

/* the ssd_step twin: x [H, P], dt [H], B, C [G, N] (activation dtype); A_log, D, dt_bias [H] (w_bf);
 * state [H, P, N] fp32, updated in place in one pass that also forms y = state C + D x. */
void vxc_ssd_step(const void *x, const void *dt, const void *A_log, const void *B, const void *Cm, const void *Dv,
                  const void *dt_bias, float dt_min, float dt_max, int clamp, float *state, void *out, long H, long P,
                  long G, long N, int bf, int w_bf) {
    long per_group = H / G;
#pragma omp parallel for schedule(static)
    for (long h = 0; h < H; h++)
        ssd_head(x, dt, B, Cm, ld(dt_bias, h, w_bf), expf(ld(A_log, h, w_bf)), ld(Dv, h, w_bf), dt_min, dt_max, clamp,
                 state, out, 1, H, P, G, N, h, h / per_group, bf);
}

/* the ssd_prefill twin as the recurrence itself: x [T, H, P], dt [T, H], B, C [T, G, N]; each head walks its
 * tokens in order (ssd_head: a state row in registers across a block of tokens), every token exactly
 * vxc_ssd_step's arithmetic: T tokens of prefill leave the state and outputs T single steps give. One parallel
 * region per call (over heads). */
void vxc_ssd_prefill(const void *x, const void *dt, const void *A_log, const void *B, const void *Cm, const void *Dv,
                     const void *dt_bias, float dt_min, float dt_max, int clamp, float *state, void *out, long T, long H,
                     long P, long G, long N, int bf, int w_bf) {
    long per_group = H / G;
#pragma omp parallel for schedule(static)
    for (long h = 0; h < H; h++)
        ssd_head(x, dt, B, Cm, ld(dt_bias, h, w_bf), expf(ld(A_log, h, w_bf)), ld(Dv, h, w_bf), dt_min, dt_max, clamp,
                 state, out, T, H, P, G, N, h, h / per_group, bf);
}

/* ------------------------------------------------------------------------------- attention (attention.py) */

/* the rotary twin for x [T, H, Dh] with tables cos, sin [T, R/2] (c_bf: their dtype): the first R dims of
 * each head rotate in pairs (i, i + R/2) or (2i, 2i + 1), the rest pass through. */
void vxc_rotary(const void *x, const void *cos_t, const void *sin_t, void *out, long T, long H, long Dh, long R,
                int interleaved, int bf, int c_bf) {
    long half = R / 2;
    /* one (token, head) row at a time through fp32 scratch: contiguous vector loads for the half-split layout */
    /* (token, head) rows over the threads from 8192 values: a batched decode step's 8 x 16 heads x 128 took 12-15 us a
     * call on one thread, cold, 8 on two */
#pragma omp parallel for schedule(static) if (T > 1 && T * H * Dh >= 8192)
    for (long th = 0; th < T * H; th++) {
        long t = th / H, base = th * Dh;
        float xv[1024], ov[1024], c[512], s[512]; /* Dh <= 1024, checked by the caller */
        load_row(x, base, Dh, bf, xv);
        load_row(cos_t, t * half, half, c_bf, c);
        load_row(sin_t, t * half, half, c_bf, s);
        if (interleaved) {
            for (long i = 0; i < half; i++) {
                float x1 = xv[2 * i], x2 = xv[2 * i + 1];
                ov[2 * i] = x1 * c[i] - x2 * s[i];
                ov[2 * i + 1] = x2 * c[i] + x1 * s[i];
            }
        } else {
#pragma omp simd
            for (long i = 0; i < half; i++) {
                float x1 = xv[i], x2 = xv[i + half];
                ov[i] = x1 * c[i] - x2 * s[i];
                ov[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
        for (long i = R; i < Dh; i++) ov[i] = xv[i];
        store_row(out, base, Dh, bf, ov);
    }
}

/* the attention twin for one query token at position ``start`` (attention.py's ring for a sliding window):
 * writes k, v into cache row start % rows (the cache holds ``rows`` rows: every position when start < rows, else a
 * ring), then each query head h (KV head h / (Hq / Hkv)) attends over positions lo .. start, lo = start - window + 1
 * when window > 0 (else 0), position p at row p % rows; sinks [Hq] (s_bf; NULL: none) add one logit per head to
 * the softmax denominator. scratch: fp32 [Hq · rows]. */
#define ATT_TILE 8 /* query heads of one KV group handled together (their q and accumulators on the stack) */
#ifndef ATT_PF
#define ATT_PF 8 /* positions ahead whose cache rows are prefetched */
#endif

/* a cache row's bytes asked for ahead: consecutive positions of one head sit Hkv rows apart (4 KiB on the 0.6B
 * softmax-decoder shape), a new page each, which the hardware prefetchers do not follow */
static inline void att_prefetch(const void *base, long byte_off, long nbytes) {
    const char *a = (const char *)base + byte_off;
    for (long b = 0; b < nbytes; b += 64) __builtin_prefetch(a + b, 0, 3);
}
/* the one-token step's (att_unit: one KV group's slice of each row, a 4 KiB row apart) into L2 (prefetcht1), where
 * the B-row step's whole rows (att_row) keep att_prefetch's L1. The 0.6B softmax-decoder shape (16 query heads, 8 KV
 * heads of 128), 28 layers' caches in huge pages, 2 threads, Zen 4, interleaved in one process, best of 8: fp32
 * cache at 1001 / 2001 positions 12.4 / 29.8 -> 10.7 / 22.1 ms, f16 12.1 / 17.3 -> 7.7 / 14.3 ms (bit-equal). The
 * B-row step with L2 instead: fp32 level, f16 at 501 positions 31.9 -> 35.7 ms, so it keeps L1. Reading a range of
 * KV groups a thread position-major (att_row's order, 2 KiB of each row) measured level to slower for one token. */
static inline void att_prefetch_l2(const void *base, long byte_off, long nbytes) {
    const char *a = (const char *)base + byte_off;
    for (long b = 0; b < nbytes; b += 64) __builtin_prefetch(a + b, 0, 2);
}

#if defined(__AVX512F__)
/* acc[j][d0 .. d0 + 16 NV) = sum_i p_j[i] / den_j * V[i][d0 ..] for heads j0, j0 + 1 (those below nh) of a tile,
 * positions in order (each head's sum as axpy_row takes it), the 2 x NV accumulators in registers */
static inline __attribute__((always_inline)) void att_wsum_range(float *acc0, float *acc1, const float *p0,
                                                                 const float *p1, float n0, float n1, int two,
                                                                 const void *v_cache, long lo, long i0, long i1, long S,
                                                                 long rows, long Hkv, long g, long Dv, long d0, int NV,
                                                                 int kt, int ahead) {
    __m512 A[2][8];
    /* as many bytes ahead whatever the cache type: 8 fp32 rows, 16 half rows (f16, Dv 128, 8 rows of 28 layers at
     * ~150 positions, interleaved A/B: 8 ahead 6.25 -> 16 ahead 5.74-5.87 ms; fp32 16 ahead was 6-10 % slower) */
    const long pfd = ATT_PF * 4 / kt_size(kt);
    for (int k = 0; k < 8; k++) {
        if (k >= NV) break;
        A[0][k] = i0 ? _mm512_loadu_ps(acc0 + d0 + 16 * k) : _mm512_setzero_ps();
        A[1][k] = i0 && two ? _mm512_loadu_ps(acc1 + d0 + 16 * k) : _mm512_setzero_ps();
    }
    for (long i = i0; i < i1; i++) {
        long vr = (((lo + i) % rows) * Hkv + g) * Dv + d0;
        if (ahead && i + pfd < S) att_prefetch_l2(v_cache, ((((lo + i + pfd) % rows) * Hkv + g) * Dv + d0) * kt_size(kt), 16 * kt_size(kt) * NV);
        __m512 w0 = _mm512_set1_ps(p0[i] / n0), w1 = _mm512_set1_ps(p1[i] / n1);
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            if (k >= NV) break;
            __m512 x = ldk16(v_cache, vr + 16 * k, kt);
            A[0][k] = _mm512_fmadd_ps(w0, x, A[0][k]);
            A[1][k] = _mm512_fmadd_ps(w1, x, A[1][k]);
        }
    }
    for (int k = 0; k < NV; k++) {
        _mm512_storeu_ps(acc0 + d0 + 16 * k, A[0][k]);
        if (two) _mm512_storeu_ps(acc1 + d0 + 16 * k, A[1][k]);
    }
}

static inline __attribute__((always_inline)) void att_wsum(float acc[][1024], const float *scratch, const float *den,
                                                           const void *v_cache, long lo, long S, long rows, long Hkv,
                                                           long g, long Dv, long h0, long j0, long nh, long d0, int NV,
                                                           int kt) {
    int two = j0 + 1 < nh;
    const float *p0 = scratch + (h0 + j0) * rows, *p1 = two ? scratch + (h0 + j0 + 1) * rows : p0;
    att_wsum_range(acc[j0], two ? acc[j0 + 1] : acc[j0], p0, p1, den[j0], two ? den[j0 + 1] : 1.0f, two, v_cache, lo, 0,
                   S, S, rows, Hkv, g, Dv, d0, NV, kt, 1);
}
#endif

#if defined(__AVX512F__)
/* the 16 sums of v[0..15] as one vector, out[p] = sum of the lanes of v[SIG(p)] (SIG: the 4 x 4 index transpose
 * p = 4m + e -> 4e + m, which the four halving steps leave): 15 adds and 30 shuffles, where 16 separate horizontal
 * sums take ~8 dependent instructions each */
#define ATT_SIG(p) ((((p) & 3) << 2) | ((p) >> 2))
static inline __attribute__((always_inline)) __m512 att_hsum16(const __m512 *v) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[2 * i]), _mm512_castps_pd(u[2 * i + 1]))));
    return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

/* the scaled scores of one head at 16 positions (rows kr[ATT_SIG(p)], fp32): 16 dots side by side, one transposing
 * reduction */
static inline __attribute__((always_inline)) __m512 att_dot16(const float *qh, const float *const *kr, long Dk, __m512 sc) {
    __m512 a[16];
    for (int p = 0; p < 16; p++) a[p] = _mm512_setzero_ps();
    for (long d = 0; d < Dk; d += 16) {
        __m512 qd = _mm512_loadu_ps(qh + d);
#pragma GCC unroll 16
        for (int p = 0; p < 16; p++) a[p] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(kr[p] + d), a[p]);
    }
    return _mm512_mul_ps(att_hsum16(a), sc);
}

/* the 16 rows of positions i .. i + 15 of KV group g as fp32 row pointers in kr[ATT_SIG(p)] (an f16 / bf16 cache's rows
 * widened into Kf: exact), the block after fetched ahead when ``ahead`` */
static inline __attribute__((always_inline)) void att_rows16(const void *k_cache, long lo, long i, long S, long rows,
                                                             long Hkv, long g, long Dk, int kt, float *Kf,
                                                             const float **kr, int ahead) {
    long es = kt_size(kt);
    for (int p = 0; p < 16; p++) {
        long off = (((lo + i + p) % rows) * Hkv + g) * Dk;
        if (ahead && i + 16 + p < S) att_prefetch_l2(k_cache, (((lo + i + 16 + p) % rows) * Hkv + g) * Dk * es, Dk * es);
        if (kt == 0) kr[ATT_SIG(p)] = (const float *)k_cache + off;
        else {
            float *dst = Kf + p * Dk;
            for (long d = 0; d < Dk; d += 16) _mm512_storeu_ps(dst + d, ldk16(k_cache, off + d, kt));
            kr[ATT_SIG(p)] = dst;
        }
    }
}

/* one head's scaled score at one position (row kr of the cache, kt): two accumulators a dot */
static inline __attribute__((always_inline)) float att_dot1(const float *qh, const void *k_cache, long kr, long Dk, int kt,
                                                            float scale) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    long d = 0;
    for (; d + 32 <= Dk; d += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), ldk16(k_cache, kr + d, kt), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d + 16), ldk16(k_cache, kr + d + 16, kt), a1);
    }
    if (d < Dk) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + d), ldk16(k_cache, kr + d, kt), a0);
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) * scale;
}

/* The scores of a one-token step in blocks of 16 positions: for each head of the tile, 16 dot products side by side
 * (a q vector loaded once feeds 16 FMAs, one accumulator per position) and one transposing reduction, so a block
 * ends in one vector of 16 scores (scaled, stored, and folded into the head's running max in lanes). A bf16 / f16
 * block is widened once into fp32 scratch for all the tile's heads. Returns the positions done (a multiple of 16;
 * the caller finishes the rest a position at a time). scratch: the tile's first head's row; mx: the running maxima. */
static long att_scores16(float qv[][1024], long nh, const void *k_cache, long lo, long S, long rows, long Hkv, long g,
                         long Dk, int kt, float scale, float *scratch, float *mx) {
    float Kf[16 * 1024]; /* Dk <= 1024 (checked by the caller) */
    const float *kr[16];
    __m512 mxv[ATT_TILE], sc = _mm512_set1_ps(scale);
    long i = 0;
    for (long j = 0; j < nh; j++) mxv[j] = _mm512_set1_ps(mx[j]);
    for (; i + 16 <= S; i += 16) {
        att_rows16(k_cache, lo, i, S, rows, Hkv, g, Dk, kt, Kf, kr, 1);
        for (long j = 0; j < nh; j++) {
            __m512 sv = att_dot16(qv[j], kr, Dk, sc);
            _mm512_storeu_ps(scratch + j * rows + i, sv);
            mxv[j] = _mm512_max_ps(mxv[j], sv);
        }
    }
    for (long j = 0; j < nh; j++) mx[j] = _mm512_reduce_max_ps(mxv[j]);
    return i;
}
#endif

/* p[i] = exp(p[i] - m) over a head's S scores; returns their sum (a sink's term added): one function for the
 * one-token step and the B-row step, so that both sum in the same order */
static __attribute__((noinline)) float att_softmax(float *p, long S, float m, const void *sinks, long h, int s_bf) {
    float z = 0.0f;
#pragma omp simd reduction(+ : z)
    for (long i = 0; i < S; i++) {
        p[i] = vexp(p[i] - m);
        z += p[i];
    }
    return z + (sinks ? expf(ld(sinks, h, s_bf) - m) : 0.0f);
}

/* Each KV group's key and value rows are read once for all the query heads that share them (a tile of up to
 * ATT_TILE heads): at long contexts the step streams the cache, and reading it once per query head multiplied that
 * traffic by the group size (the 0.6B softmax-decoder shape, 2048 positions: 50 ms a step, 42 of them here). Each
 * head's arithmetic is unchanged — its dots, its max, its exps and its weighted sum in position order — so the
 * result is bit for bit the per-head loop's. Work units are (group, tile) pairs, more tiles per group when there
 * are fewer groups than threads (one KV head and four query heads: two tiles of two). */
/* one work unit of a one-token attention step: KV group u / tiles, its tile u % tiles of query heads */
static void att_unit(const void *q, const void *k_cache, const void *v_cache, void *out, long lo, long S, float scale,
                     long Hq, long Hkv, long Dk, long Dv, float *scratch, long rows, const void *sinks, int s_bf, int bf,
                     int kt, long u, long tiles, long tile) {
    long es = kt_size(kt), group = Hq / Hkv;
    long g = u / tiles, h0 = g * group + (u % tiles) * tile, h1 = h0 + tile < (g + 1) * group ? h0 + tile : (g + 1) * group;
    long nh = h1 - h0;
    float qv[ATT_TILE][1024], acc[ATT_TILE][1024]; /* Dk, Dv <= 1024, checked by the caller */
    float mx[ATT_TILE], den[ATT_TILE];
    for (long j = 0; j < nh; j++) {
        for (long d = 0; d < Dk; d++) qv[j][d] = ld(q, (h0 + j) * Dk + d, bf);
        mx[j] = sinks ? ld(sinks, h0 + j, s_bf) : -INFINITY;
    }
#if defined(__AVX512F__)
    if (Dk % 16 == 0) { /* blocks of 16 positions, then two accumulators a dot (bf16 activations widened: exact) */
        long i = att_scores16(qv, nh, k_cache, lo, S, rows, Hkv, g, Dk, kt, scale, scratch + h0 * rows, mx);
        for (; i < S; i++) {
            long kr = (((lo + i) % rows) * Hkv + g) * Dk;
            if (i + ATT_PF < S) att_prefetch_l2(k_cache, (((lo + i + ATT_PF) % rows) * Hkv + g) * Dk * es, Dk * es);
            for (long j = 0; j < nh; j++) {
                float sc = att_dot1(qv[j], k_cache, kr, Dk, kt, scale);
                scratch[(h0 + j) * rows + i] = sc;
                if (sc > mx[j]) mx[j] = sc;
            }
        }
    } else
#endif
    for (long i = 0; i < S; i++) {
        long off = (((lo + i) % rows) * Hkv + g) * Dk;
        if (i + ATT_PF < S) att_prefetch_l2(k_cache, (((lo + i + ATT_PF) % rows) * Hkv + g) * Dk * es, Dk * es);
        for (long j = 0; j < nh; j++) {
            float *p = scratch + (h0 + j) * rows;
            p[i] = dotk_row(qv[j], k_cache, off, Dk, kt) * scale;
            if (p[i] > mx[j]) mx[j] = p[i];
        }
    }
    for (long j = 0; j < nh; j++) {
        den[j] = att_softmax(scratch + (h0 + j) * rows, S, mx[j], sinks, h0 + j, s_bf);
        for (long d = 0; d < Dv; d++) acc[j][d] = 0.0f;
    }
#if defined(__AVX512F__)
    if (Dv % 64 == 0) { /* the weighted sum of a pair of heads over 64 or 128 channels of the V rows, its
                         * accumulators in registers across the positions. bf16 activations took the per-position
                         * dot_row / axpy_row path before (the same fp32 sums in another order): 8 rows of 28 layers
                         * of the 0.6B softmax-decoder shape over a bf16 cache, ~100 / ~400 positions, in-process
                         * A/B: 13.6 / 38.5 -> 10.0 / 27.0 ms */
        for (long j0 = 0; j0 < nh; j0 += 2)
            for (long d0 = 0; d0 < Dv; d0 += (Dv % 128 == 0 ? 128 : 64)) {
                if (Dv % 128 == 0) att_wsum(acc, scratch, den, v_cache, lo, S, rows, Hkv, g, Dv, h0, j0, nh, d0, 8, kt);
                else att_wsum(acc, scratch, den, v_cache, lo, S, rows, Hkv, g, Dv, h0, j0, nh, d0, 4, kt);
            }
    } else
#endif
    for (long i = 0; i < S; i++) {
        long off = (((lo + i) % rows) * Hkv + g) * Dv;
        if (i + ATT_PF < S) att_prefetch_l2(v_cache, (((lo + i + ATT_PF) % rows) * Hkv + g) * Dv * es, Dv * es);
        for (long j = 0; j < nh; j++) axpyk_row(acc[j], scratch[(h0 + j) * rows + i] / den[j], v_cache, off, Dv, kt);
    }
    for (long j = 0; j < nh; j++)
        for (long d = 0; d < Dv; d++) st(out, (h0 + j) * Dv + d, acc[j][d], bf);
}

/* the first position a step at ``start`` attends to (a sliding window of ``window`` positions, else 0) */
static inline long att_lo(long start, long window) { return window > 0 && start - window + 1 > 0 ? start - window + 1 : 0; }

/* the (group, tile) work units of a step: tiles of at most ATT_TILE query heads, more of them when there are fewer
 * groups than threads (one KV head and four query heads: two tiles of two) */
static void att_tiles(long group, long Hkv, long threads, long *tiles_out, long *tile_out) {
    long tiles = (group + ATT_TILE - 1) / ATT_TILE;
    while (Hkv * tiles < threads && tiles < group) tiles++;
    long tile = (group + tiles - 1) / tiles;
    *tiles_out = (group + tile - 1) / tile;
    *tile_out = tile;
}

#ifndef ATT_ROW_PF
#define ATT_ROW_PF 1 /* blocks of 16 positions ahead whose whole rows (every KV group) the B-row step fetches */
#endif

/* One row of a B-row step (vxc_attention_step_rows) with its positions outermost: blocks of 16 positions, and in each
 * block every KV group and every query head, so the cache is read a whole row at a time (every group's K, then every
 * group's V: Hkv x D contiguous values a position) where att_unit's (group, tile) units read one group's 512 bytes
 * of each 4 KiB row (the 0.6B softmax-decoder shape). Each head's arithmetic is att_unit's, step for step — the same
 * dots (att_dot16 / att_dot1 / dotk_row), the same running max, att_softmax, and the weighted sums in position order
 * (att_wsum_range continues a head's accumulators from one block to the next through memory: the same values) — so
 * every row is bit for bit the one-token step on its slot. A plain reader of the same bytes with 2 threads, 8 rows
 * at ~100 positions of 28 layers (Zen 4): 18-21 GB/s one group's slice at a time, 33-35 GB/s whole rows.
 * qv, acc: Hq x Dk and Hq x Dv floats; mx, den: Hq. */
static void att_row(const void *q, const void *k_cache, const void *v_cache, void *out, long lo, long S, float scale,
                    long Hq, long Hkv, long Dk, long Dv, float *scratch, long rows, const void *sinks, int s_bf, int bf,
                    int kt, float *qv, float *acc, float *mx, float *den) {
    long es = kt_size(kt), group = Hq / Hkv, krow = Hkv * Dk * es, vrow = Hkv * Dv * es;
    for (long h = 0; h < Hq; h++) {
        for (long d = 0; d < Dk; d++) qv[h * Dk + d] = ld(q, h * Dk + d, bf);
        mx[h] = sinks ? ld(sinks, h, s_bf) : -INFINITY;
    }
    long i = 0;
#if defined(__AVX512F__)
    int vec_k = Dk % 16 == 0, vec_v = Dv % 64 == 0;
    if (vec_k) {
        float Kf[16 * 1024]; /* Dk <= 1024 (checked by the caller) */
        const float *kr[16];
        __m512 sc = _mm512_set1_ps(scale), mxv[64]; /* Hq <= 64 (checked by the caller) */
        for (long h = 0; h < Hq; h++) mxv[h] = _mm512_set1_ps(mx[h]);
        for (; i + 16 <= S; i += 16) {
            if (ATT_ROW_PF)
                for (long p = 16 * ATT_ROW_PF; p < 16 * ATT_ROW_PF + 16 && i + p < S; p++)
                    att_prefetch(k_cache, ((lo + i + p) % rows) * krow, krow);
            for (long g = 0; g < Hkv; g++) {
                att_rows16(k_cache, lo, i, S, rows, Hkv, g, Dk, kt, Kf, kr, 0);
                for (long h = g * group; h < (g + 1) * group; h++) {
                    __m512 sv = att_dot16(qv + h * Dk, kr, Dk, sc);
                    _mm512_storeu_ps(scratch + h * rows + i, sv);
                    mxv[h] = _mm512_max_ps(mxv[h], sv);
                }
            }
        }
        for (long h = 0; h < Hq; h++) mx[h] = _mm512_reduce_max_ps(mxv[h]);
        for (; i < S; i++)
            for (long g = 0; g < Hkv; g++) {
                long kr1 = (((lo + i) % rows) * Hkv + g) * Dk;
                for (long h = g * group; h < (g + 1) * group; h++) {
                    float v = att_dot1(qv + h * Dk, k_cache, kr1, Dk, kt, scale);
                    scratch[h * rows + i] = v;
                    if (v > mx[h]) mx[h] = v;
                }
            }
    } else
#endif
    for (; i < S; i++) {
        if (i + ATT_PF < S) att_prefetch(k_cache, ((lo + i + ATT_PF) % rows) * krow, krow);
        for (long g = 0; g < Hkv; g++) {
            long off = (((lo + i) % rows) * Hkv + g) * Dk;
            for (long h = g * group; h < (g + 1) * group; h++) {
                float *p = scratch + h * rows;
                p[i] = dotk_row(qv + h * Dk, k_cache, off, Dk, kt) * scale;
                if (p[i] > mx[h]) mx[h] = p[i];
            }
        }
    }
    for (long h = 0; h < Hq; h++) {
        den[h] = att_softmax(scratch + h * rows, S, mx[h], sinks, h, s_bf);
        for (long d = 0; d < Dv; d++) acc[h * Dv + d] = 0.0f;
    }
#if defined(__AVX512F__)
    if (vec_v) {
        for (long i0 = 0; i0 < S; i0 += 16) {
            long i1 = i0 + 16 < S ? i0 + 16 : S;
            if (ATT_ROW_PF)
                for (long p = 16 * ATT_ROW_PF; p < 16 * ATT_ROW_PF + 16 && i0 + p < S; p++)
                    att_prefetch(v_cache, ((lo + i0 + p) % rows) * vrow, vrow);
            for (long g = 0; g < Hkv; g++)
                for (long j0 = 0; j0 < group; j0 += 2) {
                    long h = g * group + j0;
                    int two = j0 + 1 < group;
                    const float *p0 = scratch + h * rows, *p1 = two ? p0 + rows : p0;
                    float *a0 = acc + h * Dv, *a1 = two ? a0 + Dv : a0;
                    for (long d0 = 0; d0 < Dv; d0 += (Dv % 128 == 0 ? 128 : 64)) {
                        if (Dv % 128 == 0)
                            att_wsum_range(a0, a1, p0, p1, den[h], two ? den[h + 1] : 1.0f, two, v_cache, lo, i0, i1, S,
                                           rows, Hkv, g, Dv, d0, 8, kt, 0);
                        else
                            att_wsum_range(a0, a1, p0, p1, den[h], two ? den[h + 1] : 1.0f, two, v_cache, lo, i0, i1, S,
                                           rows, Hkv, g, Dv, d0, 4, kt, 0);
                    }
                }
        }
    } else
#endif
    for (long i = 0; i < S; i++) {
        if (i + ATT_PF < S) att_prefetch(v_cache, ((lo + i + ATT_PF) % rows) * vrow, vrow);
        for (long g = 0; g < Hkv; g++) {
            long off = (((lo + i) % rows) * Hkv + g) * Dv;
            for (long h = g * group; h < (g + 1) * group; h++) axpyk_row(acc + h * Dv, scratch[h * rows + i] / den[h], v_cache, off, Dv, kt);
        }
    }
    for (long h = 0; h < Hq; h++)
        for (long d = 0; d < Dv; d++) st(out, h * Dv + d, acc[h * Dv + d], bf);
}

void vxc_attention_step(const void *q, const void *k, const void *v, void *k_cache, void *v_cache, void *out,
                        long start, float scale, long Hq, long Hkv, long Dk, long Dv, float *scratch, long rows,
                        long window, const void *sinks, int s_bf, int bf, int kt) {
    long es = kt_size(kt), group = Hq / Hkv, row = start % rows, lo = att_lo(start, window), S = start - lo + 1;
    put_row((char *)k_cache + row * Hkv * Dk * es, k, Hkv * Dk, bf, kt);
    put_row((char *)v_cache + row * Hkv * Dv * es, v, Hkv * Dv, bf, kt);
    int par = S * Hq * Dk >= 32768;
    long tiles, tile;
    att_tiles(group, Hkv, par ? omp_get_max_threads() : 1, &tiles, &tile);
#pragma omp parallel for schedule(static) if (par)
    for (long u = 0; u < Hkv * tiles; u++)
        att_unit(q, k_cache, v_cache, out, lo, S, scale, Hq, Hkv, Dk, Dv, scratch, rows, sinks, s_bf, bf, kt, u, tiles, tile);
}

/* ------------------------------------------------------------------------------- delta (delta.py, kda.py) */

/* One token of a delta-rule recurrence with a per-head (gated delta, kda = 0) or per-key-channel (KDA, kda = 1)
 * decay. q, k [Hk, Dk], v [Hv, Dv] (activation dtype), b [Hv] (activation dtype), state [Hv, Dk, Dv] fp32,
 * o [Hv, Dv] (activation dtype); value head h reads key head h / (Hv / Hk).
 *   gated delta (delta.gated_delta_step_twin): a [Hv], A_log, dt_bias [Hv] (w_bf); decay exp(g) for the head,
 *     g = -exp(A_log) softplus(a + dt_bias) (log1p, linear above 20); q, k scaled by rsqrt(|x|^2 + eps).
 *   KDA (kda.kda_step_twin): a = f [Hv·Dk], dt_bias [Hv·Dk], A_log [Hv]; decay exp(g_i) per key channel,
 *     softplus spelled log(1 + e^x) as the reference does; q, k divided by sqrt(|x|^2 + eps).
 * Then beta = sigmoid(b); S *= decay; u = beta (v - Sᵀk); S += k uᵀ; o = Sᵀq. Dk, Dv <= 1024. */
/* value head h of one token's delta step (vxc_delta_step) */
static void delta_head(const void *q, const void *k, const void *v, const void *a, const void *b, const void *A_log,
                       const void *dt_bias, float *state, void *o, long Hk, long Hv, long Dk, long Dv, float scale,
                       float l2_eps, int kda, int bf, int w_bf, long h) {
    long hk = h / (Hv / Hk);
    float qn[1024], kn[1024], ks[1024], u[1024], out[1024], decay[1024];
    load_row(q, hk * Dk, Dk, bf, qn);
    load_row(k, hk * Dk, Dk, bf, kn);
    float sq = 0.0f, sk = 0.0f;
    for (long i = 0; i < Dk; i++) { sq += qn[i] * qn[i]; sk += kn[i] * kn[i]; }
    if (kda) {
        float dq = sqrtf(sq + l2_eps), dk = sqrtf(sk + l2_eps);
        for (long i = 0; i < Dk; i++) { qn[i] = qn[i] / dq * scale; kn[i] = kn[i] / dk; }
        float A = expf(ld(A_log, h, w_bf));
        for (long i = 0; i < Dk; i++) {
            float x = ld(a, h * Dk + i, bf) + ld(dt_bias, h * Dk + i, w_bf);
            decay[i] = expf(-A * (x > 20.0f ? x : logf(1.0f + expf(x))));
        }
    } else {
        float rq = scale / sqrtf(sq + l2_eps), rk = 1.0f / sqrtf(sk + l2_eps);
        for (long i = 0; i < Dk; i++) { qn[i] *= rq; kn[i] *= rk; }
        float g = -expf(ld(A_log, h, w_bf)) * softplus(ld(a, h, bf) + ld(dt_bias, h, w_bf));
        float e = expf(g);
        for (long i = 0; i < Dk; i++) decay[i] = e;
    }
    float beta = 1.0f / (1.0f + expf(-ld(b, h, bf)));
    float *S = state + h * Dk * Dv;
    for (long j = 0; j < Dv; j++) ks[j] = 0.0f;
    for (long i = 0; i < Dk; i++) {
        float *row = S + i * Dv, ki = kn[i], di = decay[i];
        /* the first pass streams the head's state from memory: fetch the row 8 ahead (36 layers x 4 slots of
         * qwen3-next-shaped state, 288 MB, Intel Xeon, 2 threads, interleaved A/B: 23.7 -> 19.6 ms) */
        prefetch_bytes(row + 8 * Dv, Dv * 4);
#pragma omp simd
        for (long j = 0; j < Dv; j++) { row[j] *= di; ks[j] += row[j] * ki; }
    }
    load_row(v, h * Dv, Dv, bf, u);
    for (long j = 0; j < Dv; j++) { u[j] = beta * (u[j] - ks[j]); out[j] = 0.0f; }
    for (long i = 0; i < Dk; i++) {
        float *row = S + i * Dv, ki = kn[i], qi = qn[i];
#pragma omp simd
        for (long j = 0; j < Dv; j++) { row[j] += ki * u[j]; out[j] += row[j] * qi; }
    }
    store_row(o, h * Dv, Dv, bf, out);
}

void vxc_delta_step(const void *q, const void *k, const void *v, const void *a, const void *b, const void *A_log,
                    const void *dt_bias, float *state, void *o, long Hk, long Hv, long Dk, long Dv, float scale,
                    float l2_eps, int kda, int bf, int w_bf) {
#pragma omp parallel for schedule(static)
    for (long h = 0; h < Hv; h++)
        delta_head(q, k, v, a, b, A_log, dt_bias, state, o, Hk, Hv, Dk, Dv, scale, l2_eps, kda, bf, w_bf, h);
}

/* delta.sigmoid_gate_mul_twin: out = x * sigmoid(gate) over n values (both at the activation dtype). */
void vxc_sigmoid_gate_mul(const void *x, const void *gate, void *out, long n, int bf) {
    for (long i = 0; i < n; i++) st(out, i, ld(x, i, bf) * sigm(ld(gate, i, bf)), bf);
}

/* ----------------------------------------------------------------------------- elementwise (elementwise.py) */

/* tanh(GELU's argument) through vexp: tanh(y) = 1 - 2 / (1 + e^{2y}) (vexp clamps, so +-1 at the extremes) */
#pragma omp declare simd notinbranch
static inline float gelu_tanh(float g) {
    float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (2.0f - 2.0f / (1.0f + vexp(2.0f * y)));
}

/* elementwise.gated_act_twin: out = act(g) * u over n values at the activation dtype; act 0 = none (the plain
 * product), 1 = silu, 3 = gelu (tanh approximation). */
/* Elementwise loops run on every thread from ELT_PAR values (a prefill chunk's FFN: 128 x 2048 for the Gemma 3 270M
 * shape); each value is computed alike on any thread. */
#define ELT_PAR 65536
#define ELT_CHUNK 512

void vxc_gated_act(const void *g, const void *u, void *out, long n, int a, int bf) {
    if (!bf) {
        const float *gf = (const float *)g, *uf = (const float *)u;
        float *of = (float *)out;
        if (a == 0) {
#pragma omp parallel for simd schedule(static) if (n >= ELT_PAR)
            for (long i = 0; i < n; i++) of[i] = gf[i] * uf[i];
        } else if (a == 1) {
#pragma omp parallel for simd schedule(static) if (n >= ELT_PAR)
            for (long i = 0; i < n; i++) of[i] = silu(gf[i]) * uf[i];
        } else {
#pragma omp parallel for simd schedule(static) if (n >= ELT_PAR)
            for (long i = 0; i < n; i++) of[i] = gelu_tanh(gf[i]) * uf[i];
        }
        return;
    }
    /* bf16: chunks widened to fp32, the fp32 loops above (vectorised), rounded back; each value as the one-value
     * form computes it. One value at a time (ld / st) this ran 15x slower than fp32: 1.26 ms for 128 x 2048
     * gelu_tanh products, slower than torch's twin */
#pragma omp parallel for schedule(static) if (n >= ELT_PAR)
    for (long c0 = 0; c0 < n; c0 += ELT_CHUNK) {
        long m = n - c0 < ELT_CHUNK ? n - c0 : ELT_CHUNK;
        float gv[ELT_CHUNK], uv[ELT_CHUNK];
        load_row(g, c0, m, 1, gv);
        load_row(u, c0, m, 1, uv);
        if (a == 0) {
#pragma omp simd
            for (long i = 0; i < m; i++) gv[i] = gv[i] * uv[i];
        } else if (a == 1) {
#pragma omp simd
            for (long i = 0; i < m; i++) gv[i] = silu(gv[i]) * uv[i];
        } else {
#pragma omp simd
            for (long i = 0; i < m; i++) gv[i] = gelu_tanh(gv[i]) * uv[i];
        }
        store_row(out, c0, m, 1, gv);
    }
}

/* elementwise.scale_twin: out = x * s over n values (s already at the activation dtype's precision). */
void vxc_scale(const void *x, void *out, long n, float s, int bf) {
#pragma omp parallel for schedule(static) if (n >= ELT_PAR)
    for (long c0 = 0; c0 < n; c0 += ELT_CHUNK) { /* by chunks, as vxc_gated_act */
        long m = n - c0 < ELT_CHUNK ? n - c0 : ELT_CHUNK;
        float v[ELT_CHUNK];
        load_row(x, c0, m, bf, v);
#pragma omp simd
        for (long i = 0; i < m; i++) v[i] = v[i] * s;
        store_row(out, c0, m, bf, v);
    }
}

/* ------------------------------------------------------------------------------------------- mla (mla.py) */

/* Rotate x [P] (fp32, in place) by c, s [P/2]: pairs (i, i + P/2) or, interleaved, (2i, 2i + 1); an interleaved
 * rotation writes its results back interleaved, or split (y1 then y2) when split_out. */
static void mla_rope(float *x, long P, const float *c, const float *s, int interleaved, int split_out) {
    float y[1024];
    long half = P / 2;
    for (long i = 0; i < half; i++) {
        float x1 = interleaved ? x[2 * i] : x[i], x2 = interleaved ? x[2 * i + 1] : x[i + half];
        float y1 = x1 * c[i] - x2 * s[i], y2 = x2 * c[i] + x1 * s[i];
        if (interleaved && !split_out) { y[2 * i] = y1; y[2 * i + 1] = y2; }
        else { y[i] = y1; y[i + half] = y2; }
    }
    memcpy(x, y, (size_t)P * sizeof(float));
}

/* mla.mla_decode_twin for one token at position ``start``: q [H, N + P], kv [R + P] (activation dtype), norm_w [R]
 * (nw_bf), w_kvb [H·(N + V), R] (w_bf), cos / sin [P/2] (c_bf) or NULL (no rotary), cache [rows, R + P]
 * (cache_bf: its element type, kt: 0 fp32, 1 bf16, 2 f16). Writes the latent row (plain-weight rmsnorm of kv[:R], rounded as the twin materialises it at the
 * activation dtype, then the rotated rope key) into cache row ``start``; then per head the absorbed attention
 * over cache rows 0..start: q_lat = q_nope · W_k, logits = (q_lat · c_s + q_pe · k_pe_s) · scale, softmax,
 * o_lat = Σ p_s c_s, out = W_v · o_lat; out [H, V] at the activation dtype. R, N + P, V <= 1024. */
void vxc_mla_decode(const void *q, const void *kv, const void *norm_w, const void *w_kvb, const void *cos_t,
                    const void *sin_t, void *cache, void *out, long H, long N, long P, long V, long R, long start,
                    float eps, float scale, int interleaved, int split_out, int bf, int nw_bf, int w_bf, int c_bf,
                    int cache_bf) {
    long width = R + P, half = P / 2;
    float c[1024], sn[1024], row[2048], sq[2048];
    if (cos_t) { load_row(cos_t, 0, half, c_bf, c); load_row(sin_t, 0, half, c_bf, sn); }
    load_row(kv, 0, width, bf, row);
    float inv = rms_inv_f32(row, sq, R, eps);
    for (long i = 0; i < R; i++) row[i] = rnd(rnd(ld(norm_w, i, nw_bf), bf) * rnd(row[i] * inv, bf), bf);
    if (cos_t) mla_rope(row + R, P, c, sn, interleaved, split_out);
    for (long i = 0; i < width; i++) stk(cache, start * width + i, row[i], cache_bf);
    long S = start + 1;
#pragma omp parallel
    {
        float qh[2048], qlat[1024], olat[1024];
        float *logit = (float *)malloc((size_t)S * sizeof(float));
#pragma omp for schedule(static)
        for (long h = 0; h < H; h++) {
            load_row(q, h * (N + P), N + P, bf, qh);
            if (cos_t) mla_rope(qh + N, P, c, sn, interleaved, split_out);
            for (long r = 0; r < R; r++) qlat[r] = 0.0f;
            for (long n = 0; n < N; n++) axpy_row(qlat, qh[n], w_kvb, (h * (N + V) + n) * R, R, w_bf);
            float m = -INFINITY;
            for (long t = 0; t < S; t++) {
                float acc = dotk_row(qlat, cache, t * width, R, cache_bf), acc2 = dotk_row(qh + N, cache, t * width + R, P, cache_bf);
                logit[t] = (acc + acc2) * scale;
                m = logit[t] > m ? logit[t] : m;
            }
            float z = 0.0f;
            for (long t = 0; t < S; t++) { logit[t] = expf(logit[t] - m); z += logit[t]; }
            for (long r = 0; r < R; r++) olat[r] = 0.0f;
            for (long t = 0; t < S; t++) axpyk_row(olat, logit[t] / z, cache, t * width, R, cache_bf);
            for (long vv = 0; vv < V; vv++)
                st(out, h * V + vv, dot_row(olat, w_kvb, (h * (N + V) + N + vv) * R, R, w_bf), bf);
        }
        free(logit);
    }
}

/* ------------------------------------------------------------------------------------------- moe (moe.py) */

/* moe.router_twin for one token: logits = W x (+ bias) in fp32 (W and x at one dtype, products exact in fp32),
 * then by ``router``: 1 softmax → top-k (→ renormalised when norm), 2 sigmoid (+ selection bias for the choice,
 * grouped: the topk_group groups with the largest sum of their two best choices) → top-k of the choice, weights
 * the sigmoid scores (renormalised with +1e-20 when norm), 3 top-k of the logits → softmax over them. Weights are
 * multiplied by ``scaling``; vals fp32 [k] and idx int64 [k] in descending order of the choice (ties: lower id).
 * bias / sel: fp32 or at the weight dtype (b_bf / s_bf), or NULL. E <= 4096, k <= 64 (checked by the caller). */
static long topk_desc(const float *v, long E, long k, int64_t *idx) {
    for (long s = 0; s < k; s++) {
        long best = -1;
        for (long e = 0; e < E; e++) {
            int taken = 0;
            for (long t = 0; t < s; t++) taken |= idx[t] == e;
            if (!taken && v[e] != -INFINITY && (best < 0 || v[e] > v[best])) best = e;
        }
        if (best < 0) return s;
        idx[s] = best;
    }
    return k;
}

void vxc_moe_router_step(const void *x, const void *W, const void *bias, const void *sel, float *vals, int64_t *idx,
                         long E, long d, int router, long k, int norm, float scaling, long n_group, long topk_group,
                         int bf, int b_bf, int s_bf) {
    float logits[4096], choice[4096];
#pragma omp parallel for schedule(static) if (E * d >= 262144)
    for (long n0 = 0; n0 < E; n0 += 4) {
        long n = E - n0 < 4 ? E - n0 : 4;
        float acc[4];
        dot4(W, x, n0, d, n, bf, acc);
        for (long r = 0; r < n; r++) logits[n0 + r] = acc[r] + (bias ? ld(bias, n0 + r, b_bf) : 0.0f);
    }
    if (router == 1) {
        float m = -INFINITY, z = 0.0f;
        for (long e = 0; e < E; e++) m = logits[e] > m ? logits[e] : m;
        for (long e = 0; e < E; e++) { choice[e] = expf(logits[e] - m); z += choice[e]; }
        for (long e = 0; e < E; e++) choice[e] /= z;
        topk_desc(choice, E, k, idx);
        float sum = 0.0f;
        for (long s = 0; s < k; s++) { vals[s] = choice[idx[s]]; sum += vals[s]; }
        if (norm) for (long s = 0; s < k; s++) vals[s] /= sum;
    } else if (router == 2) {
        float score[4096];
        for (long e = 0; e < E; e++) {
            score[e] = 1.0f / (1.0f + expf(-logits[e]));
            choice[e] = score[e] + (sel ? ld(sel, e, s_bf) : 0.0f);
        }
        if (n_group > 1) {
            long per = E / n_group, two = per < 2 ? per : 2;
            float gs[256];
            int64_t keep[256];
            for (long g = 0; g < n_group; g++) {
                int64_t top[2];
                topk_desc(choice + g * per, per, two, top);
                gs[g] = 0.0f;
                for (long t = 0; t < two; t++) gs[g] += choice[g * per + top[t]];
            }
            topk_desc(gs, n_group, topk_group, keep);
            for (long g = 0; g < n_group; g++) {
                int kept = 0;
                for (long t = 0; t < topk_group; t++) kept |= keep[t] == g;
                if (!kept) for (long e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
            }
        }
        topk_desc(choice, E, k, idx);
        float sum = 0.0f;
        for (long s = 0; s < k; s++) { vals[s] = score[idx[s]]; sum += vals[s]; }
        if (norm) for (long s = 0; s < k; s++) vals[s] /= (sum + 1e-20f);
    } else {
        topk_desc(logits, E, k, idx);
        float m = logits[idx[0]], z = 0.0f;
        for (long s = 0; s < k; s++) { vals[s] = expf(logits[idx[s]] - m); z += vals[s]; }
        for (long s = 0; s < k; s++) vals[s] /= z;
    }
    for (long s = 0; s < k; s++) vals[s] *= scaling;
}

/* One block of n (<= 4; fused: <= 2) intermediate units j0 .. j0 + n - 1 of an expert for one token x [d]: the gate
 * and up dots (fused: interleaved rows 2j, 2j + 1 of Wi, with their biases from b_in + bo), each rounded to the
 * activation dtype, the activation (a 1: silu(g)·u; else the clamped GLU) stored at h[ho ..] at that dtype. */
static inline __attribute__((always_inline)) void moe_act_block(const void *Wi, const void *Wu, const void *x, long j0,
                                                                 long n, long d, int fused, const void *b_in, long bo,
                                                                 int a, float alpha, float limit, int bf, void *h, long ho) {
    float g[4], u[4];
    if (fused) {
        float gu[4];
        dot4(Wi, x, 2 * j0, d, 2 * n, bf, gu);
        for (long r = 0; r < n; r++) {
            g[r] = rnd(gu[2 * r], bf);
            u[r] = rnd(gu[2 * r + 1], bf);
            if (b_in) {
                g[r] += ld(b_in, bo + 2 * (j0 + r), bf);
                u[r] += ld(b_in, bo + 2 * (j0 + r) + 1, bf);
            }
        }
    } else {
        dot4(Wi, x, j0, d, n, bf, g);
        dot4(Wu, x, j0, d, n, bf, u);
        for (long r = 0; r < n; r++) { g[r] = rnd(g[r], bf); u[r] = rnd(u[r], bf); }
    }
    for (long r = 0; r < n; r++) {
        float v;
        if (a == 1) {
            v = silu(g[r]) * u[r];
        } else {
            float gg = g[r] < limit ? g[r] : limit;
            float uu = u[r] < -limit ? -limit : (u[r] > limit ? limit : u[r]);
            v = (uu + 1.0f) * (gg * sigm(gg * alpha));
        }
        st(h, ho + r, v, bf);
    }
}

/* moe.experts_twin / moe.shared_twin for one token (T = 1): the k selected experts in ascending id order, each
 * y_e = down(act(gate x, up x)) (+ biases), accumulated as acc += y_e * weight_e onto acc = init (the routed sum
 * for the shared expert, else 0), then rounded once to the activation dtype.
 *   x [d]; experts int64 [k] (NULL: expert 0) and weights fp32 [k] (NULL: 1, or sigmoid(branch . x) when
 *   branch_gate [d] is given); banks: w_in [E, rows, d] (rows = I, or 2I interleaved gate/up when fused),
 *   w_up [E, I, d] or NULL (fused), w_down [E, d, I]; expert strides se_in, se_up, se_down (elements; each
 *   expert's matrix is contiguous); b_in [E, rows] / b_down [E, d] or NULL; act 1 silu(g)·u, 3 clamped GLU
 *   (g = min(g, limit), u = clamp(u, ±limit), (u + 1)·g·σ(αg)).
 * Rounding as the twin materialises values at the activation dtype (bf): each GEMV output, and the activation
 * fed to the down GEMV; biases and the weighted sum stay fp32.
 * Tensor parallel: the banks hold the ne experts e0 .. e0 + ne - 1 (global ids; bank row id - e0); a selected
 * expert outside them is another rank's and adds nothing (ne = 0: the experts' ids are not read, the shared
 * expert). */
void vxc_moe_ffn_step(const void *x, const int64_t *experts, const float *weights, long k, const void *w_in,
                      const void *w_up, const void *w_down, const void *b_in, const void *b_down,
                      const void *branch_gate, const void *init, void *out, long d, long I, long se_in, long se_up,
                      long se_down, int fused, int a, float alpha, float limit, int bf, long e0, long ne) {
    long order[64];
    float wts[64];
    long kk = 0;
    for (long s = 0; s < k && s < 64; s++) {
        long e = experts ? experts[s] - e0 : 0;
        if (experts && ne > 0 && (e < 0 || e >= ne)) continue; /* another rank's expert */
        order[kk] = e;
        wts[kk++] = weights ? weights[s] : 1.0f;
    }
    for (long s = 1; s < kk; s++) /* insertion sort by expert id: the twin visits experts ascending */
        for (long t = s; t > 0 && order[t - 1] > order[t]; t--) {
            long e = order[t]; order[t] = order[t - 1]; order[t - 1] = e;
            float w = wts[t]; wts[t] = wts[t - 1]; wts[t - 1] = w;
        }
    if (branch_gate) {
        float acc4[4];
        dot4(branch_gate, x, 0, d, 1, bf, acc4);
        wts[0] = sigm(rnd(acc4[0], bf));
    }
    float *acc = (float *)malloc((size_t)d * sizeof(float));
    void *h = malloc((size_t)I * sizeof(float)); /* the activation, at the activation dtype */
    for (long i = 0; i < d; i++) acc[i] = init ? ld(init, i, bf) : 0.0f;
    long rows_in = fused ? 2 * I : I;
#pragma omp parallel
    {
        for (long s = 0; s < kk; s++) {
            long e = order[s];
            float wt = wts[s];
            const char *Wi = (const char *)w_in + (size_t)(e * se_in) * (bf ? 2 : 4);
            const char *Wu = w_up ? (const char *)w_up + (size_t)(e * se_up) * (bf ? 2 : 4) : NULL;
            const char *Wd = (const char *)w_down + (size_t)(e * se_down) * (bf ? 2 : 4);
            long step = fused ? 2 : 4; /* intermediate units per block of four rows */
#pragma omp for schedule(static)
            for (long j0 = 0; j0 < I; j0 += step) {
                long n = I - j0 < step ? I - j0 : step;
                moe_act_block(Wi, Wu, x, j0, n, d, fused, b_in, e * rows_in, a, alpha, limit, bf, h, j0);
            }
#pragma omp for schedule(static)
            for (long n0 = 0; n0 < d; n0 += 4) {
                long n = d - n0 < 4 ? d - n0 : 4;
                float y[4];
                dot4(Wd, h, n0, I, n, bf, y);
                for (long r = 0; r < n; r++) {
                    float v = rnd(y[r], bf);
                    if (b_down) v += ld(b_down, e * d + n0 + r, bf);
                    acc[n0 + r] += v * wt;
                }
            }
        }
    }
    for (long i = 0; i < d; i++) st(out, i, acc[i], bf);
    free(acc);
    free(h);
}

/* vxc_moe_ffn_step for T rows of a batched decode step (T <= 16; x, init, out [T, d]; experts / weights [T, k]),
 * each row's values bit for bit the one-row call's: the same dot products, the same roundings, its experts added in
 * ascending order. What changes is the loop order: each selected expert is visited once for every row that chose it
 * (experts in ascending order; within one, its rows), each block of four weight rows dotted with every such row
 * while it is in cache, so a step reads an expert's matrices from memory once however many of its rows chose it
 * (the shared expert — experts NULL — once for all T rows, where T one-row calls read it T times). */
void vxc_moe_ffn_rows(const void *x, const int64_t *experts, const float *weights, long k, const void *w_in,
                      const void *w_up, const void *w_down, const void *b_in, const void *b_down,
                      const void *branch_gate, const void *init, void *out, long d, long I, long se_in, long se_up,
                      long se_down, int fused, int a, float alpha, float limit, int bf, long e0, long ne, long T) {
    if (T <= 0) return;
    if (T > 16 || k > 64) { /* (the Python side never asks: one-row calls) */
        long es = bf ? 2 : 4;
        for (long t = 0; t < T; t++)
            vxc_moe_ffn_step((const char *)x + t * d * es, experts ? experts + t * k : NULL, weights ? weights + t * k : NULL,
                             k, w_in, w_up, w_down, b_in, b_down, branch_gate, init ? (const char *)init + t * d * es : NULL,
                             (char *)out + t * d * es, d, I, se_in, se_up, se_down, fused, a, alpha, limit, bf, e0, ne);
        return;
    }
    const long es = bf ? 2 : 4;
    /* the (expert, row, weight) triples of every row, as the one-row call filters and orders them: sorted by expert,
     * then row (a stable insertion sort: a row's own experts stay in its ascending order) */
    long pe[16 * 64], pr[16 * 64];
    float pw[16 * 64];
    long np = 0;
    for (long t = 0; t < T; t++) {
        long kk = experts ? k : 1;
        for (long s = 0; s < kk && s < 64; s++) {
            long e = experts ? experts[t * k + s] - e0 : 0;
            if (experts && ne > 0 && (e < 0 || e >= ne)) continue; /* another rank's expert */
            float w = weights ? weights[t * k + s] : 1.0f;
            if (branch_gate) {
                float acc4[4];
                dot4(branch_gate, (const char *)x + t * d * es, 0, d, 1, bf, acc4);
                w = sigm(rnd(acc4[0], bf));
            }
            long j = np++;
            for (; j > 0 && (pe[j - 1] > e || (pe[j - 1] == e && pr[j - 1] > t)); j--) {
                pe[j] = pe[j - 1]; pr[j] = pr[j - 1]; pw[j] = pw[j - 1];
            }
            pe[j] = e; pr[j] = t; pw[j] = w;
        }
    }
    float *acc = (float *)malloc((size_t)(T * d) * sizeof(float));
    void *h = malloc((size_t)(T * I) * sizeof(float)); /* each row's activation, at the activation dtype */
    for (long t = 0; t < T; t++)
        for (long i = 0; i < d; i++) acc[t * d + i] = init ? ld(init, t * d + i, bf) : 0.0f;
    long rows_in = fused ? 2 * I : I;
#pragma omp parallel
    {
        for (long p0 = 0; p0 < np;) {
            long p1 = p0 + 1;
            while (p1 < np && pe[p1] == pe[p0]) p1++; /* pairs p0 .. p1 - 1: expert pe[p0] and its rows */
            long e = pe[p0];
            const char *Wi = (const char *)w_in + (size_t)(e * se_in) * es;
            const char *Wu = w_up ? (const char *)w_up + (size_t)(e * se_up) * es : NULL;
            const char *Wd = (const char *)w_down + (size_t)(e * se_down) * es;
            long step = fused ? 2 : 4; /* intermediate units per block of four rows */
#pragma omp for schedule(static)
            for (long j0 = 0; j0 < I; j0 += step) {
                long n = I - j0 < step ? I - j0 : step;
                for (long q = p0; q < p1; q++) {
                    long t = pr[q];
                    const char *xt = (const char *)x + t * d * es;
                    moe_act_block(Wi, Wu, xt, j0, n, d, fused, b_in, e * rows_in, a, alpha, limit, bf, h, t * I + j0);
                }
            }
#pragma omp for schedule(static)
            for (long n0 = 0; n0 < d; n0 += 4) {
                long n = d - n0 < 4 ? d - n0 : 4;
                for (long q = p0; q < p1; q++) {
                    long t = pr[q];
                    float y[4];
                    dot4(Wd, (const char *)h + t * I * es, n0, I, n, bf, y);
                    for (long r = 0; r < n; r++) {
                        float v = rnd(y[r], bf);
                        if (b_down) v += ld(b_down, e * d + n0 + r, bf);
                        acc[t * d + n0 + r] += v * pw[q];
                    }
                }
            }
            p0 = p1;
        }
    }
    for (long t = 0; t < T; t++)
        for (long i = 0; i < d; i++) st(out, t * d + i, acc[t * d + i], bf);
    free(acc);
    free(h);
}

/* --------------------------------------------------------------------------- activation (activation.py) */

/* activation.activation_twin: out = act(x) over n values at the activation dtype; kind 0 = relu², max(x, 0)²
 * (the square of a value of the activation dtype is exact in fp32: one rounding, as the reference's). */
void vxc_activation(const void *x, void *out, long n, int kind, int bf) {
    (void)kind; /* relu² is the only kind */
    if (!bf) {
        const float *xf = (const float *)x;
        float *of = (float *)out;
#pragma omp parallel for simd schedule(static) if (n >= ELT_PAR)
        for (long i = 0; i < n; i++) {
            float r = xf[i] > 0.0f ? xf[i] : 0.0f;
            of[i] = r * r;
        }
        return;
    }
#pragma omp parallel for schedule(static) if (n >= ELT_PAR)
    for (long c0 = 0; c0 < n; c0 += ELT_CHUNK) { /* bf16 by chunks, as vxc_gated_act */
        long m = n - c0 < ELT_CHUNK ? n - c0 : ELT_CHUNK;
        float v[ELT_CHUNK];
        load_row(x, c0, m, 1, v);
#pragma omp simd
        for (long i = 0; i < m; i++) {
            float r = v[i] > 0.0f ? v[i] : 0.0f;
            v[i] = r * r;
        }
        store_row(out, c0, m, 1, v);
    }
}

/* ------------------------------------------------------------------------------ combine (combine.py) */

/* combine.add_twin: out = x + y over n values at the activation dtype (the sum of two mixers side by side) */
void vxc_add(const void *x, const void *y, void *out, long n, int bf) {
    if (!bf) {
        const float *xf = (const float *)x, *yf = (const float *)y;
        float *of = (float *)out;
#pragma omp simd
        for (long i = 0; i < n; i++) of[i] = xf[i] + yf[i];
        return;
    }
    for (long i = 0; i < n; i++) st(out, i, ld(x, i, bf) + ld(y, i, bf), bf);
}

/* combine.scale_segments_twin over rows of width w: columns [ends[j-1], ends[j]) times scales[j] (fp32), the
 * product rounded once to the activation dtype; nseg segments, ends[nseg-1] == w. */
void vxc_scale_segments(const void *x, void *out, long rows, long w, int nseg, const long *ends, const float *scales,
                        int bf) {
    for (long r = 0; r < rows; r++) {
        long c0 = 0, base = r * w;
        for (int j = 0; j < nseg; j++) {
            float sc = scales[j];
            for (long c = c0; c < ends[j]; c++) st(out, base + c, ld(x, base + c, bf) * sc, bf);
            c0 = ends[j];
        }
    }
}

/* ----------------------------------------------------------------------------------------- quant (quant.py) */

/* GEMV on ggml block-quantised weights, decoded in registers (no dequantised copy of W):
 *   y[b, r] = sum_c W[r, c] x[b, c]     W: rows x cols as stored in GGUF (row r = row_bytes bytes of blocks),
 *                                       x: [B, cols] fp32 (bf = 0) or bf16 (bf = 1), y: [B, rows] fp32.
 * Encodings (the codes quant.py passes; layouts as vxc/ir/ggml.py's table and ggml-common.h):
 *   0 q8_0  32 values, 34 bytes: f16 d, int8 qs[32]                               w = d q
 *   1 q4_0  32 values, 18 bytes: f16 d, qs[16] (low nibbles 0..15, high 16..31)   w = d (q - 8)
 *   2 q4_1  32 values, 20 bytes: f16 d, f16 m, qs[16]                             w = d q + m
 *   3 q4_k 256 values, 144 bytes: f16 d, f16 dmin, scales[12] (eight 6-bit scales and mins), qs[128]:
 *          sub-block j (32 values) = nibble j & 1 of qs[32 (j >> 1) ..]           w = (d sc_j) q - (dmin m_j)
 *   4 q6_k 256 values, 210 bytes: ql[128], qh[64], int8 scales[16], f16 d; per 128-value half h, group k of
 *          32: low (k < 2) / high nibble of ql[64h + 32 (k & 1) ..], bits 2k..2k+1 of qh[32h ..];
 *          scale s_j per 16 values                                               w = (d s_j) (q - 32)
 *   5 q5_0  32 values, 22 bytes: f16 d, qh (u32: bit j the fifth bit of value j), qs[16] (as q4_0)
 *                                                                                 w = d (q - 16)
 *   7 q5_1  32 values, 24 bytes: f16 d, f16 m, qh (u32), qs[16] (as q5_0, no offset)  w = d q + m
 *   6 q5_k 256 values, 176 bytes: f16 d, f16 dmin, scales[12] (as q4_k), qh[32], qs[128]: sub-block j =
 *          nibble j & 1 of qs[32 (j >> 1) ..] with bit j of qh[..] as its fifth bit w = (d sc_j) q - (dmin m_j)
 * Each weight is decoded in registers to the fp32 value gguf.quants.dequantize gives it (w = s q + mn: the
 * group's scale s — d, or d sc_j for the k-quants — times the integer is exact, then one rounding adding the
 * min mn — q4_1's m, q4_k's -dmin m_j), and y accumulates w x in fp32 like any fp32 GEMV: the result is the
 * fp32 product with the dequantised matrix, up to summation order (ggml's own dot products instead sum the
 * integers times x per group and scale the sum, and split off the mins: that rounds differently, at ~1.3x
 * the floor tolerance of the fp32 reference on the miniatures). Rows run in tiles of four over OpenMP threads
 * (as vxc_gemv); each tile's scales are decoded once and its bytes read from memory once for all B rows of x
 * (in groups of QG: the accumulators stay in registers). vxc_qdequant decodes a range of rows to fp32 the same
 * way (the prefill path: a few rows at a time into a fast GEMM). */

enum { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q4_K = 3, Q6_K = 4, Q5_0 = 5, Q5_K = 6, Q5_1 = 7, Q2_K = 8, Q3_K = 9, IQ4_NL = 10,
       IQ4_XS = 11, IQ2_XXS = 12, IQ2_XS = 13, IQ2_S = 14, IQ3_XXS = 15, IQ3_S = 16, IQ1_S = 17, IQ1_M = 18, TQ1_0 = 19,
       TQ2_0 = 20, Q_COUNT = 21 };
static const long Q_BLOCK[Q_COUNT] = {32, 32, 32, 256, 256, 32, 256, 32, 256, 256, 32, 256,
                                      256, 256, 256, 256, 256, 256, 256, 256, 256};  /* values per block */
static const long Q_TSIZE[Q_COUNT] = {34, 18, 20, 144, 210, 22, 176, 24, 84, 110, 18, 136,
                                      66, 74, 82, 98, 110, 50, 56, 54, 66};  /* bytes per block */
/* iq4_nl / iq4_xs: the value of each 4-bit code (ggml's kvalues_iq4nl) */
static const int8_t IQ4_KV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static inline int q_iq4(int enc) { return enc == IQ4_NL || enc == IQ4_XS; }
/* The ternary formats (layouts as vxc/ir/ggml.py's table): value d (c - 1), c a code 0..2 and one f16 d per
 * 256-value block, its last two bytes. tq2_0: 2-bit codes in q2_k's order (group j of a block: bits 2 (j & 3) of
 * qs[32 (j >> 2) ..]); tq1_0: base-3 digits, digit k of byte v being ((v 3^k mod 256) 3) >> 8 — group j < 5:
 * digit j of qs[0..32); 5, 6: digits 2j - 10, 2j - 9 of qs[32..48) (16 values each); 7: digit 4 of qs[32..48),
 * then value 240 + 4k + l digit k of qh[l]. Every other path takes them as a format with one scale per 32
 * values (d, eight times a block) and integers c - 1. */
static inline int q_tern(int enc) { return enc == TQ1_0 || enc == TQ2_0; }
static inline int tq1_digit(unsigned v, int k) {
    static const unsigned P3[5] = {1, 3, 9, 27, 81};
    return (int)((((v * P3[k]) & 255u) * 3u) >> 8);
}
/* where group g's 16 code bytes (q4_0's nibble order) start in an iq4 row */
static inline long iq4_qs(int enc, long g) { return enc == IQ4_NL ? 18 * g + 2 : 136 * (g >> 3) + 8 + 16 * (g & 7); }
/* iq4_xs: the 6-bit scale of group j (0..7) of a super-block b */
static inline int iq4xs_scale(const uint8_t *b, int j) {
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    return (int)(((b[4 + j / 2] >> (4 * (j & 1))) & 15) | (((sh >> (2 * j)) & 3) << 4));
}
/* the formats whose value is s q + mn (a min per group) */
static inline int q_has_min(int enc) { return enc == Q4_1 || enc == Q4_K || enc == Q5_K || enc == Q5_1 || enc == Q2_K; }
/* the formats with a scale per 16 values (q6_k, q3_k; q2_k a scale and a min per 16): every other one has one per 32 */
static inline int q_s16(int enc) { return enc == Q6_K || enc == Q3_K || enc == Q2_K; }
/* a row's scales / mins (cols values): per 16 or per 32 values */
static inline long q_ns(int enc, long cols) { return q_s16(enc) ? cols / 16 : cols / 32; }
static inline long q_nm(int enc, long cols) { return enc == Q2_K ? cols / 16 : cols / 32; }
/* q5_0 / q5_1: where a block's fifth bits (u32) and nibbles start */
static inline long q5_qh(int enc) { return enc == Q5_1 ? 4 : 2; }
static inline long q5_qs(int enc) { return enc == Q5_1 ? 8 : 6; }

/* ---------------------------------------------------------------------------------------------------------
 * The grid formats (ggml's i-quants below 4 bits; codes 12-18; layouts and values as vxc/ir/ggml.py's table):
 * every 256-value super-block is decoded to fp32 into a row buffer (iq_block: gguf.quants.dequantize's values
 * bit for bit, in its operation order), and the GEMV multiplies the decoded row by each row of x in fp32
 * (iq_gemv; int8_block32 activations: x first rounded to its int8 blocks' values d q, the torch twin's
 * definition). int8_block32 activations on AVX-512 VNNI run on integers (IQ_A8 below: grid magnitudes times x's
 * bytes with the signs on x; iq3_s / iq3_xxs by byte plane where VBMI is built, IQ_PLANAR). No packed form.
 * The grids and ggml's ksigns_iq2xs table are handed over by Python (vxc_set_iq_tables) from gguf-py's
 * gguf.quants, the one copy vxc reads; until then the grid formats decode nothing (vxc_iq_ready() is 0). */
#define IQT_IQ2XXS 0     /* 256 entries x 8 */
#define IQT_IQ2XS 2048   /* 512 x 8 */
#define IQT_IQ2S 6144    /* 1024 x 8 */
#define IQT_IQ3XXS 14336 /* 256 x 4 */
#define IQT_IQ3S 15360   /* 512 x 4 */
#define IQT_IQ1S 17408   /* 2048 x 8 (values -1, 0, 1; iq1_s and iq1_m) */
#define IQT_KSIGNS 33792 /* 128 sign bytes */
#define IQT_BYTES 33920
static int8_t IQT[IQT_BYTES];
static int iq_ready = 0;

static inline int q_grid(int enc) { return enc >= IQ2_XXS && enc <= IQ1_M; }
/* CALL(E) with E the grid encoding enc as a constant (one specialised instance per encoding) */
#define IQ_SWITCH(enc, CALL)                                                                                             \
    switch (enc) {                                                                                                       \
    case IQ2_XXS: CALL(IQ2_XXS); break;                                                                                  \
    case IQ2_XS: CALL(IQ2_XS); break;                                                                                    \
    case IQ2_S: CALL(IQ2_S); break;                                                                                      \
    case IQ3_XXS: CALL(IQ3_XXS); break;                                                                                  \
    case IQ3_S: CALL(IQ3_S); break;                                                                                      \
    case IQ1_S: CALL(IQ1_S); break;                                                                                      \
    default: CALL(IQ1_M); break;                                                                                         \
    }

/* The iq3 grids by byte plane, for the integer row kernel's table lookups (iq_a8_row_planar): IQP3S[h][e] holds
 * byte 2h of iq3s grid entry e in its low nibble and byte 2h + 1 in its high one (iq3_s magnitudes are 1 .. 15);
 * IQP3XXS[p][e] byte p of iq3xxs entry e (magnitudes up to 62). Built from IQT when it is handed over. */
static uint8_t IQP3S[2][512] __attribute__((aligned(64)));
static uint8_t IQP3XXS[4][256] __attribute__((aligned(64)));
/* the iq2 grids (8 bytes an entry, magnitudes 8, 25, 43) as 2-bit codes 0, 1, 2: IQC2*[h][e] holds bytes 4h .. 4h + 3
 * of entry e, byte 4h + q at bits 2q */
static uint8_t IQC2XXS[2][256] __attribute__((aligned(64)));
static uint8_t IQC2XS[2][512] __attribute__((aligned(64)));
static uint8_t IQC2S[2][1024] __attribute__((aligned(64)));
static const uint8_t IQ2_MAG[3] = {8, 25, 43};
/* a code byte's four 2-bit codes to magnitudes by vpermb, which reads the low 6 bits: IQ2_UNPACK[q][i] is the magnitude
 * of code q of i (bits 2q; the fourth code after a shift by 2, through [2]) */
static uint8_t IQ2_UNPACK[3][64] __attribute__((aligned(64)));
/* the iq1 grid (values -1, 0, 1) as the unsigned bytes 8 (g + 1) = 0, 8, 16: iq1_m's integer row kernel's operand
 * (iq1m_a8_row) */
static uint8_t IQ1S8[2048 * 8] __attribute__((aligned(64)));

static int iq2_codes(const int8_t *grid, long n, uint8_t *codes) {
    for (long e = 0; e < n; e++)
        for (int h = 0; h < 2; h++) {
            uint8_t c = 0;
            for (int q = 0; q < 4; q++) {
                int v = grid[8 * e + 4 * h + q], k = v == 8 ? 0 : v == 25 ? 1 : v == 43 ? 2 : -1;
                if (k < 0) return -1;
                c |= (uint8_t)(k << (2 * q));
            }
            codes[h * n + e] = c;
        }
    return 0;
}

/* the tables in the order above (n must be IQT_BYTES): 0 on success */
int vxc_set_iq_tables(const int8_t *t, long n) {
    if (n != IQT_BYTES) return -1;
    for (int i = 0; i < 2048; i++)
        if (t[IQT_IQ3S + i] < 0 || t[IQT_IQ3S + i] > 15) return -2; /* not ggml's iq3s grid: no nibble packing */
    uint8_t c2xxs[512], c2xs[1024], c2s[2048]; /* checked whole before anything held changes */
    if (iq2_codes(t + IQT_IQ2XXS, 256, c2xxs) || iq2_codes(t + IQT_IQ2XS, 512, c2xs) || iq2_codes(t + IQT_IQ2S, 1024, c2s))
        return -2; /* not ggml's iq2 grids (values 8, 25, 43) */
    for (int i = 0; i < 2048 * 8; i++)
        if (t[IQT_IQ1S + i] < -1 || t[IQT_IQ1S + i] > 1) return -2; /* not ggml's iq1s grid */
    for (int i = 0; i < 2048 * 8; i++) IQ1S8[i] = (uint8_t)(8 * (t[IQT_IQ1S + i] + 1));
    memcpy(IQC2XXS, c2xxs, sizeof c2xxs);
    memcpy(IQC2XS, c2xs, sizeof c2xs);
    memcpy(IQC2S, c2s, sizeof c2s);
    for (int q = 0; q < 3; q++)
        for (int i = 0; i < 64; i++) IQ2_UNPACK[q][i] = IQ2_MAG[((i >> (2 * q)) & 3) % 3];
    memcpy(IQT, t, IQT_BYTES);
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 512; e++)
            IQP3S[h][e] = (uint8_t)((IQT[IQT_IQ3S + 4 * e + 2 * h] & 15) | (IQT[IQT_IQ3S + 4 * e + 2 * h + 1] & 15) << 4);
    for (int p = 0; p < 4; p++)
        for (int e = 0; e < 256; e++) IQP3XXS[p][e] = (uint8_t)IQT[IQT_IQ3XXS + 4 * e + p];
    iq_ready = 1;
    return 0;
}
int vxc_iq_ready(void) { return iq_ready; }
/* whether int8_block32 products on the grid formats run on integers (AVX-512 VNNI builds; else the fp32 decode) */
int vxc_iq_a8(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__BMI2__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

static inline uint32_t iq_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint32_t iq_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* 8 values: db * grid * sign (sign bit j of sg negates value j) */
static inline void iq_put8(float *o, float db, const int8_t *gr, unsigned sg) {
    for (int j = 0; j < 8; j++) {
        float v = db * (float)gr[j];
        o[j] = (sg >> j) & 1 ? -v : v;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__BMI2__)
#define IQ_VEC 1
/* AVX-512: each 64-value chunk of a super-block as grid magnitudes (u8), a 64-bit sign mask and a scale per four
 * values (iq_chunk: what the integer products read, below); iq1 as the integer 8 grid +- 1 at the scale dl / 8.
 * Decoded to fp32, a value is its scale times its signed integer: one rounding of the same real number gguf.quants
 * forms ((db grid) sign, dl (grid + delta): every such product is exact in fp32), so the same bits. */
static const int32_t IQ_LANES4[16] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};

/* ksigns of four 7-bit indices at bits 0, 7, 14, 21 of a: 32 sign bits, value order */
static inline uint32_t iq_ks4(uint32_t a) {
    const uint8_t *ks = (const uint8_t *)IQT + IQT_KSIGNS;
    return ks[a & 127] | (uint32_t)ks[(a >> 7) & 127] << 8 | (uint32_t)ks[(a >> 14) & 127] << 16 | (uint32_t)ks[(a >> 21) & 127] << 24;
}

/* grid entries assembled by scalar loads and inserts (on Zen 4 a vpgatherdd of 16 took ~6 ns, these ~4; a
 * vpgatherdq of 8 ~3.5 ns, these ~2; in the kernels, interleaved A/B: faster for iq2_xxs, iq2_s, iq3_xxs, iq1_s,
 * iq1_m, slower for iq3_s and iq2_xs, which keep their gathers): 16 entries of 4 bytes (iq3), 8 of 8 bytes (iq2, iq1) */
static inline __attribute__((always_inline)) __m512i iq_e4x16(const int8_t *t, const uint32_t *i) {
    __m128i g[4];
    for (int k = 0; k < 4; k++) {
        int32_t v0, v1, v2, v3;
        memcpy(&v0, t + 4 * i[4 * k], 4);
        memcpy(&v1, t + 4 * i[4 * k + 1], 4);
        memcpy(&v2, t + 4 * i[4 * k + 2], 4);
        memcpy(&v3, t + 4 * i[4 * k + 3], 4);
        g[k] = _mm_insert_epi32(_mm_insert_epi32(_mm_insert_epi32(_mm_cvtsi32_si128(v0), v1, 1), v2, 2), v3, 3);
    }
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(g[0]), g[1], 1), g[2], 2), g[3], 3);
}
static inline __attribute__((always_inline)) __m512i iq_e8x8(const int8_t *t, const uint32_t *i) {
    __m128i g[4];
    for (int k = 0; k < 4; k++) {
        int64_t v0, v1;
        memcpy(&v0, t + 8 * i[2 * k], 8);
        memcpy(&v1, t + 8 * i[2 * k + 1], 8);
        g[k] = _mm_insert_epi64(_mm_cvtsi64_si128(v0), v1, 1);
    }
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(g[0]), g[1], 1), g[2], 2), g[3], 3);
}

/* chunk c (values 64c .. 64c + 63) of super-block b: magnitudes (u8), signs, per-lane weight scales */
static inline __attribute__((always_inline)) void iq_chunk(int enc, const uint8_t *b, float d, int c, __m512i *mags,
                                                           __mmask64 *sgn, __m512 *ws) {
    const __m512i lanes4 = _mm512_loadu_si512((const void *)IQ_LANES4);
    switch (enc) {
    case IQ3_S: {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        idx = _mm512_mask_or_epi32(idx, (__mmask16)iq_u16(b + 66 + 2 * c), idx, _mm512_set1_epi32(256));
        *mags = _mm512_i32gather_epi32(idx, (const void *)(IQT + IQT_IQ3S), 4); /* (here a gather beat the inserts) */
        uint64_t m;
        memcpy(&m, b + 74 + 8 * c, 8);
        *sgn = m;
        unsigned sc = b[106 + c];
        *ws = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d * (float)(1 + 2 * (sc & 15))),
                                   _mm512_set1_ps(d * (float)(1 + 2 * (sc >> 4))));
        break;
    }
    case IQ3_XXS: {
        uint32_t idx[16];
        for (int k = 0; k < 16; k++) idx[k] = b[2 + 16 * c + k];
        *mags = iq_e4x16(IQT + IQT_IQ3XXS, idx);
        uint32_t a0 = iq_u32(b + 66 + 8 * c), a1 = iq_u32(b + 70 + 8 * c);
        *sgn = (uint64_t)iq_ks4(a0) | (uint64_t)iq_ks4(a1) << 32;
        *ws = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d * (0.5f + (float)(a0 >> 28)) * 0.5f),
                                   _mm512_set1_ps(d * (0.5f + (float)(a1 >> 28)) * 0.5f));
        break;
    }
    case IQ2_XXS: {
        const uint8_t *q0 = b + 2 + 16 * c, *q1 = q0 + 8;
        uint32_t idx[8] = {q0[0], q0[1], q0[2], q0[3], q1[0], q1[1], q1[2], q1[3]};
        *mags = iq_e8x8(IQT + IQT_IQ2XXS, idx);
        uint32_t a0 = iq_u32(q0 + 4), a1 = iq_u32(q1 + 4);
        *sgn = (uint64_t)iq_ks4(a0) | (uint64_t)iq_ks4(a1) << 32;
        *ws = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d * (0.5f + (float)(a0 >> 28)) * 0.25f),
                                   _mm512_set1_ps(d * (0.5f + (float)(a1 >> 28)) * 0.25f));
        break;
    }
    case IQ2_XS: {
        const uint8_t *ks = (const uint8_t *)IQT + IQT_KSIGNS;
        __m256i q = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        *mags = _mm512_i32gather_epi64(_mm256_and_si256(q, _mm256_set1_epi32(511)), (const void *)(IQT + IQT_IQ2XS), 8);
        uint64_t m = 0;
        for (int k = 0; k < 8; k++) m |= (uint64_t)ks[iq_u16(b + 2 + 16 * c + 2 * k) >> 9] << (8 * k);
        *sgn = m;
        unsigned s0 = b[66 + 2 * c], s1 = b[67 + 2 * c];
        __m128 sv = _mm_setr_ps(d * (0.5f + (float)(s0 & 15)) * 0.25f, d * (0.5f + (float)(s0 >> 4)) * 0.25f,
                                d * (0.5f + (float)(s1 & 15)) * 0.25f, d * (0.5f + (float)(s1 >> 4)) * 0.25f);
        *ws = _mm512_permutexvar_ps(lanes4, _mm512_castps128_ps512(sv));
        break;
    }
    case IQ2_S: {
        uint32_t idx[8], qh = iq_u16(b + 66 + 2 * c); /* 2 bits per entry */
        for (int k = 0; k < 8; k++) idx[k] = b[2 + 8 * c + k] | ((qh >> (2 * k)) & 3) << 8;
        *mags = iq_e8x8(IQT + IQT_IQ2S, idx);
        uint64_t m;
        memcpy(&m, b + 34 + 8 * c, 8);
        *sgn = m;
        unsigned s0 = b[74 + 2 * c], s1 = b[75 + 2 * c];
        __m128 sv = _mm_setr_ps(d * (0.5f + (float)(s0 & 15)) * 0.25f, d * (0.5f + (float)(s0 >> 4)) * 0.25f,
                                d * (0.5f + (float)(s1 & 15)) * 0.25f, d * (0.5f + (float)(s1 >> 4)) * 0.25f);
        *ws = _mm512_permutexvar_ps(lanes4, _mm512_castps128_ps512(sv));
        break;
    }
    case IQ1_S: {
        uint32_t h0 = iq_u16(b + 34 + 4 * c), h1 = iq_u16(b + 36 + 4 * c);
        uint32_t idx[8];
        for (int k = 0; k < 4; k++) {
            idx[k] = b[2 + 8 * c + k] | ((h0 >> (3 * k)) & 7) << 8;
            idx[k + 4] = b[6 + 8 * c + k] | ((h1 >> (3 * k)) & 7) << 8;
        }
        __m512i g = iq_e8x8(IQT + IQT_IQ1S, idx);
        __mmask64 neg = (h0 & 0x8000 ? 0xFFFFFFFFull : 0) | (h1 & 0x8000 ? 0xFFFFFFFF00000000ull : 0);
        __m512i g2 = _mm512_add_epi8(g, g), g4 = _mm512_add_epi8(g2, g2);
        __m512i v = _mm512_add_epi8(_mm512_add_epi8(g4, g4), _mm512_mask_blend_epi8(neg, _mm512_set1_epi8(1), _mm512_set1_epi8(-1)));
        *mags = _mm512_abs_epi8(v);
        *sgn = _mm512_movepi8_mask(v);
        *ws = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(d * (float)(2 * ((h0 >> 12) & 7) + 1) * 0.125f),
                                   _mm512_set1_ps(d * (float)(2 * ((h1 >> 12) & 7) + 1) * 0.125f));
        break;
    }
    default: { /* IQ1_M: d is the caller's (read from the scale words) */
        uint32_t qh = iq_u32(b + 32 + 4 * c); /* one nibble per entry: 3 index bits, the delta's sign */
        uint32_t idx[8];
        for (int k = 0; k < 8; k++) idx[k] = b[8 * c + k] | ((qh >> (4 * k)) & 7) << 8;
        __m512i g = iq_e8x8(IQT + IQT_IQ1S, idx);
        /* the entries whose delta is negative, on the scalar pipes (pext, pdep) */
        __mmask64 neg = _cvtu64_mask64(_pdep_u64(_pext_u32(qh, 0x88888888u), 0x0101010101010101ull) * 0xFF);
        __m512i g2 = _mm512_add_epi8(g, g), g4 = _mm512_add_epi8(g2, g2);
        __m512i v = _mm512_add_epi8(_mm512_add_epi8(g4, g4), _mm512_mask_blend_epi8(neg, _mm512_set1_epi8(1), _mm512_set1_epi8(-1)));
        *mags = _mm512_abs_epi8(v);
        *sgn = _mm512_movepi8_mask(v);
        uint32_t w = iq_u16(b + 48 + 2 * c);
        __m128 sv = _mm_setr_ps(d * (float)(2 * (w & 7) + 1) * 0.125f, d * (float)(2 * ((w >> 3) & 7) + 1) * 0.125f,
                                d * (float)(2 * ((w >> 6) & 7) + 1) * 0.125f, d * (float)(2 * ((w >> 9) & 7) + 1) * 0.125f);
        *ws = _mm512_permutexvar_ps(lanes4, _mm512_castps128_ps512(sv));
        break;
    }
    }
}

/* the f16 d of a grid super-block (iq1_m: from the top nibbles of its scale words) */
static inline float iq_d(int enc, const uint8_t *b) {
    if (enc != IQ1_M) return h2f(b);
    uint16_t h = (uint16_t)((iq_u16(b + 48) >> 12) | ((iq_u16(b + 50) >> 8) & 0xF0) | ((iq_u16(b + 52) >> 4) & 0xF00) |
                            (iq_u16(b + 54) & 0xF000));
    uint8_t hb[2];
    memcpy(hb, &h, 2);
    return h2f(hb);
}

/* iq1_m super-block b's 16 scales, lane l (2 s_l + 1) d / 8 for its values 16 l .. 16 l + 15 — the values (and the
 * roundings) iq_chunk forms a chunk's four of one by one. The integer row kernel takes a chunk's lanes from these by
 * one permute: the vector pipes are that kernel's bound, and iq_chunk's per-chunk scales cost ~16 of their operations.
 * The 137 iq1_m matrices of the 0.6B-model-shaped IQ1_M file (75 MB), 2 threads, from memory, interleaved in one
 * process with the previous build, two runs: one row of x 24.7 / 26.0 -> 22.5 / 22.5 ms, 8 rows 45.4 / 41.0 -> 42.0 /
 * 38.1 ms, the same bits (iq1_s, its chunk's two scales two broadcasts, measured level or slower this way: as it was;
 * x's int8 values offset by 9 against an unsigned 8 g + 10 table, in place of the sign mask: level at one row, slower
 * at 8, its offsets pushing x's rows out of L1). */
static inline __attribute__((always_inline)) __m512 iq1m_scales(const uint8_t *b, float d) {
    __m512i w = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                         _mm512_cvtepu16_epi32(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(const void *)(b + 48)))));
    __m512i s3 = _mm512_and_si512(_mm512_srlv_epi32(w, _mm512_setr_epi32(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9)),
                                  _mm512_set1_epi32(7));
    __m512 k = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(s3, s3), _mm512_set1_epi32(1)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(d), k), _mm512_set1_ps(0.125f));
}

static const int32_t IQ_QUARTER[4][16] = {{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
                                          {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
                                          {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11},
                                          {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};

/* chunk c of super-block b as signed int8 values (|w| <= 62; iq1: 8 grid +- 1) and their scale per four values:
 * what the fp32 decode and the GEMM's tile expansion read */
static inline __attribute__((always_inline)) __m512i iq_signed_chunk(int enc, const uint8_t *b, float d, int c, __m512 *ws) {
    __m512i mags;
    __mmask64 sgn;
    iq_chunk(enc, b, d, c, &mags, &sgn, ws);
    return _mm512_mask_sub_epi8(mags, sgn, _mm512_setzero_si512(), mags);
}

/* byte k of each dword lane of w as 16 fp32 values (lane l: byte 4l + k, an entry's of a plane or a chunk's value
 * 4l + k) — shifts, where extracting quarters and widening them took a shuffle each */
static inline __attribute__((always_inline)) __m512 iq_byte_f(__m512i w, int k) {
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(k == 3 ? w : _mm512_slli_epi32(w, 24 - 8 * k), 24));
}

/* quarter q of w: the extract's immediate spelled out per case, so a build below -O3 (VXC_NATIVE_CFLAGS=-O2, where
 * the loop over q is not unrolled) still compiles; at -O3 the switch folds away */
static inline __attribute__((always_inline)) __m128i iq_quarter(__m512i w, int q) {
    switch (q) {
    case 0: return _mm512_castsi512_si128(w);
    case 1: return _mm512_extracti32x4_epi32(w, 1);
    case 2: return _mm512_extracti32x4_epi32(w, 2);
    default: return _mm512_extracti32x4_epi32(w, 3);
    }
}

static inline __attribute__((always_inline)) void iq_block_enc(int enc, const uint8_t *b, float *o) {
    float d = iq_d(enc, b);
    for (int c = 0; c < 4; c++) {
        __m512 ws;
        __m512i w = iq_signed_chunk(enc, b, d, c, &ws);
        for (int q = 0; q < 4; q++) {
            __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(iq_quarter(w, q)));
            __m512 sc = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)IQ_QUARTER[q]), ws);
            _mm512_storeu_ps(o + 64 * c + 16 * q, _mm512_mul_ps(sc, f));
        }
    }
}

static void iq_block(int enc, const uint8_t *b, float *o) {
    if (!iq_ready) { /* no tables handed over: NaN, never a silent wrong value */
        for (int i = 0; i < 256; i++) o[i] = NAN;
        return;
    }
#define IQ_BLOCK(E) iq_block_enc(E, b, o)
    IQ_SWITCH(enc, IQ_BLOCK)
#undef IQ_BLOCK
}
#else
/* one super-block b of encoding enc -> 256 fp32 values */
static void iq_block(int enc, const uint8_t *b, float *o) {
    const uint8_t *ks = (const uint8_t *)IQT + IQT_KSIGNS;
    if (!iq_ready) { /* no tables handed over: NaN, never a silent wrong value */
        for (int i = 0; i < 256; i++) o[i] = NAN;
        return;
    }
    switch (enc) {
    case IQ2_XXS: {
        float d = h2f(b);
        for (int g = 0; g < 8; g++) {
            const uint8_t *q = b + 2 + 8 * g;
            uint32_t a1 = iq_u32(q + 4);
            float db = d * (0.5f + (float)(a1 >> 28)) * 0.25f;
            for (int k = 0; k < 4; k++)
                iq_put8(o + 32 * g + 8 * k, db, IQT + IQT_IQ2XXS + 8 * q[k], ks[(a1 >> (7 * k)) & 127]);
        }
        break;
    }
    case IQ2_XS: {
        float d = h2f(b);
        for (int k = 0; k < 32; k++) {
            uint32_t q = iq_u16(b + 2 + 2 * k);
            float db = d * (0.5f + (float)((b[66 + k / 4] >> (4 * ((k / 2) & 1))) & 15)) * 0.25f;
            iq_put8(o + 8 * k, db, IQT + IQT_IQ2XS + 8 * (q & 511), ks[q >> 9]);
        }
        break;
    }
    case IQ2_S: {
        float d = h2f(b);
        for (int k = 0; k < 32; k++) {
            unsigned idx = b[2 + k] | (((b[66 + k / 4] >> (2 * (k % 4))) & 3) << 8);
            float db = d * (0.5f + (float)((b[74 + k / 4] >> (4 * ((k / 2) & 1))) & 15)) * 0.25f;
            iq_put8(o + 8 * k, db, IQT + IQT_IQ2S + 8 * idx, b[34 + k]);
        }
        break;
    }
    case IQ3_XXS: {
        float d = h2f(b);
        for (int g = 0; g < 8; g++) {
            uint32_t a = iq_u32(b + 66 + 4 * g);
            float db = d * (0.5f + (float)(a >> 28)) * 0.5f;
            for (int k = 0; k < 4; k++) {
                int8_t gr[8];
                memcpy(gr, IQT + IQT_IQ3XXS + 4 * b[2 + 8 * g + 2 * k], 4);
                memcpy(gr + 4, IQT + IQT_IQ3XXS + 4 * b[2 + 8 * g + 2 * k + 1], 4);
                iq_put8(o + 32 * g + 8 * k, db, gr, ks[(a >> (7 * k)) & 127]);
            }
        }
        break;
    }
    case IQ3_S: {
        float d = h2f(b);
        for (int g = 0; g < 8; g++) {
            float db = d * (float)(1 + 2 * ((b[106 + g / 2] >> (4 * (g & 1))) & 15));
            for (int k = 0; k < 4; k++) {
                int8_t gr[8];
                for (int h = 0; h < 2; h++) {
                    int e = 8 * g + 2 * k + h;
                    unsigned idx = b[2 + e] | (((b[66 + e / 8] >> (e % 8)) & 1) << 8);
                    memcpy(gr + 4 * h, IQT + IQT_IQ3S + 4 * idx, 4);
                }
                iq_put8(o + 32 * g + 8 * k, db, gr, b[74 + 4 * g + k]);
            }
        }
        break;
    }
    case IQ1_S: {
        float d = h2f(b);
        for (int g = 0; g < 8; g++) {
            uint32_t h = iq_u16(b + 34 + 2 * g);
            float dl = d * (float)(2 * ((h >> 12) & 7) + 1), delta = h & 0x8000 ? -0.125f : 0.125f;
            for (int k = 0; k < 4; k++) {
                const int8_t *gr = IQT + IQT_IQ1S + 8 * (b[2 + 4 * g + k] | (((h >> (3 * k)) & 7) << 8));
                for (int j = 0; j < 8; j++) o[32 * g + 8 * k + j] = dl * ((float)gr[j] + delta);
            }
        }
        break;
    }
    default: { /* IQ1_M */
        uint32_t w[4];
        for (int k = 0; k < 4; k++) w[k] = iq_u16(b + 48 + 2 * k);
        uint8_t dh[2];
        uint16_t db16 = (uint16_t)((w[0] >> 12) | ((w[1] >> 8) & 0xF0) | ((w[2] >> 4) & 0xF00) | (w[3] & 0xF000));
        memcpy(dh, &db16, 2);
        float d = h2f(dh);
        for (int k = 0; k < 32; k++) {
            int i = k / 2; /* the 16-value group */
            float dl = d * (float)(2 * ((w[i / 4] >> (3 * (i % 4))) & 7) + 1);
            unsigned nib = (b[32 + k / 2] >> (4 * (k & 1))) & 15;
            float delta = nib & 8 ? -0.125f : 0.125f;
            const int8_t *gr = IQT + IQT_IQ1S + 8 * (b[k] | ((nib & 7) << 8));
            for (int j = 0; j < 8; j++) o[8 * k + j] = dl * ((float)gr[j] + delta);
        }
        break;
    }
    }
}

#endif

/* a row of cols values (whole super-blocks) of a grid format decoded to fp32 */
static void iq_row(int enc, const uint8_t *row, long cols, float *o) {
    for (long i = 0; i < cols / 256; i++) iq_block(enc, row + i * Q_TSIZE[enc], o + 256 * i);
}

/* y [B, rows] = x [B, cols] fp32 times W (grid format enc): each weight row decoded once for all B rows of x */
static void iq_gemv(int enc, const uint8_t *W, const float *x, float *y, long rows, long cols, long B) {
    long rb = cols / 256 * Q_TSIZE[enc];
#pragma omp parallel
    {
        float *w = (float *)malloc((size_t)cols * sizeof(float) + 64);
#pragma omp for schedule(static)
        for (long r = 0; r < rows; r++) {
            iq_row(enc, W + r * rb, cols, w);
            for (long b = 0; b < B; b++) y[b * rows + r] = dot1_f32(w, x + b * cols, cols);
        }
        free(w);
    }
}

#if defined(IQ_VEC)
/* fp32 activations on the grid formats the byte planes do not serve (iq1; every grid format in builds without
 * AVX-512 VBMI): each 64-value chunk decoded by iq_signed_chunk (signed integers, a scale per lane of four values)
 * and multiplied in place — byte k of each lane widened (iq_byte_f) against x laid out per chunk as [k][lane] — into
 * one sum per chunk, scaled once by its lanes' scales; where each weight row had been decoded to fp32 (a multiply
 * per value), stored and summed with one accumulator. Every row of x gets the same arithmetic whatever B (one row
 * fused; more: the row's widened values and lane scales stored once, then the same operations per row). 3072 x 1024,
 * Zen 4, 2 threads, interleaved in one process, one row of x: iq1_s 0.31 -> 0.19 ms, iq1_m 0.33 -> 0.22 (built
 * without VBMI: iq3_s 0.35 -> 0.22, iq2_xxs 0.28 -> 0.17, iq2_xs 0.35 -> 0.29); 2-9 rows level or faster (iq1_s 9
 * rows 0.85 -> 0.76). */
static void iq_chunk_x(const float *x, long B, long cols, float *xc) {
    for (long b = 0; b < B; b++)
        for (long c = 0; c < cols; c += 64)
            for (int k = 0; k < 4; k++)
                for (int l = 0; l < 16; l++) xc[b * cols + c + 16 * k + l] = x[b * cols + c + 4 * l + k];
}

/* one chunk's sum: s = sum_k (byte k of w) x_k, in the order k = 0..3 */
static inline __attribute__((always_inline)) __m512 iq_chunk_sum(const __m512 wk[4], const float *x) {
    __m512 s = _mm512_mul_ps(wk[0], _mm512_loadu_ps(x));
    s = _mm512_fmadd_ps(wk[1], _mm512_loadu_ps(x + 16), s);
    s = _mm512_fmadd_ps(wk[2], _mm512_loadu_ps(x + 32), s);
    return _mm512_fmadd_ps(wk[3], _mm512_loadu_ps(x + 48), s);
}

/* the stored row (widened values wf, lane scales wsv) against NX (1, 2) rows of x at xc, xc + cols: each row's
 * operations those of the fused one-row loop, in its order; results to y, y + rows */
static inline __attribute__((always_inline)) void iq_chunk_dot_stored(int NX, const float *wf, const float *wsv, const float *xc,
                                                                      long cols, float *y, long rows) {
    __m512 t[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (long c = 0; c < cols / 64; c++) {
        __m512 wk[4];
        for (int k = 0; k < 4; k++) wk[k] = _mm512_load_ps(wf + 64 * c + 16 * k);
        const __m512 ws = _mm512_load_ps(wsv + 16 * c);
        for (int j = 0; j < NX; j++) t[j] = _mm512_fmadd_ps(iq_chunk_sum(wk, xc + j * cols + 64 * c), ws, t[j]);
    }
    for (int j = 0; j < NX; j++) y[j * rows] = _mm512_reduce_add_ps(t[j]);
}

static inline __attribute__((always_inline)) void iq_chunked_rows(int enc, const uint8_t *W, const float *xc, float *y, long rows,
                                                                  long cols, long B, long r0, long r1, float *wf) {
    const long rb = cols / 256 * Q_TSIZE[enc];
    float *wsv = wf + cols;
    for (long r = r0; r < r1; r++) {
        const uint8_t *row = W + r * rb;
        if (B == 1) {
            __m512 tot = _mm512_setzero_ps();
            for (long sb = 0; sb < cols / 256; sb++) {
                const uint8_t *b = row + sb * Q_TSIZE[enc];
                const float d = iq_d(enc, b);
                for (int c = 0; c < 4; c++) {
                    __m512 ws, wk[4];
                    const __m512i w = iq_signed_chunk(enc, b, d, c, &ws);
                    for (int k = 0; k < 4; k++) wk[k] = iq_byte_f(w, k);
                    tot = _mm512_fmadd_ps(iq_chunk_sum(wk, xc + 256 * sb + 64 * c), ws, tot);
                }
            }
            y[r] = _mm512_reduce_add_ps(tot);
            continue;
        }
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *b = row + sb * Q_TSIZE[enc];
            const float d = iq_d(enc, b);
            for (int c = 0; c < 4; c++) {
                __m512 ws;
                const __m512i w = iq_signed_chunk(enc, b, d, c, &ws);
                for (int k = 0; k < 4; k++) _mm512_store_ps(wf + 256 * sb + 64 * c + 16 * k, iq_byte_f(w, k));
                _mm512_store_ps(wsv + 16 * (4 * sb + c), ws);
            }
        }
        for (long bx = 0; bx < B; bx += 2) { /* two rows of x a pass (independent chains) */
            if (B - bx >= 2) iq_chunk_dot_stored(2, wf, wsv, xc + bx * cols, cols, y + bx * rows + r, rows);
            else iq_chunk_dot_stored(1, wf, wsv, xc + bx * cols, cols, y + bx * rows + r, rows);
        }
    }
}

static void iq_gemv_chunked(int enc, const uint8_t *W, const float *x, float *y, long rows, long cols, long B) {
    float *xc = (float *)malloc((size_t)(B * cols) * sizeof(float));
    iq_chunk_x(x, B, cols, xc);
#pragma omp parallel
    {
        float *wf = (float *)aligned_alloc(64, (size_t)(cols + cols / 4) * sizeof(float));
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        long r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
#define IQ_CROWS(E) iq_chunked_rows(E, W, xc, y, rows, cols, B, r0, r1, wf)
        IQ_SWITCH(enc, IQ_CROWS)
#undef IQ_CROWS
        free(wf);
    }
    free(xc);
}
#endif

/* q4_k's eight 6-bit scales (sc) and mins (m) from the 12 scale bytes, as the bytes of two 64-bit words (scale /
 * min j in byte j): bytes 0-3 hold scales 0-3 in their low 6 bits and the top 2 bits of scales 4-7, bytes 4-7 the
 * same for the mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibbles) and of mins 4-7 (high nibbles). */
static inline void q4k_scale_min_words(const uint8_t *q, uint64_t *sc, uint64_t *m) {
    uint32_t w0, w1, w2;
    memcpy(&w0, q, 4);
    memcpy(&w1, q + 4, 4);
    memcpy(&w2, q + 8, 4);
    uint32_t s_lo = w0 & 0x3f3f3f3fu, s_hi = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    uint32_t m_lo = w1 & 0x3f3f3f3fu, m_hi = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
    *sc = (uint64_t)s_lo | (uint64_t)s_hi << 32;
    *m = (uint64_t)m_lo | (uint64_t)m_hi << 32;
}

/* q3_k's sixteen 6-bit scales (0..63, the stored values: the scale is d (v - 32)) from its 12 scale bytes, as
 * the bytes of two 64-bit words (scale j in byte j): bytes 0-7 hold the low 4 bits of scales 0-7 (low nibbles)
 * and 8-15 (high nibbles), bytes 8-11 their top 2 bits (scale j: bits 2 (j / 4) .. of byte 8 + j % 4) */
static inline void q3k_scale_words(const uint8_t *q, uint64_t *lo, uint64_t *hi) {
    uint32_t a0, a1, t;
    memcpy(&a0, q, 4);
    memcpy(&a1, q + 4, 4);
    memcpy(&t, q + 8, 4);
    const uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
    uint32_t w0 = (a0 & k2) | ((t & k1) << 4), w1 = (a1 & k2) | (((t >> 2) & k1) << 4);
    uint32_t w2 = ((a0 >> 4) & k2) | (((t >> 4) & k1) << 4), w3 = ((a1 >> 4) & k2) | (((t >> 6) & k1) << 4);
    *lo = (uint64_t)w0 | (uint64_t)w1 << 32;
    *hi = (uint64_t)w2 | (uint64_t)w3 << 32;
}

/* One row's group scales s (per 32 values; per 16 for q6_k) and mins mn (per 32 values; q4_1, q4_k: the
 * value is s q + mn) as fp32, the products as the reference forms them (d sc_j, dmin m_j: exact). Vectorised
 * with F16C / AVX2: the 32-value formats' f16 fields packed eight at a time through integer registers and
 * widened by one vcvtph2ps (a gather of the fields, or one conversion per block, cost more than the GEMV's
 * own work on this row: ~25% of a q4_0 call each); the k-quants' 6-/8-bit scales widened eight at a time. */
static inline __attribute__((always_inline)) void q_row_scales(int enc, const uint8_t *row, long nblk, float *s, float *mn) {
    long i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    if (enc == Q8_0 || enc == Q4_0 || enc == Q4_1 || enc == Q5_0 || enc == Q5_1 || enc == IQ4_NL) {
        const long T = Q_TSIZE[enc];
        for (; i + 8 <= nblk; i += 8) {
            uint64_t d0 = 0, d1 = 0, m0 = 0, m1 = 0; /* blocks i..i+3, i+4..i+7: their d (and q4_1's m) */
            for (int k = 0; k < 4; k++) {
                uint32_t h0, h1; /* a block's first 4 bytes: f16 d, then m (q4_1) or data */
                memcpy(&h0, row + (i + k) * T, 4);
                memcpy(&h1, row + (i + 4 + k) * T, 4);
                d0 |= (uint64_t)(h0 & 0xffffu) << (16 * k);
                d1 |= (uint64_t)(h1 & 0xffffu) << (16 * k);
                m0 |= (uint64_t)(h0 >> 16) << (16 * k);
                m1 |= (uint64_t)(h1 >> 16) << (16 * k);
            }
            _mm256_storeu_ps(s + i, _mm256_cvtph_ps(_mm_set_epi64x((long long)d1, (long long)d0)));
            if (enc == Q4_1 || enc == Q5_1) _mm256_storeu_ps(mn + i, _mm256_cvtph_ps(_mm_set_epi64x((long long)m1, (long long)m0)));
        }
    } else if (enc == Q4_K || enc == Q5_K) { /* (the same d, dmin and 12 scale bytes at the block's start) */
        for (; i < nblk; i++) {
            const uint8_t *b = row + i * Q_TSIZE[enc];
            uint64_t sc, m;
            q4k_scale_min_words(b + 4, &sc, &m);
            __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)));
            __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m)));
            _mm256_storeu_ps(s + 8 * i, _mm256_mul_ps(_mm256_set1_ps(h2f(b)), scf));
            /* -(dmin m): a sign flip (0 - v would turn -0 into +0, and dmin m = +0 must give -0 as the reference's d q - 0) */
            _mm256_storeu_ps(mn + 8 * i, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(b + 2)), mf), _mm256_set1_ps(-0.0f)));
        }
    } else if (enc == Q2_K) { /* scale (low nibble) and min (high) per 16 values */
        for (; i < nblk; i++) {
            const uint8_t *b = row + i * 84;
            __m128i sc = _mm_loadu_si128((const __m128i *)b), m15 = _mm_set1_epi8(15);
            __m128i lo = _mm_and_si128(sc, m15), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m15);
            __m256 d = _mm256_set1_ps(h2f(b + 80)), dm = _mm256_set1_ps(h2f(b + 82)), neg = _mm256_set1_ps(-0.0f);
            _mm256_storeu_ps(s + 16 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo))));
            _mm256_storeu_ps(s + 16 * i + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)))));
            _mm256_storeu_ps(mn + 16 * i, _mm256_xor_ps(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi))), neg));
            _mm256_storeu_ps(mn + 16 * i + 8, _mm256_xor_ps(_mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)))), neg));
        }
    } else if (enc == Q3_K) { /* d (v - 32) per 16 values */
        for (; i < nblk; i++) {
            const uint8_t *b = row + i * 110;
            uint64_t lo, hi;
            q3k_scale_words(b + 96, &lo, &hi);
            __m256 d = _mm256_set1_ps(h2f(b + 108));
            __m256i o = _mm256_set1_epi32(32);
            _mm256_storeu_ps(s + 16 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)lo)), o))));
            _mm256_storeu_ps(s + 16 * i + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)hi)), o))));
        }
    } else if (enc == Q6_K) {
        for (; i < nblk; i++) {
            const uint8_t *b = row + i * 210;
            __m256 d = _mm256_set1_ps(h2f(b + 208));
            __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
            _mm256_storeu_ps(s + 16 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
            _mm256_storeu_ps(s + 16 * i + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(sc, sc)))));
        }
    }
#endif
    for (; i < nblk; i++) {
        const uint8_t *b = row + i * Q_TSIZE[enc];
        if (enc == Q8_0 || enc == Q4_0 || enc == Q5_0 || enc == IQ4_NL) {
            s[i] = h2f(b);
        } else if (q_tern(enc)) {
            float d = h2f(b + Q_TSIZE[enc] - 2);
            for (int j = 0; j < 8; j++) s[8 * i + j] = d;
        } else if (enc == IQ4_XS) {
            float d = h2f(b);
            for (int j = 0; j < 8; j++) s[8 * i + j] = d * (float)(iq4xs_scale(b, j) - 32);
        } else if (enc == Q4_1 || enc == Q5_1) {
            s[i] = h2f(b);
            mn[i] = h2f(b + 2);
        } else if (enc == Q4_K || enc == Q5_K) {
            float d = h2f(b), dmin = h2f(b + 2);
            uint64_t sc, m;
            q4k_scale_min_words(b + 4, &sc, &m);
            for (int j = 0; j < 8; j++) {
                s[8 * i + j] = d * (float)((sc >> (8 * j)) & 0xff);
                mn[8 * i + j] = -(dmin * (float)((m >> (8 * j)) & 0xff));
            }
        } else if (enc == Q2_K) {
            float d = h2f(b + 80), dmin = h2f(b + 82);
            for (int j = 0; j < 16; j++) {
                s[16 * i + j] = d * (float)(b[j] & 15);
                mn[16 * i + j] = -(dmin * (float)(b[j] >> 4));
            }
        } else if (enc == Q3_K) {
            float d = h2f(b + 108);
            uint64_t lo, hi;
            q3k_scale_words(b + 96, &lo, &hi);
            for (int j = 0; j < 8; j++) {
                s[16 * i + j] = d * (float)((int)((lo >> (8 * j)) & 0xff) - 32);
                s[16 * i + 8 + j] = d * (float)((int)((hi >> (8 * j)) & 0xff) - 32);
            }
        } else {
            float d = h2f(b + 208);
            for (int j = 0; j < 16; j++) s[16 * i + j] = d * (float)(int8_t)b[192 + j];
        }
    }
}

/* The 32 integer values of group g (of 32 values) of a row, in order (q4_0 and q6_k with their offsets taken
 * off: q - 8, q - 32). The scalar form of the decoders below, and the scalar path's. */
static inline void q_group_ints(int enc, const uint8_t *row, long g, int8_t q[32]) {
    if (q_tern(enc)) {
        long j = g & 7;
        const uint8_t *b = row + Q_TSIZE[enc] * (g >> 3);
        for (int i = 0; i < 32; i++) {
            int c;
            if (enc == TQ2_0) c = (b[32 * (j >> 2) + i] >> (2 * (j & 3))) & 3;
            else if (j < 5) c = tq1_digit(b[i], (int)j);
            else if (j < 7 || i < 16) c = tq1_digit(b[32 + (i & 15)], (int)(2 * j - 10 + (i >> 4)));
            else c = tq1_digit(b[48 + ((i - 16) & 3)], (i - 16) >> 2);
            q[i] = (int8_t)(c - 1);
        }
    } else if (enc == Q8_0) {
        memcpy(q, row + 34 * g + 2, 32);
    } else if (enc == Q4_0 || enc == Q4_1) {
        const uint8_t *p = enc == Q4_0 ? row + 18 * g + 2 : row + 20 * g + 4;
        int off = enc == Q4_0 ? 8 : 0;
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)((p[i] & 15) - off);
            q[i + 16] = (int8_t)((p[i] >> 4) - off);
        }
    } else if (enc == Q4_K) {
        long j = g & 7;
        const uint8_t *p = row + 144 * (g >> 3) + 16 + 32 * (j >> 1);
        int sh = 4 * (int)(j & 1);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)((p[i] >> sh) & 15);
    } else if (enc == Q5_K) {
        long j = g & 7;
        const uint8_t *b = row + 176 * (g >> 3), *p = b + 48 + 32 * (j >> 1), *qh = b + 16;
        int sh = 4 * (int)(j & 1);
        for (int i = 0; i < 32; i++) q[i] = (int8_t)(((p[i] >> sh) & 15) | (((qh[i] >> j) & 1) << 4));
    } else if (q_iq4(enc)) {
        const uint8_t *p = row + iq4_qs(enc, g);
        for (int i = 0; i < 16; i++) {
            q[i] = IQ4_KV[p[i] & 15];
            q[i + 16] = IQ4_KV[p[i] >> 4];
        }
    } else if (enc == Q2_K || enc == Q3_K) { /* group j of a super-block: bits 2 (j & 3) of qs[32 (j >> 2) ..]; q3_k:
                                              * less 4 where bit j of hmask[..] is clear */
        long j = g & 7;
        const uint8_t *b = row + Q_TSIZE[enc] * (g >> 3), *p = b + (enc == Q2_K ? 16 : 32) + 32 * (j >> 2);
        int sh = 2 * (int)(j & 3);
        for (int i = 0; i < 32; i++)
            q[i] = (int8_t)(enc == Q2_K ? (p[i] >> sh) & 3 : (((p[i] >> sh) & 3) | (((b[i] >> j) & 1) << 2)) - 4);
    } else if (enc == Q5_0 || enc == Q5_1) {
        const uint8_t *b = row + Q_TSIZE[enc] * g, *p = b + q5_qs(enc);
        const int off = enc == Q5_0 ? 16 : 0;
        uint32_t qh;
        memcpy(&qh, b + q5_qh(enc), 4);
        for (int i = 0; i < 16; i++) {
            q[i] = (int8_t)(((p[i] & 15) | (((qh >> i) & 1) << 4)) - off);
            q[i + 16] = (int8_t)(((p[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - off);
        }
    } else {
        long j = g & 7, h = j >> 2, k = j & 3;
        const uint8_t *b = row + 210 * (g >> 3), *ql = b + 64 * h + 32 * (k & 1), *qh = b + 128 + 32 * h;
        int ns = 4 * (int)(k >> 1), hs = 2 * (int)k;
        for (int i = 0; i < 32; i++) q[i] = (int8_t)((((ql[i] >> ns) & 15) | (((qh[i] >> hs) & 3) << 4)) - 32);
    }
}

#if defined(__AVX2__)
/* tq1_0: group j's 32 lanes' multipliers 3^k (the digit each lane takes of its byte) */
static const uint16_t TQ1_MUL[8][32] __attribute__((aligned(64))) = {
#define TQ_R16(v) v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v
    {TQ_R16(1), TQ_R16(1)}, {TQ_R16(3), TQ_R16(3)}, {TQ_R16(9), TQ_R16(9)}, {TQ_R16(27), TQ_R16(27)},
    {TQ_R16(81), TQ_R16(81)}, {TQ_R16(1), TQ_R16(3)}, {TQ_R16(9), TQ_R16(27)},
    {TQ_R16(81), 1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27},
#undef TQ_R16
};
/* group g of a ternary row: its 32 codes 0..2 (unsigned bytes, value order). tq1_0's digits in 16-bit lanes:
 * (v 3^k) & 255, then times 3 over 256 as the high half of a product by 768. */
static inline __attribute__((always_inline)) __m256i tq_codes(int enc, const uint8_t *row, long g) {
    long j = g & 7;
    const uint8_t *b = row + Q_TSIZE[enc] * (g >> 3);
    if (enc == TQ2_0)
        return _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(b + 32 * (j >> 2))), _mm_cvtsi32_si128(2 * (int)(j & 3))),
                                _mm256_set1_epi8(3));
    __m128i lo, hi;
    if (j < 5) {
        lo = _mm_loadu_si128((const __m128i *)b);
        hi = _mm_loadu_si128((const __m128i *)(b + 16));
    } else {
        lo = _mm_loadu_si128((const __m128i *)(b + 32));
        hi = j < 7 ? lo : _mm_shuffle_epi8(_mm_cvtsi32_si128((int)iq_u32(b + 48)), _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3));
    }
    const __m256i ff = _mm256_set1_epi16(255), k3 = _mm256_set1_epi16(768);
    __m256i v0 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(lo), _mm256_load_si256((const __m256i *)TQ1_MUL[j]));
    __m256i v1 = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(hi), _mm256_load_si256((const __m256i *)(TQ1_MUL[j] + 16)));
    v0 = _mm256_mulhi_epu16(_mm256_and_si256(v0, ff), k3);
    v1 = _mm256_mulhi_epu16(_mm256_and_si256(v1, ff), k3);
    return _mm256_permute4x64_epi64(_mm256_packus_epi16(v0, v1), 0xd8);
}
#endif

/* the row kernels (vxc_qgemv, vxc_qgemv_a8) prefetch each unit of a row Q_PF_ROWS rows ahead, one unit per row step;
 * 4 rows (the next tile) was too close: Intel Xeon, 2 threads, qwen3-0.6b-shaped matrices in one sweep, interleaved
 * A/B, vxc_qgemv one row: q4_0 32.2 -> 28.6 ms, q4_k 28.9 -> 24.4 ms, q8_0 45.8 -> 42.7 ms at 16 rows (8-32 level) */
#ifndef Q_PF_ROWS
#define Q_PF_ROWS 16
#endif
#if defined(__AVX512F__)
#define QG 4 /* rows of x per pass over a tile */
#define QU(enc) ((enc) == Q4_K || (enc) == Q5_K ? 2 : 1) /* groups of 32 per decode unit */
/* Unit u (QU groups of 32 values) of a row as its fp32 weights, 16 per vector in element order, each rounded
 * as gguf.quants.dequantize rounds it (w = s q + mn, s q exact, then one rounding: an fma gives the same).
 * The 4-bit formats look both nibbles up in a 16-entry table of the group's weights (s k + mn for k = 0..15,
 * one fma per 32 values; vpermps reads an index's low 4 bits: the low nibble as it stands, the high one after
 * a shift); q8_0 and q6_k widen their integers and scale them. s, mn: the row's group scales and mins. */
static inline __attribute__((always_inline)) void q_w512(int enc, const uint8_t *row, long u, const float *s,
                                                          const float *mn, __m512 *w) {
    if (enc == Q8_0) {
        const uint8_t *p = row + 34 * u + 2;
        __m512 sv = _mm512_set1_ps(s[u]);
        w[0] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))));
        w[1] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)))));
    } else if (enc == Q4_0 || enc == Q4_1 || q_iq4(enc)) { /* (iq4: the table of its levels, s kv: exact products) */
        const __m512 k = enc == Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                       : enc == Q4_1 ? _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
                                     : _mm512_setr_ps(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        __m512 lut = enc != Q4_1 ? _mm512_mul_ps(_mm512_set1_ps(s[u]), k)
                                 : _mm512_fmadd_ps(_mm512_set1_ps(s[u]), k, _mm512_set1_ps(mn[u]));
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q_iq4(enc) ? row + iq4_qs(enc, u)
                                                                           : enc == Q4_0 ? row + 18 * u + 2 : row + 20 * u + 4)));
        w[0] = _mm512_permutexvar_ps(v, lut);
        w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), lut);
    } else if (enc == Q5_0 || enc == Q5_1) { /* the nibbles, each with its fifth bit from qh (a masked 16); q5_0
                                              * less 16, q5_1 plus its min (an fma: s q is exact) */
        const uint8_t *b = row + Q_TSIZE[enc] * u;
        uint32_t qh;
        memcpy(&qh, b + q5_qh(enc), 4);
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + q5_qs(enc))));
        __m512i m15 = _mm512_set1_epi32(15), o = _mm512_set1_epi32(enc == Q5_0 ? -16 : 0), hb = _mm512_set1_epi32(16);
        __m512i q0 = _mm512_add_epi32(_mm512_or_si512(_mm512_and_si512(v, m15), _mm512_maskz_mov_epi32((__mmask16)(qh & 0xffffu), hb)), o);
        __m512i q1 = _mm512_add_epi32(_mm512_or_si512(_mm512_srli_epi32(v, 4), _mm512_maskz_mov_epi32((__mmask16)(qh >> 16), hb)), o);
        __m512 sv = _mm512_set1_ps(s[u]);
        if (enc == Q5_1) {
            __m512 mv = _mm512_set1_ps(mn[u]);
            w[0] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(q0), mv);
            w[1] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(q1), mv);
        } else {
            w[0] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(q0));
            w[1] = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(q1));
        }
    } else if (enc == Q4_K) { /* sub-blocks 2p (low nibbles) and 2p + 1 (high) of super-block u / 4 */
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        __m512 lut0 = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * u]), k, _mm512_set1_ps(mn[2 * u]));
        __m512 lut1 = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * u + 1]), k, _mm512_set1_ps(mn[2 * u + 1]));
        const uint8_t *p = row + 144 * (u >> 2) + 16 + 32 * (u & 3);
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        w[0] = _mm512_permutexvar_ps(v0, lut0);
        w[1] = _mm512_permutexvar_ps(v1, lut0);
        w[2] = _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), lut1);
        w[3] = _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), lut1);
    } else if (enc == Q5_K) { /* as q4_k, each index with its fifth bit from qh: a 32-entry table in two vectors */
        const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), k16 = _mm512_set1_ps(16);
        __m512 s0 = _mm512_set1_ps(s[2 * u]), s1 = _mm512_set1_ps(s[2 * u + 1]);
        __m512 m0 = _mm512_set1_ps(mn[2 * u]), m1 = _mm512_set1_ps(mn[2 * u + 1]);
        __m512 lut0 = _mm512_fmadd_ps(s0, k, m0), lut0h = _mm512_fmadd_ps(s0, _mm512_add_ps(k, k16), m0);
        __m512 lut1 = _mm512_fmadd_ps(s1, k, m1), lut1h = _mm512_fmadd_ps(s1, _mm512_add_ps(k, k16), m1);
        const uint8_t *b = row + 176 * (u >> 2), *p = b + 48 + 32 * (u & 3), *qh = b + 16;
        const int j0 = 2 * (int)(u & 3);
        const __m512i m15 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16)));
        __m512i h0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qh));
        __m512i h1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16)));
        __m512i i00 = _mm512_or_si512(_mm512_and_si512(v0, m15), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h0, j0), one), 4));
        __m512i i01 = _mm512_or_si512(_mm512_and_si512(v1, m15), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h1, j0), one), 4));
        __m512i i10 = _mm512_or_si512(_mm512_srli_epi32(v0, 4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h0, j0 + 1), one), 4));
        __m512i i11 = _mm512_or_si512(_mm512_srli_epi32(v1, 4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h1, j0 + 1), one), 4));
        w[0] = _mm512_permutex2var_ps(lut0, i00, lut0h);
        w[1] = _mm512_permutex2var_ps(lut0, i01, lut0h);
        w[2] = _mm512_permutex2var_ps(lut1, i10, lut1h);
        w[3] = _mm512_permutex2var_ps(lut1, i11, lut1h);
    } else if (q_tern(enc)) { /* each code's weight looked up in the table d (c - 1) (vpermps reads an index's low 4 bits:
                               * entry i is d ((i & 3) - 1)); tq2_0 straight from the stored bytes shifted by 2 (j & 3) */
        const __m512 lut = _mm512_mul_ps(_mm512_set1_ps(s[u]), _mm512_setr_ps(-1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2, -1, 0, 1, 2));
        if (enc == TQ2_0) {
            long j = u & 7;
            const uint8_t *p = row + 66 * (u >> 3) + 32 * (j >> 2);
            const int sh = 2 * (int)(j & 3);
            w[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), sh), lut);
            w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))), sh), lut);
        } else {
            __m256i q = tq_codes(enc, row, u);
            w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)), lut);
            w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)), lut);
        }
    } else if (enc == Q2_K || enc == Q3_K) { /* group u & 7 of super-block u / 8: 2 bits of 32 qs bytes (q3_k: with its
                                              * hmask bit, less 4), widened, scaled per 16 (q2_k: plus its min) */
        long j = u & 7;
        const uint8_t *bl = row + Q_TSIZE[enc] * (u >> 3);
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(bl + (enc == Q2_K ? 16 : 32) + 32 * (j >> 2))),
                                                      _mm_cvtsi32_si128(2 * (int)(j & 3))), _mm256_set1_epi8(3));
        if (enc == Q3_K) {
            __m256i h = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)bl), _mm_cvtsi32_si128((int)j)), _mm256_set1_epi8(1));
            q = _mm256_sub_epi8(_mm256_or_si256(q, _mm256_slli_epi16(h, 2)), _mm256_set1_epi8(4));
        }
        __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
        if (enc == Q2_K) {
            w[0] = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * u]), q0, _mm512_set1_ps(mn[2 * u]));
            w[1] = _mm512_fmadd_ps(_mm512_set1_ps(s[2 * u + 1]), q1, _mm512_set1_ps(mn[2 * u + 1]));
        } else {
            w[0] = _mm512_mul_ps(_mm512_set1_ps(s[2 * u]), q0);
            w[1] = _mm512_mul_ps(_mm512_set1_ps(s[2 * u + 1]), q1);
        }
    } else { /* q6_k: the 6-bit values assembled 32 bytes at a time (256-bit byte ops), widened, scaled per 16 */
        long j = u & 7, h = j >> 2, kk = j & 3;
        const uint8_t *bl = row + 210 * (u >> 3), *ql = bl + 64 * h + 32 * (kk & 1), *qh = bl + 128 + 32 * h;
        __m128i ns = _mm_cvtsi32_si128(4 * (int)(kk >> 1)), hs = _mm_cvtsi32_si128(2 * (int)kk);
        __m256i l = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)ql), ns), _mm256_set1_epi8(15));
        __m256i hh = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)qh), hs), _mm256_set1_epi8(3));
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(hh, 4)), _mm256_set1_epi8(32));
        w[0] = _mm512_mul_ps(_mm512_set1_ps(s[2 * u]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
        w[1] = _mm512_mul_ps(_mm512_set1_ps(s[2 * u + 1]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
    }
}

/* the weights of unit u stored to out (32 QU floats) */
static inline __attribute__((always_inline)) void q_wunit(int enc, const uint8_t *row, long u, const float *s,
                                                           const float *mn, float *out) {
    __m512 w[4];
    q_w512(enc, row, u, s, mn, w);
    for (int i = 0; i < 2 * QU(enc); i++) _mm512_storeu_ps(out + 16 * i, w[i]);
}

/* R (1 or 4) rows from W (stride rb bytes) against NB (1..QG) rows of x (stride cols): out[r][b] = sum_c
 * W[r, c] x[b, c], the weights decoded once per unit for all NB rows. s, mn: the rows' group scales and mins
 * (strides ns, nm). */
static inline __attribute__((always_inline)) void q_tile(int enc, const uint8_t *W, long rb, int R, const float *x,
                                                          long cols, int NB, const float *s, long ns, const float *mn,
                                                          long nm, float out[4][QG]) {
    __m512 acc[4][QG];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    const int NV = 2 * QU(enc); /* vectors per unit */
    long nu = cols / (32 * QU(enc));
    for (long u = 0; u < nu; u++) {
        const float *xu = x + 32 * QU(enc) * u;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512 w[4];
            const uint8_t *row = W + r * rb;
            if (R == 4) _mm_prefetch((const char *)(row + Q_PF_ROWS * rb + u * QU(enc) * Q_TSIZE[enc] * 32 / Q_BLOCK[enc]), _MM_HINT_T0);
            q_w512(enc, row, u, s + r * ns, mn + r * nm, w);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++)
#pragma GCC unroll 4
                for (int i = 0; i < NV; i++) acc[r][b] = _mm512_fmadd_ps(w[i], _mm512_loadu_ps(xu + b * cols + 16 * i), acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) out[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define QG 2
static inline __m256 q_cvt8(__m128i v, int sign) { /* the low 8 bytes of v as 8 floats */
    return _mm256_cvtepi32_ps(sign ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v));
}

/* group g's 32 weights as four vectors of 8 floats, rounded as gguf.quants.dequantize rounds them: the integer
 * values (offsets taken off), times the group's scale (per 16 values for q6_k), plus its min (q4_1, q4_k; an
 * fma: s q is exact, so one rounding either way) */
static inline __attribute__((always_inline)) void q_w256(int enc, const uint8_t *row, long g, const float *s,
                                                          const float *mn, __m256 w[4]) {
    __m128i a, b, m4 = _mm_set1_epi8(15);
    if (enc == Q8_0) {
        const uint8_t *p = row + 34 * g + 2;
        a = _mm_loadu_si128((const __m128i *)p);
        b = _mm_loadu_si128((const __m128i *)(p + 16));
    } else if (enc == Q4_0 || enc == Q4_1) {
        const uint8_t *p = enc == Q4_0 ? row + 18 * g + 2 : row + 20 * g + 4;
        __m128i v = _mm_loadu_si128((const __m128i *)p);
        a = _mm_and_si128(v, m4);
        b = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
        if (enc == Q4_0) {
            a = _mm_sub_epi8(a, _mm_set1_epi8(8));
            b = _mm_sub_epi8(b, _mm_set1_epi8(8));
        }
    } else if (q_iq4(enc)) { /* the nibbles' levels, looked up 16 at a time */
        const __m128i kv = _mm_loadu_si128((const __m128i *)IQ4_KV);
        __m128i v = _mm_loadu_si128((const __m128i *)(row + iq4_qs(enc, g)));
        a = _mm_shuffle_epi8(kv, _mm_and_si128(v, m4));
        b = _mm_shuffle_epi8(kv, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    } else if (enc == Q5_0 || enc == Q5_1) { /* as q4_0, each byte's fifth bit spread from qh (bit i -> byte i: 16 or
                                              * 0); q5_0 less 16 */
        const uint8_t *p = row + Q_TSIZE[enc] * g;
        uint32_t qh;
        memcpy(&qh, p + q5_qh(enc), 4);
        __m128i v = _mm_loadu_si128((const __m128i *)(p + q5_qs(enc)));
        const __m128i bits = _mm_set1_epi64x((long long)0x8040201008040201ULL), spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        __m128i hl = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh & 0xffffu)), spread);
        __m128i hh = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh >> 16)), spread);
        hl = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hl, bits), bits), _mm_set1_epi8(16));
        hh = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(hh, bits), bits), _mm_set1_epi8(16));
        const __m128i o16 = _mm_set1_epi8(enc == Q5_0 ? 16 : 0);
        a = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(v, m4), hl), o16);
        b = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(_mm_srli_epi16(v, 4), m4), hh), o16);
    } else if (enc == Q4_K) {
        long j = g & 7;
        const uint8_t *p = row + 144 * (g >> 3) + 16 + 32 * (j >> 1);
        __m128i sh = _mm_cvtsi32_si128(4 * (int)(j & 1));
        a = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), sh), m4);
        b = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(p + 16)), sh), m4);
    } else if (enc == Q5_K) { /* as q4_k, with bit j of qh[..] as each value's fifth bit (16 or 0) */
        long j = g & 7;
        const uint8_t *bl = row + 176 * (g >> 3), *p = bl + 48 + 32 * (j >> 1), *qh = bl + 16;
        __m128i sh = _mm_cvtsi32_si128(4 * (int)(j & 1)), hs = _mm_cvtsi32_si128((int)j), one = _mm_set1_epi8(1);
        __m128i h0 = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)qh), hs), one), 4);
        __m128i h1 = _mm_slli_epi16(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16)), hs), one), 4);
        a = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), sh), m4), h0);
        b = _mm_or_si128(_mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(p + 16)), sh), m4), h1);
    } else if (q_tern(enc)) { /* the codes less 1 */
        __m256i q = _mm256_sub_epi8(tq_codes(enc, row, g), _mm256_set1_epi8(1));
        a = _mm256_castsi256_si128(q);
        b = _mm256_extracti128_si256(q, 1);
    } else if (enc == Q2_K || enc == Q3_K) { /* 2 bits of qs (q3_k: with its hmask bit, less 4) */
        long j = g & 7;
        const uint8_t *bl = row + Q_TSIZE[enc] * (g >> 3), *p = bl + (enc == Q2_K ? 16 : 32) + 32 * (j >> 2);
        __m128i sh = _mm_cvtsi32_si128(2 * (int)(j & 3)), m2 = _mm_set1_epi8(3);
        a = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)p), sh), m2);
        b = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(p + 16)), sh), m2);
        if (enc == Q3_K) {
            __m128i hs = _mm_cvtsi32_si128((int)j), one = _mm_set1_epi8(1), o = _mm_set1_epi8(4);
            __m128i h0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)bl), hs), one);
            __m128i h1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(bl + 16)), hs), one);
            a = _mm_sub_epi8(_mm_or_si128(a, _mm_slli_epi16(h0, 2)), o);
            b = _mm_sub_epi8(_mm_or_si128(b, _mm_slli_epi16(h1, 2)), o);
        }
    } else {
        long j = g & 7, h = j >> 2, k = j & 3;
        const uint8_t *bl = row + 210 * (g >> 3), *ql = bl + 64 * h + 32 * (k & 1), *qh = bl + 128 + 32 * h;
        __m128i ns = _mm_cvtsi32_si128(4 * (int)(k >> 1)), hs = _mm_cvtsi32_si128(2 * (int)k);
        __m128i m2 = _mm_set1_epi8(3), o = _mm_set1_epi8(32);
        __m128i l0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)ql), ns), m4);
        __m128i l1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(ql + 16)), ns), m4);
        __m128i h0 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)qh), hs), m2);
        __m128i h1 = _mm_and_si128(_mm_srl_epi16(_mm_loadu_si128((const __m128i *)(qh + 16)), hs), m2);
        a = _mm_sub_epi8(_mm_or_si128(l0, _mm_slli_epi16(h0, 4)), o);
        b = _mm_sub_epi8(_mm_or_si128(l1, _mm_slli_epi16(h1, 4)), o);
    }
    int sign = !q_has_min(enc);
    w[0] = q_cvt8(a, sign);
    w[1] = q_cvt8(_mm_unpackhi_epi64(a, a), sign);
    w[2] = q_cvt8(b, sign);
    w[3] = q_cvt8(_mm_unpackhi_epi64(b, b), sign);
    if (enc == Q2_K) {
        __m256 s0 = _mm256_set1_ps(s[2 * g]), s1 = _mm256_set1_ps(s[2 * g + 1]);
        __m256 m0 = _mm256_set1_ps(mn[2 * g]), m1 = _mm256_set1_ps(mn[2 * g + 1]);
        w[0] = _mm256_fmadd_ps(s0, w[0], m0);
        w[1] = _mm256_fmadd_ps(s0, w[1], m0);
        w[2] = _mm256_fmadd_ps(s1, w[2], m1);
        w[3] = _mm256_fmadd_ps(s1, w[3], m1);
    } else if (q_s16(enc)) {
        __m256 s0 = _mm256_set1_ps(s[2 * g]), s1 = _mm256_set1_ps(s[2 * g + 1]);
        w[0] = _mm256_mul_ps(s0, w[0]);
        w[1] = _mm256_mul_ps(s0, w[1]);
        w[2] = _mm256_mul_ps(s1, w[2]);
        w[3] = _mm256_mul_ps(s1, w[3]);
    } else {
        __m256 sv = _mm256_set1_ps(s[g]);
        if (q_has_min(enc)) {
            __m256 mv = _mm256_set1_ps(mn[g]);
            for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(sv, w[i], mv);
        } else {
            for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(sv, w[i]);
        }
    }
}

#define QU(enc) 1
static inline __attribute__((always_inline)) void q_wunit(int enc, const uint8_t *row, long g, const float *s,
                                                           const float *mn, float *out) {
    __m256 w[4];
    q_w256(enc, row, g, s, mn, w);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(out + 8 * i, w[i]);
}

static inline __attribute__((always_inline)) void q_tile(int enc, const uint8_t *W, long rb, int R, const float *x,
                                                          long cols, int NB, const float *s, long ns, const float *mn,
                                                          long nm, float out[4][QG]) {
    __m256 acc[4][QG];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm256_setzero_ps();
    long ng = cols / 32;
    for (long g = 0; g < ng; g++) {
        const float *xg = x + 32 * g;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m256 w[4];
            const uint8_t *row = W + r * rb;
            if (R == 4) _mm_prefetch((const char *)(row + Q_PF_ROWS * rb + g * Q_TSIZE[enc] * 32 / Q_BLOCK[enc]), _MM_HINT_T0);
            q_w256(enc, row, g, s + r * ns, mn + r * nm, w);
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++)
                for (int i = 0; i < 4; i++) acc[r][b] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xg + b * cols + 8 * i), acc[r][b]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r][b]), _mm256_extractf128_ps(acc[r][b], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[r][b] = _mm_cvtss_f32(v);
        }
}
#else
#define QG 4
#define QU(enc) 1
/* group g's 32 weights, rounded as gguf.quants.dequantize rounds them (s q exact, then + mn) */
static inline void q_wunit(int enc, const uint8_t *row, long g, const float *s, const float *mn, float *out) {
    int8_t q[32];
    q_group_ints(enc, row, g, q);
    for (int i = 0; i < 32; i++) {
        float sc = q_s16(enc) ? s[2 * g + (i >> 4)] : s[g];
        float v = sc * (float)q[i];
        out[i] = q_has_min(enc) ? v + (enc == Q2_K ? mn[2 * g + (i >> 4)] : mn[g]) : v;
    }
}

static inline void q_tile(int enc, const uint8_t *W, long rb, int R, const float *x, long cols, int NB,
                          const float *s, long ns, const float *mn, long nm, float out[4][QG]) {
    long ng = cols / 32;
    for (int r = 0; r < R; r++) {
        float acc[QG] = {0};
        for (long g = 0; g < ng; g++) {
            float w[32];
            q_wunit(enc, W + r * rb, g, s + r * ns, mn + r * nm, w);
            for (int b = 0; b < NB; b++) {
                const float *xb = x + b * cols + 32 * g;
                float t = 0.0f;
                for (int i = 0; i < 32; i++) t += w[i] * xb[i];
                acc[b] += t;
            }
        }
        for (int b = 0; b < NB; b++) out[r][b] = acc[b];
    }
}
#endif

/* q_tile with NB as a constant (each value its own unrolled loop nest), R = 4 */
static inline __attribute__((always_inline)) void q_tile4(int enc, const uint8_t *W, long rb, const float *xb, long cols,
                                                           int nb, const float *s, long ns, const float *mn, long nm,
                                                           float out[4][QG]) {
    if (nb == 1) q_tile(enc, W, rb, 4, xb, cols, 1, s, ns, mn, nm, out);
    else if (nb == 2) q_tile(enc, W, rb, 4, xb, cols, 2, s, ns, mn, nm, out);
#if QG == 4
    else if (nb == 3) q_tile(enc, W, rb, 4, xb, cols, 3, s, ns, mn, nm, out);
#endif
    else q_tile(enc, W, rb, 4, xb, cols, QG, s, ns, mn, nm, out);
}

/* one tile of R <= 4 rows from r0 against all B rows of x; s, mn: scratch for the tile's scales and mins */
static inline __attribute__((always_inline)) void q_rows_tile(int enc, const uint8_t *W, const float *x, float *y,
                                                               long rows, long cols, long B, long r0, float *s, float *mn) {
    long rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], ns = q_ns(enc, cols), nm = q_nm(enc, cols);
    long R = rows - r0 < 4 ? rows - r0 : 4;
    const uint8_t *Wt = W + r0 * rb;
    for (long r = 0; r < R; r++) q_row_scales(enc, Wt + r * rb, cols / Q_BLOCK[enc], s + r * ns, mn + r * nm);
    for (long b0 = 0; b0 < B; b0 += QG) {
        int nb = (int)(B - b0 < QG ? B - b0 : QG);
        const float *xb = x + b0 * cols;
        float out[4][QG];
        if (R == 4) {
            q_tile4(enc, Wt, rb, xb, cols, nb, s, ns, mn, nm, out);
        } else { /* the last rows of a matrix: one row and one row of x at a time */
            for (long r = 0; r < R; r++)
                for (int b = 0; b < nb; b++) {
                    float o1[4][QG];
                    q_tile(enc, Wt + r * rb, rb, 1, xb + b * cols, cols, 1, s + r * ns, ns, mn + r * nm, nm, o1);
                    out[r][b] = o1[0][0];
                }
        }
        for (long r = 0; r < R; r++)
            for (int b = 0; b < nb; b++) y[(b0 + b) * rows + r0 + r] = out[r][b];
    }
}

#if defined(IQ_VEC) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define IQ_FP_PLANAR 1 /* (the byte-plane decode is built: iq_gemv_planar, below) */
static int iq_gemv_planar(int enc, const uint8_t *W, const float *x, float *y, long rows, long cols, long B);
#endif
/* y [B, rows] fp32 = x [B, cols] (bf16 when bf, else fp32) times W [rows, cols] of encoding enc (codes above),
 * W's rows of cols / block values stored end to end (row_bytes = cols / block * type_size). cols a multiple of
 * the block (checked by the caller, as enc < Q_COUNT). */
void vxc_qgemv(int enc, const void *W, const void *x, float *y, long rows, long cols, long B, int bf) {
    if (enc < 0 || enc >= Q_COUNT || rows <= 0 || B <= 0) return;
    long ns = q_ns(enc, cols), nm = q_nm(enc, cols);
    float *xf = bf ? (float *)malloc((size_t)(B * cols) * sizeof(float)) : NULL;
    if (bf) load_row(x, 0, B * cols, 1, xf);
    const float *xx = bf ? xf : (const float *)x;
    if (q_grid(enc)) {
#if IQ_FP_PLANAR
        if (iq_gemv_planar(enc, (const uint8_t *)W, xx, y, rows, cols, B)) {
            free(xf);
            return;
        }
#endif
#if defined(IQ_VEC)
        if (iq_ready) {
            iq_gemv_chunked(enc, (const uint8_t *)W, xx, y, rows, cols, B);
            free(xf);
            return;
        }
#endif
        iq_gemv(enc, (const uint8_t *)W, xx, y, rows, cols, B);
        free(xf);
        return;
    }
#pragma omp parallel
    {
        float *s = (float *)malloc((size_t)(4 * (ns + nm) + 1) * sizeof(float)), *mn = s + 4 * ns;
        const uint8_t *Wb = (const uint8_t *)W;
#pragma omp for schedule(static)
        for (long r0 = 0; r0 < rows; r0 += 4) {
            switch (enc) { /* a tile specialised per encoding (inside the parallel region: constants there) */
            case Q8_0: q_rows_tile(Q8_0, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q4_0: q_rows_tile(Q4_0, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q4_1: q_rows_tile(Q4_1, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q4_K: q_rows_tile(Q4_K, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q5_0: q_rows_tile(Q5_0, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q5_K: q_rows_tile(Q5_K, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q5_1: q_rows_tile(Q5_1, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q2_K: q_rows_tile(Q2_K, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case Q3_K: q_rows_tile(Q3_K, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case IQ4_NL: q_rows_tile(IQ4_NL, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case IQ4_XS: q_rows_tile(IQ4_XS, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case TQ1_0: q_rows_tile(TQ1_0, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            case TQ2_0: q_rows_tile(TQ2_0, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            default: q_rows_tile(Q6_K, Wb, xx, y, rows, cols, B, r0, s, mn); break;
            }
        }
        free(s);
    }
    free(xf);
}

#if defined(IQ_VEC) && defined(__AVX512VNNI__)
#define IQ_A8 1
/* int8_block32 activations on the grid formats (AVX-512 VNNI): each 64-value chunk of a super-block as unsigned
 * magnitudes (its grid entries: iq_chunk above), a 64-bit sign mask and a weight scale per vpdpbusd lane; x's int8
 * bytes negated where the weight's sign is, then vpdpbusd sums |w| (x sign) exactly per lane of four values, and
 * each lane's integer is scaled by its weight scale times x's block scale. iq1: the integer w = 8 grid + (delta
 * > 0 ? 1 : -1) at the scale dl / 8 (both exact), the same real value as dl (grid + delta). The fp32 product of
 * the decoded weights with x's values d q, up to summation order (the twin's definition). */
static void a8_quantize_row(const float *x, long cols, int8_t *q, float *d); /* (below: the int8 activation section) */

#define IQ_NB 8 /* rows of x per pass over a weight row: an instance for up to 4 (one row of x: 8's was ~15 % slower)
                  * and one for up to 8 (3072 x 1024 iq3_s at 8 rows: 0.62 -> 0.48 ms, one pass instead of two) */

/* one weight row against rows b0 .. b0 + nb (nb <= NB) of x (q: int8 [B, cols]; dl: each lane's x scale [B, cols / 4]) */
static inline __attribute__((always_inline)) void iq_a8_row(int enc, int NB, const uint8_t *row, long cols, const int8_t *q,
                                                            const float *dl, long b0, int nb, float *out) {
    __m512 acc[IQ_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *b = row + sb * Q_TSIZE[enc];
        float d = iq_d(enc, b);
        /* iq1_m: the super-block's 16 scales at once (iq1m_scales), each chunk's lanes picking theirs */
        const __m512 sbs = enc == IQ1_M ? iq1m_scales(b, d) : _mm512_setzero_ps();
        for (int c = 0; c < 4; c++) {
            __m512i mags;
            __mmask64 sgn;
            __m512 ws;
            iq_chunk(enc, b, d, c, &mags, &sgn, &ws);
            if (enc == IQ1_M) ws = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * c), _mm512_loadu_si512((const void *)IQ_LANES4)), sbs);
            long at = 256 * sb + 64 * c;
            for (int j = 0; j < nb; j++) {
                const int8_t *xq = q + (b0 + j) * cols + at;
                __m512i xv = _mm512_loadu_si512((const void *)xq);
                xv = _mm512_mask_sub_epi8(xv, sgn, zero, xv);
                __m512i s = _mm512_dpbusd_epi32(zero, mags, xv);
                __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(dl + (b0 + j) * (cols / 4) + at / 4));
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[j]);
            }
        }
    }
    for (int j = 0; j < nb; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* the rows of x of an iq1 chunk (64 values at ``at``): each lane's integer 8 (g + 1) x - (8 - e) x (g8, kb: iq1m_a8_row
 * below), scaled by the lane's weight scale times x's block scale into acc[j] */
static inline __attribute__((always_inline)) void iq1_a8_rows(__m512i g8, __m512i kb, __m512 ws, const int8_t *q,
                                                              const float *dl, long cols, long at, long b0, int nb,
                                                              __m512 *acc) {
    const __m512i zero = _mm512_setzero_si512();
    for (int j = 0; j < nb; j++) {
        __m512i xv = _mm512_loadu_si512((const void *)(q + (b0 + j) * cols + at));
        __m512i s = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, g8, xv), _mm512_dpbusd_epi32(zero, kb, xv));
        __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(dl + (b0 + j) * (cols / 4) + at / 4));
        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[j]);
    }
}

/* iq1_s: a super-block's 32 grid indices (8 bits from qs, 3 from qh[s] >> 3 (e % 4) for entry e of sub-block s)
 * formed in one vector and stored, so the row kernel's entry loads read each index with one load instead of four
 * scalar operations */
static const uint16_t IQ1S_DUP[32] __attribute__((aligned(64))) = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3,
                                                                 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7};
static const uint16_t IQ1S_SH[32] __attribute__((aligned(64))) = {0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9,
                                                                0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9};
static const uint64_t IQ1_NEG2[4] = {0, 0xFFFFFFFFull, 0xFFFFFFFF00000000ull, ~0ull};
static const int32_t IQ1_HALF8[16] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1};

static inline __attribute__((always_inline)) void iq1s_indices(const uint8_t *b, uint16_t *idx) {
    const __m512i qh = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + 34)));
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi16(_mm512_load_si512((const void *)IQ1S_DUP), qh),
                                                          _mm512_load_si512((const void *)IQ1S_SH)), _mm512_set1_epi16(7));
    _mm512_store_si512((void *)idx, _mm512_or_si512(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                                    _mm512_slli_epi16(hi, 8)));
}
static inline __attribute__((always_inline)) __m512i iq_e8x8_16(const int8_t *t, const uint16_t *i) {
    __m128i g[4];
    for (int k = 0; k < 4; k++) {
        int64_t v0, v1;
        memcpy(&v0, t + 8 * (size_t)i[2 * k], 8);
        memcpy(&v1, t + 8 * (size_t)i[2 * k + 1], 8);
        g[k] = _mm_insert_epi64(_mm_cvtsi64_si128(v0), v1, 1);
    }
    return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(g[0]), g[1], 1), g[2], 2), g[3], 3);
}

/* iq1_s against up to 4 rows of x, as iq1m_a8_row below (two vpdpbusd: 8 (g + 1) and 8 - e times x; the same
 * integers as iq_a8_row's, so the same bits), the super-block's indices formed by iq1s_indices, its 8 sub-block
 * scales in one vector (one permute a chunk picks a chunk's two) and its delta signs by one movepi16_mask. The scalar
 * side had bound iq_a8_row's iq1_s (the indices, four operations an entry; the scales' conversions). The 137 iq1_s
 * matrices of the 0.6B-model-shaped IQ1_S file, 2 threads, Zen 4, interleaved in one process, best of 12-60: one
 * 3072 x 1024 matrix from cache 0.264 / 0.172 / 0.238 -> 0.199 / 0.150 / 0.179 ms in three runs, all 137 from
 * memory 20.9 / 26.6 / 27.7 -> 17.9 / 21.4 / 19.2 ms at one row of x, at 3 rows one matrix 0.277 / 0.334 -> 0.255 /
 * 0.246 ms; bit-equal. At 8 rows level or slower
 * (38.2 -> 39.0, 43.1 -> 44.9 ms: the second vpdpbusd a row), so more than 4 rows keep iq_a8_row. The same index
 * vector for iq1_m (its nibbles spread by two byte unpacks) measured slower (one matrix 0.142 -> 0.155 ms, 8 rows
 * 0.308 -> 0.369), and iq1m_a8_row keeps its scalar indices. */
static inline __attribute__((always_inline)) void iq1s_a8_row(int NB, const uint8_t *row, long cols, const int8_t *q,
                                                              const float *dl, long b0, int nb, float *out) {
    __m512 acc[IQ_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    uint16_t idx[32] __attribute__((aligned(64)));
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *b = row + sb * Q_TSIZE[IQ1_S];
        iq1s_indices(b, idx);
        const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 34));
        const __m256i q32 = _mm256_cvtepu16_epi32(qh);
        const __m256i ls = _mm256_add_epi32(_mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(q32, 12), _mm256_set1_epi32(7)), 1),
                                            _mm256_set1_epi32(1));
        const __m512 sbs = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtepi32_ps(ls), _mm256_set1_ps(h2f(b) * 0.125f)));
        const unsigned sg = (unsigned)_mm_movepi16_mask(qh); /* the 8 sub-blocks' delta signs */
        for (int c = 0; c < 4; c++) {
            const __m512 ws = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(2 * c), _mm512_loadu_si512((const void *)IQ1_HALF8)), sbs);
            const __m512i g8 = iq_e8x8_16((const int8_t *)IQ1S8, idx + 8 * c);
            const __m512i kb = _mm512_mask_blend_epi8(_cvtu64_mask64(IQ1_NEG2[(sg >> (2 * c)) & 3]), _mm512_set1_epi8(7), _mm512_set1_epi8(9));
            iq1_a8_rows(g8, kb, ws, q, dl, cols, 256 * sb + 64 * c, b0, nb, acc);
        }
    }
    for (int j = 0; j < nb; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* iq1_m against rows b0 .. b0 + nb of x without the sign mask: a lane's integer is iq_a8_row's (the weights w = 8 g +
 * e, g in {-1, 0, 1} the grid entry, e = +-1 the delta's sign, times x's int8 values, summed per four), formed as the
 * difference of two vpdpbusd: 8 (g + 1) (the grid entry itself as unsigned bytes, IQ1S8) and 8 - e (7 or 9) times x,
 * where iq_a8_row forms |8 g + e| and its sign mask and negates x by it. The same integers, so the same bits. The 137
 * iq1_m matrices of the 0.6B-model-shaped IQ1_M file, 2 threads, interleaved in one process: one 3072 x 1024 matrix
 * from cache 0.163 -> 0.148 ms, all from memory 30.2 -> 27.5 ms at one row of x (a slow phase), 8 rows level. Not
 * taken for iq1_s, where it measured slower (0.171 -> 0.177 ms; 8 rows 0.348 -> 0.369): its second vpdpbusd a row
 * lands on the multiply pipes that its scales' conversions use too; with -7 S / -9 S per lane precomputed and
 * loaded instead (one vpdpbusd) both formats were slower, 8 rows by 60 % (two more 64-byte loads a row). Nor was
 * iq1_s by sub-block lanes (each vector entry j of the super-block's 8 sub-blocks, x laid out alike, so a super-block
 * takes one convert, multiply and add a row where this takes four): about half the vector operations, and level
 * (one row 0.176 -> 0.185 ms, 0.220 -> 0.221; 8 rows level): the entries' loads and inserts bound both formats. Nor
 * the entries as 2-bit codes (16 bits an entry) joined four to a 64-bit word on the scalar pipes, widened a word a
 * lane and spread to bytes by vpmultishiftqb, |8 g + e| and its sign by one byte shuffle: slower for both (iq1_s one
 * row 0.268 -> 0.341 ms, iq1_m 0.224 -> 0.258; 8 rows level or slower), the scalar side now the longer. A function
 * of its own rather than enc == IQ1_M branches in iq_a8_row (whose row loop this repeats): folded in, the same bits
 * but 4-6 % slower at one row from cache in three interleaved runs (0.142 / 0.151 / 0.147 -> 0.149 / 0.156 / 0.156 ms). */
static inline __attribute__((always_inline)) void iq1m_a8_row(int NB, const uint8_t *row, long cols, const int8_t *q,
                                                              const float *dl, long b0, int nb, float *out) {
    __m512 acc[IQ_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *b = row + sb * Q_TSIZE[IQ1_M];
        const __m512 sbs = iq1m_scales(b, iq_d(IQ1_M, b));
        for (int c = 0; c < 4; c++) {
            uint32_t idx[8], qh = iq_u32(b + 32 + 4 * c); /* a nibble an entry: 3 index bits, the delta's sign */
            for (int k = 0; k < 8; k++) idx[k] = b[8 * c + k] | ((qh >> (4 * k)) & 7) << 8;
            const __mmask64 neg = _cvtu64_mask64(_pdep_u64(_pext_u32(qh, 0x88888888u), 0x0101010101010101ull) * 0xFF);
            const __m512 ws = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * c), _mm512_loadu_si512((const void *)IQ_LANES4)), sbs);
            const __m512i g8 = iq_e8x8((const int8_t *)IQ1S8, idx);
            const __m512i kb = _mm512_mask_blend_epi8(neg, _mm512_set1_epi8(7), _mm512_set1_epi8(9));
            iq1_a8_rows(g8, kb, ws, q, dl, cols, 256 * sb + 64 * c, b0, nb, acc);
        }
    }
    for (int j = 0; j < nb; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

#if defined(__AVX512VBMI__)
#define IQ_PLANAR 1
/* The grid formats but iq1 (their 2048-entry grid: by plane, 0.16 -> 0.20 ms, not kept), one to IQ_NB rows of x, by
 * byte plane. iq3_s and iq3_xxs: a super-block's 64 grid indices in one vector, each
 * entry's byte p looked up for all 64 at once from a table in registers (vpermt2b, 128 entries a lookup; iq3_s's
 * 512-entry grid as two nibble-packed tables of two planes each, the index's bits 7 and 8 choosing by mask), so
 * plane p holds the magnitudes of values 4e + p (e = 0 .. 63). x's int8 row is laid out the same way per 256 values
 * (iq_planar_x), each plane's signs taken from the sign words by pext, and four vpdpbusd (one per plane) sum, in
 * each lane, the 16 values 16l .. 16l + 15 — one scale group's half — exactly; one conversion, one multiply (the
 * group's weight scale times x's block scale) and one FMA per super-block and row of x. The gathers of iq_chunk did
 * the lookups at ~21 cycles for 16 entries on Zen 4: 3072 x 1024 iq3_s, one row of x, 2 threads, in-cache,
 * interleaved: 0.21 -> 0.10 ms (8 rows 0.44 -> 0.21). A lane sums 16 values where iq_a8_row's sums 4 (the same
 * integers; a different float summation, within the floor). */
static inline int iq_planar8(int enc) { return enc == IQ2_XXS || enc == IQ2_XS || enc == IQ2_S; }
static inline int iq_planar(int enc) { return enc == IQ3_S || enc == IQ3_XXS || iq_planar8(enc); }
static const uint8_t IQ_EVEN64[64] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                       44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84,
                                       86, 88, 90, 92, 94, 96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120,
                                       122, 124, 126};
static inline uint64_t iq_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* the byte order that puts 64 values of P-byte entries by plane: plane p's 64 / P bytes (values P e + p) at 64 p / P */
static inline __m512i iq_pick(int P) {
    int8_t t[64];
    for (int i = 0; i < 64; i++) t[i] = (int8_t)(P * (i % (64 / P)) + i / (64 / P));
    return _mm512_loadu_si512((const void *)t);
}

/* q (natural order, [B, cols]) to qp (per 256 values: plane p's 64 bytes, values 4e + p, at 64 p) and the per-lane
 * x scales dl16 [B, cols / 16] (lane l of the row: x block l / 2) */
static void iq_planar_x(const int8_t *q, const float *d, long B, long cols, int8_t *qp, float *dl16) {
    const __m512i pk = iq_pick(4);
    for (long b = 0; b < B; b++) {
        for (long s = 0; s < cols; s += 256) {
            /* each 64 values as [plane 0: 16 bytes][plane 1][plane 2][plane 3], then the 16-byte lanes transposed */
            __m512i v[4];
            for (int k = 0; k < 4; k++) v[k] = _mm512_permutexvar_epi8(pk, _mm512_loadu_si512((const void *)(q + b * cols + s + 64 * k)));
            __m512i t0 = _mm512_shuffle_i64x2(v[0], v[1], 0x44), t1 = _mm512_shuffle_i64x2(v[0], v[1], 0xEE);
            __m512i t2 = _mm512_shuffle_i64x2(v[2], v[3], 0x44), t3 = _mm512_shuffle_i64x2(v[2], v[3], 0xEE);
            int8_t *o = qp + b * cols + s;
            _mm512_storeu_si512((void *)o, _mm512_shuffle_i64x2(t0, t2, 0x88));
            _mm512_storeu_si512((void *)(o + 64), _mm512_shuffle_i64x2(t0, t2, 0xDD));
            _mm512_storeu_si512((void *)(o + 128), _mm512_shuffle_i64x2(t1, t3, 0x88));
            _mm512_storeu_si512((void *)(o + 192), _mm512_shuffle_i64x2(t1, t3, 0xDD));
        }
        for (long l = 0; l < cols / 16; l++) dl16[b * (cols / 16) + l] = d[b * (cols / 32) + l / 2];
    }
}

/* super-block b of iq3_s / iq3_xxs by byte plane: mp[p] the magnitudes of values 4e + p (e = 0..63), sp[p] their
 * signs, ws lane l's scale (values 16l .. 16l + 15 of the super-block, entries 4l .. 4l + 3 of each plane) */
static inline __attribute__((always_inline)) void iq3_planes(int enc, const uint8_t *b, __m512i mp[4], __mmask64 sp[4],
                                                              __m512 *ws_out) {
    const __m512i lo4 = _mm512_set1_epi8(15);
    float d = iq_d(enc, b);
    const __m512i qs = _mm512_loadu_si512((const void *)(b + 2));
    const __mmask64 k7 = _mm512_movepi8_mask(qs);
    uint64_t s64[4];
    if (enc == IQ3_S) {
        uint64_t qh;
        memcpy(&qh, b + 66, 8);
        for (int h = 0; h < 2; h++) {
            const __m512i *T = (const __m512i *)(const void *)IQP3S[h];
            __m512i r0 = _mm512_permutex2var_epi8(T[0], qs, T[1]), r1 = _mm512_permutex2var_epi8(T[2], qs, T[3]);
            __m512i r2 = _mm512_permutex2var_epi8(T[4], qs, T[5]), r3 = _mm512_permutex2var_epi8(T[6], qs, T[7]);
            __m512i t = _mm512_mask_blend_epi8((__mmask64)qh, _mm512_mask_blend_epi8(k7, r0, r1), _mm512_mask_blend_epi8(k7, r2, r3));
            mp[2 * h] = _mm512_and_si512(t, lo4);
            mp[2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(t, 4), lo4);
        }
        memcpy(s64, b + 74, 32);
        /* lane l: scale group l / 2, its nibble of the four scale bytes */
        __m512i nib = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)iq_u32(b + 106)),
                                                         _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28)),
                                       _mm512_set1_epi32(15));
        *ws_out = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_add_epi32(nib, nib), _mm512_set1_epi32(1))));
    } else { /* IQ3_XXS: 256 entries, bit 7 chooses the table half */
        for (int p = 0; p < 4; p++) {
            const __m512i *T = (const __m512i *)(const void *)IQP3XXS[p];
            mp[p] = _mm512_mask_blend_epi8(k7, _mm512_permutex2var_epi8(T[0], qs, T[1]), _mm512_permutex2var_epi8(T[2], qs, T[3]));
        }
        /* the 32 sign bytes: each word's four 7-bit ksigns indices (bits 0, 7, 14, 21) picked by vpmultishiftqb,
         * then looked up in ksigns (128 bytes, one vpermt2b) */
        const __m512i *KS = (const __m512i *)(const void *)(IQT + IQT_KSIGNS);
        const __m512i fld = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x352E2720150E0700ll),
                                                         _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 66))));
        _mm256_storeu_si256((__m256i *)(void *)s64, _mm512_castsi512_si256(_mm512_permutex2var_epi8(_mm512_loadu_si512(KS), fld, _mm512_loadu_si512(KS + 1))));
        __m256 s8 = _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(b + 66)), 28));
        __m256 w8 = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_add_ps(_mm256_set1_ps(0.5f), s8)), _mm256_set1_ps(0.5f));
        *ws_out = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm512_castps256_ps512(w8));
    }
    for (int p = 0; p < 4; p++) {
        const uint64_t M = 0x1111111111111111ull << p;
        sp[p] = (__mmask64)(_pext_u64(s64[0], M) | _pext_u64(s64[1], M) << 16 | _pext_u64(s64[2], M) << 32 | _pext_u64(s64[3], M) << 48);
    }
}

static inline __attribute__((always_inline)) void iq_a8_row_planar(int enc, int NB, const uint8_t *row, long cols,
                                                                   const int8_t *qp, const float *dl16, long b0, int nb,
                                                                   float *out) {
    __m512 acc[IQ_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *b = row + sb * Q_TSIZE[enc];
        __m512i mp[4];
        __mmask64 sp[4];
        __m512 ws;
        iq3_planes(enc, b, mp, sp, &ws);
        for (int j = 0; j < nb; j++) {
            const int8_t *x = qp + (b0 + j) * cols + 256 * sb;
            __m512i s = zero;
            for (int p = 0; p < 4; p++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * p));
                s = _mm512_dpbusd_epi32(s, mp[p], _mm512_mask_sub_epi8(xv, sp[p], zero, xv));
            }
            __m512 sc = _mm512_mul_ps(ws, _mm512_loadu_ps(dl16 + (b0 + j) * (cols / 16) + 16 * sb));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[j]);
        }
    }
    for (int j = 0; j < nb; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* iq2_xxs (8-byte entries, a scale per 32 values) by byte plane over two super-blocks at a time: the 64 grid indices
 * of 512 values in one vector, eight planes (plane p: values 8e + p), each lane's four bytes per plane the 32 values
 * of one scale group; every sign byte (ksigns of a 7-bit index) belongs to one entry, so plane p's signs are bit p
 * of the 64 sign bytes (one vptestmb). x laid out by the same planes per 512 values (iq_planar_x8; rows padded to
 * 512 with zero bytes and zero scales, so a last lone super-block adds exact zeros), its block scales per lane as
 * they are. */
static long iq_p8_cols(long cols) { return (cols + 511) / 512 * 512; }

static void iq_planar_x8(const int8_t *q, const float *d, long B, long cols, int8_t *qp, float *dp) {
    const __m512i pk = iq_pick(8);
    const __m512i s1l = _mm512_setr_epi64(0, 8, 1, 9, 2, 10, 3, 11), s1h = _mm512_setr_epi64(4, 12, 5, 13, 6, 14, 7, 15);
    const __m512i s2l = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), s2h = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const __m512i s3l = _mm512_setr_epi64(0, 1, 2, 3, 8, 9, 10, 11), s3h = _mm512_setr_epi64(4, 5, 6, 7, 12, 13, 14, 15);
    const long cp = iq_p8_cols(cols);
    for (long b = 0; b < B; b++) {
        for (long s = 0; s < cp; s += 512) {
            /* 64-byte pieces k (entries 8k .. 8k + 7) with their bytes by plane (qword p: plane p), then the 8 x 8
             * qwords transposed: plane p = qword p of every piece */
            __m512i v[8], a[8], c[8];
            for (int k = 0; k < 8; k++)
                v[k] = s + 64 * k < cols ? _mm512_permutexvar_epi8(pk, _mm512_loadu_si512((const void *)(q + b * cols + s + 64 * k)))
                                         : _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                a[2 * i] = _mm512_permutex2var_epi64(v[2 * i], s1l, v[2 * i + 1]);     /* planes 0-3, pieces 2i, 2i+1 */
                a[2 * i + 1] = _mm512_permutex2var_epi64(v[2 * i], s1h, v[2 * i + 1]); /* planes 4-7 */
            }
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 2; i++) {
                    /* pieces 4i .. 4i + 3: planes (4h, 4h + 1) and (4h + 2, 4h + 3) as 256-bit halves */
                    c[4 * h + 2 * i] = _mm512_permutex2var_epi64(a[4 * i + h], s2l, a[4 * i + 2 + h]);
                    c[4 * h + 2 * i + 1] = _mm512_permutex2var_epi64(a[4 * i + h], s2h, a[4 * i + 2 + h]);
                }
            int8_t *o = qp + b * cp + s;
            for (int h = 0; h < 2; h++)
                for (int j = 0; j < 2; j++) {
                    int pl = 4 * h + 2 * j;
                    _mm512_storeu_si512((void *)(o + 64 * pl), _mm512_permutex2var_epi64(c[4 * h + j], s3l, c[4 * h + 2 + j]));
                    _mm512_storeu_si512((void *)(o + 64 * (pl + 1)), _mm512_permutex2var_epi64(c[4 * h + j], s3h, c[4 * h + 2 + j]));
                }
        }
        for (long g = 0; g < cp / 32; g++) dp[b * (cp / 32) + g] = g < cols / 32 ? d[b * (cols / 32) + g] : 0.0f;
    }
}

/* 128 entries a vpermt2b from a code table of n = 128 segs entries (the index's bits 7, 8, 9 choose by mask) */
static inline __attribute__((always_inline)) __m512i iq_lut(const uint8_t *T, int segs, __m512i lo, __mmask64 k7, __mmask64 k8,
                                                            __mmask64 k9) {
    const __m512i *t = (const __m512i *)(const void *)T;
    __m512i r[8];
    for (int g = 0; g < segs; g++) r[g] = _mm512_permutex2var_epi8(t[2 * g], lo, t[2 * g + 1]);
    const __mmask64 k[3] = {k7, k8, k9};
    for (int lv = 0, n = segs; n > 1; lv++, n /= 2)
        for (int i = 0; i < n / 2; i++) r[i] = _mm512_mask_blend_epi8(k[lv], r[2 * i], r[2 * i + 1]);
    return r[0];
}

/* iq2_xxs / iq2_xs / iq2_s over two super-blocks: 64 entries' indices (low 8 bits in lo, bits 8, 9 as masks), their
 * sign bytes (one an entry: bit p negates byte p), lane scales (per 32 values; iq2_xs / iq2_s per 16: A for a
 * lane's bytes 0-1 of each plane, B for 2-3, the entries 4l, 4l + 1 and 4l + 2, 4l + 3) */
static inline __attribute__((always_inline)) void iq2_pair(int enc, const uint8_t *b, int two, __m512i *lo, __mmask64 *k8,
                                                           __mmask64 *k9, __m512i *sgn, __m512 *wsA, __m512 *wsB) {
    static const int8_t sel[64] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27,
                                   32, 33, 34, 35, 40, 41, 42, 43, 48, 49, 50, 51, 56, 57, 58, 59,
                                   64, 65, 66, 67, 72, 73, 74, 75, 80, 81, 82, 83, 88, 89, 90, 91,
                                   96, 97, 98, 99, 104, 105, 106, 107, 112, 113, 114, 115, 120, 121, 122, 123};
    const __m512i zero = _mm512_setzero_si512();
    const __m512i *KS = (const __m512i *)(const void *)(IQT + IQT_KSIGNS);
    const long ts = Q_TSIZE[enc];
    const uint8_t *bb = b + ts;
    const __m512 dv = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(h2f(b)), _mm512_set1_ps(two ? h2f(bb) : 0.0f));
    *k8 = *k9 = 0;
    if (enc == IQ2_XXS) { /* per 32 values: 4 index bytes, then a word of four 7-bit ksigns indices and the scale */
        const __m512i sl = _mm512_loadu_si512((const void *)sel);
        const __m512i P0 = _mm512_loadu_si512((const void *)(b + 2)), P1 = two ? _mm512_loadu_si512((const void *)(bb + 2)) : zero;
        *lo = _mm512_permutex2var_epi8(P0, sl, P1);
        const __m512i ctl = _mm512_set1_epi64(0x35 << 24 | 0x2E << 16 | 0x27 << 8 | 0x20); /* bits 32, 39, 46, 53 */
        const __m512i fld = _mm512_permutex2var_epi8(_mm512_multishift_epi64_epi8(ctl, P0), sl, _mm512_multishift_epi64_epi8(ctl, P1));
        *sgn = _mm512_permutex2var_epi8(_mm512_loadu_si512(KS), fld, _mm512_loadu_si512(KS + 1));
        const __m512i aux = _mm512_permutex2var_epi32(P0, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), P1);
        *wsA = _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_add_ps(_mm512_set1_ps(0.5f), _mm512_cvtepi32_ps(_mm512_srli_epi32(aux, 28)))),
                             _mm512_set1_ps(0.25f));
        *wsB = *wsA;
        return;
    }
    __m128i sc; /* the 16 scale bytes of the pair (a nibble per 16 values) */
    if (enc == IQ2_XS) { /* per entry a u16: 9-bit index, 7-bit ksigns index */
        const __m512i P0 = _mm512_loadu_si512((const void *)(b + 2)), P1 = two ? _mm512_loadu_si512((const void *)(bb + 2)) : zero;
        const __m512i even = _mm512_loadu_si512((const void *)IQ_EVEN64); /* byte 2i of P0 | P1 */
        *lo = _mm512_permutex2var_epi8(P0, even, P1);
        const __m512i hi = _mm512_permutex2var_epi8(P0, _mm512_add_epi8(even, _mm512_set1_epi8(1)), P1);
        *k8 = _mm512_test_epi8_mask(hi, _mm512_set1_epi8(1));
        *sgn = _mm512_permutex2var_epi8(_mm512_loadu_si512(KS), _mm512_srli_epi16(hi, 1), _mm512_loadu_si512(KS + 1));
        sc = _mm_set_epi64x(two ? (long long)iq_u64(bb + 66) : 0, (long long)iq_u64(b + 66));
    } else { /* IQ2_S: 32 index bytes, 32 sign bytes, 2 high index bits an entry, the scales */
        *lo = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 2))),
                                 two ? _mm256_loadu_si256((const __m256i *)(bb + 2)) : _mm256_setzero_si256(), 1);
        *sgn = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 34))),
                                  two ? _mm256_loadu_si256((const __m256i *)(bb + 34)) : _mm256_setzero_si256(), 1);
        const uint64_t q0 = iq_u64(b + 66), q1 = two ? iq_u64(bb + 66) : 0;
        *k8 = (__mmask64)(_pext_u64(q0, 0x5555555555555555ull) | _pext_u64(q1, 0x5555555555555555ull) << 32);
        *k9 = (__mmask64)(_pext_u64(q0, 0xAAAAAAAAAAAAAAAAull) | _pext_u64(q1, 0xAAAAAAAAAAAAAAAAull) << 32);
        sc = _mm_set_epi64x(two ? (long long)iq_u64(bb + 74) : 0, (long long)iq_u64(b + 74));
    }
    const __m512i s16 = _mm512_cvtepu8_epi32(sc);
    const __m512 sA = _mm512_cvtepi32_ps(_mm512_and_si512(s16, _mm512_set1_epi32(15))), sB = _mm512_cvtepi32_ps(_mm512_srli_epi32(s16, 4));
    *wsA = _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_add_ps(_mm512_set1_ps(0.5f), sA)), _mm512_set1_ps(0.25f));
    *wsB = _mm512_mul_ps(_mm512_mul_ps(dv, _mm512_add_ps(_mm512_set1_ps(0.5f), sB)), _mm512_set1_ps(0.25f));
}

/* super-blocks b (and b's next where two) of iq2_xxs / iq2_xs / iq2_s by byte plane: mp[p] the magnitudes of values
 * 8e + p (e = 0..63: 32 entries a super-block), sp[p] their signs, wsA / wsB lane l's scales (entries 4l .. 4l + 3
 * of each plane: A for 4l, 4l + 1, B for 4l + 2, 4l + 3; the same where the scale is per 32 values) */
static inline __attribute__((always_inline)) void iq2_planes(int enc, const uint8_t *b, int two, __m512i mp[8],
                                                              __mmask64 sp[8], __m512 *wsA, __m512 *wsB) {
    const uint8_t(*L)[64] = IQ2_UNPACK;
    const __m512i L0 = _mm512_load_si512((const void *)L[0]), L1 = _mm512_load_si512((const void *)L[1]), L2 = _mm512_load_si512((const void *)L[2]);
    const uint8_t *C = enc == IQ2_XXS ? IQC2XXS[0] : enc == IQ2_XS ? IQC2XS[0] : IQC2S[0];
    const long n = enc == IQ2_XXS ? 256 : enc == IQ2_XS ? 512 : 1024;
    __m512i lo, sgn;
    __mmask64 k8, k9;
    iq2_pair(enc, b, two, &lo, &k8, &k9, &sgn, wsA, wsB);
    const __mmask64 k7 = _mm512_movepi8_mask(lo);
    for (int h = 0; h < 2; h++) {
        const __m512i t = iq_lut(C + h * n, (int)(n / 128), lo, k7, k8, k9);
        mp[4 * h] = _mm512_permutexvar_epi8(t, L0);
        mp[4 * h + 1] = _mm512_permutexvar_epi8(t, L1);
        mp[4 * h + 2] = _mm512_permutexvar_epi8(t, L2);
        mp[4 * h + 3] = _mm512_permutexvar_epi8(_mm512_srli_epi16(t, 2), L2);
    }
    for (int p = 0; p < 8; p++) sp[p] = _mm512_test_epi8_mask(sgn, _mm512_set1_epi8((char)(1 << p)));
}

static inline __attribute__((always_inline)) void iq2_a8_row_planar(int enc, int NB, const uint8_t *row, long cols, const int8_t *qp,
                                                                    const float *dp, long b0, int nb, float *out) {
    const long ts = Q_TSIZE[enc];
    const int per16 = enc != IQ2_XXS;
    const long cp = iq_p8_cols(cols), nsb = cols / 256;
    __m512 acc[IQ_NB];
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    for (long sb = 0; sb < nsb; sb += 2) {
        __m512 wsA, wsB;
        __m512i mp[8], mq[8];
        __mmask64 sp[8];
        iq2_planes(enc, row + sb * ts, sb + 1 < nsb, mp, sp, &wsA, &wsB);
        for (int p = 0; p < 8; p++) {
            if (per16) { /* a lane's first two entries (scale group A) and last two (B) apart */
                mq[p] = _mm512_maskz_mov_epi8((__mmask64)0xCCCCCCCCCCCCCCCCull, mp[p]);
                mp[p] = _mm512_maskz_mov_epi8((__mmask64)0x3333333333333333ull, mp[p]);
            }
        }
        for (int j = 0; j < nb; j++) {
            const int8_t *x = qp + (b0 + j) * cp + 256 * sb;
            __m512i sa = zero, sbv = zero;
            for (int p = 0; p < 8; p++) {
                __m512i xv = _mm512_loadu_si512((const void *)(x + 64 * p));
                xv = _mm512_mask_sub_epi8(xv, sp[p], zero, xv);
                sa = _mm512_dpbusd_epi32(sa, mp[p], xv);
                if (per16) sbv = _mm512_dpbusd_epi32(sbv, mq[p], xv);
            }
            const __m512 dl = _mm512_loadu_ps(dp + (b0 + j) * (cp / 32) + 8 * sb);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sa), _mm512_mul_ps(wsA, dl), acc[j]);
            if (per16) acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sbv), _mm512_mul_ps(wsB, dl), acc[j]);
        }
    }
    for (int j = 0; j < nb; j++) out[j] = _mm512_reduce_add_ps(acc[j]);
}

/* fp32 activations on the byte-plane grid formats (iq3_s, iq3_xxs, iq2_xxs, iq2_xs, iq2_s): each weight row decoded
 * by plane (iq3_planes / iq2_planes: the lookups of the int8 path, not iq_chunk's gathers), its signed grid values
 * widened to fp32 and multiplied with x's rows laid out in the same order (per span of 256 values, or 512 for the
 * 8-byte entries: plane p's 64 values P e + p at 64 p, byte k of each 4-byte lane l at 16 k + l; zeros past cols)
 * into lane-wise sums, each lane (four entries of one scale group) scaled once per super-block. The value of the
 * natural-order product up to float summation order (within the floor); every row of x gets the same arithmetic
 * whatever B (one row fused: iq_row_planar_dot; more: the row decoded once, iq_planar_dot_stored).
 * 3072 x 1024, 2 threads, Zen 4, interleaved in one process, gathers (iq_gemv) -> planes: one row of x iq3_s 0.36 ->
 * 0.13 ms, iq3_xxs 0.44 -> 0.17, iq2_xxs 0.30 -> 0.11, iq2_xs 0.36 -> 0.13, iq2_s 0.30 -> 0.16; 9 rows 0.92-0.98 ->
 * 0.60-0.80; 64 rows 5.2-5.3 -> 3.8-4.7. */
static inline int iq_fp_P(int enc) { return iq_planar8(enc) ? 8 : 4; }
static inline long iq_fp_cols(int enc, long cols) { return iq_planar8(enc) ? iq_p8_cols(cols) : cols; }

static void iq_planar_xf(int P, const float *x, long B, long cols, long cp, float *xp) {
    const long span = 64 * P;
    for (long b = 0; b < B; b++)
        for (long s = 0; s < cp; s += span)
            for (int p = 0; p < P; p++)
                for (int k = 0; k < 4; k++)
                    for (int l = 0; l < 16; l++) {
                        long i = s + (long)P * (4 * l + k) + p;
                        xp[b * cp + s + 64 * p + 16 * k + l] = i < cols ? x[b * cols + i] : 0.0f;
                    }
}

/* a weight row decoded for many rows of x: per span (super-block; iq2 pair) its planes' signed values as fp32 in
 * byte order (iq_byte_f's values: exact) to wf, and its lane scales to wsv (iq3: ws; iq2: wsA, wsB) — so that
 * iq_planar_dot_stored repeats iq_row_planar_dot's arithmetic for each row of x, bit for bit */
static inline __attribute__((always_inline)) void iq_row_planar_f(int enc, const uint8_t *row, long cols, float *wf, float *wsv) {
    const long ts = Q_TSIZE[enc], nsb = cols / 256;
    if (iq_planar8(enc)) {
        for (long sb = 0; sb < nsb; sb += 2) {
            __m512i mp[8];
            __mmask64 sp[8];
            __m512 wsA, wsB;
            iq2_planes(enc, row + sb * ts, sb + 1 < nsb, mp, sp, &wsA, &wsB);
            for (int p = 0; p < 8; p++) {
                const __m512i w = _mm512_mask_sub_epi8(mp[p], sp[p], _mm512_setzero_si512(), mp[p]);
                for (int k = 0; k < 4; k++) _mm512_store_ps(wf + 256 * sb + 64 * p + 16 * k, iq_byte_f(w, k));
            }
            _mm512_store_ps(wsv + 16 * sb, wsA);
            _mm512_store_ps(wsv + 16 * sb + 16, wsB);
        }
        return;
    }
    for (long sb = 0; sb < nsb; sb++) {
        __m512i mp[4];
        __mmask64 sp[4];
        __m512 ws;
        iq3_planes(enc, row + sb * ts, mp, sp, &ws);
        for (int p = 0; p < 4; p++) {
            const __m512i w = _mm512_mask_sub_epi8(mp[p], sp[p], _mm512_setzero_si512(), mp[p]);
            for (int k = 0; k < 4; k++) _mm512_store_ps(wf + 256 * sb + 64 * p + 16 * k, iq_byte_f(w, k));
        }
        _mm512_store_ps(wsv + 16 * sb, ws);
    }
}

/* the stored row (iq_row_planar_f) against NX (1, 2) rows of x at xp, xp + cp: iq_row_planar_dot's sums, in its order */
static inline __attribute__((always_inline)) void iq_planar_dot_stored(int enc, int NX, const float *wf, const float *wsv,
                                                                        const float *xp, long cp, long cols, float *out) {
    const int P = iq_fp_P(enc);
    const long span = 64 * P, nsb = cols / 256;
    __m512 tot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (long s = 0, sb = 0; sb < nsb; s += span, sb += P / 4) {
        __m512 acc[2][4];
        for (int j = 0; j < NX; j++)
            for (int k = 0; k < 4; k++) acc[j][k] = _mm512_setzero_ps();
        for (int p = 0; p < P; p++)
            for (int k = 0; k < 4; k++) {
                const __m512 w = _mm512_load_ps(wf + s + 64 * p + 16 * k);
                for (int j = 0; j < NX; j++) acc[j][k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xp + j * cp + s + 64 * p + 16 * k), acc[j][k]);
            }
        for (int j = 0; j < NX; j++) {
            if (P == 8) {
                tot[j] = _mm512_fmadd_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_load_ps(wsv + 16 * sb), tot[j]);
                tot[j] = _mm512_fmadd_ps(_mm512_add_ps(acc[j][2], acc[j][3]), _mm512_load_ps(wsv + 16 * sb + 16), tot[j]);
            } else {
                tot[j] = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(acc[j][0], acc[j][1]), _mm512_add_ps(acc[j][2], acc[j][3])),
                                         _mm512_load_ps(wsv + 16 * sb), tot[j]);
            }
        }
    }
    for (int j = 0; j < NX; j++) out[j] = _mm512_reduce_add_ps(tot[j]);
}

/* one row of x (planar, xp) against one weight row, fused: byte k of each plane's lanes widened and multiplied with
 * x into a lane-wise sum (one per k), scaled once per super-block (pair) by its lanes' scales */
static inline __attribute__((always_inline)) void iq_fuse_plane(__m512i mag, __mmask64 sgn, const float *x, __m512 acc[4]) {
    const __m512i w = _mm512_mask_sub_epi8(mag, sgn, _mm512_setzero_si512(), mag);
    for (int k = 0; k < 4; k++) acc[k] = _mm512_fmadd_ps(iq_byte_f(w, k), _mm512_loadu_ps(x + 16 * k), acc[k]);
}

static inline __attribute__((always_inline)) float iq_row_planar_dot(int enc, const uint8_t *row, long cols, const float *xp) {
    const long ts = Q_TSIZE[enc], nsb = cols / 256;
    __m512 tot = _mm512_setzero_ps();
    if (iq_planar8(enc)) {
        for (long sb = 0; sb < nsb; sb += 2) {
            __m512i mp[8];
            __mmask64 sp[8];
            __m512 wsA, wsB, acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            iq2_planes(enc, row + sb * ts, sb + 1 < nsb, mp, sp, &wsA, &wsB);
            for (int p = 0; p < 8; p++) iq_fuse_plane(mp[p], sp[p], xp + 256 * sb + 64 * p, acc);
            tot = _mm512_fmadd_ps(_mm512_add_ps(acc[0], acc[1]), wsA, tot);
            tot = _mm512_fmadd_ps(_mm512_add_ps(acc[2], acc[3]), wsB, tot);
        }
    } else {
        for (long sb = 0; sb < nsb; sb++) {
            __m512i mp[4];
            __mmask64 sp[4];
            __m512 ws, acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            iq3_planes(enc, row + sb * ts, mp, sp, &ws);
            for (int p = 0; p < 4; p++) iq_fuse_plane(mp[p], sp[p], xp + 256 * sb + 64 * p, acc);
            tot = _mm512_fmadd_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])), ws, tot);
        }
    }
    return _mm512_reduce_add_ps(tot);
}

/* rows r0 .. r1 of W against xp (one instance per encoding; wf, wsv: this thread's scratch) */
static inline __attribute__((always_inline)) void iq_planar_rows(int enc, const uint8_t *W, const float *xp, float *y, long rows,
                                                                 long cols, long B, long r0, long r1, float *wf, float *wsv) {
    const long cp = iq_fp_cols(enc, cols), rb = cols / 256 * Q_TSIZE[enc];
    for (long r = r0; r < r1; r++) {
        if (B == 1) {
            y[r] = iq_row_planar_dot(enc, W + r * rb, cols, xp);
            continue;
        }
        iq_row_planar_f(enc, W + r * rb, cols, wf, wsv);
        long b = 0;
        float o[2];
        for (; b + 2 <= B; b += 2) {
            iq_planar_dot_stored(enc, 2, wf, wsv, xp + b * cp, cp, cols, o);
            y[b * rows + r] = o[0];
            y[(b + 1) * rows + r] = o[1];
        }
        if (b < B) {
            iq_planar_dot_stored(enc, 1, wf, wsv, xp + b * cp, cp, cols, o);
            y[b * rows + r] = o[0];
        }
    }
}

/* y [B, rows] = x [B, cols] fp32 times W (a byte-plane grid format), as iq_gemv; 0 where it does not apply (no
 * tables handed over: iq_gemv's NaN) */
static int iq_gemv_planar(int enc, const uint8_t *W, const float *x, float *y, long rows, long cols, long B) {
    if (!iq_planar(enc) || !iq_ready) return 0;
    const long cp = iq_fp_cols(enc, cols);
    float *xp = (float *)malloc((size_t)(B * cp) * sizeof(float));
    iq_planar_xf(iq_fp_P(enc), x, B, cols, cp, xp);
#pragma omp parallel
    {
        float *w = (float *)aligned_alloc(64, (size_t)(cp + cp / 16) * sizeof(float)), *wsv = w + cp;
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        long r0 = rows * t / nt, r1 = rows * (t + 1) / nt;
        switch (enc) {
        case IQ3_S: iq_planar_rows(IQ3_S, W, xp, y, rows, cols, B, r0, r1, w, wsv); break;
        case IQ3_XXS: iq_planar_rows(IQ3_XXS, W, xp, y, rows, cols, B, r0, r1, w, wsv); break;
        case IQ2_XXS: iq_planar_rows(IQ2_XXS, W, xp, y, rows, cols, B, r0, r1, w, wsv); break;
        case IQ2_XS: iq_planar_rows(IQ2_XS, W, xp, y, rows, cols, B, r0, r1, w, wsv); break;
        default: iq_planar_rows(IQ2_S, W, xp, y, rows, cols, B, r0, r1, w, wsv); break;
        }
        free(w);
    }
    free(xp);
    return 1;
}
#endif

/* Many rows of x (a prefill, a large batch): tiles of IQ_TR weight rows expanded once into signed int8 values (|w| <=
 * 62; iq1: 8 grid +- 1), each scale group's -128 (sum of its w) and its scale; x in tiles of 16 rows, transposed so
 * that a vector holds four consecutive values of each of the 16 rows (as q + 128, unsigned). A weight row's four
 * values, broadcast, times that vector (vpdpbusd from the group's -128 sum w) give sum w x of each x row exactly, per
 * scale group (16 or 32 values): then one conversion, one multiply (x's block scales by the weight group's) and one
 * FMA per group serve 16 rows of x — where the one-row kernel spends them per four values. Its sums are the same
 * integers; the float sum runs per scale group rather than per four-value lane (within the floor of the row
 * kernel, not bit for bit). */
#define IQ_TR 16
#define IQ_GEMM_FROM 16 /* rows of x from which iq_gemm_a8 runs */

static inline int iq_group(int enc) { return enc == IQ2_XS || enc == IQ2_S || enc == IQ1_M ? 16 : 32; }

/* per chunk of 64 natural values w at value offset at (a multiple of 64): each group's -128 sum w and scale (wl: the
 * chunk's scale per lane of four values) */
static inline __attribute__((always_inline)) void iq_expand_sums(int G, __m512i w, const float *wl, long at, int32_t *nc,
                                                                 float *sc) {
    int32_t ls[16];
    _mm512_storeu_si512((void *)ls, _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), w));
    for (int g = 0; g < 64 / G; g++) {
        int32_t t = 0;
        for (int l = 0; l < G / 4; l++) t += ls[g * (G / 4) + l];
        nc[(at + g * G) / G] = -128 * t;
        sc[(at + g * G) / G] = wl[g * (G / 4)];
    }
}

#if defined(IQ_PLANAR)
/* iq_expand of the byte-plane formats: the planes (iq3_planes / iq2_planes, not iq_chunk's gathers) signed and put
 * back in value order by vpermt2b — 64 values of P-byte entries take P / 2 two-plane picks and P / 2 - 1 blends —
 * and the groups' sums taken from the planes' lanes (a lane holds four entries of one group), with their scales:
 * the same bytes, sums and scales as iq_expand's. 3072 x 1024, Zen 4, 2 threads, interleaved in one process: 16
 * rows of x 0.45-0.61 -> 0.28-0.36 ms, 128 rows 1.6-1.9 -> 1.49-1.78 (the expansion had been ~60 % of the 16-row
 * product and ~20 % of the 128-row one). */
/* the vpermt2b indices of chunk k (value order): byte P i + q is entry (64 / P) k + i of plane q — picked from a pair
 * of planes (q & ~1, q | 1: + 64 for the odd one), the blends then choosing the pair by q */
#define IQX_I(P, k, j) (((j) % (P) & 1 ? 64 : 0) + (64 / (P)) * (k) + (j) / (P))
#define IQX_ROW(P, k)                                                                                                    \
    {IQX_I(P, k, 0), IQX_I(P, k, 1), IQX_I(P, k, 2), IQX_I(P, k, 3), IQX_I(P, k, 4), IQX_I(P, k, 5), IQX_I(P, k, 6),       \
     IQX_I(P, k, 7), IQX_I(P, k, 8), IQX_I(P, k, 9), IQX_I(P, k, 10), IQX_I(P, k, 11), IQX_I(P, k, 12), IQX_I(P, k, 13),   \
     IQX_I(P, k, 14), IQX_I(P, k, 15), IQX_I(P, k, 16), IQX_I(P, k, 17), IQX_I(P, k, 18), IQX_I(P, k, 19),               \
     IQX_I(P, k, 20), IQX_I(P, k, 21), IQX_I(P, k, 22), IQX_I(P, k, 23), IQX_I(P, k, 24), IQX_I(P, k, 25),               \
     IQX_I(P, k, 26), IQX_I(P, k, 27), IQX_I(P, k, 28), IQX_I(P, k, 29), IQX_I(P, k, 30), IQX_I(P, k, 31),               \
     IQX_I(P, k, 32), IQX_I(P, k, 33), IQX_I(P, k, 34), IQX_I(P, k, 35), IQX_I(P, k, 36), IQX_I(P, k, 37),               \
     IQX_I(P, k, 38), IQX_I(P, k, 39), IQX_I(P, k, 40), IQX_I(P, k, 41), IQX_I(P, k, 42), IQX_I(P, k, 43),               \
     IQX_I(P, k, 44), IQX_I(P, k, 45), IQX_I(P, k, 46), IQX_I(P, k, 47), IQX_I(P, k, 48), IQX_I(P, k, 49),               \
     IQX_I(P, k, 50), IQX_I(P, k, 51), IQX_I(P, k, 52), IQX_I(P, k, 53), IQX_I(P, k, 54), IQX_I(P, k, 55),               \
     IQX_I(P, k, 56), IQX_I(P, k, 57), IQX_I(P, k, 58), IQX_I(P, k, 59), IQX_I(P, k, 60), IQX_I(P, k, 61),               \
     IQX_I(P, k, 62), IQX_I(P, k, 63)}
static const uint8_t IQX_PICK4[4][64] __attribute__((aligned(64))) = {IQX_ROW(4, 0), IQX_ROW(4, 1), IQX_ROW(4, 2), IQX_ROW(4, 3)};
static const uint8_t IQX_PICK8[8][64] __attribute__((aligned(64))) = {IQX_ROW(8, 0), IQX_ROW(8, 1), IQX_ROW(8, 2), IQX_ROW(8, 3),
                                                                       IQX_ROW(8, 4), IQX_ROW(8, 5), IQX_ROW(8, 6), IQX_ROW(8, 7)};
#undef IQX_ROW
#undef IQX_I

static inline __attribute__((always_inline)) void iq_expand_planar(int enc, const uint8_t *row, long cols, int8_t *w8,
                                                                   int32_t *nc, float *sc) {
    const int G = iq_group(enc), P = iq_fp_P(enc);
    const long ts = Q_TSIZE[enc], nsb = cols / 256;
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
    for (long sb = 0; sb < nsb; sb += P / 4) {
        __m512i w[8];
        int nch = 4; /* 64-value chunks to write */
        if (P == 8) {
            __m512i mp[8];
            __mmask64 sp[8];
            __m512 wsA, wsB;
            const int two = sb + 1 < nsb;
            iq2_planes(enc, row + sb * ts, two, mp, sp, &wsA, &wsB);
            for (int p = 0; p < 8; p++) w[p] = _mm512_mask_sub_epi8(mp[p], sp[p], zero, mp[p]);
            if (two) nch = 8;
            /* lane l of each plane: entries 4l .. 4l + 3 (a group of 32 values; of 16: 4l, 4l + 1 and 4l + 2, 4l + 3) */
            const long g0 = 256 * sb / G, ng = (two ? 512 : 256) / G;
            int32_t sa[16], sbv[16];
            float fa[16], fb[16];
            if (G == 32) {
                __m512i ls = zero;
                for (int p = 0; p < 8; p++) ls = _mm512_dpbusd_epi32(ls, ones, w[p]);
                _mm512_storeu_si512((void *)sa, ls);
                _mm512_storeu_ps(fa, wsA);
                for (long g = 0; g < ng; g++) {
                    nc[g0 + g] = -128 * sa[g];
                    sc[g0 + g] = fa[g];
                }
            } else {
                const __m512i oa = _mm512_set1_epi32(0x0101), ob = _mm512_set1_epi32(0x01010000);
                __m512i la = zero, lb = zero;
                for (int p = 0; p < 8; p++) {
                    la = _mm512_dpbusd_epi32(la, oa, w[p]);
                    lb = _mm512_dpbusd_epi32(lb, ob, w[p]);
                }
                _mm512_storeu_si512((void *)sa, la);
                _mm512_storeu_si512((void *)sbv, lb);
                _mm512_storeu_ps(fa, wsA);
                _mm512_storeu_ps(fb, wsB);
                for (long g = 0; g < ng / 2; g++) {
                    nc[g0 + 2 * g] = -128 * sa[g];
                    nc[g0 + 2 * g + 1] = -128 * sbv[g];
                    sc[g0 + 2 * g] = fa[g];
                    sc[g0 + 2 * g + 1] = fb[g];
                }
            }
        } else {
            __m512i mp[4];
            __mmask64 sp[4];
            __m512 ws;
            iq3_planes(enc, row + sb * ts, mp, sp, &ws);
            __m512i ls = zero;
            for (int p = 0; p < 4; p++) {
                w[p] = _mm512_mask_sub_epi8(mp[p], sp[p], zero, mp[p]);
                ls = _mm512_dpbusd_epi32(ls, ones, w[p]);
            }
            /* lane l: entries 4l .. 4l + 3; group g (32 values) lanes 2g, 2g + 1: their sum in the low half of each
             * 64-bit lane, taken with the even lanes' scales */
            const __m512i pr = _mm512_add_epi32(ls, _mm512_srli_epi64(ls, 32));
            _mm256_storeu_si256((__m256i *)(void *)(nc + 8 * sb), _mm512_cvtepi64_epi32(_mm512_mullo_epi32(pr, _mm512_set1_epi32(-128))));
            _mm256_storeu_si256((__m256i *)(void *)(sc + 8 * sb), _mm512_cvtepi64_epi32(_mm512_castps_si512(ws)));
        }
        for (int k = 0; k < nch; k++) {
            const __m512i idx = _mm512_load_si512((const void *)(P == 4 ? IQX_PICK4[k] : IQX_PICK8[k]));
            __m512i out;
            if (P == 4) {
                out = _mm512_mask_blend_epi8((__mmask64)0xCCCCCCCCCCCCCCCCull, _mm512_permutex2var_epi8(w[0], idx, w[1]),
                                             _mm512_permutex2var_epi8(w[2], idx, w[3]));
            } else {
                __m512i t0 = _mm512_permutex2var_epi8(w[0], idx, w[1]), t1 = _mm512_permutex2var_epi8(w[2], idx, w[3]);
                __m512i t2 = _mm512_permutex2var_epi8(w[4], idx, w[5]), t3 = _mm512_permutex2var_epi8(w[6], idx, w[7]);
                __m512i lo = _mm512_mask_blend_epi8((__mmask64)0xCCCCCCCCCCCCCCCCull, t0, t1);
                __m512i hi = _mm512_mask_blend_epi8((__mmask64)0xCCCCCCCCCCCCCCCCull, t2, t3);
                out = _mm512_mask_blend_epi8((__mmask64)0xF0F0F0F0F0F0F0F0ull, lo, hi);
            }
            _mm512_storeu_si512((void *)(w8 + 256 * sb + 64 * k), out);
        }
    }
}
#endif

static inline __attribute__((always_inline)) void iq_expand(int enc, const uint8_t *row, long cols, int8_t *w8, int32_t *nc,
                                                            float *sc) {
#if defined(IQ_PLANAR)
    if (iq_planar(enc)) {
        iq_expand_planar(enc, row, cols, w8, nc, sc);
        return;
    }
#endif
    const int G = iq_group(enc);
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *b = row + sb * Q_TSIZE[enc];
        float d = iq_d(enc, b);
        for (int c = 0; c < 4; c++) {
            __m512 ws;
            __m512i w = iq_signed_chunk(enc, b, d, c, &ws);
            long at = 256 * sb + 64 * c;
            _mm512_storeu_si512((void *)(w8 + at), w);
            /* per lane: sum of its four w (vpdpbusd with 1s), then per group of G / 4 lanes, times -128 */
            float wl[16];
            _mm512_storeu_ps(wl, ws);
            iq_expand_sums(G, w, wl, at, nc, sc);
        }
    }
}

/* IQ_RB weight rows (tile buffers w8 / nc / sc) times one 16-row x tile (xt: transposed, dx: [cols / 32][16] block
 * scales): out[i] holds weight row i's 16 results. 8 rows rather than 4 in flight: 3072 x 1024 iq3_s at 128 rows of
 * x, 2.99 -> 2.63 ms (interleaving the rows' words so one pointer reaches every broadcast bought nothing more) */
#define IQ_RB 8
static inline __attribute__((always_inline)) void iq_gemm_rb(int G, const int8_t *w8, const int32_t *nc, const float *sc,
                                                             const uint8_t *xt, const float *dx, long cols, __m512 out[IQ_RB]) {
    const long ng = cols / G;
    for (int i = 0; i < IQ_RB; i++) out[i] = _mm512_setzero_ps();
    for (long g = 0; g < ng; g++) {
        __m512i xv[8];
        for (int k = 0; k < G / 4; k++) xv[k] = _mm512_loadu_si512((const void *)(xt + (g * G + 4 * k) * 16));
        __m512 dv = _mm512_loadu_ps(dx + (g * G / 32) * 16);
        __m512i acc[IQ_RB];
        for (int i = 0; i < IQ_RB; i++) acc[i] = _mm512_set1_epi32(nc[i * ng + g]);
        for (int k = 0; k < G / 4; k++)
            for (int i = 0; i < IQ_RB; i++) {
                int32_t w4;
                memcpy(&w4, w8 + i * cols + g * G + 4 * k, 4);
                acc[i] = _mm512_dpbusd_epi32(acc[i], xv[k], _mm512_set1_epi32(w4));
            }
        for (int i = 0; i < IQ_RB; i++)
            out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(dv, _mm512_set1_ps(sc[i * ng + g])), out[i]);
    }
}

static void iq_gemm_a8(int enc, const uint8_t *W, const int8_t *q, const float *d, float *y, long rows, long cols, long B) {
    const int G = iq_group(enc);
    long rb = cols / 256 * Q_TSIZE[enc], nt = (rows + IQ_TR - 1) / IQ_TR, ng = cols / G, nx = (B + 15) / 16;
    /* x tiles: [nx][cols / 4][16 rows][4] as q + 128 (rows past B: q = 0, scale 0); block scales [nx][cols / 32][16] */
    uint8_t *xt = (uint8_t *)malloc((size_t)(nx * 16 * cols) + 64);
    float *dx = (float *)calloc((size_t)(nx * 16 * (cols / 32)) + 16, sizeof(float));
    uint32_t *row = (uint32_t *)malloc((size_t)cols + 64);
    for (long t = 0; t < nx; t++)
        for (long l = 0; l < 16; l++) {
            long b = 16 * t + l;
            if (b < B) {
                for (long k = 0; k < cols; k += 64) /* q + 128 */
                    _mm512_storeu_si512((void *)((uint8_t *)row + k), _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + b * cols + k)),
                                                                                      _mm512_set1_epi8((char)0x80)));
                for (long g = 0; g < cols / 32; g++) dx[(t * (cols / 32) + g) * 16 + l] = d[b * (cols / 32) + g];
            } else {
                memset(row, 0x80, (size_t)cols);
            }
            uint32_t *xw = (uint32_t *)(void *)(xt + t * cols * 16);
            for (long j = 0; j < cols / 4; j++) xw[j * 16 + l] = row[j]; /* four values of row l at word j */
        }
    free(row);
#pragma omp parallel
    {
        int8_t *w8 = (int8_t *)calloc((size_t)(IQ_TR * cols) + 64, 1);
        int32_t *nc = (int32_t *)calloc((size_t)(IQ_TR * ng) + 16, sizeof(int32_t));
        float *sc = (float *)calloc((size_t)(IQ_TR * ng) + 16, sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (long t = 0; t < nt; t++) {
            long r0 = t * IQ_TR, R = rows - r0 < IQ_TR ? rows - r0 : IQ_TR;
#define IQ_EXPAND(E) iq_expand(E, W + (r0 + r) * rb, cols, w8 + r * cols, nc + r * ng, sc + r * ng)
            for (long r = 0; r < R; r++) {
                IQ_SWITCH(enc, IQ_EXPAND)
            }
#undef IQ_EXPAND
            if (R < IQ_TR) { /* the last tile's missing rows: zero weights (their results are not stored) */
                memset(w8 + R * cols, 0, (size_t)((IQ_TR - R) * cols));
                memset(nc + R * ng, 0, (size_t)((IQ_TR - R) * ng) * sizeof(int32_t));
                memset(sc + R * ng, 0, (size_t)((IQ_TR - R) * ng) * sizeof(float));
            }
            for (long xb = 0; xb < nx; xb++) {
                float res[IQ_TR][16]; /* weight row i, x row l */
                for (long r = 0; r < R; r += IQ_RB) {
                    __m512 out[IQ_RB];
                    const uint8_t *xtt = xt + xb * 16 * cols;
                    const float *dxt = dx + xb * 16 * (cols / 32);
                    if (G == 16) iq_gemm_rb(16, w8 + r * cols, nc + r * ng, sc + r * ng, xtt, dxt, cols, out);
                    else iq_gemm_rb(32, w8 + r * cols, nc + r * ng, sc + r * ng, xtt, dxt, cols, out);
                    for (int i = 0; i < IQ_RB; i++) _mm512_storeu_ps(res[r + i], out[i]);
                }
                /* each x row's R results are consecutive in y: stored whole (16 scattered floats per weight row, one
                 * cache line each, cost as much as the products: 3072 x 1024 at 128 rows, ~0.7 of ~2.3 ms) */
                for (long l = 0; l < 16 && 16 * xb + l < B; l++) {
                    float o[IQ_TR];
                    for (long i = 0; i < IQ_TR; i++) o[i] = res[i][l];
                    memcpy(y + (16 * xb + l) * rows + r0, o, (size_t)R * sizeof(float));
                }
            }
        }
        free(w8);
        free(nc);
        free(sc);
    }
    free(xt);
    free(dx);
}

/* one weight row against rows b0 .. b0 + nb of x: an instance for up to 4 rows and one for up to IQ_NB, per
 * encoding; by byte plane (qp, dl16) where planar */
static inline __attribute__((always_inline)) void iq_a8_pass(int enc, int planar, const uint8_t *row, long cols, const int8_t *q, const float *dl, const int8_t *qp,
                       const float *dl16, long b0, int nb, float *out) {
    if (enc == IQ1_M) {
        if (nb <= 4) iq1m_a8_row(4, row, cols, q, dl, b0, nb, out);
        else iq1m_a8_row(IQ_NB, row, cols, q, dl, b0, nb, out);
        return;
    }
    if (enc == IQ1_S && nb <= 4) {
        iq1s_a8_row(4, row, cols, q, dl, b0, nb, out);
        return;
    }
#if defined(IQ_PLANAR)
    if (planar && iq_planar8(enc)) {
#define IQ2_PROW(E)                                                                                                      \
    if (nb <= 4) iq2_a8_row_planar(E, 4, row, cols, qp, dl16, b0, nb, out);                                             \
    else iq2_a8_row_planar(E, IQ_NB, row, cols, qp, dl16, b0, nb, out);
        if (enc == IQ2_XXS) {
            IQ2_PROW(IQ2_XXS)
        } else if (enc == IQ2_XS) {
            IQ2_PROW(IQ2_XS)
        } else {
            IQ2_PROW(IQ2_S)
        }
#undef IQ2_PROW
        return;
    }
    if (planar) {
        if (nb <= 4) {
            if (enc == IQ3_S) iq_a8_row_planar(IQ3_S, 4, row, cols, qp, dl16, b0, nb, out);
            else iq_a8_row_planar(IQ3_XXS, 4, row, cols, qp, dl16, b0, nb, out);
        } else {
            if (enc == IQ3_S) iq_a8_row_planar(IQ3_S, IQ_NB, row, cols, qp, dl16, b0, nb, out);
            else iq_a8_row_planar(IQ3_XXS, IQ_NB, row, cols, qp, dl16, b0, nb, out);
        }
        return;
    }
#endif
    (void)planar; (void)qp; (void)dl16;
#define IQ_ROW4(E) iq_a8_row(E, 4, row, cols, q, dl, b0, nb, out)
#define IQ_ROW8(E) iq_a8_row(E, IQ_NB, row, cols, q, dl, b0, nb, out)
    if (nb <= 4) {
        IQ_SWITCH(enc, IQ_ROW4)
    } else {
        IQ_SWITCH(enc, IQ_ROW8)
    }
#undef IQ_ROW4
#undef IQ_ROW8
}

static void iq_gemv_a8(int enc, const uint8_t *W, const float *x, float *y, long rows, long cols, long B) {
    long rb = cols / 256 * Q_TSIZE[enc], ng = cols / 32;
    int8_t *q = (int8_t *)malloc((size_t)(B * cols) + 64);
    float *d = (float *)malloc((size_t)(B * ng + 1) * sizeof(float)), *dl = NULL;
    for (long b = 0; b < B; b++) a8_quantize_row(x + b * cols, cols, q + b * cols, d + b * ng);
    if (B >= IQ_GEMM_FROM) {
        iq_gemm_a8(enc, W, q, d, y, rows, cols, B);
        free(q);
        free(d);
        return;
    }
    int8_t *qp = NULL;
    float *dl16 = NULL;
    int planar = 0;
#if defined(IQ_PLANAR)
    if (iq_planar8(enc)) { /* x by 8 planes per 512 values, its block scales padded alike */
        planar = 1;
        qp = (int8_t *)malloc((size_t)(B * iq_p8_cols(cols)) + 64);
        dl16 = (float *)malloc((size_t)(B * iq_p8_cols(cols) / 32 + 1) * sizeof(float));
        iq_planar_x8(q, d, B, cols, qp, dl16);
    } else if (iq_planar(enc)) {
        planar = 1;
        qp = (int8_t *)malloc((size_t)(B * cols) + 64);
        dl16 = (float *)malloc((size_t)(B * cols / 16 + 1) * sizeof(float));
        iq_planar_x(q, d, B, cols, qp, dl16);
    }
#endif
    if (!planar) { /* the per-entry kernel: x's block scale for each lane of four values */
        dl = (float *)malloc((size_t)(B * cols / 4 + 1) * sizeof(float));
        for (long b = 0; b < B; b++)
            for (long l = 0; l < cols / 4; l++) dl[b * (cols / 4) + l] = d[b * ng + l / 8];
    }
#pragma omp parallel for schedule(static)
    for (long r = 0; r < rows; r++) {
        for (long b0 = 0; b0 < B; b0 += IQ_NB) {
            int nb = (int)(B - b0 < IQ_NB ? B - b0 : IQ_NB);
            float out[IQ_NB];
            iq_a8_pass(enc, planar, W + r * rb, cols, q, dl, qp, dl16, b0, nb, out);
            for (int j = 0; j < nb; j++) y[(b0 + j) * rows + r] = out[j];
        }
    }
    free(qp);
    free(dl16);
    free(q);
    free(d);
    free(dl);
}
#endif

/* rows [r0, r1) of W decoded to fp32 (out [r1 - r0, cols], row-major), each weight exactly as
 * gguf.quants.dequantize gives it: the prefill path decodes a few rows at a time and multiplies them by a
 * fast GEMM (never the whole matrix at once) */
static inline __attribute__((always_inline)) void q_dequant_row(int enc, const uint8_t *row, long cols, float *o, float *s, float *mn) {
    long nu = cols / (32 * QU(enc));
    q_row_scales(enc, row, cols / Q_BLOCK[enc], s, mn);
    for (long u = 0; u < nu; u++) q_wunit(enc, row, u, s, mn, o + 32 * QU(enc) * u);
}

/* q_dequant_row of any encoding (one instance per encoding; vxc_qdequant's and vxc_qembedding's rows) */
static void q_dequant_row_any(int enc, const uint8_t *row, long cols, float *o, float *s, float *mn) {
    if (q_grid(enc)) {
        iq_row(enc, row, cols, o);
        return;
    }
    switch (enc) {
    case Q8_0: q_dequant_row(Q8_0, row, cols, o, s, mn); break;
    case Q4_0: q_dequant_row(Q4_0, row, cols, o, s, mn); break;
    case Q4_1: q_dequant_row(Q4_1, row, cols, o, s, mn); break;
    case Q4_K: q_dequant_row(Q4_K, row, cols, o, s, mn); break;
    case Q5_0: q_dequant_row(Q5_0, row, cols, o, s, mn); break;
    case Q5_K: q_dequant_row(Q5_K, row, cols, o, s, mn); break;
    case Q5_1: q_dequant_row(Q5_1, row, cols, o, s, mn); break;
    case Q2_K: q_dequant_row(Q2_K, row, cols, o, s, mn); break;
    case Q3_K: q_dequant_row(Q3_K, row, cols, o, s, mn); break;
    case IQ4_NL: q_dequant_row(IQ4_NL, row, cols, o, s, mn); break;
    case IQ4_XS: q_dequant_row(IQ4_XS, row, cols, o, s, mn); break;
    case TQ1_0: q_dequant_row(TQ1_0, row, cols, o, s, mn); break;
    case TQ2_0: q_dequant_row(TQ2_0, row, cols, o, s, mn); break;
    default: q_dequant_row(Q6_K, row, cols, o, s, mn); break;
    }
}

void vxc_qdequant(int enc, const void *W, float *out, long r0, long r1, long cols) {
    if (enc < 0 || enc >= Q_COUNT || r1 <= r0) return;
    long rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], ns = q_ns(enc, cols), nm = q_nm(enc, cols);
#pragma omp parallel
    {
        float *s = (float *)malloc((size_t)(ns + nm + 1) * sizeof(float)), *mn = s + ns;
#pragma omp for schedule(static)
        for (long r = r0; r < r1; r++) {
            const uint8_t *row = (const uint8_t *)W + r * rb;
            float *o = out + (r - r0) * cols;
            q_dequant_row_any(enc, row, cols, o, s, mn);
        }
        free(s);
    }
}

/* vxc_qdequant with bf16 out: each row decoded to its fp32 values in a per-thread row buffer and rounded to nearest,
 * ties to even (as torch's .to(bfloat16) of vxc_qdequant's output, bit for bit), one pass over the tile: a bf16
 * prefill's decoded tiles (quant.qgemm_tiled) without the fp32 tile and its copy */
void vxc_qdequant_bf16(int enc, const void *W, bf16_t *out, long r0, long r1, long cols) {
    if (enc < 0 || enc >= Q_COUNT || r1 <= r0) return;
    long rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], ns = q_ns(enc, cols), nm = q_nm(enc, cols);
#pragma omp parallel
    {
        float *s = (float *)malloc((size_t)(ns + nm + 1 + cols) * sizeof(float)), *mn = s + ns, *o = mn + nm + 1;
#pragma omp for schedule(static)
        for (long r = r0; r < r1; r++) {
            q_dequant_row_any(enc, (const uint8_t *)W + r * rb, cols, o, s, mn);
            bf16_t *d = out + (r - r0) * cols;
            long i = 0;
#if defined(__AVX512BF16__)
            /* vcvtneps2bf16 rounds as f2bf (nearest, ties to even; a NaN kept quiet); it reads fp32 denormals as zero,
             * which no ggml weight is (each a multiple of an f16 scale's 2^-24 or finer, far above 2^-126) */
            for (; i + 16 <= cols; i += 16)
                _mm256_storeu_si256((__m256i *)(d + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(o + i)));
#endif
            for (; i < cols; i++) d[i] = f2bf(o[i]);
        }
        free(s);
    }
}

/* The composite kernels over encoded weights (qdense.py), as native calls a decode step can replay. */

/* y [B, N] fp32 += bias [N] (bf16 when bf, else fp32): qlinear's bias, added in fp32 after the GEMV */
void vxc_qbias(float *y, const void *bias, long B, long N, int bf) {
    for (long b = 0; b < B; b++)
        for (long n = 0; n < N; n++) y[b * N + n] += ld(bias, n, bf);
}

/* dst [n] bf16 = src [n] fp32 rounded to nearest, ties to even (as torch's .to(bfloat16)): an encoded product's fp32
 * output handed to a bf16 session */
void vxc_to_bf16(const float *src, bf16_t *dst, long n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (long i = 0; i < n; i++) dst[i] = f2bf(src[i]);
}

/* dst [n] fp32 = src [n] bf16 (exact): a bf16 session's operands of the encoded MoE forms, which compute in fp32 */
void vxc_from_bf16(const bf16_t *src, float *dst, long n) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (long i = 0; i < n; i++) dst[i] = bf2f(src[i]);
}

/* h [n] fp32 = silu(g) * u: qswiglu's activation between its up and down projections */
void vxc_qsilu_mul(const float *g, const float *u, float *h, long n) {
#pragma omp parallel for schedule(static) if (n >= 16384)
    for (long i = 0; i < n; i++) h[i] = silu(g[i]) * u[i];
}

/* out [T, d] fp32 = routed + s_t h: a shared expert's output h added to the routed sum, scaled per token by
 * s_t = sigmoid(x_t . bg) (bg [d], the branch gate) or 1 (bg NULL); all fp32 (qmoe_shared's native form). */
void vxc_shared_add(const float *x, const float *h, const float *routed, const float *bg, float *out, long T, long d) {
    for (long t = 0; t < T; t++) {
        float s = 1.0f;
        if (bg) {
            double acc = 0.0;
            for (long i = 0; i < d; i++) acc += (double)x[t * d + i] * (double)bg[i];
            s = (float)(1.0 / (1.0 + exp(-acc)));
        }
        for (long i = 0; i < d; i++) out[t * d + i] = routed[t * d + i] + s * h[t * d + i];
    }
}

/* out [T, cols] fp32: the rows ids[t] of table (encoding enc, rows of cols values) decoded exactly as
 * gguf.quants.dequantize decodes them; ids are read from memory (a replayed step's token buffer). The caller
 * checks 0 <= ids[t] < vocab. drop_bytes > 0: the table (drop_bytes long) is a view of a weights file's private
 * mapping, never written; once decoded, each row's 2 MiB window of it (clamped to the table's whole pages) is
 * released (MADV_DONTNEED), so the pages a gather faults in — whole page-cache folios, tens of KiB for a row of
 * under 1 KiB — do not accumulate in RSS token after token (a later read faults them in again from the page
 * cache). */
/* the 2 MiB windows of a table in a file mapping that rows ids[t0 .. t1) sit in, released (MADV_DONTNEED) */
static void qembedding_drop(const void *table, const int64_t *ids, long t0, long t1, long rb, long drop_bytes) {
#if defined(__linux__)
    const uintptr_t W = (uintptr_t)2 << 20, PG = 4096;
    uintptr_t lo = ((uintptr_t)table + PG - 1) & ~(PG - 1), hi = ((uintptr_t)table + (uintptr_t)drop_bytes) & ~(PG - 1);
    uintptr_t last = 0;
    for (long t = t0; t < t1; t++) {
        uintptr_t a = ((uintptr_t)table + (uintptr_t)(ids[t] * rb)) & ~(W - 1), b = a + W;
        if (a == last) continue;
        last = a;
        if (a < lo) a = lo;
        if (b > hi) b = hi;
        if (b > a) madvise((void *)a, b - a, MADV_DONTNEED);
    }
#else
    (void)table; (void)ids; (void)t0; (void)t1; (void)rb; (void)drop_bytes;
#endif
}

#define QEMB_DROP_ROWS 1 /* rows gathered between two releases: a fault maps a whole page-cache folio (up to
                          * 2 MiB with large folios), so the 512 random rows of a prefill released at the end held
                          * ~80 MB of a 262144-row table at once, and even 16 rows at a time most of an 18 MB one */

void vxc_qembedding(int enc, const void *table, const int64_t *ids, float *out, long T, long cols, long drop_bytes) {
    if (enc < 0 || enc >= Q_COUNT || T <= 0) return;
    long rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], ns = q_ns(enc, cols), nm = q_nm(enc, cols);
    float *s = (float *)malloc((size_t)(ns + nm + 1) * sizeof(float)), *mn = s + ns;
    for (long t0 = 0; t0 < T; t0 += QEMB_DROP_ROWS) {
        long t1 = t0 + QEMB_DROP_ROWS < T ? t0 + QEMB_DROP_ROWS : T;
        for (long t = t0; t < t1; t++) {
            const uint8_t *row = (const uint8_t *)table + ids[t] * rb;
            float *o = out + t * cols;
            q_dequant_row_any(enc, row, cols, o, s, mn);
        }
        if (drop_bytes > 0) qembedding_drop(table, ids, t0, t1, rb, drop_bytes);
    }
    free(s);
}

/* ---------------------------------------------------------------------------------------------------------
 * int8 activations (an operand declaring ``activations int8_block32``): vxc_qgemv_a8.
 *
 * Each row of x is quantised per 32-value block as ggml's q8_0 does, with an fp32 scale: d = amax / 127,
 * q = nearbyint(x / d) (round half to even; all 0 when amax = 0), |q| <= 127. A weight group's integers times
 * its x block are summed exactly in int32 (AVX-512 VNNI vpdpbusd on the weights as unsigned bytes — the
 * formats' offsets -8 / -16 / -32 folded in by starting each lane at offset * (its four x bytes' sum), q8_0's
 * signed bytes by |w| against x with w's sign — or maddubs + madd on AVX2, plain ints otherwise), and
 * y = sum_g d_g (s_g sum_i q_i x_i + mn_g sum_i x_i): one fp32 scale per group (per 16 values for q6_k) times
 * an exact integer, the mins of q4_1 / q4_k through the block sums of x. The result is the fp32 product of
 * the dequantised weights with the dequantised activations d q, up to summation order (the torch twin's
 * definition). */

#if defined(__AVX512BW__) && defined(__AVX512F__)
#define A8_UNIT 64 /* values per vector unit */
#define A8_QG 4
#elif defined(__AVX2__) && defined(__FMA__)
#define A8_UNIT 32
#define A8_QG 2
#else
#define A8_UNIT 32
#define A8_QG 4
#endif
#define A8_LANES (A8_UNIT / 4)

/* the offset taken off the stored integer (the bias the unsigned bytes carry) */
static inline int a8_off(int enc) { return enc == Q4_0 ? -8 : enc == Q5_0 ? -16 : enc == Q6_K ? -32 : enc == Q3_K ? -4 : q_tern(enc) ? -1 : 0; }
/* the packed layout's offset per integer (vxc_qpack stores q8_0 biased by 128: unsigned for vpdpbusd) */
static inline int p_off(int enc) { return enc == Q4_0 ? -8 : enc == Q8_0 || enc == Q3_K || q_iq4(enc) ? -128 : enc == Q5_0 ? -16 : q_tern(enc) ? -1 : 0; }
static inline int a8_has_min(int enc) { return q_has_min(enc); }
/* the formats whose integers are signed bytes (vpdpbusd takes |w| against x with w's sign) */
static inline int a8_s8(int enc) { return enc == Q8_0 || q_iq4(enc); }
/* the 4-bit 32-value formats whose unit of 64 puts both blocks' low nibbles before their high ones */
static inline int a8_split(int enc) { return A8_UNIT == 64 && (enc == Q4_0 || enc == Q4_1 || enc == Q5_0 || enc == Q5_1); }

/* one row of x (fp32, cols a multiple of 32) quantised: q in natural order, d per block of 32 */
static void a8_quantize_row(const float *x, long cols, int8_t *q, float *d) {
    for (long g = 0; g < cols / 32; g++) {
        const float *v = x + 32 * g;
        int8_t *o = q + 32 * g;
#if defined(__AVX512F__)
        __m512 a0 = _mm512_loadu_ps(v), a1 = _mm512_loadu_ps(v + 16);
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a0), _mm512_abs_ps(a1)));
        float dg = amax / 127.0f;
        d[g] = dg;
        if (amax == 0.0f) {
            memset(o, 0, 32);
            continue;
        }
        __m512 dv = _mm512_set1_ps(dg);
        _mm_storeu_si128((__m128i *)o, _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(a0, dv))));
        _mm_storeu_si128((__m128i *)(o + 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_div_ps(a1, dv))));
#else
        float amax = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
        }
        float dg = amax / 127.0f;
        d[g] = dg;
        for (int i = 0; i < 32; i++) o[i] = amax == 0.0f ? 0 : (int8_t)nearbyintf(v[i] / dg);
#endif
    }
}

/* the quantised rows of x as the vector loop reads them */
typedef struct {
    int8_t *q;   /* [B, cols]: natural order, each split unit's middle 16-byte chunks swapped */
    int32_t *ox; /* [B, nu * A8_LANES]: offset times the sum of each lane's four x bytes (formats with an offset) */
    float *xc;   /* [B, cols / 32]: d_g times the sum of block g (formats with a min) */
    int32_t *xs; /* [B, cols / 32]: the packed kernel's offset (p_off) times the sum of block g */
    int32_t *xs16; /* [B, cols / 16]: -32 (q3_k: -4) times the sum of each 16 values (q6_k's, q3_k's offset term per scale block) */
    float *xc16;   /* [B, cols / 16]: d_g times the sum of each 16 values (q2_k's mins, one per 16) */
    float *d;    /* [B, cols / 32] */
    long nu, nl, ng;
} a8_x;

/* natural: keep every unit in value order (the packed kernels' reading), else swap as a8_split says */
static void a8_prepare(int enc, const float *x, long cols, long B, a8_x *X, int natural) {
    long ng = cols / 32, nu = cols / A8_UNIT, nl = nu * A8_LANES;
    X->nu = nu;
    X->ng = ng;
    X->nl = nl;
    X->q = (int8_t *)malloc((size_t)(B * cols + 64));
    X->d = (float *)malloc((size_t)(B * ng + 4) * sizeof(float));
    X->ox = (int32_t *)malloc((size_t)(B * nl + 1) * sizeof(int32_t));
    X->xc = (float *)malloc((size_t)(B * ng + 1) * sizeof(float));
    X->xs = (int32_t *)malloc((size_t)(B * ng + 1) * sizeof(int32_t));
    X->xs16 = (int32_t *)malloc((size_t)(2 * B * ng + 1) * sizeof(int32_t));
    X->xc16 = (float *)malloc((size_t)(2 * B * ng + 1) * sizeof(float));
    int off = a8_off(enc), o16 = enc == Q3_K ? -4 : -32; /* the per-16 formats' offsets: q3_k's, else q6_k's */
#pragma omp parallel for schedule(static) if (B * cols >= 65536)
    for (long b = 0; b < B; b++) {
        int8_t *q = X->q + b * cols;
        float *d = X->d + b * ng;
        a8_quantize_row(x + b * cols, cols, q, d);
        for (long g = 0; g < ng; g++) {
            int s = 0;
            for (int i = 0; i < 32; i++) s += q[32 * g + i];
            X->xc[b * ng + g] = d[g] * (float)s;
            X->xs[b * ng + g] = p_off(enc) * s;
            int s16 = 0;
            for (int i = 0; i < 16; i++) s16 += q[32 * g + i];
            X->xs16[2 * (b * ng + g)] = o16 * s16;
            X->xs16[2 * (b * ng + g) + 1] = o16 * (s - s16);
            X->xc16[2 * (b * ng + g)] = d[g] * (float)s16;
            X->xc16[2 * (b * ng + g) + 1] = d[g] * (float)(s - s16);
        }
        for (long u = 0; u < nu; u++) {
            if (a8_split(enc) && !natural) { /* [lo g | hi g | lo g+1 | hi g+1] -> [lo g | lo g+1 | hi g | hi g+1] */
                int8_t t[16];
                memcpy(t, q + 64 * u + 16, 16);
                memcpy(q + 64 * u + 16, q + 64 * u + 32, 16);
                memcpy(q + 64 * u + 32, t, 16);
            }
            for (int l = 0; l < A8_LANES; l++) {
                const int8_t *p = q + A8_UNIT * u + 4 * l;
                X->ox[b * nl + A8_LANES * u + l] = off * (p[0] + p[1] + p[2] + p[3]);
            }
        }
    }
}

static void a8_free(a8_x *X) {
    free(X->q);
    free(X->d);
    free(X->ox);
    free(X->xc);
    free(X->xs);
    free(X->xs16);
    free(X->xc16);
}

/* group g's contribution for one row of x, in plain integers (the scalar path, and the vector paths' last
 * group when the 32-value blocks are odd in number): d (s sum q x + mn sum x), q with its offset taken off */
static inline float a8_group_scalar(int enc, const uint8_t *row, long g, const int8_t *xq, float xd, const float *s,
                                    const float *mn) {
    int8_t q[32];
    q_group_ints(enc, row, g, q);
    if (q_s16(enc)) {
        int i0 = 0, i1 = 0, x0 = 0, x1 = 0;
        for (int i = 0; i < 16; i++) {
            i0 += q[i] * xq[i];
            x0 += xq[i];
        }
        for (int i = 16; i < 32; i++) {
            i1 += q[i] * xq[i];
            x1 += xq[i];
        }
        float r = s[2 * g] * (float)i0 + s[2 * g + 1] * (float)i1;
        if (enc == Q2_K) r += mn[2 * g] * (float)x0 + mn[2 * g + 1] * (float)x1;
        return xd * r;
    }
    int is = 0, xs = 0;
    for (int i = 0; i < 32; i++) {
        is += q[i] * xq[i];
        xs += xq[i];
    }
    float r = s[g] * (float)is;
    if (a8_has_min(enc)) r += mn[g] * (float)xs;
    return xd * r;
}

#if A8_UNIT == 64
/* unit u of a row (64 values) as unsigned bytes in the order of the quantised x (q8_0: its signed bytes) */
static inline __attribute__((always_inline)) __m512i a8_w512(int enc, const uint8_t *row, long u) {
    const __m512i m4 = _mm512_set1_epi8(15);
    if (enc == Q8_0) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(row + 68 * u + 2));
        __m256i b = _mm256_loadu_si256((const __m256i *)(row + 68 * u + 36));
        return _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    } else if (q_iq4(enc)) { /* groups 2u, 2u + 1: each group's low then high nibbles' levels (signed bytes) */
        const __m512i kv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_KV));
        __m128i a = _mm_loadu_si128((const __m128i *)(row + iq4_qs(enc, 2 * u)));
        __m128i b = _mm_loadu_si128((const __m128i *)(row + iq4_qs(enc, 2 * u + 1)));
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_srli_epi16(a, 4), 1)),
                                       _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1), 1);
        return _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
    } else if (enc == Q4_0 || enc == Q4_1 || enc == Q5_0 || enc == Q5_1) {
        long T = Q_TSIZE[enc], o = enc == Q4_0 ? 2 : enc == Q4_1 ? 4 : q5_qs(enc);
        const uint8_t *p = row + 2 * u * T;
        __m256i a = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(p + o))),
                                            _mm_loadu_si128((const __m128i *)(p + T + o)), 1);
        __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1), m4);
        if (enc == Q5_0 || enc == Q5_1) {
            uint32_t h0, h1;
            memcpy(&h0, p + q5_qh(enc), 4);
            memcpy(&h1, p + T + q5_qh(enc), 4);
            uint64_t m = (uint64_t)(h0 & 0xffffu) | (uint64_t)(h1 & 0xffffu) << 16 | (uint64_t)(h0 >> 16) << 32 |
                         (uint64_t)(h1 >> 16) << 48;
            w = _mm512_or_si512(w, _mm512_maskz_mov_epi8((__mmask64)m, _mm512_set1_epi8(16)));
        }
        return w;
    } else if (enc == Q4_K) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(row + 144 * (u >> 2) + 16 + 32 * (u & 3)));
        return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1), m4);
    } else if (enc == Q5_K) { /* as q4_k; bits j0, j0 + 1 of qh's 32 bytes the two sub-blocks' fifth bits */
        const uint8_t *bl = row + 176 * (u >> 2);
        const int j0 = 2 * (int)(u & 3);
        __m256i a = _mm256_loadu_si256((const __m256i *)(bl + 48 + 32 * (u & 3)));
        __m256i hq = _mm256_loadu_si256((const __m256i *)(bl + 16));
        __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_srli_epi16(a, 4), 1), m4);
        __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hq, j0)), _mm256_srli_epi16(hq, j0 + 1), 1);
        return _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(hv, _mm512_set1_epi8(1)), 4));
    } else if (q_tern(enc)) { /* groups 2u, 2u + 1: their codes (the offset -1 as a8_off's) */
        return _mm512_inserti64x4(_mm512_castsi256_si512(tq_codes(enc, row, 2 * u)), tq_codes(enc, row, 2 * u + 1), 1);
    } else if (enc == Q2_K || enc == Q3_K) { /* groups 2v, 2v + 1 of a super-block (v = u & 3): bits 4 (v & 1) and
                                              * 4 (v & 1) + 2 of qs[32 (v >> 1) ..]; q3_k with bits 2v, 2v + 1 of
                                              * hmask as bit 2 (the offset -4 as a8_off's) */
        long v = u & 3;
        const uint8_t *bl = row + Q_TSIZE[enc] * (u >> 2);
        __m256i q = _mm256_loadu_si256((const __m256i *)(bl + (enc == Q2_K ? 16 : 32) + 32 * (v >> 1)));
        const int k0 = 4 * (int)(v & 1);
        __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(q, k0)), _mm256_srli_epi16(q, k0 + 2), 1),
                                     _mm512_set1_epi8(3));
        if (enc == Q3_K) {
            __m256i hm = _mm256_loadu_si256((const __m256i *)bl);
            __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hm, 2 * (int)v)), _mm256_srli_epi16(hm, 2 * (int)v + 1), 1);
            w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(hv, _mm512_set1_epi8(1)), 2));
        }
        return w;
    } else { /* q6_k: groups 2j, 2j + 1 of a super-block (j = u & 3): ql's 64 bytes, qh's 32 twice */
        long j = u & 3, h = j >> 1, k = 2 * (j & 1);
        const uint8_t *bl = row + 210 * (u >> 2);
        __m512i l = _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512((const void *)(bl + 64 * h)), 2 * (int)k), m4);
        __m256i hh = _mm256_loadu_si256((const __m256i *)(bl + 128 + 32 * h));
        __m512i hv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_srli_epi16(hh, 2 * (int)k)),
                                        _mm256_srli_epi16(hh, 2 * (int)k + 2), 1);
        return _mm512_or_si512(l, _mm512_slli_epi16(_mm512_and_si512(hv, _mm512_set1_epi8(3)), 4));
    }
}

static inline __attribute__((always_inline)) void a8_tile(int enc, const uint8_t *W, long rb, int R, const a8_x *X,
                                                           long b0, int NB, long cols, const float *s, long ns,
                                                           float out[4][A8_QG]) {
    __m512 acc[4][A8_QG];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm512_setzero_ps();
    const int off = a8_off(enc);
    /* lane -> the scale it takes from 4 consecutive floats at the unit's first scale / x block */
    const __m512i nat = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i spl = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    const __m512i six = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i xidx = a8_split(enc) ? spl : nat, sidx = q_s16(enc) ? six : xidx;
    for (long u = 0; u < X->nu; u++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *row = W + r * rb;
            if (R == 4) _mm_prefetch((const char *)(row + Q_PF_ROWS * rb + u * Q_TSIZE[enc] * 64 / Q_BLOCK[enc]), _MM_HINT_T0);
            __m512i w = a8_w512(enc, row, u);
            __mmask64 neg = 0;
            if (a8_s8(enc)) {
                neg = _mm512_movepi8_mask(w);
                w = _mm512_abs_epi8(w);
            }
            __m512 sr = _mm512_permutexvar_ps(sidx, _mm512_castps128_ps512(_mm_loadu_ps(s + r * ns + (q_s16(enc) ? 4 : 2) * u)));
#pragma GCC unroll 4
            for (int b = 0; b < NB; b++) {
                __m512i xv = _mm512_loadu_si512((const void *)(X->q + (b0 + b) * cols + 64 * u));
                if (a8_s8(enc)) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                __m512i p0 = off ? _mm512_loadu_si512((const void *)(X->ox + (b0 + b) * X->nl + 16 * u)) : _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
                __m512i p = _mm512_dpbusd_epi32(p0, w, xv);
#else
                __m512i p = _mm512_add_epi32(p0, _mm512_madd_epi16(_mm512_maddubs_epi16(w, xv), _mm512_set1_epi16(1)));
#endif
                __m512 xs = _mm512_permutexvar_ps(xidx, _mm512_castps128_ps512(_mm_loadu_ps(X->d + (b0 + b) * X->ng + 2 * u)));
                acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(sr, xs), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) out[r][b] = _mm512_reduce_add_ps(acc[r][b]);
}

/* sum_k a[k] b[k] in fp32 */
static inline float a8_dot(const float *a, const float *b, long n) {
    __m512 acc = _mm512_setzero_ps();
    long k = 0;
    for (; k + 16 <= n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + k), _mm512_loadu_ps(b + k), acc);
    if (k < n) {
        __mmask16 m = (__mmask16)((1u << (n - k)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif A8_UNIT == 32 && defined(__AVX2__) && defined(__FMA__)
/* group g of a row as unsigned bytes in natural order (q8_0: its signed bytes) */
static inline __attribute__((always_inline)) __m256i a8_w256(int enc, const uint8_t *row, long g) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (enc == Q8_0) return _mm256_loadu_si256((const __m256i *)(row + 34 * g + 2));
    if (q_iq4(enc)) { /* the nibbles' levels (signed bytes), natural order */
        __m128i a = _mm_loadu_si128((const __m128i *)(row + iq4_qs(enc, g)));
        __m256i v = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_srli_epi16(a, 4), 1), m4);
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_KV)), v);
    }
    if (enc == Q4_0 || enc == Q4_1 || enc == Q5_0 || enc == Q5_1) {
        long T = Q_TSIZE[enc], o = enc == Q4_0 ? 2 : enc == Q4_1 ? 4 : q5_qs(enc);
        const uint8_t *p = row + g * T;
        __m128i a = _mm_loadu_si128((const __m128i *)(p + o));
        __m256i w = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(a), _mm_srli_epi16(a, 4), 1), m4);
        if (enc == Q5_0 || enc == Q5_1) { /* bit i of qh -> byte i: 16 or 0 */
            uint32_t qh;
            memcpy(&qh, p + q5_qh(enc), 4);
            __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                            _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                              0x0101010101010101LL, 0));
            const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
            v = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bits), bits), _mm256_set1_epi8(16));
            w = _mm256_or_si256(w, v);
        }
        return w;
    }
    if (enc == Q4_K) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(row + 144 * (g >> 3) + 16 + 32 * ((g & 7) >> 1)));
        return _mm256_and_si256(_mm256_srl_epi16(a, _mm_cvtsi32_si128(4 * (int)(g & 1))), m4);
    }
    if (enc == Q5_K) { /* as q4_k, bit g & 7 of qh[..] the fifth bit */
        const uint8_t *bl = row + 176 * (g >> 3);
        __m256i a = _mm256_loadu_si256((const __m256i *)(bl + 48 + 32 * ((g & 7) >> 1)));
        __m256i hq = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(bl + 16)), _mm_cvtsi32_si128((int)(g & 7)));
        return _mm256_or_si256(_mm256_and_si256(_mm256_srl_epi16(a, _mm_cvtsi32_si128(4 * (int)(g & 1))), m4),
                               _mm256_slli_epi16(_mm256_and_si256(hq, _mm256_set1_epi8(1)), 4));
    }
    if (q_tern(enc)) return tq_codes(enc, row, g); /* (the offset -1 as a8_off's) */
    if (enc == Q2_K || enc == Q3_K) { /* 2 bits of qs; q3_k with its hmask bit as bit 2 */
        long j = g & 7;
        const uint8_t *bl = row + Q_TSIZE[enc] * (g >> 3);
        __m256i q = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(bl + (enc == Q2_K ? 16 : 32) + 32 * (j >> 2))),
                                                      _mm_cvtsi32_si128(2 * (int)(j & 3))), _mm256_set1_epi8(3));
        if (enc == Q3_K)
            q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)bl),
                                                                                          _mm_cvtsi32_si128((int)j)), _mm256_set1_epi8(1)), 2));
        return q;
    }
    long j = g & 7, h = j >> 2, k = j & 3;
    const uint8_t *bl = row + 210 * (g >> 3);
    __m256i l = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(bl + 64 * h + 32 * (k & 1))),
                                                  _mm_cvtsi32_si128(4 * (int)(k >> 1))), m4);
    __m256i hh = _mm256_and_si256(_mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)(bl + 128 + 32 * h)),
                                                   _mm_cvtsi32_si128(2 * (int)k)), _mm256_set1_epi8(3));
    return _mm256_or_si256(l, _mm256_slli_epi16(hh, 4));
}

static inline __attribute__((always_inline)) void a8_tile(int enc, const uint8_t *W, long rb, int R, const a8_x *X,
                                                           long b0, int NB, long cols, const float *s, long ns,
                                                           float out[4][A8_QG]) {
    __m256 acc[4][A8_QG];
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) acc[r][b] = _mm256_setzero_ps();
    const int off = a8_off(enc);
    const __m256i ones = _mm256_set1_epi16(1);
    for (long u = 0; u < X->nu; u++) {
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *row = W + r * rb;
            if (R == 4) _mm_prefetch((const char *)(row + Q_PF_ROWS * rb + u * Q_TSIZE[enc] * 32 / Q_BLOCK[enc]), _MM_HINT_T0);
            __m256i w = a8_w256(enc, row, u), wsign = w;
            if (a8_s8(enc)) w = _mm256_abs_epi8(w);
            __m256 sr = q_s16(enc) ? _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s[r * ns + 2 * u])),
                                                           _mm_set1_ps(s[r * ns + 2 * u + 1]), 1)
                                    : _mm256_set1_ps(s[r * ns + u]);
#pragma GCC unroll 2
            for (int b = 0; b < NB; b++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(X->q + (b0 + b) * cols + 32 * u));
                if (a8_s8(enc)) xv = _mm256_sign_epi8(xv, wsign);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
                if (off) p = _mm256_add_epi32(p, _mm256_loadu_si256((const __m256i *)(X->ox + (b0 + b) * X->nl + 8 * u)));
                __m256 xs = _mm256_set1_ps(X->d[(b0 + b) * X->ng + u]);
                acc[r][b] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(sr, xs), acc[r][b]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int b = 0; b < NB; b++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[r][b]), _mm256_extractf128_ps(acc[r][b], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[r][b] = _mm_cvtss_f32(v);
        }
}

static inline float a8_dot(const float *a, const float *b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float t[8];
    _mm256_storeu_ps(t, acc);
    float s = ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}
#define A8_VECTOR 1
#else
#define A8_SCALAR 1
#endif
#if A8_UNIT == 64
#define A8_VECTOR 1
#endif

/* one tile of R <= 4 rows from r0 against all B rows of x; s, mn: scratch for the tile's scales */
static inline __attribute__((always_inline)) void a8_rows_tile(int enc, const uint8_t *W, const a8_x *X, float *y,
                                                                long rows, long cols, long B, long r0, float *s,
                                                                float *mn) {
    long rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], ng = cols / 32, ns = q_ns(enc, cols), nm = q_nm(enc, cols);
    long R = rows - r0 < 4 ? rows - r0 : 4;
    const uint8_t *Wt = W + r0 * rb;
    for (long r = 0; r < R; r++) q_row_scales(enc, Wt + r * rb, cols / Q_BLOCK[enc], s + r * ns, mn + r * nm);
#if defined(A8_VECTOR)
    long gv = X->nu * A8_UNIT / 32; /* blocks of 32 the vector loop covers */
    for (long b0 = 0; b0 < B; b0 += A8_QG) {
        int nb = (int)(B - b0 < A8_QG ? B - b0 : A8_QG);
        float out[4][A8_QG];
        if (R == 4) {
            if (nb == 1) a8_tile(enc, Wt, rb, 4, X, b0, 1, cols, s, ns, out);
#if A8_QG == 4
            else if (nb == 2) a8_tile(enc, Wt, rb, 4, X, b0, 2, cols, s, ns, out);
            else if (nb == 3) a8_tile(enc, Wt, rb, 4, X, b0, 3, cols, s, ns, out);
#endif
            else a8_tile(enc, Wt, rb, 4, X, b0, A8_QG, cols, s, ns, out);
        } else {
            for (long r = 0; r < R; r++)
                for (int b = 0; b < nb; b++) {
                    float o1[4][A8_QG];
                    a8_tile(enc, Wt + r * rb, rb, 1, X, b0 + b, 1, cols, s + r * ns, ns, o1);
                    out[r][b] = o1[0][0];
                }
        }
        for (long r = 0; r < R; r++)
            for (int b = 0; b < nb; b++) {
                long bb = b0 + b;
                float v = out[r][b];
                if (enc == Q2_K) v += a8_dot(mn + r * nm, X->xc16 + bb * 2 * ng, 2 * gv);
                else if (a8_has_min(enc)) v += a8_dot(mn + r * nm, X->xc + bb * ng, gv);
                for (long g = gv; g < ng; g++) /* the last block of an odd count */
                    v += a8_group_scalar(enc, Wt + r * rb, g, X->q + bb * cols + 32 * g, X->d[bb * ng + g], s + r * ns, mn + r * nm);
                y[bb * rows + r0 + r] = v;
            }
    }
#else
        for (long r = 0; r < R; r++)
        for (long b = 0; b < B; b++) {
            float v = 0.0f;
            for (long g = 0; g < ng; g++)
                v += a8_group_scalar(enc, Wt + r * rb, g, X->q + b * cols + 32 * g, X->d[b * ng + g], s + r * ns, mn + r * nm);
            y[b * rows + r0 + r] = v;
        }
#endif
}

/* y [B, rows] fp32 = x [B, cols] (bf16 when bf, else fp32), quantised per 32-value block to int8 (above), times
 * W [rows, cols] of encoding enc: as vxc_qgemv, with int8 activations. cols a multiple of the block. */
void vxc_qgemv_a8(int enc, const void *W, const void *x, float *y, long rows, long cols, long B, int bf) {
    if (enc < 0 || enc >= Q_COUNT || rows <= 0 || B <= 0) return;
    long ns = q_ns(enc, cols), nm = q_nm(enc, cols);
    float *xf = bf ? (float *)malloc((size_t)(B * cols) * sizeof(float)) : NULL;
    if (bf) load_row(x, 0, B * cols, 1, xf);
#if defined(IQ_A8)
    if (q_grid(enc) && iq_ready) { /* the integer path */
        iq_gemv_a8(enc, (const uint8_t *)W, bf ? xf : (const float *)x, y, rows, cols, B);
        free(xf);
        return;
    }
#endif
    if (q_grid(enc)) { /* x as its int8 blocks' values d q (fp32), then the fp32 product */
        float *xd = (float *)malloc((size_t)(B * cols) * sizeof(float)), *d = (float *)malloc((size_t)(cols / 32 + 1) * sizeof(float));
        int8_t *q = (int8_t *)malloc((size_t)cols + 64);
        for (long b = 0; b < B; b++) {
            a8_quantize_row((bf ? xf : (const float *)x) + b * cols, cols, q, d);
            for (long i = 0; i < cols; i++) xd[b * cols + i] = (float)q[i] * d[i / 32];
        }
        iq_gemv(enc, (const uint8_t *)W, xd, y, rows, cols, B);
        free(q);
        free(d);
        free(xd);
        free(xf);
        return;
    }
    a8_x X;
    a8_prepare(enc, bf ? xf : (const float *)x, cols, B, &X, 0);
    free(xf);
#pragma omp parallel
    {
        float *s = (float *)malloc((size_t)(4 * (ns + nm) + 4) * sizeof(float)), *mn = s + 4 * ns;
        const uint8_t *Wb = (const uint8_t *)W;
#pragma omp for schedule(static)
        for (long r0 = 0; r0 < rows; r0 += 4) {
            switch (enc) {
            case Q8_0: a8_rows_tile(Q8_0, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q4_0: a8_rows_tile(Q4_0, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q4_1: a8_rows_tile(Q4_1, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q4_K: a8_rows_tile(Q4_K, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q5_0: a8_rows_tile(Q5_0, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q5_K: a8_rows_tile(Q5_K, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q5_1: a8_rows_tile(Q5_1, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q2_K: a8_rows_tile(Q2_K, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case Q3_K: a8_rows_tile(Q3_K, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case IQ4_NL: a8_rows_tile(IQ4_NL, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case IQ4_XS: a8_rows_tile(IQ4_XS, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case TQ1_0: a8_rows_tile(TQ1_0, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            case TQ2_0: a8_rows_tile(TQ2_0, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            default: a8_rows_tile(Q6_K, Wb, &X, y, rows, cols, B, r0, s, mn); break;
            }
        }
        free(s);
    }
    a8_free(&X);
}

/* x [B, cols] fp32 quantised as vxc_qgemv_a8 quantises it: q [B, cols] int8, d [B, cols / 32] (for tests) */
void vxc_quantize_a8(const float *x, int8_t *q, float *d, long B, long cols) {
    for (long b = 0; b < B; b++) a8_quantize_row(x + b * cols, cols, q + b * cols, d + b * (cols / 32));
}

/* ---------------------------------------------------------------------------------------------------------
 * int8_block32 activations on repacked weights (AVX-512): vxc_qpack, vxc_qgemv_a8p.
 *
 * vxc_qpack copies a q8_0 / q4_0 / q4_1 / q4_k / q5_k / q5_0 / q6_k matrix into tiles of 16 rows (zero rows pad the last tile) in
 * which, per 32-value group, the 16 rows' fields sit side by side: their f16 scales (and mins) as one vector,
 * then the values as chunks of 16 rows x 4 bytes — so one 64-byte load holds 4 consecutive values (4 bytes,
 * or 8 values as two nibbles) of every row, one vpdpbusd against those 4 x bytes broadcast sums them into 16
 * per-row lanes, and a group's scales apply to all 16 rows at once: no per-row horizontal sums, one scale
 * multiply per 16 rows x 32 values. Tile layouts, per group (per 256-value super-block for q4_k):
 *   q4_0: d[16] f16 | qs chunks c = 0..3: row r's bytes 4c..4c+3 (low nibbles: values 4c.., high: 16 + 4c..)
 *   q4_1: d[16] f16 | m[16] f16 | qs as q4_0
 *   q8_0: d[16] f16 | q chunks c = 0..7: row r's values 4c..4c+3 as unsigned bytes q + 128
 *   q4_k: d[16] f16 | dmin[16] f16 | k[12][16] u8 (byte k of each row's 12 bytes of 6-bit scales and mins, as
 *         stored; the kernel unpacks them for 16 rows at once) | qs pairs p = 0..3, chunks c = 0..7: row r's
 *         bytes 32p + 4c.. (low nibbles: group 2p values 4c.., high: group 2p + 1): 2304 bytes per 16 x 256
 *         values, as stored (unpacked scales and mins, 2368 bytes, had made the copies 2.8 % larger than the file)
 *   q5_k: q4_k's d, dmin and k planes | for chunks c = 0..7: pair 0's qs chunk c, then qh chunk c (row r's qh
 *         bytes 4c..: bit j the fifth bit of value 4c + k of sub-block j) | pairs 1..3's qs as q4_k's: 2816 bytes
 *         per 16 x 256 values, as stored, read front to back (qh after the qs, 512 bytes skipped until the
 *         first pair read them, streamed at 14 GB/s where q4_k streams 21-25: Zen 4, 2 threads, 64 matrices of
 *         3072 x 1024, one row of x)
 *   q5_1: d[16] f16 | m[16] f16 | hb and qs as q5_0's: 384 bytes per 16 x 32 values, as stored
 *   q5_0: d[16] f16 | hb[16][4] u8 | qs as q4_0; hb byte k of row r holds the fifth bits of values 4c + k (bit 2c)
 *         and 16 + 4c + k (bit 2c + 1) for the four chunks c: the same 22 bytes per 32 values as stored
 *   q6_k: d[16] f16 | sc[16][16] i8 | per half h = 0, 1 and chunk c = 0..7, three 64-byte lines side by side: row
 *         r's ql bytes 64h + 4c.., its ql bytes 64h + 32 + 4c.., its qh bytes 32h + 4c.. (each byte pair gives
 *         values 128h + 32t + 4c + k, t = 0..3, as ggml assembles them): 3360 bytes per 16 x 256 values, as
 *         stored, read front to back. (The three regions of a half had stood apart, 512 bytes each: the stream
 *         jumped between them and a one-row product read 24.8 GB/s where q4_0 reads 32 — Zen 4, 2 threads, the
 *         151936 x 1024 head, interleaved in one process: 5.14 -> 3.96 ms with the lines side by side.)
 *   q2_k: d[16] f16 | dmin[16] f16 | sc[16][16] u8 (byte j of each row's scale / min bytes) | for chunks c = 0..7, two
 *         64-byte lines side by side: row r's qs bytes 4c.. of half 0 (qs[4c..]), then of half 1 (qs[32 + 4c..]);
 *         bits 2t..2t+1 of a half-h byte give value 4c + k of group 4h + t: 1344 bytes per 16 x 256, as stored
 *   q3_k: d[16] f16 | k[12][16] u8 (byte k of each row's 12 bytes of 6-bit scales, as stored) | for chunks c = 0..7,
 *         three lines side by side: row r's hmask bytes 4c.. (bit 4h + t the high bit of value 4c + k of group
 *         4h + t), then its qs bytes 4c.. of half 0, of half 1: 1760 bytes per 16 x 256 values, as stored
 *   iq4_nl: as q4_0 (the kernel looks each nibble's level up, biased by 128 as q8_0's bytes)
 *   iq4_xs: d[16] f16 | scales_h[16] u16 | scales_l planes k = 0..3 [16] u8 | groups j = 0..7, chunks c = 0..3: row
 *         r's qs bytes 16j + 4c..: 2176 bytes per 16 x 256 values, as stored
 *   tq2_0: d[16] f16 | halves h = 0, 1, chunks c = 0..7: row r's qs bytes 32h + 4c.. (bits 2t: value 128h + 32t + 4c
 *         + k): 1056 bytes per 16 x 256 values, as stored
 *   tq1_0: d[16] f16 | chunks c = 0..11: row r's qs bytes 4c.. | row r's 4 qh bytes: 864 bytes per 16 x 256 values,
 *         as stored (the kernel takes each byte's base-3 digits in turn: v, 3v, 9v .. mod 256, digit = [v >= 86] +
 *         [v >= 171], as ((v 3) >> 8) — byte adds, saturating subtractions and minima, none of vpdpbusd's pipes)
 * The integers and scales are the stored ones, unchanged: the products are vxc_qgemv_a8's (same sums, in
 * another order). Builds without AVX-512 (and q8_0 without VNNI) keep the row layout (vxc_qgemv_a8). */

/* the offset of pair p's qs chunk c in a packed q4_k / q5_k super-block (q5_k: pair 0's chunks each followed by
 * the chunk's qh line) */
static inline long p5k_qs(int enc, int p, int c) {
    if (enc == Q5_K) return p == 0 ? 256 + 128 * c : 768 + 512 * p + 64 * c;
    return 256 + 512 * p + 64 * c;
}

static inline long p_group_bytes(int enc) {
    return enc == Q4_0 ? 288 : enc == Q4_1 ? 320 : enc == Q8_0 ? 544 : enc == Q4_K ? 2304 : enc == Q5_0 ? 352
         : enc == Q6_K ? 3360 : enc == Q5_K ? 2816 : enc == Q5_1 ? 384 : enc == Q2_K ? 1344 : enc == Q3_K ? 1760
         : enc == IQ4_NL ? 288 : enc == IQ4_XS ? 2176 : enc == TQ2_0 ? 1056 : enc == TQ1_0 ? 864 : 0;
}

/* bytes of one tile of 16 rows (0: this encoding / build has no packed form) */
long vxc_qpack_tile_bytes(int enc, long cols) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    long gb = p_group_bytes(enc);
#if !defined(__AVX512VNNI__)
    if (enc == Q8_0 || q_iq4(enc)) return 0; /* maddubs would saturate on their biased bytes (up to 255 x 127 x 2) */
#endif
    return gb ? gb * (cols / (Q_BLOCK[enc] == 256 ? 256 : 32)) : 0;
#else
    (void)enc;
    (void)cols;
    return 0;
#endif
}

void vxc_qpack(int enc, const void *W, uint8_t *out, long rows, long cols) {
    long TB = vxc_qpack_tile_bytes(enc, cols);
    if (TB <= 0) return;
    long nt = (rows + 15) / 16, rb = cols / Q_BLOCK[enc] * Q_TSIZE[enc], nb = cols / Q_BLOCK[enc], GB = p_group_bytes(enc);
    memset(out, 0, (size_t)(nt * TB));
    const uint8_t *Wb = (const uint8_t *)W;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < nt; t++) {
        for (long r = 0; r < 16 && 16 * t + r < rows; r++) {
            const uint8_t *row = Wb + (16 * t + r) * rb;
            for (long g = 0; g < nb; g++) {
                const uint8_t *b = row + g * Q_TSIZE[enc];
                uint8_t *o = out + t * TB + g * GB;
                if (enc == Q2_K) {
                    memcpy(o + 2 * r, b + 80, 2);
                    memcpy(o + 32 + 2 * r, b + 82, 2);
                    for (int j = 0; j < 16; j++) o[64 + 16 * j + r] = b[j];
                    for (int c = 0; c < 8; c++)
                        for (int h = 0; h < 2; h++)
                            for (int k = 0; k < 4; k++) o[320 + 128 * c + 64 * h + 4 * r + k] = b[16 + 32 * h + 4 * c + k];
                } else if (enc == Q3_K) {
                    memcpy(o + 2 * r, b + 108, 2);
                    for (int k = 0; k < 12; k++) o[32 + 16 * k + r] = b[96 + k];
                    for (int c = 0; c < 8; c++)
                        for (int k = 0; k < 4; k++) {
                            uint8_t *oc = o + 224 + 192 * c + 4 * r + k;
                            oc[0] = b[4 * c + k];
                            oc[64] = b[32 + 4 * c + k];
                            oc[128] = b[64 + 4 * c + k];
                        }
                } else if (enc == Q6_K) {
                    memcpy(o + 2 * r, b + 208, 2);
                    for (int j = 0; j < 16; j++) o[32 + 16 * j + r] = b[192 + j];
                    for (int h = 0; h < 2; h++)
                        for (int c = 0; c < 8; c++)
                            for (int k = 0; k < 4; k++) {
                                uint8_t *oh = o + 288 + 1536 * h + 192 * c + 4 * r + k;
                                oh[0] = b[64 * h + 4 * c + k];
                                oh[64] = b[64 * h + 32 + 4 * c + k];
                                oh[128] = b[128 + 32 * h + 4 * c + k];
                            }
                } else if (enc == Q5_0 || enc == Q5_1) {
                    const long hbo = enc == Q5_1 ? 64 : 32; /* q5_1: its m[16] before the fifth bits */
                    memcpy(o + 2 * r, b, 2);
                    if (enc == Q5_1) memcpy(o + 32 + 2 * r, b + 2, 2);
                    uint32_t qh;
                    memcpy(&qh, b + q5_qh(enc), 4);
                    for (int k = 0; k < 4; k++) {
                        uint8_t hb = 0;
                        for (int c = 0; c < 4; c++)
                            hb |= (uint8_t)((((qh >> (4 * c + k)) & 1u) << (2 * c)) | (((qh >> (16 + 4 * c + k)) & 1u) << (2 * c + 1)));
                        o[hbo + 4 * r + k] = hb;
                    }
                    for (int c = 0; c < 4; c++)
                        for (int k = 0; k < 4; k++) o[hbo + 64 + 64 * c + 4 * r + k] = b[q5_qs(enc) + 4 * c + k];
                } else if (enc == TQ2_0) {
                    memcpy(o + 2 * r, b + 64, 2);
                    for (int h = 0; h < 2; h++)
                        for (int c = 0; c < 8; c++)
                            for (int k = 0; k < 4; k++) o[32 + 512 * h + 64 * c + 4 * r + k] = b[32 * h + 4 * c + k];
                } else if (enc == TQ1_0) {
                    memcpy(o + 2 * r, b + 52, 2);
                    for (int c = 0; c < 13; c++) /* (chunk 12: the qh bytes) */
                        for (int k = 0; k < 4; k++) o[32 + 64 * c + 4 * r + k] = b[4 * c + k];
                } else if (enc == IQ4_XS) {
                    memcpy(o + 2 * r, b, 2);
                    memcpy(o + 32 + 2 * r, b + 2, 2);
                    for (int k = 0; k < 4; k++) o[64 + 16 * k + r] = b[4 + k];
                    for (int j = 0; j < 8; j++)
                        for (int c = 0; c < 4; c++)
                            for (int k = 0; k < 4; k++) o[128 + 256 * j + 64 * c + 4 * r + k] = b[8 + 16 * j + 4 * c + k];
                } else if (enc == Q4_0 || enc == Q4_1 || enc == Q8_0 || enc == IQ4_NL) {
                    memcpy(o + 2 * r, b, 2);
                    if (enc == Q4_1) memcpy(o + 32 + 2 * r, b + 2, 2);
                    const uint8_t *q = b + (enc == Q4_1 ? 4 : 2);
                    uint8_t *qo = o + (enc == Q4_1 ? 64 : 32);
                    int nc = enc == Q8_0 ? 8 : 4;
                    for (int c = 0; c < nc; c++)
                        for (int k = 0; k < 4; k++) qo[64 * c + 4 * r + k] = enc == Q8_0 ? (uint8_t)(q[4 * c + k] ^ 0x80) : q[4 * c + k];
                } else { /* q4_k / q5_k super-block */
                    memcpy(o + 2 * r, b, 2);
                    memcpy(o + 32 + 2 * r, b + 2, 2);
                    for (int k = 0; k < 12; k++) o[64 + 16 * k + r] = b[4 + k];
                    const uint8_t *q = b + (enc == Q5_K ? 48 : 16);
                    for (int p = 0; p < 4; p++)
                        for (int c = 0; c < 8; c++)
                            for (int k = 0; k < 4; k++) o[p5k_qs(enc, p, c) + 4 * r + k] = q[32 * p + 4 * c + k];
                    if (enc == Q5_K)
                        for (int c = 0; c < 8; c++)
                            for (int k = 0; k < 4; k++) o[320 + 128 * c + 4 * r + k] = b[16 + 4 * c + k];
                }
            }
        }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#if defined(__AVX512VNNI__)
#define P_DOT(acc, u, s) _mm512_dpbusd_epi32((acc), (u), (s))
#else
#define P_DOT(acc, u, s) _mm512_add_epi32((acc), _mm512_madd_epi16(_mm512_maddubs_epi16((u), (s)), _mm512_set1_epi16(1)))
#endif
#define P_X4(p) _mm512_set1_epi32(*(const int32_t *)(const void *)(p)) /* 4 x bytes in every lane */

/* tq1_0's base-3 digits, 64 bytes at a time: digit 0 of byte v is ((v 3) >> 8) = [v >= 86] + [v >= 171] (saturating
 * subtractions and minima); the next digit is that of 3 v mod 256 (byte adds). None of them on vpdpbusd's pipes. */
static inline __attribute__((always_inline)) __m512i tq_digit512(__m512i v) {
    const __m512i one = _mm512_set1_epi8(1);
    return _mm512_add_epi8(_mm512_min_epu8(_mm512_subs_epu8(v, _mm512_set1_epi8(85)), one),
                           _mm512_min_epu8(_mm512_subs_epu8(v, _mm512_set1_epi8((char)170)), one));
}
static inline __attribute__((always_inline)) __m512i tq_times3_512(__m512i v) { return _mm512_add_epi8(v, _mm512_add_epi8(v, v)); }

/* iq4: the 16 levels + 128 (unsigned bytes), in each 128-bit lane (vpshufb's table) */
static inline __m512i iq4_levels_u8(void) {
    return _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_KV)), _mm512_set1_epi8((char)0x80));
}

/* q4_k in p_tile: the 6-bit scale and min of sub-block j (0..7) of 16 rows, unpacked from the tile's 12 byte
 * planes k (plane k: byte k of each row's scale field) as ggml's get_scale_min_k4 unpacks one row's */
static inline __attribute__((always_inline)) void q4k_tile_scale_min(const uint8_t *k, int j, __m128i *sc, __m128i *m) {
    const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(0x30);
#define Q4K_PLANE(i) _mm_loadu_si128((const __m128i *)(k + 16 * (i)))
    if (j < 4) {
        *sc = _mm_and_si128(Q4K_PLANE(j), m63);
        *m = _mm_and_si128(Q4K_PLANE(j + 4), m63);
    } else { /* low 4 bits from byte j + 4, high 2 from the top bits of byte j - 4 (scale) / j (min) */
        __m128i b = Q4K_PLANE(j + 4);
        *sc = _mm_or_si128(_mm_and_si128(b, m15), _mm_and_si128(_mm_srli_epi16(Q4K_PLANE(j - 4), 2), m48));
        *m = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b, 4), m15), _mm_and_si128(_mm_srli_epi16(Q4K_PLANE(j), 2), m48));
    }
#undef Q4K_PLANE
}

/* q6_k: the 6-bit values (0..63) of sub-block t of a chunk, 64 bytes: from its ql line (low nibbles for t = 0, 1,
 * high for 2, 3) and bits 2t..2t+1 of its qh line as bits 4-5, as ggml assembles them */
static inline __attribute__((always_inline)) __m512i q6_val(__m512i ql, __m512i qh, int t) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    __m512i lo = t < 2 ? _mm512_and_si512(ql, m4) : _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4);
    __m512i hb = t == 0 ? _mm512_slli_epi16(qh, 4) : t == 1 ? _mm512_slli_epi16(qh, 2) : t == 2 ? qh : _mm512_srli_epi16(qh, 2);
    return _mm512_or_si512(lo, _mm512_and_si512(hb, m30));
}

/* q6_k in p_tile: sub-block 8h + 2t + cq of NB rows of x, t a constant after inlining. Its 4 chunks' values are
 * decoded once (the low or high nibbles of ql, bits 2t..2t+1 of qh as bits 4-5) for all NB rows, each row's sum
 * starts at its -32 offset term, and the scaled sums are added to acc[b]. oh: the half's chunk 4cq (192 bytes a chunk:
 * its two ql lines, then its qh line); xh: row b0's values of chunk 4cq (row stride cols); s16, xd: row b0's offset terms / block scales at
 * (h, cq) / h; scb: the scale of sub-block 8h + cq. One sub-block at a time with t constant, rather than the four
 * sub-blocks of a chunk at once (16 sums a pass, 4 rows of x, and t a loop variable), because GCC spilled those
 * sums and copied every accumulator around each dot: the same products, bit for bit, and on Intel Xeon (2
 * threads, 197 qwen3-shaped q6_k matrices, 466 MB, interleaved A/B) B = 8 55.6 -> 44.6 ms, B = 64 349 -> 259 ms,
 * B = 1 22.4 -> 21.7 ms. */
static inline __attribute__((always_inline)) void q6_sub(const uint8_t *oh, const int8_t *xh, const int32_t *s16,
                                                          const float *xd, const uint8_t *scb, __m512 d, long cols,
                                                          long ng, int NB, int t, __m512 acc[8]) {
    __m512i p[8];
    for (int b = 0; b < NB; b++) p[b] = _mm512_set1_epi32(s16[b * (cols / 16) + 2 * t]);
    const uint8_t *ql = oh + (t & 1) * 64;
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i a = _mm512_loadu_si512((const void *)(ql + 192 * i));
        __m512i hh = _mm512_loadu_si512((const void *)(oh + 128 + 192 * i));
        __m512i v = q6_val(a, hh, t);
        for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], v, P_X4(xh + b * cols + 32 * t + 4 * i));
    }
    __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + 32 * t)))));
    for (int b = 0; b < NB; b++)
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[b * ng + t])), acc[b]);
}

/* q6_k in p_tile for one row of x: the four sub-blocks 8h + 2t + cq (t = 0..3) of a chunk quarter at once, each
 * chunk's ql / ql / qh lines read once (q6_sub reads each ql line twice and the qh line four times); its sums and
 * their order into acc are q6_sub's (t = 0..3 in turn) */
static inline __attribute__((always_inline)) void q6_sub4(const uint8_t *oh, const int8_t *xh, const int32_t *s16,
                                                           const float *xd, const uint8_t *scb, __m512 d, __m512 *acc) {
    __m512i p0 = _mm512_set1_epi32(s16[0]), p1 = _mm512_set1_epi32(s16[2]), p2 = _mm512_set1_epi32(s16[4]),
            p3 = _mm512_set1_epi32(s16[6]);
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m512i a = _mm512_loadu_si512((const void *)(oh + 192 * i));
        __m512i b = _mm512_loadu_si512((const void *)(oh + 64 + 192 * i));
        __m512i hh = _mm512_loadu_si512((const void *)(oh + 128 + 192 * i));
        __m512i v0 = q6_val(a, hh, 0), v1 = q6_val(b, hh, 1), v2 = q6_val(a, hh, 2), v3 = q6_val(b, hh, 3);
        p0 = P_DOT(p0, v0, P_X4(xh + 4 * i));
        p1 = P_DOT(p1, v1, P_X4(xh + 32 + 4 * i));
        p2 = P_DOT(p2, v2, P_X4(xh + 64 + 4 * i));
        p3 = P_DOT(p3, v3, P_X4(xh + 96 + 4 * i));
    }
    __m512i ps[4] = {p0, p1, p2, p3};
    for (int t = 0; t < 4; t++) {
        __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(scb + 32 * t)))));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ps[t]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[t])), *acc);
    }
}

/* q2_k / q3_k: sub-blocks j0, j0 + 1 of a packed super-block o, for its 16 rows: the integer scales (q3_k: the
 * 6-bit value less 32; q2_k: the low nibble) as int16 pairs (j0 low, j0 + 1 high: vpmaddwd's operand), and q2_k's
 * mins dmin m as fp32 */
static inline __attribute__((always_inline)) void k23_scales(int enc, const uint8_t *o, int j0, __m512 dmin,
                                                              __m512i *sc01, __m512 mn[2]) {
    __m512i sc[2];
    for (int e = 0; e < 2; e++) {
        const int j = j0 + e;
        if (enc == Q2_K) {
            __m128i pl = _mm_loadu_si128((const __m128i *)(o + 64 + 16 * j)), m15 = _mm_set1_epi8(15);
            sc[e] = _mm512_cvtepu8_epi32(_mm_and_si128(pl, m15));
            mn[e] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(pl, 4), m15))));
        } else { /* the 6-bit scale j of 16 rows from the 12 planes, as q3k_scale_words unpacks one row's */
#define Q3K_PLANE(i) _mm_loadu_si128((const __m128i *)(o + 32 + 16 * (i)))
            const __m128i m15 = _mm_set1_epi8(15), m3b = _mm_set1_epi8(3);
            __m128i lo = j < 8 ? _mm_and_si128(Q3K_PLANE(j), m15) : _mm_and_si128(_mm_srli_epi16(Q3K_PLANE(j - 8), 4), m15);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(Q3K_PLANE(8 + (j & 3)), 2 * (j >> 2)), m3b);
#undef Q3K_PLANE
            sc[e] = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(lo, _mm_slli_epi16(hi, 4))), _mm512_set1_epi32(32));
        }
    }
    *sc01 = _mm512_or_si512(_mm512_and_si512(sc[0], _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(sc[1], 16));
}

/* q2_k / q3_k in p_tile: groups 4h + t0 .. 4h + t0 + NT - 1 of super-block sb (each two sub-blocks of 16: j = 8h +
 * 2t + e, e = 0 for chunks 0..3, 1 for 4..7) for NB rows of x from b0, scaled into acc (h, t0 and NT constants
 * after inlining). Each chunk's lines are read once for the NT groups; NT = 4 for one row of x (eight sums), 1
 * from two rows on (NB x 8 sums would spill). A group's two sums share its x block's scale: they are combined in
 * integers with the sub-blocks' integer scales (P = sc0 p0 + sc1 p1, exact) and scaled once by d xd (acc += P d
 * xd: the value k23x_tile gives, bit for bit, from its expanded weights); q3_k's sums start at its -4
 * offset term; q2_k's mins come off through the x blocks' per-16 sums. o: the tile's super-block; d, dmin: its
 * rows' f16 scales widened. The order acc is added in (group by group) does not depend on NT. */
static inline __attribute__((always_inline)) void k23_group(int enc, const uint8_t *o, long sb, int h0, int NH, int t0,
                                                             int NT, const a8_x *X, long cols, long b0, int NB,
                                                             __m512 d, __m512 dmin, __m512 acc[8]) {
    const long ng = cols / 32, n16 = cols / 16;
    const __m512i m3 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4);
    __m512i p[2][2][4][8]; /* [half][e][t][row of x] */
    for (int hh = 0; hh < NH; hh++)
        for (int e = 0; e < 2; e++)
            for (int t = 0; t < NT; t++)
                for (int b = 0; b < NB; b++)
                    p[hh][e][t][b] = enc == Q3_K ? _mm512_set1_epi32(X->xs16[(b0 + b) * n16 + 16 * sb + 8 * (h0 + hh) + 2 * (t0 + t) + e])
                                                 : _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        __m512i hm = enc == Q3_K ? _mm512_loadu_si512((const void *)(o + 224 + 192 * c)) : _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int hh = 0; hh < NH; hh++) {
            const int h = h0 + hh;
            __m512i v = _mm512_loadu_si512((const void *)(o + (enc == Q2_K ? 320 + 128 * c : 288 + 192 * c) + 64 * h));
#pragma GCC unroll 4
            for (int t = 0; t < NT; t++) {
                const int tt = t0 + t, hs = 4 * h + tt;
                __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * tt), m3);
                if (enc == Q3_K) /* bit hs of the hmask byte to bit 2 */
                    q = _mm512_or_si512(q, _mm512_and_si512(hs >= 2 ? _mm512_srli_epi16(hm, hs - 2) : _mm512_slli_epi16(hm, 2 - hs), b2));
                for (int b = 0; b < NB; b++)
                    p[hh][c >> 2][t][b] = P_DOT(p[hh][c >> 2][t][b], q, P_X4(X->q + (b0 + b) * cols + 256 * sb + 128 * h + 32 * tt + 4 * c));
            }
        }
    }
    /* lane i's 16-bit halves: p0's low half, p1's (both sums fit: |sum| <= 16 x 4 x 127) */
    const __m512i pair = _mm512_setr_epi32(0x00200000, 0x00220002, 0x00240004, 0x00260006, 0x00280008, 0x002a000a,
                                           0x002c000c, 0x002e000e, 0x00300010, 0x00320012, 0x00340014, 0x00360016,
                                           0x00380018, 0x003a001a, 0x003c001c, 0x003e001e);
    for (int hh = 0; hh < NH; hh++)
    for (int t = 0; t < NT; t++) {
        const int h = h0 + hh, tt = t0 + t, j0 = 8 * h + 2 * tt;
        __m512i sc01; /* the two sub-blocks' integer scales of 16 rows as int16 pairs */
        __m512 mn[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        k23_scales(enc, o, j0, dmin, &sc01, mn);
        __m512 dx[8];
        for (int b = 0; b < NB; b++) dx[b] = _mm512_mul_ps(d, _mm512_set1_ps(X->d[(b0 + b) * ng + 8 * sb + 4 * h + tt]));
        for (int b = 0; b < NB; b++) {
            long bb = b0 + b;
            __m512i P = _mm512_madd_epi16(_mm512_permutex2var_epi16(p[hh][0][t][b], pair, p[hh][1][t][b]), sc01);
            acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(P), dx[b], acc[b]);
            if (enc == Q2_K) {
                acc[b] = _mm512_fnmadd_ps(mn[0], _mm512_set1_ps(X->xc16[bb * n16 + 16 * sb + j0]), acc[b]);
                acc[b] = _mm512_fnmadd_ps(mn[1], _mm512_set1_ps(X->xc16[bb * n16 + 16 * sb + j0 + 1]), acc[b]);
            }
        }
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
/* q2_k / q3_k from K23X_FROM rows of x (a prefill): the tile is first expanded, once for all its passes, into bytes
 * holding each value times its sub-block's integer scale, as vpdpbusd's unsigned operand — q3_k 128 - q sc (q in
 * -4..3, sc in -32..31: 0..252; the 128 comes off through x's block sums, p_off), q2_k q sc (0..45) — so a group of
 * 32 values is one run of products scaled once, like q8_0's, with no per-row decode and no per-16 epilogue. The
 * sums are k23_group's (P = sc0 p0 + sc1 p1, exact; negated for q3_k, whose product with d xd is then taken off):
 * every value equals the one-row path's bit for bit. AVX-512 VNNI (vpdpbusd does not saturate where maddubs
 * would) and VBMI (vpermt2b: a 128-entry table of 16 rows x 8 codes) builds. */
#define K23X 1
/* from 16 rows for q3_k, 32 for q2_k, whose per-16 mins keep an epilogue per group (3072 x 1024, 2 threads, Zen 4,
 * interleaved in one process, row path / expanded: q3_k 16 rows 343 / 277 us, 64 rows 1083 / 764, 128 rows 2104 /
 * 1380; q2_k 16 rows 274 / 289, 32 rows 510 / 490, 64 rows 959 / 903, 128 rows 1906 / 1720) */
static inline int k23x_from(int enc) { return enc == Q2_K ? 32 : 16; }
static __thread uint8_t *k23x_buf;
static __thread long k23x_cap;
/* this thread's expansion buffer, at least need bytes (kept for the thread's later tiles) */
static void k23x_reserve(long need) {
    if (k23x_cap >= need) return;
    free(k23x_buf);
    k23x_buf = (uint8_t *)aligned_alloc(64, (size_t)need);
    k23x_cap = need;
}

/* rows of x from which a packed tq1_0 tile's base-3 digits are expanded once into tq2_0's packed layout (its 2-bit
 * codes, the same d) for all passes over the tile, rather than taken again in each pass of 8 rows */
#ifndef TQ1X_FROM
#define TQ1X_FROM 9
#endif
/* one packed tq1_0 super-block (864 bytes) as the packed tq2_0 one of the same values (1056 bytes): line (h, c) of
 * the latter holds group 4h + t's chunk c at bits 2t (see vxc_qpack's layouts) */
static inline __attribute__((always_inline)) void tq1_expand(const uint8_t *o, uint8_t *E) {
    memcpy(E, o, 32);
    for (int c = 0; c < 8; c++) { /* groups 0..3 (digits 0..3 of chunk c), and group 4's chunk c (digit 4) */
        __m512i v = _mm512_loadu_si512((const void *)(o + 32 + 64 * c)), l0 = _mm512_setzero_si512();
        for (int k = 0; k < 4; k++) {
            l0 = _mm512_or_si512(l0, _mm512_slli_epi16(tq_digit512(v), 2 * k));
            v = tq_times3_512(v);
        }
        _mm512_storeu_si512((void *)(E + 32 + 64 * c), l0);
        _mm512_storeu_si512((void *)(E + 544 + 64 * c), tq_digit512(v));
    }
    __m512i q = _mm512_loadu_si512((const void *)(o + 32 + 64 * 12));
    for (int c = 0; c < 4; c++) { /* groups 5..7 from chunks 8..11 (their digits 0..4) and the qh chunk */
        __m512i v = _mm512_loadu_si512((const void *)(o + 32 + 64 * (8 + c))), d[5];
        for (int k = 0; k < 5; k++) {
            d[k] = tq_digit512(v);
            v = tq_times3_512(v);
        }
        __m512i *lo = (__m512i *)(void *)(E + 544 + 64 * c), *hi = (__m512i *)(void *)(E + 544 + 64 * (c + 4));
        _mm512_storeu_si512((void *)lo, _mm512_or_si512(_mm512_loadu_si512((const void *)lo),
                            _mm512_or_si512(_mm512_slli_epi16(d[0], 2), _mm512_or_si512(_mm512_slli_epi16(d[2], 4), _mm512_slli_epi16(d[4], 6)))));
        _mm512_storeu_si512((void *)hi, _mm512_or_si512(_mm512_loadu_si512((const void *)hi),
                            _mm512_or_si512(_mm512_slli_epi16(d[1], 2), _mm512_or_si512(_mm512_slli_epi16(d[3], 4), _mm512_slli_epi16(tq_digit512(q), 6)))));
        q = tq_times3_512(q);
    }
}

/* super-block o of a packed tile (16 rows) expanded to E: group g = 0..7, chunk c = 0..7: 64 bytes, row r's bytes
 * 4r..4r+3 its values 4c..4c+3 of group g (times their scale, as above) */
static inline __attribute__((always_inline)) void k23_expand(int enc, const uint8_t *o, uint8_t *E) {
    const __m512i m3 = _mm512_set1_epi8(3), b2 = _mm512_set1_epi8(4);
    /* byte i of a line belongs to row i / 4: its table entries start at 8 (i / 4) */
    const __m512i rowc = _mm512_setr_epi32(0, 0x08080808, 0x10101010, 0x18181818, 0x20202020, 0x28282828, 0x30303030,
                                           0x38383838, 0x40404040, 0x48484848, 0x50505050, 0x58585858, 0x60606060,
                                           0x68686868, 0x70707070, 0x78787878);
    /* table byte i (of 64): row (i / 8) (+ 8 for the high table), code i % 8 */
    const __m512i bc_lo = _mm512_setr_epi32(0, 0, 0x01010101, 0x01010101, 0x02020202, 0x02020202, 0x03030303, 0x03030303,
                                            0x04040404, 0x04040404, 0x05050505, 0x05050505, 0x06060606, 0x06060606,
                                            0x07070707, 0x07070707);
    const __m512i bc_hi = _mm512_add_epi8(bc_lo, _mm512_set1_epi8(8));
    const __mmask64 k1 = 0xaaaaaaaaaaaaaaaaULL, k2 = 0xccccccccccccccccULL, k4 = 0xf0f0f0f0f0f0f0f0ULL; /* code bits */
    __m512i tl[16], th[16];
    for (int j = 0; j < 16; j += 2) {
        __m512i sc01;
        __m512 mn[2];
        k23_scales(enc, o, j, _mm512_setzero_ps(), &sc01, mn);
        for (int e = 0; e < 2; e++) {
            /* the 16 rows' scales as bytes (sc01's 16-bit halves: low for j, high for j + 1) */
            __m128i sb = _mm512_cvtepi32_epi8(e ? _mm512_srai_epi32(sc01, 16) : _mm512_srai_epi32(_mm512_slli_epi32(sc01, 16), 16));
            __m512i sv = _mm512_castsi128_si512(sb);
            for (int half = 0; half < 2; half++) {
                __m512i S = _mm512_permutexvar_epi8(half ? bc_hi : bc_lo, sv), S2 = _mm512_add_epi8(S, S), S4 = _mm512_add_epi8(S2, S2);
                __m512i prod = _mm512_maskz_mov_epi8(k1, S);
                prod = _mm512_mask_add_epi8(prod, k2, prod, S2);
                prod = _mm512_mask_add_epi8(prod, k4, prod, S4);
                /* q3_k: 128 - (code - 4) sc = (128 + 4 sc) - code sc (bytes wrap; the result is 0..252) */
                __m512i t = enc == Q3_K ? _mm512_sub_epi8(_mm512_add_epi8(_mm512_set1_epi8((char)0x80), S4), prod) : prod;
                if (half) th[j + e] = t;
                else tl[j + e] = t;
            }
        }
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        __m512i hm = enc == Q3_K ? _mm512_loadu_si512((const void *)(o + 224 + 192 * c)) : _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i v = _mm512_loadu_si512((const void *)(o + (enc == Q2_K ? 320 + 128 * c : 288 + 192 * c) + 64 * h));
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const int hs = 4 * h + t, j = 8 * h + 2 * t + (c >> 2);
                __m512i q = _mm512_and_si512(_mm512_srli_epi16(v, 2 * t), m3);
                if (enc == Q3_K)
                    q = _mm512_or_si512(q, _mm512_and_si512(hs >= 2 ? _mm512_srli_epi16(hm, hs - 2) : _mm512_slli_epi16(hm, 2 - hs), b2));
                _mm512_storeu_si512((void *)(E + 64 * (8 * hs + c)), _mm512_permutex2var_epi8(tl[j], _mm512_or_si512(q, rowc), th[j]));
            }
        }
    }
}

/* the expanded tile (E: cols / 256 super-blocks of 4096 bytes; T: the packed tile, for d, dmin and q2_k's mins)
 * against NB rows of x from b0 */
static inline __attribute__((always_inline)) void k23x_tile(int enc, const uint8_t *T, const uint8_t *E, const a8_x *X,
                                                             long cols, long b0, int NB, __m512 out[8]) {
    const long ng = cols / 32, n16 = cols / 16, GB = p_group_bytes(enc);
    __m512 acc[8];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *o = T + sb * GB, *e = E + 4096 * sb;
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
        __m512 dmin = enc == Q2_K ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32))) : _mm512_setzero_ps();
        for (int g = 0; g < 8; g++) {
            __m512i p[8];
            for (int b = 0; b < NB; b++)
                p[b] = enc == Q3_K ? _mm512_set1_epi32(X->xs[(b0 + b) * ng + 8 * sb + g]) : _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int c = 0; c < 8; c++) {
                __m512i w = _mm512_loadu_si512((const void *)(e + 64 * (8 * g + c)));
                for (int b = 0; b < NB; b++) p[b] = _mm512_dpbusd_epi32(p[b], w, P_X4(X->q + (b0 + b) * cols + 256 * sb + 32 * g + 4 * c));
            }
            __m512 mn[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
            if (enc == Q2_K) {
                __m512i unused;
                k23_scales(enc, o, 2 * g, dmin, &unused, mn);
            }
            for (int b = 0; b < NB; b++) {
                long bb = b0 + b;
                __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(X->d[bb * ng + 8 * sb + g]));
                if (enc == Q3_K) {
                    acc[b] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(p[b]), dx, acc[b]);
                } else {
                    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), dx, acc[b]);
                    acc[b] = _mm512_fnmadd_ps(mn[0], _mm512_set1_ps(X->xc16[bb * n16 + 16 * sb + 2 * g]), acc[b]);
                    acc[b] = _mm512_fnmadd_ps(mn[1], _mm512_set1_ps(X->xc16[bb * n16 + 16 * sb + 2 * g + 1]), acc[b]);
                }
            }
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b];
}

/* iq4_xs from 16 rows of x: a packed super-block's levels (+ 128) and its groups' scales d (s_j - 32) expanded once
 * for all the tile's passes (group j, chunk c: the low nibbles' 64 bytes, then the high ones'; then 8 scale vectors):
 * each pass then only loads and multiplies — the values p_tile's iq4_xs branch gives, bit for bit (3072 x 1024, 2
 * threads, Zen 4, interleaved in one process: 16 rows 290 -> 252 us, 64 rows 969 -> 747, 128 rows 1852 -> 1372) */
#define IQ4X_BYTES (4096 + 512)
static inline __attribute__((always_inline)) void iq4xs_expand(const uint8_t *o, uint8_t *E) {
    const __m512i kv = iq4_levels_u8(), m4 = _mm512_set1_epi8(15);
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
    __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(o + 32)));
    for (int j = 0; j < 8; j++) {
        for (int c = 0; c < 4; c++) {
            __m512i v = _mm512_loadu_si512((const void *)(o + 128 + 256 * j + 64 * c));
            _mm512_storeu_si512((void *)(E + 128 * (4 * j + c)), _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4)));
            _mm512_storeu_si512((void *)(E + 128 * (4 * j + c) + 64), _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4)));
        }
        __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o + 64 + 16 * (j >> 1))));
        __m512i sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * (j & 1)), _mm512_set1_epi32(15)),
                                     _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * j), _mm512_set1_epi32(3)), 4));
        _mm512_storeu_ps((float *)(E + 4096 + 64 * j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32)))));
    }
}

static inline __attribute__((always_inline)) void iq4x_tile(const uint8_t *E, const a8_x *X, long cols, long b0, int NB,
                                                             __m512 out[8]) {
    const long ng = cols / 32;
    __m512 acc[8];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    for (long sb = 0; sb < cols / 256; sb++) {
        const uint8_t *e = E + IQ4X_BYTES * sb;
        for (int j = 0; j < 8; j++) {
            long g = 8 * sb + j;
            __m512i p[8];
            for (int b = 0; b < NB; b++) p[b] = _mm512_set1_epi32(X->xs[(b0 + b) * ng + g]);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                __m512i lo = _mm512_loadu_si512((const void *)(e + 128 * (4 * j + c)));
                __m512i hi = _mm512_loadu_si512((const void *)(e + 128 * (4 * j + c) + 64));
                for (int b = 0; b < NB; b++) {
                    const int8_t *xg = X->q + (b0 + b) * cols + 32 * g + 4 * c;
                    p[b] = _mm512_dpbusd_epi32(p[b], lo, P_X4(xg));
                    p[b] = _mm512_dpbusd_epi32(p[b], hi, P_X4(xg + 16));
                }
            }
            __m512 sv = _mm512_loadu_ps((const float *)(e + 4096 + 64 * j));
            for (int b = 0; b < NB; b++)
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(sv, _mm512_set1_ps(X->d[(b0 + b) * ng + g])), acc[b]);
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b];
}
#endif

/* one tile of 16 rows against NB (1..8) rows of x from b0: out[b] = the 16 rows' results. With pf, each group /
 * super-block first fetches the same bytes of the next tile (one tile ahead): the hardware prefetcher alone leaves
 * the loop waiting on memory at each tile's start (a 0.35 GB q4_0 matrix, Intel Xeon, 2 threads: B = 1 22.7 ->
 * 16.2 ms, B = 8 34.6 -> 25.4 ms). p_rows sets pf in the last pass over a tile only: the earlier passes read it
 * from cache, and a second tile in L1 beside eight rows of x slowed a 128-token prefill by a fifth. q6_k keeps
 * its next-super-block prefetch (the next tile's was level). */
static inline __attribute__((always_inline)) void p_tile(int enc, const uint8_t *T, const a8_x *X, long cols, long b0,
                                                          int NB, int pf, __m512 out[8]) {
    const __m512i m4 = _mm512_set1_epi8(15);
    long ng = cols / 32;
    __m512 acc[8];
    for (int b = 0; b < NB; b++) acc[b] = _mm512_setzero_ps();
    if (enc == Q6_K) {
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * 3360;
            /* the next super-block's 53 lines (streaming 0.36 GB of qwen3-shaped q6_k, Intel Xeon, 2 threads: 20.1 ->
             * 24.4 GB/s when the tile's regions stood apart); not on AMD CPUs, where it costs at every row count
             * (Zen 4, 2 threads, the 151936 x 1024 head, interleaved in one process, without / with it: 1 row 3.85
             * / 3.96 ms, 2 rows 3.78 / 4.61, 4 rows 3.04 / 5.42, 8 rows 7.59 / 11.02) */
            /* (in the first pass over the tile only: a later pass, from 8 rows of x on, reads it from cache) */
            if (row_prefetch && b0 == 0) prefetch_bytes(o + 3360, 3360);
            /* where pf asks for L2 (AMD, from 4 rows of x: p_rows) the next tile's super-block instead: the 168
             * qwen3-0.6b-shaped matrices of 28 layers as q6_k, Zen 4, 2 threads, interleaved, best of 6: 4 rows
             * 15.9 -> 14.0 ms, 8 rows 29.9 -> 21.3, 16 rows 47.6 -> 39.1 */
            if (pf == 2) prefetch_tile(o + cols / 256 * 3360, 3360, 2);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            for (int h = 0; h < 2; h++)
                for (int cq = 0; cq < 2; cq++) { /* chunks 4cq..4cq+3: values of sub-blocks 8h + 2t + cq, t = 0..3 */
                    const uint8_t *oh = o + 288 + 1536 * h + 768 * cq;
                    const int8_t *xh = X->q + b0 * cols + 256 * sb + 128 * h + 16 * cq;
                    const int32_t *s16 = X->xs16 + b0 * (cols / 16) + 16 * sb + 8 * h + cq;
                    const float *xd = X->d + b0 * ng + 8 * sb + 4 * h;
                    const uint8_t *scb = o + 32 + 16 * (8 * h + cq);
                    if (NB == 1) {
                        q6_sub4(oh, xh, s16, xd, scb, d, acc);
                        continue;
                    }
                    q6_sub(oh, xh, s16, xd, scb, d, cols, ng, NB, 0, acc);
                    q6_sub(oh, xh, s16, xd, scb, d, cols, ng, NB, 1, acc);
                    q6_sub(oh, xh, s16, xd, scb, d, cols, ng, NB, 2, acc);
                    q6_sub(oh, xh, s16, xd, scb, d, cols, ng, NB, 3, acc);
                }
        }
    } else if (enc == IQ4_XS) { /* group j of each super-block as an iq4_nl group, its scale d (s_j - 32) */
        const __m512i kv = iq4_levels_u8();
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * 2176;
            if (pf) prefetch_tile(o + cols / 256 * 2176, 2176, pf);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            __m512i sh = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(o + 32)));
#pragma GCC unroll 2
            for (int j = 0; j < 8; j++) {
                long g = 8 * sb + j;
                __m512i p[8];
                for (int b = 0; b < NB; b++) p[b] = _mm512_set1_epi32(X->xs[(b0 + b) * ng + g]);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m512i v = _mm512_loadu_si512((const void *)(o + 128 + 256 * j + 64 * c));
                    __m512i lo = _mm512_shuffle_epi8(kv, _mm512_and_si512(v, m4));
                    __m512i hi = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
                    for (int b = 0; b < NB; b++) {
                        const int8_t *xg = X->q + (b0 + b) * cols + 32 * g + 4 * c;
                        p[b] = P_DOT(p[b], lo, P_X4(xg));
                        p[b] = P_DOT(p[b], hi, P_X4(xg + 16));
                    }
                }
                __m512i sl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(o + 64 + 16 * (j >> 1))));
                __m512i sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(sl, 4 * (j & 1)), _mm512_set1_epi32(15)),
                                             _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(sh, 2 * j), _mm512_set1_epi32(3)), 4));
                __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
                for (int b = 0; b < NB; b++)
                    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(s, _mm512_set1_ps(X->d[(b0 + b) * ng + g])), acc[b]);
            }
        }
    } else if (enc == TQ2_0) { /* group 4h + t: bits 2t of the half's eight lines; p starts at -(sum of x's block) */
        const __m512i m2 = _mm512_set1_epi8(3);
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * 1056;
            if (pf) prefetch_tile(o + cols / 256 * 1056, 1056, pf);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            for (int h = 0; h < 2; h++) {
                __m512i v[8];
                for (int c = 0; c < 8; c++) v[c] = _mm512_loadu_si512((const void *)(o + 32 + 512 * h + 64 * c));
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    long g = 8 * sb + 4 * h + t;
                    __m512i p[8];
                    for (int b = 0; b < NB; b++) p[b] = _mm512_set1_epi32(X->xs[(b0 + b) * ng + g]);
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        __m512i w = _mm512_and_si512(_mm512_srli_epi16(v[c], 2 * t), m2);
                        for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], w, P_X4(X->q + (b0 + b) * cols + 32 * g + 4 * c));
                    }
                    for (int b = 0; b < NB; b++)
                        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(d, _mm512_set1_ps(X->d[(b0 + b) * ng + g])), acc[b]);
                }
            }
        }
    } else if (enc == TQ1_0) { /* groups 0..4: digit j of chunks 0..7; 5, 6: digits 2j - 10, 2j - 9 of chunks 8..11 against
                                * the group's halves; 7: digit 4 of chunks 8..11, then digits 0..3 of the qh chunk */
            for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * 864;
            if (pf) prefetch_tile(o + cols / 256 * 864, 864, pf);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            __m512i p[8];
            const int8_t *xq = X->q + b0 * cols + 256 * sb;
            __m512i v[8];
            for (int c = 0; c < 8; c++) v[c] = _mm512_loadu_si512((const void *)(o + 32 + 64 * c));
            for (int j = 0; j < 8; j++) {
                long g = 8 * sb + j;
                for (int b = 0; b < NB; b++) p[b] = _mm512_set1_epi32(X->xs[(b0 + b) * ng + g]);
                if (j < 5) {
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        __m512i w = tq_digit512(v[c]);
                        for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], w, P_X4(xq + b * cols + 32 * j + 4 * c));
                        if (j < 4) v[c] = tq_times3_512(v[c]);
                    }
                    if (j == 4) /* chunks 8..11 next, at digit 0 */
                        for (int c = 0; c < 4; c++) v[c] = _mm512_loadu_si512((const void *)(o + 32 + 64 * (8 + c)));
                } else {
                    for (int e = 0; e < 2; e++) { /* group 7's second half: the qh chunk's digits 0..3 */
                        if (j == 7 && e == 1) {
                            __m512i q = _mm512_loadu_si512((const void *)(o + 32 + 64 * 12));
                            for (int k = 0; k < 4; k++) {
                                __m512i w = tq_digit512(q);
                                for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], w, P_X4(xq + b * cols + 32 * j + 16 + 4 * k));
                                q = tq_times3_512(q);
                            }
                            break;
                        }
#pragma GCC unroll 4
                        for (int c = 0; c < 4; c++) {
                            __m512i w = tq_digit512(v[c]);
                            for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], w, P_X4(xq + b * cols + 32 * j + 16 * e + 4 * c));
                            v[c] = tq_times3_512(v[c]);
                        }
                    }
                }
                for (int b = 0; b < NB; b++)
                    acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(d, _mm512_set1_ps(X->d[(b0 + b) * ng + g])), acc[b]);
            }
        }
    } else if (enc == Q2_K || enc == Q3_K) {
        const long GB = p_group_bytes(enc);
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * GB;
            if (pf) prefetch_tile(o + cols / 256 * GB, GB, pf);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            __m512 dmin = enc == Q2_K ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32))) : _mm512_setzero_ps();
            if (NB == 1) { /* both halves at once: each chunk's lines read front to back */
                k23_group(enc, o, sb, 0, 2, 0, 4, X, cols, b0, 1, d, dmin, acc);
                continue;
            }
            for (int h = 0; h < 2; h++) {
                k23_group(enc, o, sb, h, 1, 0, 1, X, cols, b0, NB, d, dmin, acc);
                k23_group(enc, o, sb, h, 1, 1, 1, X, cols, b0, NB, d, dmin, acc);
                k23_group(enc, o, sb, h, 1, 2, 1, X, cols, b0, NB, d, dmin, acc);
                k23_group(enc, o, sb, h, 1, 3, 1, X, cols, b0, NB, d, dmin, acc);
            }
        }
    } else if (enc == Q4_K || enc == Q5_K) {
        const long GB = p_group_bytes(enc);
        for (long sb = 0; sb < cols / 256; sb++) {
            const uint8_t *o = T + sb * GB;
            if (pf) prefetch_tile(o + cols / 256 * GB, GB, pf);
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32)));
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                __m512i pl[8], ph[8];
                for (int b = 0; b < NB; b++) pl[b] = ph[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    __m512i v = _mm512_loadu_si512((const void *)(o + p5k_qs(enc, p, c)));
                    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    if (enc == Q5_K) { /* bits 2p / 2p + 1 of the chunk's qh bytes to bit 4 of the low / high values
                                        * (immediate shifts in 16-bit lanes, p a constant: the loop over p is
                                        * unrolled for q5_k; each byte's bit lands in its own bit 4). and + or,
                                        * not one vpternlogd: on Zen 4 that shares vpdpbusd's pipes */
                        const __m512i b4 = _mm512_set1_epi8(16);
                        __m512i hq = _mm512_loadu_si512((const void *)(o + 320 + 128 * c));
                        __m512i l5 = p == 0 ? _mm512_slli_epi16(hq, 4) : p == 1 ? _mm512_slli_epi16(hq, 2) : p == 2 ? hq : _mm512_srli_epi16(hq, 2);
                        __m512i h5 = p == 0 ? _mm512_slli_epi16(hq, 3) : p == 1 ? _mm512_slli_epi16(hq, 1) : p == 2 ? _mm512_srli_epi16(hq, 1) : _mm512_srli_epi16(hq, 3);
                        lo = _mm512_or_si512(lo, _mm512_and_si512(l5, b4));
                        hi = _mm512_or_si512(hi, _mm512_and_si512(h5, b4));
                    }
                    for (int b = 0; b < NB; b++) {
                        const int8_t *xg = X->q + (b0 + b) * cols + 256 * sb + 64 * p + 4 * c;
                        pl[b] = P_DOT(pl[b], lo, P_X4(xg));
                        ph[b] = P_DOT(ph[b], hi, P_X4(xg + 32));
                    }
                }
                for (int h = 0; h < 2; h++) {
                    int j = 2 * p + h;
                    __m128i scj, mj;
                    q4k_tile_scale_min(o + 64, j, &scj, &mj);
                    __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(scj)));
                    __m512 mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mj)));
                    for (int b = 0; b < NB; b++) {
                        long g = 8 * sb + j, bb = b0 + b;
                        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h ? ph[b] : pl[b]),
                                                 _mm512_mul_ps(s, _mm512_set1_ps(X->d[bb * ng + g])), acc[b]);
                        acc[b] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(X->xc[bb * ng + g]), acc[b]);
                    }
                }
            }
        }
    } else {
        const long GB = p_group_bytes(enc), qoff = enc == Q4_1 ? 64 : enc == Q5_0 ? 96 : enc == Q5_1 ? 128 : 32;
        const int off = p_off(enc);
        for (long g = 0; g < ng; g++) {
            const uint8_t *o = T + g * GB;
            if (pf) prefetch_tile(o + ng * GB, GB, pf);
            __m512i p[8];
            for (int b = 0; b < NB; b++)
                p[b] = off ? _mm512_set1_epi32(X->xs[(b0 + b) * ng + g]) : _mm512_setzero_si512(); /* a load, no multiply */
            if (enc == Q8_0) {
#pragma GCC unroll 8
                for (int c = 0; c < 8; c++) {
                    __m512i v = _mm512_loadu_si512((const void *)(o + qoff + 64 * c));
                    for (int b = 0; b < NB; b++) p[b] = P_DOT(p[b], v, P_X4(X->q + (b0 + b) * cols + 32 * g + 4 * c));
                }
            } else {
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    __m512i v = _mm512_loadu_si512((const void *)(o + qoff + 64 * c));
                    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    if (enc == IQ4_NL) { /* the nibbles' levels + 128 (unsigned) */
                        const __m512i kv = iq4_levels_u8();
                        lo = _mm512_shuffle_epi8(kv, lo);
                        hi = _mm512_shuffle_epi8(kv, hi);
                    }
                    if (enc == Q5_0 || enc == Q5_1) { /* bit 2c (2c + 1) of each hb byte to bit 4 of the low (high) value's byte */
                        const __m512i b4 = _mm512_set1_epi8(16);
                        __m512i hb = _mm512_loadu_si512((const void *)(o + (enc == Q5_1 ? 64 : 32)));
                        __m512i l5 = c == 0 ? _mm512_slli_epi16(hb, 4) : c == 1 ? _mm512_slli_epi16(hb, 2) : c == 2 ? hb : _mm512_srli_epi16(hb, 2);
                        __m512i h5 = c == 0 ? _mm512_slli_epi16(hb, 3) : c == 1 ? _mm512_slli_epi16(hb, 1) : c == 2 ? _mm512_srli_epi16(hb, 1) : _mm512_srli_epi16(hb, 3);
                        lo = _mm512_or_si512(lo, _mm512_and_si512(l5, b4));
                        hi = _mm512_or_si512(hi, _mm512_and_si512(h5, b4));
                    }
                    for (int b = 0; b < NB; b++) {
                        const int8_t *xg = X->q + (b0 + b) * cols + 32 * g + 4 * c;
                        p[b] = P_DOT(p[b], lo, P_X4(xg));
                        p[b] = P_DOT(p[b], hi, P_X4(xg + 16));
                    }
                }
            }
            __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)o));
            for (int b = 0; b < NB; b++) {
                long bb = b0 + b;
                acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[b]), _mm512_mul_ps(d, _mm512_set1_ps(X->d[bb * ng + g])), acc[b]);
                if (enc == Q4_1 || enc == Q5_1)
                    acc[b] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 32))),
                                             _mm512_set1_ps(X->xc[bb * ng + g]), acc[b]);
            }
        }
    }
    for (int b = 0; b < NB; b++) out[b] = acc[b];
}

/* tile t's rows of the product for all B rows of x: row b's results at yt + b * ys (the tile's first row) */
static inline __attribute__((always_inline)) void p_rows(int enc, const uint8_t *P, const a8_x *X, float *yt, long ys,
                                                          long rows, long cols, long B, long t, long TB) {
    const uint8_t *T = P + t * TB;
    long r0 = 16 * t, nr = rows - r0 < 16 ? rows - r0 : 16;
    __mmask16 m = (__mmask16)((1u << nr) - 1u);
    /* rows of x per pass over the tile: 8, but 4 for q6_k from 8 rows on (its 8-row instance spills registers: the
     * 151936 x 1024 head, Zen 4, 2 threads, interleaved in one process: 8 rows 9.0-9.5 -> 8.7-8.8 ms, 12 rows 13.0 ->
     * 11.2, 16 rows 20.2-20.5 -> 15.2-15.5; a pass of 4 rows against the tile already in cache costs less than the
     * spills). Below 8 rows one pass: passes of 4 there were 25-45 % slower at 5-7 rows. It changes no value. */
    const int W = enc == Q6_K && B >= 8 ? 4 : 8;
    /* the last pass prefetches the next tile's groups (into L1: pf 1, Intel) or into L2 (pf 2: AMD CPUs, from 4 rows
     * of x). On AMD at one row (decode) it cost 13-32 % into L1 (Zen 4, 2 threads, the qwen3-0.6b-shaped layers,
     * interleaved in one process: q4_0 24.9 -> 29.8 GB/s without it, q4_k 22.2 -> 29.4, q8_0 21.2 -> 23.9) and
     * 0-27 % into L2, so one row goes without. From 4 rows into L1 helped q4_0, q4_1 and q5_0 (8 rows 0.388 / 0.409 /
     * 0.434 against 0.485 / 0.520 / 0.543 ms) while q4_k and q8_0 lost (8 rows 0.688 / 0.698 against 0.612 /
     * 0.672); into L2 every format tried gains (the 168 matrices of 28 layers, best of 6, interleaved, without /
     * into L1 for the nibble formats -> into L2: q4_0 4 / 8 rows 11.2 / 17.2 -> 9.8 / 16.3 ms, q8_0 15.2 / 25.9 ->
     * 14.3 / 18.7, q4_k 12.8 / 23.6 -> 10.3 / 17.6; q6_k above). It changes no value. */
    const int pf_on = row_prefetch ? 1 : B >= 4 ? 2 : 0;
#if defined(K23X)
    if (enc == IQ4_XS && B >= 16) {
        k23x_reserve(IQ4X_BYTES * (cols / 256));
        for (long sb = 0; sb < cols / 256; sb++) iq4xs_expand(T + 2176 * sb, k23x_buf + IQ4X_BYTES * sb);
        for (long b0 = 0; b0 < B; b0 += 8) {
            int nb = (int)(B - b0 < 8 ? B - b0 : 8);
            __m512 out[8];
            switch (nb) {
            case 1: iq4x_tile(k23x_buf, X, cols, b0, 1, out); break;
            case 2: iq4x_tile(k23x_buf, X, cols, b0, 2, out); break;
            case 3: iq4x_tile(k23x_buf, X, cols, b0, 3, out); break;
            case 4: iq4x_tile(k23x_buf, X, cols, b0, 4, out); break;
            case 5: iq4x_tile(k23x_buf, X, cols, b0, 5, out); break;
            case 6: iq4x_tile(k23x_buf, X, cols, b0, 6, out); break;
            case 7: iq4x_tile(k23x_buf, X, cols, b0, 7, out); break;
            default: iq4x_tile(k23x_buf, X, cols, b0, 8, out); break;
            }
            for (int b = 0; b < nb; b++) _mm512_mask_storeu_ps(yt + (b0 + b) * ys, m, out[b]);
        }
        return;
    }
    if (enc == TQ1_0 && B >= TQ1X_FROM) { /* the digits expanded once; the passes are tq2_0's (the same sums, in the
                                            * same order: the same results) */
        k23x_reserve(1056 * (cols / 256));
        for (long sb = 0; sb < cols / 256; sb++) tq1_expand(T + 864 * sb, k23x_buf + 1056 * sb);
        for (long b0 = 0; b0 < B; b0 += 8) {
            int nb = (int)(B - b0 < 8 ? B - b0 : 8);
            __m512 out[8];
            switch (nb) {
            case 1: p_tile(TQ2_0, k23x_buf, X, cols, b0, 1, 0, out); break;
            case 2: p_tile(TQ2_0, k23x_buf, X, cols, b0, 2, 0, out); break;
            case 3: p_tile(TQ2_0, k23x_buf, X, cols, b0, 3, 0, out); break;
            case 4: p_tile(TQ2_0, k23x_buf, X, cols, b0, 4, 0, out); break;
            case 5: p_tile(TQ2_0, k23x_buf, X, cols, b0, 5, 0, out); break;
            case 6: p_tile(TQ2_0, k23x_buf, X, cols, b0, 6, 0, out); break;
            case 7: p_tile(TQ2_0, k23x_buf, X, cols, b0, 7, 0, out); break;
            default: p_tile(TQ2_0, k23x_buf, X, cols, b0, 8, 0, out); break;
            }
            for (int b = 0; b < nb; b++) _mm512_mask_storeu_ps(yt + (b0 + b) * ys, m, out[b]);
        }
        return;
    }
    if ((enc == Q2_K || enc == Q3_K) && B >= k23x_from(enc)) {
        k23x_reserve(4096 * (cols / 256));
        for (long sb = 0; sb < cols / 256; sb++) k23_expand(enc, T + sb * p_group_bytes(enc), k23x_buf + 4096 * sb);
        for (long b0 = 0; b0 < B; b0 += 8) {
            int nb = (int)(B - b0 < 8 ? B - b0 : 8);
            __m512 out[8];
            switch (nb) {
            case 1: k23x_tile(enc, T, k23x_buf, X, cols, b0, 1, out); break;
            case 2: k23x_tile(enc, T, k23x_buf, X, cols, b0, 2, out); break;
            case 3: k23x_tile(enc, T, k23x_buf, X, cols, b0, 3, out); break;
            case 4: k23x_tile(enc, T, k23x_buf, X, cols, b0, 4, out); break;
            case 5: k23x_tile(enc, T, k23x_buf, X, cols, b0, 5, out); break;
            case 6: k23x_tile(enc, T, k23x_buf, X, cols, b0, 6, out); break;
            case 7: k23x_tile(enc, T, k23x_buf, X, cols, b0, 7, out); break;
            default: k23x_tile(enc, T, k23x_buf, X, cols, b0, 8, out); break;
            }
            for (int b = 0; b < nb; b++) _mm512_mask_storeu_ps(yt + (b0 + b) * ys, m, out[b]);
        }
        return;
    }
#endif
    for (long b0 = 0, nb; b0 < B; b0 += nb) {
        nb = B - b0 < W ? B - b0 : W;
        /* q6_k's 6- and 7-row instances run at half the rate of its 4- and 8-row ones (8192 x 1024 from cache, Zen 4,
         * 2 threads, interleaved in one process: 6 rows 0.44-0.57 ms, 7 rows 0.40-0.49, 8 rows 0.29-0.31): 6 and 7
         * rows take a pass of 4 first (0.24 / 0.27 ms; the 151936 x 1024 head from memory: 6 rows 10.6 -> 8.7 ms,
         * 7 rows 11.8 -> 9.2). The other packed formats have no such step (5-8 rows within ~15 %). No value changes. */
        if (enc == Q6_K && (nb == 6 || nb == 7)) nb = 4;
        int pf = b0 + nb >= B ? pf_on : 0;
        __m512 out[8];
        switch (nb) {
        case 1: p_tile(enc, T, X, cols, b0, 1, pf, out); break;
        case 2: p_tile(enc, T, X, cols, b0, 2, pf, out); break;
        case 3: p_tile(enc, T, X, cols, b0, 3, pf, out); break;
        case 4: p_tile(enc, T, X, cols, b0, 4, pf, out); break;
        case 5: p_tile(enc, T, X, cols, b0, 5, pf, out); break;
        case 6: p_tile(enc, T, X, cols, b0, 6, pf, out); break;
        case 7: p_tile(enc, T, X, cols, b0, 7, pf, out); break;
        default: p_tile(enc, T, X, cols, b0, 8, pf, out); break;
        }
        for (int b = 0; b < nb; b++) _mm512_mask_storeu_ps(yt + (b0 + b) * ys, m, out[b]);
    }
}

/* p_rows of any packed encoding, one function per encoding. Kept apart, the compiler's per-function passes stay
 * small and its link-time partitions compile in parallel: all fourteen inlined into p_rows_any made one 0.5 MB
 * function, and the library's build (-flto=2 on the 2-CPU Zen 4 VM) took 78 s, against 36 s so (no code changes) */
#define P_ROWS_INST(E)                                                                                          \
    static __attribute__((noinline)) void p_rows_##E(const uint8_t *P, const a8_x *X, float *yt, long ys,      \
                                                     long rows, long cols, long B, long t, long TB) {          \
        p_rows(E, P, X, yt, ys, rows, cols, B, t, TB);                                                          \
    }
/* the packed encodings (vxc_qpack_tile_bytes), each its function, picked by a switch (a table of function pointers
 * put them back in one link-time partition: 80 s) */
#define P_ROWS_ENCODINGS(F) F(Q8_0) F(Q4_0) F(Q4_1) F(Q5_0) F(Q6_K) F(Q5_K) F(Q5_1) F(Q2_K) F(Q3_K) F(IQ4_NL) \
    F(IQ4_XS) F(TQ1_0) F(TQ2_0) F(Q4_K)
P_ROWS_ENCODINGS(P_ROWS_INST)
#undef P_ROWS_INST

static void p_rows_any(int enc, const uint8_t *P, const a8_x *X, float *yt, long ys, long rows, long cols, long B,
                       long t, long TB) {
    switch (enc) {
#define P_ROWS_CASE(E) case E: p_rows_##E(P, X, yt, ys, rows, cols, B, t, TB); return;
        P_ROWS_ENCODINGS(P_ROWS_CASE)
#undef P_ROWS_CASE
    }
    p_rows_Q4_K(P, X, yt, ys, rows, cols, B, t, TB);
}
#endif

/* y [B, rows] fp32 = x [B, cols] (bf16 when bf) at int8_block32 times the packed matrix P (vxc_qpack): as
 * vxc_qgemv_a8. Only where vxc_qpack_tile_bytes is non-zero. */
void vxc_qgemv_a8p(int enc, const void *P, const void *x, float *y, long rows, long cols, long B, int bf) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    long TB = vxc_qpack_tile_bytes(enc, cols);
    if (TB <= 0 || rows <= 0 || B <= 0) return;
    float *xf = bf ? (float *)malloc((size_t)(B * cols) * sizeof(float)) : NULL;
    if (bf) load_row(x, 0, B * cols, 1, xf);
    a8_x X;
    a8_prepare(enc, bf ? xf : (const float *)x, cols, B, &X, 1);
    free(xf);
    const uint8_t *Pb = (const uint8_t *)P;
    long nt = (rows + 15) / 16;
#pragma omp parallel for schedule(static)
    for (long t = 0; t < nt; t++) p_rows_any(enc, Pb, &X, y + 16 * t, rows, rows, cols, B, t, TB);
    a8_free(&X);
#else
    (void)enc; (void)P; (void)x; (void)y; (void)rows; (void)cols; (void)B; (void)bf;
#endif
}

/* h [B, rows] fp32 = silu(x Wg^T) * (x Wu^T): the gate and the up matrix (rows x cols each, packed by vxc_qpack) read
 * tile by tile in one pass, each product vxc_qgemv_a8p's value for value and h vxc_qsilu_mul's — the three calls'
 * results — without their [B, rows] gate and up outputs (a 128-token prompt chunk of the 0.6B softmax-decoder
 * shape's 3072-wide FFN: 3 MB less at the prefill's peak), x quantised once where the two encodings agree, one
 * parallel region. Only where vxc_qpack_tile_bytes is non-zero for both. */
void vxc_qswiglu_a8p(int enc_g, const void *Pg, int enc_u, const void *Pu, const void *x, float *h, long rows,
                     long cols, long B, int bf) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    long TBg = vxc_qpack_tile_bytes(enc_g, cols), TBu = vxc_qpack_tile_bytes(enc_u, cols);
    if (TBg <= 0 || TBu <= 0 || rows <= 0 || B <= 0) return;
    float *xf = bf ? (float *)malloc((size_t)(B * cols) * sizeof(float)) : NULL;
    if (bf) load_row(x, 0, B * cols, 1, xf);
    const float *xs = bf ? xf : (const float *)x;
    a8_x Xg, Xu;
    a8_prepare(enc_g, xs, cols, B, &Xg, 1);
    if (enc_u != enc_g) a8_prepare(enc_u, xs, cols, B, &Xu, 1);
    const a8_x *XU = enc_u != enc_g ? &Xu : &Xg;
    free(xf);
    long nt = (rows + 15) / 16;
#pragma omp parallel
    {
        float *g = (float *)malloc((size_t)(2 * B * 16) * sizeof(float)), *u = g + B * 16;
#pragma omp for schedule(static)
        for (long t = 0; t < nt; t++) {
            long r0 = 16 * t, nr = rows - r0 < 16 ? rows - r0 : 16;
            p_rows_any(enc_g, (const uint8_t *)Pg, &Xg, g, 16, rows, cols, B, t, TBg);
            p_rows_any(enc_u, (const uint8_t *)Pu, XU, u, 16, rows, cols, B, t, TBu);
            for (long b = 0; b < B; b++)
                for (long i = 0; i < nr; i++) h[b * rows + r0 + i] = silu(g[b * 16 + i]) * u[b * 16 + i];
        }
        free(g);
    }
    a8_free(&Xg);
    if (enc_u != enc_g) a8_free(&Xu);
#else
    (void)enc_g; (void)Pg; (void)enc_u; (void)Pu; (void)x; (void)h; (void)rows; (void)cols; (void)B; (void)bf;
#endif
}

/* ---------------------------------------------------------------------------------------------------------
 * Routed SwiGLU experts over ggml-encoded banks (qdense.qmoe_experts' native form): no decoded copy of a bank.
 * Banks [E, rows, row_bytes] as stored: gate / up of rows I over cols d, down of rows d over cols I. For each
 * expert some token selected, the tokens routed to it are gathered, their gate / up / down products run as one
 * block GEMV each (vxc_qgemv, or vxc_qgemv_a8 with int8_block32 activations), h = silu(g) u, and the results
 * are added to out weighted by the router — experts in ascending order, as the torch twin visits them. The
 * expert ids and weights are read from memory (the router's outputs: a replayed step's buffers). The banks hold
 * the experts e0 .. e0 + E - 1 (global ids; tensor parallel: this rank's, bank row id - e0); an id outside them
 * selects nothing. x, out fp32 [T, d]. */
void vxc_qmoe(int enc_in, const void *Win, int enc_up, const void *Wup, int enc_down, const void *Wdown,
              const float *x, const int64_t *experts, const float *weights, float *out, long T, long k, long E,
              long d, long I, int a8, long e0) {
    if (T <= 0) return;
    memset(out, 0, (size_t)(T * d) * sizeof(float));
    long s_in = I * (d / Q_BLOCK[enc_in] * Q_TSIZE[enc_in]), s_up = I * (d / Q_BLOCK[enc_up] * Q_TSIZE[enc_up]);
    long s_down = d * (I / Q_BLOCK[enc_down] * Q_TSIZE[enc_down]);
    long *sel = (long *)malloc((size_t)(T * k) * sizeof(long));
    float *X = (float *)malloc((size_t)(T * k * d) * sizeof(float)), *G = (float *)malloc((size_t)(T * k * I) * sizeof(float));
    float *U = (float *)malloc((size_t)(T * k * I) * sizeof(float)), *Y = (float *)malloc((size_t)(T * k * d) * sizeof(float));
    for (long e = 0; e < E; e++) {
        long n = 0;
        for (long i = 0; i < T * k; i++)
            if (experts[i] == e + e0) sel[n++] = i;
        if (!n) continue;
        for (long j = 0; j < n; j++) memcpy(X + j * d, x + (sel[j] / k) * d, (size_t)d * sizeof(float));
        const uint8_t *wi = (const uint8_t *)Win + e * s_in, *wu = (const uint8_t *)Wup + e * s_up;
        const uint8_t *wd = (const uint8_t *)Wdown + e * s_down;
        if (a8) {
            vxc_qgemv_a8(enc_in, wi, X, G, I, d, n, 0);
            vxc_qgemv_a8(enc_up, wu, X, U, I, d, n, 0);
        } else {
            vxc_qgemv(enc_in, wi, X, G, I, d, n, 0);
            vxc_qgemv(enc_up, wu, X, U, I, d, n, 0);
        }
        for (long i = 0; i < n * I; i++) G[i] = silu(G[i]) * U[i];
        if (a8) vxc_qgemv_a8(enc_down, wd, G, Y, d, I, n, 0);
        else vxc_qgemv(enc_down, wd, G, Y, d, I, n, 0);
        for (long j = 0; j < n; j++) {
            float w = weights[sel[j]];
            float *o = out + (sel[j] / k) * d;
            for (long c = 0; c < d; c++) o[c] += w * Y[j * d + c];
        }
    }
    free(sel);
    free(X);
    free(G);
    free(U);
    free(Y);
}

/* ------------------------------------------------------------------------- batched decode: stateful steps
 * One call for the B rows of a batched decode step (vxc/codegen/batch.py): row b is the single-sequence step of
 * the sequence in state slot slots[b] — the same function on that slot's buffers, so each row is bit-identical to
 * its single-sequence step; only the per-row Python dispatch is gone. Row tensors are contiguous [B, ...]. */

void vxc_conv1d_step_rows(const void *x, const void *weight, const void *bias, void *state, void *out, long C, long K,
                          int a, int bf, int w_bf, int s_bf, long B, const int64_t *slots, long slot_bytes) {
    long es = bf ? 2 : 4, chunk = 1024, nc = (C + chunk - 1) / chunk; /* (row, 1024 channels) pieces, one region */
#pragma omp parallel for schedule(static) if (B * C >= 8192)
    for (long i = 0; i < B * nc; i++) {
        long b = i / nc, c0 = (i % nc) * chunk, c1 = c0 + chunk < C ? c0 + chunk : C;
        conv_step_range((const char *)x + b * C * es, weight, bias, (char *)state + slots[b] * slot_bytes,
                        (char *)out + b * C * es, c0, c1, K, a, bf, w_bf, s_bf);
    }
}

void vxc_ssd_step_rows(const void *x, const void *dt, const void *A_log, const void *Bm, const void *Cm, const void *Dv,
                       const void *dt_bias, float dt_min, float dt_max, int clamp, float *state, void *out, long H, long P,
                       long G, long N, int bf, int w_bf, long B, const int64_t *slots) {
    long es = bf ? 2 : 4, per_group = H / G;
    /* one parallel region over every (row, head) pair, each pair vxc_ssd_step's head (the same arithmetic): a region
     * per row had been 8 a call and 384 a step of 8 Mamba2-780m-shaped rows */
#pragma omp parallel for schedule(static)
    for (long i = 0; i < B * H; i++) {
        long b = i / H, h = i % H;
        ssd_head((const char *)x + b * H * P * es, (const char *)dt + b * H * es, (const char *)Bm + b * G * N * es,
                 (const char *)Cm + b * G * N * es, ld(dt_bias, h, w_bf), expf(ld(A_log, h, w_bf)), ld(Dv, h, w_bf),
                 dt_min, dt_max, clamp, state + slots[b] * H * P * N, (char *)out + b * H * P * es, 1, H, P, G, N, h,
                 h / per_group, bf);
    }
}

/* kv: the region's buffer [S, 2, rows, Hkv, D] (K rows then V rows per slot); starts[b]: row b's position */
void vxc_attention_step_rows(const void *q, const void *k, const void *v, void *kv, long slot_bytes, long v_bytes,
                             void *out, const int64_t *starts, float scale, long Hq, long Hkv, long Dk, long Dv,
                             float *scratch, long rows, long window, const void *sinks, int s_bf, int bf, int kt,
                             long B, const int64_t *slots) {
    /* every row's new K / V first, then the rows' (group, tile) units in one parallel region (a region per row cost
     * more than the short contexts' work: 8 rows of the 0.6B shape at ~25 positions, 6.8 ms a step); scratch holds
     * B x Hq x rows. Each row's arithmetic is the single-row step's. */
    long es = bf ? 2 : 4, ks = kt_size(kt), group = Hq / Hkv, work = 0;
    for (long b = 0; b < B; b++) {
        char *kc = (char *)kv + slots[b] * slot_bytes;
        long row = starts[b] % rows, lo = att_lo(starts[b], window);
        put_row(kc + row * Hkv * Dk * ks, (const char *)k + b * Hkv * Dk * es, Hkv * Dk, bf, kt);
        put_row(kc + v_bytes + row * Hkv * Dv * ks, (const char *)v + b * Hkv * Dv * es, Hkv * Dv, bf, kt);
        work += (starts[b] - lo + 1) * Hq * Dk;
    }
    int par = work >= 32768, nthr = omp_get_max_threads();
    if (B >= 2 && B >= nthr && Hq <= 64) {
        /* a row per work unit (att_row: the cache read a whole row at a time), the rows over the threads */
#pragma omp parallel if (par)
        {
            float *buf = (float *)malloc((size_t)(Hq * (Dk + Dv) + 2 * Hq) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (long b = 0; b < B; b++) {
                const char *kc = (const char *)kv + slots[b] * slot_bytes;
                long lo = att_lo(starts[b], window);
                att_row((const char *)q + b * Hq * Dk * es, kc, kc + v_bytes, (char *)out + b * Hq * Dv * es, lo,
                        starts[b] - lo + 1, scale, Hq, Hkv, Dk, Dv, scratch + b * Hq * rows, rows, sinks, s_bf, bf, kt,
                        buf, buf + Hq * Dk, buf + Hq * (Dk + Dv), buf + Hq * (Dk + Dv) + Hq);
            }
            free(buf);
        }
        return;
    }
    long tiles, tile;
    att_tiles(group, Hkv * B, par ? nthr : 1, &tiles, &tile);
    long units = Hkv * tiles;
#pragma omp parallel for schedule(static) if (par)
    for (long w = 0; w < B * units; w++) {
        long b = w / units;
        const char *kc = (const char *)kv + slots[b] * slot_bytes;
        long lo = att_lo(starts[b], window);
        att_unit((const char *)q + b * Hq * Dk * es, kc, kc + v_bytes, (char *)out + b * Hq * Dv * es, lo, starts[b] - lo + 1,
                 scale, Hq, Hkv, Dk, Dv, scratch + b * Hq * rows, rows, sinks, s_bf, bf, kt, w % units, tiles, tile);
    }
}

/* delta rule (gated delta: kda = 0; KDA: kda = 1) for B rows: q, k [B, Hk, Dk], v [B, Hv, Dv], a [B, Hv] (KDA:
 * [B, Hv·Dk]), b [B, Hv], state: the region's [S, Hv, Dk, Dv] fp32 buffer, o [B, Hv, Dv]. */
void vxc_delta_step_rows(const void *q, const void *k, const void *v, const void *a, const void *b, const void *A_log,
                         const void *dt_bias, float *state, void *o, long Hk, long Hv, long Dk, long Dv, float scale,
                         float l2_eps, int kda, int bf, int w_bf, long B, const int64_t *slots) {
    long es = bf ? 2 : 4, na = kda ? Hv * Dk : Hv;
    /* one parallel region over every (row, value head) pair, each vxc_delta_step's head (a region per row before) */
#pragma omp parallel for schedule(static)
    for (long i = 0; i < B * Hv; i++) {
        long r = i / Hv;
        delta_head((const char *)q + r * Hk * Dk * es, (const char *)k + r * Hk * Dk * es,
                   (const char *)v + r * Hv * Dv * es, (const char *)a + r * na * es, (const char *)b + r * Hv * es,
                   A_log, dt_bias, state + slots[r] * Hv * Dk * Dv, (char *)o + r * Hv * Dv * es, Hk, Hv, Dk, Dv,
                   scale, l2_eps, kda, bf, w_bf, i % Hv);
    }
}

/* MLA for B rows: q [B, H, N + P], kv [B, R + P], cos / sin [B, P/2] (or NULL), cache: the region's buffer, slot
 * s at cache + s·slot_bytes; starts[b]: row b's position; out [B, H, V]. */
void vxc_mla_decode_rows(const void *q, const void *kv, const void *norm_w, const void *w_kvb, const void *cos_t,
                         const void *sin_t, void *cache, long slot_bytes, void *out, long H, long N, long P, long V,
                         long R, const int64_t *starts, float eps, float scale, int interleaved, int split_out, int bf,
                         int nw_bf, int w_bf, int c_bf, int cache_bf, long B, const int64_t *slots) {
    long es = bf ? 2 : 4, ces = c_bf ? 2 : 4, half = P / 2;
    for (long r = 0; r < B; r++)
        vxc_mla_decode((const char *)q + r * H * (N + P) * es, (const char *)kv + r * (R + P) * es, norm_w, w_kvb,
                       cos_t ? (const char *)cos_t + r * half * ces : NULL, sin_t ? (const char *)sin_t + r * half * ces : NULL,
                       (char *)cache + slots[r] * slot_bytes, (char *)out + r * H * V * es, H, N, P, V, R, starts[r], eps,
                       scale, interleaved, split_out, bf, nw_bf, w_bf, c_bf, cache_bf);
}

/* ------------------------------------------------------------------------------------ prefill attention (T > 1)
 * Causal GQA softmax attention of T new queries at positions start..start+T-1 over caches that hold every position
 * 0..start+T-1 (the caller writes the new K / V rows first): q [T, Hq, Dk], k_cache [rows, Hkv, Dk], v_cache
 * [rows, Hkv, Dv], out [T, Hq, Dv]. Query t sees keys att_lo(start + t, window)..start + t; sinks [Hq] (or NULL) add
 * one logit per head to the denominator. Blocked as flash attention is: a unit is one KV head and up to PF_ROWS /
 * group queries with all of that group's heads (R rows sharing every K and V load), the keys run in blocks of PF_KB
 * with the softmax kept online (a running max and denominator per row). The unit's queries are held transposed
 * ([Dk][rows], scaled), so a block's scores come out key-major with the rows in vector lanes — K is read in place,
 * one broadcast per value, and the masking and the online softmax run across rows in vectors. No [H, T, S] score
 * tensor and no copy of K / V per query head (torch's fused kernel wants both expanded to Hq heads, and keeps ~17 MB
 * of scratch after its first call). A bf16 / f16 cache (kt) is widened block by block into fp32 scratch. bf16
 * activations (bf = 1) work too, but slower than torch's half-precision kernel, so the op sends only fp32
 * activations here (the bf16 form is tested directly). */
#define PF_KB 32
#define PF_ROWS 64

/* St[j][0..Rp) = K[j] . Qt[., 0..Rp) for the nk keys of a block (K row j at K + j * ks); Qt: [Dk][Rp], Rp % 16 == 0.
 * AVX-512: 4 keys x up to 4 vectors of rows (16 accumulators) per pass over Dk, so each Qt load and K broadcast
 * feeds 4 FMAs. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void pf_scores4(const float *Qt, long Rp, long Dk, const float *K, long ks,
                                                              float *St, long j, long rv, int nv) {
    __m512 a[4][4];
    for (int i = 0; i < 4; i++)
        for (int u = 0; u < nv; u++) a[i][u] = _mm512_setzero_ps();
    for (long d = 0; d < Dk; d++) {
        __m512 qv[4];
        for (int u = 0; u < nv; u++) qv[u] = _mm512_loadu_ps(Qt + d * Rp + rv + 16 * u);
        for (int i = 0; i < 4; i++) {
            __m512 kb = _mm512_set1_ps(K[(j + i) * ks + d]);
            for (int u = 0; u < nv; u++) a[i][u] = _mm512_fmadd_ps(kb, qv[u], a[i][u]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int u = 0; u < nv; u++) _mm512_storeu_ps(St + (j + i) * Rp + rv + 16 * u, a[i][u]);
}
#endif

static void pf_scores(const float *Qt, long Rp, long Dk, const float *K, long ks, long nk, float *St) {
    long j = 0;
#if defined(__AVX512F__)
    for (; j + 4 <= nk; j += 4)
        for (long rv = 0; rv < Rp; rv += 64) {
            long nv = (Rp - rv) / 16 < 4 ? (Rp - rv) / 16 : 4;
            if (nv == 4) pf_scores4(Qt, Rp, Dk, K, ks, St, j, rv, 4);
            else if (nv == 3) pf_scores4(Qt, Rp, Dk, K, ks, St, j, rv, 3);
            else if (nv == 2) pf_scores4(Qt, Rp, Dk, K, ks, St, j, rv, 2);
            else pf_scores4(Qt, Rp, Dk, K, ks, St, j, rv, 1);
        }
#endif
    for (; j < nk; j++) {
        float *o = St + j * Rp;
        for (long r = 0; r < Rp; r++) o[r] = 0.0f;
        for (long d = 0; d < Dk; d++) {
            float kd = K[j * ks + d];
            const float *qd = Qt + d * Rp;
#pragma omp simd
            for (long r = 0; r < Rp; r++) o[r] += kd * qd[r];
        }
    }
}

/* acc[r][0..Dv) += sum_j P[j][r] V[j][0..Dv) for R rows and the nk keys of a block (V row j at V + j * vs). AVX-512:
 * two rows at a time over 128 (or 64) channels, so each V load feeds two FMAs. */
#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void pf_wsum2(const float *P, long Rp, long r, long nk, const float *V, long vs,
                                                            long Dv, float *acc, long c, int nu) {
    float *a0r = acc + r * Dv + c, *a1r = a0r + Dv;
    __m512 a0[8], a1[8];
    for (int u = 0; u < nu; u++) a0[u] = _mm512_loadu_ps(a0r + 16 * u), a1[u] = _mm512_loadu_ps(a1r + 16 * u);
    for (long j = 0; j < nk; j++) {
        __m512 p0 = _mm512_set1_ps(P[j * Rp + r]), p1 = _mm512_set1_ps(P[j * Rp + r + 1]);
        for (int u = 0; u < nu; u++) {
            __m512 vv = _mm512_loadu_ps(V + j * vs + c + 16 * u);
            a0[u] = _mm512_fmadd_ps(p0, vv, a0[u]);
            a1[u] = _mm512_fmadd_ps(p1, vv, a1[u]);
        }
    }
    for (int u = 0; u < nu; u++) _mm512_storeu_ps(a0r + 16 * u, a0[u]), _mm512_storeu_ps(a1r + 16 * u, a1[u]);
}
#endif

static void pf_wsum(const float *P, long Rp, long R, long nk, const float *V, long vs, long Dv, float *acc) {
    long r = 0, c = 0; /* rows r.. and channels c.. of the rows before r: what the vector passes leave */
#if defined(__AVX512F__)
    for (; r + 2 <= R; r += 2) {
        for (c = 0; c + 128 <= Dv; c += 128) pf_wsum2(P, Rp, r, nk, V, vs, Dv, acc, c, 8);
        for (; c + 64 <= Dv; c += 64) pf_wsum2(P, Rp, r, nk, V, vs, Dv, acc, c, 4);
        for (long h = r; h < r + 2; h++)
            for (long j = 0; j < nk; j++) {
                float p = P[j * Rp + h], *ar = acc + h * Dv;
#pragma omp simd
                for (long cc = c; cc < Dv; cc++) ar[cc] += p * V[j * vs + cc];
            }
    }
#endif
    for (; r < R; r++)
        for (long j = 0; j < nk; j++) {
            float p = P[j * Rp + r], *ar = acc + r * Dv;
#pragma omp simd
            for (long cc = 0; cc < Dv; cc++) ar[cc] += p * V[j * vs + cc];
        }
}

void vxc_attention_prefill(const void *q, const void *k_cache, const void *v_cache, void *out, long T, long start,
                           float scale, long Hq, long Hkv, long Dk, long Dv, long window, const void *sinks, int s_bf,
                           int bf, int kt) {
    long group = Hq / Hkv, qb = PF_ROWS / group > 0 ? PF_ROWS / group : 1, nqb = (T + qb - 1) / qb;
    long Rmax = qb * group, Rpm = (Rmax + 15) / 16 * 16;
    int par = T * (start + T) * Hq * Dk >= 65536;
#pragma omp parallel if (par)
    {
        size_t n = (size_t)(Dk * Rpm + Rmax * Dv + PF_KB * Rpm + 6 * Rpm + PF_KB * (Dk + Dv));
        float *Qt = (float *)malloc(sizeof(float) * n);
        float *acc = Qt + Dk * Rpm, *St = acc + Rmax * Dv, *m = St + PF_KB * Rpm, *l = m + Rpm, *bm = l + Rpm,
              *corr = bm + Rpm, *pos = corr + Rpm, *lo = pos + Rpm, *Kb = lo + Rpm, *Vb = Kb + PF_KB * Dk;
        /* later query blocks see more keys: units handed out one at a time, the longest first */
#pragma omp for schedule(dynamic, 1)
        for (long w = 0; w < Hkv * nqb; w++) {
            long g = w % Hkv, t0 = (nqb - 1 - w / Hkv) * qb, t1 = t0 + qb < T ? t0 + qb : T, R = (t1 - t0) * group;
            long Rp = (R + 15) / 16 * 16;
            for (long r = 0; r < Rp; r++) {
                long i = r / group, h = g * group + r % group;
                for (long d = 0; d < Dk; d++) Qt[d * Rp + r] = r < R ? ld(q, ((t0 + i) * Hq + h) * Dk + d, bf) * scale : 0.0f;
                m[r] = -INFINITY;
                l[r] = 0.0f;
                pos[r] = (float)(r < R ? start + t0 + i : -1); /* positions as floats: exact below 2^24 */
                lo[r] = (float)(r < R ? att_lo(start + t0 + i, window) : 0);
            }
            memset(acc, 0, sizeof(float) * (size_t)(R * Dv));
            long kend = start + t1; /* keys att_lo(start + t0)..kend - 1 */
            for (long kb = att_lo(start + t0, window); kb < kend; kb += PF_KB) {
                long nk = kend - kb < PF_KB ? kend - kb : PF_KB, ks = Hkv * Dk, vs = Hkv * Dv;
                const float *K = (const float *)k_cache + (kb * Hkv + g) * Dk, *V = (const float *)v_cache + (kb * Hkv + g) * Dv;
                if (kt) { /* the block's K widened to fp32 */
                    for (long j = 0; j < nk; j++) widen_row(Kb + j * Dk, k_cache, ((kb + j) * Hkv + g) * Dk, Dk, kt);
                    K = Kb, ks = Dk;
                }
                /* V copied (widened) into contiguous scratch: every row rereads it, and the cache's rows lie
                 * Hkv * Dv apart (4 KiB for 8 heads of 128), where they would all share an L1 set */
                for (long j = 0; j < nk; j++) {
                    if (kt)
                        widen_row(Vb + j * Dv, v_cache, ((kb + j) * Hkv + g) * Dv, Dv, kt);
                    else
                        memcpy(Vb + j * Dv, V + j * vs, sizeof(float) * (size_t)Dv);
                }
                V = Vb, vs = Dv;
                pf_scores(Qt, Rp, Dk, K, ks, nk, St);
#pragma omp simd
                for (long r = 0; r < Rp; r++) bm[r] = -INFINITY;
                for (long j = 0; j < nk; j++) {
                    float key = (float)(kb + j), *sj = St + j * Rp;
#pragma omp simd
                    for (long r = 0; r < Rp; r++) {
                        float v = key >= lo[r] && key <= pos[r] ? sj[r] : -INFINITY;
                        sj[r] = v;
                        bm[r] = v > bm[r] ? v : bm[r];
                    }
                }
#pragma omp simd
                for (long r = 0; r < Rp; r++) {
                    float mn = bm[r] > m[r] ? bm[r] : m[r];
                    corr[r] = m[r] == -INFINITY || mn == m[r] ? 1.0f : vexp(m[r] - mn);
                    m[r] = mn;
                    l[r] *= corr[r];
                }
                for (long j = 0; j < nk; j++) {
                    float *sj = St + j * Rp;
#pragma omp simd
                    for (long r = 0; r < Rp; r++) {
                        float p = sj[r] == -INFINITY ? 0.0f : vexp(sj[r] - m[r]);
                        sj[r] = p;
                        l[r] += p;
                    }
                }
                for (long r = 0; r < R; r++)
                    if (corr[r] != 1.0f) {
                        float cr = corr[r], *ar = acc + r * Dv;
#pragma omp simd
                        for (long c = 0; c < Dv; c++) ar[c] *= cr;
                    }
                pf_wsum(St, Rp, R, nk, V, vs, Dv, acc);
            }
            for (long r = 0; r < R; r++) {
                long i = r / group, h = g * group + r % group;
                float den = l[r] + (sinks ? expf(ld(sinks, h, s_bf) - m[r]) : 0.0f);
                for (long c = 0; c < Dv; c++) st(out, ((t0 + i) * Hq + h) * Dv + c, acc[r * Dv + c] / den, bf);
            }
        }
        free(Qt);
    }
}
