// The work team of work_team.h.
//
// One 64-bit ticket describes the current call: its generation, its item
// count and the next item to take. Taking an item is one fetch_add on it, so
// a thread that took item i < count holds a live item of the call that was
// current then (the caller publishes the next call only once every item of
// this one has run), and reads that call's function only after taking it.
// A worker that comes late takes nothing from a finished call.

#include "work_team.h"

#include "kernels.h"

#include <ATen/Parallel.h>

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace raylm {
namespace {

constexpr int kIndexBits = 20, kCountBits = 20;
constexpr uint64_t kIndexMask = (uint64_t(1) << kIndexBits) - 1;
constexpr uint64_t kCountMask = (uint64_t(1) << kCountBits) - 1;
// Items of one call; an index may pass the count by one per thread before the
// call ends, which must not carry into the count's bits.
constexpr int64_t kMaxItems = int64_t(1) << (kIndexBits - 1);

// How long a worker spins for the next call before it sleeps: a decode
// step's matmuls come microseconds apart, and the steps of a small model
// some hundreds of microseconds apart (the engine's Python in between).
constexpr auto kSpin = std::chrono::microseconds(400);

inline uint64_t ticket_of(uint64_t generation, int64_t items) {
  return (generation << (kIndexBits + kCountBits)) | (uint64_t(items) << kIndexBits);
}
inline int64_t index_of(uint64_t ticket) { return int64_t(ticket & kIndexMask); }
inline int64_t count_of(uint64_t ticket) { return int64_t((ticket >> kIndexBits) & kCountMask); }
inline bool has_work(uint64_t ticket) { return index_of(ticket) < count_of(ticket); }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::this_thread::yield();
#endif
}

class Team {
 public:
  void run(int64_t items, void (*fn)(void*, int64_t), void* ctx, int workers) {
    add_workers(workers);
    fn_ = fn;
    ctx_ = ctx;
    done_.store(0, std::memory_order_relaxed);
    active_.store(workers, std::memory_order_relaxed);
    generation_ = (generation_ + 1) & ((uint64_t(1) << (64 - kIndexBits - kCountBits)) - 1);
    ticket_.store(ticket_of(generation_, items), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    take_items();
    // Only items a worker has taken are left: wait for them, giving the core
    // away after a while in case that worker is waiting for it.
    for (int spins = 0; done_.load(std::memory_order_acquire) < items; ++spins) {
      if (spins < 2000) {
        cpu_relax();
      } else {
        sched_yield();
      }
    }
    if (failure_) {
      std::exception_ptr failure = failure_;
      failure_ = nullptr;
      std::rethrow_exception(failure);
    }
  }

  // Guards against two threads calling at once (the second runs alone).
  std::atomic<bool> busy{false};

 private:
  // Takes and runs items of the current call until none is left.
  int64_t take_items() {
    int64_t ran = 0;
    for (;;) {
      const uint64_t ticket = ticket_.fetch_add(1, std::memory_order_acq_rel);
      if (index_of(ticket) >= count_of(ticket)) return ran;
      try {
        fn_(ctx_, index_of(ticket));
      } catch (...) {
        // Rethrown by the caller; a worker must not let it end the process.
        std::lock_guard<std::mutex> lock(failure_mutex_);
        if (!failure_) failure_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_release);
      ++ran;
    }
  }

  void add_workers(int workers) {
    while (int(threads_.size()) < workers) {
      const int id = int(threads_.size());
      threads_.emplace_back([this, id] { work(id); });
      threads_.back().detach();
    }
  }

  void work(int id) {
    for (;;) {
      wait_for_call(id);
      take_items();
    }
  }

  bool wanted(int id) const { return id < active_.load(std::memory_order_relaxed); }

  void wait_for_call(int id) {
    auto since = std::chrono::steady_clock::now();
    for (int spins = 0;; ++spins) {
      if (has_work(ticket_.load(std::memory_order_acquire)) && wanted(id)) return;
      cpu_relax();
      if (spins % 256 == 255 && std::chrono::steady_clock::now() - since > kSpin) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return has_work(ticket_.load(std::memory_order_seq_cst)) && wanted(id); });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        since = std::chrono::steady_clock::now();
      }
    }
  }

  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> active_{0};  // workers the current call may use
  std::atomic<int> sleepers_{0};
  uint64_t generation_ = 0;
  // The current call; written before its ticket is published.
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  std::exception_ptr failure_;  // the first item's exception in this call
  std::mutex failure_mutex_;
  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_;
};

