"""The `dsv41c` command line: `dsv41c run` on the tiny config, and the one-red-line error policy."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import EVERY_PASS
from typer.testing import CliRunner

import dsv41c
from dsv41c.cli import run as run_module
from dsv41c.cli.main import app
from dsv41c.errors import InputError
from dsv41c.generate import generate

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.json"
RATES = re.compile(r"^(\d+) tokens? generated \| prefill: (\d+) tokens?, [\d.]+ tokens/s \| "
                   r"decode: (\d+) tokens?, [\d.]+ tokens/s$")


@pytest.fixture(scope="module")
def tiny_args():
    return dsv41c.ModelArgs.from_json(TINY)


@pytest.fixture(scope="module")
def checkpoint(tiny_args, tmp_path_factory):
    return dsv41c.save_checkpoint(dsv41c.build_model(tiny_args, seed=0), tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def recorded(monkeypatch):
    """The GenerationResults the CLI produced, so tests can compare token ids."""
    results = []

    def recording_generate(*args, **kwargs):
        results.append(generate(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(run_module, "generate", recording_generate)
    return results


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["run", "--device", "cpu", *args], env=env)


def assert_error(result, *fragments: str) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0]
    assert result.stdout == ""
    return lines[0]


def test_run_tiny_prints_text_then_rates(tiny_args, recorded):
    result = invoke("--config", str(TINY), "--prompt", "Hi", "--max-new-tokens", "4")
    assert result.exit_code == 0, (result.output, result.exception)

    expected = generate(dsv41c.build_model(tiny_args, seed=0, kv_quant=True), [256, 72, 105], 4)
    assert recorded[0].prompt_ids == [256, 72, 105]
    assert recorded[0].new_ids == expected.new_ids and len(expected.new_ids) == 4
    assert result.stdout == run_module.printable(expected.text) + "\n" + run_module.rates_line(recorded[0]) + "\n"
    rates = RATES.match(result.stdout.splitlines()[-1])
    assert rates and rates.groups() == ("4", "3", "3")


def test_checkpoint_gives_the_tokens_of_random_init(checkpoint, recorded):
    ids = "256,84,104,101,32,113"
    from_checkpoint = invoke("--model", str(checkpoint), "--prompt-ids", ids, "--max-new-tokens", "5")
    from_seed = invoke("--config", str(TINY), "--seed", "0", "--prompt-ids", ids, "--max-new-tokens", "5")
    assert from_checkpoint.exit_code == 0 and from_seed.exit_code == 0, (from_checkpoint.output, from_seed.output)
    assert recorded[0].new_ids == recorded[1].new_ids and len(recorded[0].new_ids) == 5
    assert from_checkpoint.stdout.splitlines()[:-1] == from_seed.stdout.splitlines()[:-1]


def test_other_seed_and_no_kv_quant_run(recorded):
    result = invoke("--config", str(TINY), "--seed", "1", "--prompt", "a", "--max-new-tokens", "2",
                    "--no-kv-quant", "--dtype", "bfloat16", "--temperature", "0.8")
    assert result.exit_code == 0, (result.output, result.exception)
    assert len(recorded[0].new_ids) == 2


def test_prompt_id_outside_vocabulary():
    assert_error(invoke("--config", str(TINY), "--prompt-ids", "256,72,259"), "259", "0..258")


def test_prompt_ids_not_integers():
    assert_error(invoke("--config", str(TINY), "--prompt-ids", "256,x"), "--prompt-ids", "'x'")


def test_missing_config_file(tmp_path):
    assert_error(invoke("--config", str(tmp_path / "nope.json"), "--prompt", "a"), "nope.json")


def test_default_config_is_the_current_directorys_else_the_installed_copy(tmp_path, monkeypatch):
    """Without --config: configs/tiny.json where the command runs, if there is one (here a broken
    copy, named in the error), else the copy installed with the package (the run works anywhere)."""
    monkeypatch.chdir(tmp_path)
    result = invoke("--prompt", "a", "--max-new-tokens", "1")
    assert result.exit_code == 0, (result.output, result.exception)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "tiny.json").write_text('{"bogus_key": 1}')
    assert_error(invoke("--prompt", "a"), "configs/tiny.json", "bogus_key")


def test_config_with_unknown_key(tmp_path):
    raw = json.loads(TINY.read_text())
    raw["bogus_key"] = 1
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    assert_error(invoke("--config", str(path), "--prompt", "a"), "bogus_key", "bad.json")


def test_missing_tokenizer_file(tmp_path):
    assert_error(invoke("--config", str(TINY), "--tokenizer", str(tmp_path / "t.json"), "--prompt", "a"), "t.json")


@pytest.mark.parametrize("extra", [
    ["--prompt-ids", ",".join(["72"] * 300)],
    ["--prompt", "a", "--max-new-tokens", "300"],
])
def test_prompt_longer_than_max_seq_len(extra):
    assert_error(invoke("--config", str(TINY), *extra), "max_seq_len=256")


def test_short_max_seq_len_config(tmp_path):
    raw = json.loads(TINY.read_text())
    raw["max_seq_len"] = 8
    path = tmp_path / "short.json"
    path.write_text(json.dumps(raw))
    assert_error(invoke("--config", str(path), "--prompt", "far too long a prompt"), "max_seq_len=8")


@pytest.mark.parametrize("args, fragment", [
    (["--prompt", "a", "--prompt-ids", "1"], "--prompt-ids"),
    ([], "no prompt"),
    (["--config", str(TINY), "--model", ".", "--prompt", "a"], "--model"),
])
def test_conflicting_or_missing_options(args, fragment):
    assert_error(invoke(*args), fragment)


def test_model_directory_without_checkpoint(tmp_path):
    assert_error(invoke("--model", str(tmp_path), "--prompt", "a"), "config.json")


def test_debug_env_shows_the_exception():
    result = invoke("--config", str(TINY), "--prompt-ids", "999", env={"DSV41C_DEBUG": "1"})
    assert result.exit_code == 1 and isinstance(result.exception, InputError)


def test_help_and_version():
    runner = CliRunner()
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "run" in result.stdout
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"dsv41c {dsv41c.__version__}"
    # docstrings are wrapped at 120 in the source: the help reflows their paragraphs to the terminal
    result = runner.invoke(app, ["compile", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "then times them eager and compiled." in result.stdout, result.stdout


def test_console_script_exit_code_and_stderr(tmp_path):
    """The installed entry point (`dsv41c.cli.main:app`) as a real process: exit 2, one line."""
    script = Path(sys.executable).with_name("dsv41c")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "dsv41c.cli.main"]
    env = {k: v for k, v in os.environ.items() if k != "DSV41C_DEBUG"}
    proc = subprocess.run([*command, "run", "--config", str(tmp_path / "missing.json"), "--prompt", "a"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config") and "missing.json" in lines[0], proc.stderr


# ---------------------------------------------------------------------------- dsv41c compile
@pytest.fixture
def one_layer(tmp_path):
    """tiny's dimensions, one ratio-0 layer with 2 experts: the smallest whole model to compile."""
    raw = json.loads(TINY.read_text())
    raw.update(n_layers=1, n_mtp_layers=0, compress_ratios=[0], kv_source_layers=[], index_source_layers=[],
               candidate_source_layer=-1, candidate_topk_blocks=0, candidate_block_size=0, n_routed_experts=2,
               n_activated_experts=1, hc_sinkhorn_iters=1, engram_layer_ids=[], engram_num_embeddings=[],
               dspark_block_size=0, dspark_target_layer_ids=[])
    path = tmp_path / "one.json"
    path.write_text(json.dumps(raw))
    return path


