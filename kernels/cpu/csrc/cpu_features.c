/* Which instruction-set variant of these kernels the running CPU can execute (kernels/cpu/native.py
 * asks the baseline build, then loads the best variant built at install; setup.py).
 *
 * __builtin_cpu_supports reads CPUID and, for AVX and AVX-512, whether the OS saves the wider
 * registers (XGETBV), which /proc/cpuinfo alone does not say on every kernel.
 * Returns 2 (AVX-512 F/BW/DQ/VL + AVX2 + FMA), 1 (AVX2 + FMA), 0 (baseline or not x86-64).
 */
int pagedkv_cpu_level(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return 2;
    return avx2 ? 1 : 0;
#else
    return 0;
#endif
}
