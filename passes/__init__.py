"""Graph passes over the post-grad aten graph (one pass per file, plus `manager.py`):
`lower_mhc` (mHC sites into the TileLang kernels), `fuse_wqa_wkv` (sibling projections into one
GEMM) and `fp4_kv` (packed KV caches through the codec kernels); `provenance.py` finds the eager
call sites they rewrite."""
