"""The optional C extension and the start-up file; the rest is in pyproject.toml."""
import os

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# Fused float16 conversion and PowerSGD kernels.  Optional: where no C
# compiler is found the build goes on without them and the library uses
# numpy for the same arithmetic (chainermn_overlap._kernels).
native = Extension('chainermn_overlap._native',
                   sources=['chainermn_overlap/_native.c'],
                   extra_compile_args=['-O3'], optional=True)

# Run by Python at start-up from site-packages: it lets Chainer 7.8.1 import
# on Python 3.12+ (_chainermn_overlap_compat.py says how, and how to turn it
# off).  A .pth file must lie at the top of site-packages, beside no package.
PTH = 'chainermn_overlap-compat.pth'


class BuildPyWithPth(build_py):
    """build_py that also puts the start-up file at the top of the install.

    A wheel holds what build_py leaves in ``build_lib``.  An editable wheel
    (PEP 660) does not: it maps the packages back to the checkout and holds
    only the files written into the folder that ``install`` was pointed at,
    so in editable mode the file goes there.
    """

    def run(self):
        super().run()
        target = self.build_lib
        if getattr(self, 'editable_mode', False):
            target = self.get_finalized_command('install').install_lib
        os.makedirs(target, exist_ok=True)
        self.copy_file(PTH, os.path.join(target, PTH), preserve_mode=False)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [
            os.path.join(self.build_lib, PTH)]


setup(ext_modules=[native], cmdclass={'build_py': BuildPyWithPth})
