// Tests for include/specdec/concepts.hpp: which model, vector and matrix shapes satisfy
// the concepts, and which are rejected and why.
#include <array>
#include <cstddef>
#include <span>
#include <vector>

#include <Eigen/Core>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>

#include "specdec/concepts.hpp"

namespace {

using specdec::token_id;

template <class Scalar>
struct VectorModel {
  std::vector<Scalar> row = std::vector<Scalar>(4, Scalar(0.25));
  std::size_t vocab_size() const { return row.size(); }
  std::vector<Scalar> next_token_probabilities(std::span<const token_id>) { return row; }
};

struct SpanModel {
  std::vector<float> row = {0.5F, 0.5F};
  std::size_t vocab_size() const { return row.size(); }
  std::span<const float> next_token_probabilities(std::span<const token_id>) { return row; }
};

struct EigenModel {
  Eigen::VectorXd row = Eigen::VectorXd::Constant(3, 1.0 / 3.0);
  int vocab_size() const { return static_cast<int>(row.size()); }  // int converts to size_t
  const Eigen::VectorXd& next_token_probabilities(std::span<const token_id>) { return row; }
};

struct EigenMapModel {
  std::vector<float> storage = {0.1F, 0.9F};
  std::size_t vocab_size() const { return storage.size(); }
  Eigen::Map<const Eigen::VectorXf> next_token_probabilities(std::span<const token_id>) {
    return {storage.data(), static_cast<Eigen::Index>(storage.size())};
  }
};

struct BatchedEigenModel : SpanModel {
  Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor> rows;
  const auto& score_draft(std::span<const token_id>, std::span<const token_id> draft) {
    rows.setConstant(static_cast<Eigen::Index>(draft.size() + 1), 2, 0.5F);
    return rows;
  }
};

struct BatchedViewModel : SpanModel {
  std::vector<float> storage;
  specdec::RowsView<const float> score_draft(std::span<const token_id>,
                                             std::span<const token_id> draft) {
    storage.assign((draft.size() + 1) * 2, 0.5F);
    return {storage.data(), draft.size() + 1, 2};
  }
};

struct MissingVocabSize {
  std::vector<float> next_token_probabilities(std::span<const token_id>) { return {1.0F}; }
};

struct ReturnsInts {
  std::size_t vocab_size() const { return 2; }
  std::vector<int> next_token_probabilities(std::span<const token_id>) { return {0, 1}; }
};

struct TakesVectorContext {  // wrong parameter type: cannot take a span
  std::size_t vocab_size() const { return 2; }
  std::vector<float> next_token_probabilities(const std::vector<token_id>&) { return {}; }
};

struct ColumnMajorBatched : SpanModel {  // column-major rows are not contiguous per row
  Eigen::MatrixXf rows;
  const Eigen::MatrixXf& score_draft(std::span<const token_id>, std::span<const token_id>) {
    return rows;
  }
};

struct NgramLike {
  std::size_t propose(std::span<const token_id>, std::span<token_id> out) {
    if (!out.empty()) out[0] = 1;
    return out.empty() ? 0 : 1;
  }
};

struct ProposesIntoVector {  // out must be a std::span<token_id>
  std::size_t propose(std::span<const token_id>, std::vector<token_id>& out) {
    out.push_back(1);
    return 1;
  }
};

struct ModelAndProposer : SpanModel {
  std::size_t propose(std::span<const token_id>, std::span<token_id>) { return 0; }
};

// A foreign row type opted in through the traits, without any base class.
struct ForeignRow {
  const double* pointer;
  std::size_t length;
};

}  // namespace

template <>
struct specdec::probability_vector_traits<ForeignRow> {
  static std::span<const double> view(const ForeignRow& row) { return {row.pointer, row.length}; }
};

