"""Pack an image folder (one sub-folder per identity) or a list file (`path label`
lines) into insightface's `train.rec`, `train.idx` and `property`.

    python tools/pack_rec.py --input DIR_OR_LIST --output ROOT [--image-size 112]

Images are stored as they are unless --image-size is given, in which case they
are resized and re-encoded as JPEG. Every image is decoded once to check it;
an undecodable one stops the run (or is left out with --skip-bad).
"""
import argparse
import json
import logging
import os
import sys

import cv2

from plsc.data.errors import DataError
from plsc.data.facerec import write_face_rec
from plsc.data.sources import read_image_list, scan_image_folder
from plsc.data.transforms import decode_image

logger = logging.getLogger("pack_rec")


def _check(paths, labels, skip_bad):
    """Decode every image: drop (with `skip_bad`) or report the bad ones."""
    good_paths, good_labels, shapes, skipped = [], [], [], 0
    for path, label in zip(paths, labels):
        try:
            with open(path, "rb") as f:
                shapes.append(decode_image(f.read()).shape[:2])
        except (DataError, OSError) as err:
            if not skip_bad:
                raise DataError(f"{path}: {err}") from None
            skipped += 1
            logger.warning("skipped %s (%d skipped so far): %s", path, skipped, err)
            continue
        good_paths.append(path)
        good_labels.append(label)
    return good_paths, good_labels, shapes, skipped


def _encoded(paths, size, quality):
    for path in paths:
        with open(path, "rb") as f:
            buf = f.read()
        if size:
            img = cv2.resize(decode_image(buf), (size[1], size[0]), interpolation=cv2.INTER_AREA)
            buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])[1]
            buf = buf.tobytes()
        yield buf


def pack(input_path, output, image_size=None, quality=95, header=True, skip_bad=False, verify=True,
         list_root=None, prefix="train"):
    """Pack `input_path` into `output`; returns a summary dict."""
    if os.path.isdir(input_path):
        paths, labels, _ = scan_image_folder(input_path)
    else:
        paths, labels, _ = read_image_list(input_path, list_root)
    num_classes = max(labels) + 1 if labels else 0
    shapes, skipped = [], 0
    if verify or skip_bad:
        paths, labels, shapes, skipped = _check(paths, labels, skip_bad)
    if not paths:
        raise DataError(f"{input_path}: no images to pack")
    if image_size:
        hw = (image_size, image_size)
    else:
        if not shapes:
            with open(paths[0], "rb") as f:
                shapes = [decode_image(f.read()).shape[:2]]
        hw = shapes[0]
        if len(set(shapes)) > 1:
            logger.warning("images come in %d sizes; property records the first, %s", len(set(shapes)), hw)
    n = write_face_rec(output, labels, _encoded(paths, image_size and hw, quality), hw, num_classes=num_classes,
                       header=header, prefix=prefix)
    return {"output": output, "num_images": n, "num_classes": num_classes, "image_size": list(hw),
            "skipped": skipped}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="image folder (one sub-folder per identity) or list file")
    parser.add_argument("--output", required=True, help="folder to write train.rec, train.idx and property into")
    parser.add_argument("--image-size", type=int, default=None, help="resize to this square size and re-encode")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality when re-encoding")
    parser.add_argument("--no-header", action="store_true", help="im2rec layout: no header record, keys from 0")
    parser.add_argument("--skip-bad", action="store_true", help="leave out undecodable images instead of failing")
    parser.add_argument("--no-verify", action="store_true", help="do not decode images to check them")
    parser.add_argument("--list-root", default=None, help="folder that list-file paths are relative to")
    parser.add_argument("--prefix", default="train", help="file name stem of the .rec and .idx")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        summary = pack(args.input, args.output, args.image_size, args.quality, not args.no_header, args.skip_bad,
                       not args.no_verify, args.list_root, args.prefix)
    except DataError as err:
        print(f"pack_rec: error: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
