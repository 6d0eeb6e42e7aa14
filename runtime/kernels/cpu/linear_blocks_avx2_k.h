// The K formats' AVX2 and VNNI kernels over the 8-row interleaved layout (linear_blocks_avx2.h's "x8", a
// bound weight's repacked copy: blocks.py's repack_x8), included by linear_blocks.h. Per super-block
// a group of 8 rows holds the 8 rows' float16 fields, then the rest of their bytes in block order,
// 4 at a time (vector c, lane j: row j's bytes 4c .. 4c + 3 of that rest):
//   q4_k 1152 B: d[8], dmin[8], scales (3 vectors), qs (32: vector 8j + c holds elements 4c .. 4c + 3
//                of sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles));
//   q5_k 1408 B: d[8], dmin[8], scales (3), qh (8: vector c holds the fifth bits of elements
//                4c .. 4c + 3 of every sub-block, bit s for sub-block s), qs (32, as q4_k's);
//   q6_k 1680 B: d[8], ql (32), qh (16), int8 scales (4).
// One vpmaddubsw per code vector against 4 input bytes broadcast gives each row's products in its
// own lane. Unsigned codes, their products summed in int16 as far as that is exact (q4_k: 8 vectors
// <= 8 * 2 * 15 * 127; q5_k: 4 <= 4 * 2 * 31 * 127; q6_k: 2 <= 2 * 2 * 63 * 127), then vpmaddwd by
// the rows' scales (int16 in every lane); q4_k / q5_k's mins and q6_k's -32 through the input's
// bsums. The VNNI tier (kVnni) sums the products by vpdpbusd in int32 and scales by vpmulld. Per
// super-block, row and input row the exact integer totals, then linear_blocks.h's float order for
// the K formats, lane by lane: the same bits as the kernels over ggml's layout.
#pragma once

#ifdef BM_BLK_X8

namespace bm_blk {

// Both int16 of every 4-byte lane j: lane j's bytes b0 and b1 (0..3) of v, zero-extended, or
// sign-extended with `is_signed` (picked into the high byte, then an arithmetic shift).
inline __m256i lane_int16(__m256i v, int b0, int b1, bool is_signed) {
  const uint32_t z = 0x80;   // vpshufb: a set high bit selects zero (lane offsets added below keep it)
  const uint32_t pattern = is_signed ? z | (uint32_t)b0 << 8 | z << 16 | (uint32_t)b1 << 24
                                     : (uint32_t)b0 | z << 8 | (uint32_t)b1 << 16 | z << 24;
  const __m256i lanes = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c, 0, 0x04040404, 0x08080808,
                                          0x0c0c0c0c);
  const __m256i picked = _mm256_shuffle_epi8(v, _mm256_add_epi8(_mm256_set1_epi32((int)pattern), lanes));
  return is_signed ? _mm256_srai_epi16(picked, 8) : picked;
}

// An empty asm that takes v in a register where the source has it: GCC would otherwise move the
// unrolled loops' sums to the end of their chains, keeping every product live (spills at 4 rows).
inline void in_order(__m256i& v) { asm("" : "+x"(v)); }

// A sub-block's products in both K kernels below: p plus the products of the unsigned codes u and
// the inputs s, in int16 pairs (AVX2) or int32 quads (VNNI); then the summed products times the
// rows' scale (AVX2: the scale in both int16 of a lane, a pair per vpmaddwd; VNNI: in int32).
template <bool kVnni>
inline __m256i k_products(__m256i p, __m256i u, __m256i s) {
#ifdef BM_BLK_VNNI
  if constexpr (kVnni) return dpbusd(p, u, s);
#endif
  return _mm256_add_epi16(p, _mm256_maddubs_epi16(u, s));
}
template <bool kVnni>
inline __m256i k_scaled(__m256i p, __m256i scale) {
  if constexpr (kVnni) return _mm256_mullo_epi32(p, scale);
  return _mm256_madd_epi16(p, scale);
}

