#!/usr/bin/env bash
# One GPU session's checks and measurements, in parts that each fit a 10-minute call.
# Run from the repository root on the GPU machine (torch and triton 3.6.0 preinstalled):
#
#   bash benchmarks/gpu_session.sh tests      # GPU tests but test_gluon_ws (about 6 min)
#   bash benchmarks/gpu_session.sh gluon_tests # tests/test_gluon_ws.py (up to 10 min)
#   bash benchmarks/gpu_session.sh memcheck   # compute-sanitizer over a few shapes (4 min)
#   bash benchmarks/gpu_session.sh sweep      # main loops and configs (sweep_decode.py)
#   bash benchmarks/gpu_session.sh dense      # the dense prefill path: test and sweeps
#   bash benchmarks/gpu_session.sh prep       # prefill passes: decode tiles, quantize, per kernel
#   bash benchmarks/gpu_session.sh configs    # configs and K segments on Qwen3 and Mixtral
#   bash benchmarks/gpu_session.sh gluon      # the Gluon decode GEMMs: bits and time
#   bash benchmarks/gpu_session.sh decode     # decode configs: register caps, FC2 pairs
#   bash benchmarks/gpu_session.sh bench      # fp4moe bench: DeepSeek-V3, Qwen3, Mixtral
#   bash benchmarks/gpu_session.sh ep         # two GPUs: NCCL tests, bench --ep, example
#   bash benchmarks/gpu_session.sh pair       # two GPUs: bench | memcheck, then NCCL tests
#   bash benchmarks/gpu_session.sh splits     # per-GEMM split: GPU tests, Qwen3 and Mixtral
#   bash benchmarks/gpu_session.sh famax      # per-tensor amax fused into FC1: bits, time
#   bash benchmarks/gpu_session.sh persist    # empty programs, split grid order, ordered x
#   bash benchmarks/gpu_session.sh stalls     # ncu: why the decode-size GEMMs stall
#   bash benchmarks/gpu_session.sh upto       # Gluon GEMMs against loop 3 by rows an expert
#   bash benchmarks/gpu_session.sh box3       # gluon_ws.CODE_BOX3 (default) against four boxes
#   bash benchmarks/gpu_session.sh qdec       # TritonOptions.quantize_decoded: bits and time
#   bash benchmarks/gpu_session.sh stagek     # Gluon ring stages below 256 K: bits and time
#   bash benchmarks/gpu_session.sh pdl        # the Gluon kernels in the PDL chain: time, tests
#   bash benchmarks/gpu_session.sh final      # session 11's checks: kernels, Gluon, bench
#   bash benchmarks/gpu_session.sh final2     # runner, phases, HF; memcheck over Gluon PDL
#   bash benchmarks/gpu_session.sh fc1early   # W4A4's FC1 copies before its wait: bits, time
#   bash benchmarks/gpu_session.sh atma       # the Gluon GEMMs' rows by TMA: bits, time
#   bash benchmarks/gpu_session.sh diag       # the Gluon GEMMs without decode / without copies
#   bash benchmarks/gpu_session.sh s12a       # diag, then test_kernels' GPU suite (CODE_WIDE)
#   bash benchmarks/gpu_session.sh grid       # the Gluon grid at the expected blocks: time, bits
#   bash benchmarks/gpu_session.sh grid2      # the same after the register fix, shorter
#   bash benchmarks/gpu_session.sh s12c       # session 12's last call: tests, then the bench
#   bash benchmarks/gpu_session.sh s12d       # the grid graph test again, Gluon bits, Qwen3/Mixtral
#   bash benchmarks/gpu_session.sh s12e       # per-tensor W4A4 without its amax kernel: bits, time
#   bash benchmarks/gpu_session.sh s12f       # the same at 1 token after the compile fix
#   bash benchmarks/gpu_session.sh timeline   # the Gluon GEMMs' per-program phase timeline
#   bash benchmarks/gpu_session.sh s13a       # timeline, then Gluon K segments of 512
#   bash benchmarks/gpu_session.sh s13b       # gluon_persist: bits, then time
#   bash benchmarks/gpu_session.sh s13c       # TILED weights: time; test_kernels, runner, phases
#   bash benchmarks/gpu_session.sh s13d       # bench at every count; runner, phases, HF tests
#   bash benchmarks/gpu_session.sh s13e       # memcheck with shorter limits
#   bash benchmarks/gpu_session.sh s14a       # two ring buffers (rows by TMA or X_RING): time
#   bash benchmarks/gpu_session.sh s14c       # X_RING's timeline; kernel times at 16 and 8192
#   bash benchmarks/gpu_session.sh s14d       # the new quantize kernels: bits, kernel times, bench
#   bash benchmarks/gpu_session.sh s14e       # test_kernels' GPU suite, quantize tests, PDL probe
#   bash benchmarks/gpu_session.sh s15a       # skewed starts, persistent rings of 2 and 4, clocks
#   bash benchmarks/gpu_session.sh s15b       # ncu pipe use of the decode GEMMs; persist by GEMM
#   bash benchmarks/gpu_session.sh s15c       # the bench with interleaved rounds (DeepSeek-V3)
#   bash benchmarks/gpu_session.sh s15d       # rounds against one pass at prefill; Qwen3, Mixtral
#   bash benchmarks/gpu_session.sh s15e       # per-tensor W4A4's amax zeros from the sort: bits, time
#   bash benchmarks/gpu_session.sh s15f       # FC2's dense weights decoded on a side stream
#   bash benchmarks/gpu_session.sh s16a       # 128-row Gluon tiles of 8 warps: bits, time, ncu
#   bash benchmarks/gpu_session.sh s16b       # ncu's stall samples a SASS instruction, 16 tokens
#   bash benchmarks/gpu_session.sh s16c       # Qwen3 and Mixtral benches; Qwen3's kernels at 1 token
#   bash benchmarks/gpu_session.sh s16d       # memcheck of the amax path; the Gluon GPU suite
#   bash benchmarks/gpu_session.sh s16e       # fused_chain: tests, fused calls with and without
#   bash benchmarks/gpu_session.sh s16f       # fused_chain's tests on the GPU; runner; fused shapes
#   bash benchmarks/gpu_session.sh s17a       # the Gluon GEMMs' skeleton (DIAG 3): calls, kernels, ncu
#   bash benchmarks/gpu_session.sh s17b       # gluon_prefill: a quick check, its GPU tests, a sweep
#   bash benchmarks/gpu_session.sh s17c       # gluon_prefill's GPU tests; runner, cast; Qwen3, Mixtral
#   bash benchmarks/gpu_session.sh s17d       # the bench at every count; the fused W4A4 runner tests
#   bash benchmarks/gpu_session.sh s17e       # test_kernels' large GPU shapes and invariance; presets
#   bash benchmarks/gpu_session.sh s17f       # gluon_whole_k at decode sizes; kernels at 16 and 8192
#   bash benchmarks/gpu_session.sh s17g       # gluon_prefill's experiments (DEFER, BM 64): bits, time
#   bash benchmarks/gpu_session.sh s17h       # DEFER and the finalize's tokens a program: tests, bench
#   bash benchmarks/gpu_session.sh s17i       # the bench at every count with the session's last defaults
#   bash benchmarks/gpu_session.sh s18a       # the skeleton without wgmmas (DIAG 4); memcheck of prefill
#   bash benchmarks/gpu_session.sh s18b       # tests/test_kernels.py's GPU suite with the prefill kernels
#   bash benchmarks/gpu_session.sh s18c       # whole-K Gluon programs (gluon_whole_upto): bits, sweeps
#   bash benchmarks/gpu_session.sh s18d       # their ring depth, the bench, presets, memcheck
#   bash benchmarks/gpu_session.sh s18e       # batch invariance across them, 256 tokens' kernels
#   bash benchmarks/gpu_session.sh s18f       # the sort kernel up to 4096 routes; whole-K from 1 row
#   bash benchmarks/gpu_session.sh s18g       # whole-K against split at 4 rows: Qwen3, Mixtral
#   bash benchmarks/gpu_session.sh s18h       # the bench at every count, the last defaults
#   bash benchmarks/gpu_session.sh s18i       # Qwen3's rows with the last defaults
#   bash benchmarks/gpu_session.sh s19a       # the prefill kernels from 24 / 48 rows
#   bash benchmarks/gpu_session.sh s19b       # SCHED_AHEAD, gluon_whole_over, prefill_above
#   bash benchmarks/gpu_session.sh s19c       # gluon_whole_fill; the bench, Qwen3's rows
#   bash benchmarks/gpu_session.sh s19d       # GPU tests of the session's paths; Mixtral
#   bash benchmarks/gpu_session.sh s19e       # prefill_above_long; Mixtral's bench rows
#   bash benchmarks/gpu_session.sh s20a       # (removed with WS_PRODUCER)
#   bash benchmarks/gpu_session.sh s20b       # QUANTIZE_ROW_FIRST: bits, then c3 against c3-rowfirst
#   bash benchmarks/gpu_session.sh s20c       # (removed with WS_PRODUCER)
#   bash benchmarks/gpu_session.sh s20d       # gluon_whole_wide: bits, then c3 against c3-wide24/32
#   bash benchmarks/gpu_session.sh s20e       # session 20's defaults against session 19's (c3-nowide)
#   bash benchmarks/gpu_session.sh s20f       # gluon_whole_wide 19 at 18 / 20 / 22 rows
#   bash benchmarks/gpu_session.sh s20g       # Kimi-K2 EP8 at 928 to 1056 tokens, c3 against c3-nowide
#   bash benchmarks/gpu_session.sh s20h       # the split kernels' bits tests and batch invariance
#   bash benchmarks/gpu_session.sh s21a       # the CUDA decode GEMMs: build, bits and time, tests
#   bash benchmarks/gpu_session.sh s21b       # the same: thread blocks of fewer warps, ring depth
#   bash benchmarks/gpu_session.sh s21c       # the kernel's 16-byte row copies: depth, block shape
#   bash benchmarks/gpu_session.sh s21d       # each kernel in time: the defaults against the CUDA GEMMs
#   bash benchmarks/gpu_session.sh s21e       # the same: each GEMM alone on CUDA, and without PDL
#   bash benchmarks/gpu_session.sh s21f       # the CUDA GEMMs' late PDL release, a 64-register cap
#   bash benchmarks/gpu_session.sh s21g       # the CUDA FC1 from 12 to 48 tokens, Qwen3, Mixtral
#   bash benchmarks/gpu_session.sh s22a       # the CUDA GEMMs' ring across items: bits, time
#   bash benchmarks/gpu_session.sh s22b       # the CUDA GEMMs without decode / copies; ncu samples
#   bash benchmarks/gpu_session.sh s22e       # cuda_decode.L2_NEXT: bits, time, kernels
#   bash benchmarks/gpu_session.sh s22f       # cuda_decode.WARP_ROWS 16: bits, time
#   bash benchmarks/gpu_session.sh s23a       # session 23 (no GPU then): CUDA tests (T = 0, ROT), ROT timed
#   bash benchmarks/gpu_session.sh s23b       # the Gluon ROT bits tests, W4A4 and prefill timed with it
#   bash benchmarks/gpu_session.sh s23c       # the defaults' short bench (session 22's rows)
#
# Outputs go to $OUT (or ./gpu-out) and are packed into one gpu-<part>.tar.gz there, so a
# transfer that limits the number of files still brings everything back. Each step has a
# time limit and its log is kept even when it fails; the script never stops at a failure.
set -u
part="${1:?usage: gpu_session.sh tests|gluon_tests|memcheck|sweep|dense|prep|configs|gluon|decode|bench|ep|pair|splits|famax|persist|stalls|upto|box3|qdec|stagek|pdl|final|final2|fc1early|atma|diag|s12a|grid|grid2|s12c|s12d|s12e|s12f|timeline|s13a|s13b|s13c|s13d|s13e|s14a|s14c|s14d|s14e|s15a|s15b|s15c|s15d|s15e|s15f|s16a|s16b|s16c|s16d|s16e|s16f|s17a|s17b|s17c|s17d|s17e|s17f|s17g|s17h|s17i|s18a|s18b|s18c|s18d|s18e|s18f|s18g|s18h|s18i|s19a|s19b|s19c|s19d|s19e|s20a|s20b|s20c|s20d|s20e|s20f|s20g|s20h|s21a|s21b|s21c|s21d|s21e|s21f|s21g|s22a|s22b|s22e|s22f|s23a|s23b|s23c}"
out="${OUT:-gpu-out}/$part"
mkdir -p "$out"
export PYTHONPATH=src
step() {  # step NAME SECONDS COMMAND...
    local name=$1 secs=$2
    shift 2
    echo "== $name: $*" | tee -a "$out/steps.txt"
    timeout "$secs" "$@" > "$out/$name.log" 2>&1
    echo "   exit $? ($name)" | tee -a "$out/steps.txt"
    tail -3 "$out/$name.log"
}
diag_steps() {
    # Where the Gluon GEMMs' time goes (gluon_ws.DIAG, wrong results, timing only): whole
    # calls and each kernel with the decode left out (1) and with the copies and their
    # waits left out (2), against the real kernel (0)
    step diag 150 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 64 \
        --diag 0 1 2 0 1 2 --out "$out/diag.json"
    for d in 0 1 2; do
        step "kernels_$d" 45 python3 benchmarks/profile_call.py --kernels --calls 5 \
            --tokens 16 --diag "$d"
    done
}
timeline_steps() {
    # Where each Gluon program's time goes (gluon_ws.TRACE): phase stamps of every program,
    # DeepSeek-V3 and Mixtral, W4A16 and W4A4 per-token
    step trace_test 60 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_timeline.py
    step timeline 120 python3 benchmarks/gluon_timeline.py --tokens 1 16 64 \
        --out "$out/timeline-deepseek.json"
    step timeline_w4a4 60 python3 benchmarks/gluon_timeline.py --tokens 1 16 \
        --mode w4a4-token --out "$out/timeline-deepseek-w4a4.json"
    step timeline_mixtral 60 python3 benchmarks/gluon_timeline.py --preset mixtral-8x7b \
        --tokens 1 16 --out "$out/timeline-mixtral.json"
}
ncu_source_steps() {  # ncu_source_steps TOKENS DIAG: ncu's warp samples a SASS instruction
    # of the Gluon GEMMs (W4A16, DeepSeek-V3), the source page as CSV and its report
    local tag="$1_d$2"
    step "src$tag" 150 ncu --clock-control none -k regex:tma_split -c 2 \
        --section SourceCounters --section WarpStateStats --section LaunchStats \
        --warp-sampling-interval 0 -f -o "$out/src$tag" \
        python3 benchmarks/profile_call.py --tokens "$1" --mode w4a16 --diag "$2"
    step "sass$tag" 60 ncu -i "$out/src$tag.ncu-rep" --page source --csv --print-source sass
    step "report$tag" 30 python3 benchmarks/ncu_source_report.py "$out/sass$tag.log"
}
cuda_build_step() {  # the CUDA decode library built with this machine's nvcc, or why not
    step build 120 python3 -c "from fp4moe.kernels import cuda_decode as c; \
        print(c.available(), c.build_error(), c.library_path())"
}
presets_steps() {  # presets_steps LIMIT_QWEN3 LIMIT_MIXTRAL: the bench's short rows of both
    local short=(--num-tokens 1 16 64 256 1024 8192 --iters 10)
    step qwen3 "$1" python3 -m fp4moe bench --preset qwen3-30b-a3b "${short[@]}" \
        --out "$out/qwen3"
    step mixtral "$2" python3 -m fp4moe bench --preset mixtral-8x7b "${short[@]}" \
        --out "$out/mixtral"
}
memcheck_steps() {  # memcheck_steps LIMIT LIMIT_TMA
    # compute-sanitizer over a few shapes of test_kernels, then over the Gluon TMA GEMMs
    # (the W4A16 decode default since session 9)
    step memcheck "$1" compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_kernels.py -k "test_moe_gpu_shapes and 64-qwen3 or \
        test_segmented_loop_gpu and w4a16 or dense_path_gpu and 64"
    step memcheck_tma "$2" compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_gluon_ws.py -k "async and (16 or one)"
}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$out/smi.txt" 2>&1
case "$part" in
tests)
    step kernels 300 python3 -m pytest -m gpu --device cuda tests/test_kernels.py -q
    step others 200 python3 -m pytest -m gpu --device cuda -q \
        tests/test_runner.py tests/test_phases.py tests/test_hf_gpu.py
    ;;
