"""Build hook for the optional C extension; all other metadata lives in pyproject.toml.

``tqueue._native_balance`` (native/balance.c) speeds up the DP split planner. It is optional:
without a C compiler, or if it fails to build, setuptools warns and installs tqueue without it,
and tqueue/controller/_balance.py uses its pure-Python path. ``tqueue._native_pack``
(native/pack.c) narrows integer fields in one pass; tqueue/_pack.py falls back to numpy.
See native/README.md.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tqueue._native_balance", sources=["native/balance.c"], optional=True),
        Extension("tqueue._native_pack", sources=["native/pack.c"], optional=True, extra_compile_args=["-O3"]),
    ],
)
