"""Install ddp_split into this interpreter's environment and prove pip kept its torch.

Asks pip first, in a dry run with a JSON report, what installing would change, and refuses
if torch is among it; then installs and checks the torch version is the one it found.
Usage: python .ci/pip_keeps_torch.py PIP_INSTALL_ARGS...   (e.g. -c pins.txt -e '.[test]')
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from importlib import metadata


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], capture_output=True, text=True)
    noise = "is ignored: it is neither"  # pip's note on each empty local index of this machine
    sys.stderr.write("".join(line for line in done.stderr.splitlines(True) if noise not in line))
    if done.returncode:
        sys.exit(done.returncode)


def main(args: list[str]) -> None:
    before = metadata.version("torch")
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        _pip("--dry-run", "--report", report.name, *args)
        changes = [item["metadata"]["name"] for item in json.load(open(report.name))["install"]]
    if any(name.lower() == "torch" for name in changes):
        sys.exit(f"pip would replace torch {before}: it would install {changes}")
    _pip(*args)
    after = metadata.version("torch")
    if after != before:
        sys.exit(f"pip replaced torch {before} with {after}")
    print(f"pip keeps torch {before} (installs: {', '.join(changes) or 'nothing'})")


if __name__ == "__main__":
    main(sys.argv[1:])
