// kvserve's own intra-op thread team, for every kernel of ours that splits its work over
// threads (the panels' GEMM, paged decode, the layer ops, sampling, the tables' and
// policies' C++ passes): `team::parallel_for` is at::parallel_for's contract on it.
//
// Why not OpenMP's (torch's): libgomp's threads either spin for a count fixed when it
// loads (GOMP_SPINCOUNT) or sleep on a futex at once (OMP_WAIT_POLICY=PASSIVE). A server
// wants both: awake through the ~60 parallel regions of a decode step, whose gaps are
// tens of microseconds, and asleep between steps and beside other processes. Waking a
// sleeping thread is a futex call; on a VM whose idle vCPUs halt at once (this repo's:
// the guest's halt polling is off, guest_halt_poll_ns 0) it is also an IPI and a vCPU
// wake-up on the host. That was 10-20% of the 160M model's decode step; with the guest's
// halt polling switched on, sleeping threads were as fast as spinning ones
// (docs/benchmarks.md at commit f378cb8). Here a worker that finished a job polls for the next
// for `spin_ns()` (1 ms unless KVSERVE_TEAM_SPIN_US says otherwise: longer than a step's
// gaps), then sleeps; while it polls it calls sched_yield, so a thread or process that
// wants its core gets it (a pure spin holds a core that another thread of the server
// needs). The caller makes the futex call only when a worker sleeps.
//
// One team a process: the function-local statics of `get()` are GNU unique symbols, shared
// by every kvserve library that includes this header (tests/test_team.py checks). A child
// forked after the team started has none of its workers: it starts its own on first use.
#pragma once

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

namespace team {

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

// How long an idle worker polls before it sleeps: KVSERVE_TEAM_SPIN_US, which
// engine/cpu_threads.py sets from --cpu-wait (0 for passive: sleep at once), else 1,000 us.
inline int64_t spin_ns() {
  static const int64_t ns = [] {
    const char* env = std::getenv("KVSERVE_TEAM_SPIN_US");
    char* end = nullptr;
    const long long us = env != nullptr ? std::strtoll(env, &end, 10) : 1000;
    return int64_t{1000} * std::max<long long>(0, env != nullptr && end == env ? 1000 : us);
  }();
  return ns;
}

// Whether a worker sleeps as soon as its job ends: then waking it is a futex call and a
// reschedule, ~20-40 us on a 2-core VM and far more when another process holds the core it
// wakes on, and the kernels keep small calls on the calling thread. Measured with sleeping
// threads and the operands cycled through 64 MB, as a step streams them (docs/benchmarks.md,
// "CPU threads"): two threads gain nothing on a linear layer's few rows below ~1 MB of weight
// (256x384: 53 against 55 us; 256x1376: 150 against 153) and win above (768x768: 199
// against 279); paged decode loses below ~512 KB of K/V (the demo model, one sequence of 128
// tokens: 48 against 21 us) and wins above. With polling threads two threads won nearly
// everywhere, so only the sleeping team gets the linear layers' limit, and decode a far
// lower one.
inline bool sleeps() { return spin_ns() == 0; }

// Multiply-adds (weights x max(rows, 4): a few-row step costs its weight's streaming)
// below which a linear layer runs on one thread when the team sleeps: 1 MB of fp32 weight.
constexpr int64_t kSleepingLinearWork = int64_t{1} << 20;
// K/V elements a decode call reads at most below which it runs on one thread: 512 KB of
// fp32 when the team sleeps, 128 KB when it polls.
inline int64_t decode_parallel_elements() { return sleeps() ? int64_t{128} << 10 : int64_t{32} << 10; }

inline thread_local bool in_job = false;  // nested calls run on the calling thread

class Team {
 public:
  // Runs fn(share, n) for the shares 0..n-1 of a job on up to n threads and returns when
  // all have finished; the first exception any share threw is rethrown here (as
  // at::parallel_for does). A thread takes the next share not taken yet, so the caller
  // does a worker's share itself when that worker has not turned up by the time its own
  // is done (its core went to another thread: waiting for it cost a scheduler slice).
  // `together`: each share on a thread of its own, at once, for a job whose shares meet
  // at `barrier`.
  template <typename F>
  void run(int n, F&& fn, bool together = false) {
    if (n <= 1 || in_job || at::in_parallel_region()) {
      fn(0, 1);  // one share: the whole job
      return;
    }
    std::lock_guard<std::mutex> one_job(job_lock_);  // two engine threads: one job at a time
    ensure(n - 1);
    using Fn = std::remove_reference_t<F>;
    auto call = [](void* f, int share, int shares) { (*static_cast<Fn*>(f))(share, shares); };
    job_ = {call, const_cast<void*>(static_cast<const void*>(&fn)), n, together};
    failure_ = nullptr;
    failed_.store(false, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    claim_.store(uint64_t{g} << 32 | uint64_t(n) << 16, std::memory_order_release);
    gen_.store(g, std::memory_order_seq_cst);  // then read sleepers_: a Dekker pair
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
              nullptr, 0);
    }
    in_job = true;
    take_shares(g);
    in_job = false;
    for (int turns = 0; finished_.load(std::memory_order_acquire) < n; ++turns) {
      if (turns < 64) pause(); else sched_yield();
    }
    if (failure_ != nullptr) std::rethrow_exception(failure_);
  }

