import os
import sys

# Triton kernels run under the interpreter on machines without a GPU (SPEC 7). This must be set
# before triton is first imported.
if os.environ.get("CUDA_VISIBLE_DEVICES", None) != "" and os.path.exists("/dev/nvidia0"):
    pass
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))
