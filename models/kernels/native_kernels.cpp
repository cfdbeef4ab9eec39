/* decodelab's CPU kernels for weight-only int8 / int4 projections and decode attention
   (x86 with AVX2, FMA and F16C). What each computes, and why: models/native.py. Built with
   torch.utils.cpp_extension (as C++, -O3 -mavx2 -mfma -mf16c -fopenmp) together with
   native_ops.cpp, which registers them as torch operators; plain C in style, C linkage. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>


extern "C" {

/* How many weight rows ahead the one-row kernels fetch: far enough ahead to cover the memory's
   latency (experiments/README.md, "Batch-1 decode at the memory roofline") */
#define ROWS_AHEAD 16
/* How far ahead of the codes they read the int4 attention's key and value loops fetch (bytes;
   experiments/README.md, "KV caches at long context", session 46, has what it bought). */
#define KEYS_AHEAD 4096
#define VALUES_AHEAD 8192

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The four sums of a, b, c, d's lanes. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 x = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

#define CVT8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))

/* y[M, N] = x[M, K] @ (w[N, K] * scale[N])^T; K % 8 == 0. Four output rows at a time,
   two activation rows at a time; four rows ROWS_AHEAD ahead are prefetched while these run. */
void dl_int8_mm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N) {
    int64_t nb = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t o0 = b * 4, R = N - o0 < 4 ? N - o0 : 4;
        const int8_t* w0 = w + o0 * K;
        const int8_t* w1 = w0 + (R > 1 ? K : 0);
        const int8_t* w2 = w0 + (R > 2 ? 2 * K : 0);
        const int8_t* w3 = w0 + (R > 3 ? 3 * K : 0);
        /* the four rows ROWS_AHEAD ahead (the last blocks prefetch themselves) */
        const char* next = (const char*)(o0 + 4 + ROWS_AHEAD <= N ? w0 + ROWS_AHEAD * K : w0);
        int64_t m = 0;
        for (; m + 2 <= M; m += 2) {
            const float* xa = x + m * K;
            const float* xb = xa + K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                if (m == 0 && (k & 15) == 0) _mm_prefetch(next + 4 * k, _MM_HINT_T0);
                __m256 xva = _mm256_loadu_ps(xa + k), xvb = _mm256_loadu_ps(xb + k);
                __m256 v0 = CVT8(w0 + k), v1 = CVT8(w1 + k), v2 = CVT8(w2 + k), v3 = CVT8(w3 + k);
                a0 = _mm256_fmadd_ps(v0, xva, a0); b0 = _mm256_fmadd_ps(v0, xvb, b0);
                a1 = _mm256_fmadd_ps(v1, xva, a1); b1 = _mm256_fmadd_ps(v1, xvb, b1);
                a2 = _mm256_fmadd_ps(v2, xva, a2); b2 = _mm256_fmadd_ps(v2, xvb, b2);
                a3 = _mm256_fmadd_ps(v3, xva, a3); b3 = _mm256_fmadd_ps(v3, xvb, b3);
            }
            float ra[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            float rb[4] = {hsum(b0), hsum(b1), hsum(b2), hsum(b3)};
            for (int64_t r = 0; r < R; r++) {
                y[m * N + o0 + r] = ra[r] * scale[o0 + r];
                y[(m + 1) * N + o0 + r] = rb[r] * scale[o0 + r];
            }
        }
        for (; m < M; m++) {
            const float* xa = x + m * K;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t k = 0; k < K; k += 8) {
                if (m == 0 && (k & 15) == 0) _mm_prefetch(next + 4 * k, _MM_HINT_T0);
                __m256 xva = _mm256_loadu_ps(xa + k);
                a0 = _mm256_fmadd_ps(CVT8(w0 + k), xva, a0);
                a1 = _mm256_fmadd_ps(CVT8(w1 + k), xva, a1);
                a2 = _mm256_fmadd_ps(CVT8(w2 + k), xva, a2);
                a3 = _mm256_fmadd_ps(CVT8(w3 + k), xva, a3);
            }
            float ra[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int64_t r = 0; r < R; r++) y[m * N + o0 + r] = ra[r] * scale[o0 + r];
        }
    }
}

/* Per-thread scratch that lives across calls (no allocation per product): slot `slot`'s buffer
   of at least `bytes` bytes, 64-byte aligned, grown on demand; NULL when out of memory. Other
   threads may read it through the pointer while its owner waits for them. */
static void* scratch(int slot, size_t bytes) {
    static __thread void* buf[4] = {NULL, NULL, NULL, NULL};
    static __thread size_t cap[4] = {0, 0, 0, 0};
    if (bytes == 0) bytes = 64;  /* an empty product still gets a buffer (NULL means out of memory) */
    if (bytes > cap[slot]) {
        free(buf[slot]);
        size_t n = (bytes + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, n);
        cap[slot] = buf[slot] ? n : 0;
    }
    return buf[slot];
}

/* acc[0, N) (+)= x[k0..k1) @ w[k0..k1, 0..N): the weight's rows read in order, four at a time
   (four sequential streams, the sums in acc, in L1/L2); N % 8 == 0. `init`: acc is written
   by the first four rows instead of added to. */
static inline void f32_rows(const float* x, int64_t k0, int64_t k1, const float* w, int64_t N, float* acc,
                            int init) {
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
        const float* w0 = w + k * N;
        const float* w1 = w0 + N;
        const float* w2 = w1 + N;
        const float* w3 = w2 + N;
        __m256 x0 = _mm256_set1_ps(x[k]), x1 = _mm256_set1_ps(x[k + 1]), x2 = _mm256_set1_ps(x[k + 2]),
               x3 = _mm256_set1_ps(x[k + 3]);
        int first = init && k == k0;
        for (int64_t n = 0; n < N; n += 8) {
            __m256 a = _mm256_mul_ps(x0, _mm256_loadu_ps(w0 + n));
            __m256 b = _mm256_mul_ps(x1, _mm256_loadu_ps(w1 + n));
            a = _mm256_fmadd_ps(x2, _mm256_loadu_ps(w2 + n), a);
            b = _mm256_fmadd_ps(x3, _mm256_loadu_ps(w3 + n), b);
            a = _mm256_add_ps(a, b);
            _mm256_storeu_ps(acc + n, first ? a : _mm256_add_ps(_mm256_loadu_ps(acc + n), a));
        }
    }
    for (; k < k1; k++) {
        const float* w0 = w + k * N;
        __m256 x0 = _mm256_set1_ps(x[k]);
        int first = init && k == k0;
        for (int64_t n = 0; n < N; n += 8) {
            __m256 a = _mm256_mul_ps(x0, _mm256_loadu_ps(w0 + n));
            _mm256_storeu_ps(acc + n, first ? a : _mm256_add_ps(_mm256_loadu_ps(acc + n), a));
        }
    }
}

/* y[N] = x[K] @ w[K, N] (+ bias): the one-row product of an fp32 projection stored [in, out]
   (a decode step). Each thread streams a contiguous block of the weight's rows (K split
   evenly in multiples of 4) into its own partial sums, then the partials are added in
   thread order, each thread a slice of the columns; N % 8 == 0, K >= 1. The result depends
   on the thread count (the split), never on the data. Returns 0, or -1 when out of memory. */
int dl_f32_mv(const float* x, int64_t K, const float* w, int64_t N, const float* bias, float* y) {
    int T = omp_get_max_threads();
    if (T > K / 4) T = (int)(K / 4) > 0 ? (int)(K / 4) : 1;
    int failed = 0;
    float* parts[256];
    if (T > 256) T = 256;
    #pragma omp parallel num_threads(T)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t rows = (K / nt + 3) / 4 * 4;
        int64_t k0 = t * rows < K ? t * rows : K, k1 = (t + 1) * rows < K ? (t + 1) * rows : K;
        if (t == nt - 1) k1 = K;
        float* acc = t == 0 ? y : (float*)scratch(0, (size_t)N * sizeof(float));
        parts[t] = acc;
        if (!acc) {
            #pragma omp atomic write
            failed = 1;
        } else if (k1 > k0) {
            f32_rows(x, k0, k1, w, N, acc, 1);
        } else {
            for (int64_t n = 0; n < N; n++) acc[n] = 0.f;
        }
        #pragma omp barrier
        if (!failed) {
            int64_t cols = (N / nt + 7) / 8 * 8;
            int64_t c0 = t * cols < N ? t * cols : N, c1 = (t + 1) * cols < N ? (t + 1) * cols : N;
            if (t == nt - 1) c1 = N;
            for (int64_t n = c0; n < c1; n += 8) {
                __m256 s = _mm256_loadu_ps(y + n);
                for (int u = 1; u < nt; u++) s = _mm256_add_ps(s, _mm256_loadu_ps(parts[u] + n));
                if (bias) s = _mm256_add_ps(s, _mm256_loadu_ps(bias + n));
                _mm256_storeu_ps(y + n, s);
            }
        }
    }
    return failed ? -1 : 0;
}

/* An int4 row's accumulator plus the shifts' share of it, lane by lane before the row's one
   horizontal sum: lane i gains sh[j + i] * xs[j + i] (fused) for each 8 groups j from 0, lanes
   past G gain 0 x 0. Every int4 kernel adds it this way, in 8-lane fused multiply-adds whatever
   its instruction set, so its rows stay bit-identical across kernels; the groups' products run
   8 at a time instead of a scalar chain per row. */
static inline __attribute__((always_inline)) __m256 q4_shifts(__m256 acc, const float* sh, const float* xs,
                                                                int64_t G) {
    int64_t j = 0;
    for (; j + 8 <= G; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(sh + j), _mm256_loadu_ps(xs + j), acc);
    if (j < G) {
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(G - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(sh + j, m), _mm256_maskload_ps(xs + j, m), acc);
    }
    return acc;
}

/* The int4 kernels take their codes two 32-channel blocks (b, b + 1) at a time: one 32-byte
   load holds both blocks' codes, its low nibbles their channels 0-15 and its high nibbles their
   channels 16-31 (`pack_int4`'s layout), so the activation codes are paired the same way: xl =
   block b's channels 0-15 then block b + 1's, xh = their channels 16-31. */
