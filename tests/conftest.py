"""The suite is the CPU suite: on a GPU host too, every test and every process it starts sees no
GPU (gloo, fp32, any number of ranks), as on CI. Set before anything initialises CUDA."""

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""
