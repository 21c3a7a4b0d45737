"""Image folder, list file and RecordIO datasets agree; pack_rec; DataLoader workers."""
import os

import cv2
import numpy as np
import paddle
import pytest

import scripts
from plsc.data import DataError, ImageFolderDataset, ImageListDataset, RecordIODataset, RecordIOReader
from plsc.data import irheader

pack_rec = scripts.load("tools/pack_rec.py")


@pytest.fixture
def folder(tmp_path):
    """Three identities with PNG images of 10x8; returns (root, [(rgb image, label)] in sorted order)."""
    rng = np.random.default_rng(0)
    samples = []
    for label, (name, count) in enumerate([("alice", 2), ("bob", 3), ("carol", 1)]):
        os.makedirs(tmp_path / "imgs" / name)
        for j in range(count):
            img = rng.integers(0, 256, (10, 8, 3), dtype=np.uint8)
            cv2.imwrite(str(tmp_path / "imgs" / name / f"{j}.png"), img[:, :, ::-1])
            samples.append((img, label))
    return tmp_path / "imgs", samples


def expected(img):
    return (img.transpose(2, 0, 1).astype(np.float64) - 127.5) / 127.5


def check(ds, samples):
    assert len(ds) == len(samples)
    for i, (img, label) in enumerate(samples):
        x, y = ds[i]
        assert y == label and x.shape == (3, 10, 8) and x.dtype == np.float32
        np.testing.assert_allclose(x, expected(img), atol=1e-6)


def test_folder_list_and_packed_rec_agree(folder, tmp_path):
    root, samples = folder
    check(ImageFolderDataset(str(root), image_size=(10, 8), train=False), samples)

    lines = [f"{name}/{f} {lab}" for lab, name in enumerate(["alice", "bob", "carol"])
             for f in sorted(os.listdir(root / name))]
    (root / "list.txt").write_text("\n".join(lines) + "\n")
    check(ImageListDataset(str(root / "list.txt"), image_size=(10, 8), train=False), samples)

    assert pack_rec.main(["--input", str(root), "--output", str(tmp_path / "rec")]) == 0
    assert sorted(os.listdir(tmp_path / "rec")) == ["property", "train.idx", "train.rec"]
    assert (tmp_path / "rec" / "property").read_text().strip() == "3,10,8"
    rec_ds = RecordIODataset(str(tmp_path / "rec"), train=False)
    assert rec_ds.header == (7, 10)  # 6 images at keys 1..6, identities at 7, 8, 9
    check(rec_ds, samples)

    assert pack_rec.main(["--input", str(root / "list.txt"), "--output", str(tmp_path / "rec2"), "--no-header"]) == 0
    rec2 = RecordIODataset(str(tmp_path / "rec2"), train=False)
    assert rec2.header is None and list(rec2.keys) == list(range(6))
    check(rec2, samples)


def test_pack_rec_resizes_and_stores_raw_bytes(folder, tmp_path):
    root, samples = folder
    pack_rec.main(["--input", str(root), "--output", str(tmp_path / "raw")])
    head, image = irheader.unpack(RecordIOReader(str(tmp_path / "raw" / "train.rec")).read(1))
    assert bytes(image) == (root / "alice" / "0.png").read_bytes() and head.label == 0.0
    pack_rec.main(["--input", str(root), "--output", str(tmp_path / "small"), "--image-size", "4"])
    assert (tmp_path / "small" / "property").read_text().strip() == "3,4,4"
    assert RecordIODataset(str(tmp_path / "small"), train=False)[0][0].shape == (3, 4, 4)


def test_pack_rec_bad_image(folder, tmp_path, capsys):
    root, _ = folder
    (root / "bob" / "9.jpg").write_bytes(b"broken")
    assert pack_rec.main(["--input", str(root), "--output", str(tmp_path / "out")]) == 65  # EX_DATAERR, as the trainer
    assert "9.jpg: cannot decode the image" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out" / "train.rec")
    assert pack_rec.main(["--input", str(root), "--output", str(tmp_path / "out"), "--skip-bad"]) == 0
    assert '"skipped": 1' in capsys.readouterr().out
    assert len(RecordIODataset(str(tmp_path / "out"))) == 6


def test_list_label_checks(folder):
    root, _ = folder
    (root / "list.txt").write_text("alice/0.png 0\nbob/0.png 7\n")
    with pytest.raises(DataError, match=r"list.txt:2: label 7 is not an integer >= 0 below num_classes=3"):
        ImageListDataset(str(root / "list.txt"), num_classes=3)
    ds = ImageListDataset(str(root / "list.txt"), num_classes=3, skip_bad=True)
    assert len(ds) == 1 and ds.num_skipped == 1 and len(ds.skipped) == 1 and "list.txt:2" in ds.skipped[0]
    (root / "bad.txt").write_text("alice/0.png zero\n")
    with pytest.raises(DataError, match=r"bad.txt:1: bad line"):
        ImageListDataset(str(root / "bad.txt"))


def test_missing_image_file(folder):
    root, _ = folder
    (root / "list.txt").write_text("alice/0.png 0\nnobody.png 1\n")
    ds = ImageListDataset(str(root / "list.txt"), image_size=(10, 8))
    with pytest.raises(DataError, match=r"nobody.png: cannot read the image file"):
        ds[1]


def test_dataloader_workers_match_sequential_reads(folder, tmp_path):
    root, samples = folder
    pack_rec.main(["--input", str(root), "--output", str(tmp_path / "rec")])
    ds = RecordIODataset(str(tmp_path / "rec"), train=False)
    ds[0]  # the parent opens its handle first
    loader = paddle.io.DataLoader(ds, batch_size=2, shuffle=False, num_workers=2, drop_last=False)
    xs, ys = zip(*[(x.numpy(), y.numpy()) for x, y in loader])
    np.testing.assert_allclose(np.concatenate(xs), np.stack([expected(im) for im, _ in samples]), atol=1e-6)
    assert np.concatenate(ys).tolist() == [lab for _, lab in samples]
