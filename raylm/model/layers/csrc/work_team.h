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

}  // namespace raylm
