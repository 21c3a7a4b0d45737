"""Five-point face alignment: the least-squares similarity from a face's landmarks to
ArcFace's 112x112 reference points, and the warp into an aligned crop."""
import cv2
import numpy as np

__all__ = ["ARCFACE_POINTS", "reference_points", "similarity_transform", "align_face"]

ARCFACE_POINTS = np.array([[38.2946, 51.6963], [73.5318, 51.5014], [56.0252, 71.7366],
                           [41.5493, 92.3655], [70.7299, 92.2041]], dtype=np.float64)
"""`[5, 2]` (x, y) of the left eye, right eye, nose tip and left and right mouth corner in
ArcFace's aligned 112x112 crop."""


def reference_points(image_size=(112, 112)):
    """ARCFACE_POINTS for an aligned crop of `image_size` (height, width): x scaled by
    width/112, y by height/112."""
    h, w = image_size
    return ARCFACE_POINTS * np.array([w / 112.0, h / 112.0])


def similarity_transform(src, dst):
    """The 2x3 matrix of the rotation + uniform scale + translation that maps the points
    `src` [K, 2] onto `dst` [K, 2] with the least sum of squared errors (no reflection).

    In complex numbers a similarity is w = c·z + t; the least-squares c is
    Σ (w_k − w̄)·conj(z_k − z̄) / Σ |z_k − z̄|² and t = w̄ − c·z̄ (Umeyama's solution
    in the plane).
    """
    src, dst = np.asarray(src, np.float64), np.asarray(dst, np.float64)
    if src.shape != dst.shape or src.ndim != 2 or src.shape[1] != 2 or len(src) < 2:
        raise ValueError(f"need two [K, 2] point arrays with K >= 2, got {src.shape} and {dst.shape}")
    z, w = src[:, 0] + 1j * src[:, 1], dst[:, 0] + 1j * dst[:, 1]
    zc, wc = z - z.mean(), w - w.mean()
    spread = float(np.sum(np.abs(zc) ** 2))
    if spread == 0.0:
        raise ValueError("the source points all coincide: no similarity is defined")
    c = np.sum(wc * np.conj(zc)) / spread
    t = w.mean() - c * z.mean()
    return np.array([[c.real, -c.imag, t.real], [c.imag, c.real, t.imag]])


def align_face(image, landmarks, image_size=(112, 112)):
    """The aligned crop (HWC, `image`'s dtype) of `image` whose five `landmarks` [5, 2]
    (x, y) are mapped onto `reference_points(image_size)`; bilinear, black outside."""
    h, w = image_size
    m = similarity_transform(np.asarray(landmarks, np.float64).reshape(5, 2), reference_points(image_size))
    return cv2.warpAffine(image, m, (int(w), int(h)), flags=cv2.INTER_LINEAR,
                          borderMode=cv2.BORDER_CONSTANT, borderValue=0)
