"""TileLang kernels (CUDA and the CPU C target), each beside its `*_ref` and its
`torch.library` registration.

- `quant`: packed KV formats (fp8 / fp4_e4m3 / mxfp4), ops `dsv41c::<fmt>_quant` and
  `dsv41c::<fmt>_dequant`, registered on import of `dsv41c.tilelang_kernels.quant`.

The other kernel families are not written yet: planned work."""
