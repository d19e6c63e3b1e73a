// specdec — how batch work runs on threads: the TaskExecutor concept, a non-owning
// reference to any executor, and a small built-in thread pool.
//
// Batch verification hands an executor `count` tasks (task k = "work through sequences with
// workspace k") and waits for them. An engine that already has threads supplies its own
// executor (anything with `run(count, task)` and `concurrency()`); otherwise ThreadPool is
// the default. Results never depend on which thread ran which task.
#pragma once

#include <algorithm>
#include <atomic>
#include <concepts>
#include <condition_variable>
#include <cstddef>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace specdec {

/// A non-owning reference to a callable `void(std::size_t)` (no allocation, trivially
/// copyable). The callable must outlive every call.
class task_ref {
 public:
  template <class F>
  requires(!std::same_as<std::remove_cvref_t<F>, task_ref> &&
           std::is_invocable_r_v<void, F&, std::size_t>) task_ref(F& function)
  noexcept  // NOLINT(google-explicit-constructor)
      : object_(static_cast<void*>(std::addressof(function))),
        call_([](void* object, std::size_t k) { (*static_cast<F*>(object))(k); }) {}

  void operator()(std::size_t k) const { call_(object_, k); }

 private:
  void* object_;
  void (*call_)(void*, std::size_t);
};

/// An executor runs `count` tasks: `run(count, task)` calls task(k) exactly once for every k
/// in [0, count), possibly on several threads at once, and returns when every call has
/// returned. `concurrency()` is how many tasks it can run at once (the batch verifier keeps
/// that many workspaces and hands out that many tasks). Tasks given by specdec never throw.
template <class E>
concept TaskExecutor = requires(E& executor, std::size_t count, task_ref task) {
  executor.run(count, task);
  { executor.concurrency() } -> std::convertible_to<std::size_t>;
};

/// Runs every task on the calling thread, in order.
class InlineExecutor {
 public:
  void run(std::size_t count, task_ref task) const {
    for (std::size_t k = 0; k < count; ++k) task(k);
  }
  [[nodiscard]] std::size_t concurrency() const noexcept { return 1; }
};

/// A fixed set of threads: `threads - 1` workers plus the thread calling run(), which takes
/// tasks too. run() calls from several threads are served one after another. Waiting workers
/// sleep on a condition variable; run() allocates nothing.
class ThreadPool {
 public:
  /// `threads` = 0: std::thread::hardware_concurrency() (1 if unknown).
  explicit ThreadPool(std::size_t threads = 0)
      : threads_(threads != 0 ? threads
                              : std::max<std::size_t>(1, std::thread::hardware_concurrency())) {
    workers_.reserve(threads_ - 1);
    for (std::size_t w = 1; w < threads_; ++w) workers_.emplace_back([this] { serve(); });
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  ~ThreadPool() {
    {
      const std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

  [[nodiscard]] std::size_t concurrency() const noexcept { return threads_; }

  void run(std::size_t count, task_ref task) {
    if (count == 0) return;
    if (workers_.empty() || count == 1) {
      for (std::size_t k = 0; k < count; ++k) task(k);
      return;
    }
    const std::lock_guard serial(run_mutex_);
    {
      const std::lock_guard lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0, std::memory_order_relaxed);
      busy_ = workers_.size();
      ++generation_;
    }
    wake_.notify_all();
    take_tasks(task, count);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    task_ = nullptr;
  }

 private:
  void take_tasks(task_ref task, std::size_t count) {
    for (std::size_t k = next_.fetch_add(1, std::memory_order_relaxed); k < count;
         k = next_.fetch_add(1, std::memory_order_relaxed)) {
      task(k);
    }
  }

  void serve() {
    std::size_t seen = 0;
    for (;;) {
      const task_ref* task = nullptr;
      std::size_t count = 0;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        task = task_;
        count = count_;
      }
      take_tasks(*task, count);
      {
        const std::lock_guard lock(mutex_);
        if (--busy_ == 0) done_.notify_one();
      }
    }
  }

  std::size_t threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one run() at a time
  std::mutex mutex_;      // guards everything below but next_
  std::condition_variable wake_;
  std::condition_variable done_;
  const task_ref* task_ = nullptr;
  std::size_t count_ = 0;
  std::size_t busy_ = 0;  // workers still in the current run
  std::size_t generation_ = 0;
  bool stopping_ = false;
  std::atomic<std::size_t> next_{0};
};

/// An executor from a plain function `f(count, task)` that runs task(0..count-1) (e.g. an
/// engine's parallel-for or an OpenMP loop), with the concurrency it offers.
/// @code
/// auto omp = specdec::FunctionExecutor([](std::size_t count, specdec::task_ref task) {
///   #pragma omp parallel for
///   for (std::size_t k = 0; k < count; ++k) task(k);
/// }, omp_get_max_threads());
/// specdec::BatchVerifier<float> verifier{specdec::executor_ref(omp)};
/// @endcode
template <class F>
requires std::is_invocable_v<F&, std::size_t, task_ref>
class FunctionExecutor {
 public:
  FunctionExecutor(F function, std::size_t concurrency)
      : function_(std::move(function)), concurrency_(std::max<std::size_t>(1, concurrency)) {}

  void run(std::size_t count, task_ref task) { function_(count, task); }
  [[nodiscard]] std::size_t concurrency() const noexcept { return concurrency_; }

 private:
  F function_;
  std::size_t concurrency_;
};

static_assert(TaskExecutor<InlineExecutor>);
static_assert(TaskExecutor<ThreadPool>);

/// A non-owning, type-erased reference to a TaskExecutor.
class executor_ref {
 public:
  template <TaskExecutor E>
  requires(!std::same_as<std::remove_cvref_t<E>, executor_ref>) executor_ref(E& executor)
  noexcept  // NOLINT(google-explicit-constructor)
      : object_(static_cast<void*>(std::addressof(executor))),
        run_([](void* object, std::size_t count, task_ref task) {
          static_cast<E*>(object)->run(count, task);
        }),
        concurrency_(
            [](void* object) -> std::size_t { return static_cast<E*>(object)->concurrency(); }) {}

  void run(std::size_t count, task_ref task) const { run_(object_, count, task); }
  [[nodiscard]] std::size_t concurrency() const { return concurrency_(object_); }

 private:
  void* object_;
  void (*run_)(void*, std::size_t, task_ref);
  std::size_t (*concurrency_)(void*);
};

}  // namespace specdec
