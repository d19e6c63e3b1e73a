// A small pool of worker threads for the engine's matrix products, the way CPU engines use
// every core of the machine for one forward pass: the caller hands it n tasks, the workers
// and the caller take tasks from a shared counter until none are left, and the call returns
// when all n have run.
//
// A forward pass runs a few dozen products of a few hundred microseconds each, so handing
// out work has to cost far less than a thread wake-up from the operating system. Idle
// workers therefore spin for a while (`spin`, 200 us by default) after their last task and
// only then sleep on a condition variable; inside a forward pass, and between the passes of
// a decoding loop, they are still spinning when the next product arrives.
//
// The work split never changes a result: the engine splits a product by output rows, and
// each output element is computed by the same operations whichever thread computes it
// (kernels.hpp, "Batch invariance"). So logits are bit-identical for any number of threads.
//
// One run() at a time: a run() that finds the pool busy (a second caller thread sharing
// it) runs its tasks itself, serially, which is correct, only slower. Tasks must not throw
// (the engine's kernels are noexcept): an exception escaping a task terminates.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace llama {

class ThreadPool {
 public:
  /// A pool that runs tasks on `threads` threads: the caller and threads - 1 workers
  /// (0: one per hardware thread of this machine).
  explicit ThreadPool(std::size_t threads = 0,
                      std::chrono::microseconds spin = std::chrono::microseconds(200))
      : spin_(spin) {
    if (threads == 0) threads = std::max(1U, std::thread::hardware_concurrency());
    workers_.reserve(threads - 1);
    for (std::size_t i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { work_loop(); });
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    stop_.store(true, std::memory_order_relaxed);
    publish();
    for (std::thread& t : workers_) t.join();
  }

  /// Threads that run tasks, the caller included.
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size() + 1; }

  /// Runs task(0), ..., task(tasks - 1), each exactly once, on the pool's threads and the
  /// calling one; returns when all have finished.
  template <class Task>
  void run(std::size_t tasks, Task&& task) {
    if (tasks == 0) return;
    if (workers_.empty() || tasks == 1 || busy_.exchange(true, std::memory_order_acquire)) {
      for (std::size_t i = 0; i < tasks; ++i) task(i);
      return;
    }
    using T = std::remove_reference_t<Task>;
    context_ = const_cast<void*>(static_cast<const void*>(&task));
    invoke_ = [](void* context, std::size_t i) { (*static_cast<T*>(context))(i); };
    tasks_ = tasks;
    next_.store(0, std::memory_order_relaxed);
    unfinished_.store(workers_.size(), std::memory_order_relaxed);
    publish();
    take_tasks();
    // The workers check in once they have found no task left (one may still be on its
    // last one): spin, they are at most one task behind.
    while (unfinished_.load(std::memory_order_acquire) != 0) pause();
    busy_.store(false, std::memory_order_release);
  }

 private:
  static void pause() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  // Makes the job written before it visible to the workers and wakes the sleeping ones.
  void publish() {
    generation_.fetch_add(1, std::memory_order_seq_cst);
    // A worker counts itself as a sleeper before it last looks at generation_ (both
    // sequentially consistent): either it sees the new generation and does not sleep, or
    // this load sees it counted, and the lock below waits until it is inside wait().
    if (sleepers_.load(std::memory_order_seq_cst) != 0) {
      { const std::lock_guard<std::mutex> lock(mutex_); }
      wake_.notify_all();
    }
  }

  void take_tasks() {
    for (std::size_t i = next_.fetch_add(1, std::memory_order_relaxed); i < tasks_;
         i = next_.fetch_add(1, std::memory_order_relaxed)) {
      invoke_(context_, i);
    }
  }

  void work_loop() {
    // Generation 0 is the pool's before any job, not what this thread finds when it starts:
    // a job may already be waiting for it.
    std::uint64_t seen = 0;
    for (;;) {
      // Spin for a new job, then sleep until one is published.
      const auto until = std::chrono::steady_clock::now() + spin_;
      std::uint64_t now = generation_.load(std::memory_order_acquire);
      for (std::size_t i = 0; now == seen; ++i) {
        pause();
        if (i % 64 == 63 && std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          wake_.wait(lock, [&] { return generation_.load(std::memory_order_seq_cst) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
        }
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (stop_.load(std::memory_order_relaxed)) return;
      take_tasks();
      unfinished_.fetch_sub(1, std::memory_order_release);
    }
  }

  std::chrono::microseconds spin_;
  std::vector<std::thread> workers_;
  std::atomic<std::uint64_t> generation_{0};  // one increment per job (and one to stop)
  std::atomic<bool> stop_{false};
  std::atomic<bool> busy_{false};
  std::atomic<std::size_t> sleepers_{0};  // workers waiting on wake_
  std::mutex mutex_;
  std::condition_variable wake_;
  // the current job, written before generation_ is incremented
  void* context_ = nullptr;
  void (*invoke_)(void*, std::size_t) = nullptr;
  std::size_t tasks_ = 0;
  std::atomic<std::size_t> next_{0};
  std::atomic<std::size_t> unfinished_{0};  // workers still taking tasks of the current job
};

}  // namespace llama