gluon_tests)
    # tests/test_gluon_ws.py alone: its variants compile per test (past 5 minutes)
    step gluon_ws 560 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py
    ;;
memcheck)
    # 214 s alone on an H200 in session 7; inside `tests` it ran past 240 s.
    memcheck_steps 400 200
    ;;
sweep)
    # Loop 3 (default) and its configs against loop 2, with bitwise checks; the per-tensor
    # amax on the device against torch ops (c2-torch-amax rows).
    step sweep 420 python3 benchmarks/sweep_decode.py --tokens 1 16 64 256 1024 8192 \
        --variants c2 c3 c3configs --iters 15 --out "$out/sweep.json"
    # The chunk-a-program W4A4 quantize (launch.QUANTIZE_SPLIT_ROWS, 512 since session 6)
    # against the sweep's 1024: the rows above 512 are unmeasured (the same bits).
    step sweep_qsplit 150 python3 benchmarks/sweep_decode.py --tokens 1 16 64 256 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-qsplit --iters 15 \
        --out "$out/sweep-qsplit.json"
    step sweep_tensor 150 python3 benchmarks/sweep_decode.py --tokens 1 16 64 256 \
        --modes w4a4-tensor --variants c3 c2 c2-torch-amax --iters 15 \
        --out "$out/sweep-tensor.json"
    ;;
dense)
    # The dense prefill path (TritonOptions.dense_above): bitwise against loop 3 and timed
    # per config, DeepSeek-V3 and Mixtral (then `fp4moe bench --dense-above R` with the best R).
    step dense_test 200 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "dense_path_gpu"
    step sweep_dense 240 python3 benchmarks/sweep_decode.py --tokens 2048 4096 8192 16384 \
        --variants c3 c3-nodense c3-dense c3dense --iters 10 --out "$out/sweep-dense.json"
    step sweep_dense_mixtral 200 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 1024 8192 --variants c3 c3-nodense c3-dense c3dense --iters 8 \
        --out "$out/sweep-dense-mixtral.json"
    ;;
prep)
    # The memory-bound passes of a prefill call, and each kernel's share of it.
    step sweep_prep 200 python3 benchmarks/sweep_prep.py --out "$out/prep.json"
    step kernels 200 bash -c 'for a in "--tokens 8192 --mode w4a16" \
        "--tokens 8192 --mode w4a4-token" "--preset qwen3-30b-a3b --tokens 16384 --mode w4a4-token" \
        "--preset mixtral-8x7b --tokens 8192 --mode w4a16"; do
        python3 benchmarks/profile_call.py --kernels --calls 5 $a; done'
    ;;
configs)
    # Loop 3's configs on the unmasked presets (every route valid), to move
    # choose_gemm_config onto valid rows an expert (TritonOptions.valid_fraction), and
    # shorter K segments (launch.SEGMENT) for Qwen3's small experts at decode sizes
    # (8 experts x 12 row tiles x 2 segments = 192 FC1 programs at 1 token) and prefill.
    step configs_qwen3 200 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b \
        --tokens 1 16 64 256 1024 8192 --modes w4a16 --variants c3 c3-seg256 c3-seg512 \
        c3configs --segments 256 512 --small-upto 256 --large-above 16 --iters 8 \
        --out "$out/configs-qwen3.json"
    step configs_mixtral 200 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 16 64 256 1024 --modes w4a16 --variants c3 c3configs --small-upto 64 \
        --large-above 16 --iters 6 --out "$out/configs-mixtral.json"
    ;;
decode)
    # Session 6's open questions (perf-notes items 8 to 11): register caps
    # (GemmConfig.maxnreg) against the wave quantization at 1 and 16 tokens, FC2 configs
    # of its own, other K segments (launch.SEGMENT: the split programs' wave count), and the
    # W4A4 prefill configs measured in the chunk order only.
    step decode_w4a16 270 python3 benchmarks/sweep_decode.py --tokens 1 16 64 256 \
        --modes w4a16 --variants c3 c3-seg512 c3-seg2048 c3configs c3pairs --iters 8 \
        --out "$out/decode-w4a16.json"
    step decode_w4a4 120 python3 benchmarks/sweep_decode.py --tokens 1 16 64 \
        --modes w4a4-token w4a4-tensor --variants c3 c3pairs --iters 8 \
        --out "$out/decode-w4a4.json"
    step prefill_w4a4 180 python3 benchmarks/sweep_decode.py --tokens 1024 4096 \
        --modes w4a4-token --variants c3 c3configs --iters 6 --out "$out/prefill-w4a4.json"
    ;;
gluon)
    # TritonOptions.gluon_decode (kernels.gluon_ws): bitwise against loop 3 (test), then
    # each GEMM and the whole call timed both ways, synchronous and asynchronous main loop.
    step gluon_test 200 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "tma_split_gpu"
    step gluon_sync 200 python3 benchmarks/gluon_experiment.py --tokens 1 16 64 \
        --wgmma sync --buffers 1 2 --out "$out/gluon-sync.json"
    step gluon_async 200 python3 benchmarks/gluon_experiment.py --tokens 1 16 64 \
        --buffers 1 2 4 --out "$out/gluon-async.json"
    ;;
