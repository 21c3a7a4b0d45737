"""RecordIO framing, IRHeader payloads and the insightface layout, checked against
a literal struct-based encoder of the MXNet format written here."""
import multiprocessing
import os
import struct

import cv2
import numpy as np
import pytest

from plsc.data import DataError, RecordIODataset, RecordIOReader, RecordIOWriter, image_keys, write_face_rec
from plsc.data import irheader
from plsc.data.recordio import decode_record, encode_record

MAGIC = b"\x0a\x23\xd7\xce"  # 0xced7230a little endian


# ---- the oracle: MXNet's on-disk format, written out by hand ----------------------------------
def oracle_frame(payload):
    """Frame `payload`: split at every 4-aligned magic word, drop that word, pad parts to 4."""
    aligned_magic = [i for i in range(0, len(payload) - 3, 4) if payload[i:i + 4] == MAGIC]
    pieces, start = [], 0
    for i in aligned_magic:
        pieces.append(payload[start:i])
        start = i + 4
    pieces.append(payload[start:])
    if len(pieces) == 1:
        flags = [0]
    else:
        flags = [1] + [2] * (len(pieces) - 2) + [3]
    out = b""
    for flag, piece in zip(flags, pieces):
        out += MAGIC + struct.pack("<I", (flag << 29) | len(piece)) + piece + b"\x00" * (-len(piece) % 4)
    return out


def oracle_payload(label, image, id_=0, id2=0):
    if isinstance(label, (list, tuple)):
        return struct.pack("<IfQQ", len(label), 0.0, id_, id2) + struct.pack(f"<{len(label)}f", *label) + image
    return struct.pack("<IfQQ", 0, label, id_, id2) + image


def oracle_files(records):
    """(rec bytes, idx text) for [(key, payload)] written in order."""
    rec, idx = b"", ""
    for key, payload in records:
        idx += f"{key}\t{len(rec)}\n"
        rec += oracle_frame(payload)
    return rec, idx


def write_oracle(root, records, prop=None):
    os.makedirs(root, exist_ok=True)
    rec, idx = oracle_files(records)
    with open(os.path.join(root, "train.rec"), "wb") as f:
        f.write(rec)
    with open(os.path.join(root, "train.idx"), "w") as f:
        f.write(idx)
    if prop:
        with open(os.path.join(root, "property"), "w") as f:
            f.write(prop)


def png(img_rgb):
    return cv2.imencode(".png", img_rgb[:, :, ::-1])[1].tobytes()


def random_images(n, size=(12, 10), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + (3,), dtype=np.uint8) for _ in range(n)]


def expected_tensor(img):
    return (img.astype(np.float64).transpose(2, 0, 1) - 127.5) / 127.5


def insightface_records(images, labels):
    """insightface layout: header 0, images 1..N, one identity record per label run."""
    n = len(images)
    runs = []
    for i, lab in enumerate(labels):
        if not runs or runs[-1][0] != lab:
            runs.append([lab, i + 1, i + 2])
        else:
            runs[-1][2] = i + 2
    records = [(0, oracle_payload([float(n + 1), float(n + 1 + len(runs))], b""))]
    records += [(i + 1, oracle_payload(float(lab), png(img), i + 1)) for i, (img, lab) in enumerate(zip(images, labels))]
    records += [(n + 1 + j, oracle_payload([float(s), float(e)], b"", n + 1 + j)) for j, (_, s, e) in enumerate(runs)]
    return records


# ---- framing ---------------------------------------------------------------------------------
def test_whole_record_bytes_are_the_literal_mxnet_framing():
    assert encode_record(b"abcde") == b"\x0a\x23\xd7\xce" + b"\x05\x00\x00\x00" + b"abcde\x00\x00\x00"
    assert encode_record(b"") == b"\x0a\x23\xd7\xce\x00\x00\x00\x00"
    assert decode_record(encode_record(b"abcde")) == (b"abcde", 16)


def test_payload_with_aligned_magic_is_split_and_joined_back():
    payload = b"head" + MAGIC + b"midd" + b"le.." + MAGIC + b"xyz" + MAGIC[:2] + b"\x00" + MAGIC + b"t"
    # aligned magic at 4 and 16, an unaligned one at 23 that must stay inside a part
    framed = encode_record(payload)
    assert framed == oracle_frame(payload)
    flags = [struct.unpack_from("<I", framed, pos + 4)[0] >> 29 for pos in (0, 12)]
    assert flags == [1, 2]
    got, end = decode_record(framed)
    assert bytes(got) == payload and end == len(framed)


def test_payload_ending_in_magic_and_made_of_magic():
    for payload in (MAGIC, MAGIC * 3, b"abcd" + MAGIC, MAGIC + b"ab"):
        framed = encode_record(payload)
        assert framed == oracle_frame(payload)
        assert bytes(decode_record(framed)[0]) == payload


