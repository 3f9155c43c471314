import os

# Two processes fighting over 2 cores run 3-8x slower; tests are single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

torch.set_num_threads(1)
