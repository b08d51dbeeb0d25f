#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Formatting by the repo's .clang-format, over every tracked C++/CUDA source (*.hpp *.cpp *.cu
# *.cuh from git ls-files), or over the files named.
#   scripts/format.sh [--check] [file...]   lists the files clang-format would change; exits 1
#                                           if there are any (the default; .ci/run calls this)
#   scripts/format.sh --fix [file...]       rewrites those files in place
# The clang-format is $CLANG_FORMAT, else clang-format-14, else clang-format. CI uses Debian
# bookworm's, version 14: other versions format some constructs differently, so a file that
# another version leaves alone may still fail the check there.
set -euo pipefail

usage() {
    sed -n '3,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

mode=check
files=()
for arg in "$@"; do
    case "${arg}" in
    --check) mode=check ;;
    --fix) mode=fix ;;
    -h | --help) usage ;;
    -*) echo "format.sh: unknown option ${arg}" >&2 && usage ;;
    *) files+=("${arg}") ;;
    esac
done

if [[ -n "${CLANG_FORMAT:-}" ]]; then
    tool=${CLANG_FORMAT}
elif command -v clang-format-14 >/dev/null 2>&1; then
    tool=clang-format-14
else
    tool=clang-format
fi
if ! command -v "${tool}" >/dev/null 2>&1; then
    echo "format.sh: ${tool} not found (Debian: apt-get install clang-format)" >&2
    exit 2
fi
version=$("${tool}" --version)
echo "format.sh: ${version}"
if [[ "${version}" != *"version 14."* ]]; then
    echo "format.sh: warning: CI checks with clang-format 14; this one may disagree with it" >&2
fi

if ((${#files[@]} == 0)); then
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
        echo "format.sh: not in a git work tree; name the files to format" >&2
        exit 2
    fi
    while IFS= read -r -d '' f; do
        files+=("${f}")
    done < <(git ls-files -z -- '*.hpp' '*.cpp' '*.cu' '*.cuh')
fi
if ((${#files[@]} == 0)); then
    echo "format.sh: no files" >&2
    exit 2
fi

if [[ "${mode}" == fix ]]; then
    "${tool}" -i --style=file -- "${files[@]}"
    echo "format.sh: ${#files[@]} file(s) formatted in place"
    exit 0
fi

# One file at a time, so that the failing ones can be named. A diagnostic other than a
# formatting violation (an unreadable file, a bad .clang-format) is a failure of the check itself.
unformatted=()
for f in "${files[@]}"; do
    if ! out=$("${tool}" --dry-run -Werror --style=file -- "${f}" 2>&1); then
        if [[ "${out}" == *"[-Wclang-format-violations]"* ]]; then
            unformatted+=("${f}")
        else
            printf 'format.sh: %s failed on %s:\n%s\n' "${tool}" "${f}" "${out}" >&2
            exit 2
        fi
    fi
done

if ((${#unformatted[@]} > 0)); then
    echo "format.sh: ${#unformatted[@]} of ${#files[@]} files are not formatted:"
    printf '  %s\n' "${unformatted[@]}"
    echo "format.sh: run scripts/format.sh --fix (or ${tool} -i FILE) and commit the result"
    exit 1
fi
echo "format.sh: ${#files[@]} file(s) checked, all formatted"