def compile_cli(*args: str):
    return CliRunner().invoke(app, ["compile", *args], env={"COLUMNS": "200"})


def test_compile_report_and_graph_dumps(one_layer, tmp_path):
    dump = tmp_path / "graphs"
    result = compile_cli("--config", str(one_layer), "--report", "--backend", "passes_only", "--prompt-len", "5",
                         "--decode-steps", "2", "--dump-graphs", str(dump))
    assert result.exit_code == 0, (result.output, result.exception)
    # prefill: {wq_a, wkv} on x, {gate, shared w1, w3}, and {w1, w3} of each routed expert on its tokens;
    # decode: the first two (the routed experts run as one gathered bmm)
    assert re.search(r"2 graphs compiled in [\d.]+ s \(backend passes_only\); passes: fuse_wqa_wkv 6 matches",
                     result.stdout)
    rows = re.findall(r"^\s*(\d)\s+(prefill of 5|decode at position 5)\s+(as traced|after fuse_wqa_wkv)\s+(\d+)\s+"
                      r"(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*$", result.stdout, re.M)
    counts = {(g, stage): tuple(map(int, rest)) for g, _, stage, *rest in rows}
    assert len(counts) == 4
    for g, fused_away in (("1", 1 + 2 + 2 * 1), ("2", 1 + 2)):       # each group of n loses n - 1 GEMMs
        before, after = counts[(g, "as traced")], counts[(g, "after fuse_wqa_wkv")]
        assert before[0] - after[0] == fused_away
        assert before[1:4] == after[1:4] and before[2] > 0 and before[3] == 1     # the window ring
    assert re.search(r"prefill\s+[\d.]+\s+[\d.]+\s+[\d.]+", result.stdout)
    error = float(re.search(r"against eager: (\S+)", result.stdout).group(1))
    assert error <= 1e-4
    names = sorted(p.name for p in dump.iterdir())
    assert names == ["graph1_0_as_traced.py", "graph1_1_after_fuse_wqa_wkv.py", "graph2_0_as_traced.py",
                     "graph2_1_after_fuse_wqa_wkv.py"]
    for g in ("1", "2"):
        before = (dump / f"graph{g}_0_as_traced.py").read_text()
        after = (dump / f"graph{g}_1_after_fuse_wqa_wkv.py").read_text()
        assert "_dsv41c_fused_weight" in after and "_dsv41c_fused_weight" not in before
        assert after.count("torch.ops.aten.mm.default(") < before.count("torch.ops.aten.mm.default(")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("make, fragment", [
    (lambda tmp: tmp / "missing" / "graphs", "does not exist"),
    (lambda tmp: (tmp / "full").mkdir() or (tmp / "full" / "x").write_text("x") and tmp / "full", "non-empty"),
    (lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "found a file"),
])
def test_compile_bad_dump_dir_fails_before_compiling(tmp_path, make, fragment):
    dump = make(tmp_path)
    listing = sorted(p.name for p in tmp_path.rglob("*"))
    result = compile_cli("--config", str(TINY), "--dump-graphs", str(dump))
    line = assert_error(result, "--dump-graphs", fragment)
    assert str(dump) in line
    assert sorted(p.name for p in tmp_path.rglob("*")) == listing


