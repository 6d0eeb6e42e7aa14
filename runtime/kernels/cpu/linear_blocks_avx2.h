// The AVX2 tier of linear_blocks.h's dot kernels (included by it), ggml's x86 approach:
//   q8_0, q4_0, q5_0: signed codes (q, nib - 8, q5 - 16) x int8 inputs by the sign trick,
//       vpmaddubsw(|w|, sign(q, w)) (pairs <= 2 * 128 * 127: no int16 saturation), vpmaddwd by 1;
//   q4_1: unsigned nibbles directly, its min as m * d_x * s;
//   q4_k, q5_k, q6_k: unsigned codes (<= 63) by vpmaddubsw, vpmaddwd with the sub-block scales as
//       its multiplier; mins (q4_k, q5_k) and q6_k's -32 through the input's bsums.
// Per block (32) one fma(float(isum), d_w * d_x, acc) per lane; per super-block (256) of the K
// formats the integer total isum of the row and one scalar fma(float(isum), d_w * d_x, acc) (then
// q4_k / q5_k's fma(-float(msum), dmin_w * d_x, acc)): the order their kernels over the 8-row
// interleaved layout (linear_blocks_avx2_k.h) keep per lane, so both layouts give the same bits.
// q8_0, q4_0, q4_1 and q5_0 also over the 8-row interleaved layout (below): 8 outputs per vector,
// one fma per block for all 8. The weight stream is prefetched 2 KiB ahead.
#pragma once

#ifdef __AVX2__

#include <immintrin.h>

