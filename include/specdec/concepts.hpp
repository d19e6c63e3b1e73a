// specdec — the vocabulary of the library: token ids, probability vectors and matrices,
// language models and drafters.
//
// Concepts are built from small named sub-concepts so that a compiler diagnostic names
// the exact clause a type is missing (e.g. "HasVocabSize<MyModel> was not satisfied").
// Foreign vector types opt in by specialising `probability_vector_traits`, never by
// deriving from a library base class.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ranges>
#include <span>
#include <type_traits>

#include "specdec/rows.hpp"

namespace specdec {

// The "clang-format off" regions below keep concept definitions and constrained partial
// specializations readable: clang-format 14 misparses them (e.g. `std::same_as < T, float >`).

/// A token id. Valid ids of a model are [0, vocab_size()).
using token_id = std::int32_t;

/// The element types a probability row may have.
// clang-format off
template <class T>
concept ProbabilityScalar =
    std::same_as<std::remove_cv_t<T>, float> || std::same_as<std::remove_cv_t<T>, double>;
// clang-format on

// ---------------------------------------------------------------------------------------
// Probability vectors
// ---------------------------------------------------------------------------------------

/// Customisation point: how to view a vector type as `std::span<const T>`.
/// Specialise it for your own container with
/// @code
/// template <> struct specdec::probability_vector_traits<MyRow> {
///   static std::span<const float> view(const MyRow& row) { return {row.ptr, row.len}; }
/// };
/// @endcode
/// The primary template is undefined on purpose; the library provides specialisations for
/// contiguous sized ranges of float/double (std::vector, std::array, std::span, ...) and for
/// Eigen dense vectors with unit inner stride (VectorXf, VectorXd, Map, Ref, contiguous
/// blocks), detected structurally so that this header need not include Eigen.
template <class V, class Enable = void>
struct probability_vector_traits;

namespace detail {

template <class V>
concept eigen_dense_vector = requires(const V& v) {
  typename V::Scalar;
  requires ProbabilityScalar<typename V::Scalar>;
  requires bool(V::IsVectorAtCompileTime);
  requires V::InnerStrideAtCompileTime == 1;
  { v.data() } -> std::convertible_to<const typename V::Scalar*>;
  { v.size() } -> std::convertible_to<std::ptrdiff_t>;
};

template <class V>
concept contiguous_scalar_range =
    !eigen_dense_vector<V> && std::ranges::contiguous_range<const V&> &&
    std::ranges::sized_range<const V&> && ProbabilityScalar<std::ranges::range_value_t<const V&>>;

template <class T>
struct is_const_scalar_span : std::false_type {};
// clang-format off
template <class T, std::size_t Extent>
  requires ProbabilityScalar<T>
struct is_const_scalar_span<std::span<const T, Extent>> : std::true_type {};
// clang-format on

}  // namespace detail

template <class V>
struct probability_vector_traits<V, std::enable_if_t<detail::contiguous_scalar_range<V>>> {
  using scalar_type = std::remove_cv_t<std::ranges::range_value_t<const V&>>;
  static std::span<const scalar_type> view(const V& v) noexcept {
    return {std::ranges::data(v), static_cast<std::size_t>(std::ranges::size(v))};
  }
};

template <class V>
struct probability_vector_traits<V, std::enable_if_t<detail::eigen_dense_vector<V>>> {
  using scalar_type = std::remove_cv_t<typename V::Scalar>;
  static std::span<const scalar_type> view(const V& v) noexcept {
    return {v.data(), static_cast<std::size_t>(v.size())};
  }
};

/// A contiguous, sized sequence of `float` or `double` that can be viewed as a
/// `std::span<const float>` / `std::span<const double>` through `probability_vector_traits`.
///
/// Semantic requirements (not checked by the compiler): entries are finite and
/// non-negative and sum to 1 within the tolerance documented by the validating entry
/// points. Satisfied by `std::vector<T>`, `std::array<T, N>`, `std::span<const T>`,
/// `Eigen::VectorXf`, `Eigen::VectorXd` and `Eigen::Map` / `Eigen::Ref` of them.
/// @code
/// static_assert(specdec::ProbabilityVector<std::vector<float>>);
/// static_assert(specdec::ProbabilityVector<Eigen::Ref<const Eigen::VectorXd>>);
/// @endcode
// clang-format off
template <class V>
concept ProbabilityVector = requires(const std::remove_cvref_t<V>& v) {
  { probability_vector_traits<std::remove_cvref_t<V>>::view(v) };
  requires detail::is_const_scalar_span<
      decltype(probability_vector_traits<std::remove_cvref_t<V>>::view(v))>::value;
};
// clang-format on

/// The element type (float or double) of a probability vector.
template <ProbabilityVector V>
using probability_scalar_t =
    typename decltype(probability_vector_traits<std::remove_cvref_t<V>>::view(
        std::declval<const std::remove_cvref_t<V>&>()))::value_type;

/// Views any probability vector as a span (no copy).
template <ProbabilityVector V>
[[nodiscard]] std::span<const probability_scalar_t<V>> as_span(const V& v) noexcept {
  return probability_vector_traits<std::remove_cvref_t<V>>::view(v);
}

// ---------------------------------------------------------------------------------------
// Probability matrices (row-major, one row per scored position)
// ---------------------------------------------------------------------------------------

/// Customisation point: how to view a matrix type as `RowsView<const T>`. Provided for
/// `RowsView` itself and for row-major Eigen dense matrices with unit inner stride.
template <class M, class Enable = void>
struct probability_matrix_traits;

namespace detail {

template <class M>
concept eigen_row_major_matrix = requires(const M& m) {
  typename M::Scalar;
  requires ProbabilityScalar<typename M::Scalar>;
  requires bool(M::IsRowMajor);
  requires M::InnerStrideAtCompileTime == 1;
  { m.data() } -> std::convertible_to<const typename M::Scalar*>;
  { m.rows() } -> std::convertible_to<std::ptrdiff_t>;
  { m.cols() } -> std::convertible_to<std::ptrdiff_t>;
  { m.outerStride() } -> std::convertible_to<std::ptrdiff_t>;
};

template <class T>
struct is_rows_view : std::false_type {};
template <class T>
struct is_rows_view<RowsView<T>> : std::true_type {};

template <class T>
struct is_const_rows_view : std::false_type {};
// clang-format off
template <class T>
  requires ProbabilityScalar<T>
struct is_const_rows_view<RowsView<const T>> : std::true_type {};
// clang-format on

}  // namespace detail

template <class M>
struct probability_matrix_traits<M, std::enable_if_t<detail::is_rows_view<M>::value>> {
  using scalar_type = typename M::value_type;
  static RowsView<const scalar_type> view(const M& m) noexcept { return m; }
};

template <class M>
struct probability_matrix_traits<M, std::enable_if_t<detail::eigen_row_major_matrix<M>>> {
  using scalar_type = std::remove_cv_t<typename M::Scalar>;
  static RowsView<const scalar_type> view(const M& m) noexcept {
    return {m.data(), static_cast<std::size_t>(m.rows()), static_cast<std::size_t>(m.cols()),
            static_cast<std::size_t>(m.rows() <= 1 ? m.cols() : m.outerStride())};
  }
};

/// Row-major probability rows, viewable as `RowsView<const T>`: `RowsView<T>` and row-major
/// Eigen matrices (`Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>`,
/// Map / Ref of them).
// clang-format off
template <class M>
concept ProbabilityMatrix = requires(const std::remove_cvref_t<M>& m) {
  { probability_matrix_traits<std::remove_cvref_t<M>>::view(m) };
  requires detail::is_const_rows_view<
      decltype(probability_matrix_traits<std::remove_cvref_t<M>>::view(m))>::value;
};
// clang-format on

/// Views any probability matrix as `RowsView<const T>` (no copy).
template <ProbabilityMatrix M>
[[nodiscard]] auto as_rows(const M& m) noexcept {
  return probability_matrix_traits<std::remove_cvref_t<M>>::view(m);
}

// ---------------------------------------------------------------------------------------
// Language models
// ---------------------------------------------------------------------------------------

/// `model.vocab_size()` on a const model, convertible to std::size_t.
template <class M>
concept HasVocabSize = requires(const M& model) {
  { model.vocab_size() } -> std::convertible_to<std::size_t>;
};

/// `model.next_token_probabilities(context)` with the whole accepted context as
/// `std::span<const token_id>`, returning a ProbabilityVector.
template <class M>
concept HasNextTokenProbabilities = requires(M& model, std::span<const token_id> context) {
  { model.next_token_probabilities(context) } -> ProbabilityVector;
};

/// A model of the next token: the target M_p or the draft M_q of the paper.
///
/// Syntactic requirements:
///  - `model.vocab_size()` (const) convertible to `std::size_t`;
///  - `model.next_token_probabilities(context)`, `context` a `std::span<const token_id>`
///    holding the whole accepted context (prompt + generated tokens), returning a
///    ProbabilityVector of length vocab_size().
///
/// Semantic requirements the compiler cannot check:
///  - entries are finite, non-negative and sum to 1 within the tolerance of the validating
///    entry points (the decoder validates every row it receives and names the model,
///    step and position of a bad one);
///  - the result is a deterministic function of `context` (randomness belongs to the
///    sampler, never to the model), so scoring the same prefix twice gives the same row;
///  - a returned view (span, Map, Ref) stays valid until the next non-const call on the
///    same model. Returning by value is always fine.
///
/// Stateful models (KV caches) keep their own state: the library always passes the whole
/// context and `CachedContext` (cached_context.hpp) turns it into truncate/append.
/// @code
/// struct Bigram {
///   std::vector<std::vector<float>> table;  // table[previous token] = next-token row
///   std::size_t vocab_size() const { return table.size(); }
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id> c) {
///     return table[c.empty() ? 0 : static_cast<std::size_t>(c.back())];
///   }
/// };
/// static_assert(specdec::LanguageModel<Bigram>);
/// @endcode
template <class M>
concept LanguageModel = HasVocabSize<M> && HasNextTokenProbabilities<M>;

/// `model.score_draft(context, draft)`: the rows p_1..p_{gamma+1} of all gamma+1 prefixes
/// `context`, `context + draft[0..0]`, ..., `context + draft` in one call.
// clang-format off
template <class M>
concept HasDraftScoring =
    requires(M& model, std::span<const token_id> context, std::span<const token_id> draft) {
      { model.score_draft(context, draft) } -> ProbabilityMatrix;
    };
// clang-format on

/// A LanguageModel that scores all gamma+1 prefixes of `context + draft` in one call — the
/// paper's parallel run of the target (Sec. 2.3). The result has `draft.size() + 1` rows of
/// `vocab_size()` entries; row i is the distribution of the token following
/// `context + draft[0..i)` and must equal `next_token_probabilities` of that prefix.
/// Models without it still work: the decoder falls back to one call per prefix.
/// @code
/// struct Engine {
///   Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rows;
///   std::size_t vocab_size() const;
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id>);
///   const auto& score_draft(std::span<const specdec::token_id> context,
///                           std::span<const specdec::token_id> draft) {
///     rows.resize(draft.size() + 1, vocab_size());
///     // ... one forward pass over context + draft fills every row ...
///     return rows;
///   }
/// };
/// static_assert(specdec::BatchedLanguageModel<Engine>);
/// @endcode
template <class M>
concept BatchedLanguageModel = LanguageModel<M> && HasDraftScoring<M>;