static inline __attribute__((always_inline)) void q4_xpair(const int8_t* xq, int64_t b, __m256i* xl, __m256i* xh) {
    __m256i u = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
    __m256i v = _mm256_loadu_si256((const __m256i*)(xq + b * 32 + 32));
    *xl = _mm256_permute2x128_si256(u, v, 0x20);
    *xh = _mm256_permute2x128_si256(u, v, 0x31);
}

/* The activation scales of a block pair by lane: lanes 0-3 block b's, 4-7 block b + 1's. */
static inline __attribute__((always_inline)) __m256 q4_dpair(const float* dx, int64_t b) {
    return _mm256_set_m128(_mm_set1_ps(dx[b + 1]), _mm_set1_ps(dx[b]));
}

/* The float factor of a block pair's eight integer lanes: lanes 0-3 (block b) the scale of b's
   group times b's activation scale, lanes 4-7 the same for block b + 1 (d: `q4_dpair`; gi[b]:
   block b's group, a table built once per product, so the loops divide nothing). */
static inline __attribute__((always_inline)) __m256 q4_factor(const float* sc, int64_t b, const int32_t* gi,
                                                                __m256 d) {
    int32_t j = gi[b], j2 = gi[b + 1];
    __m256 s = j == j2 ? _mm256_set1_ps(sc[j]) : _mm256_set_m128(_mm_set1_ps(sc[j2]), _mm_set1_ps(sc[j]));
    return _mm256_mul_ps(s, d);
}

/* The integer sums of a block pair: lane i (0-3: block b, 4-7: block b + 1) sums the products
   of 4 channels of the low nibbles and 4 of the high nibbles (maddubs pairs never exceed
   2 x 15 x 127, nor their sum int16). */
static inline __attribute__((always_inline)) __m256i q4_pair(const uint8_t* w, __m256i xl, __m256i xh) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i v = _mm256_loadu_si256((const __m256i*)w);
    __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(v, mask), xl);
    __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask), xh);
    return _mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1));
}

/* One int4 output row against MC (1..4) activation rows, a block pair per step: each row's
   sum in q4_rows4's order (so a row's result does not depend on M). */
static inline __attribute__((always_inline)) void q4_row(const int8_t* xq, const float* dx, const float* xs,
        int64_t m0, const int MC, int64_t K, const uint8_t* wr, const float* sc, const float* sh, int64_t G,
        const int32_t* gi, float* y, int64_t N, int64_t o) {
    int64_t B = K / 32;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < B; b += 2) {
        for (int i = 0; i < MC; i++) {
            __m256i xl, xh;
            q4_xpair(xq + (m0 + i) * K, b, &xl, &xh);
            __m256i p = q4_pair(wr + b * 16, xl, xh);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), q4_factor(sc, b, gi, q4_dpair(dx + (m0 + i) * B, b)),
                                     acc[i]);
        }
    }
    for (int i = 0; i < MC; i++) y[(m0 + i) * N + o] = hsum(q4_shifts(acc[i], sh, xs + (m0 + i) * G, G));
}

/* Fetch the codes, scales and shifts of the four int4 rows ROWS_AHEAD after row o while rows
   o .. o + 3 run, at block step b (their own line each two steps; the last rows fetch
   themselves). Shared by the AVX2 and VNNI one-row kernels. */
static inline __attribute__((always_inline)) void q4_fetch_ahead(const uint8_t* nib, const float* scale,
        const float* shift, int64_t H, int64_t G, int64_t o, int64_t N, int64_t b) {
    if (b & 3) return;
    int64_t nx = o + 4 + ROWS_AHEAD <= N ? o + ROWS_AHEAD : o;
    const char* pn = (const char*)(nib + nx * H);
    for (int r = 0; r < 4; r++) _mm_prefetch(pn + r * H + b * 16, _MM_HINT_T0);
    int64_t at = b / 4 * 64;
    if (at < 4 * G * (int64_t)sizeof(float)) {
        _mm_prefetch((const char*)(scale + nx * G) + at, _MM_HINT_T0);
        _mm_prefetch((const char*)(shift + nx * G) + at, _MM_HINT_T0);
    }
}

/* Four int4 output rows o .. o + 3 against one activation row (a decode step): q4_row's
   arithmetic for each row, in the same order, the four rows' sums interleaved and the
   activation pair loaded once. */
static inline __attribute__((always_inline)) void q4_rows4(const int8_t* xq, const float* dx, const float* xs,
        int64_t K, const uint8_t* nib, const float* scale, const float* shift, int64_t G, const int32_t* gi,
        float* y, int64_t o, int64_t N) {
    int64_t B = K / 32, H = K / 2;
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; b += 2) {
        q4_fetch_ahead(nib, scale, shift, H, G, o, N, b);
        __m256i xl, xh;
        q4_xpair(xq, b, &xl, &xh);
        __m256 d = q4_dpair(dx, b);
        for (int r = 0; r < 4; r++) {
            __m256i p = q4_pair(nib + (o + r) * H + b * 16, xl, xh);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), q4_factor(scale + (o + r) * G, b, gi, d), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) y[o + r] = hsum(q4_shifts(acc[r], shift + (o + r) * G, xs, G));
}

/* The instruction set the kernels that have a choice use: 0 = AVX2 (every CPU these kernels
   build for), 1 = AVX-512 with VNNI (Zen 4/5, Xeons since Cascade Lake), where the CPU has
   it. `set` >= 0 asks for that level (capped at what the CPU has; tests compare the two);
   returns the level in use. The two compute bit-identical results. */
static int isa_have(void) {
#ifdef DL_EMULATED_AVX512  /* tests: the AVX-512 forms run on SIMDe's emulation of them (below) */
    return 1;
#else
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") ? 1 : 0;
#endif
}

static int isa_use = -1;  /* set when the library loads (below), before any kernel runs */

__attribute__((constructor)) static void isa_init(void) { isa_use = isa_have(); }

int dl_isa(int set) {
    static int have = -1;
    if (have < 0) have = isa_have();
    if (set >= 0) isa_use = set < have ? set : have;
    return isa_use;
}

/* DL_EMULATED_AVX512: tests/models/test_native_mv.py compiles the int4 products (up to the
   line that ends them, below) with SIMDe's portable AVX-512 on a CPU without AVX-512, to
   hold the VNNI form bit-identical to the AVX2 one there too. */
#ifdef DL_EMULATED_AVX512
#define VNNI
#else
#define VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#endif

/* q4_rows4 with AVX-512 VNNI: two output rows per 512-bit register (row r in lanes 0-7, row
   r + 1 in 8-15), each half q4_rows4's eight lanes: the same integer sums (vpdpbusd over the
   low nibbles, then the high ones), the same factor and fused multiply-add lane by lane, so
   the results are bit-identical to the AVX2 kernel's. */
static VNNI void q4_rows4_vnni(const int8_t* xq, const float* dx, const float* xs, int64_t K, const uint8_t* nib,
                               const float* scale, const float* shift, int64_t G, const int32_t* gi, float* y, int64_t o,
                               int64_t N) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    int64_t B = K / 32, H = K / 2;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t b = 0; b < B; b += 2) {
        q4_fetch_ahead(nib, scale, shift, H, G, o, N, b);
        __m256i xl, xh;
        q4_xpair(xq, b, &xl, &xh);
        __m512i xl2 = _mm512_inserti64x4(_mm512_castsi256_si512(xl), xl, 1);
        __m512i xh2 = _mm512_inserti64x4(_mm512_castsi256_si512(xh), xh, 1);
        __m256 d = q4_dpair(dx, b);
        for (int r = 0; r < 4; r += 2) {
            const uint8_t* w = nib + (o + r) * H + b * 16;
            __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)w)),
                                           _mm256_loadu_si256((const __m256i*)(w + H)), 1);
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, mask), xl2);
            p = _mm512_dpbusd_epi32(p, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask), xh2);
            __m512 f = _mm512_insertf32x8(_mm512_castps256_ps512(q4_factor(scale + (o + r) * G, b, gi, d)),
                                          q4_factor(scale + (o + r + 1) * G, b, gi, d), 1);
            acc[r / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), f, acc[r / 2]);
        }
    }
    for (int r = 0; r < 4; r++) {  /* each row's half, then q4_rows4's shifts and sum */
        __m256 a = r % 2 ? _mm512_extractf32x8_ps(acc[r / 2], 1) : _mm512_castps512_ps256(acc[r / 2]);
        y[o + r] = hsum(q4_shifts(a, shift + (o + r) * G, xs, G));
    }
}

/* One activation row x[K] as int8 codes per 32 channels: xq = round-half-even(x * 127 / absmax),
   dx = absmax / 127 (codes 0 where the block is all zero), xs = the row's sum per group of g
   (summed in 8 lanes, then across them). Vectorized; the codes are what lrintf gives. */
static inline void q8_row(const float* p, int64_t K, int64_t g, int8_t* xq, float* dx, float* xs) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < K / 32; b++) {
        const float* q = p + b * 32;
        __m256 v0 = _mm256_loadu_ps(q), v1 = _mm256_loadu_ps(q + 8), v2 = _mm256_loadu_ps(q + 16),
               v3 = _mm256_loadu_ps(q + 24);
        __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float mx = _mm_cvtss_f32(h);
        float id = mx > 0.f ? 127.f / mx : 0.f;
        dx[b] = mx / 127.f;
        __m256 s = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, s)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, s));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, s)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, s));
        /* packs work per 128-bit lane: dwords come out as i0 lo, i1 lo, i2 lo, i3 lo, i0 hi, ...; reorder */
        __m256i c = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        _mm256_storeu_si256((__m256i*)(xq + b * 32), _mm256_permutevar8x32_epi32(c, order));
    }
    for (int64_t j = 0; j < K / g; j++) {
        __m256 s = _mm256_setzero_ps();
        for (int64_t k = 0; k < g; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(p + j * g + k));
        xs[j] = hsum(s);
    }
}

/* y[M, N] = x[M, K] @ W^T, W[o, k] = code * scale[o, k / g] + shift[o, k / g]; x quantized to
   int8 per 32 channels here. K % 64 == 0, g % 32 == 0, K % g == 0. Returns 0, or -1 when
   out of memory. */