namespace bm_blk {

// 16 bytes of nibbles -> 32 bytes: the low nibbles (elements 0..15) then the high ones (16..31).
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i t = _mm_loadu_si128((const __m128i*)qs);
  const __m256i both = _mm256_insertf128_si256(_mm256_castsi128_si256(t), _mm_srli_epi16(t, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// 32 bits -> 32 bytes: byte j is 0xff where bit j is set (ggml's bytes_from_bits_32).
inline __m256i bit_bytes32(const uint8_t* qh) {
  uint32_t bits;
  memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32((int)bits),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// Software prefetch of the weight stream: the `bytes` at p + kPrefetch, a line at a time.
constexpr int kPrefetch = 2048;
inline void prefetch_ahead(const void* p, int bytes) {
  for (int line = 0; line < bytes; line += 64) _mm_prefetch((const char*)p + kPrefetch + line, _MM_HINT_T0);
}
inline __m256i pair_sums(__m256i p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }

// The VNNI tier (BM_BLK_VNNI): vpdpbusd on ymm, u8 x s8 quads summed straight into int32 lanes
// (AVX512-VNNI + VL's EVEX form, else AVX-VNNI's VEX form), at the tier BM_BLK_VNNI_TIER.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define BM_BLK_VNNI 1
#define BM_BLK_VNNI_TIER bm::kAvx512Vnni
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define BM_BLK_VNNI 1
#define BM_BLK_VNNI_TIER bm::kAvxVnni
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// Per int32 lane the sum of its 4 products u8 x s8: vpmaddubsw then vpmaddwd by 1 (AVX2; the
// unsigned operands here are at most 128 and the inputs at most 127 in magnitude, so a pair is at
// most 2 * 128 * 127 and never saturates int16) or one vpdpbusd: the same integers.
template <bool kVnni>
inline __m256i quad_sums(__m256i u, __m256i s) {
#ifdef BM_BLK_VNNI
  if constexpr (kVnni) return dpbusd(_mm256_setzero_si256(), u, s);
#endif
  return pair_sums(_mm256_maddubs_epi16(u, s));
}
using bm::hsum4_epi32;
using bm::hsum8_epi32;

// A block's 32 weight codes as int8: signed values (q8_0: q, q4_0: nib - 8, q5_0: q5 - 16; the sign
// trick multiplies them) or q4_1's unsigned nibbles.
inline __m256i codes32_avx2(const BlockQ8_0& b) { return load32(b.qs); }
inline __m256i codes32_avx2(const BlockQ4_0& b) { return _mm256_sub_epi8(nibbles32(b.qs), _mm256_set1_epi8(8)); }
inline __m256i codes32_avx2(const BlockQ4_1& b) { return nibbles32(b.qs); }
inline __m256i codes32_avx2(const BlockQ5_0& b) {   // nib - 16 where the fifth bit is clear: nib | 0xf0
  return _mm256_or_si256(nibbles32(b.qs), _mm256_andnot_si256(bit_bytes32(b.qh), _mm256_set1_epi8((char)0xf0)));
}

// q8_0, q4_0, q5_0 (signed codes: |w| x sign(q, w), pairs <= 2 * 128 * 127) and q4_1 (unsigned
// nibbles, its min term m * d_x * s as a float per row). Two blocks per step into two accumulator
// sets: one set's fma chain would bound a row at one block per fma latency.
template <class B, bool kHasMin, bool kVnni = false>
struct Avx2Small {
  template <int R>
  static inline void block(const B& b, const QInput& x, int64_t i, int64_t nb, __m256 acc[R], float mins[R]) {
    const __m256i w = codes32_avx2(b);
    const __m256i wabs = kHasMin ? w : _mm256_sign_epi8(w, w);
    const float dw = f16(b.d), m = block_min(b);
    for (int r = 0; r < R; ++r) {
      const __m256i q = load32(x.q + r * x.k + i * kQ);
      const __m256i sum4 = quad_sums<kVnni>(wabs, kHasMin ? q : _mm256_sign_epi8(q, w));
      const float dx = x.d[r * x.nd + i];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum4), _mm256_set1_ps(dw * dx), acc[r]);
      if (kHasMin) mins[r] += m * (dx * (float)x.s[r * nb + i]);
    }
  }

  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const B* b = (const B*)row;
    const int64_t nb = x.k / kQ;
    __m256 acc0[R], acc1[R];
    float mins0[R], mins1[R];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps(), mins0[r] = mins1[r] = 0.f;
    int64_t i = 0;
    for (; i + 1 < nb; i += 2) {
      prefetch_ahead(&b[i], 2 * sizeof(B));
      block<R>(b[i], x, i, nb, acc0, mins0);
      block<R>(b[i + 1], x, i + 1, nb, acc1, mins1);
    }
    if (i < nb) block<R>(b[i], x, i, nb, acc0, mins0);
    for (int r = 0; r < R; ++r) out[r] = bm::hsum8(_mm256_add_ps(acc0[r], acc1[r])) + (mins0[r] + mins1[r]);
  }
};

// q4_k, q5_k: per super-block the 6-bit scales and mins unpacked once for the R rows; per pair of
// sub-blocks one 32-byte load of codes; mins against the input's bsums (pairs summed by hadd).
template <class B>
struct Avx2K4 {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const B* b = (const B*)row;
    const int64_t nb = x.k / kQK;
    const __m256i m4 = _mm256_set1_epi8(15), m1 = _mm256_set1_epi8(1);
    float acc[R] = {};
    for (int64_t i = 0; i < nb; ++i) {
      prefetch_ahead(&b[i], sizeof(B));
      uint32_t sm[4];   // built in registers: a 16-byte load of 4-byte stores would miss store forwarding
      scales_mins_k4(b[i].scales, sm);
      const __m256i both = _mm256_cvtepu8_epi16(_mm_set_epi32((int)sm[3], (int)sm[2], (int)sm[1], (int)sm[0]));
      const __m256i scales = _mm256_permute2x128_si256(both, both, 0x00);
      const __m128i mins = _mm256_extracti128_si256(both, 1);
      const uint8_t* qh = high_bits(b[i]);
      const __m256i hbits = qh ? load32(qh) : _mm256_setzero_si256();
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i bits = load32(b[i].qs + 32 * j);
        __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
        if (qh) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j), m1), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hbits, 2 * j + 1), m1), 4));
        }
        // int16 lane 2j / 2j + 1 of `scales` in every lane (bytes 4j, 4j + 1 / 4j + 2, 4j + 3)
        const __m256i sl = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(((4 * j + 1) << 8) | (4 * j))));
        const __m256i sh = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(((4 * j + 3) << 8) | (4 * j + 2))));
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q + r * x.k + i * kQK + 64 * j;
          const __m256i pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(lo, load32(q)));
          const __m256i ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(hi, load32(q + 32)));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(pl, ph));
        }
      }
      const float d = f16(b[i].d), dmin = f16(b[i].dmin);
      for (int r = 0; r < R; ++r) {
        const float dx = x.d[r * x.nd + i];
        const __m256i bs = load32(x.bsums + r * (x.k / 16) + i * 16);
        const __m128i pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
        acc[r] = fmaf((float)hsum8_epi32(isum[r]), d * dx, acc[r]);
        acc[r] = fmaf(-(float)hsum4_epi32(_mm_madd_epi16(mins, pairs)), dmin * dx, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

// q6_k: per half of 128, 3 loads (ql 64 bytes, qh 32) give 4 chunks of 32 codes; int8 scales per 16
// (the low and high 128-bit lanes of a chunk's products); the -32 offset as 32 * sum sc_i * bsums_i.
struct Avx2Q6_K {
  template <int R>
  static void dot(const uint8_t* row, const QInput& x, float out[R]) {
    const BlockQ6_K* b = (const BlockQ6_K*)row;
    const int64_t nb = x.k / kQK;
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    float acc[R] = {};
    for (int64_t i = 0; i < nb; ++i) {
      prefetch_ahead(&b[i], sizeof(BlockQ6_K));
      const __m128i sc8 = _mm_loadu_si128((const __m128i*)b[i].scales);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = load32(b[i].ql + 64 * h), ql1 = load32(b[i].ql + 64 * h + 32);
        const __m256i qh = load32(b[i].qh + 32 * h);
        for (int c = 0; c < 4; ++c) {
          const __m256i low = c == 0 ? ql0 : c == 1 ? ql1 : _mm256_srli_epi16(c == 2 ? ql0 : ql1, 4);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), m3);
          const __m256i u = _mm256_or_si256(_mm256_and_si256(low, m4), _mm256_slli_epi16(high, 4));
          const int64_t s = h * 8 + 2 * c;   // sc[s] for the low 16 codes, sc[s + 1] for the high 16
          const __m256i scale = _mm256_cvtepi8_epi16(
              _mm_shuffle_epi8(sc8, _mm_set_epi64x(0x0101010101010101 * (s + 1), 0x0101010101010101 * s)));
          for (int r = 0; r < R; ++r) {
            const __m256i q = load32(x.q + r * x.k + i * kQK + 128 * h + 32 * c);
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(scale, _mm256_maddubs_epi16(u, q)));
          }
        }
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      const float d = f16(b[i].d);
      for (int r = 0; r < R; ++r) {
        const __m256i offset = _mm256_madd_epi16(sc16, load32(x.bsums + r * (x.k / 16) + i * 16));
        const __m256i total = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(offset, 5));
        acc[r] = fmaf((float)hsum8_epi32(total), d * x.d[r * x.nd + i], acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

// ---- the 8-row interleaved layout ("x8", a bound weight's repacked copy; blocks.py's repack) ----
// (F16C converts the 8 rows' scales: every AVX2 CPU has it, -march=native enables it; without it
// no x8 kernels are compiled in and bound weights keep ggml's layout.)
#ifdef __F16C__
#define BM_BLK_X8 1
// Rows 8g .. 8g + 7 of a weight become one group of the same 8 * row_bytes bytes: per block i, the
// 8 rows' fp16 d (then q4_1's m, q4_k's dmin; q5_0's fifth bits, 4 bytes a row, see SmallX8)
// and the rest of their bytes in 32-byte vectors whose 4-byte lane j is row j's bytes 4c .. 4c + 3
// of that rest (q4_0 / q4_1 / q5_0: qs, 4 vectors; q8_0: qs, 8; q4_k: scales then qs, 3 + 32).
// One vpmaddubsw per
// vector against 4 input bytes broadcast gives every row's products in its own lane: the 8 outputs
// end in one vector (no horizontal sums) and one fma per block scales all 8 (d[8] by one F16C
// conversion). Rows after the last whole group keep ggml's layout (the driver runs them so).
// The 4 bytes at p (4 int8 inputs, or 2 int16 input sums: low p[0], high p[1]) in every 32-bit lane.
inline __m256i bcast4(const void* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// q4_0 / q4_1 / q5_0 (kKind 0 / 1 / 2): per block the 8 vectors of unsigned codes lo[c] (elements
// 4c .. 4c + 3 of each row) and hi[c] (16 + 4c ..) against the input's 4 bytes at 4c and 16 + 4c
// broadcast; q4_0's -8 as 8 * s, q5_0's -16 as 16 * s, q4_1's min as m * d_x * s per row.
//   AVX2: vpmaddubsw per vector, the 8 products of a block added in int16 (q4: each <= 2 * 15 * 127,
//   8 of them <= 30480: exact), then pairs by vpmaddwd; q5_0's codes 0..31 (<= 2 * 31 * 127 a
//   pair) sum 4 products in int16 (<= 31496), two vpmaddwd.
//   VNNI (kVnni): one vpdpbusd per vector into int32. The same integers, so the same bits.
// q5_0's fifth bits: 32 bytes whose lane j byte b holds, in bit t, row j's element 4t + b
// (blocks.py spreads qh so): one shift and mask per chunk put it at bit 4.
template <int kKind, bool kVnni>
struct SmallX8 {
  static constexpr bool kHasMin = kKind == 1, kFifth = kKind == 2;
  static constexpr int kCodes = kKind == 0 ? 16 : kKind == 1 ? 32 : 48;   // d; d, m; d, the fifth bits
  static constexpr int kGroupBlock = kCodes + 128, kOffset = kKind == 0 ? 8 : kFifth ? 16 : 0;

  // The block's codes (module comment) from its group bytes g.
  static inline void codes(const uint8_t* g, __m256i lo[4], __m256i hi[4]) {
    const __m256i m4 = _mm256_set1_epi8(15), bit4 = _mm256_set1_epi8(16);
    const __m256i high = kFifth ? load32(g + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(g + kCodes + 32 * c);
      lo[c] = _mm256_and_si256(v, m4);
      hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
      if (kFifth) {   // element 4c + b: bit c of byte b; element 16 + 4c + b: bit 4 + c
        lo[c] = _mm256_or_si256(lo[c], _mm256_and_si256(_mm256_slli_epi16(high, 4 - c), bit4));
        hi[c] = _mm256_or_si256(hi[c], _mm256_and_si256(_mm256_srli_epi16(high, c), bit4));
      }
    }
  }

  // Per int32 lane (a weight row) the integer dot of its 32 codes with the input's block q.
  static inline __m256i dot(const __m256i lo[4], const __m256i hi[4], const int8_t* q) {
#ifdef BM_BLK_VNNI
    if constexpr (kVnni) {
      __m256i isum = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        isum = dpbusd(isum, lo[c], bcast4(q + 4 * c));
        isum = dpbusd(isum, hi[c], bcast4(q + 16 + 4 * c));
      }
      return isum;
    }
#endif
    __m256i p[4];
    for (int c = 0; c < 4; ++c)
      p[c] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[c], bcast4(q + 4 * c)),
                              _mm256_maddubs_epi16(hi[c], bcast4(q + 16 + 4 * c)));
    if (kFifth)
      return _mm256_add_epi32(pair_sums(_mm256_add_epi16(p[0], p[1])), pair_sums(_mm256_add_epi16(p[2], p[3])));
    return pair_sums(_mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3])));
  }

  template <int R>
  static void group(const uint8_t* g, const QInput& x, __m256 out[R]) {
    const int64_t nb = x.k / kQ;
    __m256 acc[R], accm[R];
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, g += kGroupBlock) {
      prefetch_ahead(g, kGroupBlock);
      __m256i lo[4], hi[4];
      codes(g, lo, hi);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      for (int r = 0; r < R; ++r) {
        __m256i isum = dot(lo, hi, x.q + r * x.k + i * kQ);
        const int32_t s = x.s[r * nb + i];
        if (kOffset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(kOffset * s));
        const float dx = x.d[r * x.nd + i];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[r]);
        if (kHasMin) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
          accm[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(dx * (float)s), accm[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) out[r] = kHasMin ? _mm256_add_ps(acc[r], accm[r]) : acc[r];
  }
};

