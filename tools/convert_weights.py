"""Convert backbone weights between insightface's arcface_torch and plsc (no torch needed).

    python tools/convert_weights.py --to-plsc backbone.pth --model r50 --output r50.pdparams
    python tools/convert_weights.py --to-insightface output/checkpoints/step_00010000 --output r50.pt
    python tools/convert_weights.py --to-insightface r50.pdparams --model r50 --output r50.pt

--to-plsc reads arcface_torch's state_dict (.pt/.pth; also wrapped as {"state_dict": ...} or
with DistributedDataParallel's "module." prefix) into plsc's backbone --model: every key and
shape must fit, the embedding size is the file's, the input size --input-size (default 112).
The .pdparams it writes is what Global.pretrained reads (which also reads the .pt directly).

--to-insightface reads a plsc checkpoint folder (its meta.json names the model and input size)
or a .pdparams (give --model) and writes the file arcface_torch's
`get_model(name, num_features=E).load_state_dict(torch.load(path, weights_only=True))` accepts
strictly: Linear weights transposed to [out, in], BatchNorm running_mean/running_var and
num_batches_tracked (0), float32. Models arcface_torch does not build (IResNetTiny, ViTDemo, an
input size other than 112) are written in the same layout, with a note.

--model takes plsc's names and arcface_torch's: r18, r34, r50, r100, r200, mbf, mbf_large,
vit_t, vit_t_dp005_mask0, vit_s, vit_s_dp005_mask_0, vit_b, vit_b_dp005_mask_005,
vit_l_dp005_mask_005, vit_h. Exit status: 0, 2 for a bad argument or weights that do not fit
(one line naming the keys and shapes), 65 for a damaged checkpoint. More: docs/weights.md.
"""
import argparse

from plsc.cli import positive_int, report_mistake
from plsc.process import ending


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-plsc", metavar="PT", help="arcface_torch weights (.pt/.pth) to read")
    way.add_argument("--to-insightface", metavar="CKPT_OR_PDPARAMS",
                     help="a plsc checkpoint folder or backbone .pdparams to read")
    p.add_argument("--model", help="the backbone (required with --to-plsc and a .pdparams; a "
                   "checkpoint's meta.json names its own)")
    p.add_argument("--output", required=True, help="file to write (.pdparams / .pt)")
    p.add_argument("--input-size", type=positive_int, nargs="+", metavar="N",
                   help="image height [width] the model is built for (default 112, or the "
                   "checkpoint's Data.image_size)")
    p.add_argument("--verify", choices=("full", "size", "none"), default="full",
                   help="check a checkpoint's backbone against its manifest first (default full)")
    a = p.parse_args(argv)
    if a.input_size is not None and len(a.input_size) > 2:
        p.error("--input-size takes one or two numbers (height [width])")
    if a.to_plsc and not a.model:
        p.error("--to-plsc needs --model (e.g. r50, mbf, vit_t)")

    from plsc.apps.weights import insightface_to_pdparams, plsc_to_insightface_file
    try:
        if a.to_plsc:
            lines = [insightface_to_pdparams(a.to_plsc, a.model, a.output, a.input_size)]
        else:
            lines = plsc_to_insightface_file(a.to_insightface, a.output, a.model, a.input_size,
                                             a.verify)
    except Exception as err:  # a damaged checkpoint 65, weights that do not fit 2, ...
        code = report_mistake(err, expected=(ValueError, TypeError))
        if code is None:
            raise
        return code
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    ending.end(main())