namespace detail {
template <class M>
concept declares_stable_rows = requires {
  requires bool(M::stable_rows);
};

// A returned row that does not own its entries: a reference, a borrowed range (std::span)
// or an Eigen view (Map, Ref, Block: anything but a plain Matrix / Array).
template <class R>
concept non_owning_row =
    std::is_lvalue_reference_v<R> || std::ranges::borrowed_range<R> || requires {
  typename std::remove_cvref_t<R>::PlainObject;
  requires !std::is_same_v<std::remove_cvref_t<R>, typename std::remove_cvref_t<R>::PlainObject>;
};
}  // namespace detail

/// Opt-in promise of a LanguageModel used as the draft: every row `next_token_probabilities`
/// returns stays valid and unchanged until the end of the decoder step that asked for it
/// (through the later draft calls of that step and the target's scoring), and is returned as
/// a view or a reference (std::span, `const std::vector<T>&`, Eigen::Map), not by value.
/// Declare it with a member `static constexpr bool stable_rows = true;` or by specialising
/// this variable. Models that keep a row per position qualify (precomputed tables, a draft
/// that writes each position's row into its own slot); a model that returns a view of one
/// buffer it overwrites on every call does not.
///
/// What it buys: at T = 1 without truncation, where the decoder would copy each draft row
/// unchanged into its workspace (the row must survive the next draft call), it reads the
/// model's row in place instead when the row has the target's scalar type: the step writes
/// no draft row, and the workspace holds no draft rows (gamma V entries less to keep in
/// cache). Tokens, statistics and errors are bitwise the same as with the copy. A model that
/// breaks the promise gets wrong verification (its later rows overwrite earlier ones), which
/// no check can see: declare it only when the model's code guarantees it.
/// @code
/// struct TableDraft {  // rows of a table: valid as long as the model
///   static constexpr bool stable_rows = true;
///   std::vector<std::vector<float>> table;
///   std::size_t vocab_size() const { return table.size(); }
///   std::span<const float> next_token_probabilities(std::span<const specdec::token_id> c) {
///     return table[c.empty() ? 0 : static_cast<std::size_t>(c.back())];
///   }
/// };
/// static_assert(specdec::stable_rows<TableDraft>);
/// @endcode
template <class M>
inline constexpr bool stable_rows = detail::declares_stable_rows<M>;