  // A barrier for the n shares of a `together` job (a job's phases: pack, then multiply).
  void barrier(int n) {
    if (n <= 1) return;
    const uint32_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int turns = 0; phase_.load(std::memory_order_acquire) == phase; ++turns) {
      if (turns < 64) pause(); else sched_yield();
    }
  }

  int threads() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  struct Job {
    void (*call)(void*, int, int) = nullptr;
    void* fn = nullptr;
    int n = 0;
    bool together = false;
  };

  // The next untaken share of job `g`, or -1: `claim_` packs the job's generation, its
  // share count and the next share, so a worker that turns up after its job ended (and
  // the next began) takes nothing of either.
  int claim(uint32_t g) {
    uint64_t w = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int n = static_cast<int>(w >> 16 & 0xFFFF), next = static_cast<int>(w & 0xFFFF);
      if (static_cast<uint32_t>(w >> 32) != g || next >= n) return -1;
      if (claim_.compare_exchange_weak(w, w + 1, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        return next;
      }
    }
  }

  // Shares of job `g` until none is left (one only in a `together` job); `job_` is read
  // only after a share was taken: the job cannot end before that share has.
  void take_shares(uint32_t g) {
    for (int share = claim(g); share >= 0; share = claim(g)) {
      const Job job = job_;
      try {
        job.call(job.fn, share, job.n);
      } catch (...) {
        if (!failed_.exchange(true)) failure_ = std::current_exception();
      }
      const bool together = job.together;
      finished_.fetch_add(1, std::memory_order_release);
      if (together) return;
    }
  }

  void ensure(int wanted) {
    while (static_cast<int>(workers_.size()) < wanted) {
      const uint32_t seen = gen_.load(std::memory_order_acquire);
      workers_.emplace_back([this, seen] {
        pthread_setname_np(pthread_self(), "kvserve-team");  // as top -H and tests see it
        work(seen);
      });
    }
  }

  void work(uint32_t seen) {
    in_job = true;  // a worker's own kernels run nested calls inline
    for (;;) {
      uint32_t g;
      const int64_t since = now_ns();
      for (int turns = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++turns) {
        if (turns < 256) {
          pause();
        } else if ((turns & 15) != 0 || now_ns() - since < spin_ns()) {
          sched_yield();
        } else {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (gen_.load(std::memory_order_seq_cst) == seen) {
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAIT_PRIVATE, seen, nullptr,
                    nullptr, 0);
          }
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          turns = 0;
        }
      }
      seen = g;
      take_shares(g);
    }
  }

  std::mutex job_lock_;
  std::vector<std::thread> workers_;
  Job job_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint64_t> claim_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> finished_{0};
  std::exception_ptr failure_;
  std::atomic<bool> failed_{false};
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> phase_{0};
};

// The process's team (a child forked after it started gets a new one: its workers stayed
// behind in the parent). Never destroyed: workers must not be joined while a library unloads.
inline Team& get() {
  static std::atomic<Team*> the{nullptr};
  static std::mutex lock;
  // A forked child has none of the parent's workers: it starts a team of its own (the
  // parent's is leaked there). Registered once, so a job pays no check of the process id.
  static const bool forks_start_afresh =
      pthread_atfork(nullptr, nullptr, [] { the.store(nullptr, std::memory_order_relaxed); }) == 0;
  (void)forks_start_afresh;
  Team* team = the.load(std::memory_order_acquire);
  if (team == nullptr) {
    std::lock_guard<std::mutex> guard(lock);
    team = the.load(std::memory_order_relaxed);
    if (team == nullptr) {
      team = new Team();
      the.store(team, std::memory_order_release);
    }
  }
  return *team;
}

// at::parallel_for's contract on this team: [begin, end) in contiguous chunks of at least
// `grain`, one a thread, on at most at::get_num_threads() threads.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t g = std::max<int64_t>(grain, 1);
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), (n + g - 1) / g));
  if (threads <= 1) {
    f(begin, end);
    return;
  }
  get().run(threads, [&](int tid, int team) {
    const int64_t share = (n + team - 1) / team;
    const int64_t lo = begin + std::min(n, tid * share), hi = begin + std::min(n, (tid + 1) * share);
    if (lo < hi) f(lo, hi);
  });
}

// at::zeros, filled on the calling thread. torch fills a tensor of more than 32,768
// elements on its OpenMP threads, which a server's wait leaves asleep
// (engine/cpu_threads.py): each fill of an op's [rows, slots] output (a policy's drop
// mask, the decode kernel's attention mass) was a futex wake-up, 40-70 us on this repo's
// VM, for a memset of a few microseconds.
inline at::Tensor zeros(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  std::memset(t.data_ptr(), 0, t.nbytes());
  return t;
}

}  // namespace team
