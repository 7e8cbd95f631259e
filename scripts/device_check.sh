#!/usr/bin/env bash
# Check-and-measure runs on a GPU machine, in stages that each fit one call of a few minutes. Results
# go under $OUT (default: out/device). Run from the repository root, e.g.:
#   OUT=out/device bash scripts/device_check.sh tests match
# Stages (in the order given; `all` runs every one):
#   tests     the GPU index, co-located, top-K, scoring-kernel and graph tests on the real device (TESTS_JOBS:
#             pytest-xdist workers, where it is installed; TESTS_FILES: other test files)
#   match     `bench match` of the shipped match kernel against the circle-table versions (10M, 100M)
#   pipeline  `bench pipeline` (10M pool: latency per request and pool ads/s by batch size; PIPELINE_ARGS: more
#             options, e.g. "--layouts format,geo" for both slot orders in one run, with PIPELINE_TAG naming its files)
#   datapipe  `bench pipeline --data` on a generated corpus of distinct ads (DATA_ADS, default 10000000, fp16,
#             seed 3, DATA_REQUESTS requests, default 256; /tmp/d$DATA_ADS, generated first when missing: files
#             there do not outlast the machine, so generate and measure in one call; DATAPIPE_ARGS: more options)
#   distinct100m  `bench pipeline --data DIR --copies N` on a pool of distinct copies of the corpus of `datapipe`
#             (DISTINCT_ADS, default 10000000, generated first when missing; DISTINCT_COPIES, default 10: a 100M
#             pool made in memory, every copy an ad of its own, benchmarks/copies.py), batches 1 and 64, graphs,
#             every timed answer of DISTINCT_CHECK_REQUESTS requests checked (default 8); DISTINCT_ARGS: more
#             options; results in $OUT/pipeline_copies_${DISTINCT_ADS}x$DISTINCT_COPIES.json and .log. /tmp does not
#             outlast the machine, so generate and measure in one call: DISTINCT_TIMEOUT (default 480 s) leaves
#             the 10M corpus's generation (about 80 s) the rest of a 600 s call
#   startup   `scripts/time_startup.py` twice on the corpus of `datapipe` (generated first when missing): start-up
#             to the first answer with the compile caches as the machine has them, then warm
#   lone      where a lone request's time goes on the corpus of `datapipe` (`scripts/probe_engine_batch.py
#             --batches 1,64`), then `ncu` (speed of light, launch statistics) of the kernels of lone requests
#             (LONE_NCU_BATCH=64: of batches of 64 instead; LONE_NCU_SKIP, LONE_NCU_COUNT: which launches)
#   lonelab   a lone request's scoring kernel and top-K, variants: `scripts/probe_topk_segments.py` (top-K versions
#             TOPK_VERSIONS, default "2,3", and segment lengths TOPK_SEGMENT_LENS, default "16384,4096";
#             LONELAB_TOPK=0 leaves it out),
#             then `bench pipeline --data` with each scoring kernel of LONELAB_VERSIONS (default "8 9 10"; an
#             entry "mN" runs match kernel N of the lab with the shipped scoring kernel)
#   engines   `bench served --engines` (ENGINES, default "1,4") with the clients in SERVED_PROCS processes (default 8)
#             against `serve colocated` on the generated 1M fp16 corpus and the 10M corpus of `datapipe`
#             (ENGINES_ADS, default "1000000 10000000"): the served rate and the lone client's p99; the clients'
#             request batches in each of SERVED_FORMATS (default "json"; "json columns": both, in turn);
#             the clients reaching each of SERVED_VIAS (default "front"; "front workers": also the engine
#             workers' own endpoints, `serve colocated --endpoints`, in turn); the engines' batches overlapped
#             or not as SERVED_OVERLAPS says (default "off"; "off on": both, `--overlap-batches`, in turn);
#             SERVED_FRONTS: front processes beside the engines, which the clients follow (`--fronts`; default
#             "0"; "0,4": both, in turn);
#             ENGINES_MPS=1 runs it with the engine workers' CUDA contexts under an MPS daemon the stage starts
#             and stops (files tagged _mps)
#   servedsteps  the GPU tests of the engine's steps, the overlapped batches and the fronts' engine, then stage
#             `engines` with one engine at 10M, its batches overlapped or not and with 0 or 4 fronts
#             (`SERVED_OVERLAPS="off on" SERVED_FRONTS="0,4"`, the clients in 8 processes, one pass each): four
#             servers in one run, so what `--overlap-batches` and `--fronts` give is read against one in-process rate
#   enginesweep  `python -m benchmarks.served` on the corpus of `datapipe` with SWEEP_ENGINES engines (default
#             "2,3,4") each with decoding between batches and ahead of them (SWEEP_AHEAD, default "off,on"), and
#             the engines sharing the GPU by time slices or taking turns on it (SWEEP_TURN, default "off"; "off,on")
#   batchedpeer  `scripts/probe_batched_peer.py` on the corpus of `datapipe`: a batch of PEER_REQUESTS (64)
#             scored by the shipped kernels and by the batched, eligibility-masked PyTorch peer
#   compare   `compare` on a generated 1M-ad corpus with 2,000 updates applied: every request against
#             the oracle, the CPU index, the GPU index, both architectures (COMPARE_ARGS: more options, e.g.
#             "--layout geo", with COMPARE_TAG naming its files)
#   score     `bench score` (D = 64 and 128, fp16 and int8, versions 4 and 6, every peer) and `ncu` on the shipped v6
#   corpus    only generate the corpus the threeway and shards stages read, /tmp/c$CORPUS_ADS (default
#             10000000; 32 requests, 2,000 updates): at 10M give it a call of its own, then run those
#             stages in the next call at once, while the machine (and its /tmp) is still held
#   threeway  `compare` at 1M ads with the remote design's scorer on the CPU and on the GPU beside the
#             co-located server, on loopback and over a shaped 100 us / 25 Gb/s network
#             (THREEWAY_ADS, default 1000000: the corpus /tmp/c$THREEWAY_ADS with 2,000 updates;
#             THREEWAY_LINKS, default "0 100": loopback and 100 us; THREEWAY_REQUESTS, default 64)
#   shards    the shards' Flight fan-out (no Ray there: shards as plain processes, `benchmarks.cluster
#             --placement processes`) against one in-process engine, each Flight row split into encode,
#             fan-out, slowest shard and merge, with the scaling against one shard (SHARDS_ADS, SHARDS;
#             the shards go round the machine's GPUs: one per GPU on a kind with several, all on the
#             one GPU otherwise; SHARDS_ARGS="--gpus N" keeps to the first N)
#   tiled     a tiled pool per shard on the GPU(s) (`benchmarks.cluster --tiled`: TILED_COPIES copies of an 8,192-ad base
#             per shard, default 12208, 100M ads; TILED_SHARDS, default 1,2): each shard checked against the
#             float64 reference, the pool growing with the shards, one shard per GPU where there are several
#   ray       the shards as Ray actors on the one GPU (fractional num_gpus), actor and Flight paths, against one
#             in-process engine (`benchmarks.cluster --placement ray`; RAY_ADS, RAY_SHARDS); Ray is not on the
#             machine's image: scripts/device_wheels.sh makes wheels to carry (.whl) and install first
#   sharded   `serve cluster` (Ray) with one shard per GPU (SHARDED_SHARDS, default: the machine's GPU
#             count, at least 2) against one engine over the whole pool, both after the corpus's 2,000
#             updates, every request (`scripts/check_sharded.py`; SHARDED_ADS, default 10000000; Ray
#             carried as for `ray`)
#   clusterserved  `bench served` against `serve colocated` (CLUSTER_SERVED_ENGINES engines, default 1) and
#             `serve cluster` (Ray; 1 shard x 1 replica and 1 x 4 sharing the GPU: CLUSTER_SERVED_SPECS,
#             CLUSTER_SERVED_SPECS2) in one run on the generated 1M fp16 corpus (CLUSTER_SERVED_ADS); Ray's
#             wheels carried in .whl (scripts/device_wheels.sh) are installed first when Ray is missing
#   stall     retrieval latency during one 20,000-upsert call, each server, update CPU share 1 and 0.5
#             (STALL_SHARES, STALL_ARGS: more `bench_update_stall.py` options, e.g. "--servers colocated")
#   served    32 plain Flight clients (in 1 and in 4 processes) against `serve colocated` on the GPU, against the
#             in-process batch; the server's own ceiling with an answer table (no engine time), on a generated
#             1M-ad corpus stored in SERVED_PRECISION (default fp16, the pipeline targets' precision)
#             (SERVED_PROCS, SERVED_EXCHANGE, SERVED_SECONDS, SERVED_CEILING (empty: none); SERVED_ARGS: more
#             `bench_served.py` options, e.g. "--server-cpus 2", with SERVED_TAG naming its file; with
#             "--profile $OUT/spy" (py-spy on the PATH) the samples' summaries are printed and the raw
#             stacks come back as one spy.tgz: a call brings back at most 8 files)
#   engine    where a batch's time goes in the co-located engine on a generated 1M-ad corpus, as the served bench's
#             in-process figure runs it (`scripts/probe_engine_batch.py`: host stages, kernels by CUDA events, a
#             cProfile; ENGINE_PRECISIONS, default "fp16 fp32": the corpus's stored precision; ENGINE_BATCHES)
#   profile   `ncu` (speed of light, occupancy) of the shipped scoring kernel and the final top-K over a
#             10M-slot pool with a random 8% eligible, for 1 and for 64 requests (PROFILE_ELIGIBLE,
#             PROFILE_VERSION)
#   host      this machine's CPU and numpy's BLAS threads, and the host-side costs of a request
#             (`scripts/time_host_side.py`: decoding, encoding, match preparation, the user side) with
#             the BLAS threads as they are and with one thread, on a generated 200,000-ad corpus
#             (HOST_DATA: another corpus directory)
#   demo      `andromeda demo` on the GPU, and the quality experiment's kernel figures
#   sanitize  `compute-sanitizer` (racecheck, initcheck, memcheck, synccheck: SANITIZE_TOOLS) over tests that
#             run every kernel of the engine on the device (match, table preparation, fused scoring, top-K;
#             SANITIZE_TESTS): shared-memory races, reads of device memory nobody wrote, out-of-bounds
#             accesses, barriers not every thread reaches; exit 99 on the first error
# A call of the device tool brings back at most 8 files from its $OUT: with PACK=FILE every result of
# this run is also packed into that one file at the end (e.g. OUT=/tmp/o PACK=$OUT/results.tgz).
set -uo pipefail
OUT=${OUT:-out/device}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
A="python3 -W ignore cli.py"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(tests)
[ "${stages[0]}" = all ] && stages=(tests match pipeline compare demo)
# The machine's copy of the tree comes with the repository as it was when the checkout was made: with
# BUNDLE=FILE (a `git bundle` of the commits since, ending at the branch `main`, carried along), its
# HEAD is moved to the tree's own commit first, so every result records the commit it was made from
# and, when the tree is that commit's, git_dirty false.
if [ -n "${BUNDLE:-}" ]; then
  git fetch -q "$BUNDLE" main:refs/heads/measured 2>&1 && git reset -q measured 2>&1 \
    || echo "BUNDLE=$BUNDLE: could not move HEAD to the bundle's main"