namespace detail {
// The row type of a LanguageModel's next_token_probabilities (void scalar for other types).
template <class M>
struct model_row_traits {
  using scalar = void;
  static constexpr bool non_owning = false;
};
template <LanguageModel M>
struct model_row_traits<M> {
  using result = decltype(std::declval<M&>().next_token_probabilities(std::span<const token_id>()));
  using scalar = probability_scalar_t<result>;
  static constexpr bool non_owning = non_owning_row<result>;
};
}  // namespace detail

// ---------------------------------------------------------------------------------------
// Drafters
// ---------------------------------------------------------------------------------------

/// `drafter.propose(context, out)`: writes up to `out.size()` proposed tokens continuing
/// `context` into `out` and returns how many it wrote (0 when it has no proposal).
template <class D>
concept HasPropose = requires(D& drafter, std::span<const token_id> context,
                              std::span<token_id> out) {
  { drafter.propose(context, out) } -> std::convertible_to<std::size_t>;
};

/// A proposal-only drafter (n-gram tables, prompt lookup): it proposes tokens without a
/// distribution. Verification treats its q as one-hot on the proposed token, which keeps
/// speculative sampling exact (accept x with probability p(x), residual = p without x).
/// The drafter sees the whole accepted context on every call and may update its own
/// tables from it; it must not assume that its previous proposal was accepted.
/// @code
/// struct RepeatLast {  // proposes the last token again, up to out.size() times
///   std::size_t propose(std::span<const specdec::token_id> context,
///                       std::span<specdec::token_id> out) {
///     if (context.empty()) return 0;
///     std::fill(out.begin(), out.end(), context.back());
///     return out.size();
///   }
/// };
/// static_assert(specdec::ProposalDrafter<RepeatLast>);
/// @endcode
template <class D>
concept ProposalDrafter = HasPropose<D>;

