"""Make a verification pack (``.bin``, as insightface's lfw.bin) from a pairs list.

    python tools/make_verification_bin.py --pairs PAIRS --output val.bin [--root DIR]
                                          [--landmarks LIST] [--image-size 112]

PAIRS: lines `path1 path2 same` (same: 1/0 or true/false), or LFW's pairs.txt (`name n1 n2`
for a matched pair, `name1 n1 name2 n2` for a mismatched one, images ROOT/name/name_000n.jpg).
Paths are relative to --root (default: the pairs file's folder). Without --landmarks each
image's file is stored as it is (decoded once to check it); with --landmarks (lines
`path x1 y1 x2 y2 x3 y3 x4 y4 x5 y5`, paths relative to the same root) each face is aligned
with plsc.data.align to --image-size and stored as JPEG. The pack is written atomically; plsc
(Eval.targets) and insightface's reader read it. Bad input ends with one line naming the file
(and line) and exit status 65; a bad command line with 2.
"""
import argparse
import os

from plsc.process import ending, startup

startup.hold()  # first, before anything imports Paddle: a SIGTERM now ends the run with 75

from plsc.cli import JPEG_QUALITY, positive_int, report_summary  # noqa: E402
from plsc.data.errors import DataError  # noqa: E402
from plsc.data.prepare import aligned_jpeg, read_bytes, read_landmark_list, read_pairs  # noqa: E402
from plsc.data.transforms import decode_image  # noqa: E402
from plsc.data.verification import write_verification_bin  # noqa: E402


def make(pairs_path, output, root=None, landmarks=None, image_size=112, quality=95):
    """Write the pack; returns a summary dict."""
    root = os.path.dirname(os.path.abspath(pairs_path)) if root is None else root
    pairs = read_pairs(pairs_path, root)
    points = {}
    if landmarks:
        paths, _, marks = read_landmark_list(landmarks, root, labels=False)
        points = {os.path.normpath(p): m for p, m in zip(paths, marks)}
    images = []
    for a, b, _ in pairs:
        for path in (a, b):
            if landmarks:
                key = os.path.normpath(path)
                if key not in points:
                    raise DataError(f"{landmarks}: no landmarks for {path} (named in {pairs_path})")
                images.append(aligned_jpeg(path, points[key], (image_size, image_size), quality))
            else:
                buf = read_bytes(path)
                try:
                    decode_image(buf)
                except DataError as err:
                    raise DataError(f"{path}: {err}") from None
                images.append(buf)
    write_verification_bin(output, images, [same for _, _, same in pairs])
    return {"output": output, "pairs": len(pairs), "same": sum(s for _, _, s in pairs),
            "aligned": bool(landmarks)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", required=True, help="pairs list or LFW pairs.txt")
    parser.add_argument("--output", required=True, help="the .bin to write")
    parser.add_argument("--root", default=None, help="folder the image paths are relative to")
    parser.add_argument("--landmarks", default=None, help="'path x1 y1 ... x5 y5' lines: align the faces")
    parser.add_argument("--image-size", type=positive_int, default=112, help="aligned crop size (with --landmarks)")
    parser.add_argument("--quality", type=JPEG_QUALITY, default=95, help="JPEG quality of aligned faces")
    args = parser.parse_args(argv)
    return report_summary(lambda: make(
        args.pairs, args.output, args.root, args.landmarks, args.image_size, args.quality))


if __name__ == "__main__":
    ending.end(main())