fi
{
  nvidia-smi -L; git log --oneline -1 2>/dev/null; git status --porcelain 2>/dev/null | head -5
  python3 -c "import numpy, numba, numba_cuda, pyarrow; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'pyarrow', pyarrow.__version__)"
} 2>&1 | tee "$OUT/env.txt"
corpus_1m() {  # the generated 1M-ad corpus of a precision (64 requests, 2,000 updates), made once a machine
  local data=/tmp/c1000000$([ "$1" = fp32 ] || echo "_$1")
  [ -d $data ] || timeout 300 $A generate --ads 1000000 --requests 64 --seed 1 --workers 15 --updates 2000 \
    --precision $1 --out $data --quiet > /dev/null
  echo $data
}
data_corpus() {  # the generated corpus of distinct ads of `datapipe` (fp16, seed 3), made once a machine
  local ads=$1 data=/tmp/d$1
  if [ ! -d $data ]; then
    local g0=$(date +%s)
    timeout ${GENERATE_TIMEOUT:-300} $A generate --ads $ads --requests ${DATA_REQUESTS:-256} --seed 3 --precision fp16 \
      --workers 15 --out $data --quiet > /dev/null
    echo "generated $ads distinct ads in $(( $(date +%s) - g0 )) s" >&2
  fi
  echo $data
}
for stage in "${stages[@]}"; do
  t0=$(date +%s)
  case "$stage" in
    tests)
      ANDROMEDA_TEST_GPU=1 timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -W ignore ${TESTS_JOBS:+-n $TESTS_JOBS} \
        ${TESTS_FILES:-tests/gpu/test_gpu_index.py tests/migration/test_colocated.py tests/gpu/test_topk.py tests/gpu/test_score_kernels.py \
        tests/gpu/test_score_mma.py tests/cpu_baseline/test_candidates.py tests/core/test_deep_specs.py tests/core/test_unfused.py tests/gpu/test_remote_gpu.py tests/benchmarks/test_tiled.py tests/core/test_geo_layout.py tests/gpu/test_graphs.py tests/gpu/test_host_prepare.py} 2>&1 \
        | tail -15 | tee "$OUT/gpu_tests.txt" ;;
    match)
      timeout ${MATCH_TIMEOUT:-400} $A bench match --ads 10000000,100000000 --kernel-versions ${MATCH_VERSIONS:-6,7,8} \
        --batches 64,256 --no-measure-updates --cpu-ads 0 --out-file "$OUT/bench_match.json" > "$OUT/bench_match.log" 2>&1
      echo "match rc=$?"; grep -E "G pool ads/s|check passed|registers" "$OUT/bench_match.log" | cut -c1-200 ;;
    pipeline)
      timeout ${PIPELINE_TIMEOUT:-200} $A bench pipeline ${PIPELINE_ARGS:-} --out-file "$OUT/pipeline${PIPELINE_TAG:-}.json" \
        > "$OUT/pipeline${PIPELINE_TAG:-}.log" 2>&1
      echo "pipeline rc=$?"; tail -13 "$OUT/pipeline${PIPELINE_TAG:-}.log" ;;
    datapipe)
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      timeout ${DATAPIPE_TIMEOUT:-400} $A bench pipeline --data $data ${DATAPIPE_ARGS:-} --out-file "$OUT/pipeline_data_$ads.json" \
        > "$OUT/pipeline_data_$ads.log" 2>&1
      echo "datapipe rc=$?"; tail -16 "$OUT/pipeline_data_$ads.log" ;;
    distinct100m)
      ads=${DISTINCT_ADS:-10000000}; copies=${DISTINCT_COPIES:-10}; data=$(data_corpus $ads); name=pipeline_copies_${ads}x$copies
      timeout ${DISTINCT_TIMEOUT:-480} $A bench pipeline --data $data --copies $copies --batches 1,64 --launches graph \
        --check-requests ${DISTINCT_CHECK_REQUESTS:-8} ${DISTINCT_ARGS:-} --out-file "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "distinct100m rc=$?"
      grep -E "^copies: [0-9]|copies made|eligible share|latency per|batch   1|batch  64|^target|checked|Error|error" \
        "$OUT/$name.log" | cut -c1-240 | head -24 ;;
    startup)
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      for run in 1 2; do
        timeout ${STARTUP_TIMEOUT:-200} python3 scripts/time_startup.py --data $data --device gpu \
          --out "$OUT/startup_${ads}_$run.json" > "$OUT/startup_${ads}_$run.log" 2>&1
        echo "startup run $run rc=$?"; tail -3 "$OUT/startup_${ads}_$run.log"
      done ;;
    lone)
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      timeout ${LONE_TIMEOUT:-200} python3 scripts/probe_engine_batch.py --data $data --batches 1,64 --repeat 30 \
        --out "$OUT/lone_stages_$ads.json" > "$OUT/lone_stages_$ads.log" 2>&1
      echo "lone stages rc=$?"; grep -iE "ms|batch" "$OUT/lone_stages_$ads.log" | head -30
      timeout ${LONE_NCU_TIMEOUT:-240} ncu -k "regex:match_v|score_|topk|prep_tables|table_bits" --launch-skip ${LONE_NCU_SKIP:-42} \
        --launch-count ${LONE_NCU_COUNT:-14} \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        python3 scripts/probe_engine_batch.py --data $data --batches ${LONE_NCU_BATCH:-1} --repeat 5 > "$OUT/lone_ncu_$ads.txt" 2>&1
      echo "lone ncu rc=$?"; grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|Compute \(SM\)|Registers Per|Achieved Occ|Grid Size|Block Size" \
        "$OUT/lone_ncu_$ads.txt" | head -80 ;;
    engines)  # ENGINES_MPS=1: the engine workers share the GPU through an MPS daemon this stage starts and stops
      tag=""
      if [ "${ENGINES_MPS:-0}" = 1 ]; then
        tag=_mps; export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
        nvidia-cuda-mps-control -d; echo "mps daemon rc=$?"
        python3 -c "from numba import cuda; cuda.current_context(); print('mps context ok')" 2>&1 | tail -1
      fi
      for ads in ${ENGINES_ADS:-1000000 10000000}; do
        if [ "$ads" = 1000000 ]; then data=$(corpus_1m fp16); else data=$(data_corpus $ads); fi
        formats=""; for f in ${SERVED_FORMATS:-json}; do formats="$formats --request-format $f"; done
        for v in ${SERVED_VIAS:-front}; do formats="$formats --via $v"; done
        for o in ${SERVED_OVERLAPS:-off}; do formats="$formats --overlap $o"; done
        formats="$formats --fronts ${SERVED_FRONTS:-0}"
        timeout ${ENGINES_TIMEOUT:-280} $A bench served --data $data --device gpu --engines ${ENGINES:-1,4} --clients 32 \
          --client-processes ${SERVED_PROCS:-8} --seconds ${SERVED_SECONDS:-5} --exchange stream --repeat ${SERVED_REPEAT:-2} $formats \
          --out-file "$OUT/served_engines_$ads$tag.json" > "$OUT/served_engines_$ads$tag.log" 2>&1
        echo "engines $ads$tag rc=$?"; grep -E "in process, batches of 64|engines-|^stream|target" "$OUT/served_engines_$ads$tag.log" | tail -6
      done
      if [ -n "$tag" ]; then echo quit | nvidia-cuda-mps-control; tail -5 /tmp/mps-log/control.log 2>/dev/null
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi ;;
    servedsteps)  # what overlapped batches and fronts give one engine at 10M, in one run
      ANDROMEDA_TEST_GPU=1 timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider -W ignore \
        tests/gpu/test_engine_steps.py tests/serving/test_overlap.py tests/serving/test_lane_engine.py 2>&1 \
        | tail -4 | tee "$OUT/gpu_tests_steps.txt"
      ENGINES=1 ENGINES_ADS=${DATA_ADS:-10000000} SERVED_OVERLAPS="off on" SERVED_FRONTS="0,4" SERVED_PROCS=8 \
        SERVED_REPEAT=1 ENGINES_TIMEOUT=${ENGINES_TIMEOUT:-400} OUT="$OUT" BUNDLE= PACK= bash "$0" engines ;;
    enginesweep)  # the served path on the 10M corpus by engine count and decoding ahead or not, one run
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      timeout ${SWEEP_TIMEOUT:-440} python3 -m benchmarks.served --data $data --device gpu --engines ${SWEEP_ENGINES:-2,3,4} \
        --clients 32 --client-processes ${SERVED_PROCS:-8} --seconds ${SERVED_SECONDS:-5} --exchange stream \
        --decode-ahead ${SWEEP_AHEAD:-off,on} --gpu-turn ${SWEEP_TURN:-off} --repeat 2 --out "$OUT/served_sweep_$ads.json" > "$OUT/served_sweep_$ads.log" 2>&1
      echo "engine sweep rc=$?"; grep -vE "^\s*$" "$OUT/served_sweep_$ads.log" | tail -16 | cut -c1-220 ;;
    batchedpeer)  # the batched, eligibility-masked PyTorch peer beside the shipped kernels, a batch of the 10M corpus
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      timeout ${PEER_TIMEOUT:-240} python3 scripts/probe_batched_peer.py --data $data --requests ${PEER_REQUESTS:-64} \
        --out "$OUT/batched_peer_$ads.json" > "$OUT/batched_peer_$ads.log" 2>&1
      echo "batched peer rc=$?"; tail -12 "$OUT/batched_peer_$ads.log" | cut -c1-240 ;;
    lonelab)
      ads=${DATA_ADS:-10000000}; data=$(data_corpus $ads)
      if [ "${LONELAB_TOPK:-1}" = 1 ]; then
        timeout 120 python3 scripts/probe_topk_segments.py --versions ${TOPK_VERSIONS:-2,3} \
          --segment-lens ${TOPK_SEGMENT_LENS:-16384,4096} --out "$OUT/topk_segments.json" > "$OUT/topk_segments.log" 2>&1
        echo "topk segments rc=$?"; grep -E '^\{"version' "$OUT/topk_segments.log" | cut -c1-200
      fi
      for v in ${LONELAB_VERSIONS:-8 9 10}; do
        case $v in m*) pick="--match-version ${v#m}" ;; *) pick="--kernel-version $v" ;; esac
        timeout ${LONELAB_TIMEOUT:-200} $A bench pipeline --data $data $pick --batches 1,64 --launches graph \
          --check-requests 8 --out-file "$OUT/pipeline_lone_v$v.json" > "$OUT/pipeline_lone_v$v.log" 2>&1
        echo "v$v rc=$?"; grep -E "latency|batch   1|batch  64|target p50|checked" "$OUT/pipeline_lone_v$v.log" | head -8
      done ;;
    compare)
      timeout 200 $A generate --ads 1000000 --requests ${COMPARE_REQUESTS:-64} --seed 1 --workers 14 \
        --updates ${COMPARE_UPDATES:-2000} --out /tmp/c1m --quiet | tee "$OUT/generate_1m.txt"
      timeout ${COMPARE_TIMEOUT:-400} $A compare --data /tmp/c1m --device gpu --updates-file /tmp/c1m/updates.jsonl --json --quiet \
        ${COMPARE_ARGS:-} > "$OUT/compare_1m_gpu${COMPARE_TAG:-}.json" 2> "$OUT/compare_1m_gpu${COMPARE_TAG:-}.err"; echo "compare rc=$?"
      tail -c 600 "$OUT/compare_1m_gpu${COMPARE_TAG:-}.json"; tail -3 "$OUT/compare_1m_gpu${COMPARE_TAG:-}.err" ;;
    score)
      timeout ${SCORE_TIMEOUT:-300} $A bench score --dims ${SCORE_DIMS:-64,128} --precision fp16 --precision int8 --kernel-versions ${SCORE_VERSIONS:-4,6} --eligible ${SCORE_ELIGIBLE:-1} \
        --out-file "$OUT/bench_score.json" > "$OUT/bench_score.log" 2>&1
      echo "score rc=$?"; grep -E "G ads/s|peer|copy" "$OUT/bench_score.log" | cut -c1-200 | tail -20
      timeout 120 ncu --clock-control none --kernel-name regex:score_ --launch-skip 2 --launch-count 1 \
        python3 scripts/probe_score_mma.py --version ${NCU_VERSION:-6} --ads 16777216 > "$OUT/ncu_score_v${NCU_VERSION:-6}.txt" 2>&1
      echo "ncu rc=$?"; grep -E "DRAM Throughput|Memory Throughput|Issue Slots|Registers Per|Achieved Occupancy|Theoretical Occupancy" "$OUT/ncu_score_v${NCU_VERSION:-6}.txt" | head ;;
    corpus)
      ads=${CORPUS_ADS:-10000000}
      timeout ${GENERATE_TIMEOUT:-560} $A generate --ads $ads --requests ${CORPUS_REQUESTS:-32} --seed 1 --workers 15 \
        --updates 2000 --out /tmp/c$ads --quiet > "$OUT/generate_$ads.txt" 2>&1; echo "generate $ads rc=$?"
      tail -3 "$OUT/generate_$ads.txt"; du -sh /tmp/c$ads ;;
    threeway)
      ads=${THREEWAY_ADS:-1000000}; data=/tmp/c$ads
      [ -f $data/updates.jsonl ] || { timeout ${GENERATE_TIMEOUT:-300} $A generate --ads $ads --requests ${THREEWAY_REQUESTS:-64} \
        --seed 1 --workers 15 --updates 2000 --out $data --quiet > "$OUT/generate_$ads.txt" 2>&1; echo "generate $ads rc=$?"; }
      for latency in ${THREEWAY_LINKS:-0 100}; do
        extra=$([ "$latency" = 0 ] || echo "--link-latency-us $latency --link-gbps 25")
        timeout ${THREEWAY_TIMEOUT:-280} $A compare --data $data --device gpu --scorer-devices cpu,gpu \
          --updates-file $data/updates.jsonl --oracle-requests ${THREEWAY_ORACLE:-8} $extra --json \
          > "$OUT/threeway_${ads}_link$latency.json" 2> "$OUT/threeway_${ads}_link$latency.err"
        echo "threeway $ads link $latency rc=$?"; tail -c 700 "$OUT/threeway_${ads}_link$latency.json"; echo
        tail -2 "$OUT/threeway_${ads}_link$latency.err"
      done ;;
    shards)
      ads=${SHARDS_ADS:-1000000}; data=/tmp/c$ads
      [ -d $data ] || timeout 300 $A generate --ads $ads --requests 64 --seed 1 --workers 15 --updates 2000 --out $data --quiet > /dev/null
      timeout ${SHARDS_TIMEOUT:-300} python3 -m benchmarks.cluster --data $data --device gpu --placement processes \
        --shards ${SHARDS:-1,2,4} ${SHARDS_ARGS:-} --out "$OUT/shards_${ads}_gpu.json" 2>&1 | tail -14 ;;
    tiled)
      timeout ${TILED_TIMEOUT:-500} python3 -W ignore -m benchmarks.cluster --tiled ${TILED_COPIES:-12208} --device gpu \
        --shards ${TILED_SHARDS:-1,2} ${TILED_ARGS:-} --out "$OUT/tiled_${TILED_COPIES:-12208}_gpu.json" 2>&1 | tail -16 ;;
    ray)
      python3 -c "import ray" 2>/dev/null || { echo "ray: not importable here; make the wheels with scripts/device_wheels.sh, carry .whl and install them first"; continue; }
      ads=${RAY_ADS:-1000000}; data=/tmp/c$ads
      [ -d $data ] || timeout 300 $A generate --ads $ads --requests 64 --seed 1 --workers 15 --updates 2000 --out $data --quiet > /dev/null
      RAY_AUTH_MODE=disabled timeout ${RAY_TIMEOUT:-400} python3 -m benchmarks.cluster --data $data --device gpu --placement ray \
        --shards ${RAY_SHARDS:-1,2} --out "$OUT/ray_${ads}_gpu.json" 2>&1 | grep -v "Warning\|warn(" | tail -20 ;;
    sharded)
      python3 -c "import ray" 2>/dev/null || { echo "sharded: ray not importable here; make the wheels with scripts/device_wheels.sh, carry .whl and install them first"; continue; }
      ads=${SHARDED_ADS:-10000000}; data=/tmp/c$ads
      [ -f $data/updates.jsonl ] || timeout ${GENERATE_TIMEOUT:-300} $A generate --ads $ads --requests 32 --seed 1 --workers 15 \
        --updates 2000 --out $data --quiet > /dev/null
      n=$(nvidia-smi -L | wc -l); [ "$n" -lt 2 ] && n=2
      RAY_AUTH_MODE=disabled timeout ${SHARDED_TIMEOUT:-500} python3 -W ignore scripts/check_sharded.py --data $data \
        --shards ${SHARDED_SHARDS:-$n} --device gpu --updates $data/updates.jsonl --out "$OUT/sharded_${ads}_gpu.json" \
        2>&1 | grep -v "Warning\|warn(" | tail -6 ;;
    clusterserved)  # 39.3: `serve cluster` (Ray, replicas sharing the one GPU) beside `serve colocated`, one run
      if ! python3 -c "import ray" 2>/dev/null; then
        if ls .whl/*.whl >/dev/null 2>&1; then  # the wheels of scripts/device_wheels.sh, carried along
          python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
          export PATH=/tmp/site/bin:$PATH PYTHONPATH=$PYTHONPATH:/tmp/site
        fi
        python3 -c "import ray" 2>/dev/null || { echo "clusterserved: ray not importable; carry .whl (scripts/device_wheels.sh)"; continue; }
      fi
      for ads in ${CLUSTER_SERVED_ADS:-1000000}; do
        if [ "$ads" = 1000000 ]; then data=$(corpus_1m fp16); else data=$(data_corpus $ads); fi
        RAY_AUTH_MODE=disabled timeout ${CLUSTER_SERVED_TIMEOUT:-400} $A bench served --data $data --device gpu \
          --engines ${CLUSTER_SERVED_ENGINES:-1} --cluster ${CLUSTER_SERVED_SPECS:-1x1} --cluster ${CLUSTER_SERVED_SPECS2:-1x4} \
          --clients 32 --client-processes ${SERVED_PROCS:-8} --seconds ${SERVED_SECONDS:-5} --exchange stream --repeat 2 \
          --out-file "$OUT/served_cluster_$ads.json" > "$OUT/served_cluster_$ads.log" 2>&1
        echo "cluster served $ads rc=$?"; grep -E "in process, batches of 64|served|target" "$OUT/served_cluster_$ads.log" | tail -8 | cut -c1-260
      done ;;
    stall)
      timeout ${STALL_TIMEOUT:-300} python3 scripts/bench_update_stall.py --device gpu --cpu-shares ${STALL_SHARES:-1,0.5} ${STALL_ARGS:-} \
        --out "$OUT/update_stall_gpu.json" 2>&1 | grep -E "idle p99|Error" | cut -c1-240 ;;
    served)
      precision=${SERVED_PRECISION:-fp16}; data=$(corpus_1m $precision)
      for procs in ${SERVED_PROCS:-1 4}; do
        timeout ${SERVED_TIMEOUT:-150} python3 scripts/bench_served.py --data $data --device gpu --clients 32 \
          --client-processes $procs --seconds ${SERVED_SECONDS:-15} --exchange ${SERVED_EXCHANGE:-call,stream} ${SERVED_ARGS:-} \
          --out "$OUT/served_1m_gpu_p$procs${SERVED_TAG:-}.json" 2>&1 | tail -3
      done
      if [ -d "$OUT/spy" ]; then  # --profile DIR in SERVED_ARGS: summaries here, the raw stacks as one file
        for f in "$OUT"/spy/*.txt; do echo "-- $f"; python3 scripts/spy_summary.py "$f" --top 8 | head -70; done
        tar czf "$OUT/spy${SERVED_TAG:-}.tgz" -C "$OUT" spy && rm -rf "$OUT/spy"
      fi
      for ex in ${SERVED_CEILING-call stream}; do
        timeout 120 python3 scripts/probe_served_ceiling.py --data $data --clients 32 --client-processes 4 \
          --seconds ${SERVED_SECONDS:-15} --exchange $ex --out "$OUT/served_ceiling_1m_$ex.json" 2>&1 | tail -1
      done ;;
    engine)
      for precision in ${ENGINE_PRECISIONS:-fp16 fp32}; do
        data=$(corpus_1m $precision)
        timeout ${ENGINE_TIMEOUT:-200} python3 scripts/probe_engine_batch.py --data $data --batches ${ENGINE_BATCHES:-1,16,32,64} \
          --out "$OUT/engine_1m_$precision.json" 2>&1 | grep -E "^batch|wait|synchron|retrieve|encode|user_side|prepare" | cut -c1-200 | head -40
      done ;;
    profile)
      for R in 1 64; do
        timeout ${PROFILE_TIMEOUT:-150} ncu --clock-control none --section SpeedOfLight --section Occupancy \
          --section LaunchStats --kernel-name regex:"score|topk|prep" --launch-skip 4 --launch-count 4 \
          python3 scripts/probe_score_mma.py --version ${PROFILE_VERSION:-7} --ads 10485760 --launches 2 --topk \
          --eligible ${PROFILE_ELIGIBLE:-0.08} --requests $R > "$OUT/ncu_pipeline_r$R.txt" 2>&1
        echo "ncu requests $R rc=$?"
        grep -E "^  [a-z_0-9]+.*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Grid Size" \
          "$OUT/ncu_pipeline_r$R.txt" | cut -c1-150 | head -40
      done ;;
    host)
      lscpu 2>/dev/null | grep -E "^Model name|^CPU\(s\)|^Thread|^Core|^Socket|MHz" | tee "$OUT/lscpu.txt"
      data=${HOST_DATA:-/tmp/c200000}
      [ -d $data ] || timeout 200 $A generate --ads 200000 --requests 64 --seed 1 --workers 15 --out $data --quiet > /dev/null
      for threads in default 1; do
        ( [ $threads = default ] || export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
          timeout 200 python3 scripts/time_host_side.py --data $data --out "$OUT/host_side_threads_$threads.json" ) \
          | python3 -c "import json,sys; d=json.loads(sys.stdin.read().splitlines()[-1]); print('$threads', {k: round(v, 3) for k, v in d['ms'].items()}, d['blas'])"
      done
      timeout 200 python3 scripts/time_request_decode.py --data $data --out "$OUT/request_decode.json" ;;
    demo)
      timeout ${DEMO_TIMEOUT:-240} $A demo --json --quiet > "$OUT/demo_gpu.json" 2>&1; echo "demo rc=$?"
      tail -c 400 "$OUT/demo_gpu.json"; echo
      timeout 120 $A quality --small --json --quiet > "$OUT/quality_small_gpu.json" 2>&1; echo "quality rc=$?"
      python3 -c "import json; d=json.loads(open('$OUT/quality_small_gpu.json').read().splitlines()[-1]); print(d.get('kernel'))" 2>&1 | tail -3 ;;
    sanitize)
      for tool in ${SANITIZE_TOOLS:-racecheck initcheck memcheck synccheck}; do
        ANDROMEDA_TEST_GPU=1 timeout ${SANITIZE_TIMEOUT:-150} compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
          python3 -m pytest -q -x -p no:cacheprovider -W ignore ${SANITIZE_TESTS:-tests/gpu/test_host_prepare.py::test_engine_overlaps_preparation_and_synchronizes_once_per_batch tests/core/test_geo_layout.py::test_the_gpu_engine_laid_out_by_geography_answers_as_the_reference_through_updates} \
          > "$OUT/sanitize_$tool.log" 2>&1
        echo "sanitize $tool rc=$?"; grep -E "ERROR SUMMARY|passed|failed|Error" "$OUT/sanitize_$tool.log" | head -5
      done ;;
    *) echo "unknown stage: $stage (tests, match, pipeline, compare, score, corpus, threeway, shards, ray, stall, served, profile, host, demo, sanitize, all)"; exit 2 ;;
  esac
  echo "== $stage: $(( $(date +%s) - t0 )) s"
done
if [ -n "${PACK:-}" ]; then tar czf "$PACK" -C "$OUT" . && echo "packed $OUT into $PACK"; fi