/// `drafter.propose_many(context, out, lengths)`: writes up to B = `lengths.size()`
/// continuations of `context`, continuation b into out[b L, b L + lengths[b]) with
/// L = `out.size() / B`, and returns how many it wrote.
template <class D>
concept HasProposeMany = requires(D& drafter, std::span<const token_id> context,
                                  std::span<token_id> out, std::span<std::size_t> lengths) {
  { drafter.propose_many(context, out, lengths) } -> std::convertible_to<std::size_t>;
};

/// A ProposalDrafter that can offer several continuations of one context, for proposal
/// trees (build_proposal_tree in draft_tree.hpp): NgramDrafter (the most frequent next
/// tokens, each chained) and PromptLookupDrafter (the continuations of several earlier
/// matches).
///
/// Semantic requirements the compiler cannot check: the call returns B' <= B and sets
/// 1 <= lengths[b] <= L for b < B' (the builder checks both); the continuations are ordered
/// likeliest first, which is the order verification tries them in; they are a function of
/// the context (and the drafter's own state), never of the target, which is what keeps a
/// tree of one_hot candidates exact. Continuations may share prefixes or even coincide: the
/// tree merges them. As for `propose`, no allocation is expected per call once warm.
/// @code
/// struct LastTwo {  // proposes "repeat the last token" and "repeat the one before"
///   std::size_t propose(std::span<const specdec::token_id> c, std::span<specdec::token_id> out);
///   std::size_t propose_many(std::span<const specdec::token_id> c,
///                            std::span<specdec::token_id> out, std::span<std::size_t> lengths) {
///     if (lengths.empty() || out.size() < lengths.size()) return 0;
///     const std::size_t length = out.size() / lengths.size();
///     const std::size_t branches = std::min<std::size_t>({lengths.size(), c.size(), 2});
///     for (std::size_t b = 0; b < branches; ++b) {
///       std::ranges::fill(out.subspan(b * length, length), c[c.size() - 1 - b]);
///       lengths[b] = length;
///     }
///     return branches;
///   }
/// };
/// static_assert(specdec::MultiProposalDrafter<LastTwo>);
/// @endcode
template <class D>
concept MultiProposalDrafter = ProposalDrafter<D> && HasProposeMany<D>;

