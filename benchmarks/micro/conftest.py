"""Micro-benchmarks run apart from the test suite:

    .venv/bin/python -m pytest benchmarks/micro --benchmark-only -p no:cacheprovider

(``pip install pytest-benchmark``; ``bash benchmarks/install_peers.sh`` installs it.)
"""
