// A small fork-join loop for the CPU handlers: splits [0, n) into contiguous chunks across the
// machine's cores. Each index is computed by exactly one thread with the same arithmetic, so
// results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace hj {

template <typename F>
void parallel_for(int64_t n, int64_t cost_per_item, F&& f) {
  const int64_t hw = static_cast<int64_t>(std::max(1u, std::thread::hardware_concurrency()));
  // Below ~1M operations a thread costs more than it saves.
  const int64_t useful = std::max<int64_t>(1, (n * std::max<int64_t>(cost_per_item, 1)) / (1 << 20));
  const int64_t workers = std::min({hw, n, useful});
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(workers));
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t lo = n * w / workers, hi = n * (w + 1) / workers;
    pool.emplace_back([lo, hi, &f] {
      for (int64_t i = lo; i < hi; ++i) f(i);
    });
  }
  for (auto& t : pool) t.join();
}

}  // namespace hj
