"""Graph passes over the post-grad aten graph (one pass per file, plus `manager.py`):
`fuse_wqa_wkv` (sibling projections into one GEMM) and `lower_mhc` (mHC sites into the TileLang
kernels). Planned: `fp4_kv`."""
