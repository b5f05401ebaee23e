#!/usr/bin/env bash
# The checks a GPU host is lent for, in one run (see docs/performance.md, "CUDA"):
#   the CUDA tests, ../shared/gpu/gpu_checks.py, benchmarks/cuda.py on the gpu_checks batches,
#   then as much of the README's test suite as the time left allows.
#
#   bash benchmarks/gpu_host.sh [SECONDS]     # from the project root; logs under $OUT (or ./gpu-out)
#
# The host's image lacks pyzmq and msgspec: their cp312 wheels travel in .whl/ (`pip download
# --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 pyzmq
# msgspec -d .whl`), gpu_checks.py in .gpu/. Each step has its own limit and the whole run ends
# by SECONDS (default 450), whatever a step does.
set -u -o pipefail
budget=${1:-450}
start=$(date +%s)
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
left() { echo $(( budget - ($(date +%s) - start) )); }
step() {  # step NAME LIMIT CMD...: runs CMD under min(LIMIT, time left), logs to $out/NAME.log
    local name=$1 limit=$2; shift 2
    local t; t=$(left); (( t < limit )) && limit=$t
    if (( limit < 5 )); then echo "== $name: skipped, no time left"; summary+=("$name skipped"); return; fi
    echo "== $name (limit ${limit}s)"
    local t0; t0=$(date +%s)
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    summary+=("$name rc=$rc $(( $(date +%s) - t0 ))s")
}
summary=()
steps=${GPU_STEPS:-native cuda_tests gpu_checks bench_1gib bench_4gib suite}  # a subset: GPU_STEPS="..."
want() { [[ " $steps " == *" $1 "* ]]; }
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/env.log"
python3 -c 'import torch, zmq, msgspec, pyarrow; print("torch", torch.__version__, "cuda", torch.version.cuda, "zmq", zmq.__version__, "msgspec", msgspec.__version__, "pyarrow", pyarrow.__version__)' | tee -a "$out/env.log"
want native && step native 60 python3 setup.py -q build_ext --inplace
want cuda_tests && step cuda_tests 120 python3 -m pytest -q -p no:cacheprovider --timeout 90 tests/client/test_cuda.py tests/client/test_device.py
want gpu_checks && step gpu_checks 150 python3 .gpu/gpu_checks.py
want bench_1gib && step bench_1gib 90 python3 benchmarks/cuda.py --size 1024 --field-mib 1 --repeats 3 --out "$out/b1"
want bench_4gib && step bench_4gib 150 python3 benchmarks/cuda.py --size 256 --field-mib 16 --repeats 3 --out "$out/b4"
want suite && step suite 600 python3 -m pytest -q -p no:cacheprovider --timeout 60
echo "== summary"
printf '%s\n' "${summary[@]}"
grep -h '"check"' "$out/gpu_checks.log" 2>/dev/null | grep -v '"env"'
grep -h 'round trip\|floor' "$out/bench_1gib.log" "$out/bench_4gib.log" 2>/dev/null
tail -n 3 "$out/suite.log" 2>/dev/null
