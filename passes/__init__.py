"""Graph passes over the post-grad aten graph (one pass per file, plus `manager.py`).

Not written yet: the compiler (`dsv41c.compile`), `fuse_wqa_wkv`, `lower_mhc` and `fp4_kv`
are planned work. Importing this package is harmless.
"""
