#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What cudawait's headers cost each translation unit that includes them, under nvcc and g++.
#   benchmarks/compile_cost.sh [--runs N] [--headers] [--cpu | --memory | --instructions]
#                              [--only nvcc|g++] [--against REV]
#     --runs N     N rounds (default 4); a round compiles every TU once, each subject next to its
#                  floor (the subject first in odd rounds, the floor first in even ones: on a
#                  2-core VM the second compile of a pair ran 10-20% slower, so N should be
#                  even). The seconds are the best of N; the ratio is the median of the N
#                  rounds' own ratios, so load that comes and goes moves a round's pair alike
#     --headers    also time each face and public header on its own (nccl ones only where nccl.h is found)
#     --cpu        CPU seconds (user + system) instead of wall seconds: steadier on a busy machine
#     --memory     g++ only: MB its front end allocates (-ftime-report's TOTAL), which does not
#                  depend on load at all; it follows the time closely
#     --instructions  instructions executed, in billions, by the compiler and every program it
#                  runs (valgrind's callgrind; nvcc's cudafe++, cicc, the host g++...): the same
#                  every run, for nvcc too, but each compile takes minutes
#     --only C     time one compiler only
#     --against REV  also compile each subject against the headers of git revision REV (of this
#                  repository), in the same run, and print old, new and the change; a subject
#                  whose headers REV lacks is spelled as REV had them (core/task.hpp as task.hpp;
#                  core.hpp, a face REV lacks, as its task.hpp + scheduler.hpp)
# For each subject it compiles a one-line TU (`#include <cudawait/...>` + `int main(){}`) and its
# floor: a TU that includes exactly the standard, system and CUDA headers that cudawait's own
# headers include (found by `g++ -H`: the non-cudawait headers whose includer is a cudawait
# header), so the ratio is what cudawait's code adds over the headers it cannot avoid. The
# reference row is the least a coroutine-over-CUDA TU can pay: <coroutine> + <cuda_runtime.h>.
# Flags: nvcc -std=c++20 -O2 -arch=sm_90, g++ -std=c++20 -O2, both with include/, the CUDA
# include dir and, where the toolkit has one, its cccl/ dir (what cudawait::cudawait adds).
# $NVCC, $CXX and $CUDA_HOME override the tools. The script reports; it never gates (the target
# column is the goal, "ok" where met), and it exits 0 unless a compile fails.
set -euo pipefail

usage() {
    sed -n '3,22p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

runs=4
per_header=0
clock=wall
compilers=(nvcc g++)
against=""
while (($# > 0)); do
    case "$1" in
    --runs)
        runs="$2"
        shift
        ;;
    --headers) per_header=1 ;;
    --cpu) clock=cpu ;;
    --memory)
        clock=memory
        compilers=(g++)
        runs=1 # the same every time
        ;;
    --instructions)
        clock=instructions
        runs=1 # the same every time
        ;;
    --only)
        compilers=("$2")
        shift
        ;;
    --against)
        against="$2"
        shift
        ;;
    -h | --help) usage ;;
    *) echo "compile_cost.sh: unknown argument $1" >&2 && usage ;;
    esac
    shift
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
cxx="${CXX:-g++}"
cuda_home="${CUDA_HOME:-$(cd "$(dirname "${nvcc}")/.." && pwd)}"
cuda_include="${cuda_home}/include"
tools=("${nvcc}" "${cxx}")
[[ "${clock}" == instructions ]] && tools+=(valgrind)
for tool in "${tools[@]}"; do
    if ! command -v "${tool}" >/dev/null 2>&1; then
        echo "compile_cost.sh: ${tool} not found" >&2
        exit 1
    fi
done

includes=(-I"${root}/include" -isystem "${cuda_include}")
if [[ -e "${cuda_include}/cccl/cuda/stream_ref" ]]; then
    includes+=(-isystem "${cuda_include}/cccl")
