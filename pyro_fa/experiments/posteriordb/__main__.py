"""``python -m pyro_fa.experiments.posteriordb [NAME ...]``: the score and Stein identities of every
port (or the named ones) against its reference draws, as a Markdown table."""
import sys

import torch

from pyro_fa.experiments.posteriordb.identities import identity_table

torch.set_num_threads(1)
print(identity_table(sys.argv[1:] or None))
