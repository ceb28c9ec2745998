"""KV memory accounting (spec §11) and `dsv41c kv-budget`.

The released numbers are the spec's literals; the tiny config's are worked out here by hand from
its JSON values, without calling kv_budget for the expectation.
"""
import json
from fractions import Fraction
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dsv41c.cli.main import app
from dsv41c.config import ModelArgs
from dsv41c.errors import InputError
from dsv41c.kv_budget import kv_budget

REPO = Path(__file__).resolve().parents[1]
FLASH = REPO / "configs" / "flash.json"
TINY = REPO / "configs" / "tiny.json"
MiB = 2**20


@pytest.fixture(scope="module")
def flash():
    return kv_budget(ModelArgs.from_json(FLASH))


# ------------------------------------------------------------------ released config
def test_flash_global_bytes_per_token(flash):
    p = flash.packed
    assert [s.layer_id for s in p.sources] == [2, 8, 14, 20]
    assert [s.ratio for s in p.sources] == [2, 2, 2, 1]
    assert [s.kv_entry_bytes for s in p.sources] == [288] * 4
    assert [s.index_entry_bytes for s in p.sources] == [68] * 4
    assert [s.kv_bytes_per_token for s in p.sources] == [144, 144, 144, 288]
    assert [s.index_bytes_per_token for s in p.sources] == [34, 34, 34, 68]
    assert p.kv_bytes_per_token == 720 and p.index_bytes_per_token == 170
    assert p.bytes_per_token == 890 == flash.bytes_per_token
    assert flash.sources == p.sources


def test_flash_readers_follow_the_layer_map(flash):
    assert [s.readers for s in flash.sources] == [
        tuple(range(2, 8)), tuple(range(8, 14)), tuple(range(14, 20)), tuple(range(20, 40))]


def test_flash_fixed_state(flash):
    p = flash.packed
    assert p.window_entry_bytes == 528
    assert p.backbone_window_bytes == 40 * 128 * 528 == 2_703_360
    assert p.dspark_window_bytes == 3 * 67_584 == 202_752
    assert p.partial_group_bytes == 3 * 2 * 2 * 512 * 4 == 24 * 1024
    assert p.ngram_tail_ids == 3 and p.ngram_tail_bytes == 24
    assert p.fixed_bytes == 2_703_360 + 202_752 + 24_576 + 24


def test_flash_one_million_tokens(flash):
    p = flash.packed
    assert flash.context == 2**20
    assert p.global_bytes == 890 * MiB
    assert p.total_bytes == 890 * MiB + p.fixed_bytes
    assert p.persistent_bytes_per_token == 890 and p.persistent_bytes == 890 * MiB


def test_flash_bf16_and_ratios(flash):
    b = flash.bf16
    assert [s.kv_entry_bytes for s in b.sources] == [1024] * 4
    assert [s.index_entry_bytes for s in b.sources] == [256] * 4
    assert b.bytes_per_token == 3 * 1280 / 2 + 1280 == 3200
    assert b.global_bytes == 3200 * MiB
    assert b.partial_group_bytes == 24576 and b.window_entry_bytes == 1024
    assert flash.naive_bytes_per_token == 40 * 512 * 2 == 40_960
    assert flash.bf16_ratio == pytest.approx(3200 / 890) and round(flash.bf16_ratio, 1) == 3.6
    assert flash.naive_ratio == pytest.approx(40_960 / 890) and round(flash.naive_ratio) == 46
    assert flash.naive_bf16_ratio == pytest.approx(12.8)


def test_context_counts_only_completed_groups():
    args = ModelArgs.from_json(FLASH)
    odd = kv_budget(args, context=2**20 + 1).packed
    assert [s.entries(odd.context) for s in odd.sources] == [2**19] * 3 + [2**20 + 1]
    assert odd.global_bytes == 890 * MiB + 288 + 68
    empty = kv_budget(args, context=0).packed
    assert empty.global_bytes == 0 and empty.total_bytes == empty.fixed_bytes


@pytest.mark.parametrize("context", [-1, 1.5, True])
def test_bad_context(context):
    with pytest.raises(InputError, match="context"):
        kv_budget(ModelArgs.from_json(TINY), context=context)