bench)
    common=(--num-tokens 1 8 16 32 64 128 256 1024 4096 8192 16384 --iters 10)
    step deepseek 240 python3 -m fp4moe bench "${common[@]}" --out "$out/deepseek"
    step qwen3 150 python3 -m fp4moe bench --preset qwen3-30b-a3b "${common[@]}" \
        --out "$out/qwen3"
    step mixtral 180 python3 -m fp4moe bench --preset mixtral-8x7b "${common[@]}" \
        --out "$out/mixtral"
    ;;
pair)
    # Two GPUs in one call: fp4moe bench on GPU 0 while memcheck runs on GPU 1, then the
    # NCCL tests on both (the bench's token counts trimmed for Qwen3 and Mixtral to fit).
    (
        export CUDA_VISIBLE_DEVICES=1
        step memcheck 420 compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
            --device cuda -q tests/test_kernels.py -k "test_moe_gpu_shapes and 64-qwen3 or \
            test_segmented_loop_gpu and w4a16 or dense_path_gpu and 64"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        step deepseek 220 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 \
            4096 8192 16384 --iters 10 --out "$out/deepseek"
        short=(--num-tokens 1 16 64 256 1024 8192 --iters 10)
        step qwen3 90 python3 -m fp4moe bench --preset qwen3-30b-a3b "${short[@]}" \
            --out "$out/qwen3"
        step mixtral 110 python3 -m fp4moe bench --preset mixtral-8x7b "${short[@]}" \
            --out "$out/mixtral"
        step profile 40 bash -c 'for t in 1 16 64; do python3 benchmarks/profile_call.py \
            --kernels --calls 5 --tokens $t; done'
    )
    wait
    step nccl_tests 130 python3 -m pytest -m gpu --device cuda -q \
        tests/test_distributed.py tests/test_bench_ep.py
    ;;
famax)
    # TritonOptions.fused_amax (session 7, built on the CPU): bits on the GPU, then time
    # per-tensor W4A4 with and without it (c3 and c3-famax must be bitwise equal).
    step famax_test 150 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "fused_amax or device_amax"
    step famax_sweep 200 python3 benchmarks/sweep_decode.py --tokens 1 16 64 256 1024 \
        --modes w4a4-tensor --variants c3 c3-famax --iters 15 --out "$out/famax.json"
    ;;
persist)
    # Sessions 8 and 9: what the worst-case grid's empty programs cost (grid_experiment.py),
    # the split grid's order (TritonOptions.blocks_last, the default since session 9:
    # c3 against c3-noblast) and the activation rows in the unit order (ordered_x), each
    # bitwise against the default. (Session 9's run also timed c3-persist, since removed.)
    step tests 150 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "ordered_x_gpu or segmented_loop_gpu"
    step grid 100 python3 benchmarks/grid_experiment.py --tokens 1 16 32 64 \
        --out "$out/grid.json"
    step sweep 150 python3 benchmarks/sweep_decode.py --tokens 1 16 32 64 256 --modes w4a16 \
        --variants c3 c3-noblast c3-ordx --iters 12 --out "$out/sweep.json"
    for pr in qwen3-30b-a3b mixtral-8x7b; do
        step "sweep_$pr" 100 python3 benchmarks/sweep_decode.py --preset "$pr" \
            --tokens 1 16 64 --modes w4a16 --variants c3 c3-noblast c3-ordx --iters 8 \
            --out "$out/sweep-$pr.json"
    done
    ;;
upto)
    # The Gluon kernels (split K, 8-row tiles) against loop 3 on whole calls at every
    # count of valid rows an expert (TritonOptions.gluon_upto, 4 since session 10)
    step upto_deepseek 100 python3 benchmarks/gluon_experiment.py --whole-only \
        --gluon-upto 1000 --tokens 32 64 128 256 512 --out "$out/upto-deepseek.json"
    step upto_mixtral 100 python3 benchmarks/gluon_experiment.py --whole-only \
        --preset mixtral-8x7b --gluon-upto 1000 --tokens 8 16 32 64 --out "$out/upto-mixtral.json"
    step upto_kimi 100 python3 benchmarks/gluon_experiment.py --whole-only \
        --preset kimi-k2-ep8 --gluon-upto 1000 --tokens 64 128 256 --out "$out/upto-kimi.json"
    ;;
box3)
    # A stage's codes as one 3-D TMA box (gluon_ws.CODE_BOX3): bits, then whole calls
    # with and without it (each against loop 3 in its own rows)
    step box3_test 150 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "four_boxes"
    for r in 1 2; do  # alternating, two rounds (the loop 3 rows vary 2 to 4 us a process)
        step "box3_$r" 60 python3 benchmarks/gluon_experiment.py --whole-only \
            --tokens 1 8 16 32 --out "$out/box3-$r.json"
        step "four_$r" 60 python3 benchmarks/gluon_experiment.py --whole-only --four-boxes \
            --tokens 1 8 16 32 --out "$out/four-$r.json"
    done
    ;;
qdec)
    # W4A4's decoded rows from the quantize kernels (TritonOptions.quantize_decoded)
    step qdec_test 150 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "w4a4 and quantize_decoded"
    step qdec 150 python3 benchmarks/sweep_decode.py --tokens 1 16 32 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-noqdec c3-nogluon --iters 12 \
        --out "$out/qdec.json"
    ;;
stagek)
    # The phase test left from session 10's review, then the Gluon GEMMs' ring stage
    # (gluon_ws.STAGE_K) and depth (BUFFERS): whole W4A16 calls, bits against loop 3
    step phases 100 python3 -m pytest -m gpu --device cuda -q tests/test_phases.py
    step stagek 300 python3 benchmarks/gluon_experiment.py --whole-only \
        --tokens 1 8 16 32 64 128 --buffers 1 2 4 --stage-k 256 128 64 \
        --out "$out/stagek-deepseek.json"
    step stagek_mixtral 80 python3 benchmarks/gluon_experiment.py --whole-only \
        --preset mixtral-8x7b --tokens 1 16 --buffers 1 2 --stage-k 256 64 \
        --out "$out/stagek-mixtral.json"
    m='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum'
    m="$m,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread"
    m="$m,sm__warps_active.avg.pct_of_peak_sustained_active"
    m="$m,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem"
    step ncu_16 80 ncu --clock-control none -k regex:tma_split_kernel -c 2 --metrics "$m" \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16
    ;;
pdl)
    # The Gluon kernels launched with PDL (FC2's first weight copies before its wait)
    # against plain launches: whole calls, then the GPU tests the change touches
    step pdl 150 python3 benchmarks/gluon_experiment.py --whole-only \
        --tokens 1 8 16 32 64 128 --pdl off on early --out "$out/pdl-deepseek.json"
    step pdl_mixtral 50 python3 benchmarks/gluon_experiment.py --whole-only \
        --preset mixtral-8x7b --tokens 1 16 --pdl off early --out "$out/pdl-mixtral.json"
    step gluon_tests 200 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "stage_k_and_pdl_gpu or (ring1 and async) or (w4a4 and quantize_decoded)"
    step runner 90 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        tests/test_kernels.py -k "runner or graph or invariance"
    step bench 100 python3 -m fp4moe bench --num-tokens 1 16 32 --iters 10 --no-baseline \
        --out "$out/bench"
    ;;
final)
    # test_kernels' GPU suite, the Gluon tests the PDL rule touches, the decode bench
    step kernels 280 python3 -m pytest -m gpu --device cuda tests/test_kernels.py -q
    step gluon 130 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "(stage_k_and_pdl_gpu and pdl) or (w4a4 and quantize_decoded)"
    step bench 120 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 --iters 10 \
        --out "$out/bench"
    ;;
final2)
    # CUDA-graph replays with new routes (FC2 reads the schedule before its grid wait),
    # the workspace estimate, HF; memcheck over the Gluon kernels in the PDL chain
    step others 150 python3 -m pytest -m gpu --device cuda -q \
        tests/test_runner.py tests/test_phases.py tests/test_hf_gpu.py
    step memcheck_pdl 170 compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_gluon_ws.py -k "stage_k_and_pdl_gpu and 16 and sk128"
    step gluon_w4a4 150 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "w4a4 and quantize_decoded"
    ;;
fc1early)
    # TritonOptions.fc1_early (built in session 11 after the GPU time ran out)
    step fc1early_test 150 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "fc1_early"
    step fc1early 150 python3 benchmarks/sweep_decode.py --tokens 1 16 32 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-fc1early --iters 12 \
        --out "$out/fc1early.json"
    ;;
atma)
    # TritonOptions.gluon_a_tma (session 11: correct, no gain at 16 and 64 tokens, 6 us
    # lost at 1): bits of every mode first, then whole calls with and without it
    step atma_test 240 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "a_tma_gpu"
    step atma 150 python3 benchmarks/gluon_experiment.py --whole-only \
        --tokens 1 8 16 32 64 128 --a-tma off on off on --out "$out/atma-deepseek.json"
    step atma_w4a4 120 python3 benchmarks/sweep_decode.py --tokens 1 16 32 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-atma --iters 12 \
        --out "$out/atma-w4a4.json"
    ;;
diag)
    diag_steps
    ;;
s12a)
    # Session 12's first call: where the Gluon GEMMs' time goes (diag), then the kernels'
    # GPU suite with CODE_WIDE the default (not run with it in session 11)
    diag_steps
    step kernels 270 python3 -m pytest -m gpu --device cuda tests/test_kernels.py -q
    ;;
grid)
    # TritonOptions.gluon_grid_blocks (session 12): the Gluon GEMMs' grid at a few row blocks,
    # each program looping over its share of the valid ones, against the worst-case grid
    step grid 200 python3 benchmarks/gluon_experiment.py --whole-only \
        --tokens 1 8 16 32 64 128 --grid-blocks off auto 4 8 off auto \
        --out "$out/grid-deepseek.json"
    step grid_mixtral 60 python3 benchmarks/gluon_experiment.py --whole-only \
        --preset mixtral-8x7b --tokens 1 16 --grid-blocks off auto off auto \
        --out "$out/grid-mixtral.json"
    step grid_w4a4 130 python3 benchmarks/sweep_decode.py --tokens 1 16 32 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-gbauto c3-fc1early --iters 12 \
        --out "$out/grid-w4a4.json"
    step grid_tests 180 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "grid_blocks and (graph or one-expert or all-masked or 1-16 or 3-64 or auto-64)"
    ;;
grid2)
    # gluon_grid_blocks after session 12's register fix (the rows' buffer indexed by an
    # opaque zero: FC1 211 -> 80 registers): whole W4A16 calls, then bits, then W4A4
    step grid 170 python3 benchmarks/gluon_experiment.py --whole-only \
        --tokens 1 8 16 32 64 128 --grid-blocks off auto 4 off auto \
        --out "$out/grid2-deepseek.json"
    step grid_tests 170 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "grid_blocks and (graph or (w4a16 and (one-expert or all-masked or 1-16 or 3-64 \
        or auto-64)) or (per_token and (one-expert or auto-16)))"
    step grid_w4a4 100 python3 benchmarks/sweep_decode.py --tokens 1 16 32 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-gbauto --iters 12 \
        --out "$out/grid2-w4a4.json"
    ;;
