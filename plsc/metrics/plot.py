"""Plots drawn with OpenCV (no plotting library needed), as an image array or a PNG: ROC
curves, and the histogram of angles of sub-centre cleaning."""
import math

import cv2
import numpy as np

from ..fileio import write_image

__all__ = ["roc_image", "save_roc_png", "angle_histogram_image", "save_angle_histogram_png",
           "curve_image", "save_curve_png"]


def _draw(curves, size, far_min):
    """The plot as a BGR uint8 image: TAR against FAR on a log scale from `far_min` to 1."""
    w, h = size
    decades = max(int(round(-math.log10(far_min))), 1)
    left, right, top, bottom = 70, 20, 20, 50
    img = np.full((h, w, 3), 255, np.uint8)
    x0, x1, y0, y1 = left, w - right, h - bottom, top

    def px(far, tar):
        lf = (np.log10(np.clip(far, 10.0 ** -decades, 1.0)) + decades) / decades
        return (x0 + lf * (x1 - x0)).astype(int), (y0 - np.asarray(tar) * (y0 - y1)).astype(int)

    for k in range(decades + 1):  # grid and FAR ticks 1e-decades .. 1
        x = x0 + k * (x1 - x0) // decades
        cv2.line(img, (x, y1), (x, y0), (225, 225, 225), 1)
        cv2.putText(img, f"1e-{decades - k}" if k < decades else "1", (x - 15, y0 + 18),
                    cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    for k in range(6):  # TAR ticks 0 .. 1
        y = y0 - k * (y0 - y1) // 5
        cv2.line(img, (x0, y), (x1, y), (225, 225, 225), 1)
        cv2.putText(img, f"{k / 5:.1f}", (x0 - 35, y + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    cv2.rectangle(img, (x0, y1), (x1, y0), (0, 0, 0), 1)
    cv2.putText(img, "false accept rate", (w // 2 - 60, h - 10), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    cv2.putText(img, "TAR", (8, h // 2), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    colours = [(200, 80, 0), (0, 140, 0), (0, 0, 200), (160, 0, 160), (0, 140, 160)]
    for i, (label, (far, tar)) in enumerate(curves.items()):
        xs, ys = px(np.asarray(far), np.asarray(tar))
        colour = colours[i % len(colours)]
        cv2.polylines(img, [np.stack([xs, ys], 1).reshape(-1, 1, 2)], False, colour, 2)
        cv2.putText(img, str(label), (x0 + 10, y1 + 20 + 18 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.5, colour, 1)
    return img


def roc_image(curves, size=(640, 480), far_min=1e-4):
    """TAR against FAR (log scale, `far_min` … 1) for `curves` {label: (far, tar)} as an
    HWC uint8 RGB array (e.g. for VisualDL's add_image)."""
    return np.ascontiguousarray(_draw(curves, size, far_min)[:, :, ::-1])


def save_roc_png(curves, path, size=(640, 480), far_min=1e-4):
    """Plot TAR against FAR (log scale, `far_min` … 1) for `curves` {label: (far, tar)} to `path`."""
    write_image(path, _draw(curves, size, far_min))
    return path


def _draw_angle_histogram(angles, kept, threshold, bin_degrees, size, title):
    """The histogram of `angles` (degrees, 0..180) as a BGR image: kept samples' bars green,
    dropped ones red, the threshold a vertical line."""
    w, h = size
    left, right, top, bottom = 70, 20, 40, 50
    img = np.full((h, w, 3), 255, np.uint8)
    x0, x1, y0, y1 = left, w - right, h - bottom, top
    edges = np.arange(0.0, 180.0 + bin_degrees, bin_degrees)
    keep_counts = np.histogram(angles[kept], edges)[0]
    drop_counts = np.histogram(angles[~kept], edges)[0]
    top_count = max(1, int((keep_counts + drop_counts).max()))

    def px(deg):
        return int(round(x0 + deg / 180.0 * (x1 - x0)))

    def py(count):
        return int(round(y0 - count / top_count * (y0 - y1)))

    for deg in range(0, 181, 30):
        cv2.line(img, (px(deg), y1), (px(deg), y0), (225, 225, 225), 1)
        cv2.putText(img, str(deg), (px(deg) - 10, y0 + 18), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    for f in range(5):
        c = top_count * f / 4
        cv2.putText(img, f"{c:.0f}", (x0 - 45, py(c) + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    for i in range(len(edges) - 1):
        a, b = px(edges[i]) + 1, px(edges[i + 1]) - 1
        if keep_counts[i]:  # BGR
            cv2.rectangle(img, (a, py(keep_counts[i])), (b, y0), (60, 160, 60), -1)
        if drop_counts[i]:
            cv2.rectangle(img, (a, py(keep_counts[i] + drop_counts[i])), (b, py(keep_counts[i])),
                          (60, 60, 200), -1)
    cv2.rectangle(img, (x0, y1), (x1, y0), (0, 0, 0), 1)
    cv2.line(img, (px(threshold), y1), (px(threshold), y0), (0, 0, 220), 2)
    cv2.putText(img, f"threshold {threshold:g} deg", (min(px(threshold) + 5, x1 - 140), y1 + 15),
                cv2.FONT_HERSHEY_SIMPLEX, 0.45, (0, 0, 220), 1)
    cv2.putText(img, "angle to the class's dominant centre (degrees)", (w // 2 - 170, h - 12),
                cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    cv2.putText(img, title, (x0, 25), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    return img


def angle_histogram_image(angles, kept, threshold, bin_degrees=2.0, size=(720, 420), title=""):
    """The histogram of `angles` (degrees; `kept` a bool mask, `threshold` marked) as an HWC
    uint8 RGB array (e.g. for VisualDL's add_image)."""
    img = _draw_angle_histogram(angles, kept, threshold, bin_degrees, size, title)
    return np.ascontiguousarray(img[:, :, ::-1])


def save_angle_histogram_png(angles, kept, threshold, path, bin_degrees=2.0, size=(720, 420),
                             title=""):
    """`angle_histogram_image` written to the PNG `path`."""
    write_image(path, _draw_angle_histogram(angles, kept, threshold, bin_degrees, size, title))
    return path


def _draw_curves(curves, x_label, y_label, log_x, size):
    """y (0..1) against x (log10 scale when `log_x`) for `curves` {label: (x, y)}, as BGR."""
    w, h = size
    left, right, top, bottom = 70, 20, 20, 50
    img = np.full((h, w, 3), 255, np.uint8)
    x0, x1, y0, y1 = left, w - right, h - bottom, top
    xs = np.concatenate([np.asarray(x, np.float64) for x, _ in curves.values()])
    tx = np.log10 if log_x else (lambda v: np.asarray(v, np.float64))
    lo, hi = float(tx(xs.min())), float(tx(xs.max()))
    hi = hi if hi > lo else lo + 1

    def px(x, y):
        fx = (tx(np.asarray(x, np.float64)) - lo) / (hi - lo)
        return (x0 + fx * (x1 - x0)).astype(int), (y0 - np.asarray(y) * (y0 - y1)).astype(int)

    ticks = np.unique(np.round(np.linspace(lo, hi, 6), 6))
    for t in ticks:
        x = int(x0 + (t - lo) / (hi - lo) * (x1 - x0))
        cv2.line(img, (x, y1), (x, y0), (225, 225, 225), 1)
        label = f"1e{int(round(t))}" if log_x and abs(t - round(t)) < 1e-6 else (f"{10 ** t:.3g}" if log_x else f"{t:g}")
        cv2.putText(img, label, (x - 15, y0 + 18), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    for k in range(6):
        y = y0 - k * (y0 - y1) // 5
        cv2.line(img, (x0, y), (x1, y), (225, 225, 225), 1)
        cv2.putText(img, f"{k / 5:.1f}", (x0 - 35, y + 4), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0), 1)
    cv2.rectangle(img, (x0, y1), (x1, y0), (0, 0, 0), 1)
    cv2.putText(img, x_label, (w // 2 - 80, h - 10), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    cv2.putText(img, y_label, (8, h // 2), cv2.FONT_HERSHEY_SIMPLEX, 0.5, (0, 0, 0), 1)
    colours = [(200, 80, 0), (0, 140, 0), (0, 0, 200), (160, 0, 160), (0, 140, 160)]
    for i, (label, (x, y)) in enumerate(curves.items()):
        a, b = px(x, y)
        colour = colours[i % len(colours)]
        cv2.polylines(img, [np.stack([a, b], 1).reshape(-1, 1, 2)], False, colour, 2)
        for u, v in zip(a, b):
            cv2.circle(img, (int(u), int(v)), 3, colour, -1)
        cv2.putText(img, str(label), (x0 + 10, y1 + 20 + 18 * i), cv2.FONT_HERSHEY_SIMPLEX, 0.5, colour, 1)
    return img


def curve_image(curves, x_label, y_label, log_x=False, size=(640, 480)):
    """y (0..1) against x for `curves` {label: (x, y)} as an HWC uint8 RGB array (e.g. a CMC, or
    rank-1 identification against the distractor count with `log_x`)."""
    return np.ascontiguousarray(_draw_curves(curves, x_label, y_label, log_x, size)[:, :, ::-1])


def save_curve_png(curves, path, x_label, y_label, log_x=False, size=(640, 480)):
    """`curve_image` written to the PNG `path` (through plsc.fileio)."""
    write_image(path, _draw_curves(curves, x_label, y_label, log_x, size), ext=".png")
    return path