# ---- insightface layout -------------------------------------------------------------------------
def test_reads_insightface_layout_built_by_the_oracle(tmp_path):
    images, labels = random_images(7), [0, 0, 1, 1, 1, 2, 2]
    write_oracle(tmp_path, insightface_records(images, labels), "3,12,10")
    ds = RecordIODataset(str(tmp_path), train=False)
    assert len(ds) == 7 and ds.header == (8, 11) and ds.num_classes == 3
    for i in range(7):
        x, y = ds[i]
        assert x.shape == (3, 12, 10) and x.dtype == np.float32
        np.testing.assert_allclose(x, expected_tensor(images[i]), atol=1e-6)
        assert y == labels[i] and isinstance(y, int)


def test_face_rec_writer_is_byte_identical_to_the_oracle(tmp_path):
    images, labels = random_images(5, seed=1), [0, 0, 1, 2, 2]
    write_face_rec(str(tmp_path / "plsc"), labels, [png(im) for im in images], (12, 10))
    rec, idx = oracle_files(insightface_records(images, labels))
    assert (tmp_path / "plsc" / "train.rec").read_bytes() == rec
    assert (tmp_path / "plsc" / "train.idx").read_text() == idx
    assert (tmp_path / "plsc" / "property").read_text().strip() == "3,12,10"
    assert not [p for p in os.listdir(tmp_path / "plsc") if ".tmp" in p]


def test_headerless_rec_with_array_labels_round_trip(tmp_path):
    images, labels = random_images(4, seed=2), [3, 1, 0, 2]
    records = [(k, oracle_payload([float(lab), 9.0], png(im), k)) for k, (im, lab) in enumerate(zip(images, labels))]
    write_oracle(tmp_path / "oracle", records)
    with RecordIOWriter(str(tmp_path / "mine.rec")) as w:
        for k, (im, lab) in enumerate(zip(images, labels)):
            w.write(k, irheader.pack([float(lab), 9.0], png(im), id=k))
    assert (tmp_path / "mine.rec").read_bytes() == (tmp_path / "oracle" / "train.rec").read_bytes()
    assert (tmp_path / "mine.idx").read_text() == (tmp_path / "oracle" / "train.idx").read_text()
    ds = RecordIODataset(str(tmp_path / "oracle"), image_size=(12, 10), train=False)
    assert ds.header is None and len(ds) == 4
    for i in range(4):
        x, y = ds[i]
        assert y == labels[i]
        np.testing.assert_allclose(x, expected_tensor(images[i]), atol=1e-6)


def test_image_payload_containing_magic_survives_the_dataset(tmp_path):
    images = random_images(3, seed=3)
    blobs = [png(im) for im in images]
    # bytes after a PNG's IEND chunk are ignored by decoders; put a 4-aligned magic word there
    pad = b"\x00" * (-(24 + len(blobs[1])) % 4)
    blobs[1] = blobs[1] + pad + MAGIC + b"tail" + MAGIC
    records = [(k, oracle_payload(float(k), b)) for k, b in enumerate(blobs)]
    rec, _ = oracle_files(records)
    assert rec.count(MAGIC) > 3 + 1  # record 1 really is split
    write_oracle(tmp_path, records)
    ds = RecordIODataset(str(tmp_path), image_size=(12, 10), train=False)
    np.testing.assert_allclose(ds[1][0], expected_tensor(images[1]), atol=1e-6)
    assert RecordIOReader(str(tmp_path / "train.rec")).read(1) == oracle_payload(1.0, blobs[1])


def test_random_access_by_key_and_index_order(tmp_path):
    payloads = {k: os.urandom(5 + 3 * k) for k in (7, 2, 11, 5)}
    write_oracle(tmp_path, list(payloads.items()))
    reader = RecordIOReader(str(tmp_path / "train.rec"))
    assert list(reader.keys) == [7, 2, 11, 5]
    for key in (5, 11, 2, 7):
        assert bytes(reader.read(key)) == payloads[key]
    assert 3 not in reader and 11 in reader
    with pytest.raises(KeyError, match="key 3"):
        reader.read(3)


def _read_in_child(args):
    reader, key = args
    return os.getpid(), bytes(reader.read(key))


def test_forked_workers_open_their_own_handle(tmp_path):
    payloads = [(k, os.urandom(50)) for k in range(6)]
    write_oracle(tmp_path, payloads)
    reader = RecordIOReader(str(tmp_path / "train.rec"))
    reader.read(0)  # opens the parent's handle before forking
    parent_fd = reader._fd
    with multiprocessing.get_context("fork").Pool(2) as pool:
        got = pool.map(_read_in_child, [(reader, k) for k in range(6)])
    assert [p for _, p in got] == [p for _, p in payloads]
    assert all(pid != os.getpid() for pid, _ in got)
    assert reader._fd == parent_fd and bytes(reader.read(5)) == payloads[5][1]


def test_writer_leaves_nothing_behind_on_error(tmp_path):
    with pytest.raises(RuntimeError):
        with RecordIOWriter(str(tmp_path / "x.rec")) as w:
            w.write(0, b"abc")
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