fi
nccl_includes=()
for dir in "${NCCL_HOME:+${NCCL_HOME}/include}" /usr/include "${cuda_include}"; do
    if [[ -n "${dir}" && -e "${dir}/nccl.h" ]]; then
        nccl_includes=(-isystem "${dir}")
        break
    fi
done
nvcc_flags=(-std=c++20 -O2 -arch=sm_90 "${includes[@]}")
cxx_flags=(-std=c++20 -O2 "${includes[@]}")

work="$(mktemp -d)"
trap 'rm -rf "${work}"' EXIT

# --against: REV's include/ in ${work}/old, and the flags that find it instead of ours.
old_includes=()
if [[ -n "${against}" ]]; then
    mkdir -p "${work}/old"
    if ! git -C "${root}" archive "${against}" include | tar -x -C "${work}/old"; then
        echo "compile_cost.sh: cannot read include/ of revision ${against}" >&2
        exit 1
    fi
    old_includes=(-I"${work}/old/include" "${includes[@]:1}")
fi

# The header search list, in order, as g++ resolves <...> with these flags.
mapfile -t search_dirs < <("${cxx}" -std=c++20 "${includes[@]}" -xc++ -E -v /dev/null 2>&1 |
    sed -n '/^#include <\.\.\.> search starts here:/,/^End of search list\./p' |
    sed '1d;$d' | sed 's/^ *//')

