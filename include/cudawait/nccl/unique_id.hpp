// SPDX-License-Identifier: Apache-2.0
#pragma once

// Synopsis (namespace cudawait::nccl; link the CMake target cudawait::nccl)
//   unique_id id = unique_id::create();  made once, by one process (it hosts NCCL's bootstrap)
//   id.to_hex() / unique_id::from_hex(s) a text form for any channel
//   unique_id::from_env("CUDAWAIT_NCCL_ID")          read from the environment
//   id.write_file(path) / unique_id::read_file(path, wait)   through a shared file
//
// The token every rank needs to join one communicator. See docs/nccl.md#joining.

#include <cudawait/nccl/error.hpp>
#include <cudawait/runtime/detail/chrono.hpp>
#include <cudawait/runtime/error.hpp>

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <thread>

#include <nccl.h>

namespace cudawait::nccl {

/// The token every rank needs to join one communicator: made once (create()) by one process
/// and handed to the others (environment, file, any channel).
struct unique_id {
    ncclUniqueId value{};

    /// A fresh id (ncclGetUniqueId). The creating process hosts NCCL's bootstrap root.
    /// @throws error
    [[nodiscard]] static unique_id create() {
        unique_id id;
        detail::check(ncclGetUniqueId(&id.value), "ncclGetUniqueId");
        return id;
    }

    /// Two lowercase hex digits per byte (256 characters).
    [[nodiscard]] std::string to_hex() const {
        static constexpr char digits[] = "0123456789abcdef";
        std::string out;
        out.reserve(sizeof value.internal * 2);
        for (char c : value.internal) {
            const auto b = static_cast<unsigned char>(c);
            out += digits[b >> 4];
            out += digits[b & 0xf];
        }
        return out;
    }

    /// Parses to_hex()'s form (either case).
    /// @throws error (ncclInvalidArgument) for a wrong length or a character that is no digit
    [[nodiscard]] static unique_id from_hex(std::string_view hex) {
        constexpr std::size_t bytes = sizeof(ncclUniqueId::internal);
        if (hex.size() != bytes * 2) {
            throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_hex",
                        "expected " + std::to_string(bytes * 2) + " hex digits, got " +
                            std::to_string(hex.size()) + " characters");
        }
        auto nibble = [](char c) -> int {
            if (c >= '0' && c <= '9') {
                return c - '0';
            }
            if (c >= 'a' && c <= 'f') {
                return c - 'a' + 10;
            }
            if (c >= 'A' && c <= 'F') {
                return c - 'A' + 10;
            }
            return -1;
        };
        unique_id id;
        for (std::size_t i = 0; i < bytes; ++i) {
            const int hi = nibble(hex[2 * i]);
            const int lo = nibble(hex[2 * i + 1]);
            if (hi < 0 || lo < 0) {
                throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_hex",
                            "not a hex digit at position " +
                                std::to_string(hi < 0 ? 2 * i : 2 * i + 1));
            }
            id.value.internal[i] = static_cast<char>((hi << 4) | lo);
        }
        return id;
    }

    /// The id in the environment variable `name` (to_hex()'s form).
    /// @throws error (ncclInvalidArgument) when it is unset or malformed
    [[nodiscard]] static unique_id from_env(const char* name = "CUDAWAIT_NCCL_ID") {
        const char* v = std::getenv(name);
        if (v == nullptr) {
            throw error(ncclInvalidArgument, "cudawait::nccl::unique_id::from_env",
                        std::string(name) + " is not set");
        }
        return from_hex(v);
    }

    /// Writes to_hex() and a newline to `path`, atomically (a temporary file in the same
    /// directory, renamed): a reader never sees half an id.
    /// @throws error (ncclSystemError) when the file cannot be written
    void write_file(const std::filesystem::path& path) const {
        std::filesystem::path tmp = path;
        tmp += ".tmp." + std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
        {
            std::ofstream out(tmp, std::ios::trunc);
            out << to_hex() << '\n';
            out.flush();
            if (!out) {
                throw error(ncclSystemError, "cudawait::nccl::unique_id::write_file",
                            "cannot write " + tmp.string());
            }
        }
        std::error_code ec;
        std::filesystem::rename(tmp, path, ec);
        if (ec) {
            std::filesystem::remove(tmp, ec);
            throw error(ncclSystemError, "cudawait::nccl::unique_id::write_file",
                        "cannot rename to " + path.string());
        }
    }

    /// Reads an id write_file() wrote, waiting up to `wait` (polling every 10 ms) for the file
    /// to appear. Blocks the calling thread.
    /// @throws error: timed_out() when no file appeared in time; ncclInvalidArgument when its
    ///         content is no id
    [[nodiscard]] static unique_id read_file(const std::filesystem::path& path,
                                             std::chrono::nanoseconds wait) {
        const auto deadline = std::chrono::steady_clock::now() + wait;
        for (;;) {
            std::ifstream in(path);
            if (in) {
                std::string hex;
                in >> hex;
                return from_hex(hex);
            }
            if (std::chrono::steady_clock::now() >= deadline) {
                throw error::timeout("cudawait::nccl::unique_id::read_file", wait);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
    }

    friend bool operator==(const unique_id& a, const unique_id& b) noexcept {
        return std::memcmp(a.value.internal, b.value.internal, sizeof a.value.internal) == 0;
    }
};

} // namespace cudawait::nccl
