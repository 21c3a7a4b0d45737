"""tools/pack_rec.py --landmarks and tools/make_verification_bin.py: aligned faces equal to
plsc.data.align.align_face on the same image, parallel packing equal to one worker, packs read
back equal by plsc's reader and by a transcription of insightface's, bad lines named."""
import filecmp
import os
import pickle
import signal
import subprocess
import sys
import time

import cv2
import numpy as np
import pytest

import scripts
from processes import children, in_group
from plsc.data import irheader
from plsc.data.align import align_face
from plsc.data.recordio import RecordIOReader
from plsc.data.verification import read_verification_bin

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
    return scripts.load(f"tools/{name}.py")


pack_rec, make_bin = _tool("pack_rec"), _tool("make_verification_bin")


def jpeg_of(rgb, quality=95):
    return cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])[1].tobytes()


@pytest.fixture(scope="module")
def faces(tmp_path_factory):
    """6 identities x 2 PNG images (lossless: the decoded image is the array) with landmarks."""
    root = tmp_path_factory.mktemp("faces")
    rng = np.random.default_rng(0)
    entries = []
    for ident in range(6):
        os.makedirs(root / f"p{ident}")
        for k in range(2):
            img = cv2.GaussianBlur(rng.integers(0, 256, (90, 80, 3), dtype=np.uint8), (5, 5), 2)
            rel = f"p{ident}/p{ident}_{k + 1:04d}.png"
            cv2.imwrite(str(root / rel), cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
            pts = np.array([[28, 38], [52, 37], [40, 52], [30, 66], [50, 65]], float) + rng.normal(0, 2, (5, 2))
            entries.append((rel, ident, img, pts))
    with open(root / "landmarks.txt", "w") as f:
        for rel, ident, _, pts in entries:
            f.write(f"{rel} {ident} " + " ".join(f"{v:.3f}" for v in pts.reshape(-1)) + "\n")
    return root, entries


def records(root):
    reader = RecordIOReader(os.path.join(root, "train.rec"), os.path.join(root, "train.idx"))
    out = []
    for key in sorted(int(k) for k in reader.keys)[1:]:  # record 0: the header
        header, payload = irheader.unpack(reader.read(key))
        if payload:
            out.append((int(header.label if np.ndim(header.label) == 0 else header.label[0]), bytes(payload)))
    return out


def test_pack_rec_aligns_with_align_face_and_workers_change_no_byte(faces, tmp_path):
    root, entries = faces
    lst = str(root / "landmarks.txt")
    assert pack_rec.main(["--landmarks", lst, "--output", str(tmp_path / "one"), "--image-size", "64"]) == 0
    assert pack_rec.main(["--landmarks", lst, "--output", str(tmp_path / "two"), "--image-size", "64",
                          "--workers", "2"]) == 0
    got = records(tmp_path / "one")
    assert len(got) == len(entries)
    for (label, payload), (_, ident, img, pts) in zip(got, entries):
        # the oracle: the library's align_face on the decoded image (pts read back at 3 decimals)
        want = align_face(img, np.round(pts, 3), (64, 64))
        assert label == ident and payload == jpeg_of(want)
    for name in ("train.rec", "train.idx", "property"):
        assert filecmp.cmp(tmp_path / "one" / name, tmp_path / "two" / name, shallow=False), name


@pytest.mark.parametrize("line,expected", [("p0/p0_0001.png 0 1 2 3", "expected 12 fields"),
                                           ("p0/p0_0001.png x " + "1 " * 10, "invalid literal"),
                                           ("missing.png 0 " + "30 " * 10, "missing.png")])
def test_pack_rec_bad_landmark_line_is_one_line_and_65(faces, tmp_path, line, expected):
    root, _ = faces
    lst = root / "bad.txt"
    lst.write_text((root / "landmarks.txt").read_text().splitlines()[0] + "\n" + line + "\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "pack_rec.py"), "--landmarks", str(lst),
                           "--output", str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 65 and len(errors) == 1 and expected in errors[0], proc.stderr
    if "fields" in expected or "literal" in expected:
        assert f"{lst}:2:" in errors[0]
    assert not (tmp_path / "out" / "train.rec").exists()


def insightface_load_bin(path):
    """A transcription of insightface's recognition/eval load_bin without MXNet: the pickle
    read with encoding='bytes', each image decoded to RGB (mx.image.imdecode's order)."""
    with open(path, "rb") as f:
        bins, issame_list = pickle.load(f, encoding="bytes")
    images = []
    for idx in range(len(issame_list) * 2):
        bgr = cv2.imdecode(np.frombuffer(bins[idx], np.uint8), cv2.IMREAD_COLOR)
        images.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    return images, list(issame_list)


def test_verification_bin_from_a_pairs_list_reads_back_in_both_readers(faces, tmp_path):
    root, entries = faces
    by_name = {rel: img for rel, _, img, _ in entries}
    pairs = [("p0/p0_0001.png", "p0/p0_0002.png", 1), ("p1/p1_0001.png", "p2/p2_0002.png", 0)]
    (root / "pairs.txt").write_text("".join(f"{a} {b} {s}\n" for a, b, s in pairs))
    out = str(tmp_path / "val.bin")
    assert make_bin.main(["--pairs", str(root / "pairs.txt"), "--output", out]) == 0
    want = [by_name[p] for a, b, _ in pairs for p in (a, b)]
    for images, issame in (read_verification_bin(out), insightface_load_bin(out)):
        assert [bool(s) for s in issame] == [True, False]
        assert len(images) == 4 and all(np.array_equal(g, w) for g, w in zip(images, want))


def test_verification_bin_from_lfw_pairs_with_alignment(faces, tmp_path):
    root, entries = faces
    marks = {rel: pts for rel, _, _, pts in entries}
    (root / "lfw_pairs.txt").write_text("1\t2\np3\t1\t2\np4\t2\tp5\t1\n")
    (root / "marks.txt").write_text("".join(f"{rel.replace('.png', '.jpg')} " + " ".join(f"{v:.3f}" for v in pts.reshape(-1))
                                            + "\n" for rel, pts in marks.items()))
    lfw = tmp_path / "lfw"  # LFW's layout: name/name_000n.jpg (lossless content kept as PNG bytes)
    for rel, _, img, _ in entries:
        os.makedirs(lfw / os.path.dirname(rel), exist_ok=True)
        cv2.imwrite(str(lfw / rel.replace(".png", ".jpg")) + ".png", cv2.cvtColor(img, cv2.COLOR_RGB2BGR))
        os.replace(str(lfw / rel.replace(".png", ".jpg")) + ".png", lfw / rel.replace(".png", ".jpg"))
    out = str(tmp_path / "lfw.bin")
    assert make_bin.main(["--pairs", str(root / "lfw_pairs.txt"), "--root", str(lfw), "--output", out,
                          "--landmarks", str(root / "marks.txt")]) == 0
    by_name = {rel: (img, pts) for rel, _, img, pts in entries}
    names = ["p3/p3_0001.png", "p3/p3_0002.png", "p4/p4_0002.png", "p5/p5_0001.png"]
    want = [cv2.imdecode(np.frombuffer(jpeg_of(align_face(by_name[n][0], np.round(by_name[n][1], 3))), np.uint8),
                         cv2.IMREAD_COLOR)[:, :, ::-1] for n in names]
    for images, issame in (read_verification_bin(out), insightface_load_bin(out)):
        assert [bool(s) for s in issame] == [True, False]
        assert all(np.array_equal(g, w) for g, w in zip(images, want))


def test_make_verification_bin_bad_pairs_line_is_one_line_and_65(faces, tmp_path):
    root, _ = faces
    (root / "badpairs.txt").write_text("p0/p0_0001.png p0/p0_0002.png 1\np0/p0_0001.png p0/p0_0002.png maybe\n")
    out = tmp_path / "x.bin"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_verification_bin.py"), "--pairs",
                           str(root / "badpairs.txt"), "--output", str(out)], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln]
    assert proc.returncode == 65 and len(errors) == 1 and f"{root / 'badpairs.txt'}:2:" in errors[0], proc.stderr
    assert not out.exists()
    usage = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_verification_bin.py")],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert usage.returncode == 2


