#include <torch/extension.h>
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10avx2(__m256);
// out = x / (1 + exp(-x)) by 8 lanes with Sleef's expf (u10), as ATen's vectorized SiLU writes it
at::Tensor silu8(const at::Tensor& x) {
    auto out = at::empty_like(x);
    const float* p = x.data_ptr<float>(); float* o = out.data_ptr<float>();
    int64_t n = x.numel();
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(p + i);
        _mm256_storeu_ps(o + i, _mm256_div_ps(v, _mm256_add_ps(one, Sleef_expf8_u10avx2(_mm256_xor_ps(v, sign)))));
    }
    return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("silu8", &silu8); }
