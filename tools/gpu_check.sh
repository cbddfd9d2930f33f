#!/usr/bin/env bash
# The GPU checks as one prepared script, for a session that is lent a GPU machine (the `device` tool).
#
#   here:  bash tools/gpu_check.sh fetch    # wheels of what the GPU image lacks -> .whl/ (in .gitignore)
#   there: device run, carry ['.whl'], timeout_s 480:  bash tools/gpu_check.sh run
#
# `run` installs the wheels (the machine has torch, torchvision, sklearn, pandas... but no fastai and cannot download),
# then, each stage with its own limit and all of them TOTAL seconds (420: a hang costs its stage, not the lease):
# - nbdev_test --flags cuda over the notebooks whose `#| cuda` cells test the GPU paths: 01c_op_policy (the autocast
#   window, CUDA's fp32 list, fp16/bf16 fits), 02b_device_skip (the skip decided on the device, bit for bit as read on the
#   host, fp16 and bf16 and split), 03_learner (fits; syncs by who makes them: ours one an epoch), 09b_masters and 09bb_lean_step (lean
#   masters under CUDA's fused kernel: split bit for bit with fp32 masters, the lean step's ops); their other cells are
#   CPU-pinned;
# - lean: tools/gpu_lean.py, resnet50 224 bs 64 channels_last under `to_half('bf16')` and each `masters=`: step ms, and
#   the torch ops and CUDA kernels from the end of the backward to the end of the step; then a lean fit of a model with
#   a checkpointed block and an autocast-off region (gpu-audit-s10 row 2);
# - bench: the end-to-end variants (fp32, TF32, fastai's fp16, ours fp16 and bf16) and the per-batch overhead; the
#   optimizer-side overhead table is off (`--overhead False`: it times helpers no fit uses since the params became
#   their own masters);
# - compare on the embedded digits data (the precision ladder, lean masters included).
# Imagenette cells (`#| cuda #| slow`) are not run: that machine cannot download the data. It leaves at most 8 files in
# $OUT. A CPU dry run (the command at the end of this file) runs every stage at its smallest; its times say nothing of a GPU's.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="apsw==3.54.1.0 apswutils==0.1.2 asttokens==3.0.1 astunparse==1.6.3 backcall==0.2.0 beartype==0.23.1
beautifulsoup4==4.15.0 decorator==5.2.1 execnb==0.1.18 executing==2.2.1 fastai==2.8.7 fastcore==1.14.5 fastdownload==0.0.8
fastgit==0.1.4 fastlite==0.2.4 fastprogress==1.1.6 fastspec==0.1.0 fasttransform==0.0.2 ghapi==2.0.3 httpcore2==2.16.2
httpx2==2.16.2 ipython==8.12.3 itsdangerous==2.2.0 jedi==0.20.0 matplotlib-inline==0.2.2 nbdev==2.4.14 oauthlib==4.0.1
parso==0.8.7 pexpect==4.8.0 pickleshare==0.7.5 plum-dispatch==2.9.0 prompt-toolkit==3.0.52 ptyprocess==0.7.0
pure-eval==0.2.3 python-fasthtml==0.14.5 python-multipart==0.0.34 soupsieve==4.1.3 stack-data==0.6.3 starlette==1.10.0
traitlets==5.15.0 truststore==0.10.5 uvicorn==0.54.0 watchdog==7.1.0 wcwidth==0.7.0"

case "${1:-}" in
fetch)
  mkdir -p .whl
  for w in $WHEELS; do  # the GPU image runs CPython 3.12 on x86-64
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$w" || { echo "could not fetch $w"; exit 1; }
  done
  du -sh .whl ;;
