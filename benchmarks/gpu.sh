#!/usr/bin/env bash
# The runs that need the GPU machine, in parts that each fit one call of about ten minutes:
#
#   bash benchmarks/gpu.sh tests [N] [PYTEST ARGS]
#                                                the GPU test suite, 4 processes (pytest-xdist);
#                                                what fails there again in one process. The
#                                                whole suite takes more than one call (on an
#                                                H100, 470 s ran 212 of its 544 tests): N of
#                                                1 to 4 runs one part (parts 1 to 4 together
#                                                are the suite)
#   bash benchmarks/gpu.sh memcheck              compute-sanitizer memcheck: one call of every
#                                                kernel family (every kernel of the library)
#   bash benchmarks/gpu.sh bench [BENCH ARGS]    fp4moe bench (default: the README's table)
#   bash benchmarks/gpu.sh compare BASE [ARGS]   this tree against BASE (a git revision, or a
#                                                folder holding fp4moe_base): bits and speed
#   bash benchmarks/gpu.sh sort [ARGS]           the route sort alone (benchmarks/sort_bench.py)
#   bash benchmarks/gpu.sh ep                    the expert-parallel tests and bench (2 GPUs)
#   bash benchmarks/gpu.sh peers [PRESET ...]    fp4moe bench beside triton_kernels' MXFP4 MoE
#                                                (../shared/peers copied to .peers) in one call
#                                                a preset; the tables in $OUT/peers.md, the
#                                                files in $OUT/peers.tgz
#
# Logs and results go to $OUT (the device tool's folder) or ./gpu-out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
part="${1:-}"
shift || true

case "$part" in
tests)
    # the parts: the whole-MoE shapes but the largest batch, the families' bits, the prefill
    # kernel's mixed tile rows, then the rest
    big="test_moe_gpu_shapes or test_families_same_bits_gpu or test_prefill_mixed_gpu"
    case "${1:-}" in
    1) shift; set -- -k "test_moe_gpu_shapes and not 8192" "$@" ;;
    2) shift; set -- -k "test_families_same_bits_gpu" "$@" ;;
    3) shift; set -- -k "test_prefill_mixed_gpu" "$@" ;;
    4) shift; set -- -k "not ($big) or (test_moe_gpu_shapes and 8192)" "$@" ;;
    esac
    # four processes share the GPU; tests that fail among them (four processes can run
    # out of its memory together) run again in one process, which gives the verdict
    cache="$(mktemp -d)"
    export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    python3 -m pytest -m gpu --device cuda -q -n 4 -o cache_dir="$cache" "$@" 2>&1 |
        tee "$OUT/tests.log" | tail -40
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 1 ]; then
        echo "== the failed tests again, one process" | tee -a "$OUT/tests.log"
        python3 -m pytest -m gpu --device cuda -q -o cache_dir="$cache" --lf "$@" 2>&1 |
            tee -a "$OUT/tests.log" | tail -40
        rc=${PIPESTATUS[0]}
    fi
    rm -rf "$cache"
    exit "$rc"
    ;;