# ---- bad input -----------------------------------------------------------------------------------
def _simple(tmp_path, n=4, num_classes=None, labels=None):
    images = random_images(n, seed=4)
    labels = labels or list(range(n))
    records = [(k, oracle_payload(float(lab), png(im))) for k, (im, lab) in enumerate(zip(images, labels))]
    write_oracle(tmp_path, records, f"{num_classes or n},12,10")
    rec, idx = oracle_files(records)
    offsets = [int(line.split("\t")[1]) for line in idx.splitlines()]
    return images, offsets, rec


def test_truncated_record_names_file_key_and_offset(tmp_path):
    _, offsets, rec = _simple(tmp_path)
    (tmp_path / "train.rec").write_bytes(rec[:offsets[3] + 40])
    ds = RecordIODataset(str(tmp_path), train=False)
    with pytest.raises(DataError) as err:
        ds[3]
    msg = str(err.value)
    assert "train.rec" in msg and "key 3" in msg and f"offset {offsets[3]}" in msg and "truncated" in msg
    assert ds[2][1] == 2


def test_bad_magic_names_file_key_and_expected_value(tmp_path):
    _, offsets, rec = _simple(tmp_path)
    rec = bytearray(rec)
    rec[offsets[2]:offsets[2] + 4] = b"\x00\x11\x22\x33"
    (tmp_path / "train.rec").write_bytes(bytes(rec))
    ds = RecordIODataset(str(tmp_path), train=False)
    with pytest.raises(DataError, match=r"train.rec: record key 2 at offset \d+: bad magic word 0x33221100.*0xced7230a"):
        ds[2]


def test_index_past_the_end_is_reported_or_skipped(tmp_path):
    _, offsets, rec = _simple(tmp_path)
    idx = (tmp_path / "train.idx").read_text().replace(f"1\t{offsets[1]}", f"1\t{len(rec) + 100}")
    (tmp_path / "train.idx").write_text(idx)
    with pytest.raises(DataError, match=rf"train.idx: key 1 points to offset {len(rec) + 100}, past the end"):
        RecordIODataset(str(tmp_path), train=False)
    ds = RecordIODataset(str(tmp_path), train=False, skip_bad=True)
    assert len(ds) == 3 and [ds[i][1] for i in range(3)] == [0, 2, 3] and ds.num_skipped == 1
    assert len(ds.skipped) == 1 and "key 1 points to offset" in ds.skipped[0]
    assert "1 index entries dropped" in ds.skipped[0]


def test_bad_index_line_names_the_line(tmp_path):
    _simple(tmp_path)
    (tmp_path / "train.idx").write_text("0\t0\n1\tabc\n")
    with pytest.raises(DataError, match=r"train.idx:2: bad index line"):
        RecordIODataset(str(tmp_path))


def test_undecodable_image_is_reported_or_skipped(tmp_path):
    images = random_images(3, seed=5)
    records = [(0, oracle_payload(0.0, png(images[0]))), (1, oracle_payload(1.0, b"not an image at all")),
               (2, oracle_payload(2.0, png(images[2])))]
    write_oracle(tmp_path, records, "3,12,10")
    ds = RecordIODataset(str(tmp_path), train=False)
    with pytest.raises(DataError, match=r"train.rec: key 1: cannot decode the image"):
        ds[1]
    ds = RecordIODataset(str(tmp_path), train=False, skip_bad=True)
    x, y = ds[1]
    assert y == 2 and ds.num_skipped == 1 and len(ds.skipped) == 1 and "key 1" in ds.skipped[0]
    np.testing.assert_allclose(x, expected_tensor(images[2]), atol=1e-6)


def test_label_not_below_num_classes_is_reported_or_skipped(tmp_path):
    _simple(tmp_path, num_classes=3, labels=[0, 1, 5, 2])
    ds = RecordIODataset(str(tmp_path), train=False)
    assert ds.num_classes == 3
    with pytest.raises(DataError, match=r"key 2: label 5.0 is not an integer >= 0 below num_classes=3"):
        ds[2]
    ds = RecordIODataset(str(tmp_path), train=False, skip_bad=True)
    assert ds[2][1] == 2 and ds.num_skipped == 1
    with pytest.raises(DataError, match="num_classes=2"):
        RecordIODataset(str(tmp_path), train=False, num_classes=2)[2]


def test_short_payload_is_reported(tmp_path):
    write_oracle(tmp_path, [(0, b"tiny")])
    with pytest.raises(DataError, match=r"key 0: payload has 4 bytes, expected at least the 24-byte IRHeader"):
        RecordIODataset(str(tmp_path), image_size=8)[0]


def test_image_keys_without_identity_records(tmp_path):
    images = random_images(3, seed=6)
    records = [(0, oracle_payload([4.0, 4.0], b""))] + [(k, oracle_payload(0.0, png(images[k - 1]))) for k in (1, 2, 3)]
    write_oracle(tmp_path, records)
    keys, header = image_keys(RecordIOReader(str(tmp_path / "train.rec")))
    assert list(keys) == [1, 2, 3] and header == (4, 4)
