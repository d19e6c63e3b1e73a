// Cost of constraining one row (constrained_model.hpp): ConstrainedSampling::apply of a
// bitmask constraint to a float row of V in {32k, 128k} (mask, bias of 8 tokens, ban of 8,
// renormalisation into the adapter's output row), the row in cache or evicted to DRAM
// before each timed call, against references timed interleaved with it (baseline.hpp), on
// the same statistic, the median of thread CPU time:
//   the pure read   an integer OR over the V floats of the model's row (the physical limit:
//                   any exact implementation reads the allowed entries once);
//   the peer        what a competent engineer writes: one loop testing the mask bit of every
//                   token, writing the masked entry and summing, then one scaling loop.
// Masks: every token allowed (bias and ban only), half of them at random, and 1% (a
// grammar state allowing few tokens, in runs of 64: the mask words a JSON or regex state
// produces are mostly empty or full). `kept`: 0, every call writes the whole output row
// (nothing known of it: the first row of an adapter's buffer); 1, the adapters' steady state
// when the buffer's previous mask had the same empty blocks (blocks that were zero and stay
// zero are not written again; rows of a step with other masks fall in between).
//
// Counters: vs_read (apply / pure read), vs_peer (peer / apply: above 1, specdec is
// faster), allowed (fraction of tokens allowed).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <benchmark/benchmark.h>

#include "baseline.hpp"
#include "specdec/constrained_model.hpp"
#include "specdec/random.hpp"

namespace {

using specdec::token_id;
using specdec::baseline::residence;

/// A constraint with one fixed mask (what a TokenDfa state costs: a copy of its words).
struct FixedMask {
  using state_type = int;
  const std::vector<std::uint64_t>* words = nullptr;
  [[nodiscard]] int state() const { return 0; }
  void restore(int /*state*/) {}
  bool advance(token_id /*token*/) { return true; }
  void allowed_tokens(std::span<std::uint64_t> out) const {
    std::copy(words->begin(), words->end(), out.begin());
  }
};

enum mask_kind : std::int64_t { all_allowed = 0, half_random = 1, runs_1_percent = 2 };

std::vector<std::uint64_t> make_mask(std::size_t vocab, mask_kind kind, specdec::xoshiro256pp& g) {
  std::vector<std::uint64_t> words(specdec::mask_words(vocab), 0);
  for (std::size_t w = 0; w < words.size(); ++w) {
    switch (kind) {
      case all_allowed:
        words[w] = ~std::uint64_t{0};
        break;
      case half_random:
        words[w] = g();
        break;
      case runs_1_percent:
        words[w] = specdec::uniform01<double>(g) < 0.01 ? ~std::uint64_t{0} : 0;
        break;
    }
  }
  return words;
}

void BM_ConstrainRow(benchmark::State& state) {
  namespace bl = specdec::baseline;
  const auto vocab = static_cast<std::size_t>(state.range(0));
  const auto kind = static_cast<mask_kind>(state.range(1));
  const auto where = static_cast<residence>(state.range(2));
  const bool kept = state.range(3) != 0;
  specdec::xoshiro256pp g(17);
  std::vector<float> row(vocab);
  double total = 0.0;
  for (auto& x : row) {
    x = static_cast<float>(1.0 / (1.0 + static_cast<double>(specdec::uniform_below(g, vocab))));
    total += x;
  }
  for (auto& x : row) x = static_cast<float>(x / total);
  const auto words = make_mask(vocab, kind, g);
  specdec::BiasOptions bias;
  for (int k = 0; k < 8; ++k) {
    bias.logit_bias.push_back({static_cast<token_id>(uniform_below(g, vocab)), 1.5});
    bias.banned_tokens.push_back(static_cast<token_id>(uniform_below(g, vocab)));
  }
  specdec::ConstrainedSampling<FixedMask> rules(vocab, FixedMask{&words}, bias);
  const std::vector<token_id> context = {1, 2, 3, 4};
  rules.start(std::span<const token_id>(context).first(2));
  std::vector<float> out(vocab), peer_out(vocab);
  std::vector<std::uint64_t> written(words.size(), ~std::uint64_t{0});
  std::vector<std::uint64_t> peer_mask = words;
  for (const token_id t : bias.banned_tokens) specdec::mask_clear(peer_mask, t);

  const auto apply = [&] {
    if (!kept) std::fill(written.begin(), written.end(), ~std::uint64_t{0});
    rules.apply(std::span<const token_id>(context), std::span<const float>(row),
                std::span<float>(out), specdec::model_role::target, false,
                std::span<std::uint64_t>(written));
    benchmark::DoNotOptimize(out.data());
  };
  const auto read = [&] { benchmark::DoNotOptimize(bl::or_bits(row.data(), vocab)); };
  const auto peer = [&] {
    double sum = 0.0;
    for (std::size_t i = 0; i < vocab; ++i) {
      const bool keep = ((peer_mask[i / 64] >> (i % 64)) & 1U) != 0;
      const float x = keep ? row[i] : 0.0F;
      peer_out[i] = x;
      sum += static_cast<double>(x);
    }
    for (const auto& b : bias.logit_bias) {
      const auto i = static_cast<std::size_t>(b.token);
      const double before = static_cast<double>(peer_out[i]);
      peer_out[i] = static_cast<float>(before * std::exp(b.bias));
      sum += static_cast<double>(peer_out[i]) - before;
    }
    const auto scale = static_cast<float>(1.0 / sum);
    for (auto& x : peer_out) x *= scale;
    benchmark::DoNotOptimize(peer_out.data());
  };
  const std::size_t repetitions = where == residence::cache ? bl::calibrate(read) : 1;
  (void)bl::interleave(state, where, repetitions, apply, read, peer);
  std::size_t allowed = 0;
  for (const auto w : words) allowed += static_cast<std::size_t>(std::popcount(w));
  state.counters["V"] = static_cast<double>(vocab);
  state.counters["allowed"] = static_cast<double>(allowed) / static_cast<double>(vocab);
}

template <int Where, int Kept>
void arguments(benchmark::internal::Benchmark* benchmark) {
  for (const std::int64_t size : {32768, 131072}) {
    if (Kept == 0) {
      for (const std::int64_t kind : {all_allowed, half_random, runs_1_percent}) {
        benchmark->Args({size, kind, Where, 0});
      }
    } else {
      benchmark->Args({size, runs_1_percent, Where, 1});
    }
  }
  benchmark->ArgNames({"V", "mask", "dram", "kept"})
      ->UseManualTime()
      ->Unit(benchmark::kMicrosecond);
  // Fixed sample counts: the step is up to 100x cheaper than the per-token loop timed with
  // it, so sampling until the step's time reached a minimum would run for minutes.
  benchmark->Iterations(Where == 1 ? specdec::baseline::dram_samples() : 101);
}

}  // namespace

BENCHMARK(BM_ConstrainRow)->Apply(arguments<0, 0>);
BENCHMARK(BM_ConstrainRow)->Apply(arguments<0, 1>);
BENCHMARK(BM_ConstrainRow)->Apply(arguments<1, 0>);
BENCHMARK(BM_ConstrainRow)->Apply(arguments<1, 1>);
