// The torch operators decodelab::* (CPU) over the kernels of native_kernels.cpp: argument
// checks, fp32 conversion of activations, scales and shifts, and the output tensors.
// Their fake (meta) implementations, for torch.compile, are registered in models/native.py.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>

extern "C" {
void dl_int8_mm(const float*, int64_t, int64_t, const int8_t*, const float*, float*, int64_t);
int dl_f32_mv(const float*, int64_t, const float*, int64_t, const float*, float*);
int dl_isa(int);
int dl_int4_mm(const float*, int64_t, int64_t, const uint8_t*, const float*, const float*, int64_t, float*, int64_t);
void dl_int8_dequant(const int8_t*, const float*, int64_t, int64_t, int64_t, float*);
void dl_rms_norm(const float*, const float*, int64_t, int64_t, float, float, float*);
int64_t dl_argmax(const float*, int64_t);
int dl_decode_attn(const float*, const void*, const void*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                   int64_t, int64_t, float, int64_t, float*, const int64_t*, int64_t, int64_t, int64_t, int,
                   const float*, const float*);
void dl_int4_dequant(const uint8_t*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*,
                     uint16_t*);
int dl_int4_decode_attn(const float*, int64_t, int64_t, int64_t, int64_t, int64_t, const uint8_t* const*,
                        const void* const*, const void* const*, const uint8_t* const*, const void* const*,
                        const void* const*, int, const float* const*, const float* const*, const int64_t*,
                        const int64_t*, const int64_t*, float, int64_t, int64_t, int64_t, float*);
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

/* The instruction set of the kernels that have a choice (0: AVX2, 1: AVX-512 VNNI); `set` >= 0
   asks for one (capped at what the CPU has). Returns the level in use. */
int64_t isa(int64_t set) { return dl_isa((int)set); }

/* x [1, K] @ w [K, N] (+ bias [N]), fp32, N % 8 == 0: an fp32 projection's decode product. */
at::Tensor f32_mv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.device().is_cpu(),
                "decodelab native f32_mv: w must be a contiguous 2-D float32 CPU tensor [in, out]");
    TORCH_CHECK(w.size(1) % 8 == 0, "decodelab native f32_mv: outputs must be a multiple of 8, got ", w.size(1));
    auto xc = rows_f32(x, w.size(0));
    TORCH_CHECK(xc.size(0) == 1, "decodelab native f32_mv: one row, got ", xc.size(0));
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = f32(*bias);
        TORCH_CHECK(b.numel() == w.size(1), "decodelab native f32_mv: bias must have ", w.size(1), " values");
    }
    auto y = at::empty({1, w.size(1)}, xc.options());
    if (w.size(1) == 0) return y;
    int rc = dl_f32_mv(xc.data_ptr<float>(), w.size(0), w.data_ptr<float>(), w.size(1),
                       b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>());
    TORCH_CHECK(rc == 0, "decodelab native f32_mv: out of memory for the partial sums");
    return y;
}

// An RMSNorm's weight for rows of n: float32 [n] on the CPU, contiguous.
static at::Tensor norm_weight(const at::Tensor& w, int64_t n, const char* who) {
    TORCH_CHECK(w.dim() == 1 && w.size(0) == n && w.scalar_type() == at::kFloat && w.device().is_cpu(), who,
                "weight must be float32 [", n, "] (x's last dimension), got ", w.sizes(), " ",
                w.scalar_type());
    return w.contiguous();
}

// RMSNorm over x's last dimension (float32 CPU, any leading dimensions) with weight w [n]:
// dl_rms_norm's one order of arithmetic, eager and in a compiled graph alike.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset) {
    TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "decodelab rms_norm: x must be a float32 CPU tensor, got ", x.scalar_type(), " on ", x.device());
    int64_t n = x.size(-1);
    auto xc = x.contiguous(), wc = norm_weight(w, n, "decodelab rms_norm: the ");
    auto y = at::empty(x.sizes(), x.options());
    if (y.numel() == 0) return y;
    dl_rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), y.numel() / n, n, (float)eps, (float)offset,
                y.data_ptr<float>());
    return y;
}

// RoPE's cos and sin [..., 1, T, D] at positions [..., T] (int64) for inverse frequencies
// inv [D / 2] (float32): angle = float(position) x inv[i] in float32, as rope_cos_sin computes it,
// channel i and i + D / 2 alike; cosf / sinf of it. One computation for eager and compiled steps
// (models/transformer.py `share_kernels`).
std::tuple<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& inv, const at::Tensor& positions) {
    TORCH_CHECK(inv.dim() == 1 && inv.scalar_type() == at::kFloat && inv.device().is_cpu() &&
                positions.dim() >= 1 && positions.device().is_cpu(), "decodelab rope_cos_sin: inverse "
                "frequencies float32 [D / 2] and positions [..., T] on the CPU, got ", inv.sizes(), " ",
                inv.scalar_type(), " and ", positions.sizes());
    TORCH_CHECK(at::isIntegralType(positions.scalar_type(), /*includeBool=*/false), "decodelab rope_cos_sin: "
                "positions must be integers, got ", positions.scalar_type());
    auto ic = inv.contiguous();
    auto pc = positions.to(at::kLong).contiguous();
    int64_t h = ic.size(0), n = pc.numel();
    std::vector<int64_t> shape(positions.sizes().begin(), positions.sizes().end() - 1);
    shape.push_back(1);
    shape.push_back(positions.size(-1));
    shape.push_back(2 * h);
    auto c = at::empty(shape, ic.options()), s = at::empty(shape, ic.options());
    const float* f = ic.data_ptr<float>();
    const int64_t* p = pc.data_ptr<int64_t>();
    float *co = c.data_ptr<float>(), *so = s.data_ptr<float>();
    for (int64_t t = 0; t < n; t++) {
        float pos = (float)p[t];
        for (int64_t i = 0; i < h; i++) {
            float a = pos * f[i], ca = std::cos(a), sa = std::sin(a);
            co[t * 2 * h + i] = co[t * 2 * h + h + i] = ca;
            so[t * 2 * h + i] = so[t * 2 * h + h + i] = sa;
        }
    }
    return {c, s};
}

