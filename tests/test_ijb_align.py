"""Five-point similarity alignment: the transform and the warped crop."""
import cv2
import numpy as np
import pytest

from plsc.data.align import ARCFACE_POINTS, align_face, reference_points, similarity_transform
from plsc.data.synthetic import make_prototype, make_template


def _similarity(angle_deg, scale, tx, ty):
    a = np.deg2rad(angle_deg)
    return np.array([[scale * np.cos(a), -scale * np.sin(a), tx], [scale * np.sin(a), scale * np.cos(a), ty]])


def _apply(m, pts):
    return pts @ m[:2, :2].T + m[:, 2]


def test_reference_points_scale_with_image_size():
    np.testing.assert_allclose(reference_points((112, 112)), ARCFACE_POINTS)
    np.testing.assert_allclose(reference_points((16, 16)), ARCFACE_POINTS * 16 / 112)
    np.testing.assert_allclose(reference_points((112, 96))[:, 0], ARCFACE_POINTS[:, 0] * 96 / 112)
    np.testing.assert_allclose(reference_points((112, 96))[:, 1], ARCFACE_POINTS[:, 1])


def test_exact_similarity_is_recovered():
    rng = np.random.default_rng(0)
    for _ in range(20):
        m = _similarity(rng.uniform(-180, 180), rng.uniform(0.2, 5), *rng.uniform(-100, 100, 2))
        src = rng.uniform(0, 250, (5, 2))
        np.testing.assert_allclose(similarity_transform(src, _apply(m, src)), m, atol=1e-9)


def test_noisy_points_give_the_least_squares_similarity():
    """Oracle: linear least squares over (a, b, tx, ty) of x' = a x − b y + tx, y' = b x + a y + ty."""
    rng = np.random.default_rng(1)
    for _ in range(20):
        src = rng.uniform(0, 100, (5, 2))
        dst = rng.uniform(0, 100, (5, 2))
        rows = []
        for (x, y) in src:
            rows += [[x, -y, 1, 0], [y, x, 0, 1]]
        (a, b, tx, ty), *_ = np.linalg.lstsq(np.array(rows), dst.reshape(-1), rcond=None)
        m = similarity_transform(src, dst)
        np.testing.assert_allclose(m, [[a, -b, tx], [b, a, ty]], atol=1e-9)
        assert np.linalg.det(m[:, :2]) >= 0  # never a reflection


def test_mirrored_points_are_not_matched_by_a_reflection():
    src = ARCFACE_POINTS
    dst = src * [-1, 1]
    assert np.linalg.det(similarity_transform(src, dst)[:, :2]) >= 0


def test_bad_points_raise():
    with pytest.raises(ValueError, match="coincide"):
        similarity_transform(np.ones((5, 2)), ARCFACE_POINTS)
    with pytest.raises(ValueError, match=r"\[K, 2\]"):
        similarity_transform(np.ones((5, 3)), np.ones((5, 3)))


def test_align_recovers_the_template_crop():
    """A 112x112 face warped into a 250x250 loose crop by a known similarity, its landmarks
    moved alike: aligning the crop gives back the face away from its borders."""
    rng = np.random.default_rng(2)
    face = np.clip(make_prototype(rng, 112, make_template(rng, 112)), 0, 255).astype(np.uint8)
    for angle, scale, offset in ((20.0, 1.5, (-20, 10)), (-35.0, 2.0, (5, -8)), (5.0, 0.9, (30, 25))):
        m = _similarity(angle, scale, 0, 0)
        m[:, 2] = np.array([125.0, 125.0]) + offset - m[:, :2] @ [56.0, 56.0]  # face centre placed
        crop = cv2.warpAffine(face, m, (250, 250), flags=cv2.INTER_LINEAR)
        landmarks = _apply(m, ARCFACE_POINTS)
        aligned = align_face(crop, landmarks, (112, 112))
        assert aligned.shape == (112, 112, 3) and aligned.dtype == np.uint8
        err = np.abs(aligned[12:100, 12:100].astype(float) - face[12:100, 12:100])
        assert err.mean() < 0.6 and np.percentile(err, 99) <= 3, (angle, err.mean())
        # 16x16: the reference points scaled by 16/112, i.e. the face scaled by 16/112
        small = align_face(crop, landmarks, (16, 16))
        expect = cv2.warpAffine(face, np.array([[16 / 112, 0, 0], [0, 16 / 112, 0]]), (16, 16))
        assert np.abs(small[3:13, 3:13].astype(float) - expect[3:13, 3:13]).mean() < 1.0
