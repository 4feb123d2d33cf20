"""Logging namespace of ddp_split_backend.

``TORCH_LOGS=ddp_split`` (bucket tables) and ``TORCH_LOGS=+ddp_split`` (also the split graph
and every piece's code) work because torch accepts any importable module name in TORCH_LOGS
and routes the loggers under it through its own handlers, composing with other settings
such as ``TORCH_LOGS=ddp_split,graph_breaks``. This package deliberately imports nothing:
torch looks it up while torch itself is being imported. The API lives in
:mod:`ddp_split_backend`.
"""
