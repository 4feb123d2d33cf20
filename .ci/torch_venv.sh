#!/usr/bin/env bash
# Build, once, the virtual environment of one torch release of the test matrix, and print
# its python. The venv lives in a cache folder outside the clone (DDP_SPLIT_CACHE, default
# ~/.cache/ddp-split) and is rebuilt only when that release's pin file changes.
# Usage: .ci/torch_venv.sh 2.15.0
set -euo pipefail
release=${1:?usage: $0 TORCH_RELEASE}
root=$(cd "$(dirname "$0")/.." && pwd)
pins=$root/.ci/torch/$release.txt
if [ ! -f "$pins" ]; then
    echo "no pin file for torch $release; releases with one: $(cd "$root/.ci/torch" && ls | sed 's/\.txt$//' | xargs)" >&2
    exit 2
fi
cache=${DDP_SPLIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ddp-split}
venv=$cache/torch-$release
ready=$venv/.ready-$(sha256sum "$pins" | cut -c1-12)
if [ ! -f "$ready" ]; then
    echo "building $venv (torch $release and its extras; CUDA builds download 2.5-3 GB)" >&2
    start=$(date +%s)
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    quiet() { "$@" 2> >(grep -v "is ignored: it is neither" >&2) >&2; }  # pip's noise about empty local indexes
    quiet "$venv/bin/python" -m pip install -q --upgrade pip
    install() { quiet "$venv/bin/python" -m pip install -q -c "$pins" -r "$pins"; }
    # A machine-wide pip constraint may cap torch below the newest release: lift it for
    # this one install if it refuses.
    install || PIP_CONFIG_FILE=/dev/null install
    touch "$ready"
    echo "built $venv in $(( $(date +%s) - start )) s ($(du -sh "$venv" | cut -f1))" >&2
fi
echo "$venv/bin/python"
