#!/usr/bin/env bash
# What only a GPU can show, in stages that each fit a 10-minute command and leave their output in
# OUT even when stopped at their limit (every stage runs under `timeout`, and the benchmarks write
# as they go). From the project root, with autotune importable (installed, or on PYTHONPATH):
#
#   bash benchmarks/gpu_check.sh OUT suite     # tests/gpu but workers, pairs and the knobs' compile tests, cut at 490 s in all (each part killed 10 s after its stop); log, JUnit XML
#   bash benchmarks/gpu_check.sh OUT workers   # tests/gpu's CLI runs on CUDA (--gpus, verify, fork launcher), 560 s
#   bash benchmarks/gpu_check.sh OUT compile   # tests/gpu's compile tests, cut at 560 s
#   bash benchmarks/gpu_check.sh OUT pairs     # tests/gpu's pair test (every pair of each family's space), 560 s
#   bash benchmarks/gpu_check.sh OUT memory    # gpu_memory.py, SDXL 1024x1024, 10 steps, cut at 540 s
#   bash benchmarks/gpu_check.sh OUT tune      # SDXL random weights, 12GB, uncompiled seeds, then verify
#   bash benchmarks/gpu_check.sh OUT versus    # versus_hand_tuning --quick on CUDA (tiny-sd15), cut at 540 s
#
# Not yet run on a GPU: the limits are what a 10-minute command allows, not measured durations.
# `tune` stops short of the compiled seeds: a cold max-autotune compile of SDXL's UNet took over
# 180 s on an H100. The full comparison (#8) needs a longer visit: versus_hand_tuning.py --device cuda.
set -u -o pipefail  # a stage's exit is its pytest's or autotune's, not tee's
usage="usage: gpu_check.sh OUT suite|workers|compile|pairs|memory|tune|versus"
out=${1:?$usage}
stage=${2:?$usage}
mkdir -p "$out"
py=${PYTHON:-python3}
# autotune from this checkout, also where a test or a script starts Python elsewhere (a test's CLI
# run in its own folder, `python benchmarks/X.py`), when it is not installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# no network there: a hub call that slipped in fails at once instead of waiting on its retries
export HF_HUB_OFFLINE=1

# What the stages need beyond torch; a missing one is named here, not minutes into a stage.
# Checked from another folder: Python puts the current one on the path, where autotune is.
(cd /tmp && $py -) <<'PY' || exit 1
import importlib.util, sys  # importlib alone does not load util on Python 3.12 (helper-17)
missing = [m for m in ("torch", "diffusers", "optuna", "torchao", "pynvml", "skimage", "xdist", "pytest_timeout",
                      "autotune") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: not importable here: {', '.join(missing)}")
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs {torch.cuda.device_count()}")
if not torch.cuda.is_available():  # else tests/gpu skips every test, and the stage passes having shown nothing
    sys.exit("gpu_check: torch sees no CUDA GPU here")
PY

case $stage in
suite)
    # The memory tests one at a time: where the driver lists no process (a container without the
    # host's PID namespace) NVML's figure is the whole device's, which parallel tests would move.
    timeout -k 10 -s INT 250 $py -m pytest tests/gpu/test_cuda.py -q -rsP --timeout 200 --durations 10 \
        --junitxml "$out/gpu-tests-serial.xml" -p no:cacheprovider 2>&1 | tee "$out/gpu-tests.log"
    serial=$?
    timeout -k 10 -s INT 240 $py -m pytest tests/gpu/test_knobs_gpu.py -k "not compile and not every_pair" -q -rsP \
        -n 6 --dist worksteal --timeout 220 --durations 20 --junitxml "$out/gpu-tests.xml" -p no:cacheprovider \
        2>&1 | tee -a "$out/gpu-tests.log"
    parallel=$?
    [ "$serial" -ne 0 ] && exit "$serial"
    exit "$parallel"
    ;;
workers)
    # apart: four whole CLI studies, each trial a fresh interpreter importing torch and diffusers;
    # serial, as the memory tests above
    timeout -k 20 -s INT 560 $py -m pytest tests/gpu/test_gpu_workers.py -q -rsP --timeout 300 --durations 10 \
        --junitxml "$out/gpu-tests-workers.xml" -p no:cacheprovider 2>&1 | tee "$out/gpu-tests-workers.log"
    ;;
compile|pairs)
    # apart: each holds tests of minutes (cold compiles; several hundred configs per family)
    [ "$stage" = compile ] && select="compile" || select="every_pair"
    timeout -k 20 -s INT 560 $py -m pytest tests/gpu/test_knobs_gpu.py -k "$select" -q -rsP -n 6 --dist worksteal \
        --timeout 540 --durations 20 --junitxml "$out/gpu-tests-$stage.xml" -p no:cacheprovider \
        2>&1 | tee "$out/gpu-tests-$stage.log"
    ;;
memory)
    timeout -k 20 -s INT 540 $py benchmarks/gpu_memory.py --steps 10 --trial-timeout 150 --out "$out"
    ;;
tune)
    # the baseline and the three uncompiled SDXL seeds; then the profile replayed as production loads it.
    # --timeout counts from the end of the set-up's two reference runs (float32, bfloat16): each of
    # those and of the trials is cut at 100 s and no trial starts after 100 s more, so the study
    # ends, its profile written, about 400 s after the set-up's own loading, before the stage's kill
    # (not yet run: the loading of SDXL's random weights is not measured on a GPU).
    timeout -k 20 -s INT 420 $py -m autotune --model sdxl --random-weights --vram 12GB --steps 10 --trials 4 \
        --confirm 0 --trial-timeout 100 --timeout 100 --workdir "$out/work" -o "$out/sdxl-12GB.yaml" \
        2>&1 | tee "$out/tune.log"
    status=$?
    if [ -f "$out/sdxl-12GB.yaml" ]; then
        timeout -k 20 -s INT 130 $py -m autotune verify "$out/sdxl-12GB.yaml" --trial-timeout 120 \
            2>&1 | tee "$out/verify.log"
        verified=$?
        [ "$status" -eq 0 ] && status=$verified
    fi
    rm -rf "$out/work/trials" "$out/work/compile-cache"  # images and caches: too large to bring back
    exit "$status"
    ;;
versus)
    timeout -k 20 -s INT 540 $py benchmarks/versus_hand_tuning.py --device cuda --quick --paired-rounds 0 \
        --trial-timeout 120 --workdir /tmp/vht-quick --out "$out" --name cuda-quick
    ;;
*)
    echo "gpu_check: unknown stage $stage ($usage)" >&2
    exit 2
    ;;
esac
