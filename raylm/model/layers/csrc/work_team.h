// A team of threads for the decode matmuls, where each call is a few
// microseconds of work: an OpenMP parallel region per matmul (fork, then a
// join that waits for every thread of the team) made a batch-1 decode step
// of a ~7M model spend ~70% of its time in libgomp, and far more on a busy
// machine, where each join waits out a scheduler time slice for a peer that
// was descheduled before it even started.
//
// Here the calling thread never waits for a thread that has not started:
// items are handed out from one shared counter, the caller takes them too,
// and it waits only for items a worker has already taken. Workers spin a
// while between calls (a decode step's matmuls come microseconds apart),
// then sleep until woken. Which thread runs an item changes nothing in its
// result: each item is computed the same way whoever runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace raylm {

// Runs fn(ctx, i) for every i in [0, items) once, on the calling thread and
// up to at::get_num_threads() - 1 workers; returns when all have run. Runs
// them all on the calling thread inside an OpenMP region, under another
// call of this (from another thread), or with one thread.
void run_items(int64_t items, void (*fn)(void*, int64_t), void* ctx);

// item(i) for every i in [0, items), as run_items.
template <typename Item>
void for_each_item(int64_t items, const Item& item) {
  run_items(items, [](void* ctx, int64_t i) { (*static_cast<const Item*>(ctx))(i); },
            const_cast<void*>(static_cast<const void*>(&item)));
}

// range(begin, end) over [0, n) in contiguous ranges of at least `grain`
// (the whole of [0, n) on the caller when n <= grain), as at::parallel_for
// splits its range, but on the team. Ranges are at most kRangesPerThread per
// thread, so uneven ones (requests of different lengths) still balance.
constexpr int64_t kRangesPerThread = 4;

template <typename Range>
void for_each_range(int64_t n, int64_t grain, const Range& range) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  if (n <= grain) {
    range(int64_t(0), n);
    return;
  }
  const int64_t ranges = std::min<int64_t>((n + grain - 1) / grain, kRangesPerThread * std::max(1, at::get_num_threads()));
  const int64_t size = (n + ranges - 1) / ranges;
  for_each_item((n + size - 1) / size, [&](int64_t i) { range(i * size, std::min(n, (i + 1) * size)); });
}

// While a fused decode step (decode_layer_loop.h) runs on this thread, its
// matmuls run on the team, so its attention and elementwise ops must too: an
// OpenMP region between them wakes OpenMP's threads while the team's still
// spin for the next matmul, two pools fighting over the same cores (on 2
// cores a 111M model's batch-1 step spent ~20% of its time so, in attention
// over at most 129 tokens). Outside one (prefill, larger batches, the module
// path) the matmuls are torch's, on OpenMP, and so are these ops.
class FusedDecodeScope {
 public:
  FusedDecodeScope();
  ~FusedDecodeScope();
  FusedDecodeScope(const FusedDecodeScope&) = delete;
  FusedDecodeScope& operator=(const FusedDecodeScope&) = delete;

 private:
  bool outer_;
};
bool in_fused_decode();

// for_each_range inside a fused decode step, at::parallel_for outside one.
template <typename Range>
void parallel_ranges(int64_t n, int64_t grain, const Range& range) {
  if (in_fused_decode()) {
    for_each_range(n, grain, range);
  } else {
    at::parallel_for(0, n, grain, range);
  }
}

}  // namespace raylm
