"""Image-folder datasets for the tests that run tools/train.py on a folder of identities."""
import os

import cv2
import numpy as np


def write_faces(root, identities=8, per_identity=4, size=16, seed=0, undecodable=None):
    """`identities` folders `id<i>` of `per_identity` random size x size PNGs under `root`;
    `undecodable` = (identity, k): that file is 10 bytes of text named `notes.jpg` instead."""
    rng = np.random.default_rng(seed)
    for ident in range(identities):
        os.makedirs(os.path.join(root, f"id{ident}"))
        for k in range(per_identity):
            if (ident, k) == undecodable:
                with open(os.path.join(root, f"id{ident}", "notes.jpg"), "wb") as f:
                    f.write(b"not a face")
                continue
            cv2.imwrite(os.path.join(root, f"id{ident}", f"{k}.png"),
                        rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    return str(root)