def test_pack_rec_stopped_with_its_workers_ends_with_75_and_the_next_run_cleans_up(tmp_path):
    """SIGTERM to the process group while its two workers encode: one line, status 75, every
    process gone, only temporary files written; the next run removes them and packs."""
    rng = np.random.default_rng(1)
    for ident in range(20):
        os.makedirs(tmp_path / "imgs" / f"{ident:02d}")
        for k in range(60):  # noise: slow to encode, so the workers' stage lasts
            cv2.imwrite(str(tmp_path / "imgs" / f"{ident:02d}" / f"{k}.jpg"),
                        rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
    cmd = [sys.executable, os.path.join(ROOT, "tools/pack_rec.py"), "--input", str(tmp_path / "imgs"),
           "--output", str(tmp_path / "out"), "--image-size", "112", "--workers", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while len(children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert len(workers) == 2 and proc.returncode == 75, (workers, err)
    assert err.strip().splitlines()[-1] == ("plsc: preempted; nothing to save (signal 15, SIGTERM); "
                                            "run the same command again"), err
    assert "FatalError" not in err and out == ""
    deadline = time.monotonic() + 5
    while in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_group(proc.pid) == []
    left = sorted(os.listdir(tmp_path / "out"))
    assert left and all(name.endswith(f".{proc.pid}.part") for name in left), left
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["property", "train.idx", "train.rec"]
    assert len(records(tmp_path / "out")) == 20 * 60
