/* The float32 FMA peak of this CPU: every core runs 12 independent chains of 16-wide fused
 * multiply-adds (enough to cover the FMA latency), nothing read from memory.
 *
 *   gcc -O2 -march=native -fopenmp scripts/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 *
 * Needs AVX-512F. Prints GFLOP/s (2 per lane per FMA) for five repeats and the best; the
 * matmul kernels are judged against it (docs/PERFORMANCE.md, "Decode-sized matmuls").
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS 12

int main(int argc, char **argv) {
    (void)argv;
    const long n = 100000000L;
    double best = 0;
    for (int rep = 0; rep < 5; ++rep) {
        float total = 0;
        const double t0 = now();
#pragma omp parallel reduction(+ : total)
        {
            /* values from argc, so that the compiler cannot fold the chains together */
            __m512 a[CHAINS];
            for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_set1_ps((float)(argc + i));
            const __m512 b = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
            for (long k = 0; k < n; ++k)
#pragma GCC unroll 12
                for (int i = 0; i < CHAINS; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
            __m512 s = a[0];
            for (int i = 1; i < CHAINS; ++i) s = _mm512_add_ps(s, a[i]);
            total += _mm512_reduce_add_ps(s);
        }
        const double dt = now() - t0;
        const double gflops = (double)omp_get_max_threads() * n * CHAINS * 16 * 2 / dt / 1e9;
        if (gflops > best) best = gflops;
        printf("%d threads: %.1f GFLOP/s (checksum %g)\n", omp_get_max_threads(), gflops, total);
    }
    printf("best %.1f GFLOP/s\n", best);
    return 0;
}
