"""decodelab's own CPU kernels for weight-only int8 / int4 projections (x86 with AVX2 and
FMA), built from the C source below (and a C++ shim that registers them as torch
operators, `torch.ops.decodelab.*`) with the system compilers on first use.

Why: torch's packed CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`)
are fast only where the CPU has bf16 arithmetic (AVX-512 BF16 / AMX). On a CPU without it
(AMD Zen 1-3, AVX2 Xeons) they convert bf16 in software, and int4 ran no faster than our
own int8 here. These kernels stream the codes once per product and compute:
- int8 (`int8_mm`): y = x @ (codes x scale)^T with fp32 activations and fp32 scales, so it
  is quanto's dequantized weight exactly (float summation order aside);
- int4 (`int4_mm`): the codes (0..15, w = code x scale + shift per group of input
  channels) against activations quantized to int8 per 32 input channels (absmax / 127,
  round to nearest even), as llama.cpp's Q8 activations: integer dot products per block
  (`vpmaddubsw`), scaled in fp32; the shifts meet the exact fp32 sums of x per group;
- dequantization of either to fp32 (`int8_dequant`, `int4_dequant`; int4 also straight to
  bf16), for products of many rows (a prefill), which then multiply in fp32 or bf16
  (models/quantize.py, `prefill_dtype`).

Rows (the product's M) are independent: a row's result does not depend on how many rows
share the call. Threads: OpenMP, linked against the libgomp torch itself loaded (one pool,
`torch.set_num_threads` sets both). As torch operators they cost one dispatcher call from
eager code and run inside a torch.compile graph as opaque calls (fake impls give their
shapes). The library is built once per source, torch and compiler into
`$DECODELAB_CACHE/kernels/` (default ~/.cache/decodelab/kernels; about a minute on 2
cores, most of it torch's headers), checked before every load and rebuilt when damaged
(models/native_build.py). `problem()` says why the kernels cannot serve here
(None when they can); nothing in this module builds anything until it is called.

int4 codes are stored per block of 32 input channels as 16 bytes, byte j holding channel
j in its low nibble and channel j + 16 in its high one (`pack_int4`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from decodelab.models import native_build

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <omp.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

#define CVT8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p))))

/* y[M, N] = x[M, K] @ (w[N, K] * scale[N])^T; K % 8 == 0. Four output rows at a time,
   two activation rows at a time; the next four rows are prefetched while these run. */
void dl_int8_mm(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N) {
    int64_t nb = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++) {
        int64_t o0 = b * 4, R = N - o0 < 4 ? N - o0 : 4;
        const int8_t* w0 = w + o0 * K;
        const int8_t* w1 = w0 + (R > 1 ? K : 0);
        const int8_t* w2 = w0 + (R > 2 ? 2 * K : 0);
        const int8_t* w3 = w0 + (R > 3 ? 3 * K : 0);
        const char* next = (const char*)(b + 1 < nb ? w0 + 4 * K : w0);  /* the last block prefetches itself */
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

/* One int4 output row against MC (1..4) activation rows, two 32-channel blocks per step. */
static inline __attribute__((always_inline)) void q4_row(const int8_t* xq, const float* dx, const float* xs,
        int64_t m0, const int MC, int64_t K, const uint8_t* wr, const float* sc, const float* sh, int64_t G,
        int64_t bpg, float* y, int64_t N, int64_t o) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t B = K / 32;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 acc2[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    const float* scp = sc;
    int64_t left = bpg;
    for (int64_t b = 0; b < B; b += 2) {
        float s = *scp;
        if (--left == 0) { scp++; left = bpg; }
        float s2 = *scp;
        if (--left == 0) { scp++; left = bpg; }
        __m128i v = _mm_loadu_si128((const __m128i*)(wr + b * 16));
        __m128i v2 = _mm_loadu_si128((const __m128i*)(wr + b * 16 + 16));
        __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
        __m256i c2 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v2, 4), mask), _mm_and_si128(v2, mask));
        for (int i = 0; i < MC; i++) {
            const int8_t* xr = xq + (m0 + i) * K + b * 32;
            const float* dr = dx + (m0 + i) * B + b;
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i*)xr)), ones);
            __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(c2, _mm256_loadu_si256((const __m256i*)(xr + 32))),
                                           ones);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s * dr[0]), acc[i]);
            acc2[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(s2 * dr[1]), acc2[i]);
        }
    }
    for (int i = 0; i < MC; i++) {
        float r = hsum(_mm256_add_ps(acc[i], acc2[i]));
        const float* xr = xs + (m0 + i) * G;
        for (int64_t j = 0; j < G; j++) r += sh[j] * xr[j];
        y[(m0 + i) * N + o] = r;
    }
}

/* Four int4 output rows o .. o + 3 against one activation row (a decode step): q4_row's
   arithmetic for each row, in the same order (so a row's result does not depend on M), with
   the four rows' independent sums interleaved and the activation blocks loaded once. */
static inline __attribute__((always_inline)) void q4_rows4(const int8_t* xq, const float* dx, const float* xs,
        int64_t K, const uint8_t* nib, const float* scale, const float* shift, int64_t G, int64_t bpg,
        float* y, int64_t o, int64_t N) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    int64_t B = K / 32, H = K / 2;
    /* the next four rows' codes, scales and shifts are fetched while these run (their own
       line each two steps; the last block fetches itself) */
    int64_t nx = o + 8 <= N ? o + 4 : o;
    const char* pn = (const char*)(nib + nx * H);
    const char* ps = (const char*)(scale + nx * G);
    const char* pt = (const char*)(shift + nx * G);
    int64_t sb = 4 * G * (int64_t)sizeof(float);
    __m256 acc[4], acc2[4];
    for (int r = 0; r < 4; r++) { acc[r] = _mm256_setzero_ps(); acc2[r] = _mm256_setzero_ps(); }
    for (int64_t b = 0; b < B; b += 2) {
        if ((b & 3) == 0) {
            for (int r = 0; r < 4; r++) _mm_prefetch(pn + r * H + b * 16, _MM_HINT_T0);
            int64_t at = b / 4 * 64;
            if (at < sb) { _mm_prefetch(ps + at, _MM_HINT_T0); _mm_prefetch(pt + at, _MM_HINT_T0); }
        }
        __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + b * 32));
        __m256i xv2 = _mm256_loadu_si256((const __m256i*)(xq + b * 32 + 32));
        float d = dx[b], d2 = dx[b + 1];
        int64_t j = b / bpg, j2 = (b + 1) / bpg;
        for (int r = 0; r < 4; r++) {
            const uint8_t* wr = nib + (o + r) * H + b * 16;
            __m128i v = _mm_loadu_si128((const __m128i*)wr);
            __m128i v2 = _mm_loadu_si128((const __m128i*)(wr + 16));
            __m256i c = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
            __m256i c2 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v2, 4), mask), _mm_and_si128(v2, mask));
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(c, xv), ones);
            __m256i p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(c2, xv2), ones);
            float s = scale[(o + r) * G + j], s2 = scale[(o + r) * G + j2];
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(s * d), acc[r]);
            acc2[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p2), _mm256_set1_ps(s2 * d2), acc2[r]);
        }
    }
    for (int r = 0; r < 4; r++) {
        float v = hsum(_mm256_add_ps(acc[r], acc2[r]));
        const float* sh = shift + (o + r) * G;
        for (int64_t j = 0; j < G; j++) v += sh[j] * xs[j];
        y[o + r] = v;
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
    int8_t* xq = (int8_t*)malloc((size_t)(M * K));
    float* dx = (float*)malloc(sizeof(float) * (size_t)(M * B));
    float* xs = (float*)malloc(sizeof(float) * (size_t)(M * G));
    if (!xq || !dx || !xs) { free(xq); free(dx); free(xs); return -1; }
    for (int64_t m = 0; m < M; m++) q8_row(x + m * K, K, g, xq + m * K, dx + m * B, xs + m * G);
    if (M == 1) {  /* a decode step: four output rows at a time, the rest one by one */
        int64_t N4 = N / 4 * 4;
        #pragma omp parallel for schedule(static)
        for (int64_t o = 0; o < N4; o += 4) q4_rows4(xq, dx, xs, K, nib, scale, shift, G, bpg, y, o, N4);
        for (int64_t o = N4; o < N; o++)
            q4_row(xq, dx, xs, 0, 1, K, nib + o * (K / 2), scale + o * G, shift + o * G, G, bpg, y, N, o);
        free(xq); free(dx); free(xs);
        return 0;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t o = 0; o < N; o++) {
        const uint8_t* wr = nib + o * (K / 2);
        const float* sc = scale + o * G;
        const float* sh = shift + o * G;
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4) q4_row(xq, dx, xs, m0, 4, K, wr, sc, sh, G, bpg, y, N, o);
        switch (M - m0) {
            case 1: q4_row(xq, dx, xs, m0, 1, K, wr, sc, sh, G, bpg, y, N, o); break;
            case 2: q4_row(xq, dx, xs, m0, 2, K, wr, sc, sh, G, bpg, y, N, o); break;
            case 3: q4_row(xq, dx, xs, m0, 3, K, wr, sc, sh, G, bpg, y, N, o); break;
        }
    }
    free(xq); free(dx); free(xs);
    return 0;
}

/* Attention of decode-shaped queries over a row-major cache: out[b, h, t] = softmax over the
   slots s this query sees (s <= pos[b, t], and s > pos[b, t] - window where window > 0) of
   (q[b, h, t] . k[b, h / g, s]) * scale, times v[b, h / g, s], g = Hq / Hkv; fp32 throughout.
   q, out [B, Hq, T, D]; k, v [B, Hkv, S, D]; D % 8 == 0. Only the seen slots are read, each
   once for the g query heads that share it. The work: (b, kv head, t) x C chunks of the seen
   slots (C so that every thread gets work), each chunk's softmax taken against its own max;
   the chunks then merge exactly (flash-decoding). Returns 0, or -1 when out of memory. */
int dl_decode_attn(const float* q, const float* k, const float* v, const int64_t* pos, int64_t B, int64_t Hq,
                   int64_t Hkv, int64_t T, int64_t S, int64_t D, float scale, int64_t window, float* out) {
    int64_t g = Hq / Hkv, rows = B * Hkv * T, threads = omp_get_max_threads();
    int64_t C = (2 * threads + rows - 1) / rows;
    if (C > 16) C = 16;
    if (C < 1) C = 1;
    /* per (row, chunk, query head): max, sum, unnormalized output [D] */
    float* part = (float*)malloc(sizeof(float) * (size_t)(rows * C * g * (D + 2)));
    int64_t span = S / C + 2;
    int failed = part ? 0 : 1;
    if (failed) return -1;
    #pragma omp parallel
    {
        float* sc = (float*)malloc(sizeof(float) * (size_t)(g * span));
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
            const float* kh = k + (b * Hkv + hk) * S * D;
            const float* vh = v + (b * Hkv + hk) * S * D;
            float* pr = part + it * g * (D + 2);
            for (int64_t j = 0; j < g; j++) {
                float* o = pr + j * (D + 2);
                o[0] = -INFINITY; o[1] = 0.f;
                for (int64_t d = 0; d < D; d++) o[2 + d] = 0.f;
            }
            if (c1 <= c0) continue;
            for (int64_t s = c0; s < c1; s++) {
                const float* ks = kh + s * D;
                for (int64_t j = 0; j < g; j++) {
                    const float* qr = q + ((b * Hq + hk * g + j) * T + t) * D;
                    __m256 a = _mm256_setzero_ps();
                    for (int64_t d = 0; d < D; d += 8)
                        a = _mm256_fmadd_ps(_mm256_loadu_ps(qr + d), _mm256_loadu_ps(ks + d), a);
                    float x = hsum(a) * scale;
                    sc[j * span + (s - c0)] = x;
                    if (x > pr[j * (D + 2)]) pr[j * (D + 2)] = x;
                }
            }
            for (int64_t j = 0; j < g; j++) {
                float mx = pr[j * (D + 2)], sum = 0.f;
                float* e = sc + j * span;
                for (int64_t s = 0; s < c1 - c0; s++) { e[s] = expf(e[s] - mx); sum += e[s]; }
                pr[j * (D + 2) + 1] = sum;
            }
            for (int64_t s = c0; s < c1; s++) {
                const float* vs = vh + s * D;
                for (int64_t j = 0; j < g; j++) {
                    float* o = pr + j * (D + 2) + 2;
                    __m256 w = _mm256_set1_ps(sc[j * span + (s - c0)]);
                    for (int64_t d = 0; d < D; d += 8)
                        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(w, _mm256_loadu_ps(vs + d), _mm256_loadu_ps(o + d)));
                }
            }
        }
        free(sc);
    }
    if (!failed) {  /* merge the chunks: each rescaled to the common max */
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
    free(part);
    return failed ? -1 : 0;
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
"""

