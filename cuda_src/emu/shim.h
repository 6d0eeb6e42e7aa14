// CPU emulation shim: lets g++ compile the kernel sources of cuda_src/ unchanged (force-included
// before them with -include) and run a launch on OS threads. Used by the `emu` kernel backend
// (runtime/kernels/cuda/emu_backend.py) to verify the kernels' logic on machines without a GPU.
//
// Model
//   - One OS thread per CUDA thread of a block; the blocks of a grid run one after another on the
//     same threads (a `__shared__` variable is a function-local static, shared by the whole process,
//     so two blocks must never be live at once; a launch holds a process-wide mutex).
//   - __syncthreads is a block barrier; shuffles exchange through a per-warp double buffer with one
//     warp barrier per exchange; atomics are std::atomic_ref operations.
//   - Dynamic shared memory is a per-launch buffer poisoned with 0xff (NaN floats) before every block,
//     so reading it before writing shows up in results.
//   - A barrier that waits longer than BM_EMU_BARRIER_TIMEOUT_S seconds (default 120) aborts with a
//     message: divergent __syncthreads / shuffles deadlock here (they are undefined on a GPU).
//   - Only full-warp shuffles are emulated (mask covering every lane present in the warp).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define BM_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x = 1, y = 1, z = 1;
};

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;
constexpr int warpSize = 32;

namespace emu {

[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "emu shim: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

inline double barrier_timeout_s() {
  static const double value = [] {
    const char* text = std::getenv("BM_EMU_BARRIER_TIMEOUT_S");
    return text ? std::atof(text) : 120.0;
  }();
  return value;
}

// Generation barrier: spin briefly, then sleep on a futex (threads far outnumber cores).
class Barrier {
 public:
  explicit Barrier(int expected) : expected_(expected) {}
  void arrive_and_wait() {
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == expected_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_acq_rel);
      syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
      return;
    }
    for (int i = 0; i < 32; ++i) {
      if (generation_.load(std::memory_order_acquire) != gen) return;
      std::this_thread::yield();
    }
    const auto start = std::chrono::steady_clock::now();
    const timespec slice{0, 50 * 1000 * 1000};
    while (generation_.load(std::memory_order_acquire) == gen) {
      syscall(SYS_futex, reinterpret_cast<int*>(&generation_), FUTEX_WAIT_PRIVATE, gen, &slice, nullptr, 0);
      const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
      if (waited.count() > barrier_timeout_s()) fail("barrier timeout (divergent __syncthreads or shuffle?)");
    }
  }

 private:
  std::atomic<int> arrived_{0};
  std::atomic<int> generation_{0};
  const int expected_;
};

struct Warp {
  explicit Warp(int lanes) : num_lanes(lanes), barrier(lanes) {}
  const int num_lanes;
  Barrier barrier;
  unsigned long long slots[2][32] = {};
};

struct Launch {
  Launch(int threads, size_t smem_bytes) : num_threads(threads), barrier(threads), smem(smem_bytes + 16),
                                           predicates(threads) {
    for (int first = 0; first < threads; first += 32)
      warps.emplace_back(std::make_unique<Warp>(std::min(32, threads - first)));
  }
  const int num_threads;
  Barrier barrier;
  std::vector<std::unique_ptr<Warp>> warps;
  std::vector<unsigned char> smem;
  std::vector<int> predicates;
};

inline thread_local Launch* current = nullptr;
inline thread_local int linear_tid = 0;
inline thread_local unsigned exchange_count = 0;

inline std::mutex& launch_mutex() {
  static std::mutex mutex;
  return mutex;
}

inline unsigned char* dynamic_smem() { return current->smem.data(); }

// Runs body() as every thread of every block of the grid.
template <class Body>
void launch(dim3 grid, dim3 block, size_t smem_bytes, Body body) {
  const long long threads = (long long)block.x * block.y * block.z;
  if (threads < 1 || threads > 1024) fail("block size must be in [1, 1024]");
  std::lock_guard<std::mutex> lock(launch_mutex());
  Launch launch_state((int)threads, smem_bytes);
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (int tid = 0; tid < threads; ++tid) {
    workers.emplace_back([&, tid] {
      current = &launch_state;
      linear_tid = tid;
      exchange_count = 0;
      threadIdx = {tid % block.x, (tid / block.x) % block.y, tid / (block.x * block.y)};
      blockDim = block;
      gridDim = grid;
      for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
          for (unsigned x = 0; x < grid.x; ++x) {
            blockIdx = {x, y, z};
            if (tid == 0) std::memset(launch_state.smem.data(), 0xff, launch_state.smem.size());
            launch_state.barrier.arrive_and_wait();
            body();
            launch_state.barrier.arrive_and_wait();
          }
      current = nullptr;
    });
  }
  for (auto& worker : workers) worker.join();
}

inline Warp& my_warp() { return *current->warps[linear_tid / 32]; }

