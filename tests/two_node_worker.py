"""One node's rank of a two-node run: trains a few steps and reports what it saw.

    conftest.run_ranks(two_node_worker.py, 1, [DATA, OUT],
                       launch_args=["--nnodes", "2", "--master", "127.0.0.1:PORT", "--rank", NODE])
"""
import os
import sys

import rank_report
from trainer_common import config

from plsc.distributed import get_rank, get_world_size
from plsc.process import ending
from plsc.train import Trainer

data, out = sys.argv[1], sys.argv[2]
trainer = Trainer(config(data, os.path.join(out, "run"), Global={"max_steps": 4}))
history = trainer.train()
rank = get_rank()
rank_report.write({"rank": rank, "world_size": get_world_size(), "losses": [v for _, v in history],
                   # trainable weights only: BatchNorm running statistics are per rank, as in
                   # insightface
                   "backbone": {n: float(p.abs().sum())
                                for n, p in trainer.backbone.named_parameters()
                                if not p.stop_gradient}}, rank)
ending.end(0)
