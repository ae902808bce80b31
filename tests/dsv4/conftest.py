"""tests/dsv4 imports sglang's DSV4 kernel modules, which define Triton kernels.

TRITON_INTERPRET is read when a @triton.jit function is defined, and one pytest process must not
hold a mix of compiled and interpreted kernels: tests/kernel, collected after this folder, runs
ours in the interpreter, and kernels that this folder's modules defined without the variable
break it there ("Cannot call @triton.jit'd outside of the scope of a kernel", seen in a full
`pytest tests` run). So it is set here too, before this folder's test modules import sglang.
bench/dsv4_check and the engine test set it in their own processes as well.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