// Publishes `bits` for this lane, waits for the warp, returns the array of the warp's lanes.
inline const unsigned long long* exchange(unsigned long long bits, unsigned mask) {
  Warp& warp = my_warp();
  const unsigned present = warp.num_lanes == 32 ? 0xffffffffu : ((1u << warp.num_lanes) - 1u);
  if ((mask & present) != present) fail("only full-warp shuffles are emulated");
  unsigned long long* slots = warp.slots[exchange_count++ & 1];
  slots[linear_tid % 32] = bits;
  warp.barrier.arrive_and_wait();
  return slots;
}

template <class T>
T shuffle_from(T value, unsigned mask, int src_lane, int lane) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  unsigned long long bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  const unsigned long long* slots = exchange(bits, mask);
  if (src_lane < 0 || src_lane >= my_warp().num_lanes) src_lane = lane;
  T out;
  std::memcpy(&out, &slots[src_lane], sizeof(T));
  return out;
}

inline unsigned float_bits(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float half_bits_to_float(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000u) << 16;
  const int exp = (h >> 10) & 0x1f;
  const unsigned mant = h & 0x3ffu;
  if (exp == 0) return (sign ? -1.0f : 1.0f) * std::ldexp((float)mant, -24);
  const unsigned u = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                               : (sign | ((unsigned)(exp - 15 + 127) << 23) | (mant << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline unsigned short float_to_half_bits(float f) {  // round to nearest even, like cvt.rn.f16.f32
  const unsigned x = float_bits(f);
  const unsigned sign = (x >> 16) & 0x8000u;
  unsigned mant = x & 0x7fffffu;
  const int exp = (x >> 23) & 0xff;
  if (exp == 0xff) return (unsigned short)(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = exp - 127 + 15;
  if (e >= 0x1f) return (unsigned short)(sign | 0x7c00u);
  if (e <= 0) {
    if (e < -10) return (unsigned short)sign;
    mant |= 0x800000u;
    const int shift = 14 - e;
    unsigned h = mant >> shift;
    const unsigned rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return (unsigned short)(sign | h);
  }
  unsigned h = ((unsigned)e << 10) | (mant >> 13);
  const unsigned rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry may round up to inf: correct
  return (unsigned short)(sign | h);
}

}  // namespace emu

// ---- CUDA built-ins ------------------------------------------------------------------------------
inline void __syncthreads() { emu::current->barrier.arrive_and_wait(); }

inline int __syncthreads_count(int predicate) {
  emu::current->predicates[emu::linear_tid] = predicate ? 1 : 0;
  __syncthreads();
  int count = 0;
  for (int p : emu::current->predicates) count += p;
  __syncthreads();
  return count;
}
inline int __syncthreads_or(int predicate) { return __syncthreads_count(predicate) > 0; }
inline int __syncthreads_and(int predicate) { return __syncthreads_count(predicate) == emu::current->num_threads; }
inline void __syncwarp(unsigned mask = 0xffffffffu) { (void)mask; emu::my_warp().barrier.arrive_and_wait(); }

template <class T>
T __shfl_sync(unsigned mask, T value, int src, int width = 32) {
  const int lane = emu::linear_tid % 32;
  return emu::shuffle_from(value, mask, (lane / width) * width + (src % width), lane);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  const int lane = emu::linear_tid % 32, src = lane ^ lane_mask;
  return emu::shuffle_from(value, mask, src / width == lane / width ? src : lane, lane);
}
template <class T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = emu::linear_tid % 32, src = lane + (int)delta;
  return emu::shuffle_from(value, mask, src / width == lane / width ? src : lane, lane);
}
template <class T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  const int lane = emu::linear_tid % 32, src = lane - (int)delta;
  return emu::shuffle_from(value, mask, src >= 0 && src / width == lane / width ? src : lane, lane);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const unsigned long long* slots = emu::exchange(predicate ? 1 : 0, mask);
  unsigned bits = 0;
  for (int lane = 0; lane < emu::my_warp().num_lanes; ++lane) bits |= (slots[lane] ? 1u : 0u) << lane;
  return bits;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) {
  const int lanes = emu::my_warp().num_lanes;
  return __ballot_sync(mask, predicate) == (lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u));
}

template <class T>
T atomicAdd(T* address, T value) { return std::atomic_ref<T>(*address).fetch_add(value); }
template <class T>
T atomicSub(T* address, T value) { return std::atomic_ref<T>(*address).fetch_sub(value); }
template <class T>
T atomicExch(T* address, T value) { return std::atomic_ref<T>(*address).exchange(value); }
template <class T>
T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;
}
template <class T>
T atomicMax(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (old < value && !ref.compare_exchange_weak(old, value)) {}
  return old;
}
template <class T>
T atomicMin(T* address, T value) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (value < old && !ref.compare_exchange_weak(old, value)) {}
  return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return std::fmin(std::fmax(x, 0.0f), 1.0f); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <class T>
T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
// expf, logf, fmaxf, fminf, sqrtf come from the C library through <cmath>.
