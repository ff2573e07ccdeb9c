// Work items shared out between threads, each taking the front of its own share and, once done,
// the back of another's (packed_gemv.cpp's decode-batch matmuls).
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

namespace ember_shares {

// The items a thread has left of its share, [front, back) packed in one word: its owner takes
// from the front, a thread done with its own share from the back (GroupShares).
struct alignas(64) GroupSpan {
  std::atomic<uint64_t> span{0};
};

// Each thread's equal share of a range of work items (a matmul's groups of channels), taken one
// by one: a thread that finishes its share first takes the items at the back of the others' while
// two or more are left there (the next one, which its owner may have asked for in cache, stays
// with it), so that a core the OS lends to another process for a while, or a slower one, does not
// hold every thread at the join.
class GroupShares {
 public:
  GroupShares(int64_t items, int64_t threads) : spans_(threads) {
    for (int64_t t = 0; t < threads; ++t) {
      spans_[t].span.store(pack(items * t / threads, items * (t + 1) / threads));
    }
  }
  int64_t threads() const { return static_cast<int64_t>(spans_.size()); }
  // The front item of thread t's share, and the item after it while still there (-1 if none).
  bool take_front(int64_t t, int64_t& item, int64_t& after) {
    std::atomic<uint64_t>& span = spans_[t].span;
    uint64_t now = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = now >> 32, back = now & 0xffffffffu;
      if (front >= back) return false;
      if (span.compare_exchange_weak(now, pack(front + 1, back), std::memory_order_relaxed)) {
        item = static_cast<int64_t>(front);
        after = front + 1 < back ? item + 1 : -1;
        return true;
      }
    }
  }
  // The back item of thread t's share, while it has two or more left.
  bool take_back(int64_t t, int64_t& item) {
    std::atomic<uint64_t>& span = spans_[t].span;
    uint64_t now = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t front = now >> 32, back = now & 0xffffffffu;
      if (front + 2 > back) return false;
      if (span.compare_exchange_weak(now, pack(front, back - 1), std::memory_order_relaxed)) {
        item = static_cast<int64_t>(back - 1);
        return true;
      }
    }
  }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return (static_cast<uint64_t>(front) << 32) | static_cast<uint64_t>(back);
  }
  std::vector<GroupSpan> spans_;
};

}  // namespace ember_shares
