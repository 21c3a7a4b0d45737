"""IJB-B / IJB-C 1:N identification (tools/eval_ijb.py --protocol 1n): the templates of the 1:1
protocol searched against the galleries of the 1:N lists (plsc.data.ijb_1n).

Two sets of figures (plsc.metrics.identification): the IJB-C paper's open-set ones per
gallery (for gallery 1 the probes whose subject is only in gallery 2 are the non-mated
searches, and the reverse) and their mean; and, labelled as such, those of insightface's
`ijb_1n.py` (both galleries merged, every probe mated). Rank 0 prints them and writes
`<target>_1n_result.json` to Global.output_dir.
"""
import math
import os
import sys

import numpy as np

from .. import distributed as pd
from ..process import runtime
from ..data import DataError, read_ijb_1n_lists, read_ijb_meta
from ..fileio import write_json
from ..metrics import template_features
from ..metrics.identification import (CMC_RANKS, FPIR_TARGETS, IJB1N_FARS, IJB1N_RANKS,
                                      ijb_1n_convention, open_set_identification)
from .ijb import ijb_features

__all__ = ["ijb_1n_report", "format_ijb_1n_table", "evaluate_ijb_1n"]


def _finite(v):
    return v if v is None or not isinstance(v, float) or math.isfinite(v) else None


def ijb_1n_report(template_ids, template_feats, lists):
    """Both sets of figures from the template features (`template_ids` ascending) and the lists
    {gallery 1, gallery 2, 'probe': (template ids, subject ids)}."""
    def feats(tids):
        return template_feats[np.searchsorted(template_ids, tids)]

    probe_t, probe_s = lists["probe"]
    galleries = [k for k in lists if k != "probe"]
    out = {"probes": int(len(probe_t)), "galleries": {}}
    for g in galleries:
        out["galleries"][g] = open_set_identification(feats(probe_t), probe_s, feats(lists[g][0]),
                                                      lists[g][1])
        out["galleries"][g]["templates"] = int(len(lists[g][0]))
    per = list(out["galleries"].values())
    out["mean"] = {"cmc": {r: float(np.mean([p["cmc"][r] for p in per])) for r in CMC_RANKS},
                   "tpir_at_fpir": {f: (None if any(p["tpir_at_fpir"][f] is None for p in per) else
                                        float(np.mean([p["tpir_at_fpir"][f]["tpir"] for p in per])))
                                    for f in FPIR_TARGETS}}
    merged_t = np.concatenate([lists[g][0] for g in galleries])
    merged_s = np.concatenate([lists[g][1] for g in galleries])
    out["ijb_1n_convention"] = ijb_1n_convention(feats(probe_t), probe_s, feats(merged_t), merged_s,
                                                 IJB1N_RANKS, IJB1N_FARS)
    return out


def format_ijb_1n_table(result):
    """The figures of `evaluate_ijb_1n`'s result, in percent."""
    fp = [format(f, "g") for f in FPIR_TARGETS]
    head = (f"{'gallery':<9}{'mated':>7}{'non-m.':>8}" + "".join(f"{'rank' + str(r):>8}" for r in CMC_RANKS)
            + "".join(f"{'@' + f:>9}" for f in fp))
    lines = [f"{result['target']} 1:N: {result['probes']} probe templates; open set (IJB-C paper): per "
             "gallery, CMC (%) and TPIR (%) at FPIR; the other gallery's subjects are the non-mated "
             "searches", head]

    def pct(v):
        return f"{100 * v:.2f}" if v is not None else "-"

    for g, r in result["galleries"].items():
        lines.append(f"{g:<9}{r['mated']:>7}{r['nonmated']:>8}" +
                     "".join(f"{pct(r['cmc'][str(k)]):>8}" for k in CMC_RANKS) +
                     "".join(f"{pct(r['tpir_at_fpir'][f] and r['tpir_at_fpir'][f]['tpir']):>9}"
                             for f in fp))
    m = result["mean"]
    lines.append(f"{'mean':<9}{'':>7}{'':>8}" + "".join(f"{pct(m['cmc'][str(k)]):>8}" for k in CMC_RANKS) +
                 "".join(f"{pct(m['tpir_at_fpir'][f]):>9}" for f in fp))
    c = result["ijb_1n_convention"]
    lines.append("insightface ijb_1n.py convention (galleries merged, every probe mated; TPIR: mate "
                 "score above the ceil(probes x FAR)-th largest non-mate score):")
    lines.append("  " + "  ".join(f"top{k} {pct(v)}" for k, v in c["top"].items()) + "  " +
                 "  ".join(f"TPIR@FAR={k} {pct(v['tpir'])}" for k, v in c["tpir_at_far"].items()))
    return "\n".join(lines)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {format(k, "g") if isinstance(k, float) else str(k): _jsonable(v) for k, v in obj.items()}
    return _finite(obj)


def evaluate_ijb_1n(cfg, root, target, features=None, save_features=None, detector_score=True,
                    normalize_images=False, backbone=None, out=None, progress=None, onnx=None,
                    onnx_input="rgb"):
    """1:N identification of `target` ('IJBC' or 'IJBB') under `root`; features and options as in
    `plsc.apps.ijb.evaluate_ijb` (all ranks extract; every rank returns the result)."""
    out = sys.stdout if out is None else out
    runtime.start(cfg)
    meta = read_ijb_meta(root, target)
    lists = read_ijb_1n_lists(root, target, meta.templates)
    feats = ijb_features(cfg, meta, features, save_features, backbone, progress, onnx, onnx_input)
    bad = ~np.isfinite(feats).all(axis=1)
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(f"{features or 'the extracted features'}: row {i} ({meta.names[i]}) is not finite "
                        f"({int(bad.sum())} rows are not)")
    ids, tfeats = template_features(feats, meta.templates, meta.medias,
                                    meta.det_scores if detector_score else None, normalize_images)
    try:
        report = ijb_1n_report(ids, tfeats, lists)
    except ValueError as err:
        raise DataError(f"{os.path.join(root, 'meta')}: {err}") from None
    result = _jsonable(dict(report, target=meta.target.upper(), protocol="1:N",
                            num_images=meta.num_images, detector_score=bool(detector_score),
                            normalize_images=bool(normalize_images)))
    if pd.get_rank() == 0:
        out_dir = cfg["Global"]["output_dir"]
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, f"{meta.target.lower()}_1n_result.json")
        write_json(path, result)
        out.write(format_ijb_1n_table(result) + f"\nresult: {path}\n")
        if save_features:
            out.write(f"features: {save_features}\n")
    return result
