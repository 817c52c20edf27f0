"""The wheel's packages, found in the tree rather than listed by hand (pyproject.toml says the rest).

The code packages are every folder under ``rlx_gpu`` and ``host_fallback`` with an ``__init__.py``. The data
folders (``configs``, ``kernels``, each dialect's ``kernels_<dialect>``) lie beside the code in a checkout and
have none; they install inside ``rlx_gpu`` (``rlx_gpu.configs`` ...), where ``rlx_gpu.paths`` looks first.
"""
from setuptools import find_namespace_packages, find_packages, setup

DATA = {f"rlx_gpu.{name}": name.replace(".", "/")
        for name in find_namespace_packages(include=["configs", "configs.*", "kernels", "kernels_*"],
                                            exclude=["*__pycache__"])}

setup(packages=[*find_packages(include=["rlx_gpu", "rlx_gpu.*", "host_fallback", "host_fallback.*"]), *DATA],
      package_dir=DATA)