at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
    check_codes(codes, at::kChar, 8);
    TORCH_CHECK(scales.numel() == codes.size(0), "decodelab native int8 kernel: one scale per output row");
    auto xc = rows_f32(x, codes.size(1));
    auto sc = f32(scales);
    auto y = at::empty({xc.size(0), codes.size(0)}, xc.options());
    if (y.numel() == 0) return y;
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
    if (y.numel() == 0) return y;
    int rc = dl_int4_mm(xc.data_ptr<float>(), xc.size(0), xc.size(1), nib.data_ptr<uint8_t>(),
                        sc.data_ptr<float>(), sh.data_ptr<float>(), g, y.data_ptr<float>(), nib.size(0));
    TORCH_CHECK(rc == 0, "decodelab native int4 kernel: out of memory for the activation codes");
    return y;
}

// int4_mm of rms_norm(x): the norm (dl_rms_norm, the operator rms_norm's arithmetic) computed
// into a scratch of x's size first, so that a compiled graph calls one operator where an RMSNorm
// feeds an int4 product (models/transformer.py `share_kernels`).
at::Tensor int4_mm_normed(const at::Tensor& x, const at::Tensor& nib, const at::Tensor& scales,
                          const at::Tensor& shifts, int64_t g, const at::Tensor& norm_w, double eps, double offset) {
    check_codes(nib, at::kByte, 32);
    int64_t k = nib.size(1) * 2;
    auto xc = rows_f32(x, k), wc = norm_weight(norm_w, k, "decodelab int4_mm_normed: the norm's ");
    auto xn = at::empty_like(xc);
    if (xc.numel()) dl_rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), xc.size(0), k, (float)eps, (float)offset,
                                xn.data_ptr<float>());
    return int4_mm(xn, nib, scales, shifts, g);
}

// One int4 projection's tensors as an operator receives them (codes, scales, shifts), checked
// against its input size k (0: any) and group size g; returns its output rows.
struct Int4W {
    const at::Tensor& nib;
    const at::Tensor& sc;
    const at::Tensor& sh;
    const at::Tensor& operator[](int i) const { return i == 0 ? nib : i == 1 ? sc : sh; }
};

static int64_t int4_weight(const Int4W& w, int64_t k, int64_t g, const char* who) {
    check_codes(w[0], at::kByte, 32);
    TORCH_CHECK(k == 0 || w[0].size(1) * 2 == k, who, ": a weight of ", w[0].size(1) * 2, " inputs where ", k,
                " come in");
    check_groups(w[0], w[1], w[2], g);
    TORCH_CHECK(w[1].scalar_type() == at::kFloat && w[2].scalar_type() == at::kFloat && w[1].is_contiguous() &&
                w[2].is_contiguous(), who, ": scales and shifts must be contiguous float32");
    return w[0].size(0);
}

// What a profiler records of a product inside a fused operator: x [M, K] and the codes, as the
// inputs of a decodelab::int4_mm event (experiments/micro_weights.py `classify` reads their shapes)
static std::vector<c10::IValue> product_inputs(const float* x, int64_t M, int64_t K, const at::Tensor& nib) {
    return {at::from_blob(const_cast<float*>(x), {M, K}, at::TensorOptions().dtype(at::kFloat)), nib};
}

// y[M, N] = x[M, K] @ an int4 weight (int4_weight's tensors), into y; a profiler sees it as a
// decodelab::int4_mm of its own
static void int4_into(const float* x, int64_t M, int64_t K, const Int4W& w, int64_t g, float* y, const char* who) {
    RECORD_FUNCTION("decodelab::int4_mm", product_inputs(x, M, K, w[0]));
    int rc = dl_int4_mm(x, M, K, w[0].data_ptr<uint8_t>(), w[1].data_ptr<float>(), w[2].data_ptr<float>(), g, y,
                        w[0].size(0));
    TORCH_CHECK(rc == 0, who, ": out of memory for the activation codes");
}

// A float32 buffer of n values: up to HELD values one that lives across calls on this thread (no
// allocation per call: a decode step's rows), past that `keep`, a tensor of the call's own (a
// prefill-sized product does not leave its buffers behind)
static constexpr int64_t HELD = 1 << 18;

static float* held(int slot, int64_t n, at::Tensor& keep) {
    static thread_local std::vector<float> bufs[3];
    if (n > HELD) {
        keep = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
        return keep.data_ptr<float>();
    }
    if ((int64_t)bufs[slot].size() < n) bufs[slot].resize(n);
    return bufs[slot].data();
}

// The half-rotation RoPE of one head's D channels in place: x * cos + rotate_half(x) * sin, each
// product rounded and then the sum (models/transformer.py apply_rope's three operations, no fused
// multiply-add: the same bits)
__attribute__((optimize("fp-contract=off")))
static void rope_head(float* x, const float* c, const float* s, int64_t D) {
    int64_t h = D / 2;
    float tmp[512];
    for (int64_t d = 0; d < D; d++) tmp[d] = x[d];
    for (int64_t d = 0; d < h; d++) {
        float a = tmp[d] * c[d], b = (-tmp[d + h]) * s[d];
        x[d] = a + b;
    }
    for (int64_t d = h; d < D; d++) {
        float a = tmp[d] * c[d], b = tmp[d - h] * s[d];
        x[d] = a + b;
    }
}

