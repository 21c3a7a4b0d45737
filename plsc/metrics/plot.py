"""A ROC curve as a PNG, drawn with OpenCV (no plotting library needed)."""
import cv2
import numpy as np

__all__ = ["save_roc_png"]


def save_roc_png(curves, path, size=(640, 480)):
    """Plot TAR against FAR (log scale, 1e-4 … 1) for `curves` {label: (far, tar)} to `path`."""
    w, h = size
    left, right, top, bottom = 70, 20, 20, 50
    img = np.full((h, w, 3), 255, np.uint8)
    x0, x1, y0, y1 = left, w - right, h - bottom, top

    def px(far, tar):
        lf = (np.log10(np.clip(far, 1e-4, 1.0)) + 4.0) / 4.0
        return (x0 + lf * (x1 - x0)).astype(int), (y0 - np.asarray(tar) * (y0 - y1)).astype(int)

    for k in range(5):  # grid and FAR ticks 1e-4 .. 1
        x = x0 + k * (x1 - x0) // 4
        cv2.line(img, (x, y1), (x, y0), (225, 225, 225), 1)
        cv2.putText(img, f"1e-{4 - k}" if k < 4 else "1", (x - 15, y0 + 18), cv2.FONT_HERSHEY_SIMPLEX,
                    0.4, (0, 0, 0), 1)
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
    if not cv2.imwrite(path, img):
        raise OSError(f"could not write {path}")
    return path
