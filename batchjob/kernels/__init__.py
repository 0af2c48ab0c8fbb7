"""Triton kernels for batchjob's numeric ops.

`batchjob.kernels.ops` mirrors `batchjob.model.ops` (same function names, arguments and results): the model runner
picks it on a CUDA device. On a CPU the kernels run only in Triton's interpreter, which must be switched on
(TRITON_INTERPRET=1 in the environment) before `batchjob.kernels.ops` is first imported. Importing this package itself
does not import triton.
"""