// Never destroyed: detached workers may still touch it while the process
// exits. A forked child has none of the parent's threads (or a lock it held),
// so it starts a team of its own.
Team* g_team = nullptr;

thread_local bool t_in_fused_decode = false;
std::once_flag g_atfork_once;

Team& team() {
  std::call_once(g_atfork_once, [] { pthread_atfork(nullptr, nullptr, [] { g_team = nullptr; }); });
  if (g_team == nullptr) g_team = new Team();
  return *g_team;
}

}  // namespace

FusedDecodeScope::FusedDecodeScope() : outer_(t_in_fused_decode) { t_in_fused_decode = true; }
FusedDecodeScope::~FusedDecodeScope() { t_in_fused_decode = outer_; }
bool in_fused_decode() { return t_in_fused_decode; }

void run_items(int64_t items, void (*fn)(void*, int64_t), void* ctx) {
  const int workers = std::min<int>(at::get_num_threads(), int(items)) - 1;
  if (workers <= 0 || items > kMaxItems || at::in_parallel_region()) {
    for (int64_t i = 0; i < items; ++i) fn(ctx, i);
    return;
  }
  Team& t = team();
  if (t.busy.exchange(true, std::memory_order_acquire)) {
    for (int64_t i = 0; i < items; ++i) fn(ctx, i);
    return;
  }
  struct Release {
    Team& t;
    ~Release() { t.busy.store(false, std::memory_order_release); }
  } release{t};
  t.run(items, fn, ctx, workers);
}

}  // namespace raylm

std::tuple<at::Tensor, int64_t> work_team_probe(int64_t items, int64_t rounds) {
  TORCH_CHECK(items >= 0 && rounds >= 0, "work_team_probe: items and rounds must be >= 0");
  std::vector<std::atomic<int64_t>> runs(items);
  std::atomic<int64_t> off{0};
  const std::thread::id caller = std::this_thread::get_id();
  for (int64_t r = 0; r < rounds; ++r)
    raylm::for_each_item(items, [&](int64_t i) {
      runs[i].fetch_add(1, std::memory_order_relaxed);
      if (std::this_thread::get_id() != caller) off.fetch_add(1, std::memory_order_relaxed);
    });
  at::Tensor counts = at::empty({items}, at::kLong);
  for (int64_t i = 0; i < items; ++i) counts.data_ptr<int64_t>()[i] = runs[i].load();
  return {counts, off.load()};
}

std::tuple<at::Tensor, int64_t> work_team_range_probe(int64_t n, int64_t grain) {
  TORCH_CHECK(n >= 0, "work_team_range_probe: n must be >= 0");
  std::vector<std::atomic<int64_t>> runs(n);
  std::atomic<int64_t> ranges{0};
  raylm::for_each_range(n, grain, [&](int64_t begin, int64_t end) {
    TORCH_CHECK(begin < end, "work_team_range_probe: an empty range");
    ranges.fetch_add(1, std::memory_order_relaxed);
    for (int64_t i = begin; i < end; ++i) runs[i].fetch_add(1, std::memory_order_relaxed);
  });
  at::Tensor counts = at::empty({n}, at::kLong);
  for (int64_t i = 0; i < n; ++i) counts.data_ptr<int64_t>()[i] = runs[i].load();
  return {counts, ranges.load()};
}
