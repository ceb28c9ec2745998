"""Golden regression: the recorded files pass under eager, and perturbed models, wrong runners,
tampered files and bad record arguments are caught."""
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import dsv41c
from dsv41c import golden
from dsv41c.cli.main import app
from dsv41c.errors import ConfigError, GoldenMismatch, InputError

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "golden"
TINY_GOLDEN = GOLDEN_DIR / "tiny.safetensors"


@pytest.fixture
def tiny_only(tmp_path):
    """A golden directory holding just the tiny file, with its manifest."""
    target = tmp_path / "golden"
    target.mkdir()
    (target / TINY_GOLDEN.name).write_bytes(TINY_GOLDEN.read_bytes())
    golden.write_manifest(target, {TINY_GOLDEN.name: golden.manifest_entry(target / TINY_GOLDEN.name,
                                                                             Path("configs/tiny.json"))})
    return target


def retagged(src: Path, dst: Path, **metadata: str) -> Path:
    with safe_open(src, framework="pt") as fh:
        meta = dict(fh.metadata())
    save_file(load_file(src), dst, metadata={**meta, **metadata})
    return dst


def test_manifest_lists_both_configs_with_matching_hashes():
    files = golden.golden_files(GOLDEN_DIR)
    assert [p.name for p in files] == ["tiny.safetensors", "tiny2.safetensors"]
    manifest = golden.read_manifest(GOLDEN_DIR)["files"]
    for path in files:
        entry = manifest[path.name]
        args = dsv41c.ModelArgs.from_json(REPO / entry["config"])
        assert entry["config_sha256"] == golden.config_sha256(args) == golden.load_golden(path).metadata["config_sha256"]
        assert path.stat().st_size < 400_000


@pytest.mark.parametrize("name", ["tiny", "tiny2"])
def test_recorded_golden_passes_under_eager(name):
    report = golden.check(GOLDEN_DIR / f"{name}.safetensors")
    assert report.ok, report.failure()
    assert report.first_divergence is None
    outputs = [(r.output, r.step) for r in report.rows]
    assert outputs == [("prefill logits", None)] + [("decode logits", i) for i in range(16)] + [("greedy tokens", None)]
    assert all(r.error <= golden.GOLDEN_BOUND for r in report.rows)
    report.raise_for_failure()


def test_perturbed_model_fails():
    model = golden.load_golden(TINY_GOLDEN).build_model()
    with torch.no_grad():
        model.layers[0].attn_norm.weight.add_(1e-3)
    report = golden.check(TINY_GOLDEN, model=model)
    assert not report.ok
    prefill = report.rows[0]
    assert prefill.output == "prefill logits" and prefill.error > golden.GOLDEN_BOUND
    with pytest.raises(GoldenMismatch, match=r"tiny\.safetensors: eager vs golden"):
        report.raise_for_failure()


def test_wrong_runner_fails_on_its_step_and_names_the_first_divergence():
    model = golden.load_golden(TINY_GOLDEN).build_model()
    prompt_len = golden.load_golden(TINY_GOLDEN).prompt_len

    def runner(ids, start_pos=0, full_logits=False):
        out = model(ids, start_pos=start_pos, full_logits=full_logits)
        if start_pos == prompt_len + 2:                  # step 2: slightly off
            out = out * (1 + 1e-3)
        if start_pos == prompt_len + 5:                  # step 5: another greedy choice
            out = out.clone()
            out[1, (out[1].argmax() + 1) % out.shape[-1]] = out[1].max() + 1
        return out

    report = golden.check(TINY_GOLDEN, runner=runner, model=model)
    assert not report.ok
    eager = [r for r in report.rows if r.subject == "eager"]
    assert all(r.ok for r in eager)
    failed = [r for r in report.rows if not r.ok]
    assert {(r.output, r.step) for r in failed} == {("decode logits", 2), ("decode logits", 5), ("greedy tokens", None)}
    assert 9e-4 < failed[0].error < 2e-3
    # The choice made after step 5 is generated token 6, at sequence position prompt_len + 6.
    assert report.first_divergence == 6
    with pytest.raises(GoldenMismatch, match=rf"greedy token 6 \(sequence position {prompt_len + 6}, batch row 1\)"):
        report.raise_for_failure()


def test_runner_with_wrong_output_shape_is_an_input_error():
    model = golden.load_golden(TINY_GOLDEN).build_model()
    with pytest.raises(InputError, match=r"runner output of the prefill"):
        golden.check(TINY_GOLDEN, runner=lambda ids, start_pos=0, full_logits=False: model(ids)[:, None],
                     model=model)


def test_cli_check_passes_and_prints_the_table():
    result = CliRunner().invoke(app, ["golden", "check", "--dir", str(GOLDEN_DIR)])
    assert result.exit_code == 0, result.output
    assert "Golden check" in result.output
    for name in ("tiny ", "tiny2 "):
        assert re.search(rf"{name}\s+prefill logits\s+eager vs golden\s+-\s+\S+\s+1e-05\s+pass", result.output)
    assert re.search(r"tiny2\s+greedy tokens\s+eager vs golden\s+-\s+0/34\s+exact\s+pass", result.output)
    assert "2 golden files: every output within bounds" in result.output


