"""The PLSC-style Python API on the CPU demo data.

    python -m paddle.distributed.launch --nproc_per_node 2 demo/entry_demo.py
    python demo/entry_demo.py --steps 20          # one process, a short run

Trains a small IResNet with a class-sharded CosFace head on synthetic identities
(generated on first use), verifies on held-out identities, and exports the backbone.
"""
import argparse

from plsc import Entry
from plsc.process import ending


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help="train this many steps instead of 2 epochs")
    p.add_argument("--output", default="./output/entry_demo")
    p.add_argument("--data", default="./output/demo_data")
    a = p.parse_args()

    ins = Entry()
    ins.set_device("cpu")
    ins.set_model_name("IResNetTiny")
    ins.set_emb_size(128)
    ins.set_class_num(1000)
    ins.set_loss_type("dist_cosface")
    ins.set_margin(scale=30.0, m3=0.35)
    ins.set_dataset_type("synthetic")
    ins.set_dataset_dir(a.data)
    ins.set_image_size(56)
    ins.set_train_batch_size(64)
    ins.set_train_epochs(2)
    if a.steps:
        ins.set_train_steps(a.steps)
    ins.set_lr(0.1)
    ins.set_val_targets(["val"])
    ins.set_test_period(100)
    ins.set_model_save_dir(a.output)
    ins.train()
    ins.test()
    print(ins.convert_for_prediction(onnx=False))


if __name__ == "__main__":
    main()
    ending.end(0)  # a launched rank leaves without the C++ static destructors (docs/faults.md)