SHIM = r"""
#include <ATen/ATen.h>
#include <torch/library.h>

extern "C" {
void dl_int8_mm(const float*, int64_t, int64_t, const int8_t*, const float*, float*, int64_t);
int dl_int4_mm(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t, float*, int64_t);
void dl_int8_dequant(const int8_t*, const float*, int64_t, int64_t, int64_t, float*);
int dl_decode_attn(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                   int64_t, int64_t, float, int64_t, float*);
void dl_int4_dequant(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*,
                     uint16_t*);
}

static at::Tensor rows_f32(const at::Tensor& x, int64_t k) {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "decodelab native kernel: x must be [M, ", k, "], got ", x.sizes());
    return x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
}

static at::Tensor f32(const at::Tensor& t) {  /* scales and shifts: fp32 (a module cast to bf16 keeps working) */
    return t.scalar_type() == at::kFloat ? t.contiguous() : t.to(at::kFloat).contiguous();
}

static void check_codes(const at::Tensor& codes, at::ScalarType type, int64_t k_mult) {
    TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == type && codes.is_contiguous() && codes.device().is_cpu(),
                "decodelab native kernel: codes must be a contiguous 2-D CPU tensor of ", type);
    TORCH_CHECK(codes.size(1) % k_mult == 0, "decodelab native kernel: codes' row size ", codes.size(1),
                " is not a multiple of ", k_mult);
}

static void check_groups(const at::Tensor& nib, const at::Tensor& sc, const at::Tensor& sh, int64_t g) {
    int64_t k = nib.size(1) * 2;
    TORCH_CHECK(g > 0 && g % 32 == 0 && k % g == 0, "decodelab native int4 kernel: group size ", g,
                " must be a multiple of 32 dividing ", k);
    TORCH_CHECK(sc.numel() == nib.size(0) * (k / g) && sh.numel() == sc.numel(),
                "decodelab native int4 kernel: scales and shifts must hold [", nib.size(0), ", ", k / g, "]");
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    check_codes(codes, at::kChar, 8);
    TORCH_CHECK(scales.numel() == codes.size(0), "decodelab native int8 kernel: one scale per output row");
    auto xc = rows_f32(x, codes.size(1));
    auto sc = f32(scales);
    auto y = at::empty({xc.size(0), codes.size(0)}, xc.options());
    dl_int8_mm(xc.data_ptr<float>(), xc.size(0), xc.size(1), codes.data_ptr<int8_t>(), sc.data_ptr<float>(),
               y.data_ptr<float>(), codes.size(0));
    return y;
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& scales, const at::Tensor& shifts,
                   int64_t g) {
    check_codes(nib, at::kByte, 32);
    check_groups(nib, scales, shifts, g);
    auto xc = rows_f32(x, nib.size(1) * 2);
    auto sc = f32(scales), sh = f32(shifts);
    auto y = at::empty({xc.size(0), nib.size(0)}, xc.options());
    int rc = dl_int4_mm(xc.data_ptr<float>(), xc.size(0), xc.size(1), nib.data_ptr<uint8_t>(),
                        sc.data_ptr<float>(), sh.data_ptr<float>(), g, y.data_ptr<float>(), nib.size(0));
    TORCH_CHECK(rc == 0, "decodelab native int4 kernel: out of memory for the activation codes");
    return y;
}

static void check_out(const at::Tensor& out, int64_t o0, int64_t n, int64_t rows, int64_t k) {
    TORCH_CHECK(o0 >= 0 && n >= 0 && o0 + n <= rows, "decodelab native dequant: rows ", o0, "..", o0 + n,
                " outside [0, ", rows, ")");
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() >= n * k,
                "decodelab native dequant: out must be a contiguous float32 buffer of >= ", n * k, " floats");
}

void int8_dequant(const at::Tensor& codes, const at::Tensor& scales, int64_t o0, int64_t n, at::Tensor& out) {
    check_codes(codes, at::kChar, 8);
    check_out(out, o0, n, codes.size(0), codes.size(1));
    auto sc = f32(scales);
    dl_int8_dequant(codes.data_ptr<int8_t>(), sc.data_ptr<float>(), codes.size(1), o0, n, out.data_ptr<float>());
}

void int4_dequant(const at::Tensor& nib, const at::Tensor& scales, const at::Tensor& shifts, int64_t g, int64_t o0,
                  int64_t n, at::Tensor& out) {
    check_codes(nib, at::kByte, 32);
    check_groups(nib, scales, shifts, g);
    int64_t k = nib.size(1) * 2;
    bool bf16 = out.scalar_type() == at::kBFloat16;  // else float32 (check_out)
    if (bf16) {
        TORCH_CHECK(o0 >= 0 && n >= 0 && o0 + n <= nib.size(0), "decodelab native dequant: rows ", o0, "..", o0 + n,
                    " outside [0, ", nib.size(0), ")");
        TORCH_CHECK(out.is_contiguous() && out.numel() >= n * k,
                    "decodelab native dequant: out must be a contiguous buffer of >= ", n * k, " elements");
    } else {
        TORCH_CHECK(out.scalar_type() == at::kFloat, "decodelab native int4 dequant: out must be float32 or "
                    "bfloat16, got ", out.scalar_type());
        check_out(out, o0, n, nib.size(0), k);
    }
    auto sc = f32(scales), sh = f32(shifts);
    dl_int4_dequant(nib.data_ptr<uint8_t>(), sc.data_ptr<float>(), sh.data_ptr<float>(), g, k, o0, n,
                    bf16 ? nullptr : out.data_ptr<float>(),
                    bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& pos, double scale, int64_t window) {
    TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                "decodelab decode_attention: q [B, Hq, T, D], keys and values [B, Hkv, S, D]");
    int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = keys.size(1), S = keys.size(2);
    TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0,
                "decodelab decode_attention: shapes q ", q.sizes(), " keys ", keys.sizes());
    TORCH_CHECK(q.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
                values.scalar_type() == at::kFloat && keys.is_contiguous() && values.is_contiguous() &&
                keys.device().is_cpu(), "decodelab decode_attention: contiguous float32 CPU keys and values");
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == T,
                "decodelab decode_attention: pos must be [B, T] = [", B, ", ", T, "]");
    TORCH_CHECK(q.device().is_cpu() && values.device().is_cpu() && pos.device().is_cpu(),
                "decodelab decode_attention: q, keys, values and pos must be CPU tensors");
    auto qc = q.contiguous();
    auto pc = pos.to(at::kLong).contiguous();
    auto out = at::empty({B, Hq, T, D}, q.options());
    if (out.numel() == 0 || S == 0) return out.zero_();
    int rc = dl_decode_attn(qc.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
                            pc.data_ptr<int64_t>(), B, Hq, Hkv, T, S, D, (float)scale, window, out.data_ptr<float>());
    TORCH_CHECK(rc == 0, "decodelab decode_attention: out of memory for the scores");
    return out;
}

TORCH_LIBRARY(decodelab, m) {
    m.def("int8_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("int4_mm(Tensor x, Tensor nib, Tensor scales, Tensor shifts, int group_size) -> Tensor");
    m.def("int8_dequant(Tensor codes, Tensor scales, int o0, int n, Tensor(a!) out) -> ()");
    m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor pos, float scale, int window) -> Tensor");
    m.def("int4_dequant(Tensor nib, Tensor scales, Tensor shifts, int group_size, int o0, int n, "
          "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(decodelab, CPU, m) {
    m.impl("int8_mm", &int8_mm);
    m.impl("int4_mm", &int4_mm);
    m.impl("int8_dequant", &int8_dequant);
    m.impl("decode_attention", &decode_attention);
    m.impl("int4_dequant", &int4_dequant);
}
"""

