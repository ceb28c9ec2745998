import json
from pathlib import Path

import pytest

from dsv41c import ConfigError, ModelArgs
from dsv41c.config import build_layer_plan

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


def write(tmp_path, raw: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("name", ["tiny.json", "small.json", "flash.json"])
def test_shipped_configs_load(name):
    args = ModelArgs.from_json(CONFIGS / name)
    assert len(args.compress_ratios) == args.n_layers + args.n_mtp_layers


def test_flash_layer_map_matches_the_release():
    plan = build_layer_plan(ModelArgs.from_json(CONFIGS / "flash.json"))
    kinds = [r.kind for r in plan]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "full"] == [2, 8, 14, 20]
    assert [i for i, k in enumerate(kinds) if k == "reindex"] == [24, 28, 32, 36]
    assert kinds[40:] == ["dspark"] * 3
    assert plan[25].kv_source == 20 and plan[25].index_source == 24
    assert plan[7].kv_source == 2 and plan[7].index_source == 2
    assert plan[24].uses_candidates and plan[20].is_candidate_source and not plan[20].uses_candidates
    assert all(plan[i].owns_index_keys for i in (2, 8, 14, 20)) and not plan[24].owns_index_keys


def test_tiny_has_every_layer_kind():
    args = ModelArgs.from_json(CONFIGS / "tiny.json")
    plan = build_layer_plan(args)
    seen = {(r.kind, r.ratio) for r in plan}
    assert {("swa", 0), ("full", 2), ("reuse", 2), ("full", 1), ("reindex", 1), ("reuse", 1), ("dspark", 0)} <= seen
    assert plan[args.candidate_source_layer].ratio == 1
    assert len(args.engram_layer_ids) == 2 and args.n_mtp_layers >= 1 and args.n_routed_experts > 1
    # The funnel must really drop positions at ~100 tokens: pool < visible ratio-1 entries.
    assert args.candidate_topk_blocks * args.candidate_block_size < 100
    assert args.window_size <= 32


def test_hf_form_with_text_config_and_aliases(tmp_path):
    inner = load("tiny.json")
    hf = {"model_type": "deepseek_v4", "architectures": ["X"], "vision_config": {"num_hidden_layers": 0},
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                  "expert_dtype": "fp4"}}
    renames = {"n_layers": "num_hidden_layers", "dim": "hidden_size", "moe_inter_dim": "moe_intermediate_size",
               "n_heads": "num_attention_heads", "rope_head_dim": "qk_rope_head_dim", "window_size": "sliding_window",
               "n_activated_experts": "num_experts_per_tok", "route_scale": "routed_scaling_factor",
               "norm_eps": "rms_norm_eps", "score_func": "scoring_func", "kv_source_layers": "kv_source_layer_ids",
               "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id",
               "n_mtp_layers": "num_nextn_predict_layers", "dspark_n_activated_experts": "dspark_num_experts_per_tok",
               "engram_pad_id": "engram_pad_token_id"}
    text = {renames.get(k, k): v for k, v in inner.items() if k not in ("dtype", "expert_dtype")}
    rope = {"type": "yarn", "factor": text.pop("rope_factor"), "beta_fast": text.pop("beta_fast"),
            "beta_slow": text.pop("beta_slow"), "original_max_position_embeddings": text.pop("original_seq_len")}
    hf["text_config"] = {**text, "rope_scaling": rope, "num_key_value_heads": 1}
    args = ModelArgs.from_json(write(tmp_path, hf))
    ref = ModelArgs.from_json(CONFIGS / "tiny.json")
    assert args == ref.replace(dtype="fp8", expert_dtype="fp4")


def test_hf_without_candidate_key_disables_the_funnel(tmp_path):
    raw = load("tiny.json")
    raw.pop("candidate_source_layer")
    raw["hidden_size"] = raw.pop("dim")
    args = ModelArgs.from_json(write(tmp_path, raw))
    assert args.candidate_source_layer == -1 and args.dtype == "bf16"


@pytest.mark.parametrize("change, key", [
    ({"not_a_key": 1}, "not_a_key"),
    ({"compress_ratios": [0, 2, 2, 1]}, "compress_ratios"),
    ({"kv_source_layers": [0, 3]}, "kv_source_layers"),            # layer 0 has ratio 0
    ({"kv_source_layers": [2, 3]}, "kv_source_layers"),            # layer 1 (ratio 2) has no source
    ({"index_source_layers": [1, 4]}, "index_source_layers"),      # layer 3 (Full) has no index source
    ({"kv_source_layers": [1, 5], "index_source_layers": [1, 3, 5]}, "kv_source_layers"),
    ({"candidate_source_layer": 4}, "candidate_source_layer"),
    ({"vision_n_layers": 2}, "vision_n_layers"),
    ({"hc_mult": 0}, "hc_mult"),
    ({"dim": "big"}, "dim"),
    ({"score_func": "relu"}, "score_func"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"compress_ratios": [0, 2, 2, 1, 1, 1, 1, 1, 0, 1]}, "compress_ratios"),   # DSpark must be ratio 0
])
def test_invalid_configs_name_the_key(tmp_path, change, key):
    raw = {**load("tiny.json"), **change}
    with pytest.raises(ConfigError, match=key):
        ModelArgs.from_json(write(tmp_path, raw))


def test_vision_error_says_out_of_scope(tmp_path):
    with pytest.raises(ConfigError, match="out of scope"):
        ModelArgs.from_json(write(tmp_path, {**load("tiny.json"), "vision_n_layers": 1}))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelArgs.from_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelArgs.from_json(bad)


def test_round_trip_through_dict():
    args = ModelArgs.from_json(CONFIGS / "tiny.json")
    assert ModelArgs.from_dict(args.to_dict()) == args