# spelling PATH: the shortest <name> that finds PATH first in the search list (<cuda/version>,
# not <cccl/cuda/version>, where both would).
spelling() {
    local path="$1" dir rel other found=""
    for dir in "${search_dirs[@]}"; do
        dir="$(cd "${dir}" 2>/dev/null && pwd -P)" || continue
        [[ "${path}" == "${dir}/"* ]] || continue
        rel="${path#"${dir}/"}"
        for other in "${search_dirs[@]}"; do
            if [[ -e "${other}/${rel}" ]]; then
                if [[ "$(realpath "${other}/${rel}")" == "${path}" ]] &&
                    [[ -z "${found}" || ${#rel} -lt ${#found} ]]; then
                    found="${rel}"
                fi
                break
            fi
        done
    done
    if [[ -z "${found}" ]]; then
        echo "compile_cost.sh: no include spelling for ${path}" >&2
        return 1
    fi
    echo "${found}"
}

# floor NAME EXTRA_FLAGS...: writes NAME_floor.{cpp,cu} from NAME.cpp's include tree.
floor() {
    local name="$1" path
    shift
    # -H: one line per opened header, its depth in dots. A header is in the floor where its
    # includer (the nearest shallower line) is a cudawait header.
    "${cxx}" -std=c++20 "${includes[@]}" "$@" -H -E -o /dev/null "${work}/${name}.cpp" 2>&1 |
        awk -v inc="${root}/include/cudawait/" '
            /^\.+ / {
                depth = length($1); path = $2; parent[depth] = path
                if (index(path, inc) != 1 && depth > 1 && index(parent[depth - 1], inc) == 1) {
                    print path
                }
            }' |
        while read -r path; do
            path="$(realpath "${path}")"
            printf '#include <%s>\n' "$(spelling "${path}")"
        done | awk '!seen[$0]++' >"${work}/${name}_floor.includes"
    # The configuration macros cudawait's headers set for those headers (pinned_pool.hpp's
    # LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE switches libcu++'s cuda::mr on): defined
    # alike in the floor, so it compiles the same declarations.
    local defined
    defined="$("${cxx}" -std=c++20 "${includes[@]}" "$@" -dM -E "${work}/${name}.cpp")"
    {
        grep -rhoE '^#define [A-Za-z_][A-Za-z0-9_]*' "${root}/include/cudawait" |
            awk '{ print $2 }' | grep -v '^CUDAWAIT_' | sort -u | while read -r macro; do
            grep -E "^#define ${macro}( |$)" <<<"${defined}" || true
        done
        cat "${work}/${name}_floor.includes"
        echo 'int main() {}'
    } >"${work}/${name}_floor.cpp"
    cp "${work}/${name}_floor.cpp" "${work}/${name}_floor.cu"
}

# subject NAME HEADER...: the one-line TU including the headers, and its floor.
subjects=()
declare -A extra
subject() {
    local name="$1" header
    shift
    : >"${work}/${name}.cpp"
    [[ "${name}" == *_separate ]] && echo '#define CUDAWAIT_SEPARATE_COMPILATION' >"${work}/${name}.cpp"
    for header in "$@"; do
        printf '#include <cudawait/%s>\n' "${header}" >>"${work}/${name}.cpp"
    done
    echo 'int main() {}' >>"${work}/${name}.cpp"
    cp "${work}/${name}.cpp" "${work}/${name}.cu"
    # shellcheck disable=SC2086 # extra flags are words
    floor "${name}" ${extra[${name}]:-}
    subjects+=("${name}")
    # A *_separate subject's old TU is its plain twin's (REV knows no such define).
    [[ -n "${against}" && "${name}" != *_separate ]] && old_subject "${name}" "$@"
    return 0
}

# old_subject NAME HEADER...: NAME_old.{cpp,cu}, the same TU against REV's headers, as REV spelled
# them; none where REV has no counterpart.
old_subject() {
    local name="$1" header spelled old="${work}/old/include/cudawait"
    shift
    : >"${work}/${name}_old.cpp"
    for header in "$@"; do
        spelled="${header}"
        if [[ ! -e "${old}/${spelled}" ]]; then
            spelled="${header#*/}"
            [[ "${header}" == core.hpp ]] && spelled="task.hpp scheduler.hpp"
        fi
        for h in ${spelled}; do
            if [[ ! -e "${old}/${h}" ]]; then
                rm -f "${work}/${name}_old.cpp"
                return 0
            fi
            printf '#include <cudawait/%s>\n' "${h}" >>"${work}/${name}_old.cpp"
        done
    done
    echo 'int main() {}' >>"${work}/${name}_old.cpp"
    cp "${work}/${name}_old.cpp" "${work}/${name}_old.cu"
}

subject umbrella cudawait.hpp
subject coroutine core/task.hpp core/scheduler.hpp
subject core_face core.hpp
subject umbrella_separate cudawait.hpp
subject coroutine_separate core/task.hpp core/scheduler.hpp
subject core_face_separate core.hpp
if ((per_header)); then
    # The faces (cudawait/<module>.hpp) and every module's public headers (not detail/).
    for header in "${root}"/include/cudawait/*.hpp "${root}"/include/cudawait/*/*.hpp; do
        header="${header#"${root}"/include/cudawait/}"
        [[ "${header}" == cudawait.hpp ]] && continue
        name="${header%.hpp}"
        name="${name//\//_}"
        if [[ "${header}" == nccl.hpp || "${header}" == nccl/* ]]; then
            ((${#nccl_includes[@]} > 0)) || continue
            extra[${name}]="${nccl_includes[*]}"
        fi
        subject "${name}" "${header}"
    done
fi
printf '#include <coroutine>\n#include <cuda_runtime.h>\nint main() {}\n' >"${work}/reference.cpp"
cp "${work}/reference.cpp" "${work}/reference.cu"

declare -A best last
# ratios[COMPILER/SUBJECT]: the rounds' own ratios, space-separated; kept for the clocks that
# vary from round to round (wall and CPU), where `paired` is 1.
declare -A ratios
paired=0
[[ "${clock}" == wall || "${clock}" == cpu ]] && paired=1
# now VAR: sets VAR to the wall clock, or to the CPU seconds the finished children of this
# shell have used (`times` in this shell: in a $(...) subshell it would see none).
now() {
    if [[ "${clock}" == wall ]]; then
        printf -v "$1" '%s' "${EPOCHREALTIME}"
    else
        times >"${work}/times"
        printf -v "$1" '%s' "$(sed -n 2p "${work}/times" | awk '{
            n = 0
            for (i = 1; i <= 2; ++i) { split($i, t, /[ms]/); n += t[1] * 60 + t[2] }
            printf "%.3f", n
        }')"
    fi
}
# timed KEY COMMAND...: runs the compile, keeps the least wall time under KEY.
timed() {
    local key="$1" start end seconds
    shift
    if [[ "${clock}" == memory ]]; then
        if ! "$@" -ftime-report >"${work}/log" 2>&1; then
            echo "compile_cost.sh: failed: $*" >&2
            cat "${work}/log" >&2
            exit 1
        fi
        best["${key}"]="$(awk '/^ *TOTAL/ {
            v = $NF; u = substr(v, length(v)); n = substr(v, 1, length(v) - 1)
            printf "%.1f", u == "M" ? n : u == "k" ? n / 1024 : u == "G" ? n * 1024 : v / 1048576
        }' "${work}/log")"
        return
    fi
    if [[ "${clock}" == instructions ]]; then
        rm -f "${work}"/callgrind.*
        if ! valgrind --tool=callgrind --trace-children=yes \
            --callgrind-out-file="${work}/callgrind.%p" "$@" >"${work}/log" 2>&1; then
            echo "compile_cost.sh: failed under valgrind: $*" >&2
            cat "${work}/log" >&2
            exit 1
        fi
        best["${key}"]="$(cat "${work}"/callgrind.* |
            awk '/^summary:/ { n += $2 } END { printf "%.3f", n / 1e9 }')"
        return
    fi
    now start
    if ! "$@" >"${work}/log" 2>&1; then
        echo "compile_cost.sh: failed: $*" >&2
        cat "${work}/log" >&2
        exit 1
    fi
    now end
    seconds="$(awk -v s="${start}" -v e="${end}" 'BEGIN { printf "%.3f", e - s }')"
    last["${key}"]="${seconds}"
    if [[ -z "${best[${key}]:-}" ]] ||
        awk -v a="${seconds}" -v b="${best[${key}]}" 'BEGIN { exit !(a < b) }'; then
        best["${key}"]="${seconds}"
    fi
}

# compile_all ROUND: every TU once; for each compiler a subject next to its floor, the subject
# first in odd rounds. Keeps the round's ratio of each subject to its floor.
compile_all() {
    local round="$1" name tu compiler order
    for name in "${subjects[@]}" reference; do
        order=("${name}" "${name}_floor" "${name}_old")
        ((round % 2 == 0)) && order=("${name}_old" "${name}_floor" "${name}")
        for compiler in "${compilers[@]}"; do
            for tu in "${order[@]}"; do
                [[ -e "${work}/${tu}.cpp" ]] || continue
                local nflags=("${nvcc_flags[@]}") cflags=("${cxx_flags[@]}")
                if [[ "${tu}" == *_old ]]; then
                    nflags=(-std=c++20 -O2 -arch=sm_90 "${old_includes[@]}")
                    cflags=(-std=c++20 -O2 "${old_includes[@]}")
                fi
                if [[ "${compiler}" == nvcc ]]; then
                    # shellcheck disable=SC2086 # extra flags are words
                    timed "nvcc/${tu}" "${nvcc}" "${nflags[@]}" ${extra[${name}]:-} -c \
                        "${work}/${tu}.cu" -o "${work}/out.o"
                else
                    # shellcheck disable=SC2086
                    timed "g++/${tu}" "${cxx}" "${cflags[@]}" ${extra[${name}]:-} -c \
                        "${work}/${tu}.cpp" -o "${work}/out.o"
                fi
            done
            if ((paired)) && [[ -e "${work}/${name}_floor.cpp" ]]; then
                ratios["${compiler}/${name}"]+="$(awk -v a="${last[${compiler}/${name}]:-0}" \
                    -v b="${last[${compiler}/${name}_floor]:-1}" 'BEGIN { printf "%.4f ", a / b }')"
            fi
        done
    done
}

for ((run = 1; run <= runs; ++run)); do
    compile_all "${run}"
done

unit="${clock} seconds"
[[ "${clock}" == memory ]] && unit="MB allocated by the front end"
[[ "${clock}" == instructions ]] && unit="billions of instructions executed (callgrind)"
if ((paired)); then
    echo "cudawait compile cost: best of ${runs}, ${unit}, per TU ($(nproc) cores); ratio: the" \
        "median of the ${runs} rounds' own ratios"
else
    echo "cudawait compile cost: ${unit}, per TU ($(nproc) cores)"
fi
echo "  nvcc: $("${nvcc}" --version | sed -n '$p'): ${nvcc_flags[*]}"
echo "  g++:  $("${cxx}" --version | sed -n 1p): ${cxx_flags[*]}"
echo "floor = the standard, system and CUDA headers the subject's cudawait headers include"
old_head=""
[[ -n "${against}" ]] && old_head="$(printf '%9s %8s' "${against:0:9}" change)"
printf '%-9s %-19s %8s %8s %7s %7s %s  %s\n' compiler subject headers floor ratio target \
    "${old_head}" ""
for compiler in "${compilers[@]}"; do
    for name in "${subjects[@]}"; do
        case "${name}" in
        umbrella) target=1.5 ;;
        coroutine) target=1.3 ;;
        *) target="" ;;
        esac
        with="${best[${compiler}/${name}]}"
        without="${best[${compiler}/${name}_floor]}"
        if ((paired)); then
            ratio="$(tr ' ' '\n' <<<"${ratios[${compiler}/${name}]}" | sed '/^$/d' | sort -g |
                awk '{ v[NR] = $1 } END {
                    printf "%.2f", NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')"
        else
            ratio="$(awk -v a="${with}" -v b="${without}" 'BEGIN { printf "%.2f", a / b }')"
        fi
        met=""
        if [[ -n "${target}" ]]; then
            met="$(awk -v r="${ratio}" -v t="${target}" 'BEGIN { print (r <= t ? "ok" : "over") }')"
        fi
        old_cols=""
        if [[ -n "${against}" ]]; then
            old="${best[${compiler}/${name%_separate}_old]:-}"
            if [[ -n "${old}" ]]; then
                old_cols="$(awk -v o="${old}" -v n="${with}" 'BEGIN {
                    printf "%9.2f %+7.0f%%", o, (n / o - 1) * 100 }')"
            else
                old_cols="$(printf '%9s %8s' - -)"
            fi
        fi
        printf '%-9s %-19s %8.2f %8.2f %7s %7s %s  %s\n' "${compiler}" "${name}" "${with}" \
            "${without}" "${ratio}x" "${target:+${target}x}" "${old_cols}" "${met}"
    done
    printf '%-9s %-19s %8.2f %8s\n' "${compiler}" "reference" "${best[${compiler}/reference]}" \
        "-"
done
echo "reference: <coroutine> + <cuda_runtime.h> only; coroutine: core/task.hpp + core/scheduler.hpp; core_face: core.hpp"
echo "*_separate: the same with CUDAWAIT_SEPARATE_COMPILATION (cudawait::compiled)"
if [[ -n "${against}" ]]; then
    echo "${against}: the subject against that revision's headers (a *_separate subject: its plain twin's); change: new against it"
fi
if ((paired)); then
    for compiler in "${compilers[@]}"; do
        for name in umbrella coroutine; do
            echo "  rounds' ratios, ${compiler} ${name}: $(awk '{
                for (i = 1; i <= NF; ++i) printf "%.2f ", $i }' <<<"${ratios[${compiler}/${name}]}")"
        done
    done
fi
echo "floor headers (umbrella): $(grep -c '^#include' "${work}/umbrella_floor.cpp"), with" \
    "$(grep '^#define' "${work}/umbrella_floor.cpp" | awk '{ print $2 }' | tr '\n' ' ')defined:"
grep '^#include' "${work}/umbrella_floor.cpp" | sed 's/#include //' | tr '\n' ' ' | fold -s -w 98 |
    sed 's/^/  /'
echo
