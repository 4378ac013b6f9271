from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA (tests/gpu runs on the GPU machine)", allow_module_level=True)