s12c)
    # Session 12's last call: the graph-replay grid test that failed in grid2 (its message),
    # fc1_early (now the default) against loop 3, runner and phases, then the bench
    step grid_graph 90 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_ws.py \
        -k "loop_graph_replay_gpu and grid_blocks"
    step fc1early_test 90 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "fc1_early_gpu"
    step others 140 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        tests/test_phases.py
    step deepseek 240 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s12d)
    # The grid graph-replay test after its int32 fix, the default Gluon path's bits (CODE_WIDE,
    # fc1_early), then Qwen3 and Mixtral benches at decode and prefill sizes
    step grid_graph 90 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "loop_graph_replay_gpu and grid_blocks"
    step gluon 90 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "(tma_split_gpu and async and ring1) or (tma_split_w4a4_gpu and quantize_decoded)"
    short=(--num-tokens 1 16 64 256 8192 --iters 10)
    step qwen3 100 python3 -m fp4moe bench --preset qwen3-30b-a3b "${short[@]}" --out "$out/qwen3"
    step mixtral 130 python3 -m fp4moe bench --preset mixtral-8x7b "${short[@]}" \
        --out "$out/mixtral"
    ;;
s12e)
    # TritonOptions.amax_self_upto (session 12): per-tensor W4A4's quantize kernel takes the
    # amax itself for small inputs; bits (quantize and whole calls), then time
    step tests 110 python3 -m pytest -m "gpu or kernel" --device cuda -q tests/test_kernels.py \
        -k "amax_self or per_tensor_quantize or (gpu_shapes and per_tensor and (-1- or -3-))"
    step sweep 80 python3 benchmarks/sweep_decode.py --tokens 1 2 4 --modes w4a4-tensor \
        w4a4-token --variants c3 c3-noamaxself --iters 12 --out "$out/amaxself.json"
    ;;
s12f)
    # s12e's 1-token per-tensor cases after quantize_rows_kernel stopped specializing n_rows
    step tests 80 python3 -m pytest -m "gpu or kernel" --device cuda -q tests/test_kernels.py \
        -k "gpu_shapes and per_tensor and -1-"
    step sweep 50 python3 benchmarks/sweep_decode.py --tokens 1 --modes w4a4-tensor \
        --variants c3 c3-noamaxself --iters 12 --out "$out/amaxself-1.json"
    ;;
timeline)
    # the per-program timeline (gluon_ws.TRACE, built in session 12 after the GPU time ran
    # out; first run in s13a)
    timeline_steps
    ;;
s13a)
    # Session 13's first call: the timeline part, then Gluon K segments of 512 against 1024
    # at decode sizes (other bits: checked against the reference only)
    timeline_steps
    step seg512 150 python3 benchmarks/sweep_decode.py --tokens 1 16 32 --modes w4a16 \
        --variants c3 c3-seg512 --segments 512 --iters 12 --out "$out/seg512.json"
    ;;
s13b)
    # TritonOptions.gluon_persist (session 13): bits first (whole calls against loop 3, a
    # CUDA graph's replays), then time against the worst-case grid at decode sizes
    step persist_tests 200 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_ws.py \
        -k "persist and (graph or (w4a16 and (one-expert or all-masked or 1-16 or auto-64)) \
        or 1-64 or (per_token and auto-1))"
    step persist 200 python3 benchmarks/sweep_decode.py --tokens 1 8 16 32 64 128 256 \
        --modes w4a16 --variants c3 c3-persist c3-persist4 c3-persist-u8 --iters 12 \
        --out "$out/persist.json"
    step persist_w4a4 90 python3 benchmarks/sweep_decode.py --tokens 1 16 64 \
        --modes w4a4-token w4a4-tensor --variants c3 c3-persist --iters 12 \
        --out "$out/persist-w4a4.json"
    ;;
s13c)
    # gluon_ws.TILED (timing only: a tiled copy of the weights, contiguous 8 KB a stage),
    # then test_kernels' GPU suite with fc1_early the default, runner and phases
    step tiled 110 python3 benchmarks/sweep_decode.py --tokens 1 16 64 --modes w4a16 \
        --variants c3 c3-tiled --iters 12 --out "$out/tiled.json"
    step kernels 300 python3 -m pytest -m gpu --device cuda tests/test_kernels.py -q
    step others 120 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        tests/test_phases.py
    ;;
s13d)
    # Session 13's last call: the bench at every count with amax_self_upto (session 12's
    # estimate replaced), then runner, phases and the HF GPU tests
    step deepseek 260 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    step others 200 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        tests/test_phases.py
    step hf 100 python3 -m pytest -m gpu --device cuda -q tests/test_hf_gpu.py
    ;;
s13e)
    # memcheck with session 13's defaults (fc1_early, amax_self_upto), shorter limits (the
    # first selection's 300 s cut it after 11 of 12 tests)
    memcheck_steps 300 150
    ;;
s14a)
    # Next session's first call: two ring buffers, with the rows by TMA (gluon_a_tma) or a
    # ring stage at a time (gluon_ws.X_RING, FC1), so each program's next copy flies while
    # it decodes (session 13 item 7): X_RING's bits, then whole calls against loop 3's
    # bits; PERSIST again without the register cap that spilled FC2; the TMA ceiling
    step x_ring_tests 120 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_ws.py \
        -k "x_ring_gpu and (w4a16 or (per_token and (1-64 or 2-16)))"
    step buffers 300 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 64 \
        128 --buffers 1 2 --a-tma off on --x-ring off on --out "$out/buffers-deepseek.json"
    step persist 80 python3 benchmarks/sweep_decode.py --tokens 16 32 64 --modes w4a16 \
        --variants c3 c3-persist --iters 12 --out "$out/persist-uncapped.json"
    step stream 60 python3 benchmarks/tma_stream.py --per-sm 2 4 6 8 --buffers 1 2 \
        --out "$out/tma-stream.json"
    ;;
s14c)
    # Session 14: whether X_RING's seventh FC1 program an SM removes 16 tokens' second wave
    # and what its rows' loads in the main loop cost (the timeline both ways); each kernel's
    # time at 16 tokens, and at 8192 tokens fused per-tensor W4A4 against per-token and W4A16
    # (issue 4's unexplained 1.19x)
    for xr in "" --x-ring; do
        step "timeline${xr:+_xring}" 90 python3 benchmarks/gluon_timeline.py --tokens 1 16 \
            $xr --out "$out/timeline${xr:+-xring}.json"
    done
    step kernels_16 60 python3 benchmarks/profile_call.py --kernels --calls 5 --tokens 16
    for m in "w4a16 --fused" "w4a4-token --fused" "w4a4-tensor --fused" "w4a4-tensor"; do
        set -- $m
        step "kernels_8192_$1${2:+_fused}" 90 python3 benchmarks/profile_call.py --kernels \
            --calls 3 --tokens 8192 --mode $m
    done
    ;;
s14d)
    # Session 14's quantize and amax kernels (chunks as [blocks, 16], no barrier, one chunk
    # loaded ahead, the fast division, several rows an amax program): their bits against
    # the reference on the GPU, W4A4 whole calls, each kernel's time at 8192 tokens, then
    # the bench at every count
    step qtests 150 python3 -m pytest --device cuda -q tests/test_kernels.py -k \
        "quantize or amax or encode_e2m1 or (moe_gpu_shapes and w4a4 and deepseek)"
    for m in "w4a4-token --fused" "w4a4-tensor --fused"; do
        set -- $m
        step "kernels_8192_$1" 60 python3 benchmarks/profile_call.py --kernels --calls 3 \
            --tokens 8192 --mode $m
    done
    step deepseek 280 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s14e)
    # After s14d: the whole GPU suite of test_kernels and the quantize tests of
    # test_gluon_ws (the decoded rows) with the new quantize kernel; then whether PDL is
    # what costs fused per-tensor W4A4 its extra time at 8192 tokens (s14d: 4283 us fused
    # against 3932 unfused, W4A16 3690 / 3609)
    step kernels 300 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py
    step gluon_quantize 120 python3 -m pytest --device cuda -q tests/test_gluon_ws.py -k quantize
    step nopdl 90 python3 -m fp4moe bench --num-tokens 8192 --modes w4a4-tensor w4a4-token \
        w4a16 --no-pdl --no-baseline --iters 10 --out "$out/nopdl"
    ;;
s15a)
    # Session 14 found each decode GEMM's span the sum of its issue and byte times (no
    # overlap). Tell the causes apart: half the programs started late (gluon_ws.SKEW_NS:
    # the programs' common phase), persistent programs whose ring of 2 or 4 stages keeps
    # copies in flight while they decode, across units (never measured with more than one
    # buffer), and the SM clock and power while the calls replay (the power limit)
    step skew 110 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 64 \
        --skew 0 1000 2000 3000 0 --out "$out/skew.json"
    step persist_b12 150 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 \
        64 --buffers 1 2 --persist off 6:8 4:6 --out "$out/persist-b12.json"
    step persist_b2 100 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 \
        64 --buffers 2 --persist 3:5 5:7 --out "$out/persist-b2.json"
    step persist_b4 90 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 \
        64 --buffers 4 --persist 2:4 3:5 --out "$out/persist-b4.json"
    step persist_sk128 90 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 \
        16 64 --buffers 2 --stage-k 128 --persist off 6:8 --out "$out/persist-sk128.json"
    step clocks 50 python3 benchmarks/clock_probe.py --tokens 1 16 --seconds 2 \
        --out "$out/clocks.json"
    ;;
s15b)
    # Which pipe bounds the decode GEMMs' issue (ALU: LOP3 and PRMT at 16 lanes a clock):
    # ncu's pipe use for the two Gluon GEMMs at 1 and 16 tokens, real and without copies
    # (DIAG 2); then persistent programs with a ring of two by GEMM and token count (s15a:
    # 16 tokens 58.9 -> 53.5 us, 1 and 64 tokens slower), DeepSeek-V3, Qwen3, Mixtral
    want="smsp__issue_active smsp__inst_executed_pipe_alu smsp__inst_executed_pipe_fma \
        smsp__inst_executed_pipe_fmaheavy smsp__inst_executed_pipe_fp16 \
        smsp__inst_executed_pipe_lsu smsp__inst_executed_pipe_uniform sm__pipe_alu_cycles_active \
        sm__pipe_fma_cycles_active sm__pipe_fmaheavy_cycles_active sm__pipe_shared_cycles_active \
        smsp__pipe_alu_cycles_active smsp__pipe_fma_cycles_active smsp__pipe_fmaheavy_cycles_active \
        smsp__pipe_fp16_cycles_active smsp__pipe_shared_cycles_active"
    ncu --query-metrics > "$out/ncu-metrics.txt" 2>&1
    m="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
    m="$m,sm__cycles_elapsed.avg.per_second,sm__warps_active.avg.pct_of_peak_sustained_active"
    for w in $want; do
        if grep -q "^$w " "$out/ncu-metrics.txt"; then
            m="$m,$w.avg.pct_of_peak_sustained_active"
        fi
    done
    echo "$m" > "$out/ncu-metric-list.txt"
    for t in 1 16; do
        for d in 0 2; do
            step "ncu_${t}_diag$d" 60 ncu --clock-control none -k regex:tma_split -c 2 \
                --metrics "$m" python3 benchmarks/profile_call.py --tokens "$t" --mode w4a16 \
                --diag "$d"
        done
    done
    step persist_tokens 170 python3 benchmarks/gluon_experiment.py --whole-only --tokens 4 8 \
        12 16 24 32 --persist off 6:8 0:8 6:0 --persist-buffers 2 \
        --out "$out/persist-tokens.json"
    for pr in qwen3-30b-a3b mixtral-8x7b; do
        step "persist_$pr" 80 python3 benchmarks/gluon_experiment.py --whole-only --preset "$pr" \
            --tokens 1 16 64 --persist off 6:8 0:8 --persist-buffers 2 \
            --out "$out/persist-$pr.json"
    done
    ;;