memcheck)
    rc=0
    # family, mode, fused: together every kernel (sort, quantize, amax, the GEMM families
    # and their reduce and decode launches, finalize, cast)
    for run in "gluon-split w4a4-static" "gluon-whole w4a4-token --fused" \
        "gluon-prefill w4a4-tensor" "triton w4a16 --fused" "triton-split w4a4-static" \
        "triton-dense w4a4-token" "triton w4a8 --fused" "gluon-prefill w4a8"; do
        set -- $run
        echo "== memcheck $run" | tee -a "$OUT/memcheck.log"
        compute-sanitizer --tool memcheck --error-exitcode 9 \
            python3 benchmarks/profile_call.py --preset deepseek-v3-ep8 --tokens 40 \
            --local-experts 4 --gemm "$1" --mode "$2" ${3:-} --check \
            >>"$OUT/memcheck.log" 2>&1
        r=$?
        echo "   exit $r" | tee -a "$OUT/memcheck.log"
        [ $r -ne 0 ] && rc=1
    done
    # the prefill kernel's three launches of each expert's tile rows (about 150 rows an
    # expert: 128-row blocks, then 64 or 32)
    echo "== memcheck gluon-prefill w4a16, 128, 64 and 32-row launches" | tee -a "$OUT/memcheck.log"
    compute-sanitizer --tool memcheck --error-exitcode 9 \
        python3 benchmarks/profile_call.py --preset deepseek-v3-ep8 --tokens 4800 \
        --local-experts 4 --gemm gluon-prefill --mode w4a16 --check >>"$OUT/memcheck.log" 2>&1
    r=$?
    echo "   exit $r" | tee -a "$OUT/memcheck.log"
    [ $r -ne 0 ] && rc=1
    grep -E "ERROR SUMMARY|rel err" "$OUT/memcheck.log"
    exit $rc
    ;;
bench)
    if [ $# -eq 0 ]; then
        set -- --preset deepseek-v3-ep8 --num-tokens 1 16 64 256 1024 2048 8192 16384 \
            --iters 10
    fi
    python3 -m fp4moe bench --out "$OUT/bench" "$@" 2>&1 | tee "$OUT/bench.log" | tail -60
    ;;
compare)
    base="${1:?compare needs BASE: a git revision or a folder holding fp4moe_base}"
    shift
    if [ -d "$base" ]; then src=(--base-src "$base"); else src=(--base "$base"); fi
    python3 benchmarks/compare_versions.py "${src[@]}" --out "$OUT/compare" "$@" 2>&1 |
        tee "$OUT/compare.log" | tail -80
    ;;
sort)
    python3 benchmarks/sort_bench.py "$@" 2>&1 | tee "$OUT/sort.log"
    ;;
ep)
    python3 -m pytest -m gpu --device cuda -q -p no:cacheprovider tests/test_distributed.py \
        tests/test_bench_ep.py 2>&1 | tee "$OUT/ep-tests.log" | tail -20
    python3 -m fp4moe bench --ep 2 --preset deepseek-v3-ep8 --num-tokens 1 16 256 1024 \
        --out "$OUT/bench-ep" 2>&1 | tee "$OUT/ep-bench.log" | tail -30
    ;;
peers)
    dir="${PEERS_DIR:-.peers}"
    if [ ! -f "$dir/bench_peers.py" ]; then
        echo "gpu.sh peers: copy ../shared/peers to $dir (its README says how)" >&2
        exit 2
    fi
    [ $# -eq 0 ] && set -- deepseek-v3-ep8 qwen3-30b-a3b mixtral-8x7b gpt-oss-120b-shape
    tokens=(1 8 16 64 128 256 512 1024 2048 4096)
    rc=0
    for preset in "$@"; do
        d="$OUT/peers/$preset"
        mkdir -p "$d"
        python3 -m fp4moe bench --preset "$preset" --modes w4a16 w4a4-token --no-baseline \
            --finalize unfused --num-tokens "${tokens[@]}" --iters 10 --rounds 3 --out "$d" \
            >"$d/bench.log" 2>&1 &&
            python3 benchmarks/peers_run.py "$dir" --preset "$preset" --fp4moe-src src \
                --peers tk-mxfp4 --num-tokens "${tokens[@]}" --iters 10 --rounds 3 \
                --out "$d/peers.csv" >"$d/peers.log" 2>&1 &&
            python3 benchmarks/peers_table.py "$d/bench.json" "$d/peers.csv" |
            tee -a "$OUT/peers.md" || { echo "gpu.sh peers: $preset failed (logs in peers.tgz)"
                rc=1
            }
    done
    tar czf "$OUT/peers.tgz" -C "$OUT" peers && rm -rf "$OUT/peers"
    exit $rc
    ;;
*)
    sed -n '2,18p' "$0"
    exit 2
    ;;
esac
