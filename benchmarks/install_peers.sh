#!/usr/bin/env bash
# Install the peer systems of the end-to-end benchmarks into a virtualenv (default .venv):
# Ray 2.60, TransferQueue 0.1.11 and its runtime dependencies, matplotlib, pytest-benchmark.
# torch is held where it is by benchmarks/constraints.txt. Safe to run again.
#
#   bash benchmarks/install_peers.sh [VENV]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${1:-.venv}"
py="$venv/bin/python"
if [[ ! -x "$py" ]]; then
    echo "no python at $py (create the virtualenv first)" >&2
    exit 1
fi
constraints="$here/constraints.txt"
pip=("$py" -m pip install --disable-pip-version-check -q -c "$constraints")

"${pip[@]}" "ray==2.60.0" "tensordict==0.15.3" omegaconf msgspec psutil matplotlib pytest-benchmark
# TransferQueue declares hydra-core (and pins its own torch range) but never imports hydra:
# install it alone, without its declared dependencies, so torch is left as it is.
"${pip[@]}" --no-deps "transferqueue==0.1.11"

"$py" - <<'PY'
import importlib.metadata as md
for name in ("torch", "ray", "transferqueue", "tensordict", "omegaconf", "matplotlib", "pytest-benchmark"):
    print(f"{name:18} {md.version(name)}")
import ray, transfer_queue  # noqa: F401  (fails loudly if an import is broken)
PY
