"""A do-nothing replacement for SGLang's compiled kernel package, for running SGLang on a CPU.

Why it exists: SGLang's CPU path (SGLANG_USE_CPU_ENGINE=1) still imports `sgl_kernel`, and
names in it, while its modules load (for instance `sglang.srt.layers.quantization.utils` reads
`scalar_types.uint4b8` at import time). PyPI has no CPU build of that package: the
`sglang-kernel` wheel that `pip install sglang` pulls in is the GPU one. On the path the tests
use (`--device cpu --attention-backend torch_native --dtype bfloat16`, no draft model) none of
its kernels is ever called, so placeholders are enough to get past the imports.

How it behaves: put the folder holding this package first on PYTHONPATH (and uninstall
`sglang-kernel`). Then any name looked up on `sgl_kernel`, or on any `sgl_kernel.<sub>.<module>`,
gives a placeholder. Calling a placeholder raises NotImplementedError naming it, so a kernel
that is in fact needed fails loudly, never silently. Names looked up on a placeholder give
placeholders too, so module-level constants such as `scalar_types.uint4b8` resolve.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


def _is_dunder(name: str) -> bool:
    # Leave protocol lookups (__wrapped__, __signature__, ...) alone: answering them with a
    # placeholder would confuse inspect, pickle and friends.
    return name.startswith("__") and name.endswith("__")


class Placeholder:
    """Stands for a kernel (or any object) of sgl_kernel that this machine does not have."""

    def __init__(self, dotted: str) -> None:
        self.__qualname__ = dotted
        self.__name__ = dotted.rpartition(".")[2]

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self.__qualname__} belongs to the compiled sgl_kernel package, which this CPU stand-in "
            "(tools/sglang_cpu/sgl_kernel) does not provide"
        )

    def __getattr__(self, name: str) -> Placeholder:
        if _is_dunder(name):
            raise AttributeError(name)
        return Placeholder(f"{self.__qualname__}.{name}")

    def __repr__(self) -> str:
        return f"<sgl_kernel placeholder {self.__qualname__}>"


def _lookup_for(module_name: str):
    """A module-level __getattr__ (PEP 562) that hands out placeholders."""

    def __getattr__(name: str) -> Placeholder:
        if _is_dunder(name):
            raise AttributeError(name)
        return Placeholder(f"{module_name}.{name}")

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes every `import sgl_kernel.<anything>` succeed with an empty placeholder module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []  # a package, so that deeper submodules resolve as well
        module.__getattr__ = _lookup_for(spec.name)
        return module

    def exec_module(self, module) -> None:
        pass


if not any(isinstance(finder, _Submodules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Submodules())

__getattr__ = _lookup_for(__name__)