// A Llama block's attention input in one operator: qkv = int4(rms_norm(x)) (+ bias), then the
// half-rotation RoPE of the q and k heads at each row's cos, sin [M, D] (v as computed): the
// same bits as those steps one by one (models/transformer.py Attention, `fused`).
at::Tensor int4_qkv_rope(const at::Tensor& x, const at::Tensor& norm_w, double eps, double offset,
                         const at::Tensor& nib, const at::Tensor& scales, const at::Tensor& shifts, int64_t g,
                         const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                         const at::Tensor& sin, int64_t q_size, int64_t kv_size, int64_t head_dim) {
    const char* who = "decodelab int4_qkv_rope";
    Int4W w{nib, scales, shifts};
    int64_t N = int4_weight(w, 0, g, who), K = w[0].size(1) * 2;
    auto xc = rows_f32(x, K), wc = norm_weight(norm_w, K, "decodelab int4_qkv_rope: the norm's ");
    int64_t M = xc.size(0), D = head_dim;
    TORCH_CHECK(D > 0 && D % 2 == 0 && D <= 512 && q_size > 0 && kv_size > 0 && q_size % D == 0 && kv_size % D == 0 && q_size + 2 * kv_size == N,
                who, ": q ", q_size, " + 2 x kv ", kv_size, " (both > 0) must be the weight's ", N, " outputs, in heads of an ",
                "even head size <= 512, got ", D);
    TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                cos.size(0) == M && cos.size(1) == D && sin.sizes() == cos.sizes(), who,
                ": cos and sin must be float32 [", M, ", ", D, "], got ", cos.sizes(), " and ", sin.sizes());
    at::Tensor b;
    if (bias.has_value() && bias->defined()) {
        b = f32(*bias);
        TORCH_CHECK(b.numel() == N, who, ": bias must have ", N, " values");
    }
    auto y = at::empty({M, N}, xc.options());
    if (M == 0) return y;
    at::Tensor keep;
    float* xn = held(0, M * K, keep);
    dl_rms_norm(xc.data_ptr<float>(), wc.data_ptr<float>(), M, K, (float)eps, (float)offset, xn);
    float* yp = y.data_ptr<float>();
    int4_into(xn, M, K, w, g, yp, who);
    auto cc = cos.contiguous(), sc = sin.contiguous();
    const float *cp = cc.data_ptr<float>(), *sp = sc.data_ptr<float>(), *bp = b.defined() ? b.data_ptr<float>() : nullptr;
    for (int64_t m = 0; m < M; m++) {
        float* row = yp + m * N;
        if (bp)
            for (int64_t n = 0; n < N; n++) row[n] += bp[n];
        for (int64_t h = 0; h < (q_size + kv_size) / D; h++) rope_head(row + h * D, cp + m * D, sp + m * D, D);
    }
    return y;
}

// out = a + b and out = a * b over n floats: one rounding each, as ATen's add (alpha 1) and mul
// give them, without an ATen call's overhead per step (int4_block_out's residual adds and SiLU x up)
static void add_rows(const float* a, const float* b, float* out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

static void mul_rows(const float* a, const float* b, float* out, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
}

// ATen's own exp of 8 floats on AVX2 (libtorch_cpu's Sleef, which its AVX2 kernels call)
extern "C" __m256 Sleef_expf8_u10avx2(__m256);

// Whether `silu_rows` over M rows of n floats gives ATen's SiLU bits: where ATen runs its AVX2
// kernels (an AVX-512 machine runs its AVX-512 ones) on rows of a multiple of 16 floats (ATen's
// vectorized loop takes 16 at a time: no scalar tail, whose exp is libm's) and fewer values than
// ATen's grain (one thread walks the rows whole; a split among threads may cut a row anywhere).
// Checked on all 2^32 floats against torch's silu (experiments/results/roofline-s53/silu/).
static bool silu_rows_match_aten(int64_t M, int64_t n) {
    static const bool avx2 = at::get_cpu_capability() == "AVX2";
    return avx2 && n % 16 == 0 && M * n < at::internal::GRAIN_SIZE;
}

// out = x / (1 + exp(-x)) over n floats (n % 16 == 0): ATen's vectorized SiLU on AVX2, its
// operations in its order, without an ATen call's set-up (int4_block_out's SiLU)
static void silu_rows(const float* x, float* out, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(out + i, _mm256_div_ps(v, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_xor_ps(v, sign)))));
    }
}