int dl_int4_mm(const float* x, int64_t M, int64_t K, const uint8_t* nib, const float* scale, const float* shift,
               int64_t g, float* y, int64_t N) {
    int64_t G = K / g, B = K / 32, bpg = g / 32;
    /* the activation codes, block scales, group sums and each block's group: the calling
       thread's scratch */
    size_t qb = (size_t)(M * K + 63) / 64 * 64, db = sizeof(float) * (size_t)(M * B),
           sb = sizeof(float) * (size_t)(M * G);
    char* buf = (char*)scratch(1, qb + db + sb + sizeof(int32_t) * (size_t)B);
    if (!buf) return -1;
    int8_t* xq = (int8_t*)buf;
    float* dx = (float*)(buf + qb);
    float* xs = (float*)(buf + qb + db);
    int32_t* gi = (int32_t*)(buf + qb + db + sb);
    for (int64_t b = 0; b < B; b++) gi[b] = (int32_t)(b / bpg);
    for (int64_t m = 0; m < M; m++) q8_row(x + m * K, K, g, xq + m * K, dx + m * B, xs + m * G);
    if (M == 1) {  /* a decode step: four output rows at a time, the rest one by one */
        int64_t N4 = N / 4 * 4;
        if (dl_isa(-1) >= 1) {
            #pragma omp parallel for schedule(static)
            for (int64_t o = 0; o < N4; o += 4) q4_rows4_vnni(xq, dx, xs, K, nib, scale, shift, G, gi, y, o, N4);
        } else {
            #pragma omp parallel for schedule(static)
            for (int64_t o = 0; o < N4; o += 4) q4_rows4(xq, dx, xs, K, nib, scale, shift, G, gi, y, o, N4);
        }
        for (int64_t o = N4; o < N; o++)
            q4_row(xq, dx, xs, 0, 1, K, nib + o * (K / 2), scale + o * G, shift + o * G, G, gi, y, N, o);
        return 0;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        const uint8_t* wr = nib + o * (K / 2);
        const float* sc = scale + o * G;
        const float* sh = shift + o * G;
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) q4_row(xq, dx, xs, m0, 4, K, wr, sc, sh, G, gi, y, N, o);
        switch (M - m0) {
            case 1: q4_row(xq, dx, xs, m0, 1, K, wr, sc, sh, G, gi, y, N, o); break;
            case 2: q4_row(xq, dx, xs, m0, 2, K, wr, sc, sh, G, gi, y, N, o); break;
            case 3: q4_row(xq, dx, xs, m0, 3, K, wr, sc, sh, G, gi, y, N, o); break;
        }
    }
    return 0;
}

/* -- the end of the int4 products (what DL_EMULATED_AVX512 builds) -- */

/* Merge the flash-decoding partials part[(r * C + c) * g + j] = (max, sum, unnormalized
   output [D]) of `rows` (b, kv head, t) x C chunks x g query heads into out [B, Hq, T, D]:
   each chunk rescaled to the common max; a query that saw no slot gets zeros. */
static void merge_parts(const float* part, int64_t rows, int64_t C, int64_t g, int64_t T, int64_t Hkv, int64_t Hq,
                        int64_t D, float* out) {
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r % T, hk = (r / T) % Hkv, b = r / (T * Hkv);
        for (int64_t j = 0; j < g; j++) {
            float* o = out + ((b * Hq + hk * g + j) * T + t) * D;
            float mx = -INFINITY, sum = 0.f;
            for (int64_t c = 0; c < C; c++) {
                float m = part[((r * C + c) * g + j) * (D + 2)];
                if (m > mx) mx = m;
            }
            for (int64_t d = 0; d < D; d++) o[d] = 0.f;
            if (mx == -INFINITY) continue;  /* no slot seen: zeros */
            for (int64_t c = 0; c < C; c++) {
                const float* pr = part + ((r * C + c) * g + j) * (D + 2);
                if (pr[0] == -INFINITY) continue;
                float f = expf(pr[0] - mx);
                sum += f * pr[1];
                for (int64_t d = 0; d < D; d++) o[d] += f * pr[2 + d];
            }
            float inv = 1.f / sum;
            for (int64_t d = 0; d < D; d++) o[d] *= inv;
        }
    }
}

/* e^x for 8 lanes (Cephes' expf: range reduction by ln 2, a degree-5 polynomial, within
   2 ulp of expf); x below -87.3, -inf included, gives 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* e[i] <- exp(e[i] - mx) for i < n; returns their sum. */
static inline float exp_sum(float* e, int64_t n, float mx) {
    __m256 m = _mm256_set1_ps(mx), acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + i), m));
        _mm256_storeu_ps(e + i, v);
        acc = _mm256_add_ps(acc, v);
    }
    float sum = hsum(acc);
    for (; i < n; i++) { e[i] = expf(e[i] - mx); sum += e[i]; }
    return sum;
}

/* 8 stored K/V elements from element i of p, as fp32: KIND 0 fp32, 1 bf16, 2 fp16, 3 fp8
   e4m3 (exact: normals by moving the exponent, subnormals m x 2^-9, the sign or'ed in). */
static inline __attribute__((always_inline)) __m256 kv8(const void* p, int64_t i, const int KIND) {
    if (KIND == 0) return _mm256_loadu_ps((const float*)p + i);
    if (KIND == 3) {
        __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)((const uint8_t*)p + i)));
        __m256i em = _mm256_and_si256(x, _mm256_set1_epi32(0x7F));
        __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
        __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(0x07))),
                                   _mm256_set1_ps(1.f / 512.f));
        __m256i is_sub = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
        __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
        return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24)));
    }
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    if (KIND == 2) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* One work item of dl_decode_attn: kv head hk of row b, query t, the seen slots [c0, c1);
   the partials pr [g, D + 2] (max, sum, unnormalized output). */
static inline __attribute__((always_inline)) void decode_item(const int KIND, const float* q, const void* kh,
        const void* vh, const int64_t* tb, int64_t bs, int64_t b, int64_t hk, int64_t t, int64_t Hq, int64_t T,
        int64_t D, int64_t g, int64_t c0, int64_t c1, float scale, float vscale, float* sc, int64_t span,
        float* pr) {
    /* a position of no block (-1) reads block 0, as the gather does: past the row's length */
#define DL_SLOT(s) (tb ? ((tb[(s) / bs] > 0 ? tb[(s) / bs] : 0) * bs + (s) % bs) * D : (s) * D)
    /* scores, four slots at a time (four independent sums per query head, one hadd tree) */
    int64_t s = c0;
    const int64_t esize = KIND == 0 ? 4 : KIND == 3 ? 1 : 2, row = D * esize;
    for (; s + 4 <= c1; s += 4) {
        int64_t a0 = DL_SLOT(s), a1 = DL_SLOT(s + 1), a2 = DL_SLOT(s + 2), a3 = DL_SLOT(s + 3);
        /* the keys 16 slots ahead; the values are left to the hardware's prefetcher (what fetching
           them here too cost: experiments/README.md, "Batch-1 decode at the memory roofline") */
        for (int r = 0; r < 4 && s + 16 + r < c1; r++) {
            const char* kp = (const char*)kh + DL_SLOT(s + 16 + r) * esize;
            for (int64_t off = 0; off < row; off += 64) _mm_prefetch(kp + off, _MM_HINT_T0);
        }
        for (int64_t j = 0; j < g; j++) {
            const float* qr = q + ((b * Hq + hk * g + j) * T + t) * D;
            __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0;
            for (int64_t d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(qr + d);
                x0 = _mm256_fmadd_ps(qv, kv8(kh, a0 + d, KIND), x0);
                x1 = _mm256_fmadd_ps(qv, kv8(kh, a1 + d, KIND), x1);
                x2 = _mm256_fmadd_ps(qv, kv8(kh, a2 + d, KIND), x2);
                x3 = _mm256_fmadd_ps(qv, kv8(kh, a3 + d, KIND), x3);
            }
            _mm_storeu_ps(sc + j * span + (s - c0), _mm_mul_ps(hsum4(x0, x1, x2, x3), _mm_set1_ps(scale)));
        }
    }
    for (; s < c1; s++) {
        int64_t at = DL_SLOT(s);
        for (int64_t j = 0; j < g; j++) {
            const float* qr = q + ((b * Hq + hk * g + j) * T + t) * D;
            __m256 a = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), kv8(kh, at + d, KIND), a);
            sc[j * span + (s - c0)] = hsum(a) * scale;
        }
    }
    int64_t n = c1 - c0;
    for (int64_t j = 0; j < g; j++) {
        const float* e = sc + j * span;
        __m256 m8 = _mm256_set1_ps(-INFINITY);
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(e + i));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        for (; i < n; i++) mx = e[i] > mx ? e[i] : mx;
        pr[j * (D + 2)] = mx;
        pr[j * (D + 2) + 1] = exp_sum(sc + j * span, n, mx);
    }
    /* values: per query head, 64 output dims held in registers across the slots */
    for (int64_t j = 0; j < g; j++) {
        float* o = pr + j * (D + 2) + 2;
        const float* w = sc + j * span;
        for (int64_t d0 = 0; d0 < D; d0 += 64) {
            int64_t nd = D - d0 < 64 ? (D - d0) / 8 : 8;
            __m256 acc[8];
            for (int u = 0; u < 8; u++) acc[u] = _mm256_setzero_ps();
            for (int64_t s2 = c0; s2 < c1; s2++) {
                int64_t at = DL_SLOT(s2) + d0;
                __m256 wv = _mm256_set1_ps(w[s2 - c0] * vscale);
                if (nd == 8) {
                    for (int u = 0; u < 8; u++) acc[u] = _mm256_fmadd_ps(wv, kv8(vh, at + 8 * u, KIND), acc[u]);
                } else {
                    for (int u = 0; u < nd; u++) acc[u] = _mm256_fmadd_ps(wv, kv8(vh, at + 8 * u, KIND), acc[u]);
                }
            }
            for (int u = 0; u < nd; u++) _mm256_storeu_ps(o + d0 + 8 * u, acc[u]);
        }
    }
