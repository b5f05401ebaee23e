"""Build hook for the optional C extension; all other metadata lives in pyproject.toml.

``tqueue._native_balance`` (native/balance.c) speeds up the DP split planner. It is optional:
without a C compiler, or if it fails to build, setuptools warns and installs tqueue without it,
and tqueue/controller/_balance.py uses its pure-Python path. See native/README.md.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tqueue._native_balance", sources=["native/balance.c"], optional=True),
    ],
)