// A Llama block after its attention in one operator: x1 = x + int4_wo(attn), then
// x1 + int4_down(silu(gate) * up) with [gate, up] = int4_gate_up(rms_norm(x1)): the same bits as
// those steps one by one (the SiLU is ATen's own kernel, or its AVX2 arithmetic through ATen's own
// exp: `silu_rows`; the residual adds and the product round once each, as ATen's do)
// (models/transformer.py Block, `fused`).
at::Tensor int4_block_out(const at::Tensor& attn, const at::Tensor& x, const at::Tensor& wo_nib,
                          const at::Tensor& wo_scales, const at::Tensor& wo_shifts, int64_t wo_g,
                          const at::Tensor& norm_w, double eps, double offset, const at::Tensor& gu_nib,
                          const at::Tensor& gu_scales, const at::Tensor& gu_shifts, int64_t gu_g,
                          const at::Tensor& down_nib, const at::Tensor& down_scales, const at::Tensor& down_shifts,
                          int64_t down_g) {
    const char* who = "decodelab int4_block_out";
    Int4W wo{wo_nib, wo_scales, wo_shifts}, gate_up{gu_nib, gu_scales, gu_shifts}, down{down_nib, down_scales,
                                                                                     down_shifts};
    at::AutoDispatchBelowAutograd below;  // its ATen steps run as kernels (the operator has no autograd)
    int64_t dim = int4_weight(wo, 0, wo_g, who), Q = wo[0].size(1) * 2;
    int64_t I2 = int4_weight(gate_up, dim, gu_g, who), I = I2 / 2;
    TORCH_CHECK(I2 % 2 == 0 && int4_weight(down, I, down_g, who) == dim, who, ": gate_up's outputs (", I2,
                ") must be twice down's inputs and down's outputs wo's (", dim, ")");
    auto ac = rows_f32(attn, Q), xc = rows_f32(x, dim);
    auto wc = norm_weight(norm_w, dim, "decodelab int4_block_out: the norm's ");
    int64_t M = ac.size(0);
    TORCH_CHECK(xc.size(0) == M, who, ": attn and x must have the same rows, got ", M, " and ", xc.size(0));
    auto y = at::empty({M, dim}, xc.options());
    if (M == 0) return y;
    auto o = xc.options();
    at::Tensor keep[3];
    float* h = held(0, M * dim, keep[0]);
    int4_into(ac.data_ptr<float>(), M, Q, wo, wo_g, h, who);
    float* yp = y.data_ptr<float>();
    add_rows(xc.data_ptr<float>(), h, yp, M * dim);  // x1, in y
    float* xn = held(1, M * dim, keep[1]);
    dl_rms_norm(yp, wc.data_ptr<float>(), M, dim, (float)eps, (float)offset, xn);
    float* gu = held(2, M * I2 + M * I, keep[2]);
    int4_into(xn, M, dim, gate_up, gu_g, gu, who);
    float* ap = gu + M * I2;
    if (silu_rows_match_aten(M, I)) {
        for (int64_t m = 0; m < M; m++) silu_rows(gu + m * I2, ap + m * I, I);
    } else {  // ATen's SiLU itself: its exp, its bits
        at::Tensor gut = at::from_blob(gu, {M, I2}, o), act = at::from_blob(ap, {M, I}, o);
        at::silu_out(act, gut.narrow(1, 0, I));
    }
    for (int64_t m = 0; m < M; m++) mul_rows(ap + m * I, gu + m * I2 + I, ap + m * I, I);
    int4_into(ap, M, I, down, down_g, h, who);
    add_rows(yp, h, yp, M * dim);
    return y;
}

// torch.argmax(x, -1) of a float32 CPU tensor (a greedy step's logits [B, V]): each row's first
// largest value's index, int64 [...]; a row holding a NaN is torch's own argmax of it (its rule)
at::Tensor argmax(const at::Tensor& x) {
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "decodelab argmax: x must be a float32 CPU tensor with a non-empty last dimension, got ",
                x.scalar_type(), " ", x.sizes(), " on ", x.device());
    auto xc = x.contiguous();
    int64_t n = xc.size(-1), rows = xc.numel() / n;
    auto out = at::empty(xc.sizes().slice(0, xc.dim() - 1), xc.options().dtype(at::kLong));
    const float* p = xc.data_ptr<float>();
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = dl_argmax(p + r * n, n);
        o[r] = i >= 0 ? i : xc.view({rows, n})[r].argmax().item<int64_t>();
    }
    return out;
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

// How the decode kernels read stored K/V (dl_decode_attn's kind), and each kv head's scale.
static int kv_kind(const at::Tensor& kv, const char* who) {
    switch (kv.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        case at::kFloat8_e4m3fn: return 3;
        default: TORCH_CHECK(false, who, ": keys and values must be float32, bfloat16, float16 or float8_e4m3fn, got ",
                             kv.scalar_type());
    }
    return -1;
}

static at::Tensor head_scales(const std::optional<at::Tensor>& s, int64_t Hkv, const char* who) {
    if (!s.has_value()) return at::Tensor();
    TORCH_CHECK(s->numel() == Hkv && s->device().is_cpu(), who, ": one scale per kv head (", Hkv, "), on the CPU");
    return s->to(at::kFloat).contiguous();
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                            const at::Tensor& pos, double scale, int64_t window,
                            const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
    TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                "decodelab decode_attention: q [B, Hq, T, D], keys and values [B, Hkv, S, D]");
    int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = keys.size(1), S = keys.size(2);
    TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0,
                "decodelab decode_attention: shapes q ", q.sizes(), " keys ", keys.sizes());
    int kind = kv_kind(keys, "decodelab decode_attention");
    TORCH_CHECK(q.scalar_type() == at::kFloat && values.scalar_type() == keys.scalar_type() && keys.is_contiguous() &&
                values.is_contiguous() && keys.device().is_cpu(),
                "decodelab decode_attention: float32 q, contiguous CPU keys and values of one dtype");
    auto ksc = head_scales(k_scale, Hkv, "decodelab decode_attention"),
         vsc = head_scales(v_scale, Hkv, "decodelab decode_attention");
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == T,
                "decodelab decode_attention: pos must be [B, T] = [", B, ", ", T, "]");
    TORCH_CHECK(q.device().is_cpu() && values.device().is_cpu() && pos.device().is_cpu(),
                "decodelab decode_attention: q, keys, values and pos must be CPU tensors");
    auto qc = q.contiguous();
    auto pc = pos.to(at::kLong).contiguous();
    auto out = at::empty({B, Hq, T, D}, q.options());
    if (out.numel() == 0 || S == 0) return out.zero_();
    int rc = dl_decode_attn(qc.data_ptr<float>(), keys.data_ptr(), values.data_ptr(), pc.data_ptr<int64_t>(), B, Hq,
                            Hkv, T, S, D, (float)scale, window, out.data_ptr<float>(), nullptr, 0, 0, 0, kind,
                            ksc.defined() ? ksc.data_ptr<float>() : nullptr,
                            vsc.defined() ? vsc.data_ptr<float>() : nullptr);
    TORCH_CHECK(rc == 0, "decodelab decode_attention: out of memory for the scores");
    return out;
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& table, const at::Tensor& pos, double scale, int64_t window,
                                  const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
    TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() && table.dim() == 2,
                "decodelab paged_decode_attention: q [B, Hq, T, D], pools [Hkv, N, bs, D], table [B, M]");
    int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k_pool.size(0);
    int64_t N = k_pool.size(1), bs = k_pool.size(2), M = table.size(1), S = M * bs;
    TORCH_CHECK(table.size(0) == B && k_pool.size(3) == D && Hkv > 0 && Hq % Hkv == 0 && D % 8 == 0 && bs > 0 &&
                N > 0,
                "decodelab paged_decode_attention: shapes q ", q.sizes(), " pools ", k_pool.sizes(), " table ",
                table.sizes());
    int kind = kv_kind(k_pool, "decodelab paged_decode_attention");
    TORCH_CHECK(q.scalar_type() == at::kFloat && v_pool.scalar_type() == k_pool.scalar_type() &&
                k_pool.is_contiguous() && v_pool.is_contiguous(),
                "decodelab paged_decode_attention: float32 q, contiguous pools of one dtype");
    auto ksc = head_scales(k_scale, Hkv, "decodelab paged_decode_attention"),
         vsc = head_scales(v_scale, Hkv, "decodelab paged_decode_attention");
    TORCH_CHECK(pos.dim() == 2 && pos.size(0) == B && pos.size(1) == T,
                "decodelab paged_decode_attention: pos must be [B, T] = [", B, ", ", T, "]");
    TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu() &&
                table.device().is_cpu() && pos.device().is_cpu(),
                "decodelab paged_decode_attention: CPU tensors only");
    auto qc = q.contiguous();
    auto pc = pos.to(at::kLong).contiguous();
    auto tc = table.to(at::kLong).contiguous();
    if (tc.numel() > 0) {
        int64_t lo = tc.min().item<int64_t>(), hi = tc.max().item<int64_t>();
        TORCH_CHECK(lo >= -1 && hi < N, "decodelab paged_decode_attention: block ids must lie in [0, ", N,
                    ") (or be -1: no block)");
    }
    auto out = at::empty({B, Hq, T, D}, q.options());
    if (out.numel() == 0 || S == 0) return out.zero_();
    int rc = dl_decode_attn(qc.data_ptr<float>(), k_pool.data_ptr(), v_pool.data_ptr(), pc.data_ptr<int64_t>(), B, Hq,
                            Hkv, T, S, D, (float)scale, window, out.data_ptr<float>(), tc.data_ptr<int64_t>(), M, bs,
                            N, kind, ksc.defined() ? ksc.data_ptr<float>() : nullptr,
                            vsc.defined() ? vsc.data_ptr<float>() : nullptr);
    TORCH_CHECK(rc == 0, "decodelab paged_decode_attention: out of memory for the scores");
    return out;
}