#undef DL_SLOT
}

/* Attention of decode-shaped queries over a row-major cache: out[b, h, t] = softmax over the
   slots s this query sees (s <= pos[b, t], and s > pos[b, t] - window where window > 0) of
   (q[b, h, t] . k[b, h / g, s]) * scale, times v[b, h / g, s], g = Hq / Hkv; computed in fp32.
   q, out [B, Hq, T, D]; k, v [B, Hkv, S, D]; D % 8 == 0. Only the seen slots are read, each
   once for the g query heads that share it. The work: (b, kv head, t) x C chunks of the seen
   slots (C so that every thread gets work), each chunk's softmax taken against its own max;
   the chunks then merge exactly (flash-decoding). Returns 0, or -1 when out of memory. */
/* table (may be NULL): a paged cache's block table [B, M] (int64); then k, v are the block
   pools [Hkv, N, bs, D] and slot s of row b lives in block table[b, s / bs] at offset s % bs
   (S = M x bs; an entry of -1, no block, reads block 0); without it k, v are row-major
   [B, Hkv, S, D]. kind: how K and V are stored (0 fp32, 1 bf16, 2 fp16, 3 fp8 e4m3; `kv8`);
   kv head hk's keys are read times kscale[hk] and its values times vscale[hk] (NULL: 1),
   folded into the scores and the softmax weights. */
int dl_decode_attn(const float* q, const void* k, const void* v, const int64_t* pos, int64_t B, int64_t Hq,
                   int64_t Hkv, int64_t T, int64_t S, int64_t D, float scale, int64_t window, float* out,
                   const int64_t* table, int64_t M, int64_t bs, int64_t N, int kind, const float* kscale,
                   const float* vscale) {
    int64_t g = Hq / Hkv, rows = B * Hkv * T, threads = omp_get_max_threads();
    int64_t esize = kind == 0 ? 4 : kind == 3 ? 1 : 2;
    int64_t C = (2 * threads + rows - 1) / rows;
    if (C > 16) C = 16;
    if (C < 1) C = 1;
    /* per (row, chunk, query head): max, sum, unnormalized output [D] */
    float* part = (float*)scratch(2, sizeof(float) * (size_t)(rows * C * g * (D + 2)));
    int64_t span = S / C + 2;
    int failed = part ? 0 : 1;
    if (failed) return -1;
    #pragma omp parallel
    {
        float* sc = (float*)scratch(3, sizeof(float) * (size_t)(g * span));  /* each thread's own */
        if (!sc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < rows * C; it++) {
            if (!sc) continue;
            int64_t c = it % C, r = it / C, t = r % T, hk = (r / T) % Hkv, b = r / (T * Hkv);
            int64_t p = pos[b * T + t], hi = (p < S - 1 ? p : S - 1) + 1, lo = 0;
            if (window > 0 && p - window + 1 > 0) lo = p - window + 1;
            int64_t n = hi > lo ? hi - lo : 0;
            int64_t c0 = lo + n * c / C, c1 = lo + n * (c + 1) / C;
            const char* kh = (const char*)k + (table ? hk * N * bs * D : (b * Hkv + hk) * S * D) * esize;
            const char* vh = (const char*)v + (table ? hk * N * bs * D : (b * Hkv + hk) * S * D) * esize;
            const int64_t* tb = table ? table + b * M : NULL;
            float* pr = part + it * g * (D + 2);
            for (int64_t j = 0; j < g; j++) {
                float* o = pr + j * (D + 2);
                o[0] = -INFINITY; o[1] = 0.f;
                for (int64_t d = 0; d < D; d++) o[2 + d] = 0.f;
            }
            if (c1 <= c0) continue;
            float ks = scale * (kscale ? kscale[hk] : 1.f), vs = vscale ? vscale[hk] : 1.f;
            switch (kind) {
                case 0: decode_item(0, q, kh, vh, tb, bs, b, hk, t, Hq, T, D, g, c0, c1, ks, vs, sc, span, pr); break;
                case 1: decode_item(1, q, kh, vh, tb, bs, b, hk, t, Hq, T, D, g, c0, c1, ks, vs, sc, span, pr); break;
                case 2: decode_item(2, q, kh, vh, tb, bs, b, hk, t, Hq, T, D, g, c0, c1, ks, vs, sc, span, pr); break;
                default: decode_item(3, q, kh, vh, tb, bs, b, hk, t, Hq, T, D, g, c0, c1, ks, vs, sc, span, pr);
            }
        }
    }
    if (!failed) merge_parts(part, rows, C, g, T, Hkv, Hq, D, out);
    return failed ? -1 : 0;
}

/* Scales and shifts of an int4 cache as stored (scale_dtype: kind 0 fp16, 1 bf16, 2 fp32), as fp32. */
static inline __m256 scale8(const void* p, int kind, int64_t i) {
    if (kind == 2) return _mm256_loadu_ps((const float*)p + i);
    __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)p + i));
    if (kind == 0) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline float scale1(const void* p, int kind, int64_t i) {
    if (kind == 2) return ((const float*)p)[i];
    uint16_t h = ((const uint16_t*)p)[i];
    if (kind == 0) return _cvtsh_ss(h);
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)h << 16;
    return x.f;
}

/* 8 codes (0..15) as fp32: the low (hi = 0) or high (hi = 1) nibbles of 8 bytes at p. */
static inline __m256 nib8(const uint8_t* p, int hi) {
    __m128i v = _mm_loadl_epi64((const __m128i*)p);
    if (hi) v = _mm_srli_epi16(v, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(0x0F))));
}

/* o_j[r .. r + 8) += sum_s wv[j, s] code_lo(s) and o_j[r + VR ..) += sum_s wv[j, s] code_hi(s)
   over n tokens whose codes for this group lie at row + s * step (bytes r .. r + 8 of each),
   for JN (1..4) query heads: wv [JN, ws] (stride ws), o_j = o + j * os. */
static inline __attribute__((always_inline)) void value_cols(const int JN, const uint8_t* row, int64_t step,
        int64_t n, const float* wv, int64_t ws, float* o, int64_t os, int64_t VR) {
    __m256 lo[4], hi[4];
    for (int j = 0; j < 4; j++) lo[j] = hi[j] = _mm256_setzero_ps();
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int64_t s = 0; s < n; s++) {
        _mm_prefetch((const char*)(row + s * step) + VALUES_AHEAD, _MM_HINT_T0);
        __m128i v = _mm_loadl_epi64((const __m128i*)(row + s * step));
        __m256 cl = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, mask)));
        __m256 ch = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), mask)));
        for (int j = 0; j < JN; j++) {
            __m256 w = _mm256_broadcast_ss(wv + j * ws + s);
            lo[j] = _mm256_fmadd_ps(w, cl, lo[j]);
            hi[j] = _mm256_fmadd_ps(w, ch, hi[j]);
        }
    }
    for (int j = 0; j < JN; j++) {
        float* oj = o + j * os;
        _mm256_storeu_ps(oj, _mm256_add_ps(_mm256_loadu_ps(oj), lo[j]));
        _mm256_storeu_ps(oj + VR, _mm256_add_ps(_mm256_loadu_ps(oj + VR), hi[j]));
    }
}

/* The max of x[0 .. n), -inf for n = 0. */
static inline float max_of(const float* x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    float r = _mm_cvtss_f32(h);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

/* What one work item of dl_int4_decode_attn reads and writes, shared by its AVX2 and AVX-512 halves. */
typedef struct {
    const float* qh;  /* query head j of the kv head at qh + j * T * D */
    int64_t T, D, g, KG, VG, NV;
    const uint8_t* kd;  /* this kv head's key codes [N/KG, KG/2, D] */
    const void *ks, *ko;  /* the layer's key scales and shifts; this head's at element kso */
    int64_t kso;
    const uint8_t* vd;  /* this kv head's value codes [N, NV, VG/2] */
    const void *vs, *vo;  /* the layer's value scales and shifts; this head's at element vso */
    int64_t vso;
    int skind;
    float scale;
    int64_t pa, pb;  /* the quantized positions of this item */
    float* sc;  /* scores of query head j at sc + j * span, the quantized ones first */
    int64_t span;  /* the stride of sc and of the [g, ...] and [NV, ...] scratch arrays */
    float* pr;  /* per query head: max, sum, output [D] (stride D + 2) */
    float* tmp;  /* scratch: [g, D] + [g] + [g, span] + 2 [NV, span] + [g] floats */
    float* fold;  /* scratch: D floats (fold_query_int16) */
} Int4Item;

/* The query folded with key group `blk`'s scales, for the integer key scores (int4_keys_int):
   per query head j, q' = (q scale) x the group's scales, rounded to int16 as
   q16 = rne(q' x (32767 / max|q'|)) (0 where q' is all 0), laid out in qp [j, D / 2] as the
   two dwords of each 4 channels c.. c + 3: (q16_c, q16_{c+2}), (q16_{c+1}, q16_{c+3}); its step
   dx[j] = max|q'| / 32767; and qo[j] = sum_d (q_d scale) shift_d. The same code on every
   instruction set (so the scores are bit-identical across them); qf: D floats of scratch. */
static void fold_query_int16(const Int4Item* it, int64_t blk, int32_t* qp, float* dx, float* qo, float* qf) {
    int64_t D = it->D;
    const __m256 sv = _mm256_set1_ps(it->scale), sign = _mm256_set1_ps(-0.0f);
    const __m128i order = _mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    for (int64_t j = 0; j < it->g; j++) {
        const float* qr = it->qh + j * it->T * D;
        __m256 a = _mm256_setzero_ps(), mx = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
            __m256 qv = _mm256_mul_ps(_mm256_loadu_ps(qr + d), sv);
            __m256 qs = _mm256_mul_ps(qv, scale8(it->ks, it->skind, it->kso + blk * D + d));
            _mm256_storeu_ps(qf + d, qs);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, qs));
            a = _mm256_fmadd_ps(qv, scale8(it->ko, it->skind, it->kso + blk * D + d), a);
        }
        qo[j] = hsum(a);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        __m256 inv = _mm256_set1_ps(amax > 0.f ? 32767.0f / amax : 0.f);
        dx[j] = amax / 32767.0f;
        int32_t* o = qp + j * (D / 2);
        for (int64_t d = 0; d < D; d += 8) {  /* channels d.. d + 7: words q_d, q_{d+2}, q_{d+1}, q_{d+3}, then d + 4.. */
            __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qf + d), inv));
            __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            _mm_storeu_si128((__m128i*)(o + d / 2), _mm_shuffle_epi8(w, order));
        }
    }
}

