"""dsv41c: a compiler-driven implementation of the DeepSeek-V4.1-Flash architecture.

    import dsv41c, torch
    model = dsv41c.load_model(path, dtype=torch.float32, kv_quant=False, device="cpu")
    logits = model(input_ids, start_pos=0, full_logits=True)   # [B, S, V] fp32
    logits = model(next_ids, start_pos=S)                      # [B, V]

    compiled = dsv41c.compile(model)                           # same call surface, fused projections

    dsv41c.export(model, "artifact/")                          # AOTInductor packages + manifest
    artifact = dsv41c.load_artifact("artifact/")               # verified, loaded, nothing compiled
"""
from pathlib import Path as _Path

# In a source checkout the subpackages dsv41c.passes, dsv41c.tilelang_kernels and dsv41c.cli are the
# top-level folders beside this one (pyproject.toml's package-dir); an install puts them inside it.
# Where this folder is imported from the checkout itself (`python -m pytest` in the repository root
# puts the root first on sys.path, ahead of a non-editable install), the root joins the package's
# search path after this folder, so those names resolve as installed.
if not (_Path(__file__).parent / "passes").is_dir() and (_Path(__file__).parents[1] / "pyproject.toml").is_file():
    __path__.append(str(_Path(__file__).parents[1]))

from dsv41c.compiler import compile
from dsv41c.config import ModelArgs
from dsv41c.errors import (ArtifactError, CheckpointError, ConfigError, DSV41CError, GoldenMismatch,
                           InputError)
from dsv41c.export import export, load_artifact
from dsv41c.model import Transformer
from dsv41c.tokenizer import Tokenizer, load_tokenizer
from dsv41c.weights import build_model, init_weights, load_model, save_checkpoint

__version__ = "0.1.0"

__all__ = [
    "ModelArgs", "Transformer", "compile", "Tokenizer", "load_tokenizer", "build_model", "init_weights", "load_model",
    "save_checkpoint", "DSV41CError", "ConfigError", "CheckpointError", "InputError", "GoldenMismatch",
    "ArtifactError", "export", "load_artifact", "__version__",
]
