// SPDX-License-Identifier: Apache-2.0
#pragma once

// What every public header checks first (error.hpp includes this file first): a translation
// unit built without C++20 fails with a message that says so, not deep inside <coroutine>.

#if __cplusplus < 202002L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 202002L)
#error                                                                                             \
    "cudawait needs C++20 (it is built on coroutines): compile with -std=c++20; in CMake set CMAKE_CUDA_STANDARD 20 for .cu files and CMAKE_CXX_STANDARD 20 for .cpp files, or link cudawait::cudawait"
#endif

namespace cudawait::detail {

/// `T`, named through the template parameter `Dependent` so that the name is dependent. The
/// library's templates of an unused parameter (`template <class Unused = void>`) exist so that
/// only a translation unit that uses them compiles them; but the classes their declarations name
/// non-dependently are instantiated where the template is defined, in every translation unit, and
/// clang instantiates the functions a body calls non-dependently there too. Naming a type, or a
/// function template's argument, as `dependent_t<Unused, T>` defers that to the template's own
/// instantiation.
template <class Dependent, class T>
struct dependent {
    using type = T;
};
template <class Dependent, class T>
using dependent_t = typename dependent<Dependent, T>::type;

} // namespace cudawait::detail