extern "C++" {  /* templates (the blocks per number of query heads) within the C linkage */

/* q16 of channel c from a folded query's dwords (fold_query_int16's layout) */
static inline int32_t q16_at(const int32_t* qp, int64_t c) {
    int32_t w = qp[(c / 4) * 2 + (c & 1)];
    return (c & 2) ? (int32_t)(int16_t)((uint32_t)w >> 16) : (int32_t)(int16_t)(w & 0xFFFF);
}

/* The 4 channels' codes of a dword column (byte c.. c + 3 of 8 or 16 tokens, one token a
   32-bit lane) dotted with JN query heads: the words (code_c, code_{c+2}) and
   (code_{c+1}, code_{c+3}) of the low nibbles (tokens r..) and of the high ones (r + KR..)
   times qp's two dwords, summed in int32 (pmaddwd: exact, so any order gives the same sums). */
#define KEY_COLUMN_INT(MADD, ADD, AND, SRL, SET1, V, QP)                                                  \
    do {                                                                                                  \
        auto l0 = AND(V, m), l1 = AND(SRL(V, 8), m), h0 = AND(SRL(V, 4), m), h1 = SRL(V, 12);              \
        for (int j = 0; j < JN; j++) {                                                                    \
            auto qa = SET1((QP)[j * qps]), qb = SET1((QP)[j * qps + 1]);                                  \
            al[j] = ADD(al[j], ADD(MADD(l0, qa), MADD(l1, qb)));                                          \
            ah[j] = ADD(ah[j], ADD(MADD(h0, qa), MADD(h1, qb)));                                          \
        }                                                                                                 \
    } while (0)

/* Integer scores of 8 byte rows [r, r + 8) of a key group (rows at kg, D bytes each) against
   JN query heads (qp: fold_query_int16's dwords, head j at qp + j * qps): 32 channels at a
   time, the 8 rows' dwords transposed in registers (8 x 8), so each lane is a token; channels
   past the last multiple of 32 added in scalar. Scores dx[j] isum + qo[j] to lo[j * ss + r ..]
   (low nibbles, tokens r..) and hi[j * ss + r ..] (high, r + KR ..). */
template <int JN>
static inline __attribute__((always_inline)) void key_block_i256(const uint8_t* kg, int64_t r, const int32_t* qp,
        int64_t qps, const float* dx, const float* qo, int64_t D, float* lo, float* hi, int64_t ss) {
    __m256i al[4], ah[4];
    for (int j = 0; j < 4; j++) al[j] = ah[j] = _mm256_setzero_si256();
    const __m256i m = _mm256_set1_epi16(0x000F);
    int64_t D32 = D / 32 * 32;
    for (int64_t c0 = 0; c0 < D32; c0 += 32) {
        __m256i x[8], t[8];
        if (c0 % 64 == 0)
            for (int i = 0; i < 8; i++) _mm_prefetch((const char*)(kg + (r + i) * D + c0) + KEYS_AHEAD, _MM_HINT_T0);
        for (int i = 0; i < 8; i++) x[i] = _mm256_loadu_si256((const __m256i*)(kg + (r + i) * D + c0));
        for (int i = 0; i < 4; i++) {  /* rows 2i, 2i + 1 interleaved by dwords */
            t[2 * i] = _mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
        }
        for (int Q = 0; Q < 2; Q++) {  /* x[4Q + k], 128-bit lane L: dword column 4L + k of rows 4Q .. 4Q + 3 */
            x[4 * Q] = _mm256_unpacklo_epi64(t[4 * Q], t[4 * Q + 2]);
            x[4 * Q + 1] = _mm256_unpackhi_epi64(t[4 * Q], t[4 * Q + 2]);
            x[4 * Q + 2] = _mm256_unpacklo_epi64(t[4 * Q + 1], t[4 * Q + 3]);
            x[4 * Q + 3] = _mm256_unpackhi_epi64(t[4 * Q + 1], t[4 * Q + 3]);
        }
        for (int k = 0; k < 4; k++) {  /* columns k and 4 + k: lane i = row i */
            __m256i v0 = _mm256_permute2x128_si256(x[k], x[4 + k], 0x20);
            __m256i v1 = _mm256_permute2x128_si256(x[k], x[4 + k], 0x31);
            KEY_COLUMN_INT(_mm256_madd_epi16, _mm256_add_epi32, _mm256_and_si256, _mm256_srli_epi16,
                           _mm256_set1_epi32, v0, qp + (c0 / 4 + k) * 2);
            KEY_COLUMN_INT(_mm256_madd_epi16, _mm256_add_epi32, _mm256_and_si256, _mm256_srli_epi16,
                           _mm256_set1_epi32, v1, qp + (c0 / 4 + 4 + k) * 2);
        }
    }
    if (D32 < D) {  /* the last D % 32 channels */
        int32_t sl[4][8], sh[4][8];
        for (int j = 0; j < JN; j++) {
            _mm256_storeu_si256((__m256i*)sl[j], al[j]);
            _mm256_storeu_si256((__m256i*)sh[j], ah[j]);
        }
        for (int i = 0; i < 8; i++)
            for (int64_t c = D32; c < D; c++) {
                int32_t b = kg[(r + i) * D + c];
                for (int j = 0; j < JN; j++) {
                    int32_t w = q16_at(qp + j * qps, c);
                    sl[j][i] += w * (b & 15);
                    sh[j][i] += w * (b >> 4);
                }
            }
        for (int j = 0; j < JN; j++) {
            al[j] = _mm256_loadu_si256((const __m256i*)sl[j]);
            ah[j] = _mm256_loadu_si256((const __m256i*)sh[j]);
        }
    }
    for (int j = 0; j < JN; j++) {
        __m256 d = _mm256_set1_ps(dx[j]), o = _mm256_set1_ps(qo[j]);
        _mm256_storeu_ps(lo + j * ss + r, _mm256_fmadd_ps(_mm256_cvtepi32_ps(al[j]), d, o));
        _mm256_storeu_ps(hi + j * ss + r, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ah[j]), d, o));
    }
}

template <int JN>
static VNNI void key_block_i512(const uint8_t* kg, int64_t r, const int32_t* qp, int64_t qps, const float* dx,
                                const float* qo, int64_t D, float* lo, float* hi, int64_t ss);

/* Quantized keys: scores sc[j, s - pa] of the positions [pa, pb), as integer dot products. Per
   key group the query is folded with the group's scales and rounded to int16 (fold_query_int16),
   then whole blocks of 8 byte rows (or 16 with W: AVX-512 VNNI, D % 64 == 0) are dotted with
   up to 4 query heads at once. It writes the scores of whole blocks, so also those of up to
   KG - 1 positions either side of [pa, pb): sc has KG floats of margin there (Int4Item.sc), and
   what lands past pb is overwritten or never read. The integer sums are exact, so W = 0 and
   W = 1 give bit-identical scores. */
template <int W>
static inline __attribute__((always_inline)) void int4_keys_int(const Int4Item* it) {
    int64_t D = it->D, g = it->g, KG = it->KG, KR = KG / 2, pa = it->pa, pb = it->pb, span = it->span;
    int32_t* qp = (int32_t*)it->tmp;  /* [g, D / 2] */
    float *dx = it->tmp + g * D / 2, *qo = it->tmp + g * D, *sc = it->sc;
    float* qf = (float*)it->fold;
    int wide = W && D % 64 == 0;
    int64_t RB = wide ? 16 : 8, qps = D / 2;
    for (int64_t blk = pa / KG; blk * KG < pb; blk++) {
        fold_query_int16(it, blk, qp, dx, qo, qf);
        /* rows r whose token blk KG + r or blk KG + r + KR lies in [pa, pb), from a block start */
        int64_t base = blk * KG, x = pa - base, y = pb - base;
        int64_t r0 = x - KR > 0 ? x - KR : 0, r1 = y < KR ? y : KR;
        r0 = r0 / RB * RB;
        const uint8_t* kg = it->kd + blk * KR * D;
        for (int64_t j0 = 0; j0 < g; j0 += 4) {
            int jn = g - j0 < 4 ? (int)(g - j0) : 4;
            const int32_t* q = qp + j0 * qps;
            float* lo = sc + j0 * span + (base - pa);
            for (int64_t r = r0; r < r1; r += RB) {
                if (wide) {
                    switch (jn) {
                        case 1: key_block_i512<1>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        case 2: key_block_i512<2>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        case 3: key_block_i512<3>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        default: key_block_i512<4>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                    }
                } else {
                    switch (jn) {
                        case 1: key_block_i256<1>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        case 2: key_block_i256<2>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        case 3: key_block_i256<3>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                        default: key_block_i256<4>(kg, r, q, qps, dx + j0, qo + j0, D, lo, lo + KR, span); break;
                    }
                }
            }
        }
    }
}

}  /* extern "C++" */

static void int4_keys_avx2(const Int4Item* it) { int4_keys_int<0>(it); }

/* Quantized values, AVX2: pr's outputs += sum over [pa, pb) of the (unnormalized) weights in
   sc times each value; per token and channel group the weights times the token's scale (wv),
   the shifts' term per group (added to its channels at the end), then the codes column block
   by column block. */
