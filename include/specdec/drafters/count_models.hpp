// specdec — unigram and bigram count models built from a token corpus: the paper's trivial
// approximation models (Sec. 4.2, Table 3), usable as draft LanguageModels. With c = 0 they
// speed decoding up whenever alpha > 0 (Corollary 3.9).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <vector>

#include "specdec/concepts.hpp"
#include "specdec/error.hpp"

namespace specdec {

namespace detail {

inline void check_count_model_arguments(const char* model, std::span<const token_id> corpus,
                                        std::size_t vocab_size, double add_k) {
  if (vocab_size == 0) throw_error(errc::invalid_size, model, ": vocab_size must be > 0");
  if (!std::isfinite(add_k) || add_k < 0.0)
    throw_error(errc::invalid_option, model, ": add_k must be finite and >= 0, got ", add_k);
  for (std::size_t i = 0; i < corpus.size(); ++i) {
    if (corpus[i] < 0 || static_cast<std::size_t>(corpus[i]) >= vocab_size)
      throw_error(errc::invalid_token, model, ": corpus position ", i, ": token ", corpus[i],
                  " is outside the vocabulary [0, ", vocab_size, ")");
  }
  if (add_k == 0.0 && corpus.empty())
    throw_error(errc::zero_mass, model, ": an empty corpus needs add_k > 0");
}

}  // namespace detail

/// Unigram model with add-k smoothing: q(x) = (count(x) + k) / (corpus size + k V),
/// whatever the context. k = 1 is Laplace smoothing; k = 0 gives the raw frequencies
/// (unseen tokens get q = 0, which is fine for a draft).
/// @code
/// specdec::UnigramModel<float> unigram(corpus_tokens, vocab_size, /*add_k=*/0.5);
/// @endcode
template <class T = float>
requires ProbabilityScalar<T>
class UnigramModel {
 public:
  /// Throws specdec::error: invalid_size (vocab_size == 0), invalid_option (add_k negative
  /// or not finite), invalid_token (a corpus token outside [0, vocab_size), with its
  /// position), zero_mass (empty corpus with add_k == 0).
  UnigramModel(std::span<const token_id> corpus, std::size_t vocab_size, double add_k = 1.0)
      : counts_(vocab_size, 0), row_(vocab_size), add_k_(add_k) {
    detail::check_count_model_arguments("unigram model", corpus, vocab_size, add_k);
    for (const token_id token : corpus) ++counts_[static_cast<std::size_t>(token)];
    const double denominator =
        static_cast<double>(corpus.size()) + add_k * static_cast<double>(vocab_size);
    for (std::size_t x = 0; x < vocab_size; ++x)
      row_[x] = static_cast<T>((static_cast<double>(counts_[x]) + add_k) / denominator);
    corpus_size_ = corpus.size();
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return row_.size(); }

  /// The same row for every context.
  [[nodiscard]] std::span<const T> next_token_probabilities(
      std::span<const token_id> /*context*/) const noexcept {
    return row_;
  }

  [[nodiscard]] std::size_t count(token_id token) const noexcept {
    return token >= 0 && static_cast<std::size_t>(token) < counts_.size()
               ? counts_[static_cast<std::size_t>(token)]
               : 0;
  }
  [[nodiscard]] std::size_t corpus_size() const noexcept { return corpus_size_; }
  [[nodiscard]] double add_k() const noexcept { return add_k_; }

