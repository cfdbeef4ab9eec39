// dl_decode_attn in a C++ loop: L layers' K/V [1, 3, S, 64] fp32 in turn, 9 query heads, ctx slots;
// per call median over trials of L calls. Usage: attn_bench CTX L TRIALS FLUSH(0/1)
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <chrono>
#include <sys/mman.h>
#include <cstring>
extern "C" int dl_decode_attn(const float* q, const void* k, const void* v, const int64_t* pos, int64_t B, int64_t Hq,
                   int64_t Hkv, int64_t T, int64_t S, int64_t D, float scale, int64_t window, float* out,
                   const int64_t* table, int64_t M, int64_t bs, int64_t N, int kind, const float* kscale,
                   const float* vscale);
extern "C" int dl_set_ab(int);
int main(int argc, char** argv) {
    if (getenv("AB")) dl_set_ab(atoi(getenv("AB")));
    int64_t ctx = atoi(argv[1]), L = atoi(argv[2]), trials = atoi(argv[3]); int flush = atoi(argv[4]);
    const int64_t Hq = 9, Hkv = 3, D = 64, S = 1024;
    int huge = getenv("HUGE") && *getenv("HUGE") == '1';
    size_t per = Hkv * S * D, bytes = 2 * L * per * 4, al = 2 << 20;
    float* all = (float*)aligned_alloc(al, (bytes + al - 1) / al * al);
    if (huge) madvise(all, (bytes + al - 1) / al * al, MADV_HUGEPAGE);
    srand(1);
    std::vector<float*> ksv(L), vsv(L);
    for (int64_t l = 0; l < L; l++) {
        ksv[l] = all + 2 * l * per; vsv[l] = all + (2 * l + 1) * per;
        for (size_t i = 0; i < per; i++) ksv[l][i] = rand() / (float)RAND_MAX - 0.5f;
        for (size_t i = 0; i < per; i++) vsv[l][i] = rand() / (float)RAND_MAX - 0.5f;
    }
    std::vector<float> q(Hq * D), out(Hq * D), big(flush ? (64 << 20) / 4 : 1, 1.f);
    for (auto& x : q) x = rand() / (float)RAND_MAX - 0.5f;
    int64_t pos = ctx - 1;
    std::vector<double> t;
    double sink = 0;
    for (int64_t r = 0; r < trials; r++) {
        if (flush) { float s = 0; for (float x : big) s += x; sink += s; }
        auto t0 = std::chrono::steady_clock::now();
        for (int64_t l = 0; l < L; l++)
            dl_decode_attn(q.data(), ksv[l], vsv[l], &pos, 1, Hq, Hkv, 1, S, D, 0.125f, 0, out.data(),
                           nullptr, 0, 0, 0, 0, nullptr, nullptr);
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / L * 1e6);
    }
    std::sort(t.begin(), t.end());
    double cs = 0; for (float x : out) cs += x;
    printf("ctx %ld L %ld flush %d: %.2f us/call (checksum %.9f", (long)ctx, (long)L, flush, t[t.size() / 2], cs); for (int i = 0; i < 4; i++) printf(" %a", out[i * 37]); printf(")\n");
}
