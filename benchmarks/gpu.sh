#!/usr/bin/env bash
# Issue 26, item 7: the LoRA-overhead benchmarks on an NVIDIA Linux machine, one command.
#
#     bash benchmarks/gpu.sh [OUT_DIR]        (default benchmarks/results/gpu)
#
# Installs mlx[cuda] into the active environment (or a fresh .venv-gpu beside the repo when none
# is active), then runs, each under a time limit so that the whole stays under 8 minutes:
#   1. the layer profile at SmolLM2-135M's shapes (profile_step.py --parts layers), batch 8/32, rank 8/64;
#   2. decode steps of the real model in process (profile_step.py --parts model), base/one/mixed8/mixed64;
#   3. the real-model serving subset: mola base/one/mixed8/mixed64 at c=8 and c=32, 1 repeat,
#      16 tokens a request (serve.py --model real --systems mola).
# and writes OUT_DIR/gpu.json: the three results and the machine (nvidia-smi, mlx version).
# Needs network for the pip install and the model fetch (mola's cache is reused when present).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/gpu}
mkdir -p "$OUT"
if [ -z "${VIRTUAL_ENV:-}" ]; then
    python3 -m venv .venv-gpu
    . .venv-gpu/bin/activate
fi
pip install -q "mlx[cuda]" -e . 2>&1 | tail -2
python -c "import mlx.core as mx; assert mx.default_device() == mx.gpu, mx.default_device(); print('mlx', mx.__version__, mx.default_device())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" || true

timeout 120 python benchmarks/profile_step.py --parts layers --batch 8 32 --ranks 8 64 --repeats 5 \
    --out "$OUT/profile_layers.json" || echo "layer profile: failed or timed out" >&2
timeout 120 python benchmarks/profile_step.py --parts model --batch 8 32 --ranks 8 --repeats 3 --steps 16 \
    --out "$OUT/profile_model.json" || echo "model profile: failed or timed out" >&2
timeout 240 python benchmarks/serve.py --model real --systems mola --workloads base one mixed8 mixed64 \
    --concurrency 8 32 --repeats 1 --max-tokens 16 --no-hot-load --no-openblas \
    --out "$OUT/serve_real.json" || echo "serving subset: failed or timed out" >&2

python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
import mlx.core as mx
out = Path(sys.argv[1])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None
smi = out / "nvidia-smi.txt"
result = {"mlx": mx.__version__, "device": str(mx.default_device()),
          "gpu": smi.read_text().strip() if smi.is_file() else None,
          "profile_layers": load("profile_layers.json"), "profile_model": load("profile_model.json"),
          "serve_real": load("serve_real.json")}
(out / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
print(f"wrote {out / 'gpu.json'}")
PY