// One int4 cache layer's stores, row by row (cache/kernels/int4.py's Int4Rows), checked
// against the shapes the kernel reads: see dl_int4_decode_attn.
at::Tensor int4_decode_attention(const at::Tensor& q, at::TensorList kd, at::TensorList ks, at::TensorList ko,
                                 at::TensorList vd, at::TensorList vs, at::TensorList vo, at::TensorList ke,
                                 at::TensorList ve, at::IntArrayRef spans, const at::Tensor& qpos,
                                 const at::Tensor& vis, double scale, int64_t window, int64_t kg, int64_t vg) {
    const char* w = "decodelab int4_decode_attention: ";
    TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.device().is_cpu(), w,
                "q must be a float32 CPU tensor [B, Hq, T, D], got ", q.sizes(), " ", q.scalar_type());
    int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3);
    TORCH_CHECK((int64_t)kd.size() == B && (int64_t)ks.size() == B && (int64_t)ko.size() == B &&
                (int64_t)vd.size() == B && (int64_t)vs.size() == B && (int64_t)vo.size() == B &&
                (int64_t)ke.size() == B && (int64_t)ve.size() == B, w, "one store of each kind per row (", B, ")");
    TORCH_CHECK(D % 8 == 0 && kg % 32 == 0 && kg > 0 && vg > 0 && vg % 16 == 0 && D % vg == 0, w,
                "head size ", D, " (a multiple of 8) with key group ", kg, " (a multiple of 32: the keys are read in "
                "blocks of 16 byte rows) and value group ", vg, " (a multiple of 16 dividing D)");
    TORCH_CHECK((int64_t)spans.size() == 5 * B && qpos.dim() == 2 && qpos.size(0) == B && qpos.size(1) == T &&
                vis.sizes() == qpos.sizes(), w, "5 spans per row, qpos and vis [B, T]");
    int64_t Hkv = B ? ke[0].size(0) : 1;
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, w, Hq, " query heads over ", Hkv, " kv heads");
    at::ScalarType st = B ? ks[0].scalar_type() : at::kHalf;
    int skind = st == at::kHalf ? 0 : st == at::kBFloat16 ? 1 : st == at::kFloat ? 2 : -1;
    TORCH_CHECK(skind >= 0, w, "scales must be float16, bfloat16 or float32, got ", st);
    auto qp = qpos.to(at::kLong).contiguous(), vp = vis.to(at::kLong).contiguous();
    std::vector<at::Tensor> keep;
    std::vector<const uint8_t*> kdp(B), vdp(B);
    std::vector<const void*> ksp(B), kop(B), vsp(B), vop(B);
    std::vector<const float*> kep(B), vep(B);
    std::vector<int64_t> meta(B * 9);
    auto c = [&](const at::Tensor& t) { keep.push_back(t.contiguous()); return keep.back().data_ptr(); };
    // an exact store may be a view of a wider buffer (cache/int4.py appends in place): rows of D
    // contiguous floats, any stride between heads, read where it lies
    auto rows_of = [&](const at::Tensor& t, int64_t* stride) {
        if (t.stride(2) == 1 && t.stride(1) == D && (t.size(0) == 1 || t.stride(0) >= t.size(1) * D)) {
            *stride = t.size(0) == 1 ? t.size(1) * D : t.stride(0);
            return (const float*)t.data_ptr();
        }
        *stride = t.size(1) * D;
        return (const float*)c(t);
    };
    for (int64_t b = 0; b < B; b++) {
        int64_t N = vd[b].dim() == 4 ? vd[b].size(1) : -1, E = ke[b].dim() == 3 ? ke[b].size(1) : -1;
        TORCH_CHECK(N >= 0 && N % kg == 0 && kd[b].sizes() == at::IntArrayRef({Hkv, N / kg, kg / 2, D}) &&
                    ks[b].sizes() == at::IntArrayRef({Hkv, N / kg, 1, D}) && ko[b].sizes() == ks[b].sizes() &&
                    vd[b].sizes() == at::IntArrayRef({Hkv, N, D / vg, vg / 2}) &&
                    vs[b].sizes() == at::IntArrayRef({Hkv, N, D / vg, 1}) && vo[b].sizes() == vs[b].sizes(), w,
                    "row ", b, ": quantized stores of ", N, " tokens must be keys per channel [", Hkv, ", N/", kg,
                    ", ", kg / 2, ", ", D, "] and values per token [", Hkv, ", N, ", D / vg, ", ", vg / 2, "]");
        TORCH_CHECK(kd[b].scalar_type() == at::kByte && vd[b].scalar_type() == at::kByte &&
                    ks[b].scalar_type() == st && ko[b].scalar_type() == st && vs[b].scalar_type() == st &&
                    vo[b].scalar_type() == st, w, "row ", b, ": uint8 codes and ", st, " scales and shifts");
        TORCH_CHECK(E >= 0 && ke[b].sizes() == at::IntArrayRef({Hkv, E, D}) && ve[b].sizes() == ke[b].sizes() &&
                    ke[b].scalar_type() == at::kFloat && ve[b].scalar_type() == at::kFloat, w, "row ", b,
                    ": exact stores must be float32 [", Hkv, ", E, ", D, "]");
        const int64_t* m = spans.data() + b * 5;  // dequant_from, dequant_to, exact_from, exact_to, p0
        TORCH_CHECK(0 <= m[0] && m[0] <= m[1] && m[1] <= N && (m[3] <= m[2] || (m[4] <= m[2] && m[3] <= m[4] + E)),
                    w, "row ", b, ": spans [", m[0], ", ", m[1], ") quantized of ", N, " and [", m[2], ", ", m[3],
                    ") exact of [", m[4], ", ", m[4] + E, ") are not held");
        for (int k = 0; k < 5; k++) meta[b * 9 + k] = m[k];
        meta[b * 9 + 5] = N;
        meta[b * 9 + 6] = E;
        kdp[b] = (const uint8_t*)c(kd[b]); ksp[b] = c(ks[b]); kop[b] = c(ko[b]);
        vdp[b] = (const uint8_t*)c(vd[b]); vsp[b] = c(vs[b]); vop[b] = c(vo[b]);
        kep[b] = rows_of(ke[b], &meta[b * 9 + 7]); vep[b] = rows_of(ve[b], &meta[b * 9 + 8]);
        TORCH_CHECK(kd[b].device().is_cpu() && vd[b].device().is_cpu() && ke[b].device().is_cpu() &&
                    ve[b].device().is_cpu() && ks[b].device().is_cpu() && vs[b].device().is_cpu(), w,
                    "CPU tensors only");
    }
    auto qc = q.contiguous();
    auto out = at::empty({B, Hq, T, D}, q.options());
    if (out.numel() == 0) return out;
    int rc = dl_int4_decode_attn(qc.data_ptr<float>(), B, Hq, Hkv, T, D, kdp.data(), ksp.data(), kop.data(),
                                 vdp.data(), vsp.data(), vop.data(), skind, kep.data(), vep.data(), meta.data(),
                                 qp.data_ptr<int64_t>(), vp.data_ptr<int64_t>(), (float)scale, window, kg, vg,
                                 out.data_ptr<float>());
    TORCH_CHECK(rc == 0, w, "out of memory for the scores");
    return out;
}

