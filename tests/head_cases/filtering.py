"""Inter-class filtering (issue 23): the head with `interclass_filtering_threshold` against
the float64 oracle on data built so that the filter matters on every rank."""
import numpy as np

from head_cases.common import B, D, case_name, margins, restricted, run_head_step

# Low enough that the unfiltered logits (at most s·t for the non-targets) leave the filtered
# entries' exp(0 − max) a visible share of the softmax: at s = 64, t = 0.25 it is ~e^-16, and a
# filtered entry that wrongly passed gradient would hide under the float32 tolerance.
FILTER_THRESHOLD = 0.1
# (margin name, num_classes, sample_ratio, chunk_size, sub_centers): Partial FC, the chunked
# head with sub-centres, AdaFace (its clamp and the filter in one mask); uneven splits.
FILTER_CASES = (("arcface", 101, 0.5, 0, 1), ("cosface", 23, 1.0, 3, 2),
                ("adaface", 23, 1.0, 0, 1))
FILTER_EFFECT = 100.0  # filtering must move each result by this many times its tolerance


def filter_case_name(margin_name, num_classes, ratio, chunk, k):
    return f"filter{FILTER_THRESHOLD:g}-" + (f"k{k}-" if k > 1 else "") + \
        case_name(margin_name, num_classes, ratio, chunk)


def check_filtered(margin_name, num_classes, ratio=1.0, chunk=0, sub_centers=1,
                   threshold=FILTER_THRESHOLD, n=None, seed=0):
    """The head with `interclass_filtering_threshold` vs the float64 oracle (the rule written
    from arcface_torch's definition, restricted to the sampled classes), on data where every
    rank's (sampled) classes hold filtered entries, some targets are above the threshold (they
    must not be filtered) and the filter moves loss and gradients far beyond the tolerance.
    Returns errs on rank 0 ({key: (value, allowed)})."""
    from oracles import (ADAFACE_PUBLISHED, FILTER_GAP, AdaFaceOracle, class_cosines,
                         compare_oracle, filtered_mask, make_conflict_case, oracle_reference,
                         rel_err)
    from plsc.distributed import get_rank, get_world_size
    from plsc.loss import AdaFace

    rank, k = get_rank(), get_world_size()
    kk = int(sub_centers)
    x, y, w = make_conflict_case(seed=seed + num_classes + 3 * kk + 11 * k, n=n or k * B, d=D,
                                 num_classes=num_classes, threshold=threshold, sub_centers=kk,
                                 antiparallel=margin_name == "adaface")
    if margin_name == "adaface":
        margin = AdaFace(**ADAFACE_PUBLISHED)  # in training mode: statistics from this batch
    else:
        margin = margins()[margin_name]
    head, got, used, losses = run_head_step(margin, num_classes, x, y, w, ratio, chunk, kk,
                                            interclass_filtering_threshold=threshold)
    if rank != 0:
        return None
    q = None
    if margin_name == "adaface":
        margin = AdaFaceOracle(**ADAFACE_PUBLISHED).update(x)
        q = margin.q(x)
    remapped, w_used = restricted(used, y, w, kk)
    errs = compare_oracle(got, x, remapped, w_used, margin, kk, q, filter_threshold=threshold)
    errs["loss_same_on_all_ranks"] = (float(np.ptp(losses)), 0.0)
    # The data (float64, from the test's arrays): filtered entries on every rank's share of
    # the classes used (rank r owns [r·shard, min((r+1)·shard, C)), shard = ceil(C/k)), targets
    # above the threshold, no cosine near it.
    cos = class_cosines(x, w_used, kk)
    dirty = filtered_mask(x, remapped, w_used, threshold, kk)
    shard = -(-num_classes // k)
    per_rank = [int(dirty[:, (used >= r * shard) & (used < (r + 1) * shard)].sum())
                for r in range(k)]
    errs["ranks_without_filtered_entries"] = (float(sum(c == 0 for c in per_rank)), 0.0)
    above = int((cos[np.arange(len(y)), remapped] > threshold).sum())
    errs["no_target_above_threshold"] = (float(above == 0), 0.0)
    errs["cosines_near_threshold"] = (float((np.abs(cos - threshold) <= FILTER_GAP).sum()), 0.0)
    # The filter's effect on each result, against its tolerance: a head that did not filter
    # lands that far from the oracle, and so does one whose filtered entries pass gradient.
    ref = oracle_reference(x, remapped, w_used, margin, kk, q, filter_threshold=threshold)
    plain = oracle_reference(x, remapped, w_used, margin, kk, q)
    leaky = oracle_reference(x, remapped, w_used, margin, kk, q, filter_threshold=threshold,
                             filter_leaks=True)
    for name, other, keys in (("effect", plain, ("loss", "dx", "dw")),
                              ("leak", leaky, ("dx", "dw"))):
        for key in keys:
            effect = rel_err(other[key], ref[key])
            errs[f"tolerance_x{FILTER_EFFECT:g}_over_{name}_{key}"] = (
                FILTER_EFFECT * errs[key][1] / max(effect, 1e-300), 1.0)
    return errs
