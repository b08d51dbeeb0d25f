// SPDX-License-Identifier: Apache-2.0
#pragma once

// std::chrono's durations, clocks and literals, which is all of <chrono> that cudawait uses.
// libstdc++'s <chrono> adds C++20's calendar, time zones and their formatting (<sstream> among
// them), a fifth of what the core headers cost to compile; with libstdc++ (GCC 11 and later) the
// durations and clocks come alone from <bits/chrono.h>, the header <chrono> itself opens with.
// Code that uses the rest includes <chrono> itself, as it would anyway.

#include <version>

#if defined(__GLIBCXX__) && __has_include(<bits/chrono.h>)
#include <bits/chrono.h>
#else
#include <cudawait/runtime/detail/chrono.hpp>
#endif
