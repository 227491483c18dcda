"""xtrain: declarative experiment configs for distributed PyTorch training."""

__version__ = "0.1.0"
__all__ = ["load_model", "run_with_accelerate"]


def __getattr__(name: str):
    # imported on first use: `import xtrain` (and `python -m xtrain --cfg job`) stays free of torch
    if name == "run_with_accelerate":
        from xtrain.decorator.run_with_accelerate import run_with_accelerate

        return run_with_accelerate
    if name == "load_model":
        from xtrain.tasks.exports import load_model

        return load_model
    raise AttributeError(f"module 'xtrain' has no attribute {name!r}")