def test_compile_unknown_pass_is_one_red_line():
    assert_error(compile_cli("--config", str(TINY), "--pass", "nope"), "unknown pass 'nope'")


def test_compile_fp4_kv_with_kv_quant_in_bf16(one_layer):
    """--kv-quant lets the CLI run fp4_kv: it matches the one layer's window writes, and the logits
    stay within the bf16 bound of eager bf16 with kv_quant (tests/test_fp4_kv.py counts every
    rewrite)."""
    result = compile_cli("--config", str(one_layer), "--backend", "passes_only", "--device", "cpu",
                         "--dtype", "bfloat16", "--kv-quant", "--pass", "fuse_wqa_wkv", "--pass", "fp4_kv",
                         "--prompt-len", "5", "--decode-steps", "2")
    assert result.exit_code == 0, (result.output, result.exception)
    matches = re.search(r"passes: fuse_wqa_wkv (\d+) matches, fp4_kv (\d+) matches", result.stdout)
    assert matches and int(matches.group(1)) > 0 and int(matches.group(2)) > 0, result.stdout
    assert re.search(r"tokens/s on cpu", result.stdout)
    assert float(re.search(r"against eager: (\S+)", result.stdout).group(1)) <= 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compile_every_pass_with_cudagraphs_on_cuda(one_layer):
    """The CLI's graphed compile on CUDA with every pass, bf16 and packed caches. At tiny's head dim
    (64) the packed attention has no CUDA build, so lower_sparse_attn leaves those sites to fp4_kv's
    dequantised rows (warned); the rest lowers."""
    result = compile_cli("--config", str(one_layer), "--device", "cuda", "--dtype", "bfloat16", "--kv-quant",
                         "--cudagraphs", *(a for p in EVERY_PASS for a in ("--pass", p)),
                         "--prompt-len", "5", "--decode-steps", "4")
    assert result.exit_code == 0, (result.output, result.exception)
    assert re.search(r"fp4_kv [1-9]\d* matches", result.stdout)
    assert re.search(r"\(inductor,\s+CUDA\s+graphs\),\s+tokens/s\s+on\s+cuda", result.stdout)  # a wrapped title
    assert float(re.search(r"against eager: (\S+)", result.stdout).group(1)) <= 2e-2


def test_compile_fp4_kv_without_kv_quant_is_one_red_line(one_layer):
    assert_error(compile_cli("--config", str(one_layer), "--backend", "passes_only", "--device", "cpu",
                             "--pass", "fp4_kv"), "fp4_kv", "kv_quant=True")


def test_compile_strict_pass_error_is_one_red_line(one_layer):
    """A pass's error raised while Dynamo compiles (one_layer has no indexer site, so strict
    lower_indexer matches nothing) reaches the CLI as itself, not inside Dynamo's wrapper."""
    assert_error(compile_cli("--config", str(one_layer), "--backend", "passes_only", "--device", "cpu", "--strict",
                             "--pass", "lower_indexer", "--prompt-len", "5", "--decode-steps", "1"),
                 "pass lower_indexer: no match in graph 1 (strict mode)")


@pytest.mark.parametrize("extra, fragment", [
    (("--device", "cpu"), "--device cpu"),
    (("--backend", "passes_only"), "--backend passes_only"),
    (("--cpp-wrapper",), "--cpp-wrapper"),
])
def test_compile_cudagraphs_requirements_are_checked_first(extra, fragment, monkeypatch):
    monkeypatch.setattr(run_module.torch.cuda, "is_available", lambda: True)     # --device cuda resolves
    device = () if "--device" in extra else ("--device", "cuda")
    line = assert_error(compile_cli("--config", str(TINY), "--cudagraphs", *device, *extra),
                        "--cudagraphs: needs --device cuda, --backend inductor and no --cpp-wrapper")
    assert fragment in line.split("found", 1)[1]


def test_compile_cpp_wrapper_needs_the_inductor_backend():
    assert_error(compile_cli("--config", str(TINY), "--cpp-wrapper", "--backend", "passes_only"),
                 "--cpp-wrapper", "--backend passes_only generates none")