static void int4_values_avx2(const Int4Item* it) {
    int64_t D = it->D, g = it->g, VG = it->VG, VR = VG / 2, NV = it->NV, pa = it->pa, pb = it->pb, span = it->span;
    int64_t n = pb - pa;
    float *wv = it->tmp + g * D + g, *f = wv + g * span + 2 * NV * span, *sc = it->sc, *pr = it->pr;
    for (int64_t gi = 0; gi < NV; gi++) {
        for (int64_t j = 0; j < g; j++) f[j] = 0.f;
        for (int64_t s = pa; s < pb; s++) {
            int64_t at = it->vso + s * NV + gi;
            float vsc = scale1(it->vs, it->skind, at), vof = scale1(it->vo, it->skind, at);
            for (int64_t j = 0; j < g; j++) {
                float w = sc[j * span + (s - pa)];
                wv[j * span + (s - pa)] = w * vsc;
                f[j] += w * vof;
            }
        }
        for (int64_t j = 0; j < g; j++) {
            float* o = pr + j * (D + 2) + 2 + gi * VG;
            for (int64_t d = 0; d < VG; d++) o[d] += f[j];
        }
        const uint8_t* rows0 = it->vd + (pa * NV + gi) * VR;
        for (int64_t r = 0; r < VR; r += 8)
            for (int64_t j0 = 0; j0 < g; j0 += 4) {
                int jn = g - j0 < 4 ? (int)(g - j0) : 4;
                float* o = pr + j0 * (D + 2) + 2 + gi * VG + r;
                const float* w = wv + j0 * span;
                switch (jn) {
                    case 1: value_cols(1, rows0 + r, NV * VR, n, w, span, o, D + 2, VR); break;
                    case 2: value_cols(2, rows0 + r, NV * VR, n, w, span, o, D + 2, VR); break;
                    case 3: value_cols(3, rows0 + r, NV * VR, n, w, span, o, D + 2, VR); break;
                    default: value_cols(4, rows0 + r, NV * VR, n, w, span, o, D + 2, VR); break;
                }
            }
    }
}

#define AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))


/* 16 scales or shifts of an int4 cache from element i (scale8's, 16 wide) */
static inline AVX512 __m512 scale16(const void* p, int kind, int64_t i) {
    if (kind == 2) return _mm512_loadu_ps((const float*)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)p + i));
    if (kind == 0) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* The sums of v[0 .. 8)'s lanes, in that order: folded half against half, quarter against
   quarter, then within each 128-bit lane (24 instructions for the 8 sums). */
static inline AVX512 __m256 hsum8_512(const __m512* v) {
    __m512 u[4], w[2];
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)  /* quarter k: v[4 i + k] folded to 4 lanes */
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    __m512 z = _mm512_add_ps(_mm512_unpacklo_ps(w[0], w[1]), _mm512_unpackhi_ps(w[0], w[1]));
    z = _mm512_add_ps(z, _mm512_shuffle_ps(z, z, 0x4E));  /* quarter k: lane 0 sum v[k], lane 1 sum v[4 + k] */
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0,
                                                                          0), z));
}

extern "C++" {
/* key_block_i256 for 16 byte rows [r, r + 16) with AVX-512 VNNI (D % 64 == 0): 64 channels
   at a time, the 16 rows' dwords transposed in registers (16 x 16: dwords, quads, then 128-bit
   lanes twice), each lane a token, and vpdpwssd for pmaddwd + add: the same integer sums. */
template <int JN>
static VNNI void key_block_i512(const uint8_t* kg, int64_t r, const int32_t* qp, int64_t qps, const float* dx,
                                const float* qo, int64_t D, float* lo, float* hi, int64_t ss) {
    __m512i al[4], ah[4], bl[4], bh[4];  /* two accumulators each (shorter vpdpwssd chains) */
    for (int j = 0; j < 4; j++) al[j] = ah[j] = bl[j] = bh[j] = _mm512_setzero_si512();
    const __m512i m = _mm512_set1_epi16(0x000F);
#define KEY_COLUMN_512(V, QP)                                                                         \
    do {                                                                                              \
        __m512i l0 = _mm512_and_si512(V, m), l1 = _mm512_and_si512(_mm512_srli_epi16(V, 8), m);      \
        __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(V, 4), m), h1 = _mm512_srli_epi16(V, 12);    \
        for (int j = 0; j < JN; j++) {                                                                \
            __m512i qa = _mm512_set1_epi32((QP)[j * qps]), qb = _mm512_set1_epi32((QP)[j * qps + 1]); \
            al[j] = _mm512_dpwssd_epi32(al[j], l0, qa);                                               \
            bl[j] = _mm512_dpwssd_epi32(bl[j], l1, qb);                                               \
            ah[j] = _mm512_dpwssd_epi32(ah[j], h0, qa);                                               \
            bh[j] = _mm512_dpwssd_epi32(bh[j], h1, qb);                                               \
        }                                                                                             \
    } while (0)
    for (int64_t c0 = 0; c0 < D; c0 += 64) {
        __m512i x[16], t[16];
        for (int i = 0; i < 16; i++) _mm_prefetch((const char*)(kg + (r + i) * D + c0) + KEYS_AHEAD, _MM_HINT_T0);
        for (int i = 0; i < 16; i++) x[i] = _mm512_loadu_si512((const void*)(kg + (r + i) * D + c0));
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
        }
        for (int Q = 0; Q < 4; Q++) {  /* x[4Q + k], lane L: dword column 4L + k of rows 4Q .. 4Q + 3 */
            x[4 * Q] = _mm512_unpacklo_epi64(t[4 * Q], t[4 * Q + 2]);
            x[4 * Q + 1] = _mm512_unpackhi_epi64(t[4 * Q], t[4 * Q + 2]);
            x[4 * Q + 2] = _mm512_unpacklo_epi64(t[4 * Q + 1], t[4 * Q + 3]);
            x[4 * Q + 3] = _mm512_unpackhi_epi64(t[4 * Q + 1], t[4 * Q + 3]);
        }
        for (int k = 0; k < 4; k++) {  /* lanes L of x[k], x[4 + k], x[8 + k], x[12 + k]: column 4L + k */
            __m512i s0 = _mm512_shuffle_i32x4(x[k], x[4 + k], 0x44), s1 = _mm512_shuffle_i32x4(x[k], x[4 + k], 0xEE);
            __m512i s2 = _mm512_shuffle_i32x4(x[8 + k], x[12 + k], 0x44);
            __m512i s3 = _mm512_shuffle_i32x4(x[8 + k], x[12 + k], 0xEE);
            __m512i v0 = _mm512_shuffle_i32x4(s0, s2, 0x88), v1 = _mm512_shuffle_i32x4(s0, s2, 0xDD);
            __m512i v2 = _mm512_shuffle_i32x4(s1, s3, 0x88), v3 = _mm512_shuffle_i32x4(s1, s3, 0xDD);
            const int32_t* q = qp + (c0 / 4 + k) * 2;
            KEY_COLUMN_512(v0, q);
            KEY_COLUMN_512(v1, q + 8);
            KEY_COLUMN_512(v2, q + 16);
            KEY_COLUMN_512(v3, q + 24);
        }
    }
#undef KEY_COLUMN_512
    for (int j = 0; j < JN; j++) {
        __m512 d = _mm512_set1_ps(dx[j]), o = _mm512_set1_ps(qo[j]);
        al[j] = _mm512_add_epi32(al[j], bl[j]);
        ah[j] = _mm512_add_epi32(ah[j], bh[j]);
        _mm512_storeu_ps(lo + j * ss + r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(al[j]), d, o));
        _mm512_storeu_ps(hi + j * ss + r, _mm512_fmadd_ps(_mm512_cvtepi32_ps(ah[j]), d, o));
    }
}
}  /* extern "C++" */

/* exp8, 16 lanes */
static inline AVX512 __m512 exp16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(-87.3f);
    __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, y, _mm512_castsi512_ps(e));
}

/* exp_sum, 16 lanes (not inlined: called from code built without AVX-512) */
static AVX512 float exp_sum512(float* e, int64_t n, float mx) {
    __m512 m = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = exp16(_mm512_sub_ps(_mm512_loadu_ps(e + i), m));
        _mm512_storeu_ps(e + i, v);
        acc = _mm512_add_ps(acc, v);
    }
    if (i < n) {
        __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
        __m512 v = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, e + i), m)));
        _mm512_mask_storeu_ps(e + i, k, v);
        acc = _mm512_add_ps(acc, v);
    }
    return _mm512_reduce_add_ps(acc);
}

/* Exact keys [s0, s1) (rows of D floats at ke + s D) against JN (1..4) query heads qh + j qs
   (D % 16 == 0): two tokens a step, 8 sums reduced together; score x scale to sc[j * ss + s - s0]. */
static inline AVX512 __attribute__((always_inline)) void exact_keys512(const int JN, const float* ke, int64_t s0,
        int64_t s1, const float* qh, int64_t qs, int64_t D, float scale, float* sc, int64_t ss) {
    __m256 sv = _mm256_set1_ps(scale);
    for (int64_t s = s0; s < s1; s += 2) {
        const float *k0 = ke + s * D, *k1 = s + 1 < s1 ? k0 + D : k0;
        __m512 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
            __m512 x0 = _mm512_loadu_ps(k0 + d), x1 = _mm512_loadu_ps(k1 + d);
            for (int j = 0; j < JN; j++) {
                __m512 qv = _mm512_loadu_ps(qh + j * qs + d);
                a[j] = _mm512_fmadd_ps(x0, qv, a[j]);
                a[4 + j] = _mm512_fmadd_ps(x1, qv, a[4 + j]);
            }
        }
        float l[8];
        _mm256_storeu_ps(l, _mm256_mul_ps(hsum8_512(a), sv));
        for (int j = 0; j < JN; j++) {
            sc[j * ss + (s - s0)] = l[j];
            if (s + 1 < s1) sc[j * ss + (s + 1 - s0)] = l[4 + j];
        }
    }
}

/* Exact values [s0, s1) (rows of D floats at ve + s D) weighted by w[j * ss + s - s0] into
   o + j * os (j < JN <= 4; D % 16 == 0): 16 channels at a time, the sums kept in registers. */
static inline AVX512 __attribute__((always_inline)) void exact_values512(const int JN, const float* ve, int64_t s0,
        int64_t s1, const float* w, int64_t ss, int64_t D, float* o, int64_t os) {
    for (int64_t d = 0; d < D; d += 16) {
        __m512 a[4];
        for (int j = 0; j < 4; j++) a[j] = _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s++) {
            __m512 x = _mm512_loadu_ps(ve + s * D + d);
            for (int j = 0; j < JN; j++) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(w[j * ss + (s - s0)]), x, a[j]);
        }
        for (int j = 0; j < JN; j++) _mm512_storeu_ps(o + j * os + d, _mm512_add_ps(_mm512_loadu_ps(o + j * os + d), a[j]));
    }
}

