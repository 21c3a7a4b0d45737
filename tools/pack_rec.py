"""Pack an image folder (one sub-folder per identity) or a list file (`path label`
lines) into insightface's `train.rec`, `train.idx` and `property`.

    python tools/pack_rec.py --input DIR_OR_LIST --output ROOT [--image-size 112]
    python tools/pack_rec.py --landmarks LIST --output ROOT [--image-size 112] [--workers 4]

Images are stored as they are unless --image-size is given, in which case they
are resized and re-encoded as JPEG. Every image is decoded once to check it;
an undecodable one stops the run (or is left out with --skip-bad).

--landmarks replaces --input: a list of `path label x1 y1 x2 y2 x3 y3 x4 y4 x5 y5`
lines (five points from your face detector: eyes, nose tip, mouth corners; paths
relative to --list-root, default the list's folder); each face is aligned with
plsc.data.align to --image-size (default 112) and stored as JPEG. --workers N
encodes in N processes; the output is byte-identical to one worker's.
Bad input ends with one line naming the file (and line) and exit status 65.
"""
import argparse
import functools
import logging
import os

from plsc.process import ending, startup

startup.hold()  # first, before anything imports Paddle: a SIGTERM now ends the run with 75

from plsc.cli import JPEG_QUALITY, positive_int, report_summary  # noqa: E402
from plsc.data.errors import DataError  # noqa: E402
from plsc.data.pool import in_order  # noqa: E402
from plsc.data.prepare import aligned_or_error, read_landmark_list, resized_jpeg  # noqa: E402
from plsc.data.facerec import write_face_rec  # noqa: E402
from plsc.data.sources import read_image_list, scan_image_folder  # noqa: E402
from plsc.data.transforms import decode_image  # noqa: E402

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


def _encoded(paths, size, quality, workers=1):
    yield from in_order(functools.partial(resized_jpeg, size, quality), paths, workers)


def pack_aligned(landmarks, output, image_size=112, quality=95, header=True, skip_bad=False,
                 list_root=None, prefix="train", workers=1):
    """Pack the faces of the landmark list `landmarks` aligned to image_size x image_size."""
    paths, labels, points = read_landmark_list(landmarks, list_root)
    if not paths:
        raise DataError(f"{landmarks}: no images to pack")
    hw = (image_size, image_size)
    num_classes = max(labels) + 1
    skipped = 0
    if skip_bad:  # decode each image once first: the labels are written before the images
        _, keep, _, skipped = _check(paths, list(range(len(paths))), True)  # kept indices
        paths, labels, points = [paths[i] for i in keep], [labels[i] for i in keep], points[keep]

    def faces():
        for buf, err in in_order(functools.partial(aligned_or_error, hw, quality), list(zip(paths, points)),
                                workers):
            if err is not None:
                raise DataError(err)
            yield buf

    n = write_face_rec(output, labels, faces(), hw, num_classes=num_classes, header=header, prefix=prefix)
    return {"output": output, "num_images": n, "num_classes": num_classes, "image_size": list(hw),
            "skipped": skipped, "aligned": True}



def pack(input_path, output, image_size=None, quality=95, header=True, skip_bad=False, verify=True,
         list_root=None, prefix="train", workers=1):
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
    n = write_face_rec(output, labels, _encoded(paths, image_size and hw, quality, workers), hw, num_classes=num_classes,
                       header=header, prefix=prefix)
    return {"output": output, "num_images": n, "num_classes": num_classes, "image_size": list(hw),
            "skipped": skipped}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", help="image folder (one sub-folder per identity) or list file")
    source.add_argument("--landmarks", help="list of 'path label x1 y1 ... x5 y5' lines, replacing --input: "
                        "each face aligned (plsc.data.align) to --image-size (default 112)")
    parser.add_argument("--output", required=True, help="folder to write train.rec, train.idx and property into")
    parser.add_argument("--image-size", type=positive_int, default=None, help="resize to this square size and re-encode")
    parser.add_argument("--quality", type=JPEG_QUALITY, default=95, help="JPEG quality when re-encoding")
    parser.add_argument("--no-header", action="store_true", help="im2rec layout: no header record, keys from 0")
    parser.add_argument("--skip-bad", action="store_true", help="leave out undecodable images instead of failing")
    parser.add_argument("--no-verify", action="store_true", help="do not decode images to check them")
    parser.add_argument("--list-root", default=None, help="folder that list-file paths are relative to")
    parser.add_argument("--prefix", default="train", help="file name stem of the .rec and .idx")
    parser.add_argument("--workers", type=positive_int, default=1,
                        help="processes encoding images (output byte-identical to 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    if args.landmarks:
        return report_summary(lambda: pack_aligned(
            args.landmarks, args.output, args.image_size or 112, args.quality, not args.no_header,
            args.skip_bad, args.list_root, args.prefix, args.workers))
    return report_summary(lambda: pack(
        args.input, args.output, args.image_size, args.quality, not args.no_header, args.skip_bad,
        not args.no_verify, args.list_root, args.prefix, args.workers))


if __name__ == "__main__":
    ending.end(main())
