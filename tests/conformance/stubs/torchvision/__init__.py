"""A stand-in for torchvision: the CPU torch from PyPI cannot load the real one (`torchvision::nms does not
exist`), and SGLang imports it only for multimodal processors, which eagle3 never runs. Every attribute and
submodule is another empty stand-in package."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Stub(types.ModuleType):
    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _module(f"{self.__name__}.{name}")


def _module(name: str) -> types.ModuleType:
    if name not in sys.modules:
        module = _Stub(name)
        module.__path__ = []
        module.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)
        sys.modules[name] = module
    return sys.modules[name]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, cls, is_package=True)
        return None

    @classmethod
    def create_module(cls, spec):  # type: ignore[no-untyped-def]
        return _module(spec.name)

    @classmethod
    def exec_module(cls, module):  # type: ignore[no-untyped-def]
        return None


sys.meta_path.insert(0, _Finder)
__path__: list[str] = []
__version__ = "0.0.0+stand-in"
sys.modules[__name__].__class__ = _Stub