/* The exact part of an int4 item, 512 bits wide: scores of [s0, s1) (ke rows, sc from column
   0), or (values) the weights in sc times the ve rows into pr's outputs; g heads, 4 at a time. */
static AVX512 void int4_exact_512(const Int4Item* it, int values, const float* rows, int64_t s0, int64_t s1,
                                  float* sc) {
    int64_t D = it->D, g = it->g, ss = it->span;
    for (int64_t j0 = 0; j0 < g; j0 += 4) {
        int jn = g - j0 < 4 ? (int)(g - j0) : 4;
        if (values) {
            float* o = it->pr + j0 * (D + 2) + 2;
            const float* w = sc + j0 * ss;
            switch (jn) {
                case 1: exact_values512(1, rows, s0, s1, w, ss, D, o, D + 2); break;
                case 2: exact_values512(2, rows, s0, s1, w, ss, D, o, D + 2); break;
                case 3: exact_values512(3, rows, s0, s1, w, ss, D, o, D + 2); break;
                default: exact_values512(4, rows, s0, s1, w, ss, D, o, D + 2); break;
            }
        } else {
            const float* qh = it->qh + j0 * it->T * D;
            float* out = sc + j0 * ss;
            switch (jn) {
                case 1: exact_keys512(1, rows, s0, s1, qh, it->T * D, D, it->scale, out, ss); break;
                case 2: exact_keys512(2, rows, s0, s1, qh, it->T * D, D, it->scale, out, ss); break;
                case 3: exact_keys512(3, rows, s0, s1, qh, it->T * D, D, it->scale, out, ss); break;
                default: exact_keys512(4, rows, s0, s1, qh, it->T * D, D, it->scale, out, ss); break;
            }
        }
    }
}

static VNNI void int4_keys_512(const Int4Item* it) { int4_keys_int<1>(it); }

/* value_cols with 512-bit vectors: 16 P bytes of each token's row (P = 1: bytes r .. r + 16,
   channels r.. and r + VR..; P = 2: also the next 16 bytes), each weight broadcast once. */
static inline AVX512 __attribute__((always_inline)) void value_cols512(const int JN, const int P, const uint8_t* row,
        int64_t step, int64_t n, const float* wv, int64_t ws, float* o, int64_t os, int64_t VR) {
    __m512 acc[4][4];  /* [head][piece lo, piece hi, piece 2 lo, piece 2 hi] */
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
    const __m512i mask = _mm512_set1_epi32(0x0F);
    for (int64_t s = 0; s < n; s++) {
        __m512 c[4];
        _mm_prefetch((const char*)(row + s * step) + VALUES_AHEAD, _MM_HINT_T0);
        for (int i = 0; i < P; i++) {
            __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + s * step + 16 * i)));
            c[2 * i] = _mm512_cvtepi32_ps(_mm512_and_si512(b, mask));
            c[2 * i + 1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
        }
        for (int j = 0; j < JN; j++) {
            __m512 w = _mm512_set1_ps(wv[j * ws + s]);
            for (int i = 0; i < 2 * P; i++) acc[j][i] = _mm512_fmadd_ps(w, c[i], acc[j][i]);
        }
    }
    for (int j = 0; j < JN; j++) {
        float* oj = o + j * os;
        for (int i = 0; i < P; i++) {
            _mm512_storeu_ps(oj + 16 * i, _mm512_add_ps(_mm512_loadu_ps(oj + 16 * i), acc[j][2 * i]));
            _mm512_storeu_ps(oj + VR + 16 * i, _mm512_add_ps(_mm512_loadu_ps(oj + VR + 16 * i), acc[j][2 * i + 1]));
        }
    }
}

/* int4_values_avx2 with 512-bit vectors (VG % 32 == 0): the item's value scales and shifts
   converted once into [NV, n] fp32 arrays, the weights scaled 16 tokens at a time. */
static AVX512 void int4_values_512(const Int4Item* it) {
    int64_t D = it->D, g = it->g, VG = it->VG, VR = VG / 2, NV = it->NV, pa = it->pa, pb = it->pb, span = it->span;
    int64_t n = pb - pa;
    float *wv = it->tmp + g * D + g, *vsc = wv + g * span, *vof = vsc + NV * span, *sc = it->sc, *pr = it->pr;
    int64_t at = it->vso + pa * NV;
    if (NV == 1) {
        int64_t s = 0;
        for (; s + 16 <= n; s += 16) {
            _mm512_storeu_ps(vsc + s, scale16(it->vs, it->skind, at + s));
            _mm512_storeu_ps(vof + s, scale16(it->vo, it->skind, at + s));
        }
        for (; s < n; s++) { vsc[s] = scale1(it->vs, it->skind, at + s); vof[s] = scale1(it->vo, it->skind, at + s); }
    } else {
        for (int64_t s = 0; s < n; s++)
            for (int64_t gi = 0; gi < NV; gi++) {
                vsc[gi * span + s] = scale1(it->vs, it->skind, at + s * NV + gi);
                vof[gi * span + s] = scale1(it->vo, it->skind, at + s * NV + gi);
            }
    }
    for (int64_t gi = 0; gi < NV; gi++) {
        const float *a = vsc + gi * span, *c = vof + gi * span;
        for (int64_t j = 0; j < g; j++) {
            const float* e = sc + j * span;
            float* w = wv + j * span;
            __m512 acc = _mm512_setzero_ps();
            int64_t s = 0;
            for (; s + 16 <= n; s += 16) {
                __m512 x = _mm512_loadu_ps(e + s);
                _mm512_storeu_ps(w + s, _mm512_mul_ps(x, _mm512_loadu_ps(a + s)));
                acc = _mm512_fmadd_ps(x, _mm512_loadu_ps(c + s), acc);
            }
            float f = _mm512_reduce_add_ps(acc);
            for (; s < n; s++) { w[s] = e[s] * a[s]; f += e[s] * c[s]; }
            float* o = pr + j * (D + 2) + 2 + gi * VG;
            for (int64_t d = 0; d < VG; d++) o[d] += f;
        }
        const uint8_t* rows0 = it->vd + (pa * NV + gi) * VR;
        for (int64_t r = 0; r < VR; r += 32) {  /* 32 bytes a pass where the group has them, else 16 */
            int two = r + 32 <= VR;
            for (int64_t j0 = 0; j0 < g; j0 += 4) {
                int jn = g - j0 < 4 ? (int)(g - j0) : 4;
                float* o = pr + j0 * (D + 2) + 2 + gi * VG + r;
                const float* w = wv + j0 * span;
                const uint8_t* rr = rows0 + r;
                int64_t st = NV * VR;
                switch (jn + 4 * two) {
                    case 1: value_cols512(1, 1, rr, st, n, w, span, o, D + 2, VR); break;
                    case 2: value_cols512(2, 1, rr, st, n, w, span, o, D + 2, VR); break;
                    case 3: value_cols512(3, 1, rr, st, n, w, span, o, D + 2, VR); break;
                    case 4: value_cols512(4, 1, rr, st, n, w, span, o, D + 2, VR); break;
                    case 5: value_cols512(1, 2, rr, st, n, w, span, o, D + 2, VR); break;
                    case 6: value_cols512(2, 2, rr, st, n, w, span, o, D + 2, VR); break;
                    case 7: value_cols512(3, 2, rr, st, n, w, span, o, D + 2, VR); break;
                    default: value_cols512(4, 2, rr, st, n, w, span, o, D + 2, VR); break;
                }
            }
        }
    }
}

/* Decode attention straight from an int4 cache's stores (cache/int4.py), with the KIVI axes:
   keys quantized per channel in groups of KG tokens, values per token in groups of VG
   channels (quanto's packing: code i of a group in byte i % R at bit 4 (i / R), R = G / 2;
   x = code x scale + shift). Per row b, pointers to the layer's stores:
     kd [Hkv, N/KG, KG/2, D] codes, ks / ko [Hkv, N/KG, 1, D] scales and shifts (keys);
     vd [Hkv, N, D/VG, VG/2], vs / vo [Hkv, N, D/VG, 1] (values); N = meta[b, 5] tokens;
     ke, ve [Hkv, E, D] fp32 exact keys and values of positions [p0, p0 + E), E = meta[b, 6],
     rows of D floats, meta[b, 7] and meta[b, 8] floats from one head's rows to the next's;
   meta[b] = (dequant_from, dequant_to, exact_from, exact_to, p0, N, E, key head stride,
   value head stride): the spans the cache's View reads and the exact stores' layout. The query at position p = qpos[b, t] with V(p) = vis[b, t] sees,
   inside its window, positions [dequant_from, min(dequant_to, V(p))) quantized and
   [max(exact_from, V(p)), min(exact_to, p + 1)) exact: the rule of int4_attention_reference.
   A quantized key's score is dx (sum_d q16_d code_d) + sum_d q_d shift_d, q16 the query times
   the group's scales rounded to int16 per group and query head (fold_query_int16; the torch
   model: cache/kernels/int4.py int16_key_scores), the sum in int32; a quantized value adds
   (w scale) code + w shift; nothing dequantized is written. Work and merging as
   dl_decode_attn: (b, kv head, t) x C chunks of the seen positions, each kv head's codes
   read once for its g query heads. Keys go 16 byte rows at a time with AVX-512 VNNI (dl_isa)
   and D % 64 == 0, else 8 (the same scores); values 512 bits wide at that level with
   VG % 32 == 0, else AVX2. Key groups: a multiple of 32 tokens (the operator checks). Returns 0, or
   -1 when out of memory. */