// A compiled step's int4 layer in one call: each row's exact stores taken extra[b] tokens
// past their ends (the slots the cache holds there without having grown its views:
// cache/int4.py's booked steps; 0 where the views already cover them), the row's first
// fresh[b] new K/V (k, v [B, Hkv, T, D]) written into the last fresh[b] of those slots, then
// int4_decode_attention over the stores. spans: 6 per row, int4_decode_attention's 5 and
// extra. Every slot written or read is checked to lie in the store's storage.
at::Tensor int4_store_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::IntArrayRef fresh,
                             at::TensorList kd, at::TensorList ks, at::TensorList ko, at::TensorList vd,
                             at::TensorList vs, at::TensorList vo, at::TensorList ke, at::TensorList ve,
                             at::IntArrayRef spans, const at::Tensor& qpos, const at::Tensor& vis, double scale,
                             int64_t window, int64_t kg, int64_t vg) {
    const char* w = "decodelab int4_store_attend: ";
    int64_t B = q.dim() == 4 ? q.size(0) : -1;
    TORCH_CHECK(B >= 0 && k.dim() == 4 && k.size(0) == B && v.sizes() == k.sizes() && k.scalar_type() == at::kFloat &&
                v.scalar_type() == at::kFloat && k.device().is_cpu() && v.device().is_cpu(), w,
                "k and v must be float32 CPU tensors [B, Hkv, T, D] of q's B, got ", k.sizes(), " and ", v.sizes());
    TORCH_CHECK((int64_t)fresh.size() == B && (int64_t)ke.size() == B && (int64_t)ve.size() == B &&
                (int64_t)spans.size() == 6 * B, w,
                "one count of new tokens, one exact store of each kind and 6 spans per row (", B, ")");
    int64_t H = k.size(1), T = k.size(2), D = k.size(3);
    auto kc = k.contiguous(), vc = v.contiguous();
    std::vector<at::Tensor> kg_(B), vg_(B);
    std::vector<int64_t> sp(5 * B);
    for (int64_t b = 0; b < B; b++) {
        int64_t n = fresh[b], extra = spans[6 * b + 5];
        for (int i = 0; i < 5; i++) sp[5 * b + i] = spans[6 * b + i];
        for (int kind = 0; kind < 2; kind++) {
            const at::Tensor& s = kind ? ve[b] : ke[b];
            TORCH_CHECK(0 <= n && n <= T && extra >= 0 && s.dim() == 3 && s.size(0) == H && s.size(2) == D &&
                        s.size(1) + extra >= n && s.scalar_type() == at::kFloat && s.device().is_cpu() &&
                        s.stride(2) == 1 && s.stride(1) == D && (H == 1 || s.stride(0) >= D), w, "row ", b, ": ", n,
                        " new tokens of ", T, " into an exact store ", s.sizes(), " held ", extra,
                        " tokens past its end (float32 rows of ", D, " contiguous values, room for them)");
            int64_t E = s.size(1) + extra;
            int64_t last = s.storage_offset() + (H - 1) * s.stride(0) + E * D;  /* one past the last element */
            TORCH_CHECK(last * (int64_t)sizeof(float) <= (int64_t)s.storage().nbytes(), w, "row ", b,
                        ": an exact store held ", extra, " tokens past its end runs past its storage");
            at::Tensor g = extra ? s.as_strided({H, E, D}, {s.stride(0), D, 1}) : s;
            float* dst = g.data_ptr<float>() + (E - n) * D;
            const float* src = (kind ? vc : kc).data_ptr<float>() + b * H * T * D;
            for (int64_t h = 0; h < H; h++)
                std::memcpy(dst + h * g.stride(0), src + h * T * D, sizeof(float) * n * D);
            (kind ? vg_ : kg_)[b] = g;
        }
    }
    return int4_decode_attention(q, kd, ks, ko, vd, vs, vo, kg_, vg_, sp, qpos, vis, scale, window, kg, vg);
}