# ------------------------------------------------------------------ tiny, by hand
def test_tiny_by_hand():
    raw = json.loads(TINY.read_text())
    d, d_i, w = raw["head_dim"], raw["index_head_dim"], raw["window_size"]
    ratios, kv_src, idx_src = raw["compress_ratios"], raw["kv_source_layers"], raw["index_source_layers"]
    fp4_entry = d // 2 + d // 16          # e2m1 pairs + one E4M3 scale per 16
    mxfp4_entry = d_i // 2 + d_i // 32    # e2m1 pairs + one UE8M0 scale per 32
    fp8_entry = d + d // 32               # e4m3 + one UE8M0 scale per 32
    assert (fp4_entry, mxfp4_entry, fp8_entry) == (36, 17, 66)
    owns = [i for i in kv_src if i in idx_src]
    per_token_kv = sum(Fraction(fp4_entry, ratios[i]) for i in kv_src)
    per_token_idx = sum(Fraction(mxfp4_entry, ratios[i]) for i in owns)
    context = raw["max_seq_len"] + 3
    global_bytes = sum((context // ratios[i]) * (fp4_entry + (mxfp4_entry if i in owns else 0)) for i in kv_src)
    layers = raw["n_layers"] + raw["n_mtp_layers"]
    partial = sum(2 * ratios[i] * d * 4 for i in kv_src if ratios[i] >= 2)
    tail = (raw["engram_max_ngram_size"] - 1) * 8

    b = kv_budget(ModelArgs.from_json(TINY), context=context)
    p = b.packed
    assert [s.layer_id for s in p.sources] == kv_src
    assert [s.kv_bytes_per_token for s in p.sources] == [Fraction(fp4_entry, ratios[i]) for i in kv_src]
    assert p.kv_bytes_per_token == per_token_kv == 54
    assert p.index_bytes_per_token == per_token_idx == Fraction(51, 2)
    assert p.bytes_per_token == Fraction(159, 2)
    assert p.global_bytes == global_bytes
    assert p.backbone_window_bytes == raw["n_layers"] * w * fp8_entry
    assert p.dspark_window_bytes == raw["n_mtp_layers"] * w * fp8_entry
    assert p.window_bytes == layers * w * fp8_entry == 10 * 16 * 66
    assert p.partial_group_bytes == partial == 1024
    assert p.ngram_tail_bytes == tail == 16
    assert p.total_bytes == global_bytes + layers * w * fp8_entry + partial + tail
    assert p.persistent_bytes == global_bytes

    bf16_per_token = sum(Fraction(2 * d, ratios[i]) for i in kv_src) + sum(Fraction(2 * d_i, ratios[i]) for i in owns)
    assert b.bf16.bytes_per_token == bf16_per_token == 288
    assert b.bf16.window_bytes == layers * w * 2 * d
    assert b.naive_bytes_per_token == raw["n_layers"] * d * 2
    assert b.bf16_ratio == pytest.approx(float(bf16_per_token / (per_token_kv + per_token_idx)))


def test_no_compressed_layers(tmp_path):
    raw = json.loads(TINY.read_text())
    raw.update(compress_ratios=[0] * 10, kv_source_layers=[], index_source_layers=[], candidate_source_layer=-1,
               engram_layer_ids=[], engram_num_embeddings=[])
    b = kv_budget(ModelArgs.from_dict(raw))
    assert b.sources == () and b.packed.global_bytes == 0 and b.packed.ngram_tail_bytes == 0
    assert b.packed.partial_group_bytes == 0 and b.packed.fixed_bytes == b.packed.window_bytes
    assert b.bf16_ratio is None and b.naive_ratio is None


# ------------------------------------------------------------------ CLI
def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["kv-budget", *args], env={"COLUMNS": "80", **(env or {})})


def assert_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0]


def test_cli_prints_the_tables():
    result = invoke("--config", str(FLASH))
    assert result.exit_code == 0, (result.output, result.exception)
    out = result.stdout
    for text in ("Global KV per token", "One sequence", "144", "288", "34", "68", "720", "170", "890", "3,200",
                 "2,703,360", "202,752", "24,576", "933,232,640", "890 MiB", "3.6×", "46.0×", "40,960",
                 "20-39", "persisted"):
        assert text in out, text
    assert "…" not in out and max(len(line) for line in out.splitlines()) <= 80
    assert "max_seq_len" not in out


def test_cli_context_option():
    result = invoke("--config", str(TINY), "--context", "1000")
    assert result.exit_code == 0, (result.output, result.exception)
    assert "1,000 tokens" in result.stdout and "79.5" in result.stdout and "8.5" in result.stdout
    assert "beyond the config's max_seq_len 256" in result.stdout


def test_cli_json():
    result = invoke("--config", str(FLASH), "--json", "--context", "4096")
    assert result.exit_code == 0, (result.output, result.exception)
    data = json.loads(result.stdout)
    assert data["context"] == 4096 and data["max_seq_len"] == 2**20
    assert data["packed"]["bytes_per_token"] == 890 and data["bf16"]["bytes_per_token"] == 3200
    assert data["packed"]["global_bytes"] == 890 * 4096
    assert [s["kv_bytes_per_token"] for s in data["packed"]["sources"]] == [144, 144, 144, 288]
    assert data == json.loads(json.dumps({"config": str(FLASH), "max_seq_len": 2**20,
                                          **kv_budget(ModelArgs.from_json(FLASH), 4096).to_dict()}))


def test_cli_missing_config(tmp_path):
    assert_error(invoke("--config", str(tmp_path / "nope.json")), "nope.json", "found nothing")


def test_cli_config_is_a_directory(tmp_path):
    assert_error(invoke("--config", str(tmp_path)), "found a directory")


def test_cli_default_config_is_the_current_directorys_else_the_installed_copy(tmp_path, monkeypatch):
    """Without --config: configs/flash.json where the command runs (here tiny's, copied there), else
    the installed flash.json."""
    monkeypatch.chdir(tmp_path)
    installed = json.loads(invoke("--json").stdout)
    assert Path(installed["config"]).name == "flash.json" and installed["max_seq_len"] == ModelArgs.from_json(FLASH).max_seq_len
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "flash.json").write_text(TINY.read_text())
    local = json.loads(invoke("--json").stdout)
    assert local["config"] == str(Path("configs") / "flash.json") and local["max_seq_len"] == ModelArgs.from_json(TINY).max_seq_len


def test_cli_bad_config_key(tmp_path):
    raw = json.loads(TINY.read_text())
    raw["bogus_key"] = 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    assert_error(invoke("--config", str(path)), "bogus_key", "bad.json")


def test_cli_negative_context():
    assert_error(invoke("--config", str(TINY), "--context", "-5"), "--context -5")
