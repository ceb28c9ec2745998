"""Weights I/O: deterministic random init, checkpoint save, and `load_model` with strict checks.

A checkpoint directory holds `config.json` (ModelArgs keys), `model.safetensors` (official
parameter names, spec §3) and optionally `tokenizer.json`.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dsv41c import quant
from dsv41c.config import ModelArgs
from dsv41c.errors import CheckpointError
from dsv41c.model import Transformer
from dsv41c.tokenizer import Tokenizer

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.json"
PACKED_DTYPES = (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


# ------------------------------------------------------------------------------------ init
def _keeps_fp32_values(model: Transformer, name: str) -> bool:
    """Parameters the spec stores in fp32; every other float parameter gets bf16-exact values,
    so that a float32 model and its bfloat16 twin hold identical weights."""
    if any(k in name for k in ("hc_attn_", "hc_ffn_", "attn_sink", "gate.bias", "markov_head.head")):
        return True
    if ".compressor.wkv." in name or ".compressor.wgate." in name:
        return model.plan[int(name.split(".")[1])].ratio >= 2
    return False


def _init_values(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        # in place: the same fp32 products and sums as `randn * std + mean`, without two more
        # full-size temporaries (a large config's init is dominated by these passes over memory)
        return torch.randn(shape, generator=gen).mul_(std).add_(mean)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return normal(0.05, 1.0)
    if leaf.endswith("_fn"):
        return normal(shape[-1] ** -0.5)
    if leaf.endswith("_base"):
        return normal(0.5)
    if leaf.endswith("_scale") and len(shape) == 1:
        return normal(0.1, 0.5)
    if leaf == "attn_sink":
        return normal(1.0)
    if name.endswith("gate.bias"):
        return normal(0.1)
    if leaf in ("q_weight", "k_weight"):
        return normal(0.1, 1.0)
    if name == "embed.weight" or name.endswith("engram.embed.weight") or name.endswith("markov_head.embed.weight"):
        return normal(1.0)
    return normal(shape[-1] ** -0.5)   # projections: unit-variance outputs


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> Transformer:
    """Deterministic, sensibly scaled random weights (same seed -> same weights, any dtype/device).

    Walks the state dict (official names and storage dtypes; its tensors share the parameters'
    storage), so quantised weights are drawn in fp32 and stored with their block scales.
    """
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    for name, t in state.items():
        if t.dtype == torch.float8_e8m0fnu:
            continue                                    # set together with its weight below
        logical = tuple(t.shape[:-1]) + (t.shape[-1] * (2 if t.dtype == torch.float4_e2m1fn_x2 else 1),)
        values = _init_values(name, logical, gen)
        if t.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
            scale = state[name[:-len("weight")] + "scale"]
            if name.endswith("engram.embed.weight"):
                w, s = quant.quantize_fp8_rows(values)
            elif t.dtype == torch.float8_e4m3fn:
                w, s = quant.quantize_fp8_weight(values)
            else:
                w, s = quant.quantize_fp4_weight(values)
            t.view(torch.uint8).copy_(w.view(torch.uint8))
            scale.view(torch.uint8).copy_(s.view(torch.uint8))
            continue
        if not _keeps_fp32_values(model, name) and t.dtype != torch.bfloat16:
            values = values.bfloat16()          # (a bf16 tensor's copy_ rounds the same way itself)
        t.copy_(values)
    return model


def build_model(args: ModelArgs, *, seed: int | None = 0, dtype: torch.dtype = torch.float32,
                kv_quant: bool = False, device: str | torch.device = "cpu",
                tokenizer: Tokenizer | None = None, kv_storage: str = "plain") -> Transformer:
    """A model from a config, with `init_weights(seed)` (or uninitialised storage if seed is None)."""
    with torch.device(device):
        model = Transformer(args, tokenizer, dtype=dtype, kv_quant=kv_quant, kv_storage=kv_storage)
    if seed is not None:
        init_weights(model, seed)
    return model.eval()


# ------------------------------------------------------------------------------------ save
def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)        # mkstemp makes 0600; give the file the usual mode
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(model: Transformer, path: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write config.json, model.safetensors (official names, no aliases) and tokenizer.json.

    dtype=None keeps the model's storage. dtype="fp8" writes the released format: every Q-Linear as
    float8_e4m3fn with float8_e8m0fnu 32x32 block scales and the routed experts as MXFP4
    (expert_dtype "fp4"); the other tensors are kept.
    """
    if dtype not in (None, "fp8"):
        raise ValueError(f"save_checkpoint: dtype must be None or 'fp8', found {dtype!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    args, tensors = model.args, model.state_dict()
    if dtype == "fp8" and (args.dtype, args.expert_dtype) != ("fp8", "fp4"):
        args, tensors = _to_released_format(model, tensors)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    _atomic_write(out / WEIGHTS_FILE, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _atomic_write(out / TOKENIZER_FILE, lambda tmp: model.tokenizer.backend.save(tmp))
    _atomic_write(out / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(args.to_dict(), indent=2)))
    return out


def _to_released_format(model: Transformer, tensors: dict[str, torch.Tensor]):
    args = model.args.replace(dtype="fp8", expert_dtype="fp4")
    expected = build_model(args, seed=None, device="meta", tokenizer=model.tokenizer).state_dict()
    out = {}
    for name, want in expected.items():
        have = tensors.get(name)
        if have is not None and have.dtype == want.dtype:
            out[name] = have
        elif want.dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
            source = tensors[name].float()
            quantize = quant.quantize_fp8_weight if want.dtype == torch.float8_e4m3fn else quant.quantize_fp4_weight
            w, s = quantize(source)
            out[name], out[name[:-len("weight")] + "scale"] = w, s
        elif name not in out:
            out[name] = have
    return args, out


# ------------------------------------------------------------------------------------ load
def _aliases(args: ModelArgs) -> dict[str, str]:
    return {f"mtp.{j}.{n}.weight": f"{n}.weight" for j in range(args.n_mtp_layers) for n in ("embed", "head")}


def _convert(name: str, found: torch.Tensor, expected: torch.Tensor, source: str) -> torch.Tensor:
    if tuple(found.shape) != tuple(expected.shape):
        raise CheckpointError(f"{source}: tensor {name!r}: expected shape {tuple(expected.shape)}, "
                              f"found {tuple(found.shape)}")
    if expected.dtype in PACKED_DTYPES:
        if found.dtype == expected.dtype:
            return found
        if expected.dtype == torch.float4_e2m1fn_x2 and found.dtype == torch.uint8:
            return found.view(torch.float4_e2m1fn_x2)
    elif found.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return found.to(expected.dtype)
    raise CheckpointError(f"{source}: tensor {name!r}: expected dtype {expected.dtype}, found {found.dtype}")


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, kv_quant: bool = False,
               device: str | torch.device = "cpu", kv_storage: str = "plain") -> Transformer:
    """Load a checkpoint directory. Missing, unexpected, mis-shaped or mis-typed tensors raise
    CheckpointError naming the tensor; a bad config raises ConfigError."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a checkpoint directory")
    args = ModelArgs.from_json(root / CONFIG_FILE)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{weights}: weights file not found")
    tok_file = root / TOKENIZER_FILE
    tokenizer = Tokenizer.from_file(tok_file) if tok_file.is_file() else None
    model = build_model(args, seed=None, dtype=dtype, kv_quant=kv_quant, device="meta", tokenizer=tokenizer,
                        kv_storage=kv_storage)
    expected = model.state_dict()
    aliases = _aliases(args)
    state: dict[str, torch.Tensor] = {}
    try:
        handle = safe_open(str(weights), framework="pt")
    except Exception as e:   # safetensors raises its own error types
        raise CheckpointError(f"{weights}: unreadable safetensors file ({e})") from None
    with handle as f:
        names = list(f.keys())
        for name in names:
            if name in aliases:
                continue
            if name not in expected:
                raise CheckpointError(f"{weights}: unexpected tensor {name!r} (no such parameter)")
            state[name] = _convert(name, f.get_tensor(name), expected[name], str(weights))
        for alias, target in aliases.items():
            if alias in names and target in state:
                if not torch.equal(f.get_tensor(alias).to(state[target].dtype), state[target]):
                    raise CheckpointError(f"{weights}: alias {alias!r} differs from {target!r}")
    for name in expected:
        if name not in state:
            raise CheckpointError(f"{weights}: missing tensor {name!r}, expected shape "
                                  f"{tuple(expected[name].shape)} {expected[name].dtype}")
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model.init_buffers()
    return model.eval()


__all__ = ["init_weights", "build_model", "save_checkpoint", "load_model"]
