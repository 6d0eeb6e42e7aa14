// The native CPU layer's instruction-set tiers: one ordered enum (isa.py mirrors its values; the
// Python side checks BATCH_MANAGER_CPU_ISA and passes the cap down). Each kernel family runs its
// highest tier at or below the cap that is compiled in (#if on the compiler's target features,
// -march=native); isa_mask says which tiers are compiled in and supported by this CPU.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace bm {

enum Isa : int {
  kScalar = 0,
  kAvx2 = 1,        // AVX2 + FMA
  kAvxVnni = 2,     // AVX-VNNI (ymm vpdpbusd)
  kAvx512 = 3,      // AVX-512 F / BW / VL
  kAvx512Vnni = 4,  // AVX512-VNNI (zmm vpdpbusd)
  kAvx512Bf16 = 5,  // AVX512-BF16 (vdpbf16ps)
  kAmx = 6,         // AMX-BF16 tiles (tdpbf16ps), with the process's permission to use them
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24 and 22) and Linux's permission for this process
// to use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: asked once, process-wide;
// without it the first tile instruction faults).
inline bool amx_usable() {
  static const bool usable = [] {
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return usable;
}
#endif

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
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if ((mask & (1 << kAvx512Bf16)) && amx_usable()) mask |= 1 << kAmx;
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
