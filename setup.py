"""Declares the compiled extensions; all metadata lives in pyproject.toml.

HOSTKV_DEBUG=1 builds with line tracing, asserts and bounds checks on (a debug build).
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("HOSTKV_DEBUG", "") not in ("", "0")

# Each below the ones after it that cimport it.
MODULES = ["_tokens", "_crash", "_leases", "_geometry", "_format", "_lock", "_segment", "_pages",
           "_slab", "_radix", "_introspect", "_requests", "_records", "_viewstate", "_sequences",
           "_blockcopy", "_cudacopy"]

extensions = [
    Extension(
        f"hostkv.{module}",
        [f"hostkv/{module}.pyx"],
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
        + ([("CYTHON_TRACE_NOGIL", "1")] if DEBUG else [("NDEBUG", None)]),
        extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
        libraries=["pthread", "rt"],
    )
    for module in MODULES
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives={
            "language_level": 3,
            "embedsignature": True,
            "linetrace": DEBUG,
            "boundscheck": DEBUG,
            "wraparound": DEBUG,
        },
    ),
)
