// Collectives of the native CPU layer: the shared-memory all-reduce of tensor parallelism on one
// host (runtime/parallel/shm_collectives.py calls it through cpu_native.py).
#include <errno.h>
#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <atomic>

// Shared-memory all-reduce among the ranks of one host (tensor parallelism on CPUs, where gloo's
// loopback TCP costs ~0.3 ms per small all-reduce). Region layout: `size` control lines of 64
// bytes (int64 sequence number posted, int64 pid), then two phases of `size` slots of `capacity`
// floats. Call s (s = 1, 2, ...) uses phase s % 2: copy data into the rank's slot, post s, wait
// until every peer posted s, then sum the slots in rank order (so every rank gets the same bits).
// Two phases make it safe: a peer posts s - 1 only after reading the slots of call s - 2, and a
// rank starts call s only after seeing every peer post s - 1. Waiting spins briefly, then yields,
// then sleeps 20 us at a time (an idle wait costs little CPU); every ~10 ms of sleeping it checks
// that the peers' processes still exist. n <= capacity.
// With `gathered` non-null the call is a gather instead: gathered[r * ld + i] = rank r's data[i]
// (data unchanged); ranks that pass null only contribute.
extern "C" int bm_shm_all_reduce(float* data, int64_t n, char* region, int64_t capacity, int rank, int size,
                                 int64_t seq, int64_t timeout_ns, float* gathered, int64_t ld) {
  auto posted = [&](int r) { return reinterpret_cast<std::atomic<int64_t>*>(region + 64 * r); };
  auto pid = [&](int r) { return reinterpret_cast<int64_t*>(region + 64 * r + 8); };
  float* slots = reinterpret_cast<float*>(region + 64 * size) + (seq & 1) * size * capacity;
  memcpy(slots + rank * capacity, data, n * sizeof(float));
  posted(rank)->store(seq, std::memory_order_release);
  timespec start, now;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    for (int64_t polls = 0; posted(r)->load(std::memory_order_acquire) < seq; ++polls) {
      if (polls < 4000) {
        _mm_pause();
        continue;
      }
      if (polls < 8000) {
        sched_yield();
        continue;
      }
      timespec nap = {0, 20000};
      nanosleep(&nap, nullptr);
      if (polls % 500 == 0) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t waited = (now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec);
        if (waited > timeout_ns) return 1;
        if (kill(static_cast<pid_t>(*pid(r)), 0) != 0 && errno == ESRCH) return 2;
      }
    }
  }
  if (gathered != nullptr) {
    for (int r = 0; r < size; ++r) memcpy(gathered + r * ld, slots + r * capacity, n * sizeof(float));
    return 0;
  }
  const float* first = slots;
  for (int64_t i = 0; i < n; ++i) {
    float sum = first[i];
    for (int r = 1; r < size; ++r) sum += slots[r * capacity + i];
    data[i] = sum;
  }
  return 0;
}
