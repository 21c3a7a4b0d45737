"""The 1:N lists of IJB-B / IJB-C in insightface's IJB release: ``ROOT/meta/``

    ijbc_1N_gallery_G1.csv, ijbc_1N_gallery_G2.csv, ijbc_1N_probe_mixed.csv    (IJB-C)
    ijbb_1N_gallery_S1.csv, ijbb_1N_gallery_S2.csv, ijbb_1N_probe_mixed.csv    (IJB-B)

Comma-separated, one header line, then one line per image: TEMPLATE_ID, SUBJECT_ID, then any
further columns (not read). Templates are those of `<target>_face_tid_mid.txt`.
"""
import os

import numpy as np

from .errors import DataError

__all__ = ["ijb_1n_paths", "read_ijb_1n_list", "read_ijb_1n_lists"]


def ijb_1n_paths(root, target):
    """{'G1'|'S1': gallery 1, 'G2'|'S2': gallery 2, 'probe': mixed probes} CSV paths."""
    t = str(target).lower()
    names = ("G1", "G2") if t == "ijbc" else ("S1", "S2")
    meta = os.path.join(root, "meta")
    paths = {g: os.path.join(meta, f"{t}_1N_gallery_{g}.csv") for g in names}
    paths["probe"] = os.path.join(meta, f"{t}_1N_probe_mixed.csv")
    return paths


def read_ijb_1n_list(path, known_templates, tid_file="face_tid_mid"):
    """(template ids [T] ascending, their subject ids [T]) of one CSV. DataError naming the line:
    a field that is not an integer, a template not in `known_templates`, a template listed
    with two subjects, no template at all."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (expected TEMPLATE_ID,SUBJECT_ID,... lines)")
    known = set(int(t) for t in np.asarray(known_templates).tolist())
    subject_of = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if number == 1 or not line.strip():
                continue  # the header
            fields = line.strip().split(",")
            try:
                tid, sid = int(fields[0]), int(fields[1])
            except (ValueError, IndexError):
                raise DataError(f"{path} line {number}: {line.strip()[:60]!r}, expected "
                                "TEMPLATE_ID,SUBJECT_ID,... (integers)") from None
            if tid not in known:
                raise DataError(f"{path} line {number}: template {tid} is not in {tid_file}")
            if subject_of.setdefault(tid, sid) != sid:
                raise DataError(f"{path} line {number}: template {tid} has subject {sid}, but "
                                f"subject {subject_of[tid]} on an earlier line")
    if not subject_of:
        raise DataError(f"{path}: no templates listed")
    tids = np.array(sorted(subject_of), np.int64)
    return tids, np.array([subject_of[t] for t in tids.tolist()], np.int64)


def read_ijb_1n_lists(root, target, known_templates):
    """{name: (template ids, subject ids)} of the two galleries and the probes of `target`."""
    paths = ijb_1n_paths(root, target)
    tid_file = f"{str(target).lower()}_face_tid_mid.txt"
    return {name: read_ijb_1n_list(path, known_templates, tid_file) for name, path in paths.items()}
