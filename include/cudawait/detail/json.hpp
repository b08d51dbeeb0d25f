// SPDX-License-Identifier: Apache-2.0
#pragma once

// A small streaming JSON writer for the library's exports (trace files, stats dumps): objects,
// arrays, strings escaped per RFC 8259, numbers that stay valid JSON (non-finite values are
// written as null). Commas and nesting are tracked, so a caller cannot produce invalid JSON
// by forgetting a separator; closing more than was opened throws std::logic_error.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace cudawait::detail {

class json_writer {
public:
    explicit json_writer(std::ostream& out) : m_out(&out) {}

    json_writer& begin_object() { return open('{'); }
    json_writer& end_object() { return close('}'); }
    json_writer& begin_array() { return open('['); }
    json_writer& end_array() { return close(']'); }

    /// The key of the next value inside an object.
    json_writer& key(std::string_view k) {
        separate();
        write_string(k);
        *m_out << ':';
        m_after_key = true;
        return *this;
    }

    json_writer& value(std::string_view s) {
        separate();
        write_string(s);
        return *this;
    }
    json_writer& value(const char* s) { return s == nullptr ? null() : value(std::string_view(s)); }
    json_writer& value(const std::string& s) { return value(std::string_view(s)); }
    json_writer& value(bool b) {
        separate();
        *m_out << (b ? "true" : "false");
        return *this;
    }
    template <class T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>) json_writer& value(T v) {
        separate();
        if constexpr (std::is_signed_v<T>) {
            *m_out << static_cast<long long>(v);
        } else {
            *m_out << static_cast<unsigned long long>(v);
        }
        return *this;
    }
    json_writer& value(double v) {
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
    json_writer& value(float v) { return value(static_cast<double>(v)); }
    json_writer& null() {
        separate();
        *m_out << "null";
        return *this;
    }

    /// key(k).value(v) in one call.
    template <class T>
    json_writer& field(std::string_view k, const T& v) {
        key(k);
        return value(v);
    }

    /// Every object and array opened was closed.
    [[nodiscard]] bool complete() const noexcept { return m_stack.empty() && m_wrote_root; }

private:
    json_writer& open(char c) {
        separate();
        *m_out << c;
        m_stack.push_back({c, true});
        return *this;
    }
    json_writer& close(char c) {
        char want = c == '}' ? '{' : '[';
        if (m_stack.empty() || m_stack.back().bracket != want || m_after_key) {
            throw std::logic_error("json_writer: unbalanced close");
        }
        m_stack.pop_back();
        *m_out << c;
        if (m_stack.empty()) {
            m_wrote_root = true;
        }
        return *this;
    }
    void separate() {
        if (m_after_key) {
            m_after_key = false;
            return;
        }
        if (!m_stack.empty()) {
            if (!m_stack.back().first) {
                *m_out << ',';
            }
            m_stack.back().first = false;
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
        char bracket;
        bool first;
    };
    std::ostream* m_out;
    std::vector<level> m_stack;
    bool m_after_key = false;
    bool m_wrote_root = false;
};

} // namespace cudawait::detail
