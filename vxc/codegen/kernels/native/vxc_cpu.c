/* vxc's native CPU kernels: the decode-time hot loops of the torch twins, one pass over memory each.
 *
 * Built at first use by ``vxc/codegen/kernels/native.py`` with the host compiler (-O3 -march=native
 * -fopenmp) and loaded after torch, so its OpenMP regions share torch's libgomp thread pool (same soname).
 * Every function mirrors a torch twin (the oracle the tests compare against): fp32
 * arithmetic, results rounded once to the output dtype (bf16: round to nearest even, as torch does).
 * Activations are bf16 (``bf = 1``) or fp32 (``bf = 0``); recurrent state is fp32. Batch 1, contiguous rows.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;


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
#define VXC_ABI_VERSION 11


int vxc_abi_version(void) { return VXC_ABI_VERSION; }

int vxc_has_avx512bf16(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------ shared: GEMV dot products */

/* Four dot products W[r] . x of length K (rows ``rows`` <= 4 of a block starting at w0, stride K).
 * Each iteration also prefetches the same columns of the next block of four rows (the next 4 x 64 bytes this
 * thread streams): the hardware prefetcher alone leaves the bf16 GEMV at ~20 GB/s here, with it ~23
 * (measured over 0.9 GB of qwen3-0.6b-shaped matrices, 2 threads); a prefetch past the matrix's end is a hint
 * that cannot fault. */
#define PREFETCH_NEXT(w, k) _mm_prefetch((const char *)((w) + 4 * K + (k)), _MM_HINT_T0)
static inline void dot4_bf16(const bf16_t *w0, const bf16_t *x, long K, long rows, float acc[4]) {
#if defined(__AVX512BF16__)
    if (rows == 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const bf16_t *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        long k = 0;
        for (; k + 32 <= K; k += 32) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + k));
            PREFETCH_NEXT(w0, k);
            PREFETCH_NEXT(w1, k);
            PREFETCH_NEXT(w2, k);
            PREFETCH_NEXT(w3, k);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(w0 + k)), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(w1 + k)), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512((const void *)(w2 + k)), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512((const void *)(w3 + k)), xv);
        }
        if (k < K) {
            __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + k);
            a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, w0 + k), xv);
            a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, w1 + k), xv);
            a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_maskz_loadu_epi16(m, w2 + k), xv);
            a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_maskz_loadu_epi16(m, w3 + k), xv);
        }
        acc[0] = _mm512_reduce_add_ps(a0);
        acc[1] = _mm512_reduce_add_ps(a1);
        acc[2] = _mm512_reduce_add_ps(a2);
        acc[3] = _mm512_reduce_add_ps(a3);
        return;
    }
#endif
    for (long r = 0; r < rows; r++) {
        const bf16_t *w = w0 + r * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long k = 0; k < K; k++) s += bf2f(w[k]) * bf2f(x[k]);
        acc[r] = s;
    }
}

static inline void dot4_f32(const float *w0, const float *x, long K, long rows, float acc[4]) {
#if defined(__AVX512F__)
    if (rows == 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const float *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        long k = 0;
        for (; k + 16 <= K; k += 16) {
            __m512 xv = _mm512_loadu_ps(x + k);
            PREFETCH_NEXT(w0, k);
            PREFETCH_NEXT(w1, k);
            PREFETCH_NEXT(w2, k);
            PREFETCH_NEXT(w3, k);
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + k), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + k), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + k), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w3 + k), xv, a3);
        }
        if (k < K) {
            __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
            __m512 xv = _mm512_maskz_loadu_ps(m, x + k);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w0 + k), xv, a0);
            a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w1 + k), xv, a1);
            a2 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w2 + k), xv, a2);
            a3 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, w3 + k), xv, a3);
        }
        acc[0] = _mm512_reduce_add_ps(a0);
        acc[1] = _mm512_reduce_add_ps(a1);
        acc[2] = _mm512_reduce_add_ps(a2);
        acc[3] = _mm512_reduce_add_ps(a3);
        return;
    }
#endif
    for (long r = 0; r < rows; r++) {
        const float *w = w0 + r * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (long k = 0; k < K; k++) s += w[k] * x[k];
        acc[r] = s;
    }
}