// A compiled step's int4 attention without Python in between (cache/int4.py's booked steps):
// per HostPlan (its handle), each layer's stores and options and, per window slot, each
// step's new-token counts, spans and queries, bound from Python when they change
// (int4_host_layer, int4_host_step), and which layers this step may attend (int4_host_arm).
// int4_host_attend(q, k, v, layer, handle) then runs int4_store_attend on what is bound, or,
// for a layer armed with nothing, calls decodelab::host_attend (the Python path).
namespace {
struct BoundLayer {
    std::vector<at::Tensor> st[8];  // key codes, scales, shifts, value codes, scales, shifts, exact keys, values
    int64_t slot = 0, window = 0, kg = 0, vg = 0;
    double scale = 0;
};
struct BoundStep {
    std::vector<int64_t> fresh, spans;
    at::Tensor qpos, vis;
};
struct HostState {
    std::vector<std::shared_ptr<BoundLayer>> layers;
    std::vector<std::shared_ptr<BoundStep>> slots;
    std::vector<char> armed;  // per layer: 0 the Python path, 1 bound for this step, 2 attended this step
};
std::mutex host_mu;
std::unordered_map<int64_t, HostState> host_states;
}  // namespace

void int4_host_layer(int64_t handle, int64_t layer, int64_t slot, at::TensorList kd, at::TensorList ks,
                     at::TensorList ko, at::TensorList vd, at::TensorList vs, at::TensorList vo, at::TensorList ke,
                     at::TensorList ve, double scale, int64_t window, int64_t kg, int64_t vg) {
    TORCH_CHECK(layer >= 0 && slot >= 0, "decodelab int4_host_layer: layer and slot must be >= 0");
    auto b = std::make_shared<BoundLayer>();
    at::TensorList lists[8] = {kd, ks, ko, vd, vs, vo, ke, ve};
    for (int i = 0; i < 8; i++) b->st[i] = lists[i].vec();
    b->slot = slot; b->window = window; b->kg = kg; b->vg = vg; b->scale = scale;
    std::lock_guard<std::mutex> g(host_mu);
    auto& h = host_states[handle];
    if ((int64_t)h.layers.size() <= layer) h.layers.resize(layer + 1);
    h.layers[layer] = std::move(b);
}

void int4_host_step(int64_t handle, int64_t slot, at::IntArrayRef fresh, at::IntArrayRef spans, const at::Tensor& qpos,
                    const at::Tensor& vis) {
    TORCH_CHECK(slot >= 0, "decodelab int4_host_step: slot must be >= 0");
    auto s = std::make_shared<BoundStep>();
    s->fresh = fresh.vec(); s->spans = spans.vec(); s->qpos = qpos; s->vis = vis;
    std::lock_guard<std::mutex> g(host_mu);
    auto& h = host_states[handle];
    if ((int64_t)h.slots.size() <= slot) h.slots.resize(slot + 1);
    h.slots[slot] = std::move(s);
}

void int4_host_arm(int64_t handle, at::IntArrayRef layers) {
    std::lock_guard<std::mutex> g(host_mu);
    auto& h = host_states[handle];
    h.armed.assign(layers.size(), 0);
    for (size_t i = 0; i < layers.size(); i++) {
        bool bound = layers[i] && (int64_t)i < (int64_t)h.layers.size() && h.layers[i] &&
                     h.layers[i]->slot < (int64_t)h.slots.size() && h.slots[h.layers[i]->slot];
        TORCH_CHECK(!layers[i] || bound, "decodelab int4_host_arm: layer ", i, " armed with nothing bound");
        h.armed[i] = layers[i] ? 1 : 0;
    }
}

void int4_host_drop(int64_t handle) {
    std::lock_guard<std::mutex> g(host_mu);
    host_states.erase(handle);
}

