#!/usr/bin/env bash
# One torch release of the test matrix: its cached venv (.ci/torch_venv.sh), pip's word that
# installing ddp_split keeps that torch, the backend registered by name, then every test but
# the slow ones, with the real-model cases cut to the smoke (GPT-2 and Llama, both inner
# backends, 2 gloo ranks). Usage: .ci/test_torch.sh 2.15.0 [pytest arguments]
# (or: make test-torch TORCH=2.15.0); arguments replace the default selection `-m 'not slow'`.
set -euo pipefail
release=${1:?usage: $0 TORCH_RELEASE [pytest arguments]}
shift
[ $# -gt 0 ] || set -- -m 'not slow'
cd "$(dirname "$0")/.."
python=$(.ci/torch_venv.sh "$release")
# This workplace's global pip config caps torch below the newest release; a user's has no such
# cap, and with it pip would "fix" a newer torch. Ask pip as a user's would.
PIP_CONFIG_FILE=/dev/null "$python" .ci/pip_keeps_torch.py -c ".ci/torch/$release.txt" -e '.[test,plot]'
"$python" - <<'PY'
import torch
import ddp_split_backend  # noqa: F401  (fails at once on an unsupported torch)
assert "ddp_split" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
print(f"torch {torch.__version__}: 'ddp_split' is in torch._dynamo.list_backends()")
PY
DDP_SPLIT_REAL_MODELS=gpt2,llama "$python" -m pytest -q -rs "$@"
