"""One node's rank of a two-node run: trains a few steps and writes what it saw.

    python -m paddle.distributed.launch --nnodes 2 --master 127.0.0.1:PORT --nproc_per_node 1 \
        tests/two_node_worker.py DATA OUT
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_common import config  # noqa: E402

from plsc.distributed import get_rank, get_world_size  # noqa: E402
from plsc.train import Trainer  # noqa: E402

data, out = sys.argv[1], sys.argv[2]
trainer = Trainer(config(data, os.path.join(out, "run"), Global={"max_steps": 4}))
history = trainer.train()
rank = get_rank()
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"rank": rank, "world_size": get_world_size(), "losses": [v for _, v in history],
               # trainable weights only: BatchNorm running statistics are per rank, as in insightface
               "backbone": {n: float(p.abs().sum()) for n, p in trainer.backbone.named_parameters()
                            if not p.stop_gradient}}, f)
