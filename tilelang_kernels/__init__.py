"""TileLang kernels (CUDA and the CPU C target), each beside its `*_ref` and its
`torch.library` registration (on import of the module).

- `quant`: packed KV formats (fp8 / fp4_e4m3 / mxfp4), ops `dsv41c::<fmt>_quant` and
  `dsv41c::<fmt>_dequant`.
- `mhc`: the single-pass mHC stream kernels, ops `dsv41c::mhc_pre`, `dsv41c::mhc_post_pre` and
  `dsv41c::mhc_post_collapse`.
- `attention`: sparse attention with a sink over plain or packed KV rows, ops
  `dsv41c::sparse_attn` and `dsv41c::sparse_attn_packed`.
- `indexer`: indexer scores from packed MXFP4 keys, the top-k and the candidate funnel, ops
  `dsv41c::index_scores`, `dsv41c::index_topk` and `dsv41c::candidate_blocks`.
"""