run)  # DEVICE, NBS, LEAN, BENCH and COMPARE override the defaults (a CPU dry run of this script: see the end of this file)
  : "${OUT:=/tmp/gpu_check}" "${DEVICE:=cuda}" "${SITE:=/tmp/site}" "${TOTAL:=420}" "${SLOW:=$([ "$DEVICE" = cpu ] && echo 2 || echo 1)}"
  : "${BENCH:=--arch resnet50 --size 224 --bs 64 --steps 12 --warmup 3 --rounds 3 --overhead False}" "${COMPARE:=}"
  : "${LEAN:=--arch resnet50 --size 224 --bs 64 --steps 20 --warmup 5}" "${NBS:=01c_op_policy 02b_device_skip 03_learner 09b_masters 09bb_lean_step}"
  mkdir -p "$OUT"; : > "$OUT/log.txt"
  export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
  FF=(python3 -c 'import sys; from fastai_fp16.tools.cli import main; sys.exit(main(sys.argv[1:]))')
  rc=0 deadline=$((SECONDS + TOTAL)) times=""
  stage() {  # stage NAME LIMIT_S FILE CMD...: CMD with its output in FILE, ended at LIMIT_S (x SLOW) or at the run's deadline
    local name=$1 lim=$(($2 * SLOW)) file=$3 t0=$SECONDS left=$((deadline - SECONDS)); shift 3
    ((lim > left)) && lim=$left
    if ((lim < 5)); then echo "!! $name: not run, the run's ${TOTAL}s are spent" | tee -a "$OUT/log.txt"; rc=1; times+=" $name=skipped"; return; fi
    echo "== $name (limit ${lim}s)" | tee -a "$OUT/log.txt"
    timeout -k 5 "$lim" "$@" 2>&1 | tee -a "$file"; local s=${PIPESTATUS[0]}
    ((s == 124 || s == 137)) && echo "!! $name: stopped at its ${lim}s limit" | tee -a "$OUT/log.txt"
    echo "== $name: rc=$s, $((SECONDS - t0))s" | tee -a "$OUT/log.txt"; times+=" $name=$((SECONDS - t0))s"
    ((s == 0)) || rc=1
  }
  # limits: what a stage should take on the GPU, with room (a CPU dry run gets SLOW=2 times them); TOTAL caps their sum,
  # so that one run, with the machine's start, fits 7 minutes and leaves the lease room for a second
  stage install 60 "$OUT/log.txt" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
  ((rc == 0)) || { echo "rc=1 (install failed)" | tee -a "$OUT/log.txt"; exit 1; }
  stage versions 30 "$OUT/log.txt" bash -c '! command -v nvidia-smi >/dev/null || nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch, fastai; print(\"torch\", torch.__version__, \"fastai\", fastai.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"'
  for nb in $NBS; do stage "nbdev_test --flags $DEVICE $nb" 60 "$OUT/log.txt" nbdev_test --flags "$DEVICE" --path "nbs/$nb.ipynb"; done
  stage lean 60 "$OUT/lean.md" python3 tools/gpu_lean.py --device "$DEVICE" $LEAN
  stage bench 150 "$OUT/bench.md" "${FF[@]}" bench --device "$DEVICE" $BENCH --json "$OUT/bench.json"
  stage "compare (digits)" 90 "$OUT/log.txt" "${FF[@]}" compare --device "$DEVICE" $COMPARE --out "$OUT/compare"
  echo "stages:$times; total ${SECONDS}s" | tee -a "$OUT/log.txt"
  echo "rc=$rc" | tee -a "$OUT/log.txt"; exit $rc ;;
*) echo "usage: bash tools/gpu_check.sh fetch|run"; exit 2 ;;
esac

# CPU dry run of `run` here, in a Python 3.12 venv that holds what the GPU image holds and nothing else (the image's list
# is in the device tool's KINDS.md): torch==2.11.0 torchvision==0.26.0 numpy pandas matplotlib scikit-learn scipy pillow
# requests pyyaml packaging rich typing-extensions cloudpickle six anyio httpx httpcore h11 idna certifi charset-normalizer
# urllib3 jinja2 markupsafe python-dateutil pygments psutil tqdm click (and their dependencies, less tzdata: not there).
# OUT and SITE (where the wheels go, default /tmp/site) can point elsewhere, so that two checkouts don't share them:
#   PATH=/tmp/venv312/bin:$PATH DEVICE=cpu COMPARE="--epochs 1" BENCH="--arch resnet18 --size 32 --bs 4 --steps 1 \
#     --warmup 1 --overhead False" LEAN="--arch resnet18 --size 32 --bs 4 --steps 2 --warmup 1" bash tools/gpu_check.sh run
