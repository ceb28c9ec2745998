import pytest
import torch
from safetensors.torch import load_file, save_file

import dsv41c
from dsv41c import quant
from dsv41c import CheckpointError, ModelArgs
from dsv41c.weights import CONFIG_FILE, WEIGHTS_FILE

from pathlib import Path

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


@pytest.fixture(scope="module")
def args():
    return ModelArgs.from_json(TINY)


@pytest.fixture(scope="module")
def checkpoint(args, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    dsv41c.save_checkpoint(dsv41c.build_model(args, seed=3), path)
    return path


def prompt(n=40, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randint(0, 256, (2, n), generator=g)


def test_init_is_deterministic_and_seed_dependent(args):
    a, b, c = (dsv41c.build_model(args, seed=s) for s in (7, 7, 8))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k].view(torch.uint8) if sa[k].element_size() == 1 else sa[k],
                           sb[k].view(torch.uint8) if sb[k].element_size() == 1 else sb[k]), k
    assert not torch.equal(sa["layers.0.attn.wq_a.weight"], sc["layers.0.attn.wq_a.weight"])


def test_init_is_sensibly_scaled(args):
    model = dsv41c.build_model(args, seed=0)
    for name, p in model.named_parameters():
        if p.dtype.is_floating_point and p.element_size() > 1:
            assert torch.isfinite(p).all(), name
    ids = prompt(30)
    with torch.no_grad():
        logits = model(ids, 0, full_logits=True)
    assert torch.isfinite(logits).all()
    # not degenerate: different positions predict different tokens, logits are O(1)
    assert logits.argmax(-1).unique().numel() > 5
    assert 0.1 < logits.std().item() < 10


def test_fp32_and_bf16_twins_share_weights(args):
    a = dsv41c.build_model(args, seed=1, dtype=torch.float32)
    b = dsv41c.build_model(args, seed=1, dtype=torch.bfloat16)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        if pa.dtype.is_floating_point and pa.element_size() > 1:
            assert torch.equal(pa, pb.to(pa.dtype)), name


def test_save_load_round_trip(args, checkpoint):
    ids = prompt(50)
    model = dsv41c.build_model(args, seed=3)
    loaded = dsv41c.load_model(checkpoint, dtype=torch.float32, kv_quant=False, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ids, 0, full_logits=True), loaded(ids, 0, full_logits=True))
        assert torch.equal(model(ids[:, :1] * 0 + 5, 50), loaded(ids[:, :1] * 0 + 5, 50))
    expected = set(model.state_dict())
    assert set(load_file(checkpoint / WEIGHTS_FILE)) == expected
    assert "layers.0.ffn.experts.1.w2.weight" in expected and "layers.0.ffn.experts.w2" not in expected


def test_fp8_fp4_checkpoint_round_trip(args, tmp_path):
    quantised = args.replace(dtype="fp8", expert_dtype="fp4")
    model = dsv41c.build_model(quantised, seed=2)
    sd = model.state_dict()
    assert sd["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert sd["layers.1.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert sd["layers.1.ffn.experts.0.w1.weight"].dtype == torch.float4_e2m1fn_x2
    assert sd["layers.0.engram.embed.weight"].dtype == torch.float8_e4m3fn
    dsv41c.save_checkpoint(model, tmp_path)
    loaded = dsv41c.load_model(tmp_path, dtype=torch.float32)
    ids = prompt(20)
    with torch.no_grad():
        assert torch.equal(model(ids, 0), loaded(ids, 0))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for f in (CONFIG_FILE, "tokenizer.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    tensors = load_file(src / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, dst / WEIGHTS_FILE)
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.2.attn.wkv.weight"), "missing tensor 'layers.2.attn.wkv.weight'"),
    (lambda t: t.__setitem__("layers.2.attn.extra", torch.zeros(3)), "unexpected tensor 'layers.2.attn.extra'"),
    (lambda t: t.__setitem__("norm.weight", torch.zeros(7)), r"'norm.weight': expected shape \(64,\), found \(7,\)"),
    (lambda t: t.__setitem__("norm.weight", torch.zeros(64, dtype=torch.int32)), "'norm.weight': expected dtype"),
    (lambda t: t.__setitem__("mtp.0.embed.weight", torch.zeros_like(t["embed.weight"])), "alias 'mtp.0.embed.weight'"),
])
def test_bad_checkpoints_name_the_tensor(checkpoint, tmp_path, edit, message):
    bad = _rewrite(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=message):
        dsv41c.load_model(bad)


def test_aliases_equal_to_the_top_level_are_accepted(checkpoint, tmp_path):
    def add_aliases(t):
        for j in range(2):
            t[f"mtp.{j}.embed.weight"] = t["embed.weight"].clone()
            t[f"mtp.{j}.head.weight"] = t["head.weight"].to(torch.bfloat16)
    dsv41c.load_model(_rewrite(checkpoint, tmp_path / "alias", add_aliases))


def test_bf16_checkpoint_values_load_into_fp32(checkpoint, tmp_path):
    def to_bf16(t):
        for k, v in t.items():
            if v.dtype == torch.float32 and k in ("head.weight", "embed.weight"):
                t[k] = v.to(torch.bfloat16)     # exact: init values are bf16-representable
    model = dsv41c.load_model(_rewrite(checkpoint, tmp_path / "b", to_bf16))
    assert model.head.weight.dtype == torch.float32


def test_missing_files(tmp_path, checkpoint):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        dsv41c.load_model(tmp_path / "nothing")
    only_config = tmp_path / "cfg"
    only_config.mkdir()
    (only_config / CONFIG_FILE).write_bytes((checkpoint / CONFIG_FILE).read_bytes())
    with pytest.raises(CheckpointError, match="weights file not found"):
        dsv41c.load_model(only_config)
    (only_config / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable"):
        dsv41c.load_model(only_config)


def test_save_as_released_fp8_format(args, tmp_path):
    model = dsv41c.build_model(args, seed=4)
    dsv41c.save_checkpoint(model, tmp_path, dtype="fp8")
    tensors = load_file(tmp_path / WEIGHTS_FILE)
    assert tensors["layers.3.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.3.attn.wq_b.scale"].shape == (args.n_heads * args.head_dim // 32, args.q_lora_rank // 32)
    assert tensors["layers.3.ffn.experts.2.w2.weight"].dtype == torch.float4_e2m1fn_x2
    assert tensors["layers.3.ffn.experts.2.w2.scale"].shape == (args.dim, args.moe_inter_dim // 32)
    assert tensors["layers.3.attn.wo_a.weight"].dtype == torch.float32          # never quantised
    assert tensors["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32
    loaded = dsv41c.load_model(tmp_path, dtype=torch.float32)
    assert loaded.args.dtype == "fp8" and loaded.args.expert_dtype == "fp4"
    ids = prompt(24)
    with torch.no_grad():
        a, b = loaded(ids, 0, full_logits=True), model(ids, 0, full_logits=True)
    assert torch.isfinite(a).all()
    # FP8/FP4 weights and FP8 activations perturb the random model's logits, but keep them aligned
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9
    # the dequantised weight equals the source within one FP8 step of its block
    w = quant.dequant_fp8_weight(tensors["layers.3.attn.wq_b.weight"], tensors["layers.3.attn.wq_b.scale"])
    src = model.layers[3].attn.wq_b.weight
    assert ((w - src).abs() <= src.abs().amax() / 16).all()