def test_cli_compiled_without_compiler_exits_2(monkeypatch):
    monkeypatch.delattr(dsv41c, "compile", raising=False)
    result = CliRunner().invoke(app, ["golden", "check", "--dir", str(GOLDEN_DIR), "--compiled"])
    assert result.exit_code == 2
    assert "compiler not available" in result.output


def test_cli_compiled_divergence_is_one_red_line(monkeypatch, tiny_only):
    prompt_len = golden.load_golden(TINY_GOLDEN).prompt_len

    backends = []

    def fake_compile(model, backend):
        backends.append(backend)

        def compiled(ids, start_pos=0, full_logits=False):
            out = model(ids, start_pos=start_pos, full_logits=full_logits)
            if start_pos == prompt_len + 3:
                out = out.clone()
                out[0, (out[0].argmax() + 1) % out.shape[-1]] = out[0].max() + 1
            return out
        return compiled

    monkeypatch.setattr(dsv41c, "compile", fake_compile, raising=False)
    result = CliRunner().invoke(app, ["golden", "check", "--dir", str(tiny_only), "--compiled"])
    assert result.exit_code == 2
    assert re.search(r"tiny\s+greedy tokens\s+compiled vs eager\s+4\s+1/34\s+exact\s+FAIL", result.output)
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "compiled vs eager: greedy tokens" in errors[0]
    assert f"greedy token 4 (sequence position {prompt_len + 4}, batch row 0)" in errors[0]
    assert backends == ["passes_only"]
    result = CliRunner().invoke(app, ["golden", "check", "--dir", str(tiny_only), "--compiled", "--backend", "inductor"])
    assert result.exit_code == 2 and backends == ["passes_only", "inductor"]


def test_tampered_config_hash_is_an_error_naming_both(tmp_path):
    stored = golden.load_golden(TINY_GOLDEN).metadata["config_sha256"]
    bad = retagged(TINY_GOLDEN, tmp_path / "tiny.safetensors", config_sha256="0" * 64)
    with pytest.raises(ConfigError, match=rf"hashes to sha256 {stored}.*config_sha256 is {'0' * 64}"):
        golden.check(bad)
    config = json.loads(golden.load_golden(TINY_GOLDEN).metadata["config_json"])
    edited = retagged(TINY_GOLDEN, tmp_path / "edited.safetensors",
                      config_json=json.dumps({**config, "window_size": 8}))
    with pytest.raises(ConfigError, match=rf"config_sha256 is {stored}"):
        golden.check(edited)


def test_file_changed_after_the_manifest_is_an_error(tiny_only):
    retagged(tiny_only / "tiny.safetensors", tiny_only / "tiny.safetensors", date="2000-01-01T00:00:00+00:00")
    result = CliRunner().invoke(app, ["golden", "check", "--dir", str(tiny_only)])
    assert result.exit_code == 2
    assert "differs from the manifest" in result.output


def test_record_is_deterministic(tmp_path):
    first = golden.record(REPO / "configs" / "tiny2.json", tmp_path / "a", decode_steps=4)
    second = golden.record(REPO / "configs" / "tiny2.json", tmp_path / "b", decode_steps=4)
    a, b = load_file(first), load_file(second)
    assert sorted(a) == ["decode_logits", "decode_tokens", "inputs", "prefill_logits"]
    for name in a:
        assert torch.equal(a[name], b[name]), name
    meta = golden.load_golden(first).metadata
    assert (meta["dtype"], meta["kv_quant"], meta["seed"], meta["prompt_len"]) == ("float32", "false", "0", "25")
    assert meta["torch_version"] == torch.__version__ and meta["dsv41c_version"] == dsv41c.__version__
    # A prefix of the committed golden: record reproduces it, within the eager-vs-golden bound.
    committed = load_file(GOLDEN_DIR / "tiny2.safetensors")
    assert torch.equal(a["inputs"], committed["inputs"])
    assert torch.equal(a["decode_tokens"], committed["decode_tokens"][:, :4])
    assert golden.relative_error(a["prefill_logits"], committed["prefill_logits"]) <= golden.GOLDEN_BOUND
    assert golden.relative_error(a["decode_logits"], committed["decode_logits"][:, :4]) <= golden.GOLDEN_BOUND
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["tiny2.safetensors"]


def test_record_rejects_bad_arguments_without_leaving_a_file(tmp_path):
    with pytest.raises(InputError, match="max_batch_size=2"):
        golden.record(REPO / "configs" / "tiny.json", tmp_path, batch=3)
    with pytest.raises(InputError, match="max_seq_len=256"):
        golden.record(REPO / "configs" / "tiny.json", tmp_path, prompt_len=250)
    with pytest.raises(ConfigError, match="config file not found"):
        golden.record(tmp_path / "missing.json", tmp_path)
    assert list(tmp_path.iterdir()) == []