static inline void dot4(const void *W, const void *x, long n0, long K, long rows, int bf, float acc[4]) {
    if (bf) dot4_bf16((const bf16_t *)W + n0 * K, (const bf16_t *)x, K, rows, acc);
    else dot4_f32((const float *)W + n0 * K, (const float *)x, K, rows, acc);
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
 * (an fp32 sum of squares put gpt_oss-mxfp4's logits 2.4x the floor from fp64 on one CPU and not another). */
static inline double rms_inv(const float *v, long n, float eps) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) ss += (double)v[i] * (double)v[i];
    return 1.0 / sqrt(ss / (double)n + (double)eps);
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

/* the embedding twin for T ids: out[t] = table[ids[t]] (rows of D elements of esize bytes). */
void vxc_embedding(const int64_t *ids, const void *table, void *out, long T, long D, long esize) {
    for (long t = 0; t < T; t++)
        memcpy((char *)out + t * D * esize, (const char *)table + ids[t] * D * esize, (size_t)(D * esize));
}

/* --------------------------------------------------------------------------------------- norms (norms.py) */

/* the add_rmsnorm twin over T rows of width D. x, out: activation dtype; residual (may be NULL) and
 * new_residual: fp32 when res_f32 else the activation dtype; weight: w_bf selects bf16 / fp32. */
void vxc_add_rmsnorm(const void *x, const void *residual, const void *weight, void *out, void *new_residual,
                     long T, long D, float eps, int zero_centred, int res_f32, int bf, int w_bf) {
    int rbf = res_f32 ? 0 : bf;
#pragma omp parallel if (T * D >= 32768)
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
            load_row(x, t * D, D, bf, r);
            if (residual) {
                load_row(residual, t * D, D, rbf, r2);
#pragma omp simd
                for (long i = 0; i < D; i++) r[i] += r2[i];
            }
            if (rbf) round_row(r, D);
            store_row(new_residual, t * D, D, rbf, r);
            double inv = rms_inv(r, D, eps);
            if (zero_centred || !bf) {
#pragma omp simd
                for (long i = 0; i < D; i++) r[i] = (float)((double)r[i] * inv * (double)w[i]);
            } else {
#pragma omp simd
                for (long i = 0; i < D; i++) r[i] = w[i] * bf2f(f2bf((float)((double)r[i] * inv)));
            }
            store_row(out, t * D, D, bf, r);
        }
        free(r);
    }
}

/* the gated_rmsnorm twin over T rows of width D in groups of G channels; act 1 silu, 2 sigmoid.
 * x and z may be row-strided views (row strides sx, sz elements; e.g. slices of one projection); out is
 * contiguous [T, D]. */
