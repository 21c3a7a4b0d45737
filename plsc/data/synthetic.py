"""Synthetic identities: a training rec and a held-out verification pack.

Each identity is a random prototype: a smooth colour background with a few
random ellipses and polygons. Its images are the prototype under pose-like
affine jitter (rotation, scale, shift), lighting (contrast, brightness, a
directional gradient), colour gains, blur and noise. A model must learn
which differences are nuisance to tell unseen identities apart, so a net
trained on the training identities generalises to the held-out ones.

`generate_ijb` writes an IJB-B/IJB-C style layout (insightface's IJB release:
meta files and loose crops with five landmarks) of such identities.
"""
import os

import cv2
import numpy as np

from ..fileio import atomic_write, write_image
from .align import reference_points
from .facerec import write_face_rec
from .ijb_1n import ijb_1n_paths
from .verification import write_verification_bin

__all__ = ["make_template", "make_prototype", "render_sample", "generate", "generate_ijb",
           "write_ijb_1n_lists", "generate_megaface"]


def make_template(rng, size, num_parts=6):
    """The layout all identities share: background colours and parts
    ``(x, y, ax, ay, angle, r, g, b)`` in units of the image size / degrees / 0..255."""
    background = rng.uniform(40, 215, (3, 3, 3))
    parts = np.column_stack([rng.uniform(0.2, 0.8, (num_parts, 2)), rng.uniform(0.08, 0.2, (num_parts, 2)),
                             rng.uniform(0, 180, num_parts), rng.uniform(0, 255, (num_parts, 3))])
    return background, parts


def make_prototype(rng, size, template):
    """A random identity: the template's parts moved, resized, turned and recoloured,
    plus two blobs of its own; HWC float32 RGB in [0, 255]."""
    background, parts = template
    background = np.clip(background + rng.normal(0, 25, background.shape), 0, 255)
    img = cv2.resize(background.astype(np.float32), (size, size), interpolation=cv2.INTER_CUBIC)
    parts = parts + np.column_stack([rng.normal(0, 0.07, (len(parts), 2)), np.zeros((len(parts), 2)),
                                     rng.normal(0, 30, len(parts)), rng.normal(0, 45, (len(parts), 3))])
    parts[:, 2:4] *= np.exp(rng.normal(0, 0.3, (len(parts), 2)))
    own = np.column_stack([rng.uniform(0.15, 0.85, (2, 2)), rng.uniform(0.05, 0.15, (2, 2)),
                           rng.uniform(0, 180, 2), rng.uniform(0, 255, (2, 3))])
    for x, y, ax, ay, angle, *color in np.concatenate([parts, own]):
        cv2.ellipse(img, (int(x * size), int(y * size)), (int(ax * size) + 1, int(ay * size) + 1), float(angle),
                    0, 360, tuple(float(np.clip(c, 0, 255)) for c in color), -1, cv2.LINE_AA)
    return cv2.GaussianBlur(img, (0, 0), 0.015 * size + 0.3)


def render_sample(proto, rng, strength=1.0):
    """One image (HWC uint8 RGB) of the identity `proto` with random nuisance."""
    size = proto.shape[0]
    s = float(strength)
    angle = float(np.clip(rng.normal(0, 12 * s), -30, 30))
    scale = float(np.exp(rng.normal(0, 0.08 * s)))
    mat = cv2.getRotationMatrix2D((size / 2, size / 2), angle, scale)
    mat[:, 2] += rng.normal(0, 0.05 * s * size, 2)
    img = cv2.warpAffine(proto, mat, (size, size), flags=cv2.INTER_LINEAR, borderMode=cv2.BORDER_REFLECT101)
    grid = (np.arange(size, dtype=np.float32) - size / 2) / (size / 2)
    theta = rng.uniform(0, 2 * np.pi)
    ramp = rng.normal(0, 25 * s) * (np.cos(theta) * grid[None, :] + np.sin(theta) * grid[:, None])
    contrast = float(np.exp(rng.normal(0, 0.2 * s)))
    light = (ramp + rng.normal(0, 20 * s) + 128 * (1 - contrast))[:, :, None]
    gains = np.exp(rng.normal(0, 0.1 * s, 3)).astype(np.float32)
    img = (img * contrast + light) * gains
    if rng.random() < 0.5:
        img = cv2.GaussianBlur(img, (0, 0), rng.uniform(0.3, 1.2) * s * size / 56)
    img += rng.normal(0, rng.uniform(1, 8) * s, img.shape).astype(np.float32)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(img, quality):
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return buf.tobytes()


