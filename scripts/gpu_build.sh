#!/usr/bin/env bash
# Build here (no GPU needed) everything that travels to the GPU machine, into .gpu/ (ignored by
# git): a runtime-only TVM, tvm-ffi and mlc-spec wheels for its Python 3.12, tiny checkpoints, and
# CUDA artifacts. The real models' weights stay here (the carry is 64 MiB at most): their
# artifacts travel without params.safetensors, which scripts/gpu_check.py regenerates there.
# docs/gpu.md says how to run it; about 10 minutes on 2 cores, FlashInfer's kernels included.
set -euo pipefail
cd "$(dirname "$0")/.."
G=.gpu
PY312=${PY312:-python3.12}  # builds mlc-spec's native extensions for the GPU machine's Python
grep -qsx "/$G/" .git/info/exclude || echo "/$G/" >> .git/info/exclude
rm -rf $G && mkdir $G

# TVM's runtime without its compiler library (259 MB unpacked; the runtime does not import it)
SITE=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
tar czf $G/tvm-runtime.tgz -C "$SITE" --exclude=tvm/lib/libtvm_compiler.so \
  --exclude=tvm/3rdparty --exclude=tvm/src --exclude=tvm/web tvm
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d $G \
  "apache-tvm-ffi==$(python -c 'import importlib.metadata as m; print(m.version("apache-tvm-ffi"))')"
"$PY312" -m pip wheel -q --no-deps -w $G .

# Tiny checkpoints in float16: SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim
# 64) for Llama, and a Qwen2 one (biased QKV)
python - <<'EOF'
import sys
from pathlib import Path
sys.path.insert(0, "tests")
from tiny_models import make_tiny_model, save_tiny_checkpoint, tiny_config
for family, name, shape in [
    ("llama", "tiny-llama-hf", dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3)),
    ("qwen2", "tiny-qwen2-hf", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)),
]:
    save_tiny_checkpoint(make_tiny_model(tiny_config(family, **shape)).half(), Path(".gpu") / name)
EOF

# The tiny artifacts share their weights there (copied, or cast to bfloat16)
mlc-spec compile $G/tiny-llama-hf --target cuda --attention tir -o $G/tiny-llama-tir
mlc-spec compile $G/tiny-llama-hf --target cuda --attention flashinfer -o $G/tiny-llama-flashinfer
mlc-spec compile $G/tiny-llama-hf --target cuda --attention tir --dtype bfloat16 \
  -o $G/tiny-llama-tir-bf16
mlc-spec compile $G/tiny-qwen2-hf --target cuda --attention tir -o $G/tiny-qwen2-tir
rm $G/tiny-llama-flashinfer/params.safetensors $G/tiny-llama-tir-bf16/params.safetensors

# The real shapes: float16 with either attention, and the GGUF's own 4/8-bit weights (what
# `mlc-spec compile model.gguf --target cuda` gives by default) with FlashInfer's
SMOLLM2=$(mlc-spec fetch smollm2-135m-instruct)
QWEN=$(mlc-spec fetch qwen2.5-coder-1.5b-instruct)
for model in smollm2 qwen1.5b; do
  source=$([ $model = smollm2 ] && echo "$SMOLLM2" || echo "$QWEN")
  for attention in flashinfer tir; do
    mlc-spec compile "$source" --target cuda --attention $attention --quantization none \
      -o $G/$model-$attention
  done
  mlc-spec compile "$source" --target cuda --attention flashinfer -o $G/$model-gguf-flashinfer
done
for artifact in $G/{smollm2,qwen1.5b}-*; do
  rm $artifact/params.safetensors
  [ $artifact = $G/smollm2-flashinfer ] || rm $artifact/tokenizer.json  # one copy: end to end
done
du -sh $G  # the working tree and this travel together: 64 MiB at most
