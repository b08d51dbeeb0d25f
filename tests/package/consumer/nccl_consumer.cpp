// SPDX-License-Identifier: Apache-2.0
// Built against the installed cudawait::nccl: nccl.hpp compiles and libnccl links.
#include <cudawait/nccl/nccl.hpp>

#include <cstdio>

int main() {
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess) {
        return 1;
    }
    std::printf("NCCL %d\n", version);
    return 0;
}
