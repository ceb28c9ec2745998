"""benchmarks/compile.py's handling of a first pass that runs out of device memory: beside
`--parallel`'s siblings it is retried once, alone, in the timing phase; alone it is a result."""
import argparse
import contextlib
import sys
from pathlib import Path

import pytest
import torch

import dsv41c

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delitem(sys.modules, "compile", raising=False)
    import compile as bench
    return bench


def _run(bench, monkeypatch, sync_dir, ooms: int):
    """measure() of the eager variant on tiny, one decode workload, whose first `ooms` calls of the
    model raise the allocator's out-of-memory error; the timing phase records where it began."""
    args = dsv41c.ModelArgs.from_json(ROOT / "configs/tiny.json")
    model = dsv41c.build_model(args, seed=0)
    calls, events = [0], []

    def variant(name, m):
        def run(*a, **k):
            calls[0] += 1
            if calls[0] <= ooms:
                events.append("oom")
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.04 GiB.")
            return m(*a, **k)
        return run

    @contextlib.contextmanager
    def timing():
        events.append("timing")
        yield

    monkeypatch.setattr(bench, "make_variant", variant)
    monkeypatch.setattr(bench, "hardware", lambda a: {"copy_bytes_per_s": 1.0, "matmul_flop_per_s": 1.0})
    a = argparse.Namespace(prefill_len=0, batches=[1], decode_prompt=3, decode_steps=1, long_context=0,
                           device="cpu", repeats=1, profile=False, sync_dir=sync_dir)
    out = {}
    bench.measure("eager", model, a, torch.Generator().manual_seed(0), out, timing=timing)
    return out, events


def test_oom_beside_siblings_is_retried_alone_in_the_timing_phase(bench, monkeypatch, tmp_path):
    out, events = _run(bench, monkeypatch, tmp_path, ooms=1)
    assert events == ["oom", "timing"]
    assert "decode_b1_tok_s_error" not in out
    assert out["decode_b1_tok_s_first_pass_s"] > 0 and out["decode_b1_tok_s"] > 0


def test_a_second_oom_and_an_oom_alone_are_recorded_as_failures(bench, monkeypatch, tmp_path):
    out, events = _run(bench, monkeypatch, tmp_path, ooms=2)
    assert events == ["oom", "timing", "oom"]
    assert out["decode_b1_tok_s"] is None and out["decode_b1_tok_s_error"].startswith("OutOfMemoryError")
    out, events = _run(bench, monkeypatch, None, ooms=1)
    assert events == ["oom", "timing"]
    assert out["decode_b1_tok_s"] is None and out["decode_b1_tok_s_error"].startswith("OutOfMemoryError")
