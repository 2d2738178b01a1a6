from setuptools import Extension, find_packages, setup

# Fused float16 conversion and PowerSGD kernels.  Optional: where no C
# compiler is found the build goes on without them and the library uses
# numpy for the same arithmetic (chainermn_overlap._kernels).
native = Extension('chainermn_overlap._native',
                   sources=['chainermn_overlap/_native.c'],
                   extra_compile_args=['-O3'], optional=True)

setup(
    name='chainermn_overlap',
    version='0.1.0',
    description='Overlapped (layer-wise non-blocking) gradient reduction and '
                'spatially partitioned convolution for Chainer/ChainerMN.',
    license='MIT',
    packages=find_packages(include=['chainermn_overlap', 'chainermn_overlap.*']),
    # PEP 561: the package ships its type hints.
    package_data={'chainermn_overlap': ['py.typed']},
    ext_modules=[native],
    zip_safe=False,
    python_requires='>=3.8',
    install_requires=['chainer==7.8.1', 'numpy<2', 'mpi4py>=4'],
    extras_require={
        'mpich': ['mpich'],
        'cuda': ['cupy'],
        'test': ['pytest', 'hypothesis'],
    },
)
