// The addition task's rows (models/gpt/data.h): each decodes to a correct sum, in the configured
// format, with the loss mask on the answer and its newline only.
#include "gpt/data.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>

namespace tierzero::gpt {
namespace {

struct Row {
  std::string text;    // the row's tokens, then its last target
  std::string masked;  // the targets the loss covers
};

std::vector<Row> Rows(const DataConfig& c, bool validation, uint64_t index, int batch) {
  const int seq = Dataset::RowTokens(c);
  auto d = Dataset::Create(c, seq);
  EXPECT_TRUE(d.ok()) << d.status().ToString();
  const Batch b = (*d)->Get(validation, index, batch);
  std::vector<Row> rows;
  for (int r = 0; r < batch; ++r) {
    Row row;
    for (int t = 0; t < seq; ++t) {
      const size_t i = static_cast<size_t>(r * seq + t);
      row.text += static_cast<char>(b.tokens[i]);
      if (b.mask[i] > 0) row.masked += static_cast<char>(b.targets[i]);
    }
    row.text += static_cast<char>(b.targets[static_cast<size_t>(r * seq + seq - 1)]);
    rows.push_back(row);
  }
  return rows;
}

void CheckSums(const DataConfig& c) {
  for (const bool validation : {false, true}) {
    for (const Row& row : Rows(c, validation, 3, 64)) {
      const size_t plus = row.text.find('+'), eq = row.text.find('=');
      ASSERT_NE(plus, std::string::npos) << row.text;
      ASSERT_NE(eq, std::string::npos) << row.text;
      const std::string a = row.text.substr(0, plus), b = row.text.substr(plus + 1, eq - plus - 1);
      std::string sum = row.text.substr(eq + 1, row.text.find('\n', eq) - eq - 1);
      if (c.pad_operands) {
        EXPECT_EQ(a.size(), static_cast<size_t>(c.digits)) << row.text;
        EXPECT_EQ(b.size(), static_cast<size_t>(c.digits)) << row.text;
        EXPECT_EQ(sum.size(), static_cast<size_t>(c.digits + 1)) << row.text;
      } else {
        EXPECT_TRUE(a.size() == 1 || a[0] != '0') << row.text;
        EXPECT_TRUE(sum.size() == 1 || sum[c.reverse_answer ? sum.size() - 1 : 0] != '0')
            << row.text;
      }
      EXPECT_EQ(row.masked, sum + "\n") << row.text;
      if (c.reverse_answer) std::reverse(sum.begin(), sum.end());
      EXPECT_EQ(std::stoull(a) + std::stoull(b), std::stoull(sum)) << row.text;
    }
  }
}

TEST(AdditionData, RowsHoldCorrectSumsInEveryFormat) {
  for (const bool pad : {false, true}) {
    for (const bool reverse : {false, true}) {
      for (const int digits : {1, 2, 5}) {
        DataConfig c;
        c.digits = digits;
        c.pad_operands = pad;
        c.reverse_answer = reverse;
        SCOPED_TRACE("pad " + std::to_string(pad) + " reverse " + std::to_string(reverse) +
                     " digits " + std::to_string(digits));
        CheckSums(c);
      }
    }
  }
}

TEST(AdditionData, PaddedRowsFillTheRowExactly) {
  DataConfig c;
  c.digits = 2;
  c.pad_operands = true;
  for (const Row& row : Rows(c, false, 0, 32)) {
    EXPECT_EQ(row.text.size(), static_cast<size_t>(Dataset::RowTokens(c) + 1));
    EXPECT_EQ(row.text.back(), '\n') << row.text;
    EXPECT_EQ(row.text.find('\n'), row.text.size() - 1) << row.text;  // no padding newlines
  }
}

}  // namespace
}  // namespace tierzero::gpt