def generate(out_dir, image_size=56, num_identities=1000, images_per_identity=16, num_val_identities=200,
             num_pairs=1000, seed=0, strength=1.2, quality=92, val_name="val.bin"):
    """Write ``train.rec``/``train.idx``/``property`` and the verification pack `val_name`.

    Training uses identities ``0 .. num_identities-1``; the pack's pairs
    (half same, half different, shuffled) come from `num_val_identities`
    further identities never seen in training. Returns a summary dict.
    """
    for name, value, least in (("image_size", image_size, 1), ("num_identities", num_identities, 1),
                               ("images_per_identity", images_per_identity, 1),
                               ("num_val_identities", num_val_identities, 2), ("num_pairs", num_pairs, 2)):
        if value < least:
            raise ValueError(f"synthetic data: {name} must be at least {least}, got {value}")
    rng = np.random.default_rng(seed)
    template = make_template(rng, image_size)
    protos = [make_prototype(rng, image_size, template) for _ in range(num_identities + num_val_identities)]
    labels = np.repeat(np.arange(num_identities), images_per_identity)
    images = (_encode(render_sample(protos[label], rng, strength), quality) for label in labels)
    write_face_rec(out_dir, labels, images, image_size, num_classes=num_identities)

    same = np.arange(num_pairs) < num_pairs // 2
    rng.shuffle(same)
    pairs = []
    for is_same in same:
        a, b = rng.choice(num_val_identities, 2, replace=False) + num_identities
        pairs += [protos[a], protos[a if is_same else b]]
    val_path = os.path.join(out_dir, val_name)
    write_verification_bin(val_path, [_encode(render_sample(p, rng, strength), quality) for p in pairs], same)
    return {"root": out_dir, "num_images": len(labels), "num_classes": num_identities, "image_size": image_size,
            "val_bin": val_path, "num_pairs": num_pairs}


def _loose_crop_similarity(rng, face_size, crop_size):
    """2x3 matrix placing an aligned face of `face_size` inside a `crop_size` loose crop,
    turned by up to 25 degrees, covering about 50-80% of it, shifted a little."""
    angle = rng.uniform(-25, 25)
    scale = rng.uniform(0.8, 1.3) * 0.6 * crop_size / face_size
    m = cv2.getRotationMatrix2D((face_size / 2, face_size / 2), angle, scale)
    m[:, 2] += crop_size / 2 - face_size / 2 + rng.uniform(-0.08, 0.08, 2) * crop_size
    return m


def generate_ijb(root, target="ijbc", num_identities=6, templates_per_identity=3, face_size=48,
                 crop_size=72, max_pairs=None, seed=0, strength=0.6, ext=".jpg"):
    """Write ``root/meta/<target>_{face_tid_mid,name_5pts_score,template_pair_label}.txt`` and
    ``root/loose_crop/<i><ext>``; return the protocol as arrays in the order of the image lines.

    Each template is one identity's 1-3 medias of 1-3 images; an image is a rendered
    sample of its identity as an aligned face of `face_size` pixels (its landmarks
    the reference points) warped into a `crop_size` loose crop by a random
    similarity, the landmarks moved alike. Template ids are not contiguous, media ids
    repeat across templates, image lines are shuffled, detector scores lie in
    [0.3, 1). Pairs are all template pairs (label 1 for the same identity), or
    `max_pairs` of them drawn at random.
    """
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "meta"), exist_ok=True)
    os.makedirs(os.path.join(root, "loose_crop"), exist_ok=True)
    layout = make_template(rng, face_size)
    protos = [make_prototype(rng, face_size, layout) for _ in range(num_identities)]
    ref = reference_points((face_size, face_size))
    rows, identity_of = [], {}
    for ident in range(num_identities):
        for _ in range(templates_per_identity):
            tid = 100 + 7 * len(identity_of)
            identity_of[tid] = ident
            for _ in range(rng.integers(1, 4)):          # medias of the template
                mid = int(rng.integers(1, 12))           # media ids repeat across templates
                for _ in range(rng.integers(1, 4)):      # images of the media
                    m = _loose_crop_similarity(rng, face_size, crop_size)
                    rows.append((tid, mid, m, ident, float(rng.uniform(0.3, 1.0))))
    order = rng.permutation(len(rows))
    rows = [rows[i] for i in order]
    names = [f"{i + 1}{ext}" for i in range(len(rows))]
    landmarks = np.round(np.array([ref @ m[:, :2].T + m[:, 2] for _, _, m, _, _ in rows]), 4)
    det_scores = np.round([r[4] for r in rows], 4)
    for name, (_, _, m, ident, _) in zip(names, rows):
        face = render_sample(protos[ident], rng, strength)
        crop = cv2.warpAffine(face, m, (crop_size, crop_size), borderMode=cv2.BORDER_REFLECT101)
        write_image(os.path.join(root, "loose_crop", name), cv2.cvtColor(crop, cv2.COLOR_RGB2BGR))
    tids = sorted(identity_of)
    pairs = [(a, b, int(identity_of[a] == identity_of[b])) for i, a in enumerate(tids) for b in tids[i + 1:]]
    if max_pairs is not None and len(pairs) > max_pairs:
        pairs = [pairs[i] for i in np.sort(rng.choice(len(pairs), max_pairs, replace=False))]
    meta = os.path.join(root, "meta", target.lower())
    atomic_write(meta + "_face_tid_mid.txt",
                 "".join(f"{name} {tid} {mid}\n" for name, (tid, mid, *_) in zip(names, rows)))
    atomic_write(meta + "_name_5pts_score.txt",
                 "".join(name + " " + " ".join(f"{v:.4f}" for v in lmk.reshape(-1)) + f" {score:.4f}\n"
                         for name, lmk, score in zip(names, landmarks, det_scores)))
    atomic_write(meta + "_template_pair_label.txt", "".join(f"{a} {b} {label}\n" for a, b, label in pairs))
    return {"names": names, "templates": np.array([r[0] for r in rows]), "medias": np.array([r[1] for r in rows]),
            "landmarks": landmarks, "det_scores": np.asarray(det_scores),
            "identities": np.array([r[3] for r in rows]),
            "pairs": np.array([p[:2] for p in pairs]), "labels": np.array([p[2] for p in pairs])}


