"""Train a face-recognition model from a YAML config.

    python -m paddle.distributed.launch --nproc_per_node 8 tools/train.py -c configs/arcface_r50.yaml
    python tools/train.py -c configs/demo.yaml -o Global.max_steps=100     # one process
    srun --ntasks 8 python tools/train.py -c configs/arcface_r50.yaml     # a rank per Slurm task

On SIGTERM or SIGINT (to any rank, its process group or every process of the job) every rank
finishes the current step, a checkpoint is written and the process exits with status 75
("preempted"); with Global.checkpoint: auto the same command resumes from it. A checkpoint
predicted not to end within Checkpoint.grace_seconds of the signal is not started: the exit
(75) names the checkpoint the next start resumes from. Before the first step it exits with 75 at once (nothing to
save yet). When another rank dies, the others exit with status 69 and one line naming it.
When a checkpoint cannot be written (disk full, I/O error) every rank exits with status 74
and one line. An output folder that another job is using stops the job before its first step
with status 73, one that cannot be written with 74. When the loss or gradients stay
non-finite for more than Global.max_nonfinite_steps steps in a row, every rank exits with
status 70 and one line naming the last finite checkpoint (see docs/faults.md).
"""
import sys

from plsc.process import ending, startup

startup.hold()  # first, before anything imports Paddle: a SIGTERM now ends the run with 75

from plsc.cli import config_parser, run_tool  # noqa: E402


def train(cfg):
    from plsc.train import Trainer
    from plsc.checkpoint import CheckpointSaveError
    from plsc.process.exits import (DIVERGED_EXIT_CODE, IO_ERROR_EXIT_CODE, PREEMPTED_EXIT_CODE,
                                    RANK_LOST_EXIT_CODE)
    from plsc.train.preemption import Preempted, RankLost
    from plsc.train.divergence import Diverged
    try:
        Trainer(cfg).train()
    except Preempted as err:
        print(f"plsc: {err}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT_CODE
    except RankLost as err:
        print(f"plsc: {err}", file=sys.stderr, flush=True)
        return RANK_LOST_EXIT_CODE
    except CheckpointSaveError as err:
        print(f"plsc: {err}", file=sys.stderr, flush=True)
        return IO_ERROR_EXIT_CODE
    except Diverged as err:
        print(f"plsc: {err}", file=sys.stderr, flush=True)
        return DIVERGED_EXIT_CODE


def main(argv=None):
    parser = config_parser("Train a backbone with a class-sharded margin-softmax head (PartialFC).",
                           "-o Optimizer.lr=0.05")
    return run_tool(parser.parse_args(argv), train, before="the first step")


if __name__ == "__main__":
    ending.end(main())
