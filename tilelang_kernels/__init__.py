"""TileLang kernels (CUDA and the CPU C target), each beside its `*_ref` and its
`torch.library` registration. Not written yet: planned work."""
