"""The compiled decode step of the whole tiny model against eager (slow: several minutes of
Inductor compile per graph on a CPU core, so it is opt-in: `pytest -m slow tests/test_compile.py`)."""
from pathlib import Path

import pytest
import torch

import dsv41c
from dsv41c.compiler import compile as dsv41c_compile

pytestmark = pytest.mark.slow
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.json"


def test_compiled_decode_matches_eager_with_fused_projections():
    torch._dynamo.reset()
    args = dsv41c.ModelArgs.from_json(TINY)
    model, eager = dsv41c.build_model(args, seed=0), dsv41c.build_model(args, seed=0)
    compiled = dsv41c_compile(model, strict=True)
    ids = torch.randint(0, 259, (2, 40), generator=torch.Generator().manual_seed(0))
    model(ids, 0)                                   # eager prefill seeds the shared caches
    token = eager(ids, 0).argmax(-1, keepdim=True)
    with torch._inductor.config.patch(max_fusion_buffer_group_pairwise_attempts=4, fx_graph_cache=False):
        for p in range(40, 44):
            a, b = compiled(token, p), eager(token, p)
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-4
            assert torch.equal(a.argmax(-1), b.argmax(-1))
            token = b.argmax(-1, keepdim=True)
    # every backbone attention's input feeds one fused GEMM in each compiled graph
    assert compiled.pipeline.stats["fuse_wqa_wkv"].matches >= args.n_layers * compiled.pipeline.graphs
