"""Decode to RGB, resize, flip and normalise, against numpy formulas."""
import cv2
import numpy as np
import pytest

from plsc.data import DataError, FaceTransform, decode_image


def png_of_rgb(img_rgb):
    return cv2.imencode(".png", np.ascontiguousarray(img_rgb[:, :, ::-1]))[1].tobytes()  # OpenCV writes BGR


@pytest.fixture
def img():
    return np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)


def test_decode_gives_rgb(img):
    pure_red = np.zeros((4, 4, 3), np.uint8)
    pure_red[..., 0] = 255
    assert np.array_equal(decode_image(png_of_rgb(pure_red))[0, 0], [255, 0, 0])
    assert np.array_equal(decode_image(png_of_rgb(img)), img)


def test_default_normalisation(img):
    x = FaceTransform((6, 5))(png_of_rgb(img))
    assert x.shape == (3, 6, 5) and x.dtype == np.float32 and x.flags["C_CONTIGUOUS"]
    np.testing.assert_allclose(x, (img.transpose(2, 0, 1).astype(np.float64) - 127.5) / 127.5, atol=1e-6)


def test_per_channel_mean_std(img):
    mean, std = (120.0, 110.0, 100.0), (60.0, 50.0, 40.0)
    x = FaceTransform((6, 5), mean=mean, std=std)(png_of_rgb(img))
    want = (img.astype(np.float64) - mean) / std
    np.testing.assert_allclose(x, want.transpose(2, 0, 1), atol=1e-5)


def test_flip_only_in_training(img):
    buf = png_of_rgb(img)
    flipped = (img[:, ::-1].transpose(2, 0, 1).astype(np.float64) - 127.5) / 127.5
    np.testing.assert_allclose(FaceTransform((6, 5), train=True, flip_prob=1.0)(buf), flipped, atol=1e-6)
    plain = FaceTransform((6, 5), train=False, flip_prob=1.0)(buf)
    np.testing.assert_allclose(plain, flipped[:, :, ::-1], atol=1e-6)
    t = FaceTransform((6, 5), train=True, seed=3)
    flips = [not np.allclose(t(buf, i), plain) for i in range(200)]
    assert 60 < sum(flips) < 140
    # A function of (seed, epoch, index): repeatable, and different in another epoch.
    assert flips == [not np.allclose(t(buf, i), plain) for i in range(200)]
    t.set_epoch(1)
    assert flips != [not np.allclose(t(buf, i), plain) for i in range(200)]


def test_resize_to_configured_size():
    flat = np.full((30, 40, 3), (10, 200, 90), np.uint8)
    x = FaceTransform((16, 8))(png_of_rgb(flat))
    assert x.shape == (3, 16, 8)
    np.testing.assert_allclose(x[:, 5, 3], (np.array([10, 200, 90]) - 127.5) / 127.5, atol=1e-6)
    assert FaceTransform(20)(png_of_rgb(flat)).shape == (3, 20, 20)


def test_undecodable_bytes():
    with pytest.raises(DataError, match="cannot decode the image"):
        decode_image(b"\x00\x01 not an image")
    with pytest.raises(DataError, match="cannot decode the image"):
        decode_image(b"")


def test_uint8_output_normalised_on_the_device_equals_float_output(img):
    """The trainer's path (raw HWC uint8, normalised as a batch) gives the float32 path's values."""
    import paddle
    buf = png_of_rgb(img)
    for mean, std in ((127.5, 127.5), ((120.0, 110.0, 100.0), (60.0, 70.0, 80.0))):
        f = FaceTransform((6, 5), train=True, seed=2, mean=mean, std=std)
        u = FaceTransform((6, 5), train=True, seed=2, mean=mean, std=std, output="uint8")
        raw = np.stack([u(buf, i) for i in range(8)])
        assert raw.dtype == np.uint8 and raw.shape == (8, 6, 5, 3)
        got = u.normalize(paddle.to_tensor(raw)).numpy()
        want = np.stack([f(buf, i) for i in range(8)])
        np.testing.assert_allclose(got, want, atol=1e-6)
        expect0 = (img.transpose(2, 0, 1).astype(np.float64)
                   - np.reshape(mean, (-1, 1, 1))) / np.reshape(std, (-1, 1, 1))
        i = next(i for i in range(8) if not f.flips(i))
        np.testing.assert_allclose(got[i], expect0, atol=1e-5)
