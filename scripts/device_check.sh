#!/usr/bin/env bash
# The GPU check (issue 15) in one command, sized for a 15-minute lease of one H200 with no network.
#   scripts/device_check.sh --fetch-wheels   here, with network: the packages the device image lacks, into .whl/
#   scripts/device_check.sh                  on the device (the `run` tool, carry [".whl"], timeout_s 600):
#                                            writes env.txt, check.txt and check.json under $OUT
#   DEVICE=cpu scripts/device_check.sh       the same run on tiny shapes in Triton's interpreter (a dry run of
#                                            the script here; about a minute on 2 cores)
#   scripts/device_check.sh --split-model [NAME]   here, with the project's python as $PYTHON: a built-in model's GGUF
#                                            (default smollm2-135m-instruct) in 60 MiB pieces under .models/, to
#                                            carry one a call (docs/gpu.md); there the pieces are joined, and each
#                                            .models/*.gguf is passed as --model
# Other arguments go to `batchjob selftest` (e.g. --model PATH).
# The check itself is `batchjob selftest --device cuda` (batchjob/bench/device_check.py): dummy weights but in the
# real-model part, every part time-capped (8.4 minutes in all), its JSON rewritten after each part, so a run cut short
# still returns what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
# The image has torch, triton, transformers, tokenizers, safetensors, click, rich, pyarrow...; not pydantic, polars
# or universal-pathlib (the CLI imports all three); gguf, which the loader reads a model file with, is not known to
# be there (the dummy weights never needed it).
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  polars==2.1.0 polars-runtime-32==2.1.0 universal-pathlib==0.3.10 pathlib-abc==0.5.2 gguf==0.19.0"
exclude() { # an ignored folder: ignored files stay on the device between calls, and never reach git
  local file
  file="$(git rev-parse --git-common-dir)/info/exclude"
  grep -qx "/$1/" "$file" 2>/dev/null || echo "/$1/" >>"$file"
}

if [ "${1:-}" = --fetch-wheels ]; then
  exclude .whl
  # shellcheck disable=SC2086
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
fi
if [ "${1:-}" = --split-model ]; then
  exclude .models
  where='import sys; from batchjob.model.loader import locate_model; print(locate_model(sys.argv[1]).path)'
  gguf="$("${PYTHON:-python3}" -c "$where" "${2:-smollm2-135m-instruct}")" || exit 1
  mkdir -p .models && split -b 60M -d "$gguf" ".models/$(basename "$gguf").part" && ls -l .models
  exit
fi

OUT="${OUT:-out/device_check}"
mkdir -p "$OUT"
# No network there: nothing may try the package index or the Hub (the built-in tokenizer falls back to bytes).
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONPATH="$PWD"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="$PWD:/tmp/site"
fi
# Models brought in pieces (--split-model): joined once, then each GGUF here is one more --model.
models=()
for first in .models/*.part00; do
  [ -e "$first" ] || continue
  whole="${first%.part00}"
  [ -e "$whole" ] || { cat "$whole".part?? >"$whole.tmp" && mv "$whole.tmp" "$whole"; }
done
for gguf in .models/*.gguf; do
  [ -e "$gguf" ] && models+=(--model "$gguf")
done
{
  date -u
  nvidia-smi
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  python3 -c "import pydantic; print('pydantic', pydantic.VERSION)"
  python3 -c "import importlib.metadata as m; print('gguf', m.version('gguf'))"
  ls -l .models 2>/dev/null
} >"$OUT/env.txt" 2>&1
timeout 540 python3 -m batchjob.cli selftest --device "${DEVICE:-cuda}" --json "$OUT/check.json" \
  "${models[@]}" "$@" 2>&1 | tee "$OUT/check.txt"
rc=${PIPESTATUS[0]}
echo "exit code $rc" | tee -a "$OUT/check.txt"
exit "$rc"
