"""Suite-wide settings. The CPU tests run k3-tiny-sized ops, where intra-op threads cost far more than
they give on a 2-core machine (10x slower seen with two threads under load): one thread."""

import torch

torch.set_num_threads(1)