_C_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC"]
_problem: str | None = None
_checked = False
_library: Path | None = None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_dir() -> Path:
    from decodelab.models.loading import cache_root

    return cache_root() / "kernels"


def _build_commands(cc: str, cxx: str, tmp: Path) -> list[list[str]]:
    """Compile the C kernels and the C++ operator shim, link them against the torch that
    runs here (its libgomp first: one OpenMP pool)."""
    from torch.utils.cpp_extension import include_paths

    lib = Path(torch.__file__).parent / "lib"
    gomp = [str(lib / "libgomp.so.1")] if (lib / "libgomp.so.1").is_file() else ["-fopenmp"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [[cc, *_C_FLAGS, "-c", str(tmp / "kernels.c"), "-o", str(tmp / "kernels.o")],
            [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", abi, *[f"-I{p}" for p in include_paths()],
             str(tmp / "shim.cpp"), str(tmp / "kernels.o"), "-o", str(tmp / native_build.LIBRARY), f"-L{lib}",
             "-lc10", "-ltorch_cpu", "-ltorch", *gomp, f"-Wl,-rpath,{lib}"]]


def _compile(cc: str, cxx: str, tmp: Path) -> str | None:
    """Write the sources into `tmp` and build `tmp/<native_build.LIBRARY>`; None, or why not."""
    (tmp / "kernels.c").write_text(SOURCE)
    (tmp / "shim.cpp").write_text(SHIM)
    for cmd in _build_commands(cc, cxx, tmp):
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            return (f"cannot run the compiler {cmd[0]!r} to build decodelab's native kernels ({e}); "
                    "set CC / CXX to a working C / C++ compiler, or install gcc and g++")
        if r.returncode:
            return f"building decodelab's native kernels failed ({cmd[0]}): {r.stderr.strip()[-600:]}"
    return None


def _build() -> None:
    global _problem, _checked, _library
    _checked = True
    if os.uname().machine not in ("x86_64", "AMD64"):
        _problem = f"decodelab's native kernels are x86 (AVX2) code; this machine is {os.uname().machine}"
        return
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        _problem = f"decodelab's native kernels need AVX2 and FMA; this CPU lacks {sorted(missing)}"
        return
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cc is None or cxx is None:
        _problem = ("decodelab's native kernels are built with a C and a C++ compiler on first use, and "
                    f"{'none' if cc is None and cxx is None else 'no C++ compiler' if cc else 'no C compiler'} "
                    "was found (install gcc and g++)")
        return
    cmds = _build_commands(cc, cxx, Path("TMP"))
    key = hashlib.sha256("\n".join([SOURCE, SHIM, torch.__version__, *map(" ".join, cmds)]).encode()).hexdigest()[:16]
    folder = _build_dir() / key
    _problem = native_build.ready(folder, lambda tmp: _compile(cc, cxx, tmp))
    if _problem is not None:
        return
    out = folder / native_build.LIBRARY
    try:
        torch.ops.load_library(str(out))
        _library = out
        torch.library.register_fake("decodelab::int8_mm")(
            lambda x, codes, scales: x.new_empty(x.shape[0], codes.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::int4_mm")(
            lambda x, nib, scales, shifts, group_size: x.new_empty(x.shape[0], nib.shape[0], dtype=torch.float32))
        torch.library.register_fake("decodelab::decode_attention")(
            lambda q, keys, values, pos, scale, window: q.new_empty(q.shape))
    except Exception as e:  # a cached library this torch cannot load: say so; never half-registered
        _problem = (f"loading decodelab's native kernels from {out} failed ({type(e).__name__}: {e}); delete "
                    f"{out.parent} to rebuild them")


def problem() -> str | None:
    """Why the native kernels cannot serve on this machine (None: they can; built the
    first time on this machine, and loaded as torch operators by this call)."""
    if not _checked:
        _build()
    return _problem


_noted: set[str] = set()


def note_fallback(what: str) -> None:
    """Say once per process, on stderr, that `what` runs on torch's kernels instead of the
    native ones, and why (`problem()`)."""
    if what not in _noted:
        _noted.add(what)
        print(f"decodelab: {what} run on torch's kernels, not decodelab's native ones: {problem()}",
              file=sys.stderr, flush=True)


def library() -> Path | None:
    """The kernel library this process loaded (None: none, see `problem()`)."""
    problem()
    return _library


def _ops():
    p = problem()
    if p:
        raise RuntimeError(p)
    return torch.ops.decodelab


def shape_problem(weights: str, n_in: int, group_size: int | None) -> str | None:
    """Why the native kernel cannot take a projection of `n_in` inputs (None: it can)."""
    if weights == "int8":
        return None if n_in % 8 == 0 else f"the native int8 kernel needs an input size divisible by 8, not {n_in}"
    if n_in % 64:
        return f"the native int4 kernel needs an input size divisible by 64, not {n_in}"
    if group_size is None or group_size % 32 or n_in % group_size:
        return (f"the native int4 kernel needs a group size that is a multiple of 32 and divides the input size "
                f"{n_in}, not {group_size}")
    return None


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes [out, in] (0..15) -> [out, in / 2] uint8 in the native layout: per block of 32
    input channels, byte j = channel j | channel j + 16 << 4."""
    n_out, n_in = codes.shape
    c = codes.to(torch.uint8).reshape(n_out, n_in // 32, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n_out, n_in // 2).contiguous()


def unpack_int4(nib: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_int4`: [out, in] codes (uint8)."""
    n_out = nib.shape[0]
    b = nib.reshape(n_out, -1, 16)
    return torch.stack([b & 15, b >> 4], 2).reshape(n_out, -1)


def int8_mm(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] (any float dtype; computed in fp32) @ (codes [N, K] int8 x scales [N] fp32)^T
    -> [M, N] fp32 (the operator decodelab::int8_mm)."""
    return _ops().int8_mm(x, codes, scales)


def int4_mm(x: torch.Tensor, nib: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor,
            group_size: int) -> torch.Tensor:
    """x [M, K] @ W^T with W [N, K] = code x scale + shift per group (codes `pack_int4`ed,
    scales/shifts [N, K / group] fp32), x quantized to int8 per 32 channels -> [M, N] fp32
    (the operator decodelab::int4_mm)."""
    return _ops().int4_mm(x, nib, scales, shifts, group_size)


def dequantize_rows(weights: str, o0: int, n: int, out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                    shifts: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """Rows o0 .. o0 + n of the weight [N, K] in `out`'s dtype (fp32; int4 also bf16,
    rounded to nearest even), written into `out` (>= n x K elements, contiguous); returns
    that [n, K] view."""
    ops = _ops()
    K = codes.shape[1] * (2 if weights == "int4" else 1)
    dtypes = (torch.float32, torch.bfloat16) if weights == "int4" else (torch.float32,)
    if out.numel() < n * K or not out.is_contiguous() or out.dtype not in dtypes:
        raise ValueError(f"dequantize_rows: out must be a contiguous buffer of >= {n * K} elements of "
                         f"{' or '.join(str(d).replace('torch.', '') for d in dtypes)}")
    if weights == "int8":
        ops.int8_dequant(codes, scales, o0, n, out)
    else:
        ops.int4_dequant(codes, scales, shifts, group_size, o0, n, out)
    return out.view(-1)[: n * K].view(n, K)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, D] over the row-major cache buffers keys, values [B, Hkv, S, D] (fp32,
    contiguous; GQA: query head h reads kv head h // (Hq / Hkv)): each query at position
    pos [B, T] sees the slots at or before it (and, with a `window`, the `window` - 1
    before it); only those are read -> [B, Hq, T, D] (the operator decodelab::decode_attention)."""
    return _ops().decode_attention(q, keys, values, pos, scale, window or 0)
