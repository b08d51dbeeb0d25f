// SPDX-License-Identifier: Apache-2.0
// The packaging-test consumer, built by the host C++ compiler: no CUDA language, just the
// headers and libcudart.
#include "consumer.hpp"

int main() { return consumer::run("host C++ compiler"); }