def write_ijb_1n_lists(root, target, ref):
    """The 1:N lists (plsc.data.ijb_1n) of a layout written by `generate_ijb` (`ref` its return):
    each identity's lowest template id is its gallery template, in gallery 1 (G1 / S1) for even
    identities and gallery 2 for odd ones; its other templates are probes. Subject ids are
    identity + 1001. Returns {name: (template ids, subject ids)} as written."""
    paths = ijb_1n_paths(root, target)
    g1, g2 = [k for k in paths if k != "probe"]
    subject_of = {int(t): int(i) + 1001 for t, i in zip(ref["templates"], ref["identities"])}
    first = {}
    for t in sorted(subject_of):
        first.setdefault(subject_of[t], t)
    role = {t: ((g1 if (s - 1001) % 2 == 0 else g2) if first[s] == t else "probe")
            for t, s in subject_of.items()}
    out = {}
    for name, path in paths.items():
        rows = [f"{t},{subject_of[int(t)]},{n}\n" for t, n in zip(ref["templates"], ref["names"])
                if role[int(t)] == name]
        atomic_write(path, "TEMPLATE_ID,SUBJECT_ID,FILENAME\n" + "".join(rows))
        tids = sorted(t for t in subject_of if role[t] == name)
        out[name] = (np.array(tids, np.int64), np.array([subject_of[t] for t in tids], np.int64))
    return out


def generate_megaface(root, num_identities=6, images_per_identity=(3, 6), num_distractors=40, face_size=48,
                      seed=0):
    """A FaceScrub/MegaFace-like pair under `root`: ``probes/<identity>/<k>.jpg`` (identity
    folders), ``distractors/<k>.jpg`` named by ``distractors.txt`` (one path per line, relative to
    `root`), and noise lists in insightface's format (one path per line):
    ``facescrub_noises.txt`` (one probe image) and ``megaface_noises.txt`` (two distractors).
    Distractors are rendered from identities of their own. Returns the paths and counts."""
    rng = np.random.default_rng(seed)
    layout = make_template(rng, face_size)
    num_probes = 0
    for ident in range(num_identities):
        proto = make_prototype(rng, face_size, layout)
        folder = os.path.join(root, "probes", f"person_{ident:02d}")
        os.makedirs(folder, exist_ok=True)
        for k in range(int(rng.integers(images_per_identity[0], images_per_identity[1] + 1))):
            atomic_write(os.path.join(folder, f"{k}.jpg"), _encode(render_sample(proto, rng, 0.6), 95))
            num_probes += 1
    os.makedirs(os.path.join(root, "distractors"), exist_ok=True)
    names = []
    for k in range(num_distractors):
        proto = make_prototype(rng, face_size, layout)
        names.append(f"distractors/{k}.jpg")
        atomic_write(os.path.join(root, names[-1]), _encode(render_sample(proto, rng, 0.6), 95))
    atomic_write(os.path.join(root, "distractors.txt"), "".join(n + "\n" for n in names))
    atomic_write(os.path.join(root, "facescrub_noises.txt"), "person_01/0.jpg\n")
    atomic_write(os.path.join(root, "megaface_noises.txt"), f"{names[3]}\n{names[7]}\n")
    return {"root": root, "probes": os.path.join(root, "probes"),
            "distractors": os.path.join(root, "distractors.txt"),
            "probe_noise": os.path.join(root, "facescrub_noises.txt"),
            "distractor_noise": os.path.join(root, "megaface_noises.txt"),
            "num_probes": num_probes, "num_distractors": num_distractors}
