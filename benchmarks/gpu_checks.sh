#!/usr/bin/env bash
# What a session with a lent GPU runs (issue 19's GPU half; results in docs/benchmarks.md "GPU").
# The GPU machine has torch, transformers and pluggy but cannot reach a registry: zoo's wheels and
# the few pure dependencies it lacks travel in .whl/ (built here with `pip wheel --no-deps`).
#
#   bash benchmarks/gpu_checks.sh bench [--rows bf16:hf,bf16:zoo]   # LLaMA 1B vs HF on the GPU (llama_vs_hf.py)
#   bash benchmarks/gpu_checks.sh checks     # CUDA tests, NCCL probe, `zoo train` of every family
#   bash benchmarks/gpu_checks.sh issues [--batch 64]   # issues 14 and 16's benchmarks on the GPU (DiT vs diffusers,
#                                            # Mamba vs HF), ~3-5 min
#   bash benchmarks/gpu_checks.sh tests [-k cuda_graph]   # tests/test_cuda.py (or some of it) alone
#   bash benchmarks/gpu_checks.sh profile    # where their steps go on the GPU (step_profile.py: host
#                                            # queuing vs device time, top ops by each), ~1 min
#
# The wheels, here: `pip wheel --no-deps --no-build-isolation -w .whl/zoo ./core ./plugins/*/` (then delete
# core/build and plugins/*/build, which pip leaves behind) and `pip download --no-deps -d .whl
# importlib-metadata crc32c braceexpand diffusers` (diffusers for `issues`; pure Python); .whl/ is git-ignored
# and travels with the device tool's `carry: [".whl"]`.
#
# Logs go to $OUT (the device tool's folder) or /tmp/zoo-gpu.
set -u
OUT=${OUT:-/tmp/zoo-gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl .whl/zoo/*.whl || exit 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
python3 - <<'EOF' 2>&1 | tee "$OUT/env.log"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "transformers",
      transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory >> 20, "MiB")
from zoo import backends
print({n: backends.probe(n)[1] for n in backends.BACKENDS})
EOF

bench() {
    python3 benchmarks/llama_vs_hf.py --device cuda --preset 1b --batch 4 --steps 10 --warmup 3 "$@" 2>&1 \
        | tee -a "$OUT/llama_1b.log"
}

checks() {
    # SDPA's kernels for grouped KV heads (enable_gqa) in each dtype: which ones serve it.
    python3 - <<'EOF' 2>&1 | tee "$OUT/sdpa.log"
import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(2, 32, 1024, 64, device="cuda", dtype=dtype)
    k = torch.randn(2, 8, 1024, 64, device="cuda", dtype=dtype)
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel([be]):
                F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True)
            print(dtype, be.name, "serves enable_gqa")
        except RuntimeError as e:
            print(dtype, be.name, "refuses:", str(e).splitlines()[0][:120])
EOF
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -15
    # NCCL with two ranks on the one GPU (what a multi-rank test here would need).
    timeout 120 torchrun --standalone --nproc-per-node 2 benchmarks/nccl_probe.py 2>&1 | tail -4 | tee "$OUT/nccl.log"
    cd "$(mktemp -d)" || return
    for m in llama dit dit-video mixtral mamba2 hybrid clip llava; do
        /usr/bin/time -f "$m: %e s wall" python3 -m zoo train --model $m train.steps=30 train.eval_interval=15 \
            logging.progress=false 2>&1 | tail -3 | tee -a "$OUT/train.log"
    done
    python3 -m zoo generate --checkpoint runs/llama-tiny --prompt "The with statement" 2>&1 | tail -3 | tee -a "$OUT/train.log"
}

issues() {
    python3 benchmarks/dit_vs_diffusers.py --device cuda "$@" 2>&1 | tee "$OUT/dit_vs_diffusers.log"
    # Mamba-2 first (issue 16's 3x is on it); HF's Mamba-1 without kernels is a Python loop over tokens
    # (--quick: 512 and 2,048 only, each process limited to 90 s)
    python3 benchmarks/mamba_vs_hf.py --device cuda --kinds mamba2 2>&1 | grep -v '^\[transformers\]' \
        | tee "$OUT/mamba_vs_hf.log"
    python3 benchmarks/mamba_vs_hf.py --device cuda --kinds mamba --quick 2>&1 | grep -v '^\[transformers\]' \
        | tee -a "$OUT/mamba_vs_hf.log"
}

profile() {
    python3 benchmarks/step_profile.py --device cuda --model mamba2 --seq 2048 --python "$@" 2>&1 \
        | grep -v '^\[transformers\]' | tee "$OUT/profile_mamba2.log"
    python3 benchmarks/step_profile.py --device cuda --model dit --batch 64 --dtype bf16 --python "$@" 2>&1 \
        | tee "$OUT/profile_dit.log"
}

tests() {  # tests/test_cuda.py alone, e.g. `tests -k cuda_graph`
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py "$@" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
}

cmd=${1:-checks}
shift $(( $# > 0 ? 1 : 0 ))
"$cmd" "$@"
