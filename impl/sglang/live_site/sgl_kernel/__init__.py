"""A stand-in for sglang-kernel (CUDA only on PyPI). SGLang's CPU paths call
``torch.ops.sgl_kernel.*_cpu`` only when AMX kernels are there (never, with this stub);
a few modules import names at load time. Any name read here is a function that raises,
so a path that really needs a kernel fails naming it instead of computing something."""
__version__ = "0.0.0+pdgate-stub"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: no CPU kernel (pdgate live's stub)")
    missing.__name__ = name
    return missing
