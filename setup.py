"""Build hook for the optional C extension; all other metadata lives in pyproject.toml.

``tqueue.wire._native_pack`` (native/pack.c) narrows integer fields in one pass. It is optional:
without a C compiler, or if it fails to build, setuptools warns and installs tqueue without it,
and tqueue/wire/_pack.py falls back to numpy. See native/README.md.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tqueue.wire._native_pack", sources=["native/pack.c"], optional=True, extra_compile_args=["-O3"]),
    ],
)