// q8_0: signed codes by the sign trick per vector (pairs <= 2 * 128 * 127: no saturation), each
// vector's pairs by vpmaddwd (two would overflow int16).
struct Avx2Q8_0x8 {
  static constexpr int kGroupBlock = 16 + 256;

  template <int R>
  static void group(const uint8_t* g, const QInput& x, __m256 out[R]) {
    const int64_t nb = x.k / kQ;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, g += kGroupBlock) {
      prefetch_ahead(g, kGroupBlock);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w = load32(g + 16 + 32 * c), wabs = _mm256_sign_epi8(w, w);
        for (int r = 0; r < R; ++r) {
          const __m256i q = _mm256_sign_epi8(bcast4(x.q + r * x.k + i * kQ + 4 * c), w);
          isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, q), ones));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.nd + i])),
                                 acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

#ifdef BM_BLK_VNNI
// q8_0 on the VNNI tier: the signed codes as unsigned w + 128 (w ^ 0x80), one vpdpbusd per vector
// and row into int32, the 128 * s taken off per block: Avx2Q8_0x8's integers, so its bits.
struct VnniQ8_0x8 {
  static constexpr int kGroupBlock = 16 + 256;

  template <int R>
  static void group(const uint8_t* g, const QInput& x, __m256 out[R]) {
    const int64_t nb = x.k / kQ;
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nb; ++i, g += kGroupBlock) {
      prefetch_ahead(g, kGroupBlock);
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i u = _mm256_xor_si256(load32(g + 16 + 32 * c), flip);
        for (int r = 0; r < R; ++r) isum[r] = dpbusd(isum[r], u, bcast4(x.q + r * x.k + i * kQ + 4 * c));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
      for (int r = 0; r < R; ++r) {
        const __m256i exact = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(128 * x.s[r * nb + i]));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(exact), _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.nd + i])),
                                 acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) out[r] = acc[r];
  }
};

