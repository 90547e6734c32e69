#!/usr/bin/env bash
# The device check, sized for 8 minutes on one GPU: installs kvserve into the device's own Python
# without touching its torch, runs the kernel tests compiled (`pytest -m cuda`), then the GPU
# throughput benchmark (benchmarks/gpu_throughput.py), which writes the "GPU throughput" section of
# BENCHMARKS.md (copied to $OUT when set).
#
#   benchmarks/gpu_check.sh --fetch-wheels   # here, online: wheels the device may lack -> build/gpu-wheels
#   benchmarks/gpu_check.sh                  # on the device, with build/gpu-wheels carried along
#
# Budget: install ~30 s, tests <= 180 s (every kernel variant compiles once), benchmark <= 250 s (no
# run starts after 150 s of it).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-build/gpu-wheels}
# import name=distribution, for what kvserve, its kernel tests and the benchmark import
PKGS="numpy=numpy gguf=gguf safetensors=safetensors transformers=transformers tokenizers=tokenizers
      huggingface_hub=huggingface_hub jinja2=Jinja2 markupsafe=MarkupSafe tqdm=tqdm yaml=PyYAML regex=regex
      packaging=packaging filelock=filelock fsspec=fsspec pytest=pytest pluggy=pluggy iniconfig=iniconfig
      httpx2=httpx2 anyio=anyio h11=h11 idna=idna sniffio=sniffio typing_extensions=typing_extensions
      setuptools=setuptools wheel=wheel"

if [ "${1:-}" = "--fetch-wheels" ]; then
    # the versions installed here, as wheels for the device's likely Pythons (PYVERS); the carry
    # limit is 64 MiB, about two Python versions' worth
    mkdir -p "$WHEELS"
    for pair in $PKGS; do
        dist=${pair#*=}
        ver=$($PY -c "import importlib.metadata as m; print(m.version('$dist'))" 2>/dev/null) || continue
        for pv in ${PYVERS:-3.11 3.12}; do
            $PY -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
                --platform manylinux_2_28_x86_64 --python-version "$pv" -d "$WHEELS" "$dist==$ver" \
                || echo "no wheel: $dist==$ver for Python $pv"
        done
    done
    du -sh "$WHEELS"
    exit 0
fi

step() { echo; echo "== $* ($(date -u +%H:%M:%S))"; }

step "device"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(0))" || exit 2
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv,noheader 2>/dev/null

step "install (the device's torch stays)"
missing=()
for pair in $PKGS; do
    $PY -c "import ${pair%%=*}" 2>/dev/null || missing+=("${pair#*=}")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing from $WHEELS: ${missing[*]}"
    $PY -m pip install -q --no-deps --no-index --find-links "$WHEELS" "${missing[@]}" || echo "some wheels missing"
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . || exit 3
$PY -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__)" || exit 4

step "kernel tests, compiled"
timeout 180 $PY -m pytest -q -m cuda tests/test_triton_kernels.py -p no:cacheprovider --durations=8
tests_rc=$?

step "throughput"
timeout 250 $PY benchmarks/gpu_throughput.py --budget-s 150 ${BENCH_ARGS:-}
bench_rc=$?
if [ -n "${OUT:-}" ]; then cp BENCHMARKS.md "$OUT/BENCHMARKS.md"; fi

step "done: tests rc=$tests_rc, benchmark rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))