TEST_CASE("ProbabilityVector accepts contiguous float/double sequences", "[concepts]") {
  STATIC_REQUIRE(specdec::ProbabilityVector<std::vector<float>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<std::vector<double>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<std::span<const float>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<std::span<float, 4>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<std::array<double, 3>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<const std::vector<double>&>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::VectorXf>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::VectorXd>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::RowVectorXf>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::Map<Eigen::VectorXf>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::Map<const Eigen::VectorXd>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::Ref<const Eigen::VectorXf>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<Eigen::Ref<Eigen::VectorXd>>);
  STATIC_REQUIRE(specdec::ProbabilityVector<ForeignRow>);
}

TEST_CASE("ProbabilityVector rejects other element types and strided views", "[concepts]") {
  STATIC_REQUIRE_FALSE(specdec::ProbabilityVector<std::vector<int>>);
  STATIC_REQUIRE_FALSE(specdec::ProbabilityVector<std::vector<long double>>);
  STATIC_REQUIRE_FALSE(specdec::ProbabilityVector<float>);
  STATIC_REQUIRE_FALSE(specdec::ProbabilityVector<Eigen::VectorXi>);
  // A row of a column-major matrix is strided: not contiguous, so not accepted.
  STATIC_REQUIRE_FALSE(
      specdec::ProbabilityVector<decltype(std::declval<Eigen::MatrixXf&>().row(0))>);
  // A column of a column-major matrix is contiguous.
  STATIC_REQUIRE(specdec::ProbabilityVector<decltype(std::declval<Eigen::MatrixXf&>().col(0))>);
}

TEST_CASE("as_span views every vector type without copying", "[concepts]") {
  std::vector<float> v = {0.25F, 0.75F};
  CHECK(specdec::as_span(v).data() == v.data());
  Eigen::VectorXd e = Eigen::VectorXd::Constant(5, 0.2);
  const auto s = specdec::as_span(e);
  CHECK(s.data() == e.data());
  CHECK(s.size() == 5);
  STATIC_REQUIRE(std::is_same_v<specdec::probability_scalar_t<Eigen::VectorXd>, double>);
  STATIC_REQUIRE(std::is_same_v<specdec::probability_scalar_t<std::vector<float>>, float>);
  const double storage[2] = {0.5, 0.5};
  CHECK(specdec::as_span(ForeignRow{storage, 2}).size() == 2);
}

TEMPLATE_TEST_CASE("LanguageModel accepts vector-returning models", "[concepts]", float, double) {
  STATIC_REQUIRE(specdec::LanguageModel<VectorModel<TestType>>);
  STATIC_REQUIRE_FALSE(specdec::BatchedLanguageModel<VectorModel<TestType>>);
  VectorModel<TestType> model;
  const std::vector<token_id> context = {1, 2};
  CHECK(specdec::as_span(model.next_token_probabilities(context)).size() == model.vocab_size());
}

TEST_CASE("LanguageModel accepts span- and Eigen-returning models", "[concepts]") {
  STATIC_REQUIRE(specdec::LanguageModel<SpanModel>);
  STATIC_REQUIRE(specdec::LanguageModel<EigenModel>);
  STATIC_REQUIRE(specdec::LanguageModel<EigenMapModel>);
}

TEST_CASE("LanguageModel names the missing clause", "[concepts]") {
  STATIC_REQUIRE_FALSE(specdec::LanguageModel<MissingVocabSize>);
  STATIC_REQUIRE_FALSE(specdec::HasVocabSize<MissingVocabSize>);
  STATIC_REQUIRE(specdec::HasNextTokenProbabilities<MissingVocabSize>);

  STATIC_REQUIRE_FALSE(specdec::LanguageModel<ReturnsInts>);
  STATIC_REQUIRE(specdec::HasVocabSize<ReturnsInts>);
  STATIC_REQUIRE_FALSE(specdec::HasNextTokenProbabilities<ReturnsInts>);

  STATIC_REQUIRE_FALSE(specdec::LanguageModel<TakesVectorContext>);
  STATIC_REQUIRE_FALSE(specdec::LanguageModel<int>);
}