using VnniQ4_0x8 = SmallX8<0, true>;
using VnniQ4_1x8 = SmallX8<1, true>;
using VnniQ5_0x8 = SmallX8<2, true>;
#endif  // BM_BLK_VNNI

#endif  // __F16C__

using Avx2Q8_0 = Avx2Small<BlockQ8_0, false>;
using Avx2Q4_0 = Avx2Small<BlockQ4_0, false>;
using Avx2Q4_1 = Avx2Small<BlockQ4_1, true>;
using Avx2Q5_0 = Avx2Small<BlockQ5_0, false>;
using Avx2Q4_K = Avx2K4<BlockQ4_K>;
#ifdef BM_BLK_VNNI
using VnniQ8_0 = Avx2Small<BlockQ8_0, false, true>;
using VnniQ4_0 = Avx2Small<BlockQ4_0, false, true>;
using VnniQ4_1 = Avx2Small<BlockQ4_1, true, true>;
using VnniQ5_0 = Avx2Small<BlockQ5_0, false, true>;
#endif
using Avx2Q5_K = Avx2K4<BlockQ5_K>;
#ifdef BM_BLK_X8
using Avx2Q4_0x8 = SmallX8<0, false>;
using Avx2Q4_1x8 = SmallX8<1, false>;
using Avx2Q5_0x8 = SmallX8<2, false>;
#endif

}  // namespace bm_blk

#endif  // __AVX2__