s15c)
    # The bench with its configurations sampled in interleaved rounds (bench --rounds, new):
    # a short smoke run, then session 14's command at every count
    step smoke 90 python3 -m fp4moe bench --preset qwen3-30b-a3b --num-tokens 1 16 \
        --iters 4 --rounds 2 --out "$out/smoke"
    step deepseek 420 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s15d)
    # Whether the rounds change target 3's ratio at prefill (one pass against five rounds,
    # each in a fresh process), then Qwen3 and Mixtral (target 5)
    for r in 1 5; do
        step "prefill_rounds$r" 90 python3 -m fp4moe bench --num-tokens 8192 16384 --modes \
            w4a4-tensor w4a16 --no-baseline --iters 10 --rounds "$r" --out "$out/prefill-r$r"
    done
    presets_steps 130 170
    ;;
s15e)
    # Per-tensor W4A4's amax kernels fold into zeros the sort kernel clears
    # (TritonOptions.amax_zeros_in_sort): the per-tensor and amax GPU tests, then whole
    # calls with and without it
    step tests 200 python3 -m pytest --device cuda -q tests/test_kernels.py -k \
        "amax or (moe_gpu_shapes and per_tensor) or (invariance and per_tensor)"
    step sweep 150 python3 benchmarks/sweep_decode.py --tokens 1 4 8 16 32 64 256 --modes \
        w4a4-tensor --variants c3 c3-noamaxzeros c3 c3-noamaxzeros --iters 15 \
        --out "$out/amaxzeros.json"
    ;;
s15f)
    # The dense path with FC2's weights decoded on a side stream during FC1
    # (TritonOptions.dense_overlap): bits (eager and graph), time against the call's
    # stream, then the bench's prefill rows
    step tests 150 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py -k \
        "dense_overlap or dense_path"
    step sweep 120 python3 benchmarks/sweep_decode.py --tokens 8192 16384 --modes w4a16 \
        w4a4-token w4a4-tensor --variants c3 c3-nodenseoverlap --iters 10 \
        --out "$out/overlap.json"
    step bench 120 python3 -m fp4moe bench --num-tokens 4096 8192 16384 --iters 10 \
        --out "$out/prefill"
    ;;
s16a)
    # Next session's first call: gluon_ws.TILE_ROWS 128 (two 64-row tiles a program of 8
    # warps sharing one staged activation tile; built in session 15 after the GPU time
    # ran out, compiled on the CPU only): its bits against loop 3, whole calls against
    # 64-row tiles, then ncu's issue and warps at 16 tokens (session 15 item 4's table)
    step tile_tests 200 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_ws.py \
        -k tile_rows_gpu
    step tile_time 150 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 8 16 \
        32 64 128 --tile-rows 64 128 64 128 --out "$out/tile-rows.json"
    m="gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed"
    m="$m,sm__warps_active.avg.pct_of_peak_sustained_active"
    m="$m,smsp__issue_active.avg.pct_of_peak_sustained_active"
    m="$m,sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active"
    step ncu_16 90 ncu --clock-control none -k regex:tma_split -c 2 --metrics "$m" \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16 --tile-rows 128
    ;;
s16b)
    # Where the Gluon GEMMs' warps wait, instruction by instruction: ncu's warp-state
    # samples (SourceCounters) of FC1 and FC2 at 16 tokens, the real kernel and DIAG 2 (no
    # copies, no waits), exported as the SASS source page (one row an instruction)
    ncu --version > "$out/ncu-version.txt" 2>&1
    for d in 0 2; do
        ncu_source_steps 16 "$d"
        step "details16_d$d" 60 ncu -i "$out/src16_d$d.ncu-rep" --page details --csv
    done
    step others 200 python3 -m pytest -m gpu --device cuda -q \
        tests/test_runner.py tests/test_phases.py tests/test_hf_gpu.py
    ;;
s16c)
    # The two other presets' benches with session 15's amax changes; memcheck over the
    # amax and quantize kernels those changes touched
    presets_steps 130 160
    # Qwen3 per-tensor W4A4 at 1 token: each kernel, fused against deterministic (the
    # fused call was 4 us over the deterministic one in session 15, W4A16's 0.5)
    for f in "" --fused; do
        for m in w4a4-tensor w4a16; do
            step "qwen3_kernels_${m}${f}" 60 python3 benchmarks/profile_call.py \
                --preset qwen3-30b-a3b --tokens 1 --mode "$m" --kernels --calls 5 $f
        done
    done
    ;;
s16d)
    # memcheck over the amax and quantize kernels session 15 changed, then the whole
    # Gluon GPU suite (last run whole in session 11)
    step memcheck_amax 200 compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_kernels.py -k "amax and not dense"
    step gluon_ws 330 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py
    ;;
s16e)
    # TritonOptions.fused_chain (new, on): the fused finalize's zeros before the sort and
    # its cast a PDL launch. Its tests, then fused calls with it and without
    # (c3-nofusedchain), DeepSeek-V3 and Qwen3, then the bench's decode rows of both
    step chain_tests 70 python3 -m pytest --device cuda -q tests/test_kernels.py \
        -k "cast_rows or fused_chain"
    local_sweep=(--modes w4a16 w4a4-token w4a4-tensor --variants c3 c3-nofusedchain --fused
        --iters 20)
    step chain_ds 120 python3 benchmarks/sweep_decode.py --tokens 1 16 64 "${local_sweep[@]}" \
        --out "$out/chain-deepseek.json"
    step chain_qwen3 90 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b \
        --tokens 1 16 "${local_sweep[@]}" --out "$out/chain-qwen3.json"
    step bench_ds 100 python3 -m fp4moe bench --num-tokens 1 16 64 --iters 10 \
        --no-baseline --out "$out/deepseek"
    step bench_qwen3 80 python3 -m fp4moe bench --preset qwen3-30b-a3b --num-tokens 1 16 \
        --iters 10 --no-baseline --out "$out/qwen3"
    ;;
s16f)
    # fused_chain's tests on the GPU (kernel tests run there without -m gpu), then the
    # GPU tests of the paths it touches: the runner's graphs, the fused GPU shapes
    step chain_tests 90 python3 -m pytest --device cuda -q tests/test_kernels.py \
        -k "cast_rows or fused_chain"
    step runner 120 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py
    step fused_shapes 150 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "moe_gpu_shapes and fused and not deterministic"
    ;;
