// SPDX-License-Identifier: Apache-2.0
#pragma once

// A small streaming JSON writer for the library's exports (trace files, stats dumps): objects,
// arrays, strings escaped per RFC 8259, numbers that stay valid JSON (non-finite values are
// written as null). Commas and nesting are tracked, so a caller cannot produce invalid JSON
// by forgetting a separator; closing more than was opened throws std::logic_error.

#include <cudawait/runtime/detail/config.hpp>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace cudawait::detail {

/// (A class template, `Unused` always void, its stream named dependently: only a translation
/// unit that writes JSON compiles its members; use json_writer.)
template <class Unused = void>
class basic_json_writer {
    using ostream = dependent_t<Unused, std::ostream>;

public:
    explicit basic_json_writer(ostream& out) : m_out(&out) {}

    basic_json_writer& begin_object() { return open('{'); }
    basic_json_writer& end_object() { return close('}'); }
    basic_json_writer& begin_array() { return open('['); }
    basic_json_writer& end_array() { return close(']'); }

    /// The key of the next value inside an object.
    basic_json_writer& key(std::string_view k) {
        separate();
        write_string(k);
        *m_out << ':';
        m_after_key = true;
        return *this;
    }

    basic_json_writer& value(std::string_view s) {
        separate();
        write_string(s);
        return *this;
    }
    basic_json_writer& value(const char* s) {
        return s == nullptr ? null() : value(std::string_view(s));
    }
    basic_json_writer& value(const std::string& s) { return value(std::string_view(s)); }
    basic_json_writer& value(bool b) {
        separate();
        *m_out << (b ? "true" : "false");
        return *this;
    }
    template <class T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>) basic_json_writer& value(T v) {
        separate();
        if constexpr (std::is_signed_v<T>) {
            *m_out << static_cast<long long>(v);
        } else {
            *m_out << static_cast<unsigned long long>(v);
        }
        return *this;
    }
    basic_json_writer& value(double v) {
        separate();
        if (!std::isfinite(v)) {
            *m_out << "null";
            return *this;
        }
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.17g", v);
        *m_out << buf;
        return *this;
    }
    basic_json_writer& value(float v) { return value(static_cast<double>(v)); }
    basic_json_writer& null() {
        separate();
        *m_out << "null";
        return *this;
    }

    /// key(k).value(v) in one call.
    template <class T>
    basic_json_writer& field(std::string_view k, const T& v) {
        key(k);
        return value(v);
    }

    /// Every object and array opened was closed.
    [[nodiscard]] bool complete() const noexcept { return m_depth == 0 && m_wrote_root; }

    /// Objects and arrays nest at most this deep (the exports need a handful of levels).
    static constexpr std::size_t max_depth = 64;

private:
    basic_json_writer& open(char c) {
        if (m_depth == max_depth) {
            throw std::logic_error("json_writer: nested deeper than max_depth");
        }
        separate();
        *m_out << c;
        m_stack[m_depth++] = {c, true};
        return *this;
    }
    basic_json_writer& close(char c) {
        char want = c == '}' ? '{' : '[';
        if (m_depth == 0 || m_stack[m_depth - 1].bracket != want || m_after_key) {
            throw std::logic_error("json_writer: unbalanced close");
        }
        --m_depth;
        *m_out << c;
        if (m_depth == 0) {
            m_wrote_root = true;
        }
        return *this;
    }
    void separate() {
        if (m_after_key) {
            m_after_key = false;
            return;
        }
        if (m_depth > 0) {
            level& top = m_stack[m_depth - 1];
            if (!top.first) {
                *m_out << ',';
            }
            top.first = false;
        }
    }
    void write_string(std::string_view s) {
        *m_out << '"';
        for (char ch : s) {
            auto c = static_cast<unsigned char>(ch);
            switch (c) {
            case '"':
                *m_out << "\\\"";
                break;
            case '\\':
                *m_out << "\\\\";
                break;
            case '\n':
                *m_out << "\\n";
                break;
            case '\r':
                *m_out << "\\r";
                break;
            case '\t':
                *m_out << "\\t";
                break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
                    *m_out << buf;
                } else {
                    *m_out << ch;
                }
            }
        }
        *m_out << '"';
    }

    struct level {
        char bracket = 0;
        bool first = true;
    };
    ostream* m_out;
    // A fixed stack rather than a std::vector: no allocation, and g++ 13's -Wstringop-overflow
    // misreads std::vector's growth path for this small struct at -O3.
    std::array<level, max_depth> m_stack{};
    std::size_t m_depth = 0;
    bool m_after_key = false;
    bool m_wrote_root = false;
};

using json_writer = basic_json_writer<>;

} // namespace cudawait::detail