 private:
  std::vector<std::size_t> counts_;
  std::vector<T> row_;
  double add_k_;
  std::size_t corpus_size_ = 0;
};

/// Bigram model with add-k smoothing:
///   q(x | ..., y) = (count(y x) + k) / (count(y .) + k V)
/// for a previous token y that was followed by something in the corpus. For an empty
/// context, or a y never followed by anything (add-k would give the uniform distribution),
/// it backs off to the unigram model of the same corpus and k.
///
/// Counts are stored sparsely (one sorted successor list per token, O(V + corpus) memory),
/// so large vocabularies are fine; a row costs O(V) to fill into a buffer the model owns
/// (the returned span is valid until the next call). Allocates nothing after construction.
/// @code
/// specdec::BigramModel<float> bigram(corpus_tokens, vocab_size, /*add_k=*/0.1);
/// auto q = bigram.next_token_probabilities(context);
/// @endcode
template <class T = float>
requires ProbabilityScalar<T>
class BigramModel {
 public:
  /// Throws like UnigramModel.
  BigramModel(std::span<const token_id> corpus, std::size_t vocab_size, double add_k = 1.0)
      : unigram_(corpus, vocab_size, add_k), offsets_(vocab_size + 1, 0), row_(vocab_size) {
    // Counting sort of the (previous, next) pairs by previous token, then by next token.
    std::vector<std::size_t> followers(vocab_size, 0);
    for (std::size_t i = 1; i < corpus.size(); ++i)
      ++followers[static_cast<std::size_t>(corpus[i - 1])];
    std::vector<std::size_t> start(vocab_size + 1, 0);
    for (std::size_t y = 0; y < vocab_size; ++y) start[y + 1] = start[y] + followers[y];
    std::vector<token_id> next_tokens(start.back());
    std::vector<std::size_t> fill(start.begin(), start.end() - 1);
    for (std::size_t i = 1; i < corpus.size(); ++i)
      next_tokens[fill[static_cast<std::size_t>(corpus[i - 1])]++] = corpus[i];
    totals_.assign(vocab_size, 0);
    for (std::size_t y = 0; y < vocab_size; ++y) {
      auto first = next_tokens.begin() + static_cast<std::ptrdiff_t>(start[y]);
      auto last = next_tokens.begin() + static_cast<std::ptrdiff_t>(start[y + 1]);
      std::sort(first, last);
      for (auto it = first; it != last;) {
        const auto run_end = std::find_if(it, last, [&](token_id x) { return x != *it; });
        successors_.push_back({*it, static_cast<std::size_t>(run_end - it)});
        it = run_end;
      }
      offsets_[y + 1] = successors_.size();
      totals_[y] = followers[y];
    }
    successors_.shrink_to_fit();
  }

  [[nodiscard]] std::size_t vocab_size() const noexcept { return row_.size(); }

  /// Throws specdec::error (invalid_token) if the last context token is outside
  /// [0, vocab_size()).
  [[nodiscard]] std::span<const T> next_token_probabilities(std::span<const token_id> context) {
    if (context.empty()) return unigram_.next_token_probabilities(context);
    const token_id previous = context.back();
    if (previous < 0 || static_cast<std::size_t>(previous) >= row_.size())
      detail::throw_error(errc::invalid_token, "bigram model: context position ",
                          context.size() - 1, ": token ", previous,
                          " is outside the vocabulary [0, ", row_.size(), ")");
    const auto y = static_cast<std::size_t>(previous);
    if (totals_[y] == 0) return unigram_.next_token_probabilities(context);
    const double k = unigram_.add_k();
    const double denominator =
        static_cast<double>(totals_[y]) + k * static_cast<double>(row_.size());
    std::fill(row_.begin(), row_.end(), static_cast<T>(k / denominator));
    for (std::size_t s = offsets_[y]; s < offsets_[y + 1]; ++s)
      row_[static_cast<std::size_t>(successors_[s].token)] =
          static_cast<T>((static_cast<double>(successors_[s].count) + k) / denominator);
    return row_;
  }

  /// count(previous next) in the corpus.
  [[nodiscard]] std::size_t count(token_id previous, token_id next) const noexcept {
    if (previous < 0 || static_cast<std::size_t>(previous) >= totals_.size()) return 0;
    const auto y = static_cast<std::size_t>(previous);
    for (std::size_t s = offsets_[y]; s < offsets_[y + 1]; ++s)
      if (successors_[s].token == next) return successors_[s].count;
    return 0;
  }
  [[nodiscard]] const UnigramModel<T>& unigram() const noexcept { return unigram_; }

 private:
  struct Successor {
    token_id token;
    std::size_t count;
  };

  UnigramModel<T> unigram_;
  std::vector<std::size_t> offsets_;  // successors of y: successors_[offsets_[y], offsets_[y+1])
  std::vector<Successor> successors_;
  std::vector<std::size_t> totals_;  // count(y .)
  std::vector<T> row_;
};

static_assert(LanguageModel<UnigramModel<float>>);
static_assert(LanguageModel<BigramModel<double>>);

}  // namespace specdec
