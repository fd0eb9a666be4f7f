"""Triton kernels for ``backend="triton"``: ``forward.py``, ``backward.py`` and ``decode.py`` hold the
``@triton.jit`` code; ``triton_backend.py`` the autograd rule, the ``torch.library`` custom ops and the
backend function. Nothing here is imported until the triton backend is first used."""
