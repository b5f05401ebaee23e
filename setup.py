"""Build hook for the optional C extension; all other metadata lives in pyproject.toml.

``tqueue.wire._native_pack`` (native/pack.c) narrows integer fields in one pass. It is optional:
without a C compiler, or if it fails to build, setuptools warns and installs tqueue without it,
and tqueue/wire/_pack.py falls back to numpy. ``tqueue.wire._native_crc`` (native/crc.c) takes the
CRC-32C of many samples in one call; without it tqueue/wire/_crc.py calls the crc32c package
once per sample. See native/README.md.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("tqueue.wire._native_pack", sources=["native/pack.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("tqueue.wire._native_crc", sources=["native/crc.c"], optional=True, extra_compile_args=["-O3"]),
    ],
)