at::Tensor int4_host_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t layer,
                            const at::Tensor& handle) {
    int64_t key = handle.item<int64_t>();
    std::shared_ptr<BoundLayer> b;
    std::shared_ptr<BoundStep> s;
    {
        std::lock_guard<std::mutex> g(host_mu);
        auto it = host_states.find(key);
        if (it != host_states.end() && layer >= 0 && layer < (int64_t)it->second.armed.size() &&
            it->second.armed[layer]) {
            TORCH_CHECK(it->second.armed[layer] == 1, "layer ", layer, " attended twice on one booked step: its K/V ",
                        "would be stored twice; book every step (HostPlan.book) before running it");
            it->second.armed[layer] = 2;
            b = it->second.layers[layer];
            s = it->second.slots[b->slot];
        }
    }
    if (!b) {
        static auto python = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("decodelab::host_attend", "")
                                 .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                   const at::Tensor&)>();
        return python.call(q, k, v, layer, handle);
    }
    at::Tensor out = int4_store_attend(q, k, v, s->fresh, b->st[0], b->st[1], b->st[2], b->st[3], b->st[4], b->st[5],
                                       b->st[6], b->st[7], s->spans, s->qpos, s->vis, b->scale, b->window, b->kg,
                                       b->vg);
    if (out.strides() == q.strides()) return out;
    return at::empty_like(q).copy_(out);  // the layout the graph reads it by (q's: its fake's)
}

TORCH_LIBRARY(decodelab, m) {
    m.def("int8_mm(Tensor x, Tensor codes, Tensor scales) -> Tensor");
    m.def("f32_mv(Tensor x, Tensor w, Tensor? bias=None) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor w, float eps, float offset) -> Tensor");
    m.def("int4_mm_normed(Tensor x, Tensor nib, Tensor scales, Tensor shifts, int group_size, Tensor norm_w, float eps, float offset) -> Tensor");
    m.def("rope_cos_sin(Tensor inv_freq, Tensor positions) -> (Tensor, Tensor)");
    m.def("int4_qkv_rope(Tensor x, Tensor norm_w, float eps, float offset, Tensor nib, Tensor scales, Tensor shifts, "
          "int group_size, Tensor? bias, Tensor cos, Tensor sin, int q_size, int kv_size, int head_dim) -> Tensor");
    m.def("int4_block_out(Tensor attn, Tensor x, Tensor wo_nib, Tensor wo_scales, Tensor wo_shifts, int wo_group, "
          "Tensor norm_w, float eps, float offset, Tensor gate_up_nib, Tensor gate_up_scales, Tensor gate_up_shifts, "
          "int gate_up_group, Tensor down_nib, Tensor down_scales, Tensor down_shifts, int down_group) -> Tensor");
    m.def("isa(int set=-1) -> int");
    m.def("argmax(Tensor x) -> Tensor");
    m.def("int4_mm(Tensor x, Tensor nib, Tensor scales, Tensor shifts, int group_size) -> Tensor");
    m.def("int8_dequant(Tensor codes, Tensor scales, int o0, int n, Tensor(a!) out) -> ()");
    m.def("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor pos, float scale, int window, "
          "Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
    m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor table, Tensor pos, float scale, "
          "int window, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor");
    m.def("int4_dequant(Tensor nib, Tensor scales, Tensor shifts, int group_size, int o0, int n, "
          "Tensor(a!) out) -> ()");
    m.def("int4_decode_attention(Tensor q, Tensor[] kd, Tensor[] ks, Tensor[] ko, Tensor[] vd, Tensor[] vs, "
          "Tensor[] vo, Tensor[] ke, Tensor[] ve, int[] spans, Tensor qpos, Tensor vis, float scale, int window, "
          "int key_group, int value_group) -> Tensor");
    m.def("int4_store_attend(Tensor q, Tensor k, Tensor v, int[] fresh, Tensor[] kd, Tensor[] ks, Tensor[] ko, "
          "Tensor[] vd, Tensor[] vs, Tensor[] vo, Tensor(a!)[] ke, Tensor(b!)[] ve, int[] spans, Tensor qpos, "
          "Tensor vis, float scale, int window, int key_group, int value_group) -> Tensor");
    m.def("int4_host_layer(int handle, int layer, int slot, Tensor[] kd, Tensor[] ks, Tensor[] ko, Tensor[] vd, "
          "Tensor[] vs, Tensor[] vo, Tensor[] ke, Tensor[] ve, float scale, int window, int key_group, "
          "int value_group) -> ()");
    m.def("int4_host_step(int handle, int slot, int[] fresh, int[] spans, Tensor qpos, Tensor vis) -> ()");
    m.def("int4_host_arm(int handle, int[] layers) -> ()");
    m.def("int4_host_drop(int handle) -> ()");
    m.def("int4_host_attend(Tensor q, Tensor k, Tensor v, int layer, Tensor handle) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodelab, CompositeExplicitAutograd, m) {
    m.impl("isa", &isa);
    m.impl("int4_host_layer", &int4_host_layer);
    m.impl("int4_host_step", &int4_host_step);
    m.impl("int4_host_arm", &int4_host_arm);
    m.impl("int4_host_drop", &int4_host_drop);
}

TORCH_LIBRARY_IMPL(decodelab, CPU, m) {
    m.impl("int8_mm", &int8_mm);
    m.impl("f32_mv", &f32_mv);
    m.impl("rms_norm", &rms_norm);
    m.impl("int4_mm_normed", &int4_mm_normed);
    m.impl("rope_cos_sin", &rope_cos_sin);
    m.impl("int4_qkv_rope", &int4_qkv_rope);
    m.impl("int4_block_out", &int4_block_out);
    m.impl("int4_mm", &int4_mm);
    m.impl("argmax", &argmax);
    m.impl("int8_dequant", &int8_dequant);
    m.impl("decode_attention", &decode_attention);
    m.impl("paged_decode_attention", &paged_decode_attention);
    m.impl("int4_dequant", &int4_dequant);
    m.impl("int4_decode_attention", &int4_decode_attention);
    m.impl("int4_store_attend", &int4_store_attend);
    m.impl("int4_host_attend", &int4_host_attend);
}