// q4_k (kHigh false) and q5_k: the 6-bit scales and mins of the 8 rows unpacked at once
// (scales_mins_k4's word operations lane by lane); sub-block by sub-block (2j: chunk j's low
// nibbles, 2j + 1: its high ones) the rows' int16 sums, then vpmaddwd with the rows' scale; the
// mins against the input's sums of 32 (two bsums of 16), 2 mins per vpmaddwd.
// kVnni (the VNNI tier): a sub-block's 8 vpdpbusd into int32 in two chains of 4 (one chain of 8
// waits on vpdpbusd's latency: 0.95x AVX2 at one row), each then vpmulld by the rows' scale: the
// same exact integers, so the same bits. Against AVX2 over the same x8 weight, in one process (AMD
// EPYC Zen 4, 2 threads, 3072 x 2048, L3-resident, two runs): q4_k 1.00-1.04x at 1 row, 1.16-1.20x
// at 8-512; q6_k (4 vectors a sub-block) 0.99-1.00x / 1.08-1.13x.
template <bool kHigh, bool kVnni = false>
struct Avx2K4x8 {
  static constexpr int kHighBits = 128, kCodes = kHigh ? 128 + 256 : 128, kGroupBlock = kCodes + 1024;
  // code vectors whose products are summed before the scale (in int16 on AVX2: exact that far)
  static constexpr int kSum = kHigh || kVnni ? 4 : 8;

  static __m256i bit_to_4(__m256i h, int b) {   // bit b of each byte of h at bit 4, the rest 0
    const __m256i moved = b < 4 ? _mm256_slli_epi16(h, 4 - b) : b > 4 ? _mm256_srli_epi16(h, b - 4) : h;
    return _mm256_and_si256(moved, _mm256_set1_epi8(16));
  }

