"""Reading insightface's IJB layout: the protocol arrays, the aligned-face dataset, and
errors that name the file and line."""
import os
import shutil

import cv2
import numpy as np
import pytest

from ijb_layout import make_layout
from plsc.data import DataError, IJBFaceDataset, align_face, check_ijb_images, read_ijb_meta


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ijb") / "IJBC")
    return root, make_layout(root, num_identities=4, templates_per_identity=3)


@pytest.fixture
def copy(layout, tmp_path):
    root = str(tmp_path / "IJBC")
    shutil.copytree(layout[0], root)
    return root


def _meta_file(root, kind):
    return os.path.join(root, "meta", f"ijbc_{kind}.txt")


def _edit_line(path, number, text):
    lines = open(path).read().splitlines(keepends=True)
    lines[number - 1] = text
    open(path, "w").write("".join(lines))


def test_meta_arrays_follow_the_files(layout):
    root, ref = layout
    meta = read_ijb_meta(root, "IJBC")
    assert meta.names == ref["names"] and meta.num_images == len(ref["names"])
    np.testing.assert_array_equal(meta.templates, ref["templates"])
    np.testing.assert_array_equal(meta.medias, ref["medias"])
    np.testing.assert_allclose(meta.landmarks, ref["landmarks"], atol=1e-4)
    np.testing.assert_allclose(meta.det_scores, ref["det_scores"], atol=1e-6)
    np.testing.assert_array_equal(meta.pairs, ref["pairs"])
    np.testing.assert_array_equal(meta.labels, ref["labels"])
    assert meta.num_templates == 12 and meta.num_pairs == 66
    assert meta.lines.tolist() == list(range(1, meta.num_images + 1))
    check_ijb_images(meta)


def test_dataset_reads_and_aligns_each_image(layout):
    root, ref = layout
    meta = read_ijb_meta(root, "ijbc")
    ds = IJBFaceDataset(meta, (16, 16), start=3, stop=9)
    assert len(ds) == 6
    for i in range(len(ds)):
        image, index = ds[i]
        assert index == 3 + i and image.shape == (16, 16, 3) and image.dtype == np.uint8
        raw = cv2.cvtColor(cv2.imread(os.path.join(root, "loose_crop", ref["names"][3 + i])), cv2.COLOR_BGR2RGB)
        np.testing.assert_array_equal(image, align_face(raw, ref["landmarks"][3 + i], (16, 16)))


def test_blank_lines_are_skipped_and_line_numbers_kept(copy):
    path = _meta_file(copy, "name_5pts_score")
    lines = open(path).read().splitlines(keepends=True)
    open(path, "w").write("".join(lines[:2] + ["\n"] + lines[2:]))
    tid = _meta_file(copy, "face_tid_mid")
    open(tid, "a").write("\n\n")
    meta = read_ijb_meta(copy, "IJBC")
    assert meta.lines[:4].tolist() == [1, 2, 4, 5]


def test_missing_meta_file(copy):
    path = _meta_file(copy, "template_pair_label")
    os.remove(path)
    with pytest.raises(FileNotFoundError, match=f"{path} does not exist"):
        read_ijb_meta(copy, "IJBC")


def test_missing_image_names_the_line(copy):
    meta = read_ijb_meta(copy, "IJBC")
    os.remove(os.path.join(copy, "loose_crop", meta.names[4]))
    expect = f"{meta.names[4]} does not exist .*ijbc_name_5pts_score.txt line 5"
    with pytest.raises(FileNotFoundError, match=expect):
        check_ijb_images(meta)


def test_pair_with_unknown_template(copy):
    path = _meta_file(copy, "template_pair_label")
    _edit_line(path, 17, "100 99 1\n")
    with pytest.raises(DataError, match=f"^{path} line 17: template 99 is not in ijbc_face_tid_mid.txt$"):
        read_ijb_meta(copy, "IJBC")


@pytest.mark.parametrize("kind,line,text,message", [
    ("name_5pts_score", 3, "3.jpg 1 2 3 4 5 6 7 8 9 0.5\n", "line 3: 11 fields, expected 12"),
    ("name_5pts_score", 2, "2.jpg 1 2 3 4 5 6 7 x 9 10 0.5\n",
     "line 2: landmarks '1 2 3 4 5 6 7 x 9 10', expected 10 finite numbers"),
    ("name_5pts_score", 2, "2.jpg 1 2 3 4 5 6 7 8 9 10 nan\n",
     "line 2: detector score 'nan', expected a finite number"),
    ("face_tid_mid", 6, "6.jpg 12a 3\n", "line 6: template id '12a' is not an integer"),
    ("face_tid_mid", 6, "6.jpg 100\n", "line 6: 2 fields, expected 3"),
    ("template_pair_label", 5, "100 107 2\n", "line 5: label 2, expected 1 .same. or 0"),
])
def test_malformed_lines(copy, kind, line, text, message):
    path = _meta_file(copy, kind)
    _edit_line(path, line, text)
    with pytest.raises(DataError, match=f"^{path} {message}"):
        read_ijb_meta(copy, "IJBC")


def test_image_lists_that_disagree(copy):
    tid = _meta_file(copy, "face_tid_mid")
    lines = open(tid).read().splitlines(keepends=True)
    lines[6], lines[7] = lines[7], lines[6]
    open(tid, "w").write("".join(lines))
    pts = _meta_file(copy, "name_5pts_score")
    with pytest.raises(DataError, match=f"^{pts} line 7: image '7.jpg', but {tid} line 7 lists '8.jpg'"):
        read_ijb_meta(copy, "IJBC")
    lines[6], lines[7] = lines[7], lines[6]
    open(tid, "w").write("".join(lines[:-1]))
    with pytest.raises(DataError, match=f"^{pts} line {len(lines)}: image '{len(lines)}.jpg' is not in {tid}"):
        read_ijb_meta(copy, "IJBC")


def test_undecodable_image_names_file_and_line(copy):
    meta = read_ijb_meta(copy, "IJBC")
    path = os.path.join(copy, "loose_crop", meta.names[2])
    open(path, "wb").write(b"not an image")
    with pytest.raises(DataError, match=f"{path} .*ijbc_name_5pts_score.txt line 3.*cannot decode"):
        IJBFaceDataset(meta, (16, 16))[2]
