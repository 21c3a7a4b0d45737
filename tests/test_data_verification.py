"""Verification packs: round trip, a pack pickled as Python 2 does, and bad packs."""
import pickle
import struct

import cv2
import numpy as np
import pytest

from plsc.data import DataError, load_verification_arrays, read_verification_bin, write_verification_bin


def png(img_rgb):
    return cv2.imencode(".png", img_rgb[:, :, ::-1])[1].tobytes()


def images(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (9, 7, 3), dtype=np.uint8) for _ in range(n)]


def python2_pack(bins, issame):
    """The bytes Python 2's cPickle writes for ``(bins, issame)`` with protocol 2:
    ``str`` items as SHORT_BINSTRING/BINSTRING, bools as NEWTRUE/NEWFALSE."""
    out = b"\x80\x02"  # PROTO 2
    out += b"]q\x00(" # EMPTY_LIST, BINPUT 0, MARK
    for i, b in enumerate(bins):
        out += (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<I", len(b))) + b
        out += b"q" + bytes([i + 1])  # BINPUT
    out += b"e]q" + bytes([len(bins) + 1]) + b"("  # APPENDS, EMPTY_LIST, BINPUT, MARK
    out += b"".join(b"\x88" if s else b"\x89" for s in issame)
    out += b"e\x86q" + bytes([len(bins) + 2]) + b"."  # APPENDS, TUPLE2, BINPUT, STOP
    return out


def test_round_trip_png(tmp_path):
    imgs, same = images(6), [True, False, True]
    write_verification_bin(tmp_path / "v.bin", imgs, same, ext=".png")
    got, issame = read_verification_bin(tmp_path / "v.bin")
    assert issame.dtype == bool and list(issame) == same
    assert len(got) == 6 and all(np.array_equal(a, b) for a, b in zip(got, imgs))
    with open(tmp_path / "v.bin", "rb") as f:
        bins, lst = pickle.load(f)  # the plain insightface structure
    assert all(isinstance(b, bytes) for b in bins) and lst == same


def test_python2_pack_loads(tmp_path):
    imgs = images(4, seed=1)
    bins = [png(im) for im in imgs]
    bins[3] = bins[3] + b"\x00" * (300 - len(bins[3]))  # one image long enough for BINSTRING
    data = python2_pack(bins, [False, True])
    with pytest.raises(UnicodeDecodeError):  # a plain Python 3 load chokes on Python 2 str: it is that format
        pickle.loads(data)
    (tmp_path / "lfw.bin").write_bytes(data)
    got, issame = read_verification_bin(tmp_path / "lfw.bin")
    assert list(issame) == [False, True]
    assert all(np.array_equal(a, b) for a, b in zip(got, imgs))
    raw, _ = read_verification_bin(tmp_path / "lfw.bin", decode=False)
    assert raw == bins


def test_encoded_bytes_are_stored_as_given(tmp_path):
    bins = [png(im) for im in images(2, seed=2)]
    write_verification_bin(tmp_path / "v.bin", bins, [True])
    assert read_verification_bin(tmp_path / "v.bin", decode=False)[0] == bins


def test_arrays_for_evaluation(tmp_path):
    imgs = images(4, seed=3)
    write_verification_bin(tmp_path / "v.bin", imgs, [True, False], ext=".png")
    data, issame = load_verification_arrays(tmp_path / "v.bin", image_size=(9, 7))
    assert data.shape == (4, 3, 9, 7) and data.dtype == np.float32
    np.testing.assert_allclose(data[2], (imgs[2].transpose(2, 0, 1) - 127.5) / 127.5, atol=1e-6)


def test_arrays_are_decoded_into_place_not_held_twice(tmp_path):
    """The load's peak (tracemalloc, which counts numpy's buffers) is the array and the pack's
    encoded bytes: no list of every decoded image nor their stack beside it (which took the
    array's size twice more, left as free heap the first evaluation started among)."""
    import tracemalloc
    rng = np.random.default_rng(4)
    imgs = [rng.integers(0, 256, (32, 32, 3), dtype=np.uint8) for _ in range(200)]
    write_verification_bin(tmp_path / "v.bin", imgs, [True] * 100, ext=".png")
    encoded = (tmp_path / "v.bin").stat().st_size
    tracemalloc.start()
    try:
        data, _ = load_verification_arrays(tmp_path / "v.bin", image_size=(32, 32))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_allclose(data[7], (imgs[7].transpose(2, 0, 1) - 127.5) / 127.5, atol=1e-6)
    assert peak < data.nbytes + 2 * encoded + (1 << 20), (peak, data.nbytes, encoded)


def test_count_mismatch_is_reported(tmp_path):
    bins = [png(im) for im in images(3)]
    (tmp_path / "v.bin").write_bytes(pickle.dumps((bins, [True, False])))
    with pytest.raises(DataError, match=r"v.bin: 3 images for 2 pairs, expected 4"):
        read_verification_bin(tmp_path / "v.bin")


def test_not_a_pickle_is_reported(tmp_path):
    (tmp_path / "v.bin").write_bytes(b"this is no pickle")
    with pytest.raises(DataError, match=r"v.bin: not a verification pack"):
        read_verification_bin(tmp_path / "v.bin")
    (tmp_path / "w.bin").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(DataError, match=r"w.bin: holds a dict, expected a pickled \(bins, issame_list\)"):
        read_verification_bin(tmp_path / "w.bin")


def test_undecodable_image_names_its_index(tmp_path):
    bins = [png(im) for im in images(2)]
    bins[1] = b"garbage"
    (tmp_path / "v.bin").write_bytes(pickle.dumps((bins, [True])))
    with pytest.raises(DataError, match=r"v.bin: image 1: cannot decode the image"):
        read_verification_bin(tmp_path / "v.bin")


@pytest.mark.parametrize("pairs, refused", [(9, True), (10, False)])
def test_evaluator_refuses_a_pack_too_small_for_ten_folds(tmp_path, pairs, refused):
    """Checked when the evaluator is built, before a training step, not at the first [val]."""
    from plsc.embedding import VerificationEvaluator
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) for _ in range(2 * pairs)]
    write_verification_bin(tmp_path / "tiny.bin", images, [i % 2 == 0 for i in range(pairs)])
    if refused:
        with pytest.raises(DataError) as err:
            VerificationEvaluator(str(tmp_path), ["tiny"], (8, 8), 4)
        assert str(err.value) == (f"{tmp_path / 'tiny.bin'}: 9 pairs, expected at least 10 "
                                  "(the verification accuracy is 10-fold)")
    else:
        VerificationEvaluator(str(tmp_path), ["tiny"], (8, 8), 4)
