// SPDX-License-Identifier: Apache-2.0
#include <cudawait/observe/detail/json.hpp>

#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

using cudawait::detail::json_writer;

TEST(json_writer, nests_objects_and_arrays_with_separators) {
    std::ostringstream os;
    json_writer w(os);
    w.begin_object()
        .field("name", "h2d")
        .field("count", std::uint64_t{18446744073709551615u})
        .field("neg", -3)
        .field("ok", true)
        .key("list")
        .begin_array()
        .value(1.5)
        .value(2)
        .begin_object()
        .end_object()
        .end_array()
        .key("none")
        .null()
        .end_object();
    EXPECT_TRUE(w.complete());
    EXPECT_EQ(os.str(), R"({"name":"h2d","count":18446744073709551615,"neg":-3,"ok":true,)"
                        R"("list":[1.5,2,{}],"none":null})");
}

TEST(json_writer, escapes_strings_and_writes_non_finite_numbers_as_null) {
    std::ostringstream os;
    json_writer w(os);
    w.begin_array()
        .value("q\"b\\n\nt\tc\x01")
        .value(std::numeric_limits<double>::infinity())
        .value(std::numeric_limits<double>::quiet_NaN())
        .value(static_cast<const char*>(nullptr))
        .end_array();
    EXPECT_EQ(os.str(), R"(["q\"b\\n\nt\tc\u0001",null,null,null])");
}

TEST(json_writer, doubles_round_trip) {
    std::ostringstream os;
    json_writer w(os);
    const double v = 0.1 + 0.2;
    w.begin_array().value(v).end_array();
    std::string s = os.str();
    EXPECT_EQ(std::stod(s.substr(1, s.size() - 2)), v);
}

TEST(json_writer, unbalanced_closes_throw) {
    std::ostringstream os;
    json_writer w(os);
    EXPECT_THROW(w.end_object(), std::logic_error);
    w.begin_object();
    EXPECT_THROW(w.end_array(), std::logic_error);
    w.key("k");
    EXPECT_THROW(w.end_object(), std::logic_error) << "a key without its value";
    EXPECT_FALSE(w.complete());
}

TEST(json_writer, nesting_deeper_than_max_depth_throws) {
    std::ostringstream os;
    json_writer w(os);
    for (std::size_t i = 0; i < json_writer::max_depth; ++i) {
        w.begin_array();
    }
    EXPECT_THROW(w.begin_array(), std::logic_error);
    for (std::size_t i = 0; i < json_writer::max_depth; ++i) {
        w.end_array();
    }
    EXPECT_TRUE(w.complete());
    EXPECT_EQ(os.str(),
              std::string(json_writer::max_depth, '[') + std::string(json_writer::max_depth, ']'));
}