int dl_int4_decode_attn(const float* q, int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D,
                        const uint8_t* const* kd, const void* const* ks, const void* const* ko,
                        const uint8_t* const* vd, const void* const* vs, const void* const* vo, int skind,
                        const float* const* ke, const float* const* ve, const int64_t* meta, const int64_t* qpos,
                        const int64_t* vis, float scale, int64_t window, int64_t KG, int64_t VG, float* out) {
    int64_t g = Hq / Hkv, rows = B * Hkv * T, threads = omp_get_max_threads();
    int64_t KR = KG / 2, VR = VG / 2, NV = D / VG, maxn = 1;
    int wide = dl_isa(-1) >= 1 && D % 16 == 0 && VG % 32 == 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t* m = meta + b * 9;
        int64_t n = (m[1] - m[0]) + (m[3] - m[2]);
        if (n > maxn) maxn = n;
    }
    int64_t C = (2 * threads + rows - 1) / rows;
    if (C > 16) C = 16;
    if (C > maxn / 64 + 1) C = maxn / 64 + 1;  /* a chunk of at least ~64 positions */
    if (C < 1) C = 1;
    float* part = (float*)malloc(sizeof(float) * (size_t)(rows * C * g * (D + 2)));
    int64_t span = maxn / C + 2, ss = span + 2 * KG;  /* scores: a margin of KG either side (int4_keys_int) */
    int failed = part ? 0 : 1;
    if (failed) return -1;
    #pragma omp parallel
    {
        /* per thread: scores [g, ss], then the items' scratch (Int4Item.tmp) */
        int64_t scratch = g * ss + g * D + g + g * ss + 2 * NV * ss + g;
        float* sc = (float*)malloc(sizeof(float) * (size_t)(scratch + D));
        if (!sc) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t it = 0; it < rows * C; it++) {
            if (!sc) continue;
            int64_t c = it % C, r = it / C, t = r % T, hk = (r / T) % Hkv, b = r / (T * Hkv);
            const int64_t* m = meta + b * 9;
            int64_t p = qpos[b * T + t], vq = vis[b * T + t], N = m[5], p0 = m[4];
            int64_t wlo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
            int64_t q0 = m[0] > wlo ? m[0] : wlo, q1 = m[1] < vq ? m[1] : vq;
            if (q1 > p + 1) q1 = p + 1;
            if (q1 < q0) q1 = q0;
            int64_t e0 = m[2] > vq ? m[2] : vq, e1 = m[3] < p + 1 ? m[3] : p + 1;
            if (e0 < wlo) e0 = wlo;
            if (e1 < e0) e1 = e0;
            int64_t nq = q1 - q0, n = nq + (e1 - e0);
            int64_t a0 = n * c / C, a1 = n * (c + 1) / C;  /* this chunk: virtual indices [a0, a1) */
            float* pr = part + it * g * (D + 2);
            for (int64_t j = 0; j < g; j++) {
                float* o = pr + j * (D + 2);
                o[0] = -INFINITY; o[1] = 0.f;
                for (int64_t d = 0; d < D; d++) o[2 + d] = 0.f;
            }
            if (a1 <= a0) continue;
            Int4Item item;
            item.qh = q + ((b * Hq + hk * g) * T + t) * D;
            item.T = T; item.D = D; item.g = g; item.KG = KG; item.VG = VG; item.NV = NV;
            item.kd = kd[b] + hk * (N / KG) * KR * D; item.ks = ks[b]; item.ko = ko[b]; item.kso = hk * (N / KG) * D;
            item.vd = vd[b] + hk * N * NV * VR; item.vs = vs[b]; item.vo = vo[b]; item.vso = hk * N * NV;
            item.skind = skind; item.scale = scale;
            /* quantized positions [pa, pb) of this chunk */
            item.pa = q0 + a0; item.pb = q0 + (a1 < nq ? a1 : nq);
            item.sc = sc + KG; item.span = ss; item.pr = pr; item.tmp = sc + g * ss;
            item.fold = sc + scratch;
            int64_t nqc = item.pb > item.pa ? item.pb - item.pa : 0;  /* quantized scores first, then exact ones */
            if (nqc > 0) {
                if (wide) int4_keys_512(&item);
                else int4_keys_avx2(&item);
            }
            /* exact positions [ea, eb) of this chunk */
            int64_t ea = e0 + (a0 > nq ? a0 - nq : 0), eb = e0 + (a1 > nq ? a1 - nq : 0);
            const float* keh = ke[b] + hk * m[7];
            const float* veh = ve[b] + hk * m[8];
            if (wide && eb > ea) int4_exact_512(&item, 0, keh + (ea - p0) * D, 0, eb - ea, item.sc + nqc);
            for (int64_t s = wide ? eb : ea; s < eb; s++) {
                const float* kr = keh + (s - p0) * D;
                for (int64_t j = 0; j < g; j++) {
                    const float* qr = item.qh + j * T * D;
                    __m256 a = _mm256_setzero_ps();
                    for (int64_t d = 0; d < D; d += 8)
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(kr + d), a);
                    item.sc[j * ss + nqc + (s - ea)] = hsum(a) * scale;
                }
            }
            int64_t cnt = nqc + (eb - ea);
            for (int64_t j = 0; j < g; j++) {
                float mx = max_of(item.sc + j * ss, cnt);
                pr[j * (D + 2)] = mx;
                pr[j * (D + 2) + 1] = wide ? exp_sum512(item.sc + j * ss, cnt, mx) : exp_sum(item.sc + j * ss, cnt, mx);
            }
            if (nqc > 0) {
                if (wide) int4_values_512(&item);
                else int4_values_avx2(&item);
            }
            if (wide && eb > ea) int4_exact_512(&item, 1, veh + (ea - p0) * D, 0, eb - ea, item.sc + nqc);
            for (int64_t s = wide ? eb : ea; s < eb; s++) {
                const float* vr = veh + (s - p0) * D;
                for (int64_t j = 0; j < g; j++) {
                    float* o = pr + j * (D + 2) + 2;
                    __m256 w = _mm256_set1_ps(item.sc[j * ss + nqc + (s - ea)]);
                    for (int64_t d = 0; d < D; d += 8)
                        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + d), _mm256_loadu_ps(o + d)));
                }
            }
        }
        free(sc);
    }
    if (!failed) merge_parts(part, rows, C, g, T, Hkv, Hq, D, out);
    free(part);
    return failed ? -1 : 0;
}

/* RMSNorm of `rows` rows of n floats: y = w (x r) (offset 0: Llama's order) or (x r)(offset + w)
   (Gemma's), r = 1 / sqrt(sum(x^2) / n + eps), the sum in 8 lanes (FMA) then those lanes in a fixed
   order and the tail in order: one order whatever the thread count or the caller (eager or a
   compiled graph), so the norms' outputs that an int4 product quantizes are the same bits in
   both (models/transformer.py RMSNorm). Rows split over threads from 64 rows on. */
void dl_rms_norm(const float* x, const float* w, int64_t rows, int64_t n, float eps, float offset, float* y) {
    #pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * n;
        float* yr = y + r * n;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float l[8], ss = 0.f;
        _mm256_storeu_ps(l, acc);
        for (int j = 0; j < 8; j++) ss += l[j];
        for (; i < n; i++) ss += xr[i] * xr[i];
        float inv = 1.f / sqrtf(ss / (float)n + eps);
        if (offset != 0.f)
            for (int64_t k = 0; k < n; k++) yr[k] = (xr[k] * inv) * (offset + w[k]);
        else
            for (int64_t k = 0; k < n; k++) yr[k] = w[k] * (xr[k] * inv);
    }
}

/* The index of the first largest of x[0 .. n) (torch.argmax's answer: the first of equal
   maxima, -0 equal to +0), or -1 where x holds a NaN (torch's NaN rule: the caller asks
   torch). A max over 8 lanes, then the first lane equal to it; n >= 1. */
int64_t dl_argmax(const float* x, int64_t n) {
    __m256 m = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        m = _mm256_max_ps(m, v);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(nan)) return -1;
    float l[8], mx = -INFINITY;
    _mm256_storeu_ps(l, m);
    for (int j = 0; j < 8; j++) mx = l[j] > mx ? l[j] : mx;
    for (; i < n; i++) {
        if (x[i] != x[i]) return -1;
        mx = x[i] > mx ? x[i] : mx;
    }
    __m256 want = _mm256_set1_ps(mx);
    for (i = 0; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), want, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz(hit);
    }
    for (; i < n; i++)
        if (x[i] == mx) return i;
    return 0;  /* (unreached: mx is one of x) */
}

/* out[n, K] (fp32) = rows o0 .. o0 + n of the int8 weight */
void dl_int8_dequant(const int8_t* w, const float* scale, int64_t K, int64_t o0, int64_t n, float* out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        const int8_t* wr = w + (o0 + r) * K;
        __m256 s = _mm256_set1_ps(scale[o0 + r]);
        for (int64_t k = 0; k < K; k += 8) _mm256_storeu_ps(out + r * K + k, _mm256_mul_ps(CVT8(wr + k), s));
    }
}

/* 8 floats to bf16, rounded to nearest even (as torch's conversion, finite values) */
static inline __m128i bf16_8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8));
}

/* out[n, K] = rows o0 .. o0 + n of the int4 weight: code * scale + shift, in fp32 (out32)
   or, where out32 is NULL, in bf16 (out16) */
void dl_int4_dequant(const uint8_t* nib, const float* scale, const float* shift, int64_t g, int64_t K, int64_t o0,
                     int64_t n, float* out32, uint16_t* out16) {
    int64_t G = K / g;
    const __m128i mask = _mm_set1_epi8(0x0F);
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; r++) {
        int64_t o = o0 + r;
        const uint8_t* wr = nib + o * (K / 2);
        for (int64_t b = 0; b < K / 32; b++) {
            int64_t j = b * 32 / g;
            __m256 s = _mm256_set1_ps(scale[o * G + j]), t = _mm256_set1_ps(shift[o * G + j]);
            __m128i v = _mm_loadu_si128((const __m128i*)(wr + b * 16));
            __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
            __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int q = 0; q < 4; q++) {
                __m256 c = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[q])), s, t);
                int64_t at = r * K + b * 32 + q * 8;
                if (out32) _mm256_storeu_ps(out32 + at, c);
                else _mm_storeu_si128((__m128i*)(out16 + at), bf16_8(c));
            }
        }
    }
}

}  // extern "C"