s17a)
    # Session 16's open question (perf-notes session 16, item 6): is the Gluon GEMMs'
    # skeleton (schedule reads, the rows' staging, wgmmas on zeros, the epilogue: DIAG 3,
    # neither decode nor copies) most of their time? Whole calls and each kernel with
    # DIAG 0 to 3, then ncu's warp samples of the skeleton at 16 tokens
    step diag 200 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 64 \
        --diag 0 1 2 3 0 3 --out "$out/diag.json"
    for d in 0 1 2 3; do
        step "kernels_$d" 45 python3 benchmarks/profile_call.py --kernels --calls 5 \
            --tokens 16 --diag "$d"
    done
    ncu_source_steps 16 3
    rm -f "$out"/*.ncu-rep
    gzip -9 "$out/sass16_d3.log"
    ;;
s17b)
    # gluon_prefill (session 17): the dense path's GEMMs decoding in registers. A quick
    # check first (bits against the dense path; a hang is cut at its limit), the rest
    # only if it passed
    step check 120 python3 benchmarks/prefill_check.py --tokens 2048 8192 --iters 5
    if grep -q "same True" "$out/check.log" && ! grep -q "same False" "$out/check.log"; then
        step tests 150 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_prefill.py \
            -k "deepseek or graph"
        step sweep 240 python3 benchmarks/sweep_decode.py --tokens 1024 2048 4096 8192 16384 \
            --modes w4a16 w4a4-token --variants c3 c3-prefill c3-prefill-d64 c3-dense64 \
            --iters 10 --out "$out/sweep.json"
    fi
    ;;
s17c)
    # gluon_prefill on by default (prefill_above 96): its GPU tests, session 16's runner
    # tests not reached then and the cast test, then Qwen3 and Mixtral with and without
    step tests 240 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_prefill.py
    step runner 120 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        tests/test_kernels.py -k "graph_replay_gpu or cast_rows_gpu"
    for pr in qwen3-30b-a3b mixtral-8x7b; do
        step "sweep_$pr" 100 python3 benchmarks/sweep_decode.py --preset "$pr" \
            --tokens 1024 4096 8192 --modes w4a16 w4a4-token --variants c3 c3-noprefill \
            --iters 5 --out "$out/sweep-$pr.json"
    done
    ;;
s17d)
    # The bench at every count with gluon_prefill on, then the runner tests session 16 and
    # s17c did not reach (fused W4A4) and the cast test
    step deepseek 420 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    step runner 90 python3 -m pytest -m gpu --device cuda -q tests/test_runner.py \
        -k "graph_replay_gpu and fused and w4a4"
    step cast 40 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py -k cast_rows_gpu
    ;;
s17e)
    # test_kernels' GPU shapes where the prefill path runs (1000 and 8192 tokens), batch
    # invariance and the dense path's test, then Qwen3 and Mixtral at prefill sizes
    step kernels 300 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "(moe_gpu_shapes and (1000 or 8192)) or invariance or dense_path_gpu"
    for pr in qwen3-30b-a3b mixtral-8x7b; do
        step "bench_$pr" 110 python3 -m fp4moe bench --preset "$pr" --num-tokens 1024 4096 \
            8192 --iters 5 --out "$out/$pr"
    done
    ;;
s17f)
    # gluon_whole_k (the decode-size W4A16 GEMMs on the prefill kernel, 8-row blocks,
    # whole K a program): bits, whole calls, each kernel at 16 tokens; then each kernel of
    # the prefill path at 8192 tokens
    step tests 100 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_prefill.py \
        -k whole_k
    step sweep 150 python3 benchmarks/sweep_decode.py --tokens 1 8 16 32 64 --modes w4a16 \
        --variants c3 c3-wholek --iters 10 --out "$out/sweep.json"
    step kernels_16 45 python3 benchmarks/profile_call.py --kernels --calls 5 --tokens 16
    step kernels_16_wholek 45 python3 benchmarks/profile_call.py --kernels --calls 5 \
        --tokens 16 --whole-k
    for m in w4a16 w4a4-token; do
        step "kernels_8192_$m" 60 python3 benchmarks/profile_call.py --kernels --calls 3 \
            --tokens 8192 --mode "$m"
    done
    ;;
s17g)
    # gluon_prefill's experiments: DEFER, 64-row blocks (BM 64), two programs an SM
    step tests 150 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_prefill.py \
        -k variants
    step sweep 220 python3 benchmarks/sweep_decode.py --tokens 4096 8192 16384 \
        --modes w4a16 w4a4-token --variants c3 c3-pdefer c3-pbm64 c3-pbm64x2 \
        c3-pbm64x2-defer --iters 5 --out "$out/sweep.json"
    ;;
s17h)
    # The session's last defaults (gluon_prefill.DEFER, the finalize's tokens a program):
    # the prefill and finalize GPU tests, the finalize's timing, the bench at every count
    step tests 160 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_prefill.py \
        -k "not whole_k and not variants"
    step finalize_tests 60 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "finalize_gpu or invariance"
    step finalize_tpp 60 python3 benchmarks/finalize_tpp.py --tokens 2048 8192 16384
    step deepseek 200 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s17i)
    # The bench at every count with the session's last defaults (finalize back to one
    # token a program after s17h)
    step deepseek 240 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 1024 4096 \
        8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s18a)
    # Session 17's next step: how much of the decode GEMMs' skeleton (DIAG 3) is their
    # wgmma chain (DIAG 4 leaves it out too), whole calls and each kernel at 16 tokens;
    # then compute-sanitizer over the prefill kernel's GPU tests (a few shapes). First the
    # prefill kernel's 1-token cases, added after session 17's GPU time ran out
    ids=$(python3 -m pytest --collect-only -q tests/test_gluon_prefill.py 2>/dev/null \
        | grep 'prefill_gpu\[.*-1\]')
    # shellcheck disable=SC2086
    step prefill_t1 150 python3 -m pytest -m gpu --device cuda -q $ids
    step diag 150 python3 benchmarks/gluon_experiment.py --whole-only --tokens 1 16 64 \
        --diag 0 3 4 0 3 4 --out "$out/diag.json"
    for d in 3 4; do
        step "kernels_$d" 45 python3 benchmarks/profile_call.py --kernels --calls 5 \
            --tokens 16 --diag "$d"
    done
    step memcheck 240 compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_gluon_prefill.py -k "deepseek and 64 and deterministic \
        or graph"
    ;;
s18b)
    # tests/test_kernels.py's GPU suite with gluon_prefill and prefill_above (session 17
    # ran its large shapes and invariance only)
    step kernels 560 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py
    ;;
s18c)
    # gluon_whole_upto (session 18): the Gluon GEMMs with whole-K programs where loop 3 runs
    # unsplit. Bits first (a hang is cut at its limit); the sweeps only if they passed
    step tests 150 python3 -m pytest -m gpu --device cuda -q -x tests/test_gluon_whole.py \
        -k "deterministic and (256 or qwen3 or one-expert)"
    if grep -q " passed" "$out/tests.log" && ! grep -q "failed\|error" "$out/tests.log"; then
        step sweep 180 python3 benchmarks/sweep_decode.py --tokens 256 384 512 768 \
            --modes w4a16 w4a4-token --variants c3 c3-whole24 --iters 10 --out "$out/sweep.json"
        step mixtral 60 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 32 64 \
            --modes w4a16 --variants c3 c3-whole24 --iters 10 --out "$out/mixtral.json"
        step qwen3 60 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b --tokens 256 384 \
            --modes w4a16 --variants c3 c3-whole24 --iters 10 --out "$out/qwen3.json"
        step tests_rest 120 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_whole.py \
            -k "not (deterministic and (256 or qwen3 or one-expert))"
    fi
    ;;
s18d)
    # gluon_whole_upto 24 the default: two ring stages a whole-K program against one, the
    # bench at every count, Qwen3 and Mixtral rows, compute-sanitizer over the new kernel
    step buffers 90 python3 benchmarks/sweep_decode.py --tokens 256 384 512 768 \
        --modes w4a16 --variants c3-whole24 c3-whole24b2 --iters 10 --out "$out/buffers.json"
    step deepseek 250 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 512 1024 \
        4096 8192 16384 --iters 10 --out "$out/deepseek"
    for pr in qwen3-30b-a3b mixtral-8x7b; do
        step "bench_$pr" 70 python3 -m fp4moe bench --preset "$pr" --num-tokens 16 64 256 \
            --iters 10 --out "$out/$pr"
    done
    step memcheck 90 compute-sanitizer --tool memcheck python3 -m pytest -m gpu \
        --device cuda -q tests/test_gluon_whole.py -k "256 and (w4a16 or per_token)"
    ;;
s18e)
    # Batch invariance across the whole-K kernels (a batch of 384 tokens), each kernel of a
    # 256-token call, and 128 tokens (4 valid rows an expert) on the whole-K kernels
    step invariance 120 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "batch_invariance_gpu"
    for wu in 0 24; do
        step "kernels_256_$wu" 45 python3 benchmarks/profile_call.py --kernels --calls 5 \
            --tokens 256 --whole-upto "$wu"
    done
    step sweep128 90 python3 benchmarks/sweep_decode.py --tokens 128 --modes w4a16 w4a4-token \
        --variants c3 c3-whole24u3 --iters 10 --out "$out/sweep128.json"
    ;;
s18f)
    # sort_routes_kernel up to 4096 routes (was 1024): its GPU tests and batch invariance;
    # the whole-K kernels from 1 valid row an expert; 256 tokens' kernels; the bench rows
    step tests 150 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "sort_invariants or batch_invariance_gpu"
    step sweep 90 python3 benchmarks/sweep_decode.py --tokens 64 96 128 --modes w4a16 \
        w4a4-token --variants c3 c3-whole24u1 --iters 10 --out "$out/sweep.json"
    step kernels_256 45 python3 benchmarks/profile_call.py --kernels --calls 5 --tokens 256
    step deepseek 100 python3 -m fp4moe bench --num-tokens 128 256 512 --iters 10 \
        --out "$out/deepseek"
    ;;
s18g)
    # The calls at exactly 4 expected valid rows an expert (gluon_upto) on the whole-K
    # kernels against the split ones: Qwen3 at 64 tokens, Mixtral at 16
    step qwen3 60 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b --tokens 64 \
        --modes w4a16 w4a4-token --variants c3 c3-whole24u3 --iters 10 --out "$out/qwen3.json"
    step mixtral 60 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 16 \
        --modes w4a16 w4a4-token --variants c3 c3-whole24u3 --iters 10 --out "$out/mixtral.json"
    ;;
s18h)
    # The bench at every count with the session's last defaults (whole-K kernels, the sort
    # kernel up to 4096 routes)
    step deepseek 240 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 512 1024 \
        4096 8192 16384 --iters 10 --out "$out/deepseek"
    ;;
s18i)
    # Qwen3's rows with the session's last defaults (its 256 and 512 tokens: 2048 and 4096
    # routes, now on the sort kernel)
    step qwen3 120 python3 -m fp4moe bench --preset qwen3-30b-a3b --num-tokens 16 64 256 512 \
        --iters 10 --out "$out/qwen3"
    ;;
s19a)
    # Session 18's next steps, prepared: Mixtral at 256 tokens (64 valid rows an expert,
    # loop 3 at 64-row tiles, 1.06x the bf16 MoE) on the prefill kernels from 48 rows;
    # DeepSeek-V3 at 1024 tokens (32 rows) likewise
    step mixtral 120 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 128 256 \
        --modes w4a16 w4a4-token --variants c3 c3-pa48 c3-pa24 --iters 10 --out "$out/mixtral.json"
    step deepseek 120 python3 benchmarks/sweep_decode.py --tokens 768 1024 2048 \
        --modes w4a16 --variants c3 c3-pa48 c3-pa24 --iters 10 --out "$out/deepseek.json"
    ;;
s19b)
    # Session 19: a valid program's start / end read beside its expert (c3-sched), two
    # processes; whole-K above 3.5 rows (gluon_whole_over, now on) against the split
    # kernels (c3-noover); the prefill kernels from fewer rows, and 64-row blocks there
    step sched1 150 python3 benchmarks/sweep_decode.py --tokens 1 8 16 32 64 --modes w4a16 \
        --variants c3 c3-sched --iters 20 --out "$out/sched1.json"
    step sched2 150 python3 benchmarks/sweep_decode.py --tokens 1 8 16 32 64 \
        --modes w4a16 w4a4-token --variants c3 c3-sched --iters 20 --out "$out/sched2.json"
    step over 150 python3 benchmarks/sweep_decode.py --tokens 96 112 120 128 144 \
        --modes w4a16 w4a4-token w4a4-tensor --variants c3 c3-noover --iters 20 \
        --out "$out/over.json"
    step over_kimi 90 python3 benchmarks/sweep_decode.py --preset kimi-k2-ep8 --tokens 160 192 \
        --modes w4a16 --variants c3 c3-noover --iters 20 --out "$out/over-kimi.json"
    step pa_mix 200 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 96 128 192 256 384 --modes w4a16 w4a4-token \
        --variants c3 c3-pa16 c3-pa32 c3-pa48 c3-pa48-pbm64x2-defer --iters 10 \
        --out "$out/pa-mixtral.json"
    step pa_ds 150 python3 benchmarks/sweep_decode.py --tokens 1536 2048 3072 \
        --modes w4a16 w4a4-token --variants c3 c3-pa32 c3-pa48 c3-pa48-pbm64x2-defer \
        --iters 10 --out "$out/pa-deepseek.json"
    ;;
s19c)
    # gluon_whole_fill on Mixtral's under-filled whole-K FC2 (48 and 64 tokens); the bench
    # at every count and Qwen3's rows with the session's defaults (gluon_whole_over 3.5,
    # prefill_above 32)
    step fill 100 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 48 64 \
        --modes w4a16 w4a4-token --variants c3 c3-fill1 --iters 20 --out "$out/fill.json"
    step deepseek 270 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 128 256 512 1024 \
        2048 4096 8192 16384 --iters 10 --out "$out/deepseek"
    step qwen3 120 python3 -m fp4moe bench --preset qwen3-30b-a3b --num-tokens 16 64 256 512 \
        --iters 10 --out "$out/qwen3"
    ;;
s19d)
    # GPU tests of the session's paths (whole-K at 128 tokens, batch invariance), Mixtral's
    # rows
    step whole_tests 170 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_whole.py
    step invariance 90 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k batch_invariance_gpu
    step mixtral 200 python3 -m fp4moe bench --preset mixtral-8x7b --num-tokens 16 64 128 256 \
        --iters 10 --out "$out/mixtral"
    # per-tensor W4A4's fused call at 1 token (1.18x the fused W4A16 call in s19c, 1.12x in
    # s18h) against per-token's and W4A16's, each kernel
    for m in w4a4-tensor w4a4-token w4a16; do
        step "k1_$m" 45 python3 benchmarks/profile_call.py --kernels --calls 5 --tokens 1 \
            --mode "$m" --fused
    done
    ;;
s19e)
    # prefill_above_long (24 where both GEMMs' K reach 4096): Mixtral at 25 to 32 rows an
    # expert on the prefill kernels, against prefill_above alone (c3-nolong); DeepSeek-V3
    # at 1024 tokens unchanged; Mixtral's bench rows
    step long 150 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 104 112 128 \
        --modes w4a16 w4a4-token --variants c3 c3-nolong --iters 10 --out "$out/long.json"
    step mixtral 200 python3 -m fp4moe bench --preset mixtral-8x7b --num-tokens 16 64 128 256 \
        --iters 10 --out "$out/mixtral"
    ;;
s20a)
    # Session 20: gluon_ws.WS_PRODUCER, c3 against c3-ws (every launch hung: its barriers'
    # count); removed in session 20 with the experiment (docs/perf-notes.md, session 20)
    echo "s20a: removed with gluon_ws.WS_PRODUCER (session 20)"
    ;;
s20c)
    # Session 20: s20a after the barriers' fix (slower at 8 to 64 tokens, wrong bits in
    # two cases); removed with gluon_ws.WS_PRODUCER (docs/perf-notes.md, session 20)
    echo "s20c: removed with gluon_ws.WS_PRODUCER (session 20)"
    ;;
s20d)
    # TritonOptions.gluon_whole_wide (whole-K at 32-row tiles): its bits, then DeepSeek-V3
    # at 16 to 32 rows an expert and Mixtral at 16 to 32 (64 to 128 tokens)
    step wide_test 170 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_whole.py \
        -k "wide"
    step wide_ds 170 python3 benchmarks/sweep_decode.py --tokens 512 640 768 896 1024 \
        --modes w4a16 w4a4-token --variants c3 c3-wide24 c3-wide32 --iters 10 \
        --out "$out/wide-deepseek.json"
    step wide_mixtral 150 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 64 80 96 112 128 --modes w4a16 w4a4-token --variants c3 c3-wide24 \
        c3-wide32 --iters 10 --out "$out/wide-mixtral.json"
    ;;
s20e)
    # session 20's defaults (gluon_whole_wide 16, gluon_whole_upto 28, prefill_above_long
    # 28) against session 19's (c3-nowide): the whole-K GPU tests, then the row counts
    # the change moves on the three presets (16 to 28 rows an expert)
    step whole_tests 170 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_whole.py
    step nowide_ds 110 python3 benchmarks/sweep_decode.py --tokens 576 768 832 896 \
        --modes w4a16 w4a4-token --variants c3 c3-nowide --iters 10 \
        --out "$out/nowide-deepseek.json"
    step nowide_mixtral 90 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 72 96 104 112 --modes w4a16 w4a4-token --variants c3 c3-nowide --iters 10 \
        --out "$out/nowide-mixtral.json"
    step nowide_qwen3 90 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b \
        --tokens 288 384 448 --modes w4a16 w4a4-token --variants c3 c3-nowide --iters 10 \
        --out "$out/nowide-qwen3.json"
    ;;
s20f)
    # gluon_whole_wide 19 (32-row tiles from 20 rows) against session 19's defaults at 18,
    # 20 and 22 rows an expert on the three presets
    step w19_ds 90 python3 benchmarks/sweep_decode.py --tokens 576 640 704 --modes w4a16 \
        --variants c3 c3-nowide --iters 10 --out "$out/w19-deepseek.json"
    step w19_mixtral 70 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b \
        --tokens 72 80 88 --modes w4a16 --variants c3 c3-nowide --iters 10 \
        --out "$out/w19-mixtral.json"
    step w19_qwen3 70 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b \
        --tokens 288 320 352 --modes w4a16 --variants c3 c3-nowide --iters 10 \
        --out "$out/w19-qwen3.json"
    ;;
s20g)
    # Kimi-K2 EP8 at 19 to 22 rows an expert (928 to 1056 tokens), which session 20's
    # defaults moved to the 32-row whole-K tiles unmeasured, against session 19's
    step kimi 170 python3 benchmarks/sweep_decode.py --preset kimi-k2-ep8 \
        --tokens 928 960 1024 1056 --modes w4a16 w4a4-token --variants c3 c3-nowide \
        --iters 10 --out "$out/nowide-kimi.json"
    ;;
s21a)
    # TritonOptions.cuda_decode (kernels/cuda/decode_gemm.cu): the library built with the
    # machine's nvcc, then W4A16 at decode sizes against the defaults (bits: `same`) with
    # the ring slots a warp (dN) and the L2 prefetch, each GEMM alone at 16 tokens, and the tests
    export FP4MOE_CACHE="$out/cache"
    cuda_build_step
    step cuda 220 python3 benchmarks/sweep_decode.py --tokens 1 8 16 32 64 128 \
        --modes w4a16 --variants c3 c3-cuda c3-cuda-d2 c3-cuda-d6 c3-cuda-d8 c3-cuda-l2 \
        c3-cuda-d8-l2 --iters 20 --out "$out/cuda.json"
    step cuda_one 60 python3 benchmarks/sweep_decode.py --tokens 16 --modes w4a16 \
        --variants c3 c3-cuda-fc1 c3-cuda-fc2 --iters 20 --out "$out/cuda-one.json"
    step cuda_tests 150 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py
    rm -rf "$out/cache"
    ;;
s21b)
    # s21a (session 21 item 1): 2x slower than the Gluon kernels with 14-warp thread blocks
    # (one an SM by registers). Row groups a block (rN) and ring slots (dN) by warps an SM
    export FP4MOE_CACHE="$out/cache"
    cuda_build_step
    step cuda 300 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 \
        --modes w4a16 --variants c3 c3-cuda-r1-d2 c3-cuda-r1-d3 c3-cuda-r1-d4 c3-cuda-r2-d2 \
        c3-cuda-r2-d3 c3-cuda-r4-d2 c3-cuda-r1-d3-l2 --iters 20 --out "$out/cuda.json"
    step cuda_one 90 python3 benchmarks/sweep_decode.py --tokens 16 --modes w4a16 \
        --variants c3 c3-cuda-r1-d3-fc1 c3-cuda-r1-d3-fc2 c3-cuda-r2-d3-fc2 c3-cuda-r4-d3-fc2 \
        --iters 20 --out "$out/cuda-one.json"
    rm -rf "$out/cache"
    ;;
s21c)
    # session 21 item 2: the codes copied 16 bytes a lane (four rows a warp instruction),
    # the segment's scales once, the activations by plain loads; groups of 4 units in
    # flight (dN) and row groups a block (rN)
    export FP4MOE_CACHE="$out/cache"
    cuda_build_step
    step cuda 300 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 \
        --modes w4a16 --variants c3 c3-cuda-d1-r1 c3-cuda-d2-r1 c3-cuda-d4-r1 c3-cuda-d2 \
        c3-cuda-d4 c3-cuda-d2-r2 c3-cuda-d2-r4 --iters 20 --out "$out/cuda.json"
    step cuda_one 90 python3 benchmarks/sweep_decode.py --tokens 16 --modes w4a16 \
        --variants c3 c3-cuda-d2-r1-fc1 c3-cuda-d4-r1-fc1 c3-cuda-d2-r2-fc2 c3-cuda-d2-r4-fc2 \
        --iters 20 --out "$out/cuda-one.json"
    step cuda_tests 120 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py
    rm -rf "$out/cache"
    ;;
s21d)
    # each kernel of a call in time (CUDA graph replays, PDL) with the Gluon GEMMs and with
    # the CUDA ones (DEPTH 2, one row group a block), at 1, 16 and 64 tokens
    export FP4MOE_CACHE="$out/cache"
    for t in 1 16 64; do
        step "tl_c3_$t" 60 python3 benchmarks/profile_call.py --tokens $t --calls 5 \
            --kernels --graph --timeline
        step "tl_cuda_$t" 60 python3 benchmarks/profile_call.py --tokens $t --calls 5 \
            --kernels --graph --timeline --cuda --cuda-depth 2 --cuda-rows 1
    done
    rm -rf "$out/cache"
    ;;
s21e)
    # s21d: FC2 on the CUDA kernel ends 25 us after a CUDA FC1 at 16 tokens (Gluon: 17).
    # Each GEMM alone on the CUDA kernel, and both without PDL
    export FP4MOE_CACHE="$out/cache"
    tl=(python3 benchmarks/profile_call.py --calls 5 --kernels --graph --timeline --cuda
        --cuda-depth 2)  # (timeout runs no shell function: an array)
    step tl16_fc1 60 "${tl[@]}" --tokens 16 --cuda-rows 1 --cuda-only fc1
    step tl16_fc2r1 60 "${tl[@]}" --tokens 16 --cuda-rows 1 --cuda-only fc2
    step tl16_fc2r4 60 "${tl[@]}" --tokens 16 --cuda-rows 4 --cuda-only fc2
    step tl16_nopdl 60 "${tl[@]}" --tokens 16 --cuda-rows 1 --cuda-nopdl
    step tl1_nopdl 60 "${tl[@]}" --tokens 1 --cuda-rows 1 --cuda-nopdl
    step tl64_fc2r4 60 "${tl[@]}" --tokens 64 --cuda-rows 4 --cuda-only fc2
    rm -rf "$out/cache"
    ;;
s21f)
    # s21e: the CUDA FC2 after a CUDA FC1 lost 6 us to PDL's early launch; the release now
    # comes with each block's last item. And a 64-register cap (more warps an SM)
    export FP4MOE_CACHE="$out/cache"
    step cuda 330 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 --modes w4a16 \
        --variants c3 c3-cuda-d1-r1 c3-cuda-d2-r1 c3-cuda-d1-r1-cap64 c3-cuda-d2-r1-cap64 \
        c3-cuda-d2-r1-fc1 c3-cuda-d1-r1-cap64-fc1 --iters 20 --out "$out/cuda.json"
    step cuda_tests 120 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py
    rm -rf "$out/cache"
    ;;
s21g)
    # s21f: only FC1 on the CUDA kernel gains, at 16 tokens. Where else: DeepSeek-V3 at 12
    # to 48 tokens, Qwen3 (FC1 only: its FC2's K is 768) and Mixtral at 16 and 64; then
    # session 20's unrun all-masked case of the 32-row whole-K kernels
    export FP4MOE_CACHE="$out/cache"
    step ds 150 python3 benchmarks/sweep_decode.py --tokens 12 16 24 32 48 --modes w4a16 \
        --variants c3 c3-cuda-d2-r1-fc1 c3-cuda-d1-r1-cap64-fc1 c3-cuda-d1-r1 --iters 20 \
        --out "$out/ds.json"
    step qwen 90 python3 benchmarks/sweep_decode.py --preset qwen3-30b-a3b --tokens 16 64 \
        --modes w4a16 --variants c3 c3-cuda-d2-r1-fc1 --iters 20 --out "$out/qwen.json"
    step mixtral 100 python3 benchmarks/sweep_decode.py --preset mixtral-8x7b --tokens 16 64 \
        --modes w4a16 --variants c3 c3-cuda-d2-r1 c3-cuda-d2-r1-fc1 --iters 20 \
        --out "$out/mixtral.json"
    step wide_masked 120 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_whole.py \
        -k "whole_wide_gpu and all-masked"
    rm -rf "$out/cache"
    ;;
s22a)
    # cuda_decode.CROSS_ITEMS (built after session 21's GPU time, not yet run): each block's
    # ring runs on from one item to the next. Its bits (the tests' cross cases), then its
    # time against session 21's best shapes and the defaults
    export FP4MOE_CACHE="$out/cache"
    step cuda_tests 180 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py
    step cuda 300 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 --modes w4a16 \
        --variants c3 c3-cuda-d2-r1 c3-cuda-d2-r1-x c3-cuda-d2-r1-fc1 c3-cuda-d2-r1-x-fc1 \
        c3-cuda c3-cuda-x --iters 20 --out "$out/cuda.json"
    rm -rf "$out/cache"
    ;;
s22b)
    # Where the CUDA decode kernel's time goes (never profiled in session 21): whole calls
    # and each kernel with the decode left out (DIAG 1), the weights' copies left out (2),
    # both (3), against the real kernel; then ncu's warp samples of both GEMMs at 16 tokens
    export FP4MOE_CACHE="$out/cache"
    step diag 200 python3 benchmarks/sweep_decode.py --tokens 1 16 64 --modes w4a16 \
        --variants c3 c3-cuda c3-cuda-diag1 c3-cuda-diag2 c3-cuda-diag3 --iters 20 \
        --out "$out/diag.json"
    for d in 0 1 2 3; do
        step "kernels_$d" 60 python3 benchmarks/profile_call.py --kernels --graph --timeline \
            --calls 5 --tokens 16 --cuda --cuda-diag "$d"
    done
    ncu --version > "$out/ncu-version.txt" 2>&1
    step src16_cuda 150 ncu --clock-control none -k regex:decode_gemm -c 2 \
        --section SourceCounters --section WarpStateStats --section LaunchStats \
        --section Occupancy --warp-sampling-interval 0 -f -o "$out/src16_cuda" \
        python3 benchmarks/profile_call.py --tokens 16 --mode w4a16 --cuda
    step sass16_cuda 60 ncu -i "$out/src16_cuda.ncu-rep" --page source --csv --print-source sass
    step report16_cuda 30 python3 benchmarks/ncu_source_report.py "$out/sass16_cuda.log"
    step details16_cuda 60 ncu -i "$out/src16_cuda.ncu-rep" --page details --csv
    rm -rf "$out/cache" "$out"/*.ncu-rep
    ;;
s22e)
    # cuda_decode.L2_NEXT: FC1 (at 2.2 of the 4.2 TB/s) prefetches FC2's weights of its
    # experts into L2 where they fit, so that FC2 (s22b: 16.8 us at 16 tokens, 11.2 without
    # its copies) finds them there
    export FP4MOE_CACHE="$out/cache"
    step cuda_tests 120 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py \
        -k "l2next"
    step cuda 300 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 --modes w4a16 \
        --variants c3 c3-cuda-x-fc1 c3-cuda-x-pf1-fc1 c3-cuda-x-pf2-fc1 c3-cuda-x \
        c3-cuda-x-pf1 c3-cuda-x-pf2 --iters 20 --out "$out/cuda.json"
    for v in 1 2; do
        step "kernels_pf$v" 60 python3 benchmarks/profile_call.py --kernels --graph \
            --timeline --calls 5 --tokens 16 --cuda --cuda-cross --cuda-only fc1 \
            --cuda-l2next "$v"
    done
    step kernels_pf2_both 60 python3 benchmarks/profile_call.py --kernels --graph \
        --timeline --calls 5 --tokens 16 --cuda --cuda-cross --cuda-l2next 2
    rm -rf "$out/cache"
    ;;
s22f)
    # cuda_decode.WARP_ROWS 16: one 16-row A tile a warp (FC1 at 8 rows: 92 registers, 41
    # KB a block of 7 warps, so 3 blocks an SM instead of 2): more warps for the same work
    export FP4MOE_CACHE="$out/cache"
    step cuda_tests 120 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py \
        -k "rows16"
    step cuda 240 python3 benchmarks/sweep_decode.py --tokens 1 8 16 64 --modes w4a16 \
        --variants c3 c3-cuda-x-fc1 c3-cuda-x-w16-fc1 c3-cuda-w16-fc1 c3-cuda-x \
        c3-cuda-x-w16 --iters 20 --out "$out/cuda.json"
    rm -rf "$out/cache"
    ;;
s23a)
    # Session 23 had no GPU: the CUDA kernel's T = 0 case and the rotated code layout
    # (ROT_LAYOUT: 15 decode instructions a code word against 18, the same bits) with every
    # knob's case of test_cuda_decode_gpu; then the rotated layout on the Gluon GEMMs (the
    # defaults, c3-grot) and on the CUDA kernel with CROSS (both GEMMs and FC1 alone)
    # against today's, whole calls, and the 16-token kernels (about 8 minutes)
    export FP4MOE_CACHE="$out/cache"
    cuda_build_step
    step cuda_tests 300 python3 -m pytest -m gpu --device cuda -q tests/test_cuda_decode.py
    step rot 240 python3 benchmarks/sweep_decode.py --tokens 1 16 64 --modes w4a16 \
        --variants c3 c3-grot c3-cuda-x c3-cuda-x-rot c3-cuda-x-fc1 c3-cuda-x-rot-fc1 \
        --iters 20 --out "$out/rot.json"
    step kernels 60 python3 benchmarks/profile_call.py --kernels --graph --timeline \
        --calls 5 --tokens 16 --cuda --cuda-cross
    step kernels_rot 60 python3 benchmarks/profile_call.py --kernels --graph --timeline \
        --calls 5 --tokens 16 --cuda --cuda-cross --cuda-rot
    rm -rf "$out/cache"
    ;;
s23b)
    # The rotated layout on the Gluon GEMMs: its bits tests (decode sizes and 4096 tokens),
    # W4A4 per-token and prefill sizes timed with it (about 8 minutes)
    step gluon_rot_tests 240 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        -k "rot_layout_gpu"
    step rot_w4a4 150 python3 benchmarks/sweep_decode.py --tokens 1 16 64 \
        --modes w4a4-token --variants c3 c3-grot --iters 20 --out "$out/rot_w4a4.json"
    step rot_prefill 150 python3 benchmarks/sweep_decode.py --tokens 4096 8192 \
        --modes w4a16 --variants c3 c3-grot --iters 10 --out "$out/rot_prefill.json"
    ;;
s23c)
    # The defaults' short bench, as session 22's (issue 3's and 4's decode rows)
    step bench 300 python3 -m fp4moe bench --num-tokens 1 8 16 32 64 --finalize both \
        --iters 10 --out "$out/bench"
    ;;
s20h)
    # After the WS removal and the rows' staging change (_stage_x CH): the split Gluon
    # kernels' own bits tests and batch invariance with session 20's defaults
    step final_tests 200 python3 -m pytest -m gpu --device cuda -q tests/test_gluon_ws.py \
        tests/test_kernels.py -k "test_tma_split_gpu or test_tma_split_w4a4_gpu or \
        batch_invariance_gpu"
    ;;
s20b)
    # launch.QUANTIZE_ROW_FIRST: its bits, then per-tensor and per-token W4A4 at 1 and 16
    # tokens, fused (per-tensor's fused 1-token row is target 3's weakest) and not
    step rowfirst_test 90 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "row_first"
    step rowfirst 120 python3 benchmarks/sweep_decode.py --tokens 1 16 --modes w4a4-tensor \
        w4a4-token --variants c3 c3-rowfirst --iters 20 --fused --out "$out/rowfirst-fused.json"
    step rowfirst_det 100 python3 benchmarks/sweep_decode.py --tokens 1 16 \
        --modes w4a4-tensor w4a4-token --variants c3 c3-rowfirst --iters 20 \
        --out "$out/rowfirst.json"
    ;;
stalls)
    # Why the decode-size GEMMs issue so little: ncu's stall reasons a issued instruction.
    m='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,gpu__time_duration.sum'
    m="$m,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__registers_per_thread"
    m="$m,sm__warps_active.avg.pct_of_peak_sustained_active"
    m="$m,smsp__issue_active.avg.pct_of_peak_sustained_active"
    for t in 1 16; do
        step "ncu_$t" 150 ncu --clock-control none -k regex:moe_gemm_kernel -c 2 --metrics "$m" \
            python3 benchmarks/profile_call.py --tokens "$t" --mode w4a16
    done
    ;;
splits)
    # Session 7's per-GEMM split (TritonOptions.gemm_splits) and 64-row tiles at 64 valid
    # rows an expert: the GPU tests that cover splits and configs, then the two presets
    # the change touches (every route valid).
    step tests 200 python3 -m pytest -m gpu --device cuda -q tests/test_kernels.py \
        -k "gpu_shapes or segmented or invariance or dense_path_gpu"
    presets_steps 100 130
    ;;
ep)
    step nccl_tests 150 python3 -m pytest -m gpu --device cuda -q \
        tests/test_distributed.py tests/test_bench_ep.py
    step bench_ep 300 python3 -m fp4moe bench --ep 2 --ep-path both --num-tokens 1 16 64 256 \
        --modes w4a16 w4a4-token --out "$out/bench-ep"
    if [ ! -s "$out/bench-ep/bench-ep.json" ]; then  # graph capture of the fixed path failed?
        step bench_ep_variable 200 python3 -m fp4moe bench --ep 2 --ep-path variable \
            --num-tokens 1 16 64 256 --modes w4a16 w4a4-token --out "$out/bench-ep-variable"
    fi
    step disaggregated 90 python3 examples/disaggregated.py --device cuda
    ;;
*)
    echo "unknown part $part (tests, memcheck, sweep, dense, prep, configs, gluon, decode, bench, ep, pair, splits, famax, persist or stalls)"
    exit 2
    ;;
esac
tar -czf "${OUT:-gpu-out}/gpu-$part.tar.gz" -C "$(dirname "$out")" "$part"
echo "packed ${OUT:-gpu-out}/gpu-$part.tar.gz"
