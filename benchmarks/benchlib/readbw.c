/* The benchmarks' read-bandwidth probe with software prefetch (benchlib/engines.py compiles it with the host
 * compiler; never part of vxc). torch's sum / mv leave the read to the hardware prefetcher alone, and vxc's
 * streaming kernels, which prefetch, read faster than that on some CPUs: the bound of a "decode / bandwidth
 * bound" column is the fastest read measured, so it must include a read that prefetches. Each thread sums its
 * contiguous share of a (fp32) in 256-byte steps, prefetching the lines pf bytes ahead (pf = 0: no prefetch). */
#include <omp.h>

float vxcb_sum(const float *a, long n, long pf) {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        long nt = omp_get_num_threads(), per = (n / 64 + nt - 1) / nt * 64;
        long lo = omp_get_thread_num() * per, hi = lo + per < n ? lo + per : n;
        float acc[64] = {0};
        for (long i = lo; i + 64 <= hi; i += 64) {
            if (pf)
                for (int l = 0; l < 256; l += 64) __builtin_prefetch((const char *)(a + i) + pf + l, 0, 3);
#pragma omp simd
            for (int j = 0; j < 64; j++) acc[j] += a[i + j];
        }
        for (int j = 0; j < 64; j++) total += acc[j];
    }
    return total;
}
