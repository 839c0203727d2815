// Probes of native/csrc/team.h for tests/test_team.py, called through ctypes: the team
// itself, compiled into a library of their own (twice, to see that a process has one).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "../../native/csrc/team.h"

extern "C" {

const void* team_address() { return &team::get(); }

int team_threads() { return team::get().threads(); }

// The chunks parallel_for(0, n, grain) made, or -1 unless each index came exactly once.
int covers(int64_t n, int64_t grain) {
  std::vector<std::atomic<int>> seen(n);
  std::atomic<int> chunks{0};
  team::parallel_for(0, n, grain, [&](int64_t lo, int64_t hi) {
    chunks.fetch_add(1);
    for (int64_t i = lo; i < hi; ++i) seen[i].fetch_add(1);
  });
  for (auto& s : seen) if (s.load() != 1) return -1;
  return chunks.load();
}

// The message of the exception thread `tid` of a two-thread job threw, as the caller
// caught it ("" when none arrived); writes it into out.
int rethrows(int tid, char* out, int size) {
  try {
    team::get().run(2, [&](int t, int) {
      if (t == tid) throw std::runtime_error("thrown by thread " + std::to_string(t));
    });
  } catch (const std::exception& e) {
    std::snprintf(out, size, "%s", e.what());
    return 1;
  }
  return 0;
}

// A job inside a job runs on the calling thread: returns the inner team sizes seen, summed
// (2 threads, each running an inner job of one: 2).
int nested() {
  std::atomic<int> inner{0};
  team::get().run(2, [&](int, int) {
    team::get().run(2, [&](int, int n) { inner.fetch_add(n); });
  });
  return inner.load();
}

// The threads (by kernel thread id) that ran the two shares of a job started while the
// worker sleeps: with `together` always two; without, often the caller's alone (it takes
// the worker's share before the worker has woken).
int distinct_threads(int together) {
  std::atomic<long> ran[2] = {0, 0};
  team::get().run(2, [&](int share, int) { ran[share].store(syscall(SYS_gettid)); }, together != 0);
  return ran[0].load() == ran[1].load() ? 1 : 2;
}

}  // extern "C"
