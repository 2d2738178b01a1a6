"""The optional C extension; everything else is in pyproject.toml."""
from setuptools import Extension, setup

# Fused float16 conversion and PowerSGD kernels.  Optional: where no C
# compiler is found the build goes on without them and the library uses
# numpy for the same arithmetic (chainermn_overlap._kernels).
native = Extension('chainermn_overlap._native',
                   sources=['chainermn_overlap/_native.c'],
                   extra_compile_args=['-O3'], optional=True)

setup(ext_modules=[native])
