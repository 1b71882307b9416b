"""Import-only torchvision stand-in for CPU serving (on PYTHONPATH only where the real torchvision does not import).

SGLang imports torchvision at module level in a few multimodal configs, and transformers then
imports a few of its names; PyPI's torchvision links CUDA and fails beside torch+cpu. Text-only
serving never calls any of it: every name here is a stub that raises when used.
"""

__version__ = "0.29.0"  # what transformers' version gates compare against; nothing is implemented


class _Stub:
    def __init__(self, name: str):
        self.__name__ = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.__name__}: the torchvision stand-in is import-only")


def stub_getattr(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(f"{module}.{name}")

    return __getattr__


__getattr__ = stub_getattr("torchvision")
