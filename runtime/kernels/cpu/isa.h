// The native CPU layer's instruction-set tiers: one ordered enum (isa.py mirrors its values; the
// Python side checks BATCH_MANAGER_CPU_ISA and passes the cap down). Each kernel family runs its
// highest tier at or below the cap that is compiled in (#if on the compiler's target features,
// -march=native); isa_mask says which tiers are compiled in and supported by this CPU.
#pragma once

namespace bm {

enum Isa : int {
  kScalar = 0,
  kAvx2 = 1,        // AVX2 + FMA
  kAvxVnni = 2,     // AVX-VNNI (ymm vpdpbusd)
  kAvx512 = 3,      // AVX-512 F / BW / VL
  kAvx512Vnni = 4,  // AVX512-VNNI (zmm vpdpbusd)
  kAvx512Bf16 = 5,  // AVX512-BF16 (vdpbf16ps)
};

// Bit t set: tier t is compiled in and this CPU runs it.
inline int isa_mask() {
  int mask = 1 << kScalar;
#if defined(__AVX2__) && defined(__FMA__)
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) mask |= 1 << kAvx2;
#endif
#ifdef __AVXVNNI__
  if (__builtin_cpu_supports("avxvnni")) mask |= 1 << kAvxVnni;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    mask |= 1 << kAvx512;
#endif
#ifdef __AVX512VNNI__
  if (__builtin_cpu_supports("avx512vnni")) mask |= 1 << kAvx512Vnni;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (__builtin_cpu_supports("avx512bf16")) mask |= 1 << kAvx512Bf16;
#endif
  return mask;
}

// The CPU's vendor, for what the tiers do not tell apart: memory behaviour (vec.h's
// row_prefetch_bytes), measured per vendor.
inline bool cpu_is_intel() {
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
}

}  // namespace bm
