// Whether an op's work pays for waking OpenMP's team, shared by the kernels that open
// parallel regions of their own (linear_panels.h, paged_decode_cpu.cpp).
//
// Why: `kvserve serve` makes the intra-op threads sleep as soon as a region ends
// (engine/cpu_threads.py: spinning threads starved the HTTP side and any neighbouring
// process). Waking a sleeping thread is a futex call and a reschedule, ~20-40 us on this
// 2-core VM, and far more when another process holds the core it wakes on; a decode step
// of the demo model opened ~21 regions, most for ops of 40-150 us. Measured on this Zen 3
// with sleeping threads and the operands cycled through 64 MB, as a step streams them
// (docs/benchmarks.md, session 33): two threads gain nothing on a linear layer's few rows
// below ~1 MB of weight (256x384: 53 against 55 us; 256x1376: 150 against 153) and win
// above (768x768: 199 against 279); paged decode loses below ~512 KB of K/V (the demo
// model, one sequence of 128 tokens: 48 against 21 us) and wins above. With spinning
// threads (`kvserve generate`) two threads won nearly everywhere, so only the sleeping
// team gets the linear layers' limit, and decode a far lower one.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <strings.h>  // strcasecmp: libgomp reads the policy in any case

namespace team_wake {

// libgomp's own reading of the environment, which it makes once when torch loads it:
// GOMP_SPINCOUNT wins (a number of turns, or "infinite"), then OMP_WAIT_POLICY; unset,
// the threads spin (300,000 turns).
// (kvserve used as a library after torch was imported: the environment may no longer be
// what libgomp read; cpu_threads says so in its log line.)
inline bool team_sleeps() {
  static const bool sleeps = [] {
    if (const char* spin = std::getenv("GOMP_SPINCOUNT")) {
      char* end = nullptr;
      const long long turns = std::strtoll(spin, &end, 10);
      return end != spin && turns == 0;
    }
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy != nullptr && strcasecmp(policy, "passive") == 0;
  }();
  return sleeps;
}

// Multiply-adds (weights x max(rows, 4): a few-row step costs its weight's streaming)
// below which a linear layer runs on one thread when the team sleeps: 1 MB of fp32 weight.
constexpr int64_t kSleepingLinearWork = int64_t{1} << 20;
// K/V elements a decode call reads at most below which it runs on one thread: 512 KB of
// fp32 when the team sleeps, 128 KB when it spins.
inline int64_t decode_parallel_elements() { return team_sleeps() ? int64_t{128} << 10 : int64_t{32} << 10; }

}  // namespace team_wake