/// What `SpeculativeDecoder<Target, Draft>` drafts with: proposed tokens x_1..x_gamma for
/// one step, together with the q rows they were drawn from, or with none (one-hot q).
/// Exactly two kinds of type qualify, each named by its own clause so that a rejected type
/// is told what either kind needs:
///  - a LanguageModel (`LanguageModel<D>`: q rows). The decoder adapts it: it calls
///    `next_token_probabilities` once per drafted token, standardizes the row like the
///    target's, draws x_i from that standardized q_i itself and verifies x_i with the same
///    q_i. The tokens always come from the q in the acceptance ratio, so exactness holds by
///    construction; a model never hands the decoder tokens it sampled on its own.
///  - a ProposalDrafter (`ProposalDrafter<D>`: tokens only). It is called once per step and
///    its tokens are verified with a one-hot q, which is exact for any proposal that is a
///    function of the accepted context.
/// A type that is both is used as a LanguageModel (its q rows carry more information).
/// @code
/// static_assert(specdec::Drafter<Bigram>);      // a LanguageModel, drafts sampled from q
/// static_assert(specdec::Drafter<RepeatLast>);  // a ProposalDrafter, one-hot q
/// @endcode
template <class D>
concept Drafter = LanguageModel<D> || ProposalDrafter<D>;

/// Whether the decoder drafts from `D`'s q rows (a LanguageModel; also when `D` could
/// propose too) rather than from its proposals.
template <Drafter D>
inline constexpr bool drafts_from_rows = LanguageModel<D>;

}  // namespace specdec
