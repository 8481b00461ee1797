// The instruction-set paths tandem's CPU kernels are compiled for, shared by int_dot.cpp and decode_attention.cpp:
// every op takes the path to run (engine/hardware/cpu_kernels.py PATHS; 0 for the best this CPU has), and a path is
// refused where the CPU lacks it. Functions of one path carry its target attribute, so the library loads on any
// x86-64 CPU.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TANDEM_X86 1
#else
#define TANDEM_X86 0
#endif

#define TANDEM_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TANDEM_TARGET_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
// A body inlined into each path's function, and so compiled for its instruction set.
#define TANDEM_INLINE inline __attribute__((always_inline))

namespace {

enum Path : int64_t { kAuto = 0, kScalar = 1, kAvx2 = 2, kAvx512Vnni = 3 };

inline bool cpu_has_avx2() {
#if TANDEM_X86
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

inline bool cpu_has_vnni() {
#if TANDEM_X86
  return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

inline int64_t supported_paths() {
  int64_t mask = 1 << kScalar;
  if (cpu_has_avx2()) mask |= 1 << kAvx2;
  if (cpu_has_vnni()) mask |= 1 << kAvx512Vnni;
  return mask;
}

inline Path resolve(int64_t path) {
  const int64_t mask = supported_paths();
  if (path == kAuto) return (mask & (1 << kAvx512Vnni)) ? kAvx512Vnni : (mask & (1 << kAvx2)) ? kAvx2 : kScalar;
  TORCH_CHECK(path >= kScalar && path <= kAvx512Vnni, "tandem_cpu: unknown path ", path);
  TORCH_CHECK(mask & (1 << path), "tandem_cpu: path ", path, " does not run on this CPU (supported mask ", mask, ")");
  return static_cast<Path>(path);
}

}  // namespace