  template <int R>
  static void group(const uint8_t* g, const QInput& x, __m256 out[R]) {
    const int64_t nb = x.k / kQK;
    const __m256i m4 = _mm256_set1_epi8(15), low6 = _mm256_set1_epi8(0x3f), low2 = _mm256_set1_epi8(3);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, g += kGroupBlock) {
      prefetch_ahead(g, kGroupBlock);
      const __m256i w0 = load32(g + 32), w1 = load32(g + 64), w2 = load32(g + 96);
      __m256i u[4];   // scales 0..3, 4..7, mins 0..3, 4..7 (bytes of each lane)
      u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), m4),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w1, 6), low2), 4));
      u[2] = _mm256_and_si256(w1, low6);
      u[1] = _mm256_or_si256(_mm256_and_si256(w2, m4),
                             _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(w0, 6), low2), 4));
      u[0] = _mm256_and_si256(w0, low6);
      const int8_t* q[R];   // the input rows' super-block i
      for (int r = 0; r < R; ++r) q[r] = x.q + r * x.k + i * kQK;
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {   // sub-block s: chunk j = s / 2, its low nibbles (s even) or high
        const int j = s / 2;
        const __m256i pair = lane_int16(u[s / 4], s % 4, s % 4, false);
        const __m256i scale = kVnni ? _mm256_and_si256(pair, _mm256_set1_epi32(0xffff)) : pair;
#pragma GCC unroll 2
        for (int c0 = 0; c0 < 8; c0 += kSum) {
          __m256i p[R];
          for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
          for (int c = c0; c < c0 + kSum; ++c) {
            const __m256i v = load32(g + kCodes + 256 * j + 32 * c);
            __m256i code = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(v, 4) : v, m4);
            if (kHigh) code = _mm256_or_si256(code, bit_to_4(load32(g + kHighBits + 32 * c), s));
            for (int r = 0; r < R; ++r) {
              p[r] = k_products<kVnni>(p[r], code, bcast4(q[r] + 32 * s + 4 * c));
              in_order(p[r]);
            }
          }
          for (int r = 0; r < R; ++r) {
            isum[r] = _mm256_add_epi32(isum[r], k_scaled<kVnni>(p[r], scale));
            in_order(isum[r]);
          }
        }
      }
      __m256i mins[4];   // mins 2p, 2p + 1 of each row as the two int16 of its lane
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) mins[p] = lane_int16(u[2 + p / 2], 2 * p % 4, 2 * p % 4 + 1, false);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
      for (int r = 0; r < R; ++r) {
        const int16_t* bs = x.bsums + r * (x.k / 16) + i * 16;
        __m256i msum = _mm256_setzero_si256();
        for (int p = 0; p < 4; ++p) {
          const int16_t sums[2] = {(int16_t)(bs[4 * p] + bs[4 * p + 1]), (int16_t)(bs[4 * p + 2] + bs[4 * p + 3])};
          msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[p], bcast4(sums)));
        }
        const __m256 dx = _mm256_set1_ps(x.d[r * x.nd + i]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

// q6_k: per half h of 128 and chunk c of 32, codes 4t .. 4t + 3 (t < 8) from ql vector 16h + 8(c & 1)
// + t (c >= 2: its high nibbles) and qh vector 8h + t (bits 2c, 2c + 1); sub-block 8h + 2c for
// t < 4, 8h + 2c + 1 after; products of two t summed in int16, then vpmaddwd by the rows' int8
// scales (sign-extended); the -32 as 32 * sum_s sc_s * bsums_s, 2 scales per vpmaddwd. kVnni: a
// sub-block's 4 t by vpdpbusd into int32, then vpmulld by its scale sign-extended to int32.
template <bool kVnni>
struct Avx2Q6_Kx8T {
  static constexpr int kQl = 16, kQh = kQl + 1024, kScales = kQh + 512, kGroupBlock = kScales + 128;
  static constexpr int kSum = kVnni ? 4 : 2;   // code vectors (t) summed before the scale

  template <int R>
  static void group(const uint8_t* g, const QInput& x, __m256 out[R]) {
    const int64_t nb = x.k / kQK;
    const __m256i m4 = _mm256_set1_epi8(15), bits45 = _mm256_set1_epi8(0x30);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, g += kGroupBlock) {
      prefetch_ahead(g, kGroupBlock);
      __m256i sc[4];   // scales 4m .. 4m + 3 of each row (bytes of its lane)
      for (int m = 0; m < 4; ++m) sc[m] = load32(g + kScales + 32 * m);
      const int8_t* q[R];   // the input rows' super-block i
      for (int r = 0; r < R; ++r) q[r] = x.q + r * x.k + i * kQK;
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) {
          const int s = 8 * h + 2 * c;
          __m256i scale[2] = {lane_int16(sc[s / 4], s % 4, s % 4, true),
                              lane_int16(sc[s / 4], s % 4 + 1, s % 4 + 1, true)};
          if constexpr (kVnni)   // the sign-extended int16 to int32
            for (__m256i& v : scale) v = _mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16);
#pragma GCC unroll 4
          for (int t0 = 0; t0 < 8; t0 += kSum) {
            __m256i p[R];
            for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int t = t0; t < t0 + kSum; ++t) {
              const __m256i ql = load32(g + kQl + 32 * (16 * h + 8 * (c & 1) + t));
              const __m256i qh = load32(g + kQh + 32 * (8 * h + t));
              const __m256i low = _mm256_and_si256(c < 2 ? ql : _mm256_srli_epi16(ql, 4), m4);
              const __m256i high = c == 0 ? _mm256_slli_epi16(qh, 4) : c == 1 ? _mm256_slli_epi16(qh, 2)
                                   : c == 2 ? qh : _mm256_srli_epi16(qh, 2);
              const __m256i u = _mm256_or_si256(low, _mm256_and_si256(high, bits45));
              for (int r = 0; r < R; ++r) {
                p[r] = k_products<kVnni>(p[r], u, bcast4(q[r] + 128 * h + 32 * c + 4 * t));
                in_order(p[r]);
              }
            }
            for (int r = 0; r < R; ++r) {
              isum[r] = _mm256_add_epi32(isum[r], k_scaled<kVnni>(p[r], scale[t0 / 4]));
              in_order(isum[r]);
            }
          }
        }
      __m256i pairs[8];   // scales 2m, 2m + 1 of each row as the two int16 of its lane
#pragma GCC unroll 8
      for (int m = 0; m < 8; ++m) pairs[m] = lane_int16(sc[m / 2], 2 * m % 4, 2 * m % 4 + 1, true);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      for (int r = 0; r < R; ++r) {
        const int16_t* bs = x.bsums + r * (x.k / 16) + i * 16;
        __m256i offset = _mm256_setzero_si256();
        for (int m = 0; m < 8; ++m)
          offset = _mm256_add_epi32(offset, _mm256_madd_epi16(pairs[m], bcast4(bs + 2 * m)));
        const __m256i total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
        const __m256 dx = _mm256_set1_ps(x.d[r * x.nd + i]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

using Avx2Q4_Kx8 = Avx2K4x8<false>;
using Avx2Q5_Kx8 = Avx2K4x8<true>;
using Avx2Q6_Kx8 = Avx2Q6_Kx8T<false>;
#ifdef BM_BLK_VNNI
using VnniQ4_Kx8 = Avx2K4x8<false, true>;
using VnniQ5_Kx8 = Avx2K4x8<true, true>;
using VnniQ6_Kx8 = Avx2Q6_Kx8T<true>;
#endif

}  // namespace bm_blk

#endif  // BM_BLK_X8
