"""Where kernel tests run: the GPU when there is one, else the CPU under Triton's interpreter.

Tests draw inputs on the CPU from a seeded generator and move them to DEVICE, so the same seed
gives the same inputs on both, and the same test file checks the compiled kernels on a GPU.
"""

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