void vxc_gated_rmsnorm(const void *x, const void *z, const void *weight, void *out, long T, long D, long G,
                       float eps, int norm_before_gate, int a, int bf, int w_bf, long sx, long sz) {
#pragma omp parallel if (T * D >= 32768)
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

/* the conv1d_step twin: x [C], weight [C, K], bias [C] or NULL, state [C, K] (oldest first; s_bf: its
 * dtype), out [C]; act 0 none, 1 silu. */
void vxc_conv1d_step(const void *x, const void *weight, const void *bias, void *state, void *out, long C, long K,
                     int a, int bf, int w_bf, int s_bf) {
#pragma omp parallel for schedule(static) if (C >= 8192)
    for (long c = 0; c < C; c++) {
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

/* the ssd_step twin: x [H, P], dt [H], B, C [G, N] (activation dtype); A_log, D, dt_bias [H] (w_bf);
 * state [H, P, N] fp32, updated in place in one pass that also forms y = state C + D x. */
void vxc_ssd_step(const void *x, const void *dt, const void *A_log, const void *B, const void *Cm, const void *Dv,
                  const void *dt_bias, float dt_min, float dt_max, int clamp, float *state, void *out, long H, long P,
                  long G, long N, int bf, int w_bf) {
    long per_group = H / G;
#pragma omp parallel for schedule(static)
    for (long h = 0; h < H; h++) {
        float b[1024], cc[1024]; /* N <= 1024, checked by the caller */
        long g = h / per_group;
        for (long n = 0; n < N; n++) {
            b[n] = ld(B, g * N + n, bf);
            cc[n] = ld(Cm, g * N + n, bf);
        }
        float d = softplus(ld(dt, h, bf) + ld(dt_bias, h, w_bf));
        if (clamp) d = d < dt_min ? dt_min : (d > dt_max ? dt_max : d);
        float decay = expf(d * -expf(ld(A_log, h, w_bf)));
        float Dh = ld(Dv, h, w_bf);
        for (long p = 0; p < P; p++) {
            float xv = ld(x, h * P + p, bf);
            float dx = d * xv;
            float *s = state + (h * P + p) * N;
            float y = 0.0f;
#pragma omp simd reduction(+ : y)
            for (long n = 0; n < N; n++) {
                float v = s[n] * decay + dx * b[n];
                s[n] = v;
                y += v * cc[n];
            }
            st(out, h * P + p, y + Dh * xv, bf);
        }
    }
}

/* ------------------------------------------------------------------------------- attention (attention.py) */

/* the rotary twin for x [T, H, Dh] with tables cos, sin [T, R/2] (c_bf: their dtype): the first R dims of
 * each head rotate in pairs (i, i + R/2) or (2i, 2i + 1), the rest pass through. */
void vxc_rotary(const void *x, const void *cos_t, const void *sin_t, void *out, long T, long H, long Dh, long R,
                int interleaved, int bf, int c_bf) {
    long half = R / 2;
    /* one (token, head) row at a time through fp32 scratch: contiguous vector loads for the half-split layout */
#pragma omp parallel for schedule(static) if (T * H * Dh >= 65536)
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
void vxc_attention_step(const void *q, const void *k, const void *v, void *k_cache, void *v_cache, void *out,
                        long start, float scale, long Hq, long Hkv, long Dk, long Dv, float *scratch, long rows,
                        long window, const void *sinks, int s_bf, int bf) {
    long es = bf ? 2 : 4, group = Hq / Hkv, row = start % rows;
    long lo = window > 0 && start - window + 1 > 0 ? start - window + 1 : 0, S = start - lo + 1;
    memcpy((char *)k_cache + row * Hkv * Dk * es, k, (size_t)(Hkv * Dk * es));
    memcpy((char *)v_cache + row * Hkv * Dv * es, v, (size_t)(Hkv * Dv * es));
#pragma omp parallel for schedule(static) if (S * Hq * Dk >= 32768)
    for (long h = 0; h < Hq; h++) {
        long g = h / group;
        float qv[1024], acc[1024]; /* Dk, Dv <= 1024, checked by the caller */
        float *p = scratch + h * rows;
        for (long d = 0; d < Dk; d++) qv[d] = ld(q, h * Dk + d, bf);
        float mx = sinks ? ld(sinks, h, s_bf) : -INFINITY;
        for (long i = 0; i < S; i++) {
            p[i] = dot_row(qv, k_cache, (((lo + i) % rows) * Hkv + g) * Dk, Dk, bf) * scale;
            if (p[i] > mx) mx = p[i];
        }
        float den = sinks ? expf(ld(sinks, h, s_bf) - mx) : 0.0f;
        for (long i = 0; i < S; i++) {
            p[i] = expf(p[i] - mx);
            den += p[i];
        }
        for (long d = 0; d < Dv; d++) acc[d] = 0.0f;
        for (long i = 0; i < S; i++) axpy_row(acc, p[i] / den, v_cache, (((lo + i) % rows) * Hkv + g) * Dv, Dv, bf);
        for (long d = 0; d < Dv; d++) st(out, h * Dv + d, acc[d], bf);
    }
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
void vxc_delta_step(const void *q, const void *k, const void *v, const void *a, const void *b, const void *A_log,
                    const void *dt_bias, float *state, void *o, long Hk, long Hv, long Dk, long Dv, float scale,
                    float l2_eps, int kda, int bf, int w_bf) {
#pragma omp parallel for schedule(static)
    for (long h = 0; h < Hv; h++) {
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
}

/* delta.sigmoid_gate_mul_twin: out = x * sigmoid(gate) over n values (both at the activation dtype). */
void vxc_sigmoid_gate_mul(const void *x, const void *gate, void *out, long n, int bf) {
    for (long i = 0; i < n; i++) st(out, i, ld(x, i, bf) * sigm(ld(gate, i, bf)), bf);
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
 * (cache_bf). Writes the latent row (plain-weight rmsnorm of kv[:R], rounded as the twin materialises it at the
 * activation dtype, then the rotated rope key) into cache row ``start``; then per head the absorbed attention
 * over cache rows 0..start: q_lat = q_nope · W_k, logits = (q_lat · c_s + q_pe · k_pe_s) · scale, softmax,
 * o_lat = Σ p_s c_s, out = W_v · o_lat; out [H, V] at the activation dtype. R, N + P, V <= 1024. */
void vxc_mla_decode(const void *q, const void *kv, const void *norm_w, const void *w_kvb, const void *cos_t,
                    const void *sin_t, void *cache, void *out, long H, long N, long P, long V, long R, long start,
                    float eps, float scale, int interleaved, int split_out, int bf, int nw_bf, int w_bf, int c_bf,
                    int cache_bf) {
    long width = R + P, half = P / 2;
    float c[1024], sn[1024], row[2048];
    if (cos_t) { load_row(cos_t, 0, half, c_bf, c); load_row(sin_t, 0, half, c_bf, sn); }
    load_row(kv, 0, width, bf, row);
    double inv = rms_inv(row, R, eps);
    for (long i = 0; i < R; i++) row[i] = rnd(rnd(ld(norm_w, i, nw_bf), bf) * rnd((float)((double)row[i] * inv), bf), bf);
    if (cos_t) mla_rope(row + R, P, c, sn, interleaved, split_out);
    store_row(cache, start * width, width, cache_bf, row);
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
                float acc = dot_row(qlat, cache, t * width, R, cache_bf), acc2 = dot_row(qh + N, cache, t * width + R, P, cache_bf);
                logit[t] = (acc + acc2) * scale;
                m = logit[t] > m ? logit[t] : m;
            }
            float z = 0.0f;
            for (long t = 0; t < S; t++) { logit[t] = expf(logit[t] - m); z += logit[t]; }
            for (long r = 0; r < R; r++) olat[r] = 0.0f;
            for (long t = 0; t < S; t++) axpy_row(olat, logit[t] / z, cache, t * width, R, cache_bf);
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

/* moe.experts_twin / moe.shared_twin for one token (T = 1): the k selected experts in ascending id order, each
 * y_e = down(act(gate x, up x)) (+ biases), accumulated as acc += y_e * weight_e onto acc = init (the routed sum
 * for the shared expert, else 0), then rounded once to the activation dtype.
 *   x [d]; experts int64 [k] (NULL: expert 0) and weights fp32 [k] (NULL: 1, or sigmoid(branch . x) when
 *   branch_gate [d] is given); banks: w_in [E, rows, d] (rows = I, or 2I interleaved gate/up when fused),
 *   w_up [E, I, d] or NULL (fused), w_down [E, d, I]; expert strides se_in, se_up, se_down (elements; each
 *   expert's matrix is contiguous); b_in [E, rows] / b_down [E, d] or NULL; act 1 silu(g)·u, 3 clamped GLU
 *   (g = min(g, limit), u = clamp(u, ±limit), (u + 1)·g·σ(αg)).
 * Rounding as the twin materialises values at the activation dtype (bf): each GEMV output, and the activation
 * fed to the down GEMV; biases and the weighted sum stay fp32. */
void vxc_moe_ffn_step(const void *x, const int64_t *experts, const float *weights, long k, const void *w_in,
                      const void *w_up, const void *w_down, const void *b_in, const void *b_down,
                      const void *branch_gate, const void *init, void *out, long d, long I, long se_in, long se_up,
                      long se_down, int fused, int a, float alpha, float limit, int bf) {
    long order[64];
    float wts[64];
    long kk = k < 64 ? k : 64;
    for (long s = 0; s < kk; s++) {
        order[s] = experts ? experts[s] : 0;
        wts[s] = weights ? weights[s] : 1.0f;
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
                float g[4], u[4];
                if (fused) {
                    float gu[4];
                    dot4(Wi, x, 2 * j0, d, 2 * n, bf, gu);
                    for (long r = 0; r < n; r++) {
                        g[r] = rnd(gu[2 * r], bf);
                        u[r] = rnd(gu[2 * r + 1], bf);
                        if (b_in) {
                            g[r] += ld(b_in, e * rows_in + 2 * (j0 + r), bf);
                            u[r] += ld(b_in, e * rows_in + 2 * (j0 + r) + 1, bf);
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
                    st(h, j0 + r, v, bf);
                }
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