TEST_CASE("BatchedLanguageModel: one call scores all gamma+1 prefixes", "[concepts]") {
  STATIC_REQUIRE(specdec::BatchedLanguageModel<BatchedEigenModel>);
  STATIC_REQUIRE(specdec::BatchedLanguageModel<BatchedViewModel>);
  STATIC_REQUIRE_FALSE(specdec::BatchedLanguageModel<SpanModel>);
  STATIC_REQUIRE_FALSE(specdec::BatchedLanguageModel<ColumnMajorBatched>);
  STATIC_REQUIRE_FALSE(specdec::HasDraftScoring<ColumnMajorBatched>);

  BatchedEigenModel model;
  const std::vector<token_id> context = {0};
  const std::vector<token_id> draft = {1, 0, 1};
  const auto rows = specdec::as_rows(model.score_draft(context, draft));
  CHECK(rows.rows() == draft.size() + 1);
  CHECK(rows.cols() == model.vocab_size());
  CHECK(rows(3, 1) == 0.5F);
}

TEST_CASE("Drafter: a LanguageModel (q rows) or a ProposalDrafter (tokens only)", "[concepts]") {
  STATIC_REQUIRE(specdec::ProposalDrafter<NgramLike>);
  STATIC_REQUIRE_FALSE(specdec::LanguageModel<NgramLike>);
  STATIC_REQUIRE(specdec::Drafter<NgramLike>);
  STATIC_REQUIRE_FALSE(specdec::drafts_from_rows<NgramLike>);

  STATIC_REQUIRE(specdec::Drafter<SpanModel>);
  STATIC_REQUIRE(specdec::Drafter<EigenModel>);
  STATIC_REQUIRE(specdec::Drafter<VectorModel<double>>);
  STATIC_REQUIRE(specdec::drafts_from_rows<SpanModel>);

  // Both: used as a LanguageModel, whose q rows the decoder samples from.
  STATIC_REQUIRE(specdec::LanguageModel<ModelAndProposer>);
  STATIC_REQUIRE(specdec::ProposalDrafter<ModelAndProposer>);
  STATIC_REQUIRE(specdec::drafts_from_rows<ModelAndProposer>);
}

TEST_CASE("Drafter names the missing clause of either kind", "[concepts]") {
  // Neither kind: a row of ints is no ProbabilityVector, and there is no propose().
  STATIC_REQUIRE_FALSE(specdec::Drafter<ReturnsInts>);
  STATIC_REQUIRE_FALSE(specdec::HasNextTokenProbabilities<ReturnsInts>);
  STATIC_REQUIRE_FALSE(specdec::HasPropose<ReturnsInts>);
  // A proposer with the wrong signature fails HasPropose (and is no model).
  STATIC_REQUIRE_FALSE(specdec::Drafter<ProposesIntoVector>);
  STATIC_REQUIRE_FALSE(specdec::HasPropose<ProposesIntoVector>);
  STATIC_REQUIRE_FALSE(specdec::HasVocabSize<ProposesIntoVector>);
  STATIC_REQUIRE_FALSE(specdec::Drafter<MissingVocabSize>);
  STATIC_REQUIRE_FALSE(specdec::Drafter<int>);
}

TEST_CASE("RowsView indexes strided rows", "[concepts][rows]") {
  std::vector<double> buffer = {0.1, 0.9, -1.0, 0.4, 0.6, -1.0};
  specdec::RowsView<const double> rows(buffer.data(), 2, 2, 3);
  CHECK(rows.row(1)[0] == 0.4);
  CHECK(rows(0, 1) == 0.9);
  CHECK(rows.subrows(1, 1).row(0)[1] == 0.6);
  specdec::RowsView<double> mutable_rows(buffer.data(), 2, 2, 3);
  specdec::RowsView<const double> converted = mutable_rows;
  CHECK(converted.data() == buffer.data());
  STATIC_REQUIRE(specdec::ProbabilityMatrix<specdec::RowsView<const double>>);
  STATIC_REQUIRE(specdec::ProbabilityMatrix<specdec::RowsView<float>>);
}
